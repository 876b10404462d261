"""Connection: the behaviours of multiprocessing.connection, side by side with the stdlib, and
what framepipe adds (timeouts, frame errors, max_size, objects with out-of-band buffers)."""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import pickle
import re
import threading
import time
from array import array

import numpy as np
import pytest
from _helpers import F_SETPIPE_SZ, LEN, TIMEOUT, Background, frame, write_all

import framepipe


def outcome(fn):
    """``("ok", result)`` or ``(exception type, message)``."""
    try:
        return "ok", fn()
    except Exception as exc:  # noqa: BLE001
        return type(exc), str(exc)


@pytest.fixture(params=[True, False], ids=["duplex", "oneway"])
def pairs(request, impl):
    """``(framepipe pair, stdlib pair)``, both ``(reader, writer)``-ordered."""
    duplex = request.param
    fp = impl.pipe(duplex)
    mp = multiprocessing.Pipe(duplex)
    yield fp, mp
    for c in (*fp, *mp):
        c.close()


@pytest.fixture
def oneway(impl):
    r, w = impl.pipe(duplex=False)
    yield r, w
    r.close()
    w.close()


class RawPipe:
    """A Connection reading an os.pipe whose write end the test drives byte by byte."""

    def __init__(self, impl, **kwargs) -> None:
        r, self.w = os.pipe()
        self.conn = impl.Connection(r, writable=False, **kwargs)
        self.w_open = True

    def write(self, data: bytes) -> None:
        write_all(self.w, data)

    def close_writer(self) -> None:
        if self.w_open:
            self.w_open = False
            os.close(self.w)

    def close(self) -> None:
        self.conn.close()
        self.close_writer()


@pytest.fixture
def raw(impl):
    made = []

    def make(**kwargs) -> RawPipe:
        made.append(RawPipe(impl, **kwargs))
        return made[-1]

    yield make
    for p in made:
        p.close()


# --- side by side with multiprocessing.connection ---------------------------------------------

SEND_ARGS = [
    (b"abcdef", 0, None),
    (b"abcdef", 2, None),
    (b"abcdef", 2, 3),
    (b"abcdef", 6, None),
    (b"abcdef", 6, 0),
    (b"abcdef", 0, 6),
    (b"abcdef", -1, None),  # offset is negative
    (b"abcdef", 7, None),  # buffer length < offset
    (b"abcdef", 0, -1),  # size is negative
    (b"abcdef", 2, 5),  # buffer length < offset + size
    (b"abcdef", 7, 0),
    (b"", 0, None),
    (bytearray(b"xyz"), 1, 1),
    (array("i", [1, 2, 3, 4]), 4, 8),  # offset and size count bytes
    (array("i", [1, 2, 3, 4]), 0, 17),
    (array("d", [0.5, -1.0]), 0, None),
]


@pytest.mark.parametrize("buf, offset, size", SEND_ARGS)
def test_send_bytes_arguments_like_the_stdlib(pairs, buf, offset, size):
    (fr, fw), (mr, mw) = pairs
    fp = outcome(lambda: fw.send_bytes(buf, offset, size))
    mp = outcome(lambda: mw.send_bytes(buf, offset, size))
    assert fp == mp
    if fp[0] == "ok":
        assert fr.recv_bytes(timeout=TIMEOUT) == mr.recv_bytes()
    assert not fr.poll()


def test_send_bytes_memoryview_of_non_byte_items(pairs):
    (fr, fw), (mr, mw) = pairs
    data = array("i", range(-5, 1000))
    fw.send_bytes(memoryview(data))
    mw.send_bytes(memoryview(data))
    got = fr.recv_bytes(timeout=TIMEOUT)
    assert got == mr.recv_bytes() == data.tobytes()
    assert array("i", got) == data


