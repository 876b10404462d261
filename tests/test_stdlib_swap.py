"""framepipe.connection as multiprocessing.connection: misuse errors, handles, sockets with
authentication, fds per pipe, and lifecycle edges (fork while blocked, shutdown). Both cores."""

from __future__ import annotations

import errno
import multiprocessing
import multiprocessing.connection
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from multiprocessing import AuthenticationError, reduction

import pytest
from _helpers import TIMEOUT, Background, exit_code, fork, running, started

from framepipe import ReadTimeout, WriterDied
from framepipe import connection as fpc

NAN = float("nan")


@pytest.fixture
def duplex(impl):
    a, b = impl.pipe(True)
    with a, b:
        yield a, b


def test_a_bad_handle_fails_on_first_use_like_the_stdlib(impl):
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    conn = impl.Connection(w)  # closed fd: no error yet
    with pytest.raises(OSError) as info:
        conn.send_bytes(b"x")
    assert info.value.errno == errno.EBADF
    conn.close()  # it never owned a file: nothing is closed
    with pytest.raises(ValueError, match="invalid handle"):
        impl.Connection(-1)


def test_misuse_errors_are_the_stdlib_ones(duplex):
    a, b = duplex
    with pytest.raises(ValueError):
        a.poll(NAN)
    with pytest.raises(ValueError, match="NaN"):
        a.recv(timeout=NAN)
    with pytest.raises(ValueError, match="NaN"):
        a.recv_bytes(timeout=NAN)
    assert a.poll(-1) is False  # a negative timeout does not wait, as in the stdlib
    with pytest.raises(ReadTimeout):
        a.recv_bytes(timeout=-1)
    for offset, size in ((-1, None), (4, None), (0, -1), (2, 3)):
        with pytest.raises(ValueError):
            b.send_bytes(b"abc", offset, size)
    with pytest.raises(ValueError):
        a.recv_bytes(-1)
    with pytest.raises(TypeError):
        b.send_bytes(b"abc", 1.0)
    with pytest.raises(TypeError):
        b.send_bytes(b"abc", 0, 1.5)
    b.send_bytes(b"12345678")
    with pytest.raises(BufferError):  # refused before the message is read: it stays
        a.recv_bytes_into(memoryview(bytearray(16))[::2])
    assert a.recv_bytes() == b"12345678"
    # an infinite timeout waits as long as it takes (the stdlib's poll() overflows)
    for wait in (a.poll, lambda t: fpc.wait([a], t)):
        later = threading.Timer(0.2, b.send_bytes, (b"late",))
        later.start()
        try:
            assert wait(float("inf"))
            assert a.recv_bytes(timeout=float("inf")) == b"late"
        finally:
            later.join()


class Tagged:
    def __init__(self, value):
        self.value = value


def _rebuild_tagged(value):
    return ("rebuilt", value)


def _reduce_tagged(obj):
    return (_rebuild_tagged, (obj.value,))


def test_objects_are_pickled_as_forkingpickler_does(duplex):
    """multiprocessing.connection pickles with ForkingPickler: what is registered with it
    comes first (a reducer of a caller's, torch.multiprocessing's tensors), and a socket
    travels as a working socket."""
    a, b = duplex
    reduction.ForkingPickler.register(Tagged, _reduce_tagged)
    try:
        a.send([Tagged(3), bytearray(1 << 17)])  # with an out-of-band buffer
        got = b.recv()
        assert got[0] == ("rebuilt", 3) and len(got[1]) == 1 << 17
    finally:
        del reduction.ForkingPickler._extra_reducers[Tagged]
    a.send(Tagged(4))  # registered no more: pickled as itself
    assert type(b.recv()) is Tagged
    x, y = socket.socketpair()
    with x, y:
        a.send(x)
        got = b.recv()
        with got:
            assert isinstance(got, socket.socket) and got.fileno() != x.fileno()
            got.sendall(b"through the copy")
            assert y.recv(64) == b"through the copy"


def test_the_stdlibs_address_helpers_and_wait_on_what_is_no_file(duplex):
    a, b = duplex
    assert fpc.families == multiprocessing.connection.families
    assert fpc.default_family == multiprocessing.connection.default_family
    assert fpc.address_type("/tmp/x") == "AF_UNIX"
    assert fpc.address_type(("127.0.0.1", 0)) == "AF_INET"
    assert fpc.arbitrary_address("AF_UNIX") != fpc.arbitrary_address("AF_UNIX")
    with pytest.raises(ValueError, match="Invalid file object"):
        fpc.wait([a, object()], 0)
    with pytest.raises(ValueError, match="Invalid file descriptor"):
        fpc.wait([-1], 0)
    a.tag = "mine"  # callers hang their own attributes on connections, as on the stdlib's
    assert a.tag == "mine" and not hasattr(b, "tag")


