"""Side-by-side benchmarks: framepipe's compiled core and its pure-Python twin against
``multiprocessing.connection``, in one run, as ratios.

Run it as ``python -m framepipe bench`` (``--quick``, ``--json``, ``--only NAME``, ``--list``,
``--repeat N``, ``--seconds S``, ``-v``). Every cell forks a writer (multiprocessing's ``fork``
context, so connections are inherited) and times the reading side in this process from the
first message to the last. The implementations compared are:

``c`` / ``python``
    framepipe's two cores from :func:`framepipe._impl.load` (one that does not import is
    skipped, and the output says why);
``stdlib duplex`` / ``stdlib simplex``
    ``multiprocessing.Pipe(duplex=True)`` (a socketpair) and ``Pipe(duplex=False)``
    (an ``os.pipe()``; two of them for round trips).

Adding a benchmark is one function registered with :func:`section`::

    from framepipe._bench import Context, Row, row, section

    @section("overshoot", "timeout overshoot")
    def _overshoot(ctx: Context) -> list[Row]:
        return [row("overshoot", "timeout overshoot", "c", 0.4, "ms", better="lower"), ...]

A section returns rows (plain dicts, see :func:`row`); rows with the same ``bench`` form one
group, and :func:`finish` adds the ratios against the group's stdlib rows (``vs_stdlib``:
against the stdlib's best; ``vs_duplex``: against ``stdlib duplex``) and judges targets.
:func:`measure` does the forking, calibration, repeats and clean-up for the common case of
"a writer in a child, a reader here".
"""

from __future__ import annotations

import argparse
import datetime
import fnmatch
import importlib
import inspect
import json
import multiprocessing
import os
import platform
import re
import signal
import stat
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from types import ModuleType, TracebackType
from typing import Any, Protocol

__all__ = [
    "SECTIONS",
    "Cell",
    "CellTimeout",
    "Context",
    "Duo",
    "Impl",
    "Peer",
    "Row",
    "Section",
    "Target",
    "WriterFailed",
    "add_arguments",
    "finish",
    "format_report",
    "format_table",
    "framepipe_impl",
    "implementations",
    "machine_info",
    "main",
    "measure",
    "normalize",
    "optional_section",
    "row",
    "run",
    "section",
    "selected",
    "size_label",
    "stdlib_impls",
]

Row = dict[str, Any]
"""One measured cell. Keys: ``bench`` (group id, what ``--only`` matches), ``title``, ``impl``,
``family`` (``framepipe`` | ``stdlib`` | ``other``), ``value``, ``unit``, ``better``
(``higher`` | ``lower``); optional ``mb_per_s``, ``n``, ``seconds``, ``target`` (a string such
as ``">= 2.5x"``, judged against ``vs_stdlib``), ``error`` (then ``value`` is None), ``note``.
:func:`finish` fills ``vs_stdlib``, ``vs_duplex`` and ``met``."""

KiB = 1024
MiB = 1024 * KiB
SMALL = 64
READ_TIMEOUT = 5.0  # the timeout passed by the "with a read timeout" rows
CELL_TIMEOUT = 120.0  # a cell whose writer runs longer is killed: no bug can hang the runner
JOIN_GRACE = 5.0

STDLIB_DUPLEX = "stdlib duplex"
STDLIB_SIMPLEX = "stdlib simplex"


# -- connections and implementations ---------------------------------------------------------


class Conn(Protocol):
    """What the benchmarks use of a connection: the ``multiprocessing.connection`` API."""

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None: ...
    def recv_bytes(self, maxlength: int | None = None) -> bytes: ...
    def send(self, obj: Any) -> None: ...
    def recv(self) -> Any: ...
    def poll(self, timeout: float | None = 0.0) -> bool: ...
    def close(self) -> None: ...


class Duo:
    """Two one-way connections used as one duplex end: reads from ``reader``, writes to
    ``writer``. The methods are the underlying bound methods, so a loop that binds
    ``end.recv_bytes`` pays nothing for the pairing."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self.reader, self.writer = reader, writer
        self.recv_bytes = reader.recv_bytes
        self.recv = reader.recv
        self.poll = reader.poll
        self.send_bytes = writer.send_bytes
        self.send = writer.send

    def close(self) -> None:
        """Close both connections."""
        self.reader.close()
        self.writer.close()


@dataclass(frozen=True)
class Impl:
    """One implementation under test: how to make its connections.

    ``oneway()`` returns ``(reader, writer)``; ``duplex()`` returns ``(parent end, child end)``.
    ``module`` is the framepipe core module (None for the stdlib).
    """

    name: str
    family: str
    oneway: Callable[[], tuple[Any, Any]]
    duplex: Callable[[], tuple[Any, Any]]
    module: ModuleType | None = None
    description: str = ""

    @property
    def is_framepipe(self) -> bool:
        """True for framepipe's own cores."""
        return self.family == "framepipe"


def _stdlib_simplex_duplex() -> tuple[Any, Any]:
    down_r, down_w = multiprocessing.Pipe(duplex=False)
    up_r, up_w = multiprocessing.Pipe(duplex=False)
    return Duo(up_r, down_w), Duo(down_r, up_w)


def stdlib_impls() -> list[Impl]:
    """The two ``multiprocessing.connection`` baselines."""
    return [
        Impl(
            STDLIB_DUPLEX,
            "stdlib",
            lambda: multiprocessing.Pipe(duplex=True),
            lambda: multiprocessing.Pipe(duplex=True),
            description="multiprocessing.Pipe(duplex=True): socketpair",
        ),
        Impl(
            STDLIB_SIMPLEX,
            "stdlib",
            lambda: multiprocessing.Pipe(duplex=False),
            _stdlib_simplex_duplex,
            description="multiprocessing.Pipe(duplex=False): os.pipe (two for round trips)",
        ),
    ]


def framepipe_impl(name: str, *, read_ahead: bool = False) -> Impl:
    """framepipe's core ``name`` (``"c"`` or ``"python"``); raises ImportError if it is not
    available here. ``read_ahead`` makes the "<name> read-ahead" variant."""
    from . import _impl

    module = _impl.load(name)
    pipe = module.pipe
    label = f"{name} read-ahead" if read_ahead else name
    return Impl(
        label,
        "framepipe",
        lambda: pipe(duplex=False, read_ahead=read_ahead),
        lambda: pipe(duplex=True, read_ahead=read_ahead),
        module=module,
        description=f"{module.__name__}: pipe(duplex=False): {_transport(pipe, False)}; "
        f"pipe(duplex=True): {_transport(pipe, True)}"
        + ("; read_ahead=True (reads may take several frames at once)" if read_ahead else ""),
    )


