"""Threads sharing a Connection, and file descriptor hygiene."""

from __future__ import annotations

import gc
import os
import signal
import struct
import sys
import threading
import time

import numpy as np
import pytest
from _helpers import TIMEOUT, Background, exit_code, fork, pipe_works
from _helpers import reuse_fd as _reuse

TAG = struct.Struct("<III")  # thread, sequence number, payload size


def body(tid: int, seq: int, size: int) -> bytes:
    """A payload that says who sent it and is wrong anywhere if two frames interleave."""
    assert size >= TAG.size
    return TAG.pack(tid, seq, size) + bytes([(tid * 37 + seq) % 251 + 1]) * (size - TAG.size)


def check(msg: bytes) -> tuple[int, int]:
    tid, seq, size = TAG.unpack_from(msg)
    assert msg == body(tid, seq, size), f"frame {seq} of thread {tid} is corrupt"
    return tid, seq


SIZES = [12, 100, 4096, 65_537, 200_000, 12, 1 << 20, 70_000]


def test_send_bytes_from_four_threads_never_interleaves(pair):
    r, w = pair
    threads, per_thread = 4, 16
    start = threading.Barrier(threads)

    def send(tid: int) -> None:
        start.wait(TIMEOUT)
        for seq in range(per_thread):
            w.send_bytes(body(tid, seq, SIZES[(seq + tid) % len(SIZES)]))

    senders = [Background(send, tid) for tid in range(threads)]
    last = [-1] * threads
    try:
        for _ in range(threads * per_thread):
            tid, seq = check(r.recv_bytes(timeout=TIMEOUT))
            assert seq == last[tid] + 1, f"thread {tid}: frame {seq} after {last[tid]}"
            last[tid] = seq
    finally:
        r.close()  # unblock any sender still writing if the test failed
        for s in senders:
            s.thread.join(TIMEOUT)
    for s in senders:
        s.join()
    assert last == [per_thread - 1] * threads


def test_send_objects_from_four_threads_never_interleaves(pair):
    # Objects with large buffers are several frames each: they must still arrive as a unit.
    r, w = pair
    threads, per_thread = 4, 6
    start = threading.Barrier(threads)

    def obj(tid: int, seq: int):
        n = [10, 20_000, 100_000][(tid + seq) % 3]
        return {
            "tid": tid,
            "seq": seq,
            "a": np.full(n, tid * 100 + seq, dtype=np.int32),
            "b": bytes([tid]) * (n * 2),
        }

    def send(tid: int) -> None:
        start.wait(TIMEOUT)
        for seq in range(per_thread):
            w.send(obj(tid, seq))

    senders = [Background(send, tid) for tid in range(threads)]
    last = [-1] * threads
    try:
        for _ in range(threads * per_thread):
            got = r.recv(timeout=TIMEOUT)
            tid, seq = got["tid"], got["seq"]
            want = obj(tid, seq)
            assert np.array_equal(got["a"], want["a"]) and got["b"] == want["b"]
            assert seq == last[tid] + 1
            last[tid] = seq
    finally:
        r.close()
        for s in senders:
            s.thread.join(TIMEOUT)
    for s in senders:
        s.join()
    assert last == [per_thread - 1] * threads


@pytest.mark.parametrize("how", ["recv_bytes", "recv"])
def test_two_reader_threads_receive_every_frame_exactly_once(pair, how):
    r, w = pair
    count = 300
    sizes = [0, 1, 50, 3000, 70_000, 9]

    def write() -> None:
        for i in range(count):
            if how == "recv":
                w.send(("item", i, b"p" * sizes[i % len(sizes)]))
            else:
                w.send_bytes(body(0, i, max(sizes[i % len(sizes)], TAG.size)))
        for _ in range(2):
            w.send(None) if how == "recv" else w.send_bytes(b"stop")

    def read() -> list[int]:
        seen = []
        while True:
            if how == "recv":
                msg = r.recv(timeout=TIMEOUT)
                if msg is None:
                    return seen
                kind, i, pad = msg
                assert kind == "item" and pad == b"p" * sizes[i % len(sizes)]
                seen.append(i)
            else:
                msg = r.recv_bytes(timeout=TIMEOUT)
                if msg == b"stop":
                    return seen
                seen.append(check(msg)[1])

    readers = [Background(read) for _ in range(2)]
    writer = Background(write)
    try:
        writer.join()
        results = [rd.join() for rd in readers]
    finally:
        r.close()
    everything = sorted(results[0] + results[1])
    assert everything == list(range(count))
    for seen in results:
        assert seen == sorted(seen)  # each reader gets its frames in stream order