@pytest.mark.parametrize("bad", ["oops", ValueError, None, 42])
def test_send_exception_refuses_what_is_not_an_exception(duplex, bad):
    a, b = duplex
    with pytest.raises(TypeError, match="send_exception"):
        b.send_exception(bad)
    b.send_bytes(b"next")
    assert a.recv_bytes(timeout=TIMEOUT) == b"next"  # nothing reached the reader


def test_watch_refuses_what_cannot_work(impl):
    r, w = impl.pipe(False)
    with r, w:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        proc.wait(TIMEOUT)
        with pytest.raises(ProcessLookupError, match=str(proc.pid)):
            r.watch(proc.pid)  # exited and reaped: no such pid
        with pytest.raises(ValueError, match="this process"):
            r.watch(os.getpid())
        with pytest.raises(ValueError, match="write-only"):
            w.watch(os.getppid())
        r.watch(proc)  # the Popen object still knows its exit status
        with pytest.raises(WriterDied):
            r.recv_bytes(timeout=TIMEOUT)


def test_read_timeout_says_how_long_and_the_frame_state(impl):
    r, w = impl.pipe(False)
    with r, w:
        with pytest.raises(ReadTimeout, match=r"^timed out after 0.05 s: nothing arrived; "):
            r.recv_bytes(timeout=0.05)
        os.write(w.fileno(), b"\0\0" + struct.pack("Q", 100) + b"\0\0" + b"x" * 30)
        with pytest.raises(ReadTimeout) as info:
            r.recv_bytes(timeout=0.05)
        assert str(info.value).startswith("timed out after 0.05 s: 42 of the 112 bytes")
        os.write(w.fileno(), b"y" * 70)
        assert r.recv_bytes(timeout=TIMEOUT) == b"x" * 30 + b"y" * 70


def test_fd_counts_per_pipe(impl, fd_count):
    before = fd_count()
    a, b = impl.pipe(True)
    assert fd_count() - before == 2  # one socketpair: at most 4 asked, the stdlib's 2
    r, w = impl.pipe(False)
    assert fd_count() - before == 6  # a pipe and its bulk socketpair
    for c in (a, b, r, w):
        c.close()
    assert fd_count() == before


def _send_a_handle(conn, path):
    with open(path, "rb") as f:
        reduction.send_handle(conn, f.fileno(), os.getppid())
    conn.recv_bytes(timeout=TIMEOUT)
    conn.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_send_handle_and_recv_handle_over_a_duplex_pipe(impl, tmp_path, method):
    path = tmp_path / "secret"
    path.write_bytes(b"passed by handle")
    a, b = impl.pipe(True)
    ctx = multiprocessing.get_context(method)
    with a, started(ctx.Process(target=_send_a_handle, args=(b, str(path)))) as proc:
        b.close()
        fd = reduction.recv_handle(a)
        with open(fd, "rb") as f:
            assert f.read() == b"passed by handle"
        a.send_bytes(b"done")
        proc.join(TIMEOUT)
        assert proc.exitcode == 0


# -- Listener and Client --------------------------------------------------------------------


@pytest.fixture(params=["unix", "tcp"])
def address(request, tmp_path):
    """A Listener address of each family: a Unix socket path, a TCP port of localhost."""
    return str(tmp_path / "sock") if request.param == "unix" else ("127.0.0.1", 0)


def test_listener_and_client_with_the_right_key(engine, address):
    impl = engine
    with fpc.Listener(address, authkey=b"secret") as listener:
        client = Background(fpc.Client, listener.address, None, b"secret")
        with listener.accept() as server:
            with client.join() as conn:
                assert type(server) is impl.Connection and type(conn) is impl.Connection
                conn.send({"n": 1})
                assert server.recv(timeout=TIMEOUT) == {"n": 1}
                sending = Background(server.send_bytes, b"x" * (1 << 20))  # over the buffers
                assert conn.recv_bytes(timeout=TIMEOUT) == b"x" * (1 << 20)
                sending.join()
                with pytest.raises(ReadTimeout):
                    conn.recv(timeout=0.05)
                conn.send_exception(KeyError("remote"))
                with pytest.raises(KeyError, match="remote"):
                    server.recv(timeout=TIMEOUT)


