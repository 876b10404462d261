"""Frame-parser fuzzing: hypothesis-built byte streams written into a real pipe, read back
through ``recv_bytes``, ``recv``, ``recv_bytes_into`` and ``poll``, with and without timeouts and
``maxlength``, on both cores.

Two properties:

- ``test_reads_follow_the_wire_format``: streams of valid frames, frames with a flipped check
  byte, headers announcing 2**40, 2**62, 2**63 or 2**64-1 bytes (or more than ``max_size``),
  TIMEOUT and DEAD sentinels, junk, cut at any byte (end of file inside a frame) and delivered
  in parts between reads. A model of the wire format written here from docs/architecture.md
  says what each read must do; the core must do exactly that (the same bytes, or an error of
  the documented class), within its deadline, and without allocating more than the frame cap.
- ``test_both_cores_agree_on_any_bytes``: any bytes, including the error, object, buffer and
  bulk check values: the compiled core and the twin must return the same bytes and raise the
  same errors with the same text, each a documented one.

The default run keeps a few hundred cases per core; ``pytest --fuzz-minutes N`` runs each
property for about N minutes. Failing examples found so far are kept below as ``@example``.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys
import time
import tracemalloc
from dataclasses import dataclass

import psutil
import pytest
from _helpers import LEN, Background, header
from hypothesis import HealthCheck, example, given, reject, settings
from hypothesis import strategies as st

from framepipe import (  # noqa: F401 - imported before memory is traced
    BufferTooShort,
    FrameError,
    MessageTooLong,
    ReadTimeout,
    RefusedPayload,
    WriterDied,
    _impl,
    remote,
    watch,
)
from framepipe import _wire as F

SHORT = 0.02  # the timeout of reads that need bytes the test has not written
MARGIN = 2.0  # a read may overrun its deadline by scheduling delays, never by this much
HANG = 20  # seconds after which a read without a timeout counts as hung
HUGE = [1 << 40, 1 << 62, (1 << 62) + 1, 1 << 63, (1 << 64) - 1]
ALLOC_SLACK = 4 << 20  # what a read may allocate besides its frame (exceptions, imports)
# A length under the frame cap that no allocation can satisfy here: the core must refuse it
# like one over the cap (FrameError, connection broken) instead of raising MemoryError.
UNALLOCATABLE = psutil.virtual_memory().total + psutil.swap_memory().total


def run_profile(config, default_examples: int, test) -> None:
    """Run the hypothesis ``test``: the quick profile (``default_examples`` cases, the same on
    every run), or under ``--fuzz-minutes N`` fresh batches of random cases for N minutes."""
    minutes = config.getoption("--fuzz-minutes")
    quiet = list(HealthCheck)
    if not minutes:
        settings(
            max_examples=default_examples,
            deadline=None,
            derandomize=True,
            suppress_health_check=quiet,
            database=None,
        )(test)()
        return
    end = time.monotonic() + minutes * 60
    while time.monotonic() < end:
        settings(max_examples=500, deadline=None, suppress_health_check=quiet)(test)()


@contextlib.contextmanager
def hang_guard(seconds: int):
    """Fail a read that blocks longer than ``seconds`` (a SIGALRM handler raises in it: both
    cores run signal handlers while they wait)."""
    previous = signal.signal(signal.SIGALRM, _alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class Hung(Exception):
    pass


def _alarm(signum, frame):
    raise Hung(f"a read without a timeout was still blocked after {HANG} s")


# --- the model: what the wire format (docs/architecture.md) says each read does ----------------

# Check values a model stream may hold: data, TIMEOUT, DEAD, PAD, and values that are not a check.
MODEL_BYTES = [0, 1, 2, *range(7, 256)]
VALID_CHECKS = {b"\x00\x00", b"\x01\x01", b"\x02\x02", b"\x07\x07"}


@dataclass
class Model:
    cap: int
    data: bytes = b""  # delivered so far
    eof: bool = False
    pos: int = 0  # bytes consumed by whole units (frames, sentinels)
    pending: tuple[int, int | None] | None = None  # (length, maxlength) once the header is read
    broken: bool = False
    largest: int = 0  # the longest payload a header announced and the model accepted

    def read(self, how: str, maxlength: int | None, into: int):
        """What a read must give: ("value", v), ("error", class) or ("timeout",)."""
        if self.broken:
            return ("error", FrameError)
        rest = self.data[self.pos :]
        if self.pending is None:
            if len(rest) < 2:
                return self._short(rest)
            check = rest[:2]
            if check[0] == check[1] and 3 <= check[0] <= 6:
                reject()  # error, object, buffer and bulk frames: the two-core test's domain
            if check not in VALID_CHECKS:
                self.broken = True
                return ("error", FrameError)
            if check == b"\x01\x01":
                self.pos += 2
                return ("error", ReadTimeout)
            if check == b"\x02\x02":
                if len(rest) < F.DEAD_SIZE:
                    return self._short(rest)
                self.pos += F.DEAD_SIZE
                return ("error", WriterDied)
            if check == b"\x07\x07":  # a PAD: skipped whole, at most PAD_MIN bytes
                if len(rest) < F.HEADER_SIZE:
                    return self._short(rest)
                (length,) = LEN.unpack_from(rest, 2)
                if rest[10:12] != check or length > F.PAD_MIN:
                    self.broken = True
                    return ("error", FrameError)
                if len(rest) < F.HEADER_SIZE + length:
                    return self._short(rest)
                self.pos += F.HEADER_SIZE + length
                return self.read(how, maxlength, into)
            if len(rest) < F.HEADER_SIZE:
                return self._short(rest)
            (length,) = LEN.unpack_from(rest, 2)
            discard = maxlength is not None and length > maxlength  # nothing to allocate
            if (
                rest[10:12] != check
                or length > self.cap
                or (length > UNALLOCATABLE and not discard)
            ):
                self.broken = True
                return ("error", FrameError)
            self.pos += F.HEADER_SIZE
            self.pending = (length, maxlength)
            self.largest = max(self.largest, length)
            rest = rest[F.HEADER_SIZE :]
        length, maxlen = self.pending
        if len(rest) < length:
            return ("error", FrameError) if self.eof else ("timeout",)
        payload = rest[:length]
        self.pos += length
        self.pending = None
        if maxlen is not None and length > maxlen:
            return ("error", MessageTooLong)
        if how == "recv":
            try:
                return ("value", pickle.loads(payload))
            except Exception as exc:  # noqa: BLE001 - the core raises what pickle raises
                return ("error", type(exc))
        if how == "recv_bytes_into" and length > into:
            return ("error", BufferTooShort)
        return ("value", payload)

    def _short(self, rest: bytes):
        if not self.eof:
            return ("timeout",)
        return ("error", EOFError) if not rest else ("error", FrameError)

    def ready(self) -> bool:
        """Whether a read would finish now without waiting (poll must then say True)."""
        if self.broken:
            return False  # poll looks at the fd only; a read raises at once anyway
        probe = Model(self.cap, self.data, self.eof, self.pos, self.pending)
        return probe.read("recv_bytes", None, 0) != ("timeout",)


# --- strategies -------------------------------------------------------------------------------


def _pickled(data: bytes) -> bytes:
    return pickle.dumps(data, protocol=5)


model_junk = st.lists(st.sampled_from(MODEL_BYTES), min_size=1, max_size=20).map(bytes)
pieces = st.one_of(
    st.binary(max_size=300).map(lambda b: ("frame", _pickled(b))),
    st.tuples(
        st.binary(max_size=40),
        st.sampled_from([0, 1, 10, 11]),
        st.sampled_from(MODEL_BYTES[1:]),
    ).map(lambda t: ("flip", t)),
    st.sampled_from(HUGE).map(lambda n: ("huge", n)),
    st.just(("timeout", None)),
    st.integers(0, 2**64 - 1).map(lambda s: ("dead", s)),
    st.sampled_from([0, 1, 244, 256, 257, 1 << 40]).map(lambda n: ("pad", n)),
    model_junk.map(lambda b: ("junk", b)),
)


def render(piece) -> bytes:
    kind, arg = piece
    if kind == "frame":
        return header(len(arg)) + arg
    if kind == "flip":
        body, where, value = arg
        raw = bytearray(header(len(body)) + body)
        raw[where] = value
        return bytes(raw)
    if kind == "huge":
        return header(arg) + b"xyz"
    if kind == "timeout":
        return b"\x01\x01"
    if kind == "dead":
        return b"\x02\x02" + LEN.pack(arg)
    if kind == "pad":
        return header(arg, b"\x07\x07") + bytes(min(arg, 300))
    return arg


read_ops = st.lists(
    st.tuples(
        st.sampled_from(["recv_bytes", "recv", "recv_bytes_into", "poll"]),
        st.sampled_from([None, 0.0, SHORT]),
        st.one_of(st.none(), st.integers(0, 400)),  # maxlength (recv_bytes only)
        st.integers(0, 400),  # the recv_bytes_into buffer size
    ),
    min_size=1,
    max_size=12,
)


@st.composite
def scenarios(draw):
    stream = b"".join(render(p) for p in draw(st.lists(pieces, min_size=1, max_size=8)))
    cut = draw(st.one_of(st.none(), st.integers(0, len(stream))))
    if cut is not None:
        stream = stream[:cut]  # end of file anywhere, inside a frame included
    parts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=3)))
    bounds = [0, *parts, len(stream)]
    deliveries = [stream[a:b] for a, b in zip(bounds, bounds[1:])]
    close = draw(st.booleans())
    max_size = draw(st.sampled_from([None, None, 64, 1 << 20]))
    return deliveries, close, draw(read_ops), max_size


def run_read(conn, how: str, timeout, maxlength, into: int):
    if how == "recv_bytes":
        return conn.recv_bytes(maxlength, timeout=timeout)
    if how == "recv":
        return conn.recv(timeout=timeout)
    buf = bytearray(b"\xee" * (into + 3))
    n = conn.recv_bytes_into(buf, 3, timeout=timeout)
    assert bytes(buf[:3]) == b"\xee" * 3, "recv_bytes_into wrote before its offset"
    assert bytes(buf[3 + n :]) == b"\xee" * (into - n), "recv_bytes_into wrote past the message"
    return bytes(buf[3 : 3 + n])


def check_scenario(core, scenario) -> None:
    deliveries, close, ops, max_size = scenario
    r, w = os.pipe()
    conn = core.Connection(r, writable=False, max_size=max_size)
    model = Model(F.frame_cap(max_size))
    try:
        for i, (how, timeout, maxlength, into) in enumerate(ops):
            if deliveries:
                chunk = deliveries.pop(0)
                os.write(w, chunk)  # small streams: the pipe takes them whole
                model.data += chunk
            if not deliveries and close and w >= 0:
                os.close(w)
                w = -1
                model.eof = True
            if how != "recv_bytes":
                maxlength = None
            if timeout is None and not model.eof:
                timeout = SHORT  # the test is the only writer: waiting forever would hang
            if how == "poll":
                started = time.monotonic()
                ready = conn.poll(timeout)
                assert time.monotonic() - started <= (timeout or 0.0) + MARGIN
                if model.ready():
                    assert ready, f"poll said no data where a read completes (op {i})"
                continue
            want = model.read(how, maxlength, into)
            tracemalloc.start()
            started = time.monotonic()
            try:
                with hang_guard(HANG):
                    got = ("value", run_read(conn, how, timeout, maxlength, into))
            except Hung:
                raise
            except ReadTimeout as exc:
                got = ("error", ReadTimeout) if exc.sentinel else ("timeout",)
            except Exception as exc:  # noqa: BLE001 - compared with the model below
                got = ("error", type(exc), exc)
            finally:
                elapsed = time.monotonic() - started
                peak = tracemalloc.get_traced_memory()[1]
                tracemalloc.stop()
            assert elapsed <= (timeout or 0.0) + MARGIN, f"op {i} ran {elapsed:.3f} s"
            # Never more than the frames the model accepted under the cap (refused lengths,
            # 2**40 and up, are never allocated).
            limit = model.largest + len(model.data) + ALLOC_SLACK
            assert peak <= limit, f"op {i} allocated {peak:,} bytes (limit {limit:,})"
            if want[0] == "error":
                assert got[0] == "error" and issubclass(got[1], want[1]), (i, how, want, got)
            else:
                assert got == want, (i, how, want, got)
    finally:
        conn.close()
        if w >= 0:
            os.close(w)


@pytest.fixture
def fuzz(request):
    """This run's pytest config (for ``--fuzz-minutes``)."""
    return request.config


