"""Reads that never hang: deadlines over whole frames, and writers that die, stop or lie.

Real processes, real pipes, real signals, for both cores and every multiprocessing start method
where it matters. No assertion is about elapsed time: every wait is bounded only so that a
broken build fails instead of hanging.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection as mpc
import os
import pickle
import select
import signal
import subprocess
import sys
import threading
import time

import pytest
from _fault_children import (
    MIB,
    WAIT,
    block_until_killed,
    do_nothing,
    echo,
    kill_and_wait_dead,
    proc_stat,
    proc_state,
    send_then_die,
    small_then_big,
    stop_mid_frame,
    unread,
    wire,
    write_in_thread,
)
from _helpers import (
    START_METHODS,
    at_pid,
    child_env,
    header,
    payload,
    reaped,
    running,
    wait_until,
    write_all,
)

import framepipe.connection as fpc
from framepipe import ReadTimeout, WriterDied
from framepipe._wire import PAD_MIN
from framepipe.watch import Liveness, dead_status_word

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux processes and signals")

SHORT = 0.3  # a timeout meant to expire
NOT_REAPED = os.WEXITED | os.WNOHANG | os.WNOWAIT


def read_with(conn, how: str, size: int, timeout: float):
    """Read one message from ``conn`` the way ``how`` says; returns its bytes (for ``recv``,
    the object)."""
    if how == "recv_bytes":
        return conn.recv_bytes(timeout=timeout)
    if how == "recv":
        return conn.recv(timeout=timeout)
    buf = bytearray(size + 5)
    n = conn.recv_bytes_into(buf, timeout=timeout)
    return bytes(buf[:n])


# -- 1. deadlines ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["recv_bytes", "recv_bytes_into", "recv"])
def test_deadline_covers_the_whole_frame_while_bytes_keep_arriving(impl, how):
    # A writer trickles one byte every 5 ms. A timeout restarted by each arriving byte would
    # never expire; the deadline is for the whole frame, so the read must give up.
    obj = {"trickled": payload(3000)}
    body = pickle.dumps(obj, protocol=5)
    data = header(len(body)) + body
    expected = obj if how == "recv" else body
    r, w = impl.pipe(False)
    stop = threading.Event()
    written = [0]

    def trickle() -> None:
        # One byte at a time for at most 5 s (then the rest at once, so a broken build fails
        # with a wrong result instead of hanging), or until the test says stop.
        while written[0] < len(data) - 1 and not stop.wait(0.005):
            os.write(w.fileno(), data[written[0] : written[0] + 1])
            written[0] += 1
            if written[0] > 1000:
                break
        write_all(w.fileno(), data[written[0] :])

    first = os.write(w.fileno(), data[:1])
    written[0] = first
    thread = threading.Thread(target=trickle, daemon=True)
    thread.start()
    try:
        before = written[0]
        with pytest.raises(ReadTimeout) as info:
            read_with(r, how, len(body), SHORT)
        after = written[0]
        assert info.value.sentinel is False
        assert isinstance(info.value, TimeoutError)
        assert after > before, "no byte arrived during the read: the test proved nothing"
        assert after < len(data), "the whole frame arrived before the read gave up"
    finally:
        stop.set()
        thread.join(WAIT)
    # Nothing was lost: the bytes read before the deadline are part of the next result.
    assert read_with(r, how, len(body), WAIT) == expected
    r.close()
    w.close()


def _messages(impl):
    small = payload(100)
    large = payload(300_000)
    return {
        "small-bytes": (wire(impl, data=small), small, "recv_bytes"),
        "large-bytes": (wire(impl, data=large), large, "recv_bytes"),
        "large-into": (wire(impl, data=large), large, "recv_bytes_into"),
        "small-object": (wire(impl, {"k": small}), {"k": small}, "recv"),
        "large-object": (wire(impl, [large, 7]), [large, 7], "recv"),
    }


@pytest.mark.parametrize(
    "kind", ["small-bytes", "large-bytes", "large-into", "small-object", "large-object"]
)
@pytest.mark.parametrize("where", ["in-header", "middle", "last-byte"])
def test_timed_out_read_loses_nothing(impl, kind, where):
    data, expected, how = _messages(impl)[kind]
    split = {"in-header": 5, "middle": len(data) // 2, "last-byte": len(data) - 1}[where]
    size = len(expected) if isinstance(expected, bytes) else 0
    r, w = impl.pipe(False)
    try:
        writer = write_in_thread(w.fileno(), data[:split])
        # Reads time out while the first part arrives (however small the pipe), and once more
        # after all of it is in: each timeout keeps what it read.
        while True:
            done = not writer.is_alive()
            with pytest.raises(ReadTimeout):
                read_with(r, how, size, 0.05)
            if done:
                break
        writer = write_in_thread(w.fileno(), data[split:] + data)
        assert read_with(r, how, size, WAIT) == expected
        assert read_with(r, how, size, WAIT) == expected  # and the stream is still in sync
        writer.join(WAIT)
        assert not r.poll(0)
    finally:
        r.close()
        w.close()


def test_timed_out_recv_bytes_into_does_not_keep_the_callers_buffer(impl):
    # The first read times out with half a frame in the caller's buffer; the next read, into
    # another buffer, must return the whole frame there.
    data = payload(500_000)
    frame = header(len(data)) + data
    r, w = impl.pipe(False)
    try:
        writer = write_in_thread(w.fileno(), frame[: len(frame) // 2])
        first = bytearray(len(data))
        while True:
            done = not writer.is_alive()
            with pytest.raises(ReadTimeout):
                r.recv_bytes_into(first, timeout=0.05)
            if done:
                break
        assert first != bytes(len(data)), "no byte reached the first buffer"
        writer = write_in_thread(w.fileno(), frame[len(frame) // 2 :])
        second = bytearray(len(data))
        assert r.recv_bytes_into(second, timeout=WAIT) == len(data)
        writer.join(WAIT)
        assert second == data
    finally:
        r.close()
        w.close()


def test_pipe_timeout_callback_runs_before_read_timeout(impl):
    calls = []
    with impl.Pipe(timeout=SHORT, timeout_callback=lambda: calls.append("called")) as p:
        with pytest.raises(ReadTimeout):
            p.read()
        assert calls == ["called"]
        with pytest.raises(ReadTimeout):
            p.read(timeout=0.05)  # an explicit timeout also calls it
        assert calls == ["called", "called"]
        p.write(b"after the timeouts")
        assert p.read() == b"after the timeouts"
        assert calls == ["called", "called"]


def test_pipe_timeout_callback_runs_first_and_may_raise(impl):
    # The callback runs before ReadTimeout is raised: an exception it raises is what the
    # caller sees, with the timeout as its context.
    class Cleanup(Exception):
        pass

    def callback():
        raise Cleanup("cleaned up")

    with impl.Pipe(timeout=SHORT, timeout_callback=callback) as p:
        with pytest.raises(Cleanup) as info:
            p.read()
        assert isinstance(info.value.__context__, ReadTimeout)


def test_poll_false_then_true(impl):
    r, w = impl.pipe(False)
    try:
        assert r.poll() is False
        assert r.poll(SHORT) is False
        thread = write_in_thread(w.fileno(), header(3) + b"abc")
        assert r.poll(WAIT) is True
        thread.join(WAIT)
        assert r.recv_bytes(timeout=WAIT) == b"abc"
        assert r.poll(0.05) is False
    finally:
        r.close()
        w.close()


# -- 2. a writer killed in the middle of a frame --------------------------------------------


@pytest.mark.parametrize("method", START_METHODS)
def test_sigkill_in_the_middle_of_a_16_mib_frame(impl, method):
    r, w = impl.pipe(False)
    with running(method, small_then_big, w, 3, 16 * MIB) as proc:
        w.close()
        r.watch(proc)
        for i in range(3):  # frames written before the death come first
            assert r.recv_bytes(timeout=WAIT) == payload(10 + i, i)
        assert r.poll(WAIT)  # the big frame has begun
        # Its payload goes to the bulk socket: kill the child only once it sleeps there,
        # blocked on a full buffer, so it cannot finish the frame while we read.
        bulk = r._handles()[2]
        wait_until(lambda: proc_state(proc.pid) == "S" and unread(bulk) > 0, "the writer blocks")
        kill_and_wait_dead(proc.pid)  # else the frame may still arrive whole
        with pytest.raises(WriterDied) as info:
            r.recv_bytes(timeout=WAIT)
        err = info.value
        assert type(err) is WriterDied
        assert err.pid == proc.pid
        assert err.exitcode == -signal.SIGKILL
        assert err.signal_name == "SIGKILL"
        assert err.core_dumped is False
        assert err.expected_bytes == 16 * MIB + 12
        assert 0 < err.lost_bytes < err.expected_bytes
        proc.join(WAIT)
        assert proc.exitcode == -signal.SIGKILL
    r.close()


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("how", [("signal", signal.SIGKILL), ("exit", 3)], ids=["sigkill", "exit3"])
def test_frames_written_before_death_are_delivered_first(impl, method, how):
    sizes = [1, 2000, 30_000]
    r, w = impl.pipe(False)
    with running(method, send_then_die, w, sizes, how) as proc:
        w.close()
        r.watch(proc)
        # Read nothing until the writer is dead (its sentinel fires at exit, no reaping).
        assert mpc.wait([proc.sentinel], WAIT) == [proc.sentinel]
        for n in sizes:
            assert r.recv_bytes(timeout=WAIT) == payload(n)
        with pytest.raises(WriterDied) as info:
            r.recv_bytes(timeout=WAIT)
        code = -how[1] if how[0] == "signal" else how[1]
        assert info.value.exitcode == code
        assert info.value.lost_bytes == 0
        proc.join(WAIT)
        assert proc.exitcode == code
    r.close()


@pytest.mark.parametrize("concurrent_join", [False, True], ids=["read-then-join", "join-meanwhile"])
def test_forkserver_exit_codes_survive_many_deaths(impl, concurrent_join):
    # Twenty forkserver workers exit with twenty different codes. The reader, framepipe's
    # watcher thread and (with join-meanwhile) a thread joining the workers all ask for the
    # exit status at about the same time: every one must report the true code, and so must
    # each Process afterwards.
    ctx = multiprocessing.get_context("forkserver")
    workers = []
    try:
        for code in range(1, 21):
            r, w = impl.pipe(False)
            proc = ctx.Process(target=send_then_die, args=(w, [code], ("exit", code)), daemon=True)
            proc.start()
            w.close()
            r.watch(proc)
            workers.append((code, proc, r))
        joiner = None
        if concurrent_join:
            joiner = threading.Thread(target=lambda: [p.join(WAIT) for _, p, _ in workers])
            joiner.start()
        seen = {}
        for code, _, r in workers:
            assert r.recv_bytes(timeout=WAIT) == payload(code)
            with pytest.raises(WriterDied) as info:
                r.recv_bytes(timeout=WAIT)
            seen[code] = info.value.exitcode
        if joiner is not None:
            joiner.join(WAIT)
        for _, proc, _ in workers:
            proc.join(WAIT)
        assert seen == {code: code for code, _, _ in workers}
        assert {code: proc.exitcode for code, proc, _ in workers} == seen
    finally:
        for _, proc, r in workers:
            if proc.exitcode is None:
                proc.kill()
                proc.join(WAIT)
            r.close()


# -- 3. a stopped writer ---------------------------------------------------------------------


@pytest.mark.parametrize("size", [1000, 40_000])
def test_stopped_writer_times_out_then_continues(impl, size):
    r, w = impl.pipe(False)
    with running("fork", stop_mid_frame, w, size) as proc:
        w.close()
        r.watch(proc)
        wait_until(lambda: proc_state(proc.pid) == "T", "the writer to stop itself")
        with pytest.raises(ReadTimeout):  # stopped is not dead
            r.recv_bytes(timeout=SHORT)
        with pytest.raises(ReadTimeout):
            r.recv(timeout=0.05)
        os.kill(proc.pid, signal.SIGCONT)
        assert r.recv_bytes(timeout=WAIT) == payload(size)
        with pytest.raises(WriterDied) as info:  # then it returns: exit code 0
            r.recv_bytes(timeout=WAIT)
        assert info.value.exitcode == 0
        proc.join(WAIT)
        assert proc.exitcode == 0
    r.close()


# -- 4./5. exit 0 without writing, and a parent that still holds the write end -------------


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("hold", [False, True], ids=["closed", "parent-holds-writer"])
def test_exit_0_without_writing_is_writer_died(impl, method, hold):
    r, w = impl.pipe(False)
    with running(method, do_nothing, w) as proc:
        if not hold:
            w.close()
        r.watch(proc)
        with pytest.raises(WriterDied) as info:
            r.recv_bytes(timeout=WAIT)
        err = info.value
        assert type(err) is WriterDied
        assert isinstance(err, EOFError) and isinstance(err, OSError)
        assert err.exitcode == 0
        assert err.signal_name is None
        assert err.lost_bytes == 0
        assert err.pid == proc.pid
        with pytest.raises(WriterDied):  # and it stays that way: no hang on a second read
            r.recv(timeout=WAIT)
        proc.join(WAIT)
        assert proc.exitcode == 0
    r.close()
    w.close()


def _close_then_exit_0(w, linger: float) -> None:
    """A clean exit at a frame boundary: the last frame, the write end closed (as an
    interpreter's shutdown closes it), then ``linger`` seconds until the process ends."""
    w.send_bytes(b"last")
    w.close()
    time.sleep(linger)


# How long a writer's exit may take after its end of the pipe closed: an interpreter shutting
# down takes from nothing to a few hundred ms on a loaded machine. Each value runs several
# times; the reader must always hear the same thing.
LINGERS = [0.0, 0.002, 0.02, 0.08, 0.15, 0.3] * 4


@pytest.mark.parametrize("how", ["untimed", "timed", "short-timeouts", "async", "wait"])
def test_a_clean_exit_at_a_frame_boundary_is_always_writer_died(impl, how):
    # The reader sees end of file first (the closed write end) and the death after it; the
    # race between the two must not decide the error: a watched writer that exits with code
    # 0 is WriterDied (also an EOFError, what the stdlib raises; subprocess_rpc's callers
    # route a code 0 through their timeout path), never a bare EOFError.
    import asyncio

    seen = []
    for linger in LINGERS:
        r, w = impl.pipe(False)
        with running("fork", _close_then_exit_0, w, linger) as proc:
            w.close()
            r.watch(proc)
            assert r.recv_bytes(timeout=WAIT) == b"last"
            try:
                if how == "untimed":
                    r.recv_bytes()
                elif how == "timed":
                    r.recv_bytes(timeout=WAIT)
                elif how == "short-timeouts":  # a deadline inside the writer's exit decides
                    deadline = time.monotonic() + WAIT  # nothing: the next read goes on
                    while time.monotonic() < deadline:
                        try:
                            r.recv_bytes(timeout=0.01)
                        except ReadTimeout:
                            continue
                elif how == "async":
                    asyncio.run(asyncio.wait_for(r.recv_bytes_async(), WAIT))
                else:  # framepipe's wait(), then a read that must not block
                    deadline = time.monotonic() + WAIT
                    while time.monotonic() < deadline:
                        assert fpc.wait([r], WAIT) == [r]
                        try:
                            r.recv_bytes(timeout=0)
                        except ReadTimeout:
                            continue
                seen.append(("data", linger))
            except WriterDied as exc:
                seen.append(("WriterDied", exc.exitcode))
            except EOFError:
                seen.append(("EOFError", linger))
            proc.join(WAIT)
        r.close()
    assert seen == [("WriterDied", 0)] * len(LINGERS)


def _close_then_live(w, seconds: float) -> None:
    w.close()
    time.sleep(seconds)


def test_a_watched_writer_that_closes_and_lives_on_is_end_of_file(impl):
    # End of file with the writer alive: after a grace for its exit to show, EOFError, as
    # the stdlib says; the read never waits for a death that does not come.
    r, w = impl.pipe(False)
    with running("fork", _close_then_live, w, 3 * WAIT) as proc:
        w.close()
        r.watch(proc)
        started = time.monotonic()
        with pytest.raises(EOFError) as info:
            r.recv_bytes()
        assert type(info.value) is EOFError
        assert time.monotonic() - started < 10  # the grace is a second: a hang guard only
        assert proc.is_alive()
        with pytest.raises(EOFError):  # and at once from then on
            r.recv_bytes(timeout=0)
    r.close()


def _wait_with(waiter: str, conn, timeout: float) -> bool:
    """Whether ``waiter`` reports ``conn`` ready within ``timeout`` seconds."""
    if waiter == "multiprocessing.wait":
        return mpc.wait([conn], timeout=timeout) == [conn]
    if waiter == "framepipe.wait":
        return fpc.wait([conn], timeout=timeout) == [conn]
    if waiter == "select":
        return select.select([conn.fileno()], [], [], timeout)[0] == [conn.fileno()]
    return conn.poll(timeout) is True


WAITERS = ["multiprocessing.wait", "framepipe.wait", "select", "poll"]


@pytest.mark.parametrize("waiter", WAITERS)
def test_waiters_wake_up_when_the_writer_dies(impl, waiter):
    # The parent holds the write end, so no end of file ever comes (the stdlib hangs here):
    # the watcher's DEAD sentinel is what wakes a thread blocked on the fd.
    r, w = impl.pipe(False)
    with running("fork", do_nothing, w) as proc:
        r.watch(proc)
        assert _wait_with(waiter, r, WAIT)
        with pytest.raises(WriterDied) as info:
            r.recv_bytes(timeout=WAIT)
        assert info.value.exitcode == 0
        assert info.value.pid == proc.pid
        proc.join(WAIT)
    r.close()
    w.close()


READY = 1.0  # the bytes are known to be there before these waits start: they must not block


@pytest.mark.parametrize("waiter", WAITERS)
def test_waiters_see_a_death_behind_the_last_frame(impl, waiter):
    # The writer sends a frame and dies; the DEAD sentinel lands right behind the frame. After
    # the frame is received, a waiter must still report the connection ready (the next read
    # raises WriterDied at once), or a wait()-then-recv() loop hangs forever.
    r, w = impl.pipe(False)
    with running("fork", send_then_die, w, [5], ("exit", 0)) as proc:
        r.watch(proc)
        assert mpc.wait([proc.sentinel], WAIT) == [proc.sentinel]
        frame = PAD_MIN  # the 17-byte frame, padded (see test_padding)
        wait_until(lambda: unread(r.fileno()) == frame + 10, "the DEAD sentinel")
        assert r.recv_bytes(timeout=WAIT) == payload(5)
        assert _wait_with(waiter, r, READY), f"{waiter} does not see the DEAD sentinel"
        with pytest.raises(WriterDied):
            r.recv_bytes(timeout=WAIT)
        proc.join(WAIT)
    r.close()
    w.close()


@pytest.mark.parametrize("waiter", WAITERS)
def test_waiters_see_a_frame_that_arrived_with_the_previous_one(impl, waiter):
    # Two frames sit in the pipe; after the first is received, a waiter must report the
    # connection ready, as it does for multiprocessing's own Connection.
    r, w = impl.pipe(False)
    try:
        w.send_bytes(b"one")
        w.send_bytes(b"two")
        assert r.recv_bytes(timeout=WAIT) == b"one"
        assert _wait_with(waiter, r, READY), f"{waiter} does not see the second frame"
        assert r.recv_bytes(timeout=WAIT) == b"two"
    finally:
        r.close()
        w.close()


@pytest.mark.parametrize("waiter", ["framepipe.wait", "poll"])
@pytest.mark.parametrize("behind", ["frame", "dead-sentinel"])
def test_read_ahead_connection_still_wakes_framepipe_waiters(impl, waiter, behind):
    # With read_ahead=True the next frame (or the DEAD sentinel) may already sit in the
    # connection's buffer, invisible to select(); framepipe's own waiters must still see it.
    r, w = impl.pipe(False, read_ahead=True)
    try:
        w.send_bytes(b"one")
        if behind == "frame":
            w.send_bytes(b"two")
        else:
            write_all(w.fileno(), b"\x02\x02" + dead_status_word(3).to_bytes(8, sys.byteorder))
        assert r.recv_bytes(timeout=WAIT) == b"one"
        assert unread(r.fileno()) == 0, "the read did not take the next bytes ahead"
        assert _wait_with(waiter, r, READY)
        if behind == "frame":
            assert r.recv_bytes(timeout=WAIT) == b"two"
        else:
            with pytest.raises(WriterDied) as info:
                r.recv_bytes(timeout=WAIT)
            assert info.value.exitcode == 3
    finally:
        r.close()
        w.close()


# -- 6. two workers whose pipes both exist before either starts -------------------------------


def test_each_reader_watches_its_own_worker(impl):
    # Both pipes are made first, so each forked worker inherits the other's write end too:
    # end of file can never tell who died; only the watch can.
    a_parent, a_child = impl.pipe(True)
    b_parent, b_child = impl.pipe(True)
    with running("fork", echo, a_child) as a, running("fork", echo, b_child) as b:
        a_parent.watch(a)
        b_parent.watch(b)
        for conn in (a_parent, b_parent):
            conn.send_bytes(b"ping")
            assert conn.recv_bytes(timeout=WAIT) == b"ping"
        os.kill(a.pid, signal.SIGKILL)
        with pytest.raises(WriterDied) as info:
            a_parent.recv_bytes(timeout=WAIT)
        assert info.value.pid == a.pid
        assert info.value.exitcode == -signal.SIGKILL
        # The other reader saw nothing of it and still works.
        assert b_parent.poll(0) is False
        for i in range(3):
            b_parent.send_bytes(payload(1000, i))
            assert b_parent.recv_bytes(timeout=WAIT) == payload(1000, i)
        os.kill(b.pid, signal.SIGKILL)
        with pytest.raises(WriterDied) as info:
            b_parent.recv_bytes(timeout=WAIT)
        assert info.value.pid == b.pid
    for conn in (a_parent, a_child, b_parent, b_child):
        conn.close()


# -- 9. reaped writers and recycled pids ------------------------------------------------------


@pytest.mark.parametrize("target", ["process", "pid"])
def test_writer_reaped_by_join_is_dead(impl, target):
    r, w = impl.pipe(False)
    with running("fork", send_then_die, w, [7], ("exit", 4)) as proc:
        r.watch(proc if target == "process" else proc.pid)
        proc.join(WAIT)  # reaped before anyone reads
        assert proc.exitcode == 4
        assert r.recv_bytes(timeout=WAIT) == payload(7)
        with pytest.raises(WriterDied) as info:
            r.recv_bytes(timeout=WAIT)  # the parent holds the write end: no end of file
        assert info.value.pid == proc.pid
        if target == "process":
            assert info.value.exitcode == 4
    # A Liveness made after the reaping knows the process is dead, by object or by pid.
    with Liveness(proc) as live:
        assert live.poll_dead()
        assert live.status()[0] == 4
    with Liveness(proc.pid) as live:
        assert live.poll_dead()
    r.close()
    w.close()


def _start_tick(pid: int) -> str | None:
    return proc_stat(pid, 22)  # starttime


@pytest.mark.parametrize("use_pidfd", [True, False], ids=["pidfd", "portable"])
def test_recycled_pid_does_not_revive_a_dead_writer(impl, use_pidfd):
    # The watched writer dies and is reaped; a new process gets the very same pid and holds
    # the write end. The reader must still say WriterDied.
    r, w = impl.pipe(False)
    with running("fork", block_until_killed, w) as first:
        pid = first.pid
        if use_pidfd:
            r.watch(pid)  # by pid: the watch alone must tell the two processes apart
        live = Liveness(pid, use_pidfd=use_pidfd)
        first_start = _start_tick(pid)
        first.kill()
        first.join(WAIT)
    try:
        for _attempt in range(50):
            second = multiprocessing.get_context("fork").Process(
                target=block_until_killed, args=(w,), daemon=True
            )
            settable, _ = at_pid(pid, second.start)
            if not settable:
                pytest.skip("cannot choose the next pid here (ns_last_pid is not writable)")
            with reaped(second):
                if second.pid != pid or _start_tick(pid) == first_start:
                    # Not our pid, or started in the same clock tick as the first one (which
                    # nothing but a pidfd can tell apart): try again.
                    time.sleep(0.01)
                    continue
                assert live.poll_dead()
                if use_pidfd:
                    with pytest.raises(WriterDied) as info:
                        r.recv_bytes(timeout=WAIT)
                    assert info.value.pid == pid
                    assert second.is_alive()
                return
        pytest.skip("another process kept taking the pid")
    finally:
        live.close()
        r.close()
        w.close()


# -- 10. sentinels written by hand --------------------------------------------------------------


@pytest.mark.parametrize("how", ["recv_bytes", "recv", "recv_bytes_into"])
def test_timeout_sentinel_raises_read_timeout_then_stream_goes_on(impl, how):
    r, w = impl.pipe(False)
    try:
        after = pickle.dumps("after") if how == "recv" else b"after"
        write_all(w.fileno(), b"\x01\x01" + header(len(after)) + after)
        with pytest.raises(ReadTimeout) as info:
            read_with(r, how, 100, WAIT)
        assert info.value.sentinel is True
        assert read_with(r, how, 100, WAIT) == ("after" if how == "recv" else after)
        with pytest.raises(ReadTimeout) as info:
            read_with(r, how, 100, 0.05)
        assert info.value.sentinel is False
    finally:
        r.close()
        w.close()


def test_pipe_read_on_timeout_sentinel_calls_the_callback(impl):
    calls = []
    with impl.Pipe(timeout=WAIT, timeout_callback=lambda: calls.append(1)) as p:
        write_all(p.write_fd, b"\x01\x01")
        with pytest.raises(ReadTimeout) as info:
            p.read()
        assert info.value.sentinel is True
        assert calls == [1]


# -- 11. never reaped ---------------------------------------------------------------------------

POPEN_WRITER = """
import os, signal, sys, time
from framepipe import _impl
conn = _impl.load(sys.argv[1]).Connection(int(sys.argv[2]), readable=False)
conn.send_bytes(b"last words")
if sys.argv[3] == "exit":
    os._exit(int(sys.argv[4]))
os.kill(os.getpid(), int(sys.argv[4]))
time.sleep(60)
"""

HOWS = [("exit", 7), ("signal", signal.SIGTERM), ("signal", signal.SIGKILL)]
HOW_IDS = ["exit7", "sigterm", "sigkill"]


@pytest.mark.parametrize("method", START_METHODS)
@pytest.mark.parametrize("how", HOWS, ids=HOW_IDS)
def test_process_is_never_reaped_by_the_reader(impl, method, how):
    code = how[1] if how[0] == "exit" else -how[1]
    r, w = impl.pipe(False)
    with running(method, send_then_die, w, [10], how) as proc:
        w.close()
        r.watch(proc)
        assert r.recv_bytes(timeout=WAIT) == payload(10)
        with pytest.raises(WriterDied) as info:
            r.recv_bytes(timeout=WAIT)
        assert info.value.exitcode == code
        if method != "forkserver":  # our own child: still a zombie, waiting for join()
            assert os.waitid(os.P_PID, proc.pid, NOT_REAPED) is not None
        proc.join(WAIT)
        assert proc.exitcode == code
    r.close()


@pytest.mark.parametrize("how", HOWS, ids=HOW_IDS)
def test_popen_is_never_reaped_by_the_reader(impl, how):
    code = how[1] if how[0] == "exit" else -how[1]
    r, w = impl.pipe(False)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            POPEN_WRITER,
            impl.ENGINE,
            str(w.fileno()),
            how[0],
            str(int(how[1])),
        ],
        pass_fds=[w.fileno()],
        env=child_env(),
    )
    try:
        w.close()
        r.watch(proc)
        assert r.recv_bytes(timeout=WAIT) == b"last words"
        with pytest.raises(WriterDied) as info:
            r.recv_bytes(timeout=WAIT)
        assert info.value.exitcode == code
        assert info.value.pid == proc.pid
        assert proc.returncode is None
        assert os.waitid(os.P_PID, proc.pid, NOT_REAPED) is not None
        assert proc.wait(WAIT) == code
    finally:
        if proc.returncode is None:
            proc.kill()
            proc.wait(WAIT)
        r.close()