@pytest.mark.parametrize(
    "bufsize, offset",
    [(10, 0), (10, 3), (5, 0), (8, 5), (10, 10), (10, 11), (10, -1), (4, 0)],
)
def test_recv_bytes_into_like_the_stdlib(pairs, bufsize, offset):
    (fr, fw), (mr, mw) = pairs
    msg = b"hello"
    fw.send_bytes(msg)
    mw.send_bytes(msg)
    fbuf, mbuf = bytearray(b"." * bufsize), bytearray(b"." * bufsize)
    fp = outcome(lambda: fr.recv_bytes_into(fbuf, offset, timeout=TIMEOUT))
    mp = outcome(lambda: mr.recv_bytes_into(mbuf, offset))
    if mp[0] is multiprocessing.BufferTooShort:
        # BufferTooShort's text is the message itself: compare through args below.
        assert fp[0] is multiprocessing.BufferTooShort
    else:
        assert fp == mp
    assert fbuf == mbuf
    if fp[0] == "ok" or fp[0] is multiprocessing.BufferTooShort:
        # The message was consumed; the connection is still usable.
        fw.send_bytes(b"next")
        mw.send_bytes(b"next")
        assert fr.recv_bytes(timeout=TIMEOUT) == mr.recv_bytes() == b"next"
    else:
        # The argument was refused before reading: the message is still there.
        assert fr.recv_bytes(timeout=TIMEOUT) == mr.recv_bytes() == msg


def test_buffer_too_short_carries_the_message(pairs):
    (fr, fw), (mr, mw) = pairs
    msg = bytes(range(200))
    fw.send_bytes(msg)
    mw.send_bytes(msg)
    with pytest.raises(multiprocessing.BufferTooShort) as fexc:
        fr.recv_bytes_into(bytearray(100), timeout=TIMEOUT)
    with pytest.raises(multiprocessing.BufferTooShort) as mexc:
        mr.recv_bytes_into(bytearray(100))
    assert fexc.value.args[0] == mexc.value.args[0] == msg
    fw.send_bytes(b"still usable")
    assert fr.recv_bytes(timeout=TIMEOUT) == b"still usable"


def test_recv_bytes_into_array_of_ints(pairs):
    (fr, fw), (mr, mw) = pairs
    data = array("i", [7, 8, 9])
    fw.send_bytes(data)
    mw.send_bytes(data)
    fbuf, mbuf = array("i", [0] * 5), array("i", [0] * 5)
    assert fr.recv_bytes_into(fbuf, 8, timeout=TIMEOUT) == mr.recv_bytes_into(mbuf, 8) == 12
    assert fbuf == mbuf == array("i", [0, 0, 7, 8, 9])


def test_recv_bytes_negative_maxlength(pairs):
    (fr, fw), (mr, mw) = pairs
    fw.send_bytes(b"abc")
    mw.send_bytes(b"abc")
    fp = outcome(lambda: fr.recv_bytes(-1))
    assert fp == outcome(lambda: mr.recv_bytes(-1))
    assert fp[0] is ValueError
    assert fr.recv_bytes(3, timeout=TIMEOUT) == mr.recv_bytes(3) == b"abc"


def _calls(conn):
    return {
        "send_bytes": lambda: conn.send_bytes(b"x"),
        "send": lambda: conn.send(1),
        "recv_bytes": lambda: conn.recv_bytes(),
        "recv_bytes_into": lambda: conn.recv_bytes_into(bytearray(10)),
        "recv": lambda: conn.recv(),
        "poll": lambda: conn.poll(),
        "fileno": lambda: conn.fileno(),
    }


def test_closed_connection_raises_oserror_on_every_method(pairs):
    (fr, fw), (mr, mw) = pairs
    for f, m in ((fr, mr), (fw, mw)):
        assert f.closed is m.closed is False
        f.close()
        m.close()
        assert f.closed is m.closed is True
        fcalls, mcalls = _calls(f), _calls(m)
        for name in fcalls:
            fp, mp = outcome(fcalls[name]), outcome(mcalls[name])
            assert fp == mp, name
            assert issubclass(fp[0], OSError), name
        f.close()  # closing again is harmless
        m.close()


