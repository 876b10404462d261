"""A duplex Pipe() is a SOCK_SEQPACKET socketpair: frames cut into records, read whole.

Every write there is one record, which a read takes whole or loses the rest of. These tests
check the rules that make that safe (``framepipe._wire.RECORD_MAX``): frames of every size
around the record boundaries, in both directions with real children; records that hold
several frames or cross a frame's end; a foreign record too long to read; a send buffer too
small for RECORD_MAX; and that a read never takes a byte past its frame, so a ``select()``
on ``fileno()`` sees every frame still unread. Both cores."""

from __future__ import annotations

import multiprocessing
import os
import pickle
import select
import socket
import threading
import time

import pytest
from _helpers import frame, payload

from framepipe import FrameError
from framepipe._wire import RECORD_MAX
from framepipe.errors import MessageTooLong

WAIT = 60.0
HEAD = RECORD_MAX - 12  # the payload that fits one record with its header
SIZES = [0, 1, HEAD - 1, HEAD, HEAD + 1, RECORD_MAX, 2 * RECORD_MAX - 12, 2 * RECORD_MAX - 11]
BIG = [1 << 20, (16 << 20) + 3]


def seqpacket_pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def _echo(conn, count: int) -> None:
    """Send back each message, as bytes and as an object holding it out of band."""
    for _ in range(count):
        data = conn.recv_bytes(timeout=WAIT)
        conn.send_bytes(data)
        conn.send(pickle.PickleBuffer(bytearray(data)))
    conn.close()


@pytest.fixture(params=["fork", "spawn"])
def echo_child(request, impl):
    """(parent's end, child) with the child echoing over the other end of a duplex Pipe()."""
    a, b = impl.pipe(True)
    ctx = multiprocessing.get_context(request.param)
    sizes = SIZES + BIG
    child = ctx.Process(target=_echo, args=(b, len(sizes)))
    child.start()
    b.close()
    try:
        yield a, child, sizes
    finally:
        a.close()
        child.join(WAIT)
        if child.is_alive():
            child.kill()
            child.join()


def test_frames_of_every_size_cross_records_both_ways(impl, echo_child):
    conn, child, sizes = echo_child
    assert conn._records
    for i, n in enumerate(sizes):
        data = payload(n, i)
        conn.send_bytes(data)
        assert conn.recv_bytes(timeout=WAIT) == data, n
        back = conn.recv(timeout=WAIT)
        assert bytes(back) == data, n
    child.join(WAIT)
    assert child.exitcode == 0


@pytest.mark.parametrize("n", SIZES + BIG)
def test_recv_bytes_into_takes_each_size_whole(impl, n):
    r, w = impl.pipe(True)
    with r, w:
        data = payload(n)
        t = threading.Thread(target=w.send_bytes, args=(data,))  # more than the buffers hold
        t.start()
        buf = bytearray(n + 7)
        assert r.recv_bytes_into(buf, 7, timeout=WAIT) == n
        assert bytes(buf[7:]) == data
        t.join(WAIT)
        assert not t.is_alive()


def test_a_read_never_takes_a_byte_past_its_frame(impl):
    # Each frame is its own record: after one recv_bytes the fd still shows the next frame
    # to select(), as a stdlib wait() on fileno() would need.
    r, w = impl.pipe(True)
    with r, w:
        for i in range(3):
            w.send_bytes(payload(100, i))
        for i in range(3):
            assert select.select([r.fileno()], [], [], 0)[0] == [r.fileno()]
            assert r.recv_bytes(timeout=WAIT) == payload(100, i)
        assert select.select([r.fileno()], [], [], 0)[0] == []


def test_records_that_hold_several_frames_or_cross_a_frames_end(impl):
    # A foreign writer may pack frames into records as it likes, within RECORD_MAX: several
    # small frames in one record, or a record that ends one large frame and starts the next.
    a, b = seqpacket_pair()
    conn = impl.Connection(a.detach())
    with conn, b:
        small = [payload(10, i) for i in range(3)]
        b.send(b"".join(frame(x) for x in small))
        big, after = payload(3 * RECORD_MAX), payload(50, 9)
        stream = frame(big) + frame(after)
        for k in range(0, len(stream), RECORD_MAX):
            b.send(stream[k : k + RECORD_MAX])
        for x in small:
            assert conn.recv_bytes(timeout=WAIT) == x
        assert conn.recv_bytes(timeout=WAIT) == big
        assert conn.recv_bytes(timeout=WAIT) == after