@pytest.mark.parametrize("duplex", [False, True], ids=["oneway", "duplex"])
def test_readers_waiting_for_the_read_lock_time_out_and_take_their_turn(impl, duplex):
    # Thread A waits in a read; the others wait for A's read lock. One with a deadline gives
    # up at its deadline, leaving the lock as it was; one without is handed the lock when A's
    # read ends, and reads the next message; a close() ends every wait, for data or the lock.
    from framepipe.errors import ReadTimeout

    r, w = impl.pipe(duplex)
    try:
        first = Background(r.recv_bytes)
        time.sleep(0.2)  # A holds the read lock, waiting for data
        started = time.monotonic()
        with pytest.raises(ReadTimeout):
            r.recv_bytes(timeout=0.3)
        waited = time.monotonic() - started
        assert 0.25 <= waited < TIMEOUT, waited
        second = Background(r.recv_bytes)
        time.sleep(0.2)  # B waits for A's lock
        w.send_bytes(b"one")
        w.send_bytes(b"two")
        assert sorted([first.join(), second.join()]) == [b"one", b"two"]
        w.send_bytes(b"three")
        assert r.recv_bytes(timeout=TIMEOUT) == b"three"  # nobody kept the lock
        blocked = [Background(r.recv_bytes) for _ in range(3)]
        time.sleep(0.2)
        r.close()
        for b in blocked:
            with pytest.raises(OSError, match="closed"):
                b.join()
    finally:
        r.close()
        w.close()


def test_a_reader_waiting_for_the_read_lock_gets_it_from_a_thread_that_keeps_reading(impl):
    # Thread A reads in a loop, waiting for each message; B waits for A's read lock. Each time
    # A's read ends, the lock goes to B, not back to A (which keeps the GIL until its next read
    # and would otherwise take the lock again before B could): B gets a message in time.
    from framepipe.errors import ReadTimeout

    r, w = impl.pipe(False)
    got_a: list[bytes] = []

    def keep_reading() -> None:
        while (msg := r.recv_bytes(timeout=TIMEOUT)) != b"stop":
            got_a.append(msg)

    def write() -> None:
        for i in range(100):
            time.sleep(0.02)
            w.send_bytes(b"m%d" % i)

    try:
        a = Background(keep_reading)
        time.sleep(0.1)  # A holds the lock, waiting for data
        writer = Background(write)
        try:
            got_b = r.recv_bytes(timeout=1.5)
        except ReadTimeout:
            pytest.fail("a reader waiting for the read lock never got it")
        writer.join()
        w.send_bytes(b"stop")
        a.join()
        assert got_b.startswith(b"m") and got_b not in got_a
        assert len(got_a) + 1 == 100
    finally:
        r.close()
        w.close()


def test_a_signal_handler_raising_while_a_read_waits_for_the_lock_leaks_no_close(impl):
    # A handler's exception (Ctrl-C, an alarm) during a wait for the read lock leaves the
    # connection as it was: close() then closes the fd once the other reader has left.
    import fcntl

    class Alarm(Exception):
        pass

    def ring(signum, frame):
        raise Alarm

    r, w = impl.pipe(False)
    fd = r.fileno()
    old = signal.signal(signal.SIGALRM, ring)
    sender = threading.Timer(1.0, lambda: (w.send_bytes(b"one"), w.send_bytes(b"two")))
    try:
        first = Background(r.recv_bytes)
        time.sleep(0.2)  # the read lock is taken
        signal.setitimer(signal.ITIMER_REAL, 0.3)
        sender.start()
        with pytest.raises(Alarm):  # at once (pure engine) or once its read ends (compiled)
            r.recv_bytes(timeout=TIMEOUT)
            time.sleep(TIMEOUT)  # the handler runs here if the read returned first
        assert first.join() == b"one"
        sender.join(TIMEOUT)  # its second send too, before the ends close under it
        r.close()
        with pytest.raises(OSError):
            fcntl.fcntl(fd, fcntl.F_GETFD)  # closed: no call was left counted as under way
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
        sender.cancel()
        sender.join(TIMEOUT)
        r.close()
        w.close()


def test_a_read_lock_wait_with_a_huge_timeout_waits(impl):
    # A timeout too long for the lock's own clock waits for the lock; it does not expire at once.
    r, w = impl.pipe(False)
    try:
        first = Background(r.recv_bytes)
        time.sleep(0.2)  # the read lock is taken
        second = Background(lambda: r.recv_bytes(timeout=1e300))
        time.sleep(0.2)
        w.send_bytes(b"one")
        w.send_bytes(b"two")
        assert sorted([first.join(), second.join()]) == [b"one", b"two"]
    finally:
        r.close()
        w.close()