def test_read_on_write_only_and_write_on_read_only(impl):
    fr, fw = impl.pipe(duplex=False)
    mr, mw = multiprocessing.Pipe(duplex=False)
    with fr, fw, mr, mw:
        writes = ("send_bytes", "send")
        reads = ("recv_bytes", "recv_bytes_into", "recv", "poll")
        for f, m, forbidden in ((fr, mr, writes), (fw, mw, reads)):
            fcalls, mcalls = _calls(f), _calls(m)
            for name in forbidden:
                fp, mp = outcome(fcalls[name]), outcome(mcalls[name])
                assert fp == mp, name
                assert fp[0] is OSError, name
        assert outcome(lambda: fw.recv_bytes()) == (OSError, "connection is write-only")
        assert outcome(lambda: fr.send_bytes(b"")) == (OSError, "connection is read-only")


def test_readable_writable_fileno(pairs):
    (fr, fw), (mr, mw) = pairs
    for f, m in ((fr, mr), (fw, mw)):
        assert (f.readable, f.writable) == (m.readable, m.writable)
        fd = f.fileno()
        assert isinstance(fd, int)
        os.fstat(fd)  # a live descriptor
    assert fr.fileno() != fw.fileno()


def test_eof_when_the_peer_closes(pairs):
    (fr, fw), (mr, mw) = pairs
    fw.send_bytes(b"last")
    mw.send_bytes(b"last")
    fw.close()
    mw.close()
    assert fr.recv_bytes(timeout=TIMEOUT) == mr.recv_bytes() == b"last"
    assert fr.poll() is mr.poll() is True  # end of file is readable
    for read in (
        lambda c: c.recv_bytes(),
        lambda c: c.recv(),
        lambda c: c.recv_bytes_into(bytearray(8)),
    ):
        fp, mp = outcome(lambda: read(fr)), outcome(lambda: read(mr))  # noqa: B023
        assert fp[0] is mp[0] is EOFError


def test_poll(pairs):
    (fr, fw), (mr, mw) = pairs
    for r, w in ((fr, fw), (mr, mw)):
        assert r.poll() is False
        assert r.poll(0) is False
        assert r.poll(0.01) is False
        assert r.poll(-1) is False
        w.send_bytes(b"x")
        assert r.poll() is True
        assert r.poll(TIMEOUT) is True
        assert r.poll(None) is True
        assert r.recv_bytes() == b"x"
        assert r.poll(0) is False


def test_poll_none_waits_for_data(pairs):
    (fr, fw), _ = pairs
    sender = Background(fw.send_bytes, b"late")
    assert fr.poll(None) is True
    sender.join()
    assert fr.recv_bytes(timeout=TIMEOUT) == b"late"


OBJECTS = [
    None,
    0,
    -(2**70),
    3.5,
    "text é",
    b"",
    b"bytes",
    bytearray(b"ba"),
    [1, [2, [3]]],
    {"k": (1, 2), 3: {4}},
    frozenset({1, 2}),
    ValueError("an exception as data"),
]


@pytest.mark.parametrize("obj", OBJECTS, ids=repr)
def test_send_recv_objects(pairs, obj):
    (fr, fw), (mr, mw) = pairs
    fw.send(obj)
    mw.send(obj)
    fgot, mgot = fr.recv(timeout=TIMEOUT), mr.recv()
    assert type(fgot) is type(mgot) is type(obj)
    if isinstance(obj, Exception):
        assert fgot.args == mgot.args == obj.args
    else:
        assert fgot == mgot == obj


def test_context_manager(pairs):
    (fr, _), (mr, _) = pairs
    for c in (fr, mr):
        with c as entered:
            assert entered is c
            assert not c.closed
        assert c.closed