def _transport(pipe: Callable[..., tuple[Any, Any]], duplex: bool) -> str:
    """What ``pipe(duplex)`` is made of: ``"os.pipe"``, ``"two os.pipe"`` or ``"socketpair"``."""
    a, b = pipe(duplex=duplex)
    try:
        if stat.S_ISSOCK(os.fstat(a.fileno()).st_mode):
            return "socketpair"
        return "two os.pipe" if duplex else "os.pipe"
    finally:
        a.close()
        b.close()


def implementations() -> tuple[list[Impl], list[str]]:
    """Every implementation that works here, framepipe's first, and a note for each skipped."""
    impls: list[Impl] = []
    notes: list[str] = []
    for name, read_ahead in (("c", False), ("c", True), ("python", False)):
        try:
            impls.append(framepipe_impl(name, read_ahead=read_ahead))
        except Exception as exc:  # noqa: BLE001 - an unbuilt or broken core is reported
            if not read_ahead:
                notes.append(f"framepipe {name!r} skipped: {type(exc).__name__}: {exc}")
    impls.extend(stdlib_impls())
    return impls, notes


# -- the writer in another process -----------------------------------------------------------


def _close_quietly(obj: Any) -> None:
    try:
        obj.close()
    except Exception:  # noqa: BLE001, S110 - clean-up of a connection already broken
        pass


def _child_main(
    fn: Callable[..., None],
    args: tuple[Any, ...],
    drop: Sequence[Any],
    report_fd: int,
    cpu: int | None,
) -> None:
    # Ctrl-C reaches the whole process group: the parent stops the run and kills this child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    for obj in drop:
        _close_quietly(obj)
    try:
        fn(*args)
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the reader went away: the benchmark is over
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit 1
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:_REPORT_MAX]
        try:
            os.write(report_fd, text)
        except OSError:
            pass
        raise SystemExit(1) from None


_REPORT_MAX = 4096  # a child's error report always fits the pipe buffer: writing never blocks


class CellTimeout(RuntimeError):
    """A writer ran past its time limit and was killed."""


class WriterFailed(RuntimeError):
    """The writer raised; the message is its exception."""


class Peer:
    """A forked child running ``fn(*args)`` on connections it inherited.

    The child first closes ``drop_in_child`` (its copies of this process's ends); this
    process closes ``drop_in_parent`` once the child has started, so either side's death is an
    end of file for the other. A watchdog kills the child after ``timeout`` seconds, which turns
    any blocked read here into an error. ``child_cpu`` pins the child to that CPU. On exit
    ``close_on_exit`` is closed (which also unblocks a writer stuck on a full pipe) and the child
    joined, then killed if it lingers: no child outlives the block. An exception in the child
    becomes :class:`WriterFailed` here.
    """

    def __init__(
        self,
        fn: Callable[..., None],
        args: tuple[Any, ...],
        *,
        drop_in_child: Sequence[Any] = (),
        drop_in_parent: Sequence[Any] = (),
        close_on_exit: Sequence[Any] = (),
        timeout: float = CELL_TIMEOUT,
        child_cpu: int | None = None,
    ) -> None:
        self._fn, self._args = fn, args
        self._drop_in_child, self._drop_in_parent = list(drop_in_child), list(drop_in_parent)
        self._close_on_exit = list(close_on_exit)
        self._timeout = timeout
        self._child_cpu = child_cpu
        self._timer: threading.Timer | None = None
        self._report_fd = -1
        self.expired = False
        self.process: Any = None

    def __enter__(self) -> Peer:  # noqa: PYI034 - not meant to be subclassed
        context = multiprocessing.get_context("fork")
        report_r, report_w = os.pipe()
        self._report_fd = report_r
        try:
            self.process = context.Process(
                target=_child_main,
                args=(
                    self._fn,
                    self._args,
                    [*self._drop_in_child, _Fd(report_r)],
                    report_w,
                    self._child_cpu,
                ),
                daemon=True,
            )
            self.process.start()
        except BaseException:
            os.close(report_r)
            self._report_fd = -1
            for obj in self._close_on_exit:
                _close_quietly(obj)
            raise
        finally:
            os.close(report_w)
            for obj in self._drop_in_parent:
                _close_quietly(obj)
        self._timer = threading.Timer(self._timeout, self._expire)
        self._timer.daemon = True
        self._timer.start()
        return self

    def _expire(self) -> None:
        self.expired = True
        self.process.kill()

    @property
    def pid(self) -> int:
        """The child's process id."""
        return int(self.process.pid)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for obj in self._close_on_exit:
            _close_quietly(obj)
        process = self.process
        process.join(JOIN_GRACE)
        if process.is_alive():
            process.kill()
            process.join(JOIN_GRACE)
        report = b""
        try:
            os.set_blocking(self._report_fd, False)
            report = os.read(self._report_fd, _REPORT_MAX)
        except OSError:
            pass
        finally:
            os.close(self._report_fd)
        exitcode = process.exitcode
        if exitcode is not None:
            process.close()  # releases the sentinel fd now rather than at collection
        if exc is not None and not isinstance(exc, Exception):
            return  # KeyboardInterrupt and friends go on as they are
        if self.expired:
            raise CellTimeout(f"the writer ran past {self._timeout:g} s and was killed") from exc
        if report:
            raise WriterFailed(report.decode("utf-8", "replace")) from exc
        if exc is not None and exitcode not in (0, None):
            raise WriterFailed(f"the writer exited with code {exitcode}") from exc


