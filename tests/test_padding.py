"""Padded small messages on a pipe with a bulk channel (see ``framepipe._wire.PAD_MIN``).

Where both ends are framepipe's (a connection with a bulk channel), a message's first write on
the pipe is at least 256 bytes, a shorter one ended by a PAD frame, and a reader reads 256 bytes
at a message's start: one read() takes a small message whole and never a byte of the next one.
Both cores, real pipes, real children.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import select
import struct

import pytest

from framepipe import FrameError

WAIT = 60.0
LEN = struct.Struct("Q")
PAD_MIN = 256  # restated: the wire's rule, not read from the library under test
SIZES = [0, 1, 63, 64, 200, 231, 232, 233, 243, 244, 245, 255, 256, 1000, 16383]


def data_frame(payload: bytes) -> bytes:
    return b"\x00\x00" + LEN.pack(len(payload)) + b"\x00\x00" + payload


def pad_after(first: int) -> bytes:
    """What the wire rule puts after a first write of ``first`` bytes."""
    if first >= PAD_MIN:
        return b""
    n = max(PAD_MIN - first - 12, 0)
    return b"\x07\x07" + LEN.pack(n) + b"\x07\x07" + bytes(n)


def readable(fd: int) -> bool:
    return bool(select.select([fd], [], [], 0)[0])


def drain(fd: int) -> bytes:
    out = b""
    while readable(fd):
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        out += chunk
    return out


def test_a_one_way_pipe_pads_each_small_message_to_256_bytes(impl):
    r, w = impl.pipe(False)
    with r, w:
        assert r._rpad and w._wpad
        for n in SIZES:
            w.send_bytes(b"m" * n)
            frame = data_frame(b"m" * n)
            assert drain(r.fileno()) == frame + pad_after(len(frame)), n


def test_a_bulk_header_is_padded_too(impl):
    r, w = impl.pipe(False)
    with r, w:
        w.send_bytes(b"x" * (1 << 20))
        header = b"\x06\x06" + LEN.pack(1 << 20) + b"\x06\x06"
        assert drain(r.fileno()) == header + pad_after(12)
        assert r._handles()[2] >= 0  # the payload waits on the bulk channel


def test_pipes_without_a_bulk_channel_never_pad(impl):
    # The reference format, byte for byte: nothing but frames.
    rfd, wfd = os.pipe()
    w = impl.Connection(wfd, readable=False)
    with w:
        assert not w._wpad
        w.send_bytes(b"abc")
        assert drain(rfd) == data_frame(b"abc")
    os.close(rfd)
    a, b = impl.pipe(True)  # a seqpacket socketpair: one record a message already
    with a, b:
        assert not a._wpad and not a._rpad


@pytest.mark.parametrize("n", SIZES)
def test_the_pipe_is_readable_exactly_while_a_message_is_left(impl, n):
    r, w = impl.pipe(False)
    with r, w:
        for _ in range(3):
            w.send_bytes(b"q" * n)
        for left in (2, 1, 0):
            assert r.recv_bytes(timeout=WAIT) == b"q" * n
            assert readable(r.fileno()) == bool(left)  # no PAD left behind, no message taken
            assert r.poll(0) == bool(left)
        assert not r._has_buffered()


def test_objects_errors_and_async_sends_are_padded_and_read(impl):
    r, w = impl.pipe(False)
    with r, w:
        w.send({"k": [1, 2, 3]})
        w.send(b"z" * 100_000)  # an object with a buffer on the bulk channel
        w.send_exception(KeyError("gone"))
        asyncio.run(w.send_bytes_async(b"from a coroutine"))
        asyncio.run(w.send_async(("tuple", 7)))
        assert r.recv(timeout=WAIT) == {"k": [1, 2, 3]}
        assert r.recv(timeout=WAIT) == b"z" * 100_000
        with pytest.raises(KeyError):
            r.recv(timeout=WAIT)
        assert r.recv_bytes(timeout=WAIT) == b"from a coroutine"
        assert r.recv(timeout=WAIT) == ("tuple", 7)
        assert not readable(r.fileno()) and not r.poll(0)


def test_a_reader_without_a_bulk_channel_skips_the_pads(impl):
    # A padded writer read by a plain connection over a dup of the read end.
    r, w = impl.pipe(False)
    plain = impl.Connection(os.dup(r.fileno()), writable=False)
    with r, w, plain:
        assert not plain._rpad
        for n in (5, 300, 20_000):
            w.send_bytes(b"p" * n)
        assert plain.recv_bytes(timeout=WAIT) == b"p" * 5
        assert plain.recv_bytes(timeout=WAIT) == b"p" * 300
        # the 20,000 B payload went to the bulk channel, which only ``r`` reads
        assert r.recv_bytes(timeout=WAIT) == b"p" * 20_000


def test_a_padded_reader_reads_an_unpadded_writer(impl):
    r, w = impl.pipe(False)
    plain = impl.Connection(os.dup(w.fileno()), readable=False)
    with r, w, plain:
        assert not plain._wpad
        messages = [b"a" * n for n in (0, 3, 100, 255, 256, 257, 5000)]
        for m in messages:
            plain.send_bytes(m)
        assert [r.recv_bytes(timeout=WAIT) for _ in messages] == messages


def test_a_pad_longer_than_its_limit_breaks_the_stream(impl):
    r, w = impl.pipe(False)
    with r, w:
        os.write(w.fileno(), b"\x07\x07" + LEN.pack(PAD_MIN + 1) + b"\x07\x07")
        with pytest.raises(FrameError, match="07 07"):
            r.recv_bytes(timeout=WAIT)


def test_a_message_before_a_bad_pad_is_delivered_and_the_next_read_says_why(impl):
    r, w = impl.pipe(False)
    with r, w:
        bad = b"\x07\x07" + LEN.pack(PAD_MIN + 1) + b"\x07\x07"
        os.write(w.fileno(), data_frame(b"kept") + bad)
        assert r.recv_bytes(timeout=WAIT) == b"kept"
        with pytest.raises(FrameError, match="PAD frame"):
            r.recv_bytes(timeout=WAIT)


def test_any_number_of_pads_in_a_row_is_skipped(impl):
    # Skipped in a loop: 200,000 of them (2.4 MB) once crashed the compiled reader's stack.
    import threading

    r, w = impl.pipe(False)
    with r, w:
        pads = (b"\x07\x07" + LEN.pack(0) + b"\x07\x07") * 200_000 + data_frame(b"after")
        writer = threading.Thread(target=os.write, args=(w.fileno(), pads))
        writer.start()
        try:
            assert r.recv_bytes(timeout=WAIT) == b"after"
        finally:
            writer.join(WAIT)
        assert not writer.is_alive()


def test_a_frame_is_not_held_back_by_a_pad_that_has_not_arrived(impl):
    # A framepipe writer sends the PAD in the frame's own write; one that does not must not
    # make the reader wait for it: the frame is returned, the next read finishes the PAD.
    import time

    r, w = impl.pipe(False)
    with r, w:
        pad = pad_after(17)
        os.write(w.fileno(), data_frame(b"first") + pad[:5])
        started = time.monotonic()
        assert r.recv_bytes(timeout=WAIT) == b"first"
        assert time.monotonic() - started < WAIT / 4
        os.write(w.fileno(), pad[5:] + data_frame(b"second"))
        assert r.recv_bytes(timeout=WAIT) == b"second"
        assert not readable(r.fileno()) and not r._has_buffered()


def test_a_pad_is_not_held_to_max_size(impl):
    rfd, wfd = os.pipe()
    import socket

    a, b = socket.socketpair()
    r = impl.Connection(rfd, writable=False, bulk_handle=a.detach(), max_size=8)
    w = impl.Connection(wfd, readable=False, bulk_handle=b.detach())
    with r, w:
        w.send_bytes(b"12345678")  # a 236-byte PAD follows, over max_size, and is skipped
        assert r.recv_bytes(timeout=WAIT) == b"12345678"
        w.send_bytes(b"123456789")
        with pytest.raises(FrameError, match="max_size"):
            r.recv_bytes(timeout=WAIT)


def _send_sizes(conn) -> None:
    for n in SIZES:
        conn.send_bytes(bytes([n % 251]) * n)
    conn.close()


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_a_child_writes_padded_messages_the_parent_reads(impl, method, no_leftover_processes):
    r, w = impl.pipe(False)
    process = multiprocessing.get_context(method).Process(target=_send_sizes, args=(w,))
    process.start()
    try:
        w.close()
        for n in SIZES:
            assert r.recv_bytes(timeout=WAIT) == bytes([n % 251]) * n
            assert not r._has_buffered()  # each read stopped at its message's PAD
        with pytest.raises(EOFError):
            r.recv_bytes(timeout=WAIT)
    finally:
        process.join(WAIT)
        if process.is_alive():
            process.kill()
            process.join()
        r.close()
    assert process.exitcode == 0