def test_a_forked_child_finishing_an_inherited_async_send_leaves_its_own_lock_alone(impl):
    # The parent forked while an asyncio send held the write lock. In the child a thread now
    # holds the (fresh) lock; the inherited send finishing there must not give it back.
    r, w = impl.pipe(False)
    try:
        assert w._lock_write_nowait()  # an asyncio send in progress

        def child() -> int:
            blocked = threading.Thread(target=w.send_bytes, args=(bytes(8 << 20),), daemon=True)
            blocked.start()  # fills the pipe and waits, holding the child's write lock
            time.sleep(0.3)
            w._unlock_write()
            return 3 if w._lock_write_nowait() else 0

        assert exit_code(fork(child)) == 0, "the child's write lock was given back"
        w._unlock_write()
    finally:
        r.close()
        w.close()


@pytest.mark.parametrize("duplex", [False, True], ids=["oneway", "duplex"])
def test_a_writer_waiting_for_the_write_lock_writes_once_it_is_handed_over(impl, duplex):
    # A's send fills the pipe and waits for the reader, holding the write lock; B's send waits
    # for that lock and goes out whole after A's once the reader drains the pipe.
    r, w = impl.pipe(duplex)
    big = b"a" * (8 << 20)
    try:
        first = Background(w.send_bytes, big)
        time.sleep(0.2)
        second = Background(w.send_bytes, b"b" * 100)
        time.sleep(0.2)
        assert r.recv_bytes(timeout=TIMEOUT) == big
        assert r.recv_bytes(timeout=TIMEOUT) == b"b" * 100
        first.join()
        second.join()
    finally:
        r.close()
        w.close()


# --- file descriptors ---------------------------------------------------------------------------


@pytest.mark.parametrize("duplex", [True, False], ids=["duplex", "oneway"])
def test_pipe_close_cycles_leave_the_fd_count_unchanged(impl, fd_count, duplex):
    gc.collect()  # fds of earlier tests' garbage must not close during the count
    before = fd_count()
    for _ in range(10_000):
        a, b = impl.pipe(duplex)
        a.close()
        b.close()
    assert fd_count() == before


def test_pipe_object_close_cycles_leave_the_fd_count_unchanged(impl, fd_count):
    gc.collect()  # fds of earlier tests' garbage must not close during the count
    before = fd_count()
    for _ in range(10_000):
        impl.Pipe().close()
    assert fd_count() == before


def test_connections_used_then_closed_leave_the_fd_count_unchanged(impl, fd_count):
    gc.collect()  # fds of earlier tests' garbage must not close during the count
    before = fd_count()
    for i in range(500):
        with impl.pipe(i % 2 == 0)[0] as a:
            pass
        r, w = impl.pipe(False)
        with r, w:
            w.send_bytes(b"x")
            assert r.recv_bytes(timeout=TIMEOUT) == b"x"
        with impl.Pipe() as p:
            p.write(b"y")
            assert p.read(timeout=TIMEOUT) == b"y"
    gc.collect()
    assert fd_count() == before
    assert a.closed


def test_dropped_connections_are_closed_when_collected(impl, fd_count):
    gc.collect()  # fds of earlier tests' garbage must not close during the count
    before = fd_count()
    for _ in range(1000):
        impl.pipe(True)
        impl.pipe(False)
        impl.Pipe()
    gc.collect()
    assert fd_count() == before


def test_closing_twice_never_closes_an_fd_twice(impl):
    r, w = os.pipe()
    conn = impl.Connection(r, writable=False)
    conn.close()
    assert conn.closed
    fd, nw = _reuse(r)
    try:
        conn.close()
        conn.__exit__(None, None, None)
        del conn
        gc.collect()
        pipe_works(fd, nw)
    finally:
        os.close(fd)
        os.close(nw)
        os.close(w)


def test_closing_a_pipe_pair_twice_never_closes_an_fd_twice(impl):
    for duplex in (True, False):
        a, b = impl.pipe(duplex)
        fa, fb = a.fileno(), b.fileno()
        a.close()
        b.close()
        ra, wa = _reuse(fa, avoid=(fb,))
        rb, wb = _reuse(fb, avoid=(fa, wa))
        try:
            a.close()
            b.close()
            del a, b
            gc.collect()
            pipe_works(ra, wa)
            pipe_works(rb, wb)
        finally:
            for fd in (ra, wa, rb, wb):
                os.close(fd)