# --- timeouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["recv_bytes", "recv", "recv_bytes_into"])
def test_read_timeouts_raise_read_timeout(oneway, method):
    r, w = oneway
    read = {
        "recv_bytes": lambda: r.recv_bytes(timeout=0.01),
        "recv": lambda: r.recv(timeout=0.01),
        "recv_bytes_into": lambda: r.recv_bytes_into(bytearray(16), timeout=0.01),
    }[method]
    with pytest.raises(framepipe.ReadTimeout) as info:
        read()
    assert isinstance(info.value, TimeoutError)
    assert isinstance(info.value, framepipe.FramepipeError)
    w.send_bytes(b"then data")
    assert r.recv_bytes(timeout=TIMEOUT) == b"then data"


def _timer_slack() -> int:
    with open(f"/proc/{threading.get_native_id()}/timerslack_ns") as file:
        return int(file.read())


@pytest.mark.skipif(not os.path.exists("/proc/self/timerslack_ns"), reason="Linux /proc")
def test_short_timeouts_give_the_thread_its_timer_slack_back(oneway):
    r, w = oneway
    before = _timer_slack()
    for timeout in (0.001, 0.01, 0.05, 0.2):
        with pytest.raises(framepipe.ReadTimeout):
            r.recv_bytes(timeout=timeout)
        assert _timer_slack() == before

    def late() -> None:
        time.sleep(0.05)
        w.send_bytes(b"late")

    # Short waits that data ends: one usually; on a loaded machine the data may come after a
    # wait has timed out, and the next short wait takes it (a timeout loses nothing).
    writer = Background(late)
    end = time.monotonic() + TIMEOUT
    while True:
        try:
            data = r.recv_bytes(timeout=0.09)
            break
        except framepipe.ReadTimeout:
            assert _timer_slack() == before
            assert time.monotonic() < end, "the late frame never came"
    assert data == b"late"
    writer.join()
    assert _timer_slack() == before


def test_short_timeouts_on_fds_above_select_limits(impl):
    # Short waits may use select(), which cannot watch fd 1024 and up: such fds still work.
    rfd, wfd = os.pipe()
    high_r = fcntl.fcntl(rfd, fcntl.F_DUPFD_CLOEXEC, 1500)
    high_w = fcntl.fcntl(wfd, fcntl.F_DUPFD_CLOEXEC, 1500)
    os.close(rfd)
    os.close(wfd)
    r = impl.Connection(high_r, writable=False)
    w = impl.Connection(high_w, readable=False)
    with r, w:
        r.watch(os.getppid())
        with pytest.raises(framepipe.ReadTimeout):
            r.recv_bytes(timeout=0.02)
        assert not r.poll(0.02)
        w.send_bytes(b"high")
        assert r.poll(0.05)
        assert r.recv_bytes(timeout=0.05) == b"high"


def test_timeout_zero_with_data_ready_returns_it(oneway):
    r, w = oneway
    w.send_bytes(b"ready")
    assert r.recv_bytes(timeout=0) == b"ready"
    w.send(["ready"])
    assert r.recv(timeout=0) == ["ready"]


@pytest.mark.parametrize("n", [10, 100_000], ids=["small", "large"])
@pytest.mark.parametrize("cut", [3, 12, "half"])
def test_half_arrived_frame_then_timeout_next_read_returns_it_whole(raw, n, cut):
    p = raw()
    data = os.urandom(n)
    whole = frame(data)
    cut = len(whole) // 2 if cut == "half" else cut
    p.write(whole[:cut])
    with pytest.raises(framepipe.ReadTimeout):
        p.conn.recv_bytes(timeout=0.02)
    with pytest.raises(framepipe.ReadTimeout):
        p.conn.recv_bytes(timeout=0.0)
    writer = Background(p.write, whole[cut:] + frame(b"next"))
    assert p.conn.recv_bytes(timeout=TIMEOUT) == data
    assert p.conn.recv_bytes(timeout=TIMEOUT) == b"next"
    writer.join()


