"""The bytes on the wire, checked against the format written out here by hand.

frame    := CHECK(2) + u64 length (struct "Q", native order) + CHECK(2) + payload, CHECK = 00 00
TIMEOUT  := 01 01 alone at a frame boundary
DEAD     := 02 02 + u64 status word at a frame boundary (the exit code, when it exited)
"""

from __future__ import annotations

import os
import pickle
import random
import signal
import socket
import struct

import pytest
from _helpers import (
    TIMEOUT,
    Background,
    frame,
    nothing_left,
    read_exactly,
    write_all,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import framepipe

LEN = struct.Struct("Q")
CHECK = b"\x00\x00"


def payload_of(n: int) -> bytes:
    return random.Random(n).randbytes(n)


class RawWriter(int):
    """A raw write fd that is closed once, whoever closes it first."""

    closed = False

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            os.close(self)


@pytest.fixture
def raw_to_conn(impl):
    """(conn reading an os.pipe, the raw write fd)."""
    r, w = os.pipe()
    conn = impl.Connection(r, writable=False)
    w = RawWriter(w)
    yield conn, w
    conn.close()
    w.close()


@pytest.fixture
def conn_to_raw(impl):
    """(conn writing to an os.pipe, the raw read fd)."""
    r, w = os.pipe()
    conn = impl.Connection(w, readable=False)
    yield conn, r
    conn.close()
    os.close(r)


SIZES = [0, 1, 65_537, 16 * 1024 * 1024]


# --- decoding: hand-built frames -> recv_bytes ----------------------------------------------


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n}B")
def test_hand_built_frame_is_received(raw_to_conn, n):
    conn, w = raw_to_conn
    data = payload_of(n)
    writer = Background(write_all, w, frame(data))
    got = conn.recv_bytes(timeout=TIMEOUT)
    writer.join()
    assert type(got) is bytes
    assert len(got) == n
    assert got == data


def test_hand_built_frames_back_to_back_in_one_write(raw_to_conn):
    conn, w = raw_to_conn
    payloads = [b"", b"a", b"bc", payload_of(300), b""]
    os.write(w, b"".join(frame(p) for p in payloads))
    assert [conn.recv_bytes(timeout=TIMEOUT) for _ in payloads] == payloads
    w.close()
    with pytest.raises(EOFError):
        conn.recv_bytes(timeout=TIMEOUT)


# --- encoding: send_bytes -> raw bytes ------------------------------------------------------


@pytest.mark.parametrize("n", SIZES, ids=lambda n: f"{n}B")
def test_send_bytes_writes_the_reference_frame(conn_to_raw, n):
    conn, r = conn_to_raw
    data = payload_of(n)
    writer = Background(conn.send_bytes, data)
    head = read_exactly(r, 12)
    assert head[:2] == b"\x00\x00"
    assert LEN.unpack(head[2:10])[0] == n
    assert head[10:12] == b"\x00\x00"
    body = read_exactly(r, n)
    writer.join()
    assert body == data
    assert nothing_left(r)


def test_duplex_pipe_writes_the_same_bytes(impl):
    a, b = impl.pipe(duplex=True)
    with a, b:
        a.send_bytes(b"hello")
        a.send_bytes(b"")
        assert read_exactly(b.fileno(), 17 + 12) == frame(b"hello") + frame(b"")
        assert nothing_left(b.fileno())


def test_connection_over_a_socket_reads_and_writes_frames(impl):
    s1, s2 = socket.socketpair()
    with s1, s2:
        conn = impl.Connection(os.dup(s1.fileno()))
        with conn:
            conn.send_bytes(b"over a socket")
            assert read_exactly(s2.fileno(), 25) == frame(b"over a socket")
            assert nothing_left(s2.fileno())
            s2.sendall(frame(b"back") + frame(b""))
            assert conn.recv_bytes(timeout=TIMEOUT) == b"back"
            assert conn.recv_bytes(timeout=TIMEOUT) == b""


def test_send_bytes_offset_and_size_frame_only_the_slice(conn_to_raw):
    conn, r = conn_to_raw
    conn.send_bytes(b"0123456789", 2, 5)
    assert read_exactly(r, 17) == frame(b"23456")
    assert nothing_left(r)


def test_send_of_a_small_object_is_an_in_band_pickle_data_frame(conn_to_raw):
    # What a reference reader expects: one data frame whose payload pickle.loads reads.
    conn, r = conn_to_raw
    obj = {"a": [1, 2.5, "three"], "b": (None, True)}
    conn.send(obj)
    head = read_exactly(r, 12)
    assert head[:2] == head[10:12] == b"\x00\x00"
    body = read_exactly(r, LEN.unpack(head[2:10])[0])
    assert pickle.loads(body) == obj
    assert nothing_left(r)