# Regression cases: each was a failure of one core before the fix named with it.
MODEL_EXAMPLES = [
    # A header announcing 2**40 bytes: the compiled core raised MemoryError, and the next read
    # read into a NULL destination (EFAULT); the twin raised MemoryError, then TypeError.
    (([header(1 << 40) + b"xyz"], True, [("recv_bytes", None, None, 0)] * 2, None)),
    # 2**63 and 2**64-1: the twin raised OverflowError from bytearray().
    (([header(1 << 63)], False, [("recv", SHORT, None, 0)] * 2, None)),
    (([header((1 << 64) - 1)], True, [("recv_bytes_into", None, None, 8)] * 2, None)),
]


def test_reads_follow_the_wire_format(impl, fuzz):
    @given(scenario=scenarios())
    def prop(scenario):
        check_scenario(impl, scenario)

    for case in MODEL_EXAMPLES:
        prop = example(scenario=case)(prop)
    run_profile(fuzz, 150, prop)


# --- both cores, any bytes --------------------------------------------------------------------

DOCUMENTED = (EOFError, FrameError, ReadTimeout, WriterDied, BufferTooShort, RefusedPayload)
any_checks = st.sampled_from([bytes([k, k]) for k in range(8)] + [b"\x00\x01", b"\xff\xff"])
any_pieces = st.one_of(
    st.tuples(any_checks, st.binary(max_size=200)).map(lambda t: header(len(t[1]), t[0]) + t[1]),
    st.tuples(any_checks, st.sampled_from([0, 7, 8, 24, *HUGE])).map(lambda t: header(t[1], t[0])),
    st.binary(min_size=1, max_size=40),
    st.sampled_from([b"\x01\x01", b"\x02\x02" + LEN.pack(9)]),
)


