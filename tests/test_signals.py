"""Signals during reads and writes: nothing is lost, handlers run, Ctrl-C interrupts a blocked
read and the stream stays usable, and a deadline is not restarted by interruptions.

Real signals (interval timers, ``kill`` from another process) against real pipes, for both cores.
No assertion is about elapsed time.
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import subprocess
import sys
import threading

import pytest
from _fault_children import (
    MIB,
    WAIT,
    LineReader,
    flood,
    proc_state,
    unread,
    write_in_thread,
)
from _helpers import child_env, header, payload, running, wait_until, write_all

from framepipe import ReadTimeout

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux processes and signals")

SIZES = [1, 7, 100, 4096, 65_535, 65_536, 200_000, MIB, 3 * MIB + 5]


class AlarmCounter:
    """A Python SIGALRM handler counting its calls, driven by an interval timer."""

    def __init__(self, interval: float) -> None:
        self.calls = 0
        self.interval = interval

    def handler(self, signum, frame) -> None:
        self.calls += 1

    def __enter__(self):
        self.previous = signal.signal(signal.SIGALRM, self.handler)
        signal.setitimer(signal.ITIMER_REAL, self.interval, self.interval)
        return self

    def __exit__(self, *exc: object) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
        signal.signal(signal.SIGALRM, self.previous)


# -- 7. a signal every 100 us during a 64 MiB transfer ---------------------------------------


def test_signal_storm_during_64_mib_transfer_loses_nothing(impl):
    total = 64 * MIB
    r, w = impl.pipe(False)
    with running("fork", flood, w, total, SIZES, 0.0001) as proc:
        w.close()
        r.watch(proc)
        digest = hashlib.sha256()
        received = frames = 0
        with AlarmCounter(0.0001) as alarms:
            while received < total:
                if frames % 3 == 2:
                    data = r.recv(timeout=WAIT)
                elif frames % 3 == 1:
                    buf = bytearray(SIZES[frames % len(SIZES)] + 3)
                    data = buf[: r.recv_bytes_into(buf, timeout=WAIT)]
                else:
                    data = r.recv_bytes(timeout=WAIT)
                digest.update(struct.pack("Q", len(data)))
                digest.update(data)
                received += len(data)
                frames += 1
            done = r.recv(timeout=WAIT)
        assert done[0] == "done"
        assert received == total
        assert (done[1], done[2]) == (digest.hexdigest(), frames)
        # The storm really happened on both sides.
        assert alarms.calls >= 10, f"the reader's handler ran only {alarms.calls} times"
        assert done[3] >= 10, f"the writer's handler ran only {done[3]} times"
        proc.join(WAIT)
        assert proc.exitcode == 0
    r.close()


def test_signals_do_not_restart_the_deadline(impl):
    # A signal every 10 ms interrupts the wait; a read that restarted its full timeout after
    # each interruption would never time out. The writer thread sends a frame after 100
    # interruptions, so such a build fails on the result instead of hanging.
    r, w = impl.pipe(False)
    late = threading.Event()
    try:
        with AlarmCounter(0.01) as alarms:

            def send_late() -> None:
                wait_until(lambda: alarms.calls >= 100 or late.is_set(), "interruptions")
                if not late.is_set():
                    w.send_bytes(b"too late")

            thread = threading.Thread(target=send_late, daemon=True)
            thread.start()
            with pytest.raises(ReadTimeout):
                r.recv_bytes(timeout=0.3)
            calls = alarms.calls
            late.set()
            thread.join(WAIT)
        assert calls >= 2, "no signal interrupted the read: the test proved nothing"
    finally:
        r.close()
        w.close()


class Interrupted(Exception):
    pass


@pytest.mark.parametrize("where", ["boundary", "mid-frame"])
def test_exception_from_a_signal_handler_leaves_the_stream_usable(impl, where):
    # A handler raises while the read is blocked: the exception propagates, and the bytes that
    # had arrived stay with the connection.
    data = payload(300_000)
    frame = header(len(data)) + data
    split = 0 if where == "boundary" else len(frame) // 2
    r, w = impl.pipe(False)

    def handler(signum, _frame):
        raise Interrupted

    previous = signal.signal(signal.SIGALRM, handler)
    try:
        writer = write_in_thread(w.fileno(), frame[:split])
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        with pytest.raises(Interrupted):
            r.recv_bytes(timeout=WAIT)
        signal.setitimer(signal.ITIMER_REAL, 0)
        writer.join(WAIT)
        writer = write_in_thread(w.fileno(), frame[split:] + frame)
        assert r.recv_bytes(timeout=WAIT) == data
        assert r.recv_bytes(timeout=WAIT) == data
        writer.join(WAIT)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        r.close()
        w.close()


# -- 8. Ctrl-C from another process -----------------------------------------------------------

READER = """
import hashlib, signal, sys
from framepipe import _impl
# A test runner started in the background (nohup, &) leaves SIGINT ignored, and a child
# inherits that: restore Python's own handler, as an interactive program would have it.
signal.signal(signal.SIGINT, signal.default_int_handler)
conn = _impl.load(sys.argv[1]).Connection(int(sys.argv[2]), writable=False)
try:
    print("ready", flush=True)
    data = conn.recv_bytes(timeout=60)
    print("no interrupt", len(data), flush=True)
except KeyboardInterrupt:
    print("KeyboardInterrupt", flush=True)
for _ in range(2):
    data = conn.recv_bytes(timeout=60)
    print(len(data), hashlib.sha256(data).hexdigest(), flush=True)
"""


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.parametrize("where", ["boundary", "mid-frame"])
@pytest.mark.parametrize("inherited", ["default", "ignored"])
def test_sigint_interrupts_a_blocked_read_in_another_process(impl, where, inherited):
    # "ignored": the child starts as under a test runner in the background (SIGINT ignored).
    data = payload(200_000)
    frame = header(len(data)) + data
    split = 0 if where == "boundary" else len(frame) // 2
    rfd, wfd = os.pipe()
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, impl.ENGINE, str(rfd)],
        pass_fds=[rfd],
        stdout=subprocess.PIPE,
        env=child_env(),
        preexec_fn=_ignore_sigint if inherited == "ignored" else None,
    )
    os.close(rfd)
    try:
        out = LineReader(proc.stdout)
        assert out.readline() == "ready"
        write_all(wfd, frame[:split])
        # The reader has taken the first part (the pipe is empty) and sleeps in its read.
        wait_until(lambda: unread(wfd) == 0, "the reader to drain the pipe")
        wait_until(lambda: proc_state(proc.pid) == "S", "the reader to block")
        os.kill(proc.pid, signal.SIGINT)
        assert out.readline() == "KeyboardInterrupt"
        writer = write_in_thread(wfd, frame[split:] + header(5) + b"after")
        expected = hashlib.sha256(data).hexdigest()
        assert out.readline() == f"{len(data)} {expected}"
        assert out.readline() == f"5 {hashlib.sha256(b'after').hexdigest()}"
        writer.join(WAIT)
        assert proc.wait(WAIT) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait(WAIT)
        proc.stdout.close()
        os.close(wfd)