def test_half_arrived_frame_into_a_buffer_then_timeout(raw):
    # The first read fills the caller's buffer directly; after the timeout that buffer is the
    # caller's again, and the next read (into another buffer) still returns the whole frame.
    p = raw()
    data = os.urandom(200_000)
    whole = frame(data)
    first = bytearray(300_000)
    p.write(whole[:50_000])
    with pytest.raises(framepipe.ReadTimeout):
        p.conn.recv_bytes_into(first, timeout=0.02)
    first[:] = b"\xff" * len(first)  # scribbling on it must not change what is received
    writer = Background(p.write, whole[50_000:])
    second = bytearray(250_000)
    assert p.conn.recv_bytes_into(second, 10, timeout=TIMEOUT) == len(data)
    writer.join()
    assert second[10 : 10 + len(data)] == data
    assert first == b"\xff" * len(first)


@pytest.mark.parametrize("cut", ["in-first-header", "after-first-frame", "in-buffer"])
def test_half_arrived_object_then_timeout_next_recv_returns_it(impl, raw, cut):
    # An object with a large buffer travels as several frames; time out in the middle of them.
    obj = {"array": np.arange(20_000, dtype=np.int64), "tag": "t"}
    rfd, wfd = os.pipe()  # a plain pipe: no bulk channel, every frame is in this stream
    fcntl.fcntl(wfd, F_SETPIPE_SZ, 1 << 20)
    with impl.Connection(wfd, readable=False) as w:
        w.send(obj)  # about 160 KB: fits the 1 MiB pipe
    stream = bytearray()
    while chunk := os.read(rfd, 1 << 20):
        stream += chunk
    os.close(rfd)
    first_frame = 12 + LEN.unpack(stream[2:10])[0]
    at = {"in-first-header": 5, "after-first-frame": first_frame, "in-buffer": 40_000}[cut]
    assert at < 60_000 < len(stream)  # the first part fits the raw pipe's 64 KiB buffer
    p = raw()
    p.write(bytes(stream[:at]))
    with pytest.raises(framepipe.ReadTimeout):
        p.conn.recv(timeout=0.02)
    writer = Background(p.write, bytes(stream[at:]))
    got = p.conn.recv(timeout=TIMEOUT)
    writer.join()
    assert got["tag"] == "t"
    assert np.array_equal(got["array"], obj["array"])


# --- maxlength ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [11, 200_000], ids=["small", "large"])
def test_maxlength_exceeded_raises_message_too_long_and_connection_stays_usable(oneway, n):
    r, w = oneway
    sender = Background(lambda: (w.send_bytes(b"y" * n), w.send_bytes(b"fits")))
    with pytest.raises(framepipe.MessageTooLong) as info:
        r.recv_bytes(10, timeout=TIMEOUT)
    assert isinstance(info.value, OSError)
    assert r.recv_bytes(10, timeout=TIMEOUT) == b"fits"
    sender.join()
    w.send_bytes(b"z" * 10)
    assert r.recv_bytes(10, timeout=TIMEOUT) == b"z" * 10  # exactly maxlength fits


def test_maxlength_is_an_oserror_like_the_stdlib(pairs):
    (fr, fw), (mr, mw) = pairs
    fw.send_bytes(b"x" * 100)
    mw.send_bytes(b"x" * 100)
    with pytest.raises(OSError):
        mr.recv_bytes(10)
    with pytest.raises(OSError):
        fr.recv_bytes(10, timeout=TIMEOUT)


# --- the write loop ---------------------------------------------------------------------------


@pytest.mark.parametrize("n", [100_000, 3 << 20], ids=["100KB", "3MiB"])
def test_a_write_end_someone_made_non_blocking_waits_for_room(impl, n):
    # O_NONBLOCK lives on the open file description, which a child or a library may set
    # behind the connection's back: a full pipe must then make the write wait, on both
    # engines, never raise BlockingIOError half way through a frame.
    r, w = os.pipe()
    fcntl.fcntl(w, F_SETPIPE_SZ, 4096)
    os.set_blocking(w, False)
    writer = impl.Connection(w, readable=False)
    reader = impl.Connection(r, writable=False)
    data = os.urandom(n)
    try:
        sending = Background(lambda: [writer.send_bytes(data), writer.send(("after", 1))])
        time.sleep(0.05)  # the pipe is full and the writer waits for room
        assert reader.recv_bytes(timeout=TIMEOUT) == data
        assert reader.recv(timeout=TIMEOUT) == ("after", 1)
        sending.join()
    finally:
        writer.close()
        reader.close()