class _Fd:
    """A raw fd with ``close()``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


# -- measuring one cell ----------------------------------------------------------------------

Pair = Callable[[], tuple[Any, Any, Sequence[Any], Sequence[Any]]]
"""Makes ``(parent end, child end, what the child closes, what this process closes)`` (see
:class:`Peer`)."""
Reader = Callable[[Any, int], float]
"""Reads ``n`` messages (or round trips) on the parent end; returns the seconds from the first
to the last."""
Writer = Callable[[Any, int], None]
"""Runs in the child: writes ``n`` messages (or answers ``n`` round trips) on the child end."""


@dataclass
class Context:
    """Settings of one run, the implementations under test and the notes to print."""

    impls: list[Impl]
    quick: bool = False
    seconds: float = 0.3
    repeat: int = 5
    placement: str = "free"
    """Where reader and writer run: ``free`` (the scheduler decides), ``same`` (both pinned to
    one CPU) or ``split`` (pinned to two different CPUs)."""
    notes: list[str] = field(default_factory=list)
    progress: Callable[[str], None] = lambda message: None

    def note(self, text: str) -> None:
        """Add a line to the notes printed under the table."""
        if text not in self.notes:
            self.notes.append(text)

    @property
    def framepipe(self) -> list[Impl]:
        """framepipe's cores available in this run."""
        return [impl for impl in self.impls if impl.is_framepipe]

    @property
    def stdlib(self) -> list[Impl]:
        """The stdlib baselines."""
        return [impl for impl in self.impls if not impl.is_framepipe]


@dataclass
class Cell:
    """One implementation's part in a comparison."""

    impl: str
    family: str
    pair: Pair
    reader: Reader
    writer: Writer
    n: int = 0
    best: float | None = None
    runs: list[float] = field(default_factory=list)
    error: str | None = None
    started: Callable[[Any, int], None] | None = None
    """Called with the parent end and the writer's pid once the writer runs."""


PLACEMENTS = ("free", "same", "split")


def _placement_cpus(placement: str) -> tuple[int | None, int | None]:
    """The CPUs of the reader (this process) and of the writer for ``placement``."""
    if placement == "free":
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "same":
        return cpus[0], cpus[0]
    if placement == "split" and len(cpus) >= 2:
        return cpus[0], cpus[1]
    raise ValueError(f"placement {placement!r} needs one of {PLACEMENTS} and, for split, 2 CPUs")


def _run_once(cell: Cell, n: int, placement: str = "free") -> float:
    parent_cpu, child_cpu = _placement_cpus(placement)
    saved = os.sched_getaffinity(0) if parent_cpu is not None else None
    parent, child, drop_in_child, drop_in_parent = cell.pair()
    try:
        if parent_cpu is not None:
            os.sched_setaffinity(0, {parent_cpu})
        with Peer(
            cell.writer,
            (child, n),
            drop_in_child=drop_in_child,
            drop_in_parent=drop_in_parent,
            close_on_exit=[parent],
            child_cpu=child_cpu,
        ) as peer:
            if cell.started is not None:
                cell.started(parent, peer.pid)
            return cell.reader(parent, n)
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)