def test_a_wrong_key_fails_both_ends(engine, address):
    with fpc.Listener(address, authkey=b"secret") as listener:
        client = Background(fpc.Client, listener.address, None, b"wrong")
        with pytest.raises(AuthenticationError, match="digest received was wrong"):
            listener.accept()
        with pytest.raises(AuthenticationError, match="rejected"):
            client.join()


@pytest.mark.parametrize(
    "junk",
    [
        b"GET / HTTP/1.1\r\n\r\n",
        b"\0\0" + struct.pack("Q", 1 << 40) + b"\0\0",
    ],
)
def test_garbage_or_a_huge_length_before_authenticating_is_refused_unread(engine, tmp_path, junk):
    with fpc.Listener(str(tmp_path / "sock"), authkey=b"secret") as listener:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(listener.address)
            s.sendall(junk)
            start = time.monotonic()
            with pytest.raises(AuthenticationError, match="did not follow the handshake"):
                listener.accept()
            assert time.monotonic() - start < 5


def test_answer_and_deliver_challenge_check_their_key(duplex):
    a, b = duplex
    with pytest.raises(ValueError, match="Authkey must be bytes"):
        fpc.deliver_challenge(a, "text")
    other = Background(fpc.answer_challenge, b, b"k")
    fpc.deliver_challenge(a, b"k")
    other.join()


def _write_after(conn, delay):
    time.sleep(delay)
    conn.send_bytes(b"late")
    time.sleep(30)


def test_watch_and_async_reads_on_a_socket_connection(engine, tmp_path):
    import asyncio

    with fpc.Listener(str(tmp_path / "sock")) as listener:
        client = Background(fpc.Client, listener.address)
        with listener.accept() as server, client.join() as conn:
            with running("fork", _write_after, conn, 0.1) as proc:
                server.watch(proc)
                assert asyncio.run(server.recv_bytes_async(timeout=TIMEOUT)) == b"late"
                proc.kill()
                conn.close()
                with pytest.raises(WriterDied):
                    server.recv_bytes(timeout=TIMEOUT)


# -- lifecycle edges ---------------------------------------------------------------------------


def test_fork_while_a_thread_is_blocked_in_a_timed_recv(impl):
    # Forked while a thread of this process is blocked in a timed read of ``r`` (holding its
    # read lock), the child reads the same connection with a timeout and writes to ``w`` at once.
    # The two processes never read the pipe at the same time (that would split frames between
    # them): the child starts reading only after the parent's thread has taken its frame.
    r, w = impl.pipe(False)
    go_r, go_w = os.pipe()
    with r, w:
        blocked = Background(lambda: r.recv_bytes(timeout=TIMEOUT))
        time.sleep(0.1)  # the thread holds the read lock, waiting

        def child() -> int:
            os.close(go_w)
            os.read(go_r, 1)  # the parent's thread has its frame
            got = r.recv_bytes(timeout=5)  # raises on a false timeout or a hang
            w.send_bytes(b"child writes too")
            return 0 if got == b"two" else 2

        pid = fork(child)
        os.close(go_r)
        try:
            w.send_bytes(b"one")
            assert blocked.join() == b"one"
            w.send_bytes(b"two")
            os.write(go_w, b"g")
            code, pid = exit_code(pid), 0
            assert code == 0
            assert r.recv_bytes(timeout=TIMEOUT) == b"child writes too"
        finally:
            os.close(go_w)
            if pid:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def _child_closes_while_its_thread_waits(conn, call) -> int:
    """Fork a child in which a thread waits in ``call(conn)`` and the main thread closes
    ``conn`` (the child's copy): returns the child's pid; it exits 0 when its thread was woken
    with OSError, 2 when it was not woken."""

    def child() -> int:
        waiting = Background(call, conn)
        time.sleep(0.1)
        conn.close()
        try:
            waiting.join()
        except OSError:
            return 0
        return 2

    return fork(child)