# --- protocol errors ------------------------------------------------------------------------------


def _hex_seen(message: str, seen: bytes) -> bool:
    a, b = seen.hex()[:2], seen.hex()[2:]
    return re.search(rf"{a}[ :]?{b}", message, re.IGNORECASE) is not None


@pytest.mark.parametrize(
    "bad",
    [b"\x07\x09" + bytes(10), b"\x00\x00" + LEN.pack(3) + b"\x00\x08" + b"abc"],
    ids=["first-check", "second-check"],
)
def test_wrong_check_bytes_raise_frame_error_and_break_the_connection(raw, bad):
    p = raw()
    good = frame(b"a" * 100)  # the bad bytes sit at stream offset 112
    p.write(good + bad + frame(b"valid afterwards"))
    assert p.conn.recv_bytes(timeout=TIMEOUT) == b"a" * 100
    with pytest.raises(framepipe.FrameError) as info:
        p.conn.recv_bytes(timeout=TIMEOUT)
    err = info.value
    assert isinstance(err, OSError)
    message = str(err)
    seen = bad[:2] if bad[:2] != b"\x00\x00" else bad[10:12]
    assert _hex_seen(message, seen), message
    assert "112" in message, message
    for read in (
        lambda: p.conn.recv_bytes(timeout=TIMEOUT),
        lambda: p.conn.recv(timeout=TIMEOUT),
        lambda: p.conn.recv_bytes_into(bytearray(100), timeout=TIMEOUT),
    ):
        with pytest.raises(framepipe.FrameError):
            read()


def test_length_over_max_size_is_refused_before_allocating(raw):
    p = raw(max_size=1 << 20)
    assert p.conn.max_size == 1 << 20
    # 2**60 bytes could never be allocated: a MemoryError here would mean the core tried.
    p.write(b"\x00\x00" + LEN.pack(2**60) + b"\x00\x00" + b"abc")
    with pytest.raises(framepipe.FrameError) as info:
        p.conn.recv_bytes(timeout=TIMEOUT)
    assert isinstance(info.value, OSError)
    assert not isinstance(info.value, framepipe.MessageTooLong)
    with pytest.raises(framepipe.FrameError):
        p.conn.recv_bytes(timeout=TIMEOUT)


def test_max_size_admits_frames_up_to_it(raw):
    p = raw(max_size=100)
    p.write(frame(b"m" * 100) + frame(b"m" * 101))
    assert p.conn.recv_bytes(timeout=TIMEOUT) == b"m" * 100
    with pytest.raises(framepipe.FrameError):
        p.conn.recv_bytes(timeout=TIMEOUT)


@pytest.mark.parametrize(
    "sent, expected",
    [
        (b"\x00\x00" + LEN.pack(100) + b"\x00\x00" + b"p" * 30, 112),  # in the payload
        (b"\x00\x00" + LEN.pack(100) + b"\x00", 12),  # in the header: length not yet trusted
        (b"\x00\x00" + LEN.pack(5)[:3], 12),  # in the header
    ],
    ids=["payload", "second-check", "length"],
)
def test_eof_inside_a_frame_is_a_frame_error_naming_the_byte_counts(raw, sent, expected):
    p = raw()
    p.write(frame(b"whole") + sent)
    p.close_writer()
    assert p.conn.recv_bytes(timeout=TIMEOUT) == b"whole"
    with pytest.raises(framepipe.FrameError) as info:
        p.conn.recv_bytes(timeout=TIMEOUT)
    assert not isinstance(info.value, EOFError)
    message = str(info.value)
    assert re.search(rf"\b{len(sent)}\b", message), message
    assert re.search(rf"\b{expected}\b", message), message


# --- objects ----------------------------------------------------------------------------------