# --- sentinels --------------------------------------------------------------------------------


def test_timeout_sentinel_raises_read_timeout_and_the_next_frame_follows(raw_to_conn):
    conn, w = raw_to_conn
    os.write(w, b"\x01\x01" + frame(b"after"))
    with pytest.raises(framepipe.ReadTimeout) as info:
        conn.recv_bytes(timeout=TIMEOUT)
    assert isinstance(info.value, TimeoutError)
    assert conn.recv_bytes(timeout=TIMEOUT) == b"after"


def test_timeout_sentinel_after_a_frame(raw_to_conn):
    conn, w = raw_to_conn
    os.write(w, frame(b"first") + b"\x01\x01")
    assert conn.recv_bytes(timeout=TIMEOUT) == b"first"
    with pytest.raises(framepipe.ReadTimeout):
        conn.recv(timeout=TIMEOUT)


def test_timeout_sentinel_split_across_writes(raw_to_conn):
    conn, w = raw_to_conn
    os.write(w, b"\x01")
    with pytest.raises(framepipe.ReadTimeout):
        conn.recv_bytes(timeout=0.05)  # half a sentinel: the read's own deadline
    os.write(w, b"\x01" + frame(b"x"))
    with pytest.raises(framepipe.ReadTimeout):
        conn.recv_bytes(timeout=TIMEOUT)  # now the whole sentinel
    assert conn.recv_bytes(timeout=TIMEOUT) == b"x"


@pytest.mark.parametrize(
    "exitcode, signal_name",
    [
        (0, None),
        (3, None),
        (137, None),
        (-signal.SIGKILL, "SIGKILL"),
        (-signal.SIGTERM, "SIGTERM"),
        (-signal.SIGSEGV, "SIGSEGV"),
        (None, None),
    ],
)
def test_dead_sentinel_raises_writer_died(raw_to_conn, exitcode, signal_name):
    # A plain exit code is its own status word; signals and "unknown" have the encoding that
    # framepipe's watcher writes (framepipe.watch.dead_status_word).
    from framepipe.watch import dead_status_word

    status = dead_status_word(exitcode)
    if exitcode is not None and exitcode >= 0:
        assert status == exitcode
    conn, w = raw_to_conn
    os.write(w, frame(b"last words") + b"\x02\x02" + LEN.pack(status))
    assert conn.recv_bytes(timeout=TIMEOUT) == b"last words"
    with pytest.raises(framepipe.WriterDied) as info:
        conn.recv_bytes(timeout=TIMEOUT)
    err = info.value
    assert type(err) is framepipe.WriterDied  # not a subclass: no fault record was read
    assert isinstance(err, EOFError)
    assert isinstance(err, OSError)
    assert err.exitcode == exitcode
    assert err.signal_name == signal_name


def test_signal_names_are_the_platforms_canonical_ones():
    # An alias (SIGIOT for 6, SIGCLD for SIGCHLD) never wins over the name the enum gives;
    # a number the platform does not name, and anything that is not a number, say SIG<n>.
    from framepipe.errors import signal_name

    for n in range(-1, 80):
        try:
            want = signal.Signals(n).name
        except ValueError:
            want = f"SIG{n}"
        assert signal_name(n) == want
    assert signal_name(signal.SIGABRT) == "SIGABRT"
    assert signal_name(None) == "SIGNone"  # type: ignore[arg-type]
    assert signal_name([6]) == "SIG[6]"  # type: ignore[arg-type]


def test_dead_sentinel_split_across_writes(raw_to_conn):
    conn, w = raw_to_conn
    dead = b"\x02\x02" + LEN.pack(7)
    os.write(w, dead[:5])
    with pytest.raises(framepipe.ReadTimeout):
        conn.recv(timeout=0.05)
    os.write(w, dead[5:])
    with pytest.raises(framepipe.WriterDied) as info:
        conn.recv(timeout=TIMEOUT)
    assert info.value.exitcode == 7


# --- any frames, any chunking -----------------------------------------------------------------