def replay(core, chunks: list[bytes], ops) -> list:
    """Every read's outcome on ``core``: the value, or the error's class name and text."""
    r, w = os.pipe()
    conn = core.Connection(r, writable=False)
    out = []
    try:
        for i, (how, maxlength, into) in enumerate(ops):
            if i < len(chunks):
                os.write(w, chunks[i])
            if i == len(chunks) - 1:
                os.close(w)
                w = -1
            started = time.monotonic()
            try:
                with hang_guard(HANG):
                    if how == "poll":
                        out.append(("poll", conn.poll(0.0)))
                    else:
                        timeout = 0.0 if w >= 0 else None
                        out.append(("value", run_read(conn, how, timeout, maxlength, into)))
            except Exception as exc:  # noqa: BLE001 - compared between the cores
                assert isinstance(exc, DOCUMENTED), f"undocumented {type(exc).__name__}: {exc}"
                out.append(("error", type(exc).__name__, str(exc)))
            assert time.monotonic() - started <= MARGIN
    finally:
        conn.close()
        if w >= 0:
            os.close(w)
    return out


@st.composite
def chaos(draw):
    stream = b"".join(draw(st.lists(any_pieces, min_size=1, max_size=6)))
    cuts = sorted(draw(st.lists(st.integers(0, len(stream)), max_size=2)))
    bounds = [0, *cuts, len(stream)]
    chunks = [stream[a:b] for a, b in zip(bounds, bounds[1:])]
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["recv_bytes", "recv_bytes_into", "poll"]),
                st.one_of(st.none(), st.integers(0, 300)),
                st.integers(0, 300),
            ),
            min_size=len(chunks),
            max_size=len(chunks) + 6,
        )
    )
    return chunks, [(h, m if h == "recv_bytes" else None, n) for h, m, n in ops]


