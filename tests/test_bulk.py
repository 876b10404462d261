"""The bulk channel of ``pipe()``: large payloads on a socketpair, headers in the pipe, in order.

Both cores. Children are module-level functions so spawn and forkserver children can import
them (pytest puts the tests directory on ``sys.path``).
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import select
import signal
import socket
import stat
import struct

import numpy as np
import pytest
from _fault_children import kill_and_wait_dead
from _helpers import LEN, START_METHODS, Background, nothing_left, payload, read_exactly, running

from framepipe import FrameError, ReadTimeout, WriterDied
from framepipe._wire import FRAME_RECORD_MAX, RECORD_MAX, pad_frame
from framepipe.errors import MessageTooLong

WAIT = 60.0  # upper bound on any blocking wait; a healthy run never comes close
MIB = 1 << 20

BULK = b"\x06\x06"


def bulk_header(n: int) -> bytes:
    return BULK + LEN.pack(n) + BULK


def raw_bulk_reader(impl):
    """A reading Connection over a raw os.pipe() plus a raw socketpair for its bulk channel:
    ``(conn, pipe write fd, bulk socket to write)``."""
    r, w = os.pipe()
    a, b = socket.socketpair()
    conn = impl.Connection(r, writable=False, bulk_handle=a.detach())
    return conn, w, b


# -- children ----------------------------------------------------------------------------------


def child_sends(conn) -> None:
    conn.send_bytes(payload(MIB, 1))
    conn.send(np.arange(MIB, dtype=np.int64))
    conn.send(payload(16 * MIB, 2))
    conn.send({"small": b"x", "big": payload(3 * MIB, 3), "arr": np.ones((512, 1024), np.float32)})
    conn.send_bytes(b"done")
    conn.close()


def child_echoes(conn) -> None:
    """Receive objects until None, answering each with its pickled digest and a copy."""
    while True:
        obj = conn.recv(timeout=WAIT)
        if obj is None:
            break
        conn.send(obj)
    conn.close()


def child_blocks_in_a_bulk_payload(conn, n: int) -> None:
    conn.send_bytes(b"before")
    conn.send_bytes(payload(n))  # far over the socket buffers: blocks until killed
    os._exit(0)


# -- the wire ----------------------------------------------------------------------------------


def test_large_frame_header_in_pipe_payload_on_bulk_fd(impl):
    r, w = impl.pipe(False)
    with r, w:
        data = payload(MIB)
        w.send_bytes(data)  # fits the socket buffers: no reader needed
        w.send_bytes(b"small")
        rfd, _, bfd, _ = r._handles()
        assert bfd >= 0
        # each message's first write padded to 256 bytes (see test_padding)
        assert read_exactly(rfd, 256) == bulk_header(MIB) + pad_frame(12)
        small = b"\x00\x00" + LEN.pack(5) + b"\x00\x00" + b"small"
        assert read_exactly(rfd, 256) == small + pad_frame(17)
        assert nothing_left(rfd)
        assert read_exactly(bfd, MIB) == data
        assert nothing_left(bfd)


def test_small_frames_stay_in_the_pipe(impl):
    r, w = impl.pipe(False)
    with r, w:
        w.send_bytes(payload(1000))
        w.send(payload(100_000))  # an out-of-band buffer under the bulk threshold
        assert r.recv_bytes(timeout=WAIT) == payload(1000)
        assert r.recv(timeout=WAIT) == payload(100_000)
        assert nothing_left(r._handles()[2])


def test_select_and_wait_see_a_bulk_frame(impl):
    import multiprocessing.connection as mpc

    r, w = impl.pipe(False)
    with r, w:
        w.send_bytes(payload(MIB))
        assert mpc.wait([r], 0) == [r]
        assert select.select([r.fileno()], [], [], 0)[0] == [r.fileno()]
        assert r.recv_bytes(timeout=WAIT) == payload(MIB)
        assert mpc.wait([r], 0) == []


def read_records(fd: int, n: int) -> list[bytes]:
    """Records of the SOCK_SEQPACKET socket ``fd``, each read whole, until ``n`` bytes."""
    out: list[bytes] = []
    with socket.fromfd(fd, socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        while sum(map(len, out)) < n:
            r, _, _ = select.select([fd], [], [], WAIT)
            assert r, f"nothing to read after {WAIT} s"
            record = s.recv(2 * FRAME_RECORD_MAX)
            assert record, "unexpected end of file"
            out.append(record)
    return out


def test_a_duplex_pipe_is_one_seqpacket_socketpair_that_carries_frames_in_records(impl):
    # Two fds in all, no bulk channel: every frame travels in order on the socket, cut into
    # records: a large frame's first of RECORD_MAX bytes, its others of at most
    # FRAME_RECORD_MAX, and a small frame is one record, header and payload.
    r, w = impl.pipe(True)
    with r, w:
        assert r._handles()[2:] == (-1, -1)
        assert stat.S_ISSOCK(os.fstat(r.fileno()).st_mode)
        with socket.fromfd(r.fileno(), socket.AF_UNIX, socket.SOCK_STREAM) as s:
            assert s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_SEQPACKET
        assert r._records and w._records
        w.send_bytes(payload(MIB))
        w.send_bytes(b"small")
        small = b"\x00\x00" + LEN.pack(5) + b"\x00\x00" + b"small"
        records = read_records(r.fileno(), 12 + MIB + len(small))
        assert b"".join(records) == b"\x00\x00" + LEN.pack(MIB) + b"\x00\x00" + payload(MIB) + small
        assert len(records[0]) == RECORD_MAX
        assert 2 <= len(records) - 1 <= 1 + MIB // RECORD_MAX  # the 1 MiB frame, then "small"
        assert max(len(x) for x in records[1:-1]) <= FRAME_RECORD_MAX
        assert records[-1] == small
        assert nothing_left(r.fileno())


# -- round trips -------------------------------------------------------------------------------


@pytest.mark.parametrize("duplex", [False, True], ids=["simplex", "duplex"])
@pytest.mark.parametrize("n", [MIB, 16 * MIB], ids=["1MiB", "16MiB"])
def test_send_bytes_recv_bytes(impl, duplex, n):
    r, w = impl.pipe(duplex)
    with r, w:
        data = [payload(n, i) for i in range(3)]
        sender = Background(lambda: [w.send_bytes(d) for d in data])
        for d in data:
            got = r.recv_bytes(timeout=WAIT)
            assert type(got) is bytes and got == d
        sender.join()


@pytest.mark.parametrize("n", [MIB, 16 * MIB], ids=["1MiB", "16MiB"])
def test_recv_bytes_into(impl, n):
    r, w = impl.pipe(True)
    with r, w:
        data = payload(n)
        sender = Background(w.send_bytes, data)
        buf = bytearray(n + 10)
        assert r.recv_bytes_into(buf, 7, timeout=WAIT) == n
        assert buf[7 : 7 + n] == data
        sender.join()
        sender = Background(w.send_bytes, data)
        with pytest.raises(Exception) as info:  # too small: BufferTooShort carries the message
            r.recv_bytes_into(bytearray(n - 1), timeout=WAIT)
        assert info.value.args[0] == data
        sender.join()


def test_send_objects_from_a_thread(impl):
    r, w = impl.pipe(False)
    with r, w:
        arr = np.random.default_rng(0).integers(0, 1 << 30, 4 * MIB, dtype=np.int32)
        objs = [
            arr,
            payload(2 * MIB),
            bytearray(payload(MIB, 9)),
            {"a": arr[:1000], "b": [np.zeros(MIB), payload(300_000)], "c": "text"},
        ]
        sender = Background(lambda: [w.send(o) for o in objs])
        got = [r.recv(timeout=WAIT) for _ in objs]
        sender.join()
        assert np.array_equal(got[0], arr) and got[0].flags.writeable
        assert type(got[1]) is bytes and got[1] == objs[1]
        assert type(got[2]) is bytearray and got[2] == objs[2]
        assert np.array_equal(got[3]["a"], arr[:1000])
        assert np.array_equal(got[3]["b"][0], np.zeros(MIB))
        assert got[3]["b"][1] == payload(300_000) and got[3]["c"] == "text"


def test_recv_bytes_of_an_object_with_bulk_buffers(impl):
    r, w = impl.pipe(False)
    with r, w:
        arr = np.arange(MIB, dtype=np.int32)
        sender = Background(w.send, arr)
        assert np.array_equal(pickle.loads(r.recv_bytes(timeout=WAIT)), arr)
        sender.join()


def test_message_too_long_discards_a_bulk_payload(impl):
    r, w = impl.pipe(False)
    with r, w:
        sender = Background(lambda: (w.send_bytes(payload(3 * MIB)), w.send_bytes(b"next")))
        with pytest.raises(MessageTooLong):
            r.recv_bytes(1000, timeout=WAIT)
        assert r.recv_bytes(timeout=WAIT) == b"next"
        sender.join()


@pytest.mark.parametrize("method", START_METHODS)
def test_child_sends_through_a_bulk_pipe(impl, method):
    r, w = impl.pipe(False)
    with r, running(method, child_sends, w) as proc:
        w.close()
        assert r.recv_bytes(timeout=WAIT) == payload(MIB, 1)
        assert np.array_equal(r.recv(timeout=WAIT), np.arange(MIB, dtype=np.int64))
        assert r.recv(timeout=WAIT) == payload(16 * MIB, 2)
        obj = r.recv(timeout=WAIT)
        assert obj["small"] == b"x" and obj["big"] == payload(3 * MIB, 3)
        assert np.array_equal(obj["arr"], np.ones((512, 1024), np.float32))
        assert r.recv_bytes(timeout=WAIT) == b"done"
        with pytest.raises(EOFError):
            r.recv_bytes(timeout=WAIT)
        proc.join(WAIT)
        assert proc.exitcode == 0


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_child_echoes_through_a_duplex_bulk_pipe(impl, method):
    a, b = impl.pipe(True)
    with a, running(method, child_echoes, b) as proc:
        b.close()
        objs = [payload(16 * MIB), np.arange(2 * MIB, dtype=np.float64), b"tiny"]
        for obj in objs:
            a.send(obj)
            got = a.recv(timeout=WAIT)
            if isinstance(obj, np.ndarray):
                assert np.array_equal(got, obj)
            else:
                assert got == obj
        a.send(None)
        proc.join(WAIT)
        assert proc.exitcode == 0


# -- timeouts, deaths, protocol errors ---------------------------------------------------------


@pytest.mark.parametrize("into", [False, True], ids=["recv_bytes", "recv_bytes_into"])
def test_timeout_in_the_middle_of_a_bulk_payload_then_resume(impl, into):
    conn, pw, sock = raw_bulk_reader(impl)
    with conn, sock:
        n = 2 * MIB
        data = payload(n)
        os.write(pw, bulk_header(n))
        sock.sendall(data[:65536])  # fits the socket buffer
        buf = bytearray(n)
        for _ in range(2):  # nothing lost across repeated timeouts
            with pytest.raises(ReadTimeout):
                if into:
                    conn.recv_bytes_into(buf, timeout=0.05)
                else:
                    conn.recv_bytes(timeout=0.05)
            assert conn.poll(0) is False  # all that arrived is taken; poll watches the bulk fd
        # The rest arrives from a thread (more than the socket buffer holds at once).
        sender = Background(sock.sendall, data[65536:])
        if into:
            assert conn.recv_bytes_into(buf, timeout=WAIT) == n
            assert buf == data
        else:
            assert conn.recv_bytes(timeout=WAIT) == data
        sender.join()
        os.write(pw, b"\x00\x00" + LEN.pack(2) + b"\x00\x00ok")
        assert conn.recv_bytes(timeout=WAIT) == b"ok"
        os.close(pw)
        with pytest.raises(EOFError):
            conn.recv_bytes(timeout=WAIT)


def test_end_of_file_on_the_bulk_fd_mid_payload_is_truncated(impl):
    conn, pw, sock = raw_bulk_reader(impl)
    with conn:
        os.write(pw, bulk_header(1000))
        sock.sendall(b"x" * 300)
        sock.close()
        with pytest.raises(FrameError, match="after 312 of the 1,012 bytes"):
            conn.recv_bytes(timeout=WAIT)
    os.close(pw)


@pytest.mark.parametrize("close_writer", [True, False], ids=["writer-closed", "writer-kept"])
@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_writer_killed_in_the_middle_of_a_bulk_payload(impl, method, close_writer):
    n = 64 * MIB
    r, w = impl.pipe(False)
    proc = multiprocessing.get_context(method).Process(
        target=child_blocks_in_a_bulk_payload, args=(w, n)
    )
    proc.start()
    try:
        if close_writer:
            w.close()  # else only the pidfd can tell the writer is gone
        r.watch(proc)
        assert r.recv_bytes(timeout=WAIT) == b"before"
        assert r.poll(WAIT)  # the header is in the pipe
        # Part of the payload is on the bulk fd; the rest cannot fit: the child is blocked.
        assert select.select([r._handles()[2]], [], [], WAIT)[0]
        kill_and_wait_dead(proc.pid)  # else the frame may still arrive whole
        with pytest.raises(WriterDied) as info:
            r.recv_bytes(timeout=WAIT)
        err = info.value
        assert err.exitcode == -signal.SIGKILL
        assert err.expected_bytes == n + 12
        assert 12 < err.lost_bytes < err.expected_bytes
    finally:
        proc.join(WAIT)
        r.close()
        w.close()


def test_bulk_header_without_a_bulk_channel_is_a_frame_error(impl):
    r, w = os.pipe()
    conn = impl.Connection(r, writable=False)
    with conn:
        os.write(w, b"\x00\x00" + LEN.pack(2) + b"\x00\x00hi" + bulk_header(MIB))
        assert conn.recv_bytes(timeout=WAIT) == b"hi"
        with pytest.raises(FrameError, match="no bulk channel"):
            conn.recv_bytes(timeout=WAIT)
        with pytest.raises(FrameError, match="broken"):
            conn.recv_bytes(timeout=WAIT)
    os.close(w)


def test_bulk_handle_arguments(impl):
    r, w = os.pipe()
    a, b = socket.socketpair()
    try:
        with pytest.raises(ValueError):
            impl.Connection(r, bulk_write_handle=b.fileno(), closefd=False)
        with pytest.raises(ValueError):
            impl.Connection(
                r,
                writable=False,
                bulk_handle=a.fileno(),
                bulk_write_handle=b.fileno(),
                closefd=False,
            )
        with pytest.raises(ValueError):
            impl.Connection(r, writable=False, bulk_handle=-1, closefd=False)
        c = impl.Connection(r, writable=False, bulk_handle=a.fileno(), closefd=False)
        assert c._handles() == (r, r, a.fileno(), -1)
        c.close()
        c = impl.Connection(w, readable=False, bulk_handle=b.fileno(), closefd=False)
        assert c._handles() == (w, w, -1, b.fileno())
        c.close()
    finally:
        for fd in (r, w):
            os.close(fd)
        a.close()
        b.close()


# -- threads and fds ---------------------------------------------------------------------------


def test_four_threads_interleaving_small_and_large_frames(impl):
    r, w = impl.pipe(False)
    sizes = [10, 400_000, 100, 2 * MIB, 5000, 256 * 1024, 0, MIB + 3]
    rounds = 6

    def send(tid: int) -> None:
        for i in range(rounds):
            for j, n in enumerate(sizes):
                tag = struct.pack("III", tid, i, j)
                if j % 2:
                    w.send(tag + payload(n, tid))
                else:
                    w.send_bytes(b"B" + tag + payload(n, tid))  # a pickle starts with 80

    with r, w:
        senders = [Background(send, t) for t in range(4)]
        seen = {t: [] for t in range(4)}
        for _ in range(4 * rounds * len(sizes)):
            msg = r.recv_bytes(timeout=WAIT)
            msg = msg[1:] if msg[:1] == b"B" else pickle.loads(msg)
            tid, i, j = struct.unpack_from("III", msg)
            assert msg[12:] == payload(sizes[j], tid)
            seen[tid].append((i, j))
        for s in senders:
            s.join()
        want = [(i, j) for i in range(rounds) for j in range(len(sizes))]
        assert all(seen[t] == want for t in range(4))


@pytest.mark.parametrize("duplex", [False, True], ids=["simplex", "duplex"])
def test_fd_count_unchanged_after_many_pipes(impl, duplex, fd_count):
    gc.collect()
    before = fd_count()
    for i in range(2000):
        a, b = impl.pipe(duplex)
        if i % 100 == 0:
            b.send_bytes(payload(300_000))
            assert a.recv_bytes(timeout=WAIT) == payload(300_000)
        a.close()
        b.close()
    assert fd_count() == before