frame_sizes = st.lists(
    st.one_of(
        st.integers(0, 16),
        st.integers(0, 2_000),
        st.integers(60 * 1024, 200 * 1024),  # over the pipe buffer: straddles many reads
    ),
    min_size=1,
    max_size=8,
)
chunk_sizes = st.lists(
    st.one_of(st.just(1), st.integers(1, 13), st.integers(1, 4096), st.integers(1, 300_000)),
    min_size=1,
    max_size=12,
)


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(sizes=frame_sizes, chunks=chunk_sizes, seed=st.integers(0, 2**32))
def test_any_frames_in_any_chunking_read_back_exactly(impl, sizes, chunks, seed):
    rng = random.Random(seed)
    payloads = [rng.randbytes(n) for n in sizes]
    stream = b"".join(frame(p) for p in payloads)

    def write_chunked(w: int) -> None:
        pos, i, writes = 0, 0, 0
        while pos < len(stream):
            # Cycle through the drawn chunk sizes; cap the syscall count so a long stream of
            # 1-byte writes stays quick (the rest then goes in one write).
            n = chunks[i % len(chunks)] if writes < 20_000 else len(stream) - pos
            write_all(w, stream[pos : pos + n])
            pos += n
            i += 1
            writes += 1
        os.close(w)

    r, w = os.pipe()
    conn = impl.Connection(r, writable=False)
    writer = Background(write_chunked, w)
    try:
        got = [conn.recv_bytes(timeout=TIMEOUT) for _ in payloads]
        with pytest.raises(EOFError):
            conn.recv_bytes(timeout=TIMEOUT)
    finally:
        conn.close()  # a blocked writer then fails with EPIPE instead of hanging
        writer.thread.join(TIMEOUT)
    writer.join()
    assert [len(g) for g in got] == sizes
    assert got == payloads


# --- the header codec: _wire.decode_header restates csrc's fp_header_decode ------------------


@pytest.mark.parametrize(
    "data, want",
    [
        (b"", ("MORE", -1, 0, 2)),
        (b"\x00", ("MORE", -1, 0, 2)),
        (b"\x00\x00" + LEN.pack(5)[:3], ("MORE", 0, 0, 12)),
        (b"\x00\x00" + LEN.pack(5) + b"\x00\x00", ("OK", 0, 5, 12)),
        (b"\x06\x06" + LEN.pack(50) + b"\x06\x06", ("OK", 6, 50, 12)),
        (b"\x01\x01", ("OK", 1, 0, 2)),
        (b"\x02\x02" + LEN.pack(7)[:5], ("MORE", 2, 0, 10)),
        (b"\x02\x02" + LEN.pack(7), ("OK", 2, 7, 10)),
        (b"\x08\x08" + bytes(10), ("BAD_CHECK", -1, 0, 0)),
        (b"\x00\x01" + bytes(10), ("BAD_CHECK", -1, 0, 0)),
        (b"\x00\x00" + LEN.pack(5) + b"\x00\x03", ("MISMATCH", 0, 0, 12)),
        (b"\x00\x00" + LEN.pack(101) + b"\x00\x00", ("TOO_LARGE", 0, 101, 12)),
        (b"\x00\x00" + LEN.pack(2**64 - 1) + b"\x00\x00", ("TOO_LARGE", 0, 2**64 - 1, 12)),
        (b"\x07\x07" + LEN.pack(256) + b"\x07\x07", ("OK", 7, 256, 12)),  # a PAD, over cap
        (b"\x07\x07" + LEN.pack(257) + b"\x07\x07", ("TOO_LARGE", 7, 257, 12)),
    ],
    ids=[
        "empty",
        "one-byte",
        "short-header",
        "data",
        "bulk",
        "timeout",
        "short-dead",
        "dead",
        "unknown-kind",
        "unequal-checks",
        "mismatch",
        "over-cap",
        "2**64-1",
        "pad",
        "pad-over-256",
    ],
)
def test_decode_header(data, want):
    from framepipe import _wire

    status, kind, value, size = _wire.decode_header(b"junk" + data, 4, 100)
    assert (status, kind, value, size) == (getattr(_wire, want[0]), *want[1:])


@pytest.mark.parametrize("length", [100, 101, 2**62, 2**62 + 1, 2**63, 2**64 - 1])
def test_both_engines_refuse_the_same_lengths(impl, length):
    # The cap is the engine's (C: fp_header_decode, twin: decode_header), the same numbers.
    r, w = os.pipe()
    conn = impl.Connection(r, writable=False, max_size=None if length > 101 else 100)
    try:
        write_all(w, CHECK + LEN.pack(length) + CHECK + b"xy")
        os.close(w)
        w = -1
        with pytest.raises(framepipe.FrameError) as info:
            conn.recv_bytes(timeout=TIMEOUT)
        message = str(info.value)
        if length in (101, 2**62 + 1, 2**63, 2**64 - 1):  # over the cap: refused unallocated
            assert f"announces {length:,} bytes" in message, message
            assert "nothing was allocated" in message, message
        elif length == 2**62:  # at the cap: tried, and no process can hold it
            assert "more than this process could allocate" in message, message
        else:  # admitted: the 2 bytes that came are not the 100 announced
            assert "got end of file during message" in message, message
    finally:
        conn.close()
        if w >= 0:
            os.close(w)