@pytest.fixture
def both_cores():
    """(the c core, the python core); the test is skipped where the c core is not built."""
    try:
        return _impl.load("c"), _impl.load("python")
    except ImportError as exc:
        pytest.skip(f"needs both cores: {exc}")


def test_both_cores_agree_on_any_bytes(fuzz, both_cores):
    c, py = both_cores

    @given(case=chaos())
    def prop(case):
        chunks, ops = case
        assert replay(c, chunks, ops) == replay(py, chunks, ops)

    run_profile(fuzz, 200, prop)


# --- error frames: hostile exception graphs -------------------------------------------------

# Class names an error frame may carry: builtins, a stdlib __main__ whose import would run a
# program, absent modules, a function, BaseExceptions that are not Exceptions.
ERROR_NAMES = [
    ("builtins", "ValueError"),
    ("builtins", "KeyError"),
    ("builtins", "ExceptionGroup"),
    ("builtins", "BaseExceptionGroup"),
    ("builtins", "SystemExit"),
    ("builtins", "KeyboardInterrupt"),
    ("unittest.__main__", "X"),
    ("email.__main__", "X"),
    ("fp_fuzz_absent.errors", "Y"),
    ("os", "system"),
    ("builtins", "__import__"),
]
NEVER_IMPORTED = ("unittest.__main__", "email.__main__", "fp_fuzz_absent")