def test_closed_connection_is_not_closed_again_when_collected(impl):
    # Drop the only reference after close(): the collector must not close the number again.
    for _ in range(100):
        r, w = os.pipe()
        conn = impl.Connection(w, readable=False)
        conn.close()
        fd, nw = _reuse(w)
        try:
            del conn  # the last reference: collected here
            pipe_works(fd, nw)
        finally:
            os.close(fd)
            os.close(nw)
            os.close(r)


# --- the private non-blocking description of timed and watched reads ---------------------------

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="uses /proc/self/fd")


def _fds_of_pipe(fd: int) -> int:
    """How many fds of this process are open on the same pipe as ``fd`` (either end)."""
    link = os.readlink(f"/proc/self/fd/{fd}")
    count = 0
    for name in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{name}") == link
        except OSError:
            pass  # closed while we looked
    return count


def _wait_blocked_in_pipe_read(pid: int) -> int | None:
    """Wait until the child ``pid`` sleeps in a read of a pipe (None), or has exited (its wait
    status). Fails after TIMEOUT seconds."""
    end = time.monotonic() + TIMEOUT
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return status
        try:
            with open(f"/proc/{pid}/wchan") as file:
                wchan = file.read()
        except OSError:
            wchan = ""
        if wchan.endswith("pipe_read"):  # pipe_read, anon_pipe_read (Linux 6.x)
            return None
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the child never blocked in its read (wchan {wchan!r})")
        time.sleep(0.001)


@linux_only
def test_timed_reads_never_make_the_inherited_fd_non_blocking(impl):
    r, w = impl.pipe(False)
    with r, w:
        w.send_bytes(b"first")
        assert r.recv_bytes(timeout=TIMEOUT) == b"first"
        with pytest.raises(TimeoutError):
            r.recv_bytes(timeout=0.01)
        r.watch(os.getppid())
        w.send_bytes(b"second")
        assert r.recv_bytes(timeout=TIMEOUT) == b"second"
        r.watch(None)
        assert os.get_blocking(r.fileno())

        def child() -> int:  # a plain blocking os.read of the inherited fd waits for the frame
            try:
                return 0 if os.read(r.fileno(), 4096)[12:17] == b"hello" else 2
            except BlockingIOError:
                return 3

        pid = fork(child)
        # Write only once the child sleeps in its read of the empty pipe (or has already
        # failed): a read that found the frame there would prove nothing.
        status = _wait_blocked_in_pipe_read(pid)
        w.send_bytes(b"hello")
        if status is None:
            _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0  # 3: the description was non-blocking


@linux_only
@pytest.mark.parametrize("closefd", [True, False], ids=["closefd", "borrowed"])
def test_the_private_read_description_closes_with_the_connection(impl, closefd):
    rfd, wfd = os.pipe()
    try:
        conn = impl.Connection(rfd, writable=False, closefd=closefd)
        os.write(wfd, struct.pack("=HQH", 0, 3, 0) + b"abc")
        assert conn.recv_bytes() == b"abc"
        assert _fds_of_pipe(wfd) == 2  # a plain read opens nothing
        os.write(wfd, struct.pack("=HQH", 0, 3, 0) + b"def")
        assert conn.recv_bytes(timeout=TIMEOUT) == b"def"
        assert _fds_of_pipe(wfd) in (2, 3)  # 3 where the private description could be made
        conn.close()
        assert _fds_of_pipe(wfd) == (1 if closefd else 2)
        if not closefd:  # the borrowed fd is still open and still works
            pipe_works(rfd, wfd)
    finally:
        if not closefd:
            os.close(rfd)
        os.close(wfd)


def test_dropped_connections_after_timed_reads_leave_the_fd_count_unchanged(impl, fd_count):
    gc.collect()  # fds of earlier tests' garbage must not close during the count
    before = fd_count()
    for _ in range(300):
        r, w = impl.pipe(False)
        w.send_bytes(b"x")
        assert r.recv_bytes(timeout=TIMEOUT) == b"x"
        del r, w
    gc.collect()
    assert fd_count() == before


def test_a_forked_child_shares_timed_reads_of_an_inherited_connection(impl):
    r, w = impl.pipe(False)
    with r, w:
        with pytest.raises(TimeoutError):
            r.recv_bytes(timeout=0.01)  # the private description exists before the fork
        for i in range(3):
            w.send_bytes(b"frame %d" % i)
        pid = fork(lambda: 0 if r.recv_bytes(timeout=TIMEOUT) == b"frame 0" else 2)
        assert exit_code(pid) == 0
        assert r.recv_bytes(timeout=TIMEOUT) == b"frame 1"
        assert r.recv_bytes(timeout=TIMEOUT) == b"frame 2"
        with pytest.raises(TimeoutError):
            r.recv_bytes(timeout=0.01)