def _probe_count(size: int, quick: bool) -> int:
    budget = (8 if quick else 32) * MiB
    return max(4, min(20_000 if not quick else 5_000, budget // max(size, 1)))


def measure(
    ctx: Context,
    bench: str,
    title: str,
    cells: Sequence[Cell],
    *,
    size: int,
    latency: bool = False,
    target: str | None = None,
    target_vs: str = "stdlib",
) -> list[Row]:
    """Time each cell: a probe run picks ``n`` so one run takes about ``ctx.seconds``, then
    ``ctx.repeat`` runs, interleaved across implementations, of which the best counts.

    Rows report messages/s and MB/s (``size`` bytes each), or microseconds per round trip
    when ``latency``. ``target`` goes on framepipe's rows. A cell that fails is reported as
    an error row; the others still run.
    """
    probe = max(_probe_count(size, ctx.quick) // (4 if latency else 1), 4)
    for cell in cells:
        ctx.progress(f"{bench}: calibrating {cell.impl}")
        try:
            elapsed = _run_once(cell, probe, ctx.placement)
            rate = (probe - 1) / max(elapsed, 1e-9)
            cell.n = max(4, min(int(rate * ctx.seconds) + 1, 50_000_000))
        except Exception as exc:  # noqa: BLE001 - one failing cell must not stop the others
            cell.error = f"{type(exc).__name__}: {exc}"
    for attempt in range(ctx.repeat):
        for cell in cells:
            if cell.error is not None:
                continue
            ctx.progress(f"{bench}: {cell.impl} run {attempt + 1}/{ctx.repeat} (n={cell.n})")
            try:
                elapsed = _run_once(cell, cell.n, ctx.placement)
            except Exception as exc:  # noqa: BLE001 - reported in the cell's row
                cell.error = f"{type(exc).__name__}: {exc}"
                continue
            cell.runs.append(elapsed)
            cell.best = elapsed if cell.best is None else min(cell.best, elapsed)
    rows = []
    for cell in cells:
        out = row(
            bench,
            title,
            cell.impl,
            None,
            "us/rt" if latency else "msg/s",
            family=cell.family,
            better="lower" if latency else "higher",
        )
        if cell.family == "framepipe" and target is not None:
            out["target"] = target
            out["target_vs"] = target_vs
        if cell.error is not None or cell.best is None:
            out["error"] = cell.error or "no run completed"
            rows.append(out)
            continue
        per_message = cell.best / (cell.n - 1)
        out.update(
            n=cell.n, seconds=round(cell.best, 6), runs=[round(r, 6) for r in cell.runs], size=size
        )
        if latency:
            out["value"] = per_message * 1e6
        else:
            out["value"] = 1.0 / per_message
            out["mb_per_s"] = size / per_message / 1e6
        rows.append(out)
    return rows


def row(
    bench: str,
    title: str,
    impl: str,
    value: float | None,
    unit: str,
    *,
    family: str | None = None,
    better: str = "higher",
    **extra: Any,
) -> Row:
    """Build a row (see :data:`Row`)."""
    out: Row = {
        "bench": bench,
        "title": title,
        "impl": impl,
        "family": family or _family(impl),
        "value": value,
        "unit": unit,
        "better": better,
    }
    out.update(extra)
    return out


def _family(impl: str) -> str:
    if impl.split(" ")[0] in ("c", "python"):
        return "framepipe"
    if impl.startswith("stdlib"):
        return "stdlib"
    return "other"


# -- readers and writers ---------------------------------------------------------------------


def _bytes_pair(impl: Impl) -> Pair:
    def pair() -> tuple[Any, Any, Sequence[Any], Sequence[Any]]:
        reader, writer = impl.oneway()
        return reader, writer, [reader], [writer]

    return pair


def _duplex_pair(impl: Impl) -> Pair:
    def pair() -> tuple[Any, Any, Sequence[Any], Sequence[Any]]:
        parent, child = impl.duplex()
        return parent, child, [parent], [child]

    return pair


def _write_bytes(size: int) -> Writer:
    def write(end: Any, n: int) -> None:
        payload = b"\xa5" * size
        send = end.send_bytes
        for _ in range(n):
            send(payload)

    return write


def _check_size(got: int, size: int) -> None:
    if got != size:
        raise RuntimeError(f"received {got} bytes, expected {size}")


def _time_reads(recv: Callable[[], Any], n: int, nbytes: Callable[[Any], int], size: int) -> float:
    """Call ``recv`` ``n`` times; the seconds from the first message to the last (the first
    call waits for the writer to start). The last message must be ``size`` bytes."""
    recv()
    start = time.perf_counter()
    for _ in range(n - 2):
        recv()
    last = recv()
    elapsed = time.perf_counter() - start
    _check_size(nbytes(last), size)
    return elapsed


def _read_bytes(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        return _time_reads(end.recv_bytes, n, len, size)

    return read


def _read_bytes_timeout(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        recv = end.recv_bytes
        timeout = READ_TIMEOUT
        recv(timeout=timeout)
        start = time.perf_counter()
        for _ in range(n - 2):
            recv(timeout=timeout)
        last = recv(timeout=timeout)
        elapsed = time.perf_counter() - start
        _check_size(len(last), size)
        return elapsed

    return read


def _read_poll_then_bytes(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        recv, poll = end.recv_bytes, end.poll
        timeout = READ_TIMEOUT
        if not poll(timeout):
            raise TimeoutError("no message within the read timeout")
        recv()
        start = time.perf_counter()
        for _ in range(n - 2):
            if not poll(timeout):
                raise TimeoutError("no message within the read timeout")
            recv()
        if not poll(timeout):
            raise TimeoutError("no message within the read timeout")
        last = recv()
        elapsed = time.perf_counter() - start
        _check_size(len(last), size)
        return elapsed

    return read


def _echo(end: Any, n: int) -> None:
    send, recv = end.send_bytes, end.recv_bytes
    for _ in range(n):
        send(recv())


def _ping(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        send, recv = end.send_bytes, end.recv_bytes
        payload = b"\x5a" * size
        send(payload)
        recv()
        start = time.perf_counter()
        for _ in range(n - 1):
            send(payload)
            last = recv()
        elapsed = time.perf_counter() - start
        _check_size(len(last), size)
        return elapsed

    return read


def _write_array(size: int) -> Writer:
    def write(end: Any, n: int) -> None:
        import numpy

        array = numpy.arange(size // 8, dtype=numpy.float64)
        send = end.send
        for _ in range(n):
            send(array)

    return write


def _read_array(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        return _time_reads(end.recv, n, lambda array: int(array.nbytes), size)

    return read


def _ref_pipe_pair(module: ModuleType) -> Pair:
    def pair() -> tuple[Any, Any, Sequence[Any], Sequence[Any]]:
        ref = module.Pipe(timeout=READ_TIMEOUT)
        return ref, ref, [], []  # the child closes its read fd itself (see _ref_pipe_write)

    return pair


def _ref_pipe_write(size: int) -> Writer:
    def write(ref: Any, n: int) -> None:
        os.close(ref.read_fd)  # this process only writes; the exit must not wait on a reader
        payload = b"\xa5" * size
        write_one = ref.write
        for _ in range(n):
            write_one(payload)

    return write


def _ref_pipe_read(size: int) -> Reader:
    def read(ref: Any, n: int) -> float:
        return _time_reads(ref.read, n, len, size)

    return read


# -- sections --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Section:
    """A named benchmark: ``run(ctx)`` returns its rows."""

    name: str
    title: str
    run: Callable[[Context], list[Row]]


SECTIONS: list[Section] = []
"""Every benchmark, in the order of the table. :func:`section` appends to it."""


def section(
    name: str, title: str
) -> Callable[[Callable[[Context], list[Row]]], Callable[[Context], list[Row]]]:
    """Register ``fn(ctx) -> rows`` as the benchmark ``name`` (what ``--only`` selects)."""

    def register(fn: Callable[[Context], list[Row]]) -> Callable[[Context], list[Row]]:
        SECTIONS.append(Section(name, title, fn))
        return fn

    return register


def size_label(size: int) -> str:
    """``64 B``, ``4 KiB``, ``16 MiB``."""
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def _id(size: int) -> str:
    return size_label(size).replace(" ", "")


def _two_pipes(impl: Impl) -> Pair:
    def pair() -> tuple[Any, Any, Sequence[Any], Sequence[Any]]:
        down_r, down_w = impl.oneway()
        up_r, up_w = impl.oneway()
        parent, child = Duo(up_r, down_w), Duo(down_r, up_w)
        return parent, child, [parent], [child]

    return pair


def _pingpong_cells(ctx: Context) -> list[Cell]:
    cells = [
        Cell(impl.name, impl.family, _duplex_pair(impl), _ping(SMALL), _echo) for impl in ctx.impls
    ]
    # Like for like with "stdlib simplex": a framepipe core whose duplex pipe is a socketpair
    # is also timed over two of its one-way pipes.
    over_sockets = [
        impl for impl in ctx.framepipe if "pipe(duplex=True): socketpair" in impl.description
    ]
    cells[len(ctx.framepipe) : len(ctx.framepipe)] = [
        Cell(f"{impl.name} 2 pipes", impl.family, _two_pipes(impl), _ping(SMALL), _echo)
        for impl in over_sockets
    ]
    ctx.note(
        "ping-pong rows: each implementation's duplex connection (see the implementations "
        "above)" + (", and, as '2 pipes', two framepipe pipe(duplex=False)" if over_sockets else "")
        + "; the ping-pong target is judged against the stdlib's Pipe() (its duplex "
        "socketpair, what a round trip uses), the 'vs stdlib' column against its best"
    )
    return cells


@section(f"pingpong-{_id(SMALL)}", f"ping-pong {size_label(SMALL)}")
def _pingpong(ctx: Context) -> list[Row]:
    return measure(
        ctx,
        f"pingpong-{_id(SMALL)}",
        f"ping-pong {size_label(SMALL)}",
        _pingpong_cells(ctx),
        size=SMALL,
        latency=True,
        target="<= 0.6x",
        target_vs="duplex",
    )


@section(f"pingpong-{_id(SMALL)}-1cpu", f"ping-pong {size_label(SMALL)}, one CPU")
def _pingpong_one_cpu(ctx: Context) -> list[Row]:
    if not hasattr(os, "sched_setaffinity"):
        ctx.note("one-CPU ping-pong skipped: no sched_setaffinity here")
        return []
    saved, ctx.placement = ctx.placement, "same"
    ctx.note(
        "one-CPU ping-pong: both processes pinned to one CPU, so a round trip costs two "
        "context switches and no cross-CPU wake-up (steadier, and closer to the library's "
        "own overhead)"
    )
    try:
        return measure(
            ctx,
            f"pingpong-{_id(SMALL)}-1cpu",
            f"ping-pong {size_label(SMALL)}, one CPU",
            _pingpong_cells(ctx),
            size=SMALL,
            latency=True,
            target="<= 0.6x",
            target_vs="duplex",
        )
    finally:
        ctx.placement = saved


_ONEWAY_TARGETS = {SMALL: ">= 2.5x", MiB: ">= 1.6x", 16 * MiB: ">= 1.6x"}


def _oneway(size: int) -> Callable[[Context], list[Row]]:
    def run(ctx: Context) -> list[Row]:
        cells = [
            Cell(impl.name, impl.family, _bytes_pair(impl), _read_bytes(size), _write_bytes(size))
            for impl in ctx.impls
        ]
        return measure(
            ctx,
            f"oneway-{_id(size)}",
            f"one-way {size_label(size)}",
            cells,
            size=size,
            target=_ONEWAY_TARGETS.get(size),
        )

    return run


for _size in (SMALL, 4 * KiB, 64 * KiB, MiB, 16 * MiB):
    section(f"oneway-{_id(_size)}", f"one-way {size_label(_size)}")(_oneway(_size))


@section(f"timeout-{_id(SMALL)}", f"{size_label(SMALL)}, read timeout")
def _with_timeout(ctx: Context) -> list[Row]:
    cells = [
        Cell(
            impl.name,
            impl.family,
            _bytes_pair(impl),
            _read_bytes_timeout(SMALL) if impl.is_framepipe else _read_poll_then_bytes(SMALL),
            _write_bytes(SMALL),
        )
        for impl in ctx.impls
    ]
    ctx.note(
        f"timeout rows: framepipe recv_bytes(timeout={READ_TIMEOUT:g}) against the "
        f"stdlib's poll({READ_TIMEOUT:g}) + recv_bytes()"
    )
    return measure(
        ctx,
        f"timeout-{_id(SMALL)}",
        f"{size_label(SMALL)}, read timeout",
        cells,
        size=SMALL,
        target=">= 7x",
    )


def _numpy(size: int) -> Callable[[Context], list[Row]]:
    def run(ctx: Context) -> list[Row]:
        try:
            import numpy  # noqa: F401
        except ImportError:
            ctx.note("numpy rows skipped: numpy is not installed")
            return []
        cells = [
            Cell(impl.name, impl.family, _bytes_pair(impl), _read_array(size), _write_array(size))
            for impl in ctx.impls
        ]
        ctx.note(
            "numpy rows: send(array)/recv() of float64 arrays; framepipe pickles with "
            "protocol 5 out of band, the stdlib pickles in band"
        )
        return measure(
            ctx,
            f"numpy-{_id(size)}",
            f"numpy {size_label(size)}",
            cells,
            size=size,
            target=">= 4x" if size == 16 * MiB else None,
        )

    return run


for _size in (MiB, 16 * MiB):
    section(f"numpy-{_id(_size)}", f"numpy {size_label(_size)}")(_numpy(_size))


@section(f"refpipe-{_id(SMALL)}", f"Pipe.read {size_label(SMALL)}")
def _ref_pipe(ctx: Context) -> list[Row]:
    cells = []
    for impl in ctx.impls:
        if impl.module is not None:
            cells.append(
                Cell(
                    impl.name,
                    impl.family,
                    _ref_pipe_pair(impl.module),
                    _ref_pipe_read(SMALL),
                    _ref_pipe_write(SMALL),
                    started=_set_writer_pid,
                )
            )
        else:
            cells.append(
                Cell(
                    impl.name,
                    impl.family,
                    _bytes_pair(impl),
                    _read_bytes(SMALL),
                    _write_bytes(SMALL),
                )
            )
    ctx.note(
        "refpipe rows: framepipe's reference-style Pipe (write()/read() with writer_pid "
        "set) against the stdlib's recv_bytes()"
    )
    return measure(
        ctx, f"refpipe-{_id(SMALL)}", f"Pipe.read {size_label(SMALL)}", cells, size=SMALL
    )


def _set_writer_pid(ref: Any, pid: int) -> None:
    """Tell the reference-style Pipe who writes, as its users do: the writer's death then
    raises instead of hanging although this process keeps the write end open."""
    ref.set_writer_pid(pid)


def _accepted(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    try:
        parameters = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
        return offered
    return {key: value for key, value in offered.items() if key in parameters}


def _first_number(item: dict[str, Any]) -> tuple[str, float] | None:
    for key, value in item.items():
        if key != "n" and isinstance(value, (int, float)) and not isinstance(value, bool):
            return key, float(value)
    return None


def normalize(rows: Any, name: str, title: str) -> list[Row]:
    """Turn what an optional section returned (a list of dicts, or a dict holding one under
    ``"rows"``) into :data:`Row` dicts: ``bench``/``title`` default to the section's, ``impl``
    to a ``method``, ``name`` or ``case`` key, and a row without ``value`` takes its first
    number, whose key becomes the unit (``us_per_roundtrip`` -> ``us per roundtrip``; a time
    unit counts as lower-is-better)."""
    if isinstance(rows, dict):
        rows = rows.get("rows", [])
    out: list[Row] = []
    for got in rows or ():
        item = dict(got)
        item.setdefault("bench", name)
        item.setdefault("title", title)
        label = item.get("method") or item.get("name") or item.get("case") or ""
        item.setdefault("impl", str(label))
        if "value" not in item:
            first = _first_number(item)
            item["value"] = first[1] if first else None
            if first is not None:
                item.setdefault("unit", first[0].replace("_", " "))
                if _TIME_UNIT.search(first[0]):
                    item.setdefault("better", "lower")
        item.setdefault("family", _family(str(item["impl"])))
        item.setdefault("unit", "")
        item.setdefault("better", "higher")
        out.append(item)
    return out


_TIME_UNIT = re.compile(r"(?:^|_)(?:ns|us|ms|s|seconds)(?:_|$)")


def optional_section(
    name: str,
    title: str,
    module: str,
    function: str,
    arguments: Callable[[Context], dict[str, Any]] | None = None,
    adapt: Callable[[Any], list[Row]] | None = None,
) -> Section:
    """A section whose rows come from ``module.function(...)`` if that module exists.

    ``arguments(ctx)`` gives the keyword arguments; by default the function is offered
    ``quick``, ``seconds``, ``repeat`` and ``impls`` (names) and gets those its signature
    accepts. ``adapt`` turns its result into rows (default: :func:`normalize`).
    """

    def run(ctx: Context) -> list[Row]:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise
            ctx.note(f"{name} rows skipped: {module} is not present")
            return []
        fn = getattr(mod, function, None)
        if fn is None:
            ctx.note(f"{name} rows skipped: {module} has no {function}()")
            return []
        if arguments is not None:
            kwargs = arguments(ctx)
        else:
            offered = {
                "quick": ctx.quick,
                "seconds": ctx.seconds,
                "repeat": ctx.repeat,
                "impls": [impl.name for impl in ctx.impls],
            }
            kwargs = _accepted(fn, offered)
        result = fn(**kwargs)
        return adapt(result) if adapt is not None else normalize(result, name, title)

    return Section(name, title, run)


OVERSHOOT_TIMEOUT = 0.010


def _overshoot_ms(wait: Callable[[], None], tries: int) -> list[float]:
    """How far past ``OVERSHOOT_TIMEOUT`` each of ``tries`` timed-out waits returned, in ms."""
    late = []
    for _ in range(tries):
        start = time.perf_counter()
        wait()
        late.append((time.perf_counter() - start - OVERSHOOT_TIMEOUT) * 1e3)
    return late


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@section("timeout-overshoot", "10 ms timeout overshoot")
def _timeout_overshoot(ctx: Context) -> list[Row]:
    """A read with a 10 ms timeout on a pipe whose writer is alive and silent: how late it
    gives up. framepipe's ``recv_bytes(timeout=0.01)`` against the stdlib's ``poll(0.01)``."""
    tries = 20 if ctx.quick else 200
    title = f"{OVERSHOOT_TIMEOUT * 1e3:g} ms timeout overshoot"
    rows: list[Row] = []
    for impl in ctx.impls:
        reader, writer = impl.oneway()
        try:
            if impl.is_framepipe:

                def wait(reader: Any = reader) -> None:
                    try:
                        reader.recv_bytes(timeout=OVERSHOOT_TIMEOUT)
                    except TimeoutError:
                        return
                    raise RuntimeError("a message arrived on a silent pipe")

            else:

                def wait(reader: Any = reader) -> None:
                    if reader.poll(OVERSHOOT_TIMEOUT):
                        raise RuntimeError("a message arrived on a silent pipe")

            ctx.progress(f"timeout-overshoot: {impl.name}")
            late = _overshoot_ms(wait, tries)
        finally:
            reader.close()
            writer.close()
        median, p99 = statistics.median(late), _percentile(late, 0.99)
        out = row("timeout-overshoot", title, impl.name, median * 1e3, "us late",
                  family=impl.family, better="lower", n=tries, p99_us=round(p99 * 1e3, 1))
        if impl.is_framepipe:
            out["target"] = "median <= 300 us, p99 <= 1 ms"
            out["met"] = median <= 0.3 and p99 <= 1.0
        rows.append(out)
    ctx.note(
        f"timeout-overshoot: median over {tries} tries of how late a {OVERSHOOT_TIMEOUT * 1e3:g}"
        " ms read timeout returns; p99 in the JSON (p99_us): "
        + ", ".join(f"{r['impl']} {r['p99_us']:g} us" for r in rows)
    )
    return rows


@section(f"watched-{_id(SMALL)}", f"{size_label(SMALL)}, watched + timed read")
def _watched(ctx: Context) -> list[Row]:
    """64 B messages/s of a read that watches its writer and has a timeout, against the same
    core's plain ``recv_bytes()``: the liveness fd and the deadline must cost almost nothing."""
    bench, title = f"watched-{_id(SMALL)}", f"{size_label(SMALL)}, watched + timed read"
    cells = []
    for impl in ctx.framepipe:
        cells.append(Cell(f"{impl.name} plain", impl.family, _bytes_pair(impl),
                          _read_bytes(SMALL), _write_bytes(SMALL)))
        cells.append(Cell(f"{impl.name} watched", impl.family, _bytes_pair(impl),
                          _read_bytes_timeout(SMALL), _write_bytes(SMALL),
                          started=lambda parent, pid: parent.watch(pid)))
    rows = measure(ctx, bench, title, cells, size=SMALL)
    by_name = {r["impl"]: r for r in rows}
    ratios = []
    for impl in ctx.framepipe:
        plain, watched = by_name.get(f"{impl.name} plain"), by_name.get(f"{impl.name} watched")
        if plain is None or watched is None or not (_ok(plain) and _ok(watched)):
            continue
        ratio = float(watched["value"]) / float(plain["value"])
        watched.update(target=">= 0.9x plain", met=ratio >= 0.9, vs_plain=round(ratio, 3))
        ratios.append(f"{impl.name} {ratio:.2f}x")
    if ratios:
        ctx.note("watched + timed read against the same core's plain read: " + ", ".join(ratios))
    return rows


def _detection_family(method: str) -> str:
    if method.startswith("framepipe"):
        return "framepipe"
    if method.startswith("multiprocessing"):
        return "stdlib"
    return "other"


def _detection_rows(result: Any) -> list[Row]:
    rows = []
    for got in result.get("rows", []) if isinstance(result, dict) else result:
        method = str(got.get("method", ""))
        extra = {k: v for k, v in got.items() if k not in ("method", "median_ms")}
        out = row(
            "watch",
            "writer death seen",
            method,
            got.get("median_ms"),
            "ms",
            family=_detection_family(method),
            better="lower",
            **extra,
        )
        median, p90 = got.get("median_ms"), got.get("p90_ms")
        small = got.get("small_child", True)  # the target is for a small child
        if out["family"] == "framepipe" and small and median is not None and p90 is not None:
            out["target"] = "median <= 2 ms, p90 <= 5 ms"
            out["met"] = median <= 2.0 and p90 <= 5.0
        rows.append(out)
    return rows


SECTIONS.append(
    optional_section("exceptions", "exceptions", "framepipe._bench_remote", "bench_exceptions")
)
SECTIONS.append(
    optional_section(
        "watch",
        "writer death seen",
        "framepipe._bench_watch",
        "bench_detection",
        arguments=lambda ctx: (
            {"n": 5, "include_psutil": False} if ctx.quick else {"n": 20, "include_psutil": True}
        ),
        adapt=_detection_rows,
    )
)


# -- ratios, targets, output -----------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A ratio goal against the stdlib, e.g. ``>= 2.5x`` or ``<= 0.6x``."""

    op: str
    ratio: float

    @classmethod
    def parse(cls, text: str) -> Target:
        """Read ``">= 2.5x"``."""
        op, _, number = text.strip().partition(" ")
        if op not in (">=", "<=") or not number.endswith("x"):
            raise ValueError(f"bad target {text!r}; expected like '>= 2.5x'")
        return cls(op, float(number[:-1]))

    def met(self, ratio: float) -> bool:
        """Whether ``ratio`` reaches the goal."""
        return ratio >= self.ratio if self.op == ">=" else ratio <= self.ratio

    def __str__(self) -> str:
        return f"{self.op} {self.ratio:g}x"


def finish(rows: list[Row]) -> list[Row]:
    """Fill ``vs_stdlib`` (against the best stdlib row of the same bench), ``vs_duplex``
    (against ``stdlib duplex``) and ``met`` (target judged on ``vs_stdlib``) where a section
    did not set them. Returns ``rows``."""
    groups: dict[str, list[Row]] = {}
    for item in rows:
        groups.setdefault(str(item["bench"]), []).append(item)
    for group in groups.values():
        stdlib = [r for r in group if r.get("family") == "stdlib" and _ok(r)]
        lower = any(r.get("better") == "lower" for r in group)
        best = None
        if stdlib:
            pick = min if lower else max
            best = pick(float(r["value"]) for r in stdlib)
        duplex = next((float(r["value"]) for r in stdlib if r["impl"] == STDLIB_DUPLEX), None)
        for item in group:
            if not _ok(item):
                item.setdefault("vs_stdlib", None)
                item.setdefault("vs_duplex", None)
                item.setdefault("met", None if not item.get("target") else False)
                continue
            value = float(item["value"])
            item.setdefault("vs_stdlib", value / best if best else None)
            item.setdefault("vs_duplex", value / duplex if duplex else None)
            target = item.get("target")
            by_duplex = item.get("target_vs") == "duplex"
            basis = item.get("vs_duplex") if by_duplex else item.get("vs_stdlib")
            if "met" in item:
                pass  # the section judged its own target
            elif target and basis is not None:
                item["met"] = Target.parse(str(target)).met(float(basis))
            else:
                item.setdefault("met", None)
    return rows


def _ok(item: Row) -> bool:
    value = item.get("value")
    return isinstance(value, (int, float)) and value > 0 and not item.get("error")


def machine_info() -> dict[str, Any]:
    """CPU count, platform, Python and library versions, and the date (UTC)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        import numpy

        numpy_version: str | None = numpy.__version__
    except ImportError:
        numpy_version = None
    try:
        from . import __version__ as version
    except ImportError:
        version = "unknown"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": model,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "numpy": numpy_version,
        "framepipe": version,
    }


def _si(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.2f} {suffix}"
    return f"{value:.1f} "


def _result(item: Row) -> str:
    if item.get("error"):
        return "error"
    value = item.get("value")
    if not isinstance(value, (int, float)):
        return "-"
    unit = str(item.get("unit", ""))
    if unit == "msg/s":
        return f"{_si(float(value))}msg/s"
    return f"{value:.3g} {unit}".strip()


def _spread(runs: Any) -> str:
    if not isinstance(runs, list) or len(runs) < 2 or min(runs) <= 0:
        return ""
    return f"{max(runs) / min(runs):.2f}x"


def _ratio(value: Any) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) else ""


def format_table(rows: Sequence[Row]) -> str:
    """The side-by-side table: one line per bench and implementation."""
    header = ["bench", "impl", "result", "MB/s", "vs stdlib", "vs duplex", "target", "met"]
    header.append("spread")
    lines: list[list[str]] = []
    last_bench = None
    for item in rows:
        bench = str(item.get("title") or item["bench"])
        met = item.get("met")
        lines.append(
            [
                bench if bench != last_bench else "",
                str(item.get("impl", "")),
                _result(item),
                f"{item['mb_per_s']:.1f}" if isinstance(item.get("mb_per_s"), (int, float)) else "",
                _ratio(item.get("vs_stdlib")),
                _ratio(item.get("vs_duplex")),
                str(item.get("target") or ""),
                "" if met is None else ("met" if met else "missed"),
                _spread(item.get("runs")),
            ]
        )
        last_bench = bench
    widths = [
        max(len(h), *(len(line[i]) for line in lines)) if lines else len(h)
        for i, h in enumerate(header)
    ]
    right = {2, 3, 4, 5, 8}

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))
        ).rstrip()

    out = [fmt(header), fmt(["-" * w for w in widths])]
    out.extend(fmt(line) for line in lines)
    errors = [
        f"  {r.get('title') or r['bench']} / {r.get('impl')}: {r['error']}"
        for r in rows
        if r.get("error")
    ]
    if errors:
        out.append("")
        out.append("errors:")
        out.extend(errors)
    return "\n".join(out)


def _summary(rows: Sequence[Row]) -> list[str]:
    lines = []
    judged: dict[str, list[Row]] = {}
    for item in rows:
        if item.get("family") == "framepipe" and item.get("target"):
            judged.setdefault(str(item["impl"]), []).append(item)
    for impl, items in judged.items():
        met = [str(r.get("title") or r["bench"]) for r in items if r.get("met")]
        missed = [str(r.get("title") or r["bench"]) for r in items if not r.get("met")]
        line = f"targets met by {impl}: {len(met)}/{len(items)}"
        if missed:
            line += f" (missed: {', '.join(missed)})"
        lines.append(line)
    return lines


def selected(sections: Iterable[Section], only: Sequence[str]) -> list[Section]:
    """The sections ``--only`` selects, in table order; all when ``only`` is empty. A pattern
    that is a section's name selects that section; otherwise it selects by prefix before
    ``-`` (``oneway`` selects every ``oneway-*``) or as a shell pattern (``*-1MiB``)."""
    sections = list(sections)
    patterns = [p.strip() for value in only for p in value.split(",") if p.strip()]
    if not patterns:
        return sections
    names = {s.name for s in sections}

    def matches(name: str, pattern: str) -> bool:
        if pattern in names:
            return name == pattern
        return name.startswith(pattern + "-") or fnmatch.fnmatchcase(name, pattern)

    return [s for s in sections if any(matches(s.name, p) for p in patterns)]


def run(
    only: Sequence[str] = (),
    *,
    quick: bool = False,
    seconds: float | None = None,
    repeat: int | None = None,
    placement: str = "free",
    progress: Callable[[str], None] = lambda message: None,
) -> dict[str, Any]:
    """Run the selected sections; returns the report (``machine``, ``implementations``,
    ``settings``, ``notes``, ``rows``) that :func:`main` prints. ``placement``: see
    :attr:`Context.placement`."""
    _placement_cpus(placement)  # a placement this machine cannot give fails before any run
    impls, notes = implementations()
    ctx = Context(
        impls,
        quick=quick,
        seconds=seconds if seconds is not None else (0.1 if quick else 0.3),
        repeat=repeat if repeat is not None else (1 if quick else 5),
        placement=placement,
        notes=notes,
        progress=progress,
    )
    chosen = selected(SECTIONS, only)
    if not chosen:
        raise ValueError(
            f"--only {' '.join(only)} selects nothing; the names are: "
            + ", ".join(s.name for s in SECTIONS)
        )
    machine = machine_info()  # dated when the run starts
    rows: list[Row] = []
    for sec in chosen:
        progress(f"{sec.name} ...")
        try:
            rows.extend(sec.run(ctx))
        except Exception as exc:  # noqa: BLE001 - a broken section is a note, not a crash
            ctx.note(f"{sec.name} failed: {type(exc).__name__}: {exc}")
    finish(rows)
    return {
        "machine": machine,
        "implementations": {impl.name: impl.description for impl in impls},
        "settings": {
            "quick": quick,
            "seconds": ctx.seconds,
            "repeat": ctx.repeat,
            "placement": placement,
            "read_timeout": READ_TIMEOUT,
        },
        "notes": ctx.notes,
        "rows": rows,
    }


_PLACEMENT_TEXT = {
    "free": "CPUs chosen by the scheduler",
    "same": "reader and writer pinned to one CPU",
    "split": "reader and writer pinned to two CPUs",
}


def format_report(report: dict[str, Any]) -> str:
    """The header (date, machine, implementations), the table, the notes and the target
    summary."""
    m = report["machine"]
    s = report["settings"]
    out = [
        f"framepipe {m['framepipe']} bench, {m['date']}",
        f"machine: {m['platform']}; {m['cpu_count']} CPUs ({m['cpus_usable']} usable); "
        f"{m['cpu_model']}; {m['python']}" + (f"; numpy {m['numpy']}" if m["numpy"] else ""),
        "implementations:",
        *(f"  {name:<15} {text}" for name, text in report["implementations"].items()),
        (
            f"each cell: best of {s['repeat']} run(s) of ~{s['seconds']:g} s, writer in a forked "
            f"child ({_PLACEMENT_TEXT[s.get('placement', 'free')]}), reader timed from first to "
            "last message; vs stdlib = against the stdlib's "
            "best, vs duplex = against Pipe(duplex=True); spread = slowest run / fastest run; "
            "MB = 10^6 bytes"
        ),
        "",
        format_table(report["rows"]),
    ]
    if report["notes"]:
        out += ["", "notes:", *(f"  {note}" for note in report["notes"])]
    summary = _summary(report["rows"])
    if summary:
        out += ["", *summary]
    return "\n".join(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument(
        "suite",
        nargs="?",
        default="core",
        choices=SUITES,
        help="core: framed pipes against multiprocessing.connection (default); "
        "workers: the Pool and Worker against concurrent.futures, multiprocessing.Pool, "
        "loky, pebble, mpire; loader: the DataLoader against torch's",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="short runs (one of ~0.1 s a cell; default: best of 5 of ~0.3 s)",
    )
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="NAME",
        help="run only these benches (name, prefix such as 'oneway', or "
        "pattern; repeatable, comma-separated); see --list",
    )
    parser.add_argument("--list", action="store_true", help="list the bench names and exit")
    parser.add_argument(
        "--seconds", type=float, default=None, help="target duration of one run of a cell"
    )
    parser.add_argument("--repeat", type=int, default=None, help="runs per cell (best counts)")
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="free",
        help="where reader and writer run: free (scheduler), same (one CPU), split (two CPUs)",
    )
    parser.add_argument("--verbose", "-v", action="store_true", help="progress on stderr")


SUITES = ("core", "workers", "loader")


def main(args: argparse.Namespace) -> int:
    """Run ``python -m framepipe bench`` with parsed ``args``."""
    if args.suite == "workers":
        from . import _bench_workers

        return _bench_workers.main(args)
    if args.suite == "loader":
        from . import _bench_loader

        return _bench_loader.main(args)
    if args.list:
        for sec in SECTIONS:
            print(f"{sec.name:<18} {sec.title}")
        return 0

    def progress(message: str) -> None:
        if args.verbose:
            print(message, file=sys.stderr, flush=True)

    try:
        report = run(
            args.only,
            quick=args.quick,
            seconds=args.seconds,
            repeat=args.repeat,
            placement=args.placement,
            progress=progress,
        )
    except ValueError as exc:
        print(f"framepipe bench: {exc}", file=sys.stderr)
        return 2
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return 0