@st.composite
def error_graphs(draw):
    """An error payload: a random graph of exceptions (members, causes and contexts pointing
    anywhere, out of range and at themselves included), or a deep group / chain."""
    import _hostile as H

    shape = draw(st.sampled_from(["graph", "graph", "deep", "chain"]))
    if shape == "deep":
        return H.nested_groups(draw(st.integers(1, 1500)))
    if shape == "chain":
        return H.chain(draw(st.integers(1, 3000)), draw(st.sampled_from(["cause", "context"])))
    n = draw(st.integers(1, 30))
    index = st.one_of(st.none(), st.integers(-1, n))
    nodes = []
    for _ in range(n):
        module, qualname = draw(st.sampled_from(ERROR_NAMES))
        nodes.append(
            H.node(
                module,
                qualname,
                draw(st.text(max_size=8)),
                members=draw(st.one_of(st.none(), st.lists(index, max_size=4))),
                cause=draw(index),
                context=draw(index),
                pickled=draw(st.booleans()),
            )
        )
    return H.envelope(nodes, root=draw(st.integers(0, n)))


def read_error_frame(core, payload: bytes):
    """What ``recv`` raises for ``payload`` as an error frame: (class name, text)."""
    import _hostile as H

    r, w = os.pipe()
    conn = core.Connection(r, writable=False)
    frame = H.error_frame(payload)

    def write() -> None:
        view = memoryview(frame)
        while view:
            view = view[os.write(w, view) :]

    try:
        writer = Background(write)
        with hang_guard(HANG):
            try:
                conn.recv(timeout=HANG)
            except Exception as exc:  # noqa: BLE001 - compared between the cores
                outcome = (type(exc).__name__, str(exc))
            else:
                raise AssertionError("an error frame raised nothing")
        writer.join()
    finally:
        conn.close()
        os.close(w)
    return outcome


def test_error_frames_never_import_hang_or_escape_and_both_cores_agree(fuzz, both_cores):
    c, py = both_cores
    import email  # noqa: F401 - imported: only their __main__ modules are not
    import unittest  # noqa: F401

    @given(payload=error_graphs())
    def prop(payload):
        got = read_error_frame(c, payload)
        assert got == read_error_frame(py, payload)
        assert got[0] != "RecursionError", got
        assert not [m for m in sys.modules if m.startswith(NEVER_IMPORTED)]

    run_profile(fuzz, 120, prop)