def test_a_frames_later_records_may_be_long_but_never_run_past_its_end(impl):
    # After a frame's first record (read into the buffer), its records may be as long as the
    # rest of the frame: a reader takes them straight into the payload. One that also holds
    # the next frame's start cannot be read whole there: FrameError, not a hole in the stream.
    a, b = seqpacket_pair()
    conn = impl.Connection(a.detach())
    with conn, b:
        data = payload(3 * RECORD_MAX)
        stream = frame(data)
        b.send(stream[:RECORD_MAX])
        b.send(stream[RECORD_MAX:])  # over two RECORD_MAX long, the frame's end
        assert conn.recv_bytes(timeout=WAIT) == data
        b.send(stream[:RECORD_MAX])
        b.send(stream[RECORD_MAX:] + frame(b"next"))  # runs past the frame's end
        with pytest.raises(FrameError, match="record of the socket was longer"):
            conn.recv_bytes(timeout=WAIT)


def test_a_record_too_long_to_read_breaks_the_stream_with_an_error_that_says_so(impl):
    a, b = seqpacket_pair()
    conn = impl.Connection(a.detach())
    with conn, b:
        b.send(frame(payload(2 * RECORD_MAX)))  # one record: longer than any read's room
        with pytest.raises(
            FrameError,
            match=r"record of the socket was longer than the 65,5\d\d bytes its read had room",
        ):
            conn.recv_bytes(timeout=WAIT)
        b.send(frame(b"later"))
        with pytest.raises(FrameError, match="broken"):
            conn.recv_bytes(timeout=WAIT)


def test_a_message_over_maxlength_is_dropped_whole_and_the_connection_goes_on(impl):
    # Its records after the first are longer than the read buffer: they are dropped whole.
    r, w = impl.pipe(True)
    with r, w:
        big = payload(3_000_000)
        t = threading.Thread(target=lambda: (w.send_bytes(big), w.send_bytes(b"after")))
        t.start()
        with pytest.raises(MessageTooLong):
            r.recv_bytes(10, timeout=WAIT)
        assert r.recv_bytes(timeout=WAIT) == b"after"
        t.join(WAIT)
        assert not t.is_alive()


def _owned_by_the_caller(impl):
    a, b = seqpacket_pair()
    return a, b, impl.Connection(a.fileno(), closefd=False)


def test_closing_a_connection_over_a_callers_socket_leaves_the_socket_working(impl):
    # closefd=False: a close() that wakes a thread waiting for data must not shut the
    # caller's socket down (its reads wait in poll(), woken by the wake fd).
    a, b, conn = _owned_by_the_caller(impl)
    with a, b:
        result: list[BaseException] = []
        t = threading.Thread(target=lambda: _catch(conn.recv_bytes, result))
        t.start()
        time.sleep(0.1)  # let it block (if not yet, it sees the close anyway)
        conn.close()
        t.join(WAIT)
        assert not t.is_alive() and isinstance(result[0], OSError)
        b.send(b"still")  # both ways still work on the caller's sockets
        assert a.recv(10) == b"still"
        a.send(b"back")
        assert b.recv(10) == b"back"


def _catch(fn, into: list[BaseException]) -> None:
    try:
        fn()
    except BaseException as exc:  # noqa: BLE001 - checked by the test
        into.append(exc)


def test_a_small_send_buffer_cuts_smaller_records(impl):
    a, b = seqpacket_pair()
    b.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)
    room = b.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
    assert room < 2 * RECORD_MAX  # else this test tests nothing
    reader = impl.Connection(a.detach())
    writer = impl.Connection(b.detach())
    with reader, writer:
        data = payload(1 << 20)
        t = threading.Thread(target=writer.send_bytes, args=(data,))
        t.start()
        assert reader.recv_bytes(timeout=WAIT) == data
        t.join(WAIT)
        assert not t.is_alive()


def test_a_stream_socket_still_reads_as_a_stream(impl):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    conn = impl.Connection(a.detach())
    with conn, b:
        assert not conn._records
        stream = frame(b"one") + frame(payload(100_000))
        b.sendall(stream[:5])
        b.sendall(stream[5:])
        assert conn.recv_bytes(timeout=WAIT) == b"one"
        assert conn.recv_bytes(timeout=WAIT) == payload(100_000)


def test_the_pair_is_two_fds_of_one_seqpacket_socketpair(impl):
    a, b = impl.pipe(True)
    with a, b:
        for c in (a, b):
            with socket.fromfd(c.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
                assert s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_SEQPACKET
            assert c._handles()[1:] == (c.fileno(), -1, -1)
        os.set_blocking(a.fileno(), True)  # reads must not depend on the description's flags
        b.send_bytes(b"x")
        assert a.recv_bytes(timeout=WAIT) == b"x"