@pytest.mark.parametrize(
    "parent_waits, child_call",
    [(True, lambda c: c.poll(30)), (False, lambda c: c.recv_bytes())],
    ids=["parent-in-recv-child-in-poll", "child-in-recv"],
)
def test_a_forked_childs_close_of_its_copy_leaves_the_parents_connection_working(
    impl, parent_waits, child_call
):
    # The child inherits the parent's end of a duplex Pipe() and closes it while a thread of its
    # own waits on it. The child's thread is woken; the parent's end (with or without a thread
    # of its own waiting in recv() meanwhile) goes on working both ways: no shutdown of the
    # socket both processes hold, and no wake meant for the child's thread reaches the parent.
    a, b = impl.pipe(True)
    with a, b:
        blocked = Background(a.recv_bytes) if parent_waits else None
        time.sleep(0.1)  # the parent's thread waits in recv()
        pid = _child_closes_while_its_thread_waits(a, child_call)
        try:
            _, status = os.waitpid(pid, 0)
            pid = 0
            assert os.waitstatus_to_exitcode(status) == 0  # 2: the child's wait went on
            b.send_bytes(b"to the parent")
            if blocked is not None:
                assert blocked.join() == b"to the parent"
            else:
                assert a.recv_bytes(timeout=TIMEOUT) == b"to the parent"
            a.send_bytes(b"and back")
            assert b.recv_bytes(timeout=TIMEOUT) == b"and back"
        finally:
            if pid:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)


def _recv_with_timeout(conn):
    try:
        conn.recv_bytes(timeout=TIMEOUT)
    except Exception:
        pass


def test_fork_while_blocked_in_recv_with_timeout_multiprocessing(impl):
    # The same through multiprocessing's fork: the connection was forked while a parent thread
    # held it in a timed read; once that thread is done, the child's first timed read of it
    # works (two processes never read the pipe at once: that would split frames).
    r, w = impl.pipe(False)
    with r, w:
        t = threading.Thread(target=_recv_with_timeout, args=(r,), daemon=True)
        t.start()
        time.sleep(0.1)
        ctx = multiprocessing.get_context("fork")
        go = ctx.Event()
        try:
            with started(ctx.Process(target=_child_reads_after, args=(r, go))) as proc:
                w.send_bytes(b"for the parent's thread")
                t.join(TIMEOUT)
                assert not t.is_alive()
                w.send_bytes(b"for the child")
                go.set()
                proc.join(TIMEOUT)
                assert proc.exitcode == 0
        finally:
            if t.is_alive():
                w.send_bytes(b"release the thread")
                t.join(TIMEOUT)


def _child_reads_after(r, go):
    go.wait(TIMEOUT)
    start = time.monotonic()
    data = r.recv_bytes(timeout=TIMEOUT)
    os._exit(0 if data == b"for the child" and time.monotonic() - start < TIMEOUT / 2 else 1)


SHUTDOWN = """
import multiprocessing, sys
from framepipe import _impl

def child(conn):
    conn.send_bytes(b"bye")  # exits without closing it

if __name__ == "__main__":
    core = _impl.load(sys.argv[1])
    a, b = core.pipe(True)
    r, w = core.pipe(False)
    keep = (a, b, r, w)  # alive at shutdown too
    ctx = multiprocessing.get_context("spawn")
    p = ctx.Process(target=child, args=(b,))
    p.start()
    assert a.recv_bytes(timeout=60) == b"bye"
    p.join(60)
    sys.exit(p.exitcode)
"""


def test_shutdown_with_open_connections_prints_nothing(impl, tmp_path):
    script = tmp_path / "shutdown.py"
    script.write_text(SHUTDOWN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    name = impl.ENGINE
    out = subprocess.run(
        [sys.executable, str(script), name], capture_output=True, env=env, timeout=120
    )
    assert out.returncode == 0
    assert out.stderr == b"" and out.stdout == b""


def _hold(pid_holder):
    time.sleep(30)


def test_closing_a_handle_behind_a_connection_never_closes_the_watchers_fds(impl):
    # A caller closes "its copy" of a handle with os.close while a Connection still holds the
    # number; the watch started next gets that number for its pidfd. Closing the Connection
    # must leave the pidfd alone: the watched writer's death is still seen.
    r, w = impl.pipe(False)
    proc = multiprocessing.get_context("fork").Process(target=_hold, args=(None,))
    stray_r, stray_w = os.pipe()
    stray = impl.Connection(stray_r, writable=False)
    try:
        proc.start()
        os.close(stray_r)  # the number is free again, the Connection does not know
        r.watch(proc)
        stray.close()
        del stray
        pidfds = [
            fd
            for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")
            and os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[pidfd]"
        ]
        assert pidfds  # still open
        proc.kill()
        with pytest.raises(WriterDied):
            r.recv_bytes(timeout=TIMEOUT)
    finally:
        proc.kill()
        proc.join(TIMEOUT)
        r.close()
        w.close()
        os.close(stray_w)