def _roundtrip(pair, obj):
    r, w = pair
    sender = Background(w.send, obj)
    got = r.recv(timeout=TIMEOUT)
    sender.join()
    return got


@pytest.mark.parametrize("n", [0, 100, 1 << 20, 16 << 20], ids=["0B", "100B", "1MiB", "16MiB"])
def test_bytes_and_bytearray_round_trip(pair, n):
    data = os.urandom(n)
    got = _roundtrip(pair, data)
    assert type(got) is bytes
    assert got == data
    got = _roundtrip(pair, bytearray(data))
    assert type(got) is bytearray
    assert got == data


@pytest.mark.parametrize("nbytes", [1 << 20, 16 << 20], ids=["1MiB", "16MiB"])
def test_numpy_arrays_round_trip_writable(pair, nbytes):
    arr = np.random.default_rng(nbytes).integers(0, 2**31, nbytes // 4, dtype=np.int32)
    got = _roundtrip(pair, arr)
    assert isinstance(got, np.ndarray)
    assert got.dtype == arr.dtype and got.shape == arr.shape
    assert np.array_equal(got, arr)
    assert got.flags.writeable
    got[0] = -1  # really writable


def test_structures_of_arrays_round_trip(pair):
    obj = {
        "f": np.linspace(0, 1, 300_000).reshape(300, 1000),
        "fortran": np.asfortranarray(np.arange(200_000, dtype=np.int16).reshape(400, 500)),
        "small": np.arange(10),
        "blob": os.urandom(70_000),
        "list": [np.ones(50_000, dtype=np.uint8), b"tiny", bytearray(90_000)],
    }
    got = _roundtrip(pair, obj)
    for key in ("f", "fortran", "small"):
        assert np.array_equal(got[key], obj[key])
        assert got[key].dtype == obj[key].dtype
        assert got[key].flags.writeable
    assert got["fortran"].flags.f_contiguous
    assert got["blob"] == obj["blob"]
    assert np.array_equal(got["list"][0], obj["list"][0])
    assert got["list"][1:] == obj["list"][1:]
    assert type(got["list"][2]) is bytearray


@pytest.mark.parametrize("protocol", [2, 4, 5])
def test_in_band_pickle_frame_is_read_by_recv(raw, protocol):
    p = raw()
    objs = [{"ref": [1, 2, 3]}, b"r" * 200_000, np.arange(50_000)]
    stream = b"".join(frame(pickle.dumps(o, protocol=protocol)) for o in objs)
    writer = Background(p.write, stream)
    got = [p.conn.recv(timeout=TIMEOUT) for _ in objs]
    writer.join()
    assert got[0] == objs[0]
    assert got[1] == objs[1]
    assert np.array_equal(got[2], objs[2])


@pytest.mark.parametrize(
    "obj",
    [
        {"small": 1},
        b"b" * (1 << 20),
        bytearray(b"c" * 100_000),
        {"a": np.arange(1 << 18, dtype=np.float32), "n": None},
    ],
    ids=["small", "bytes-1MiB", "bytearray", "array"],
)
def test_recv_bytes_of_an_object_unpickles_to_it(pair, obj):
    r, w = pair
    sender = Background(w.send, obj)
    data = r.recv_bytes(timeout=TIMEOUT)
    sender.join()
    assert type(data) is bytes
    back = pickle.loads(data)
    if isinstance(obj, dict) and "a" in obj:
        assert np.array_equal(back["a"], obj["a"]) and back["n"] is None
    else:
        assert back == obj
        assert type(back) is type(obj)
    w.send_bytes(b"after")
    assert r.recv_bytes(timeout=TIMEOUT) == b"after"


def test_recv_bytes_into_of_an_object_unpickles_to_it(pair):
    r, w = pair
    obj = {"a": np.arange(100_000)}
    sender = Background(w.send, obj)
    buf = bytearray(4 << 20)
    n = r.recv_bytes_into(buf, timeout=TIMEOUT)
    sender.join()
    assert np.array_equal(pickle.loads(bytes(buf[:n]))["a"], obj["a"])
