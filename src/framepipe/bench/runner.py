"""Running and timing: a writer in a forked child with a watchdog (:class:`Child`), one
implementation's part in a comparison (:class:`Cell`), and :func:`measure`, which calibrates,
repeats and interleaves the cells of one benchmark and turns them into rows.

A cell never hangs the run: its child is killed after :data:`CELL_TIMEOUT` seconds, and an error
in the child or the reader becomes that cell's error row while the other cells go on.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

from .peers import Impl
from .rows import Row, row

__all__ = [
    "CELL_TIMEOUT",
    "PLACEMENTS",
    "Cell",
    "CellTimeout",
    "Child",
    "Context",
    "DEPTHS",
    "Depth",
    "Section",
    "WriterFailed",
    "describe",
    "elapsed_since",
    "measure",
    "placement_cpus",
]

CELL_TIMEOUT = 120.0  # a writer that runs longer is killed: no bug can hang the run
JOIN_GRACE = 5.0
_REPORT_MAX = 4096  # a child's error report always fits the pipe buffer: writing never blocks


# -- the writer in another process ---------------------------------------------------------------


def _close_quietly(obj: Any) -> None:
    try:
        obj.close()
    except Exception:  # noqa: BLE001 - clean-up of a connection already broken
        pass


def _child_main(
    fn: Callable[..., None],
    args: tuple[Any, ...],
    drop: Sequence[Any],
    report_fd: int,
    cpu: int | None,
) -> None:
    # Ctrl-C reaches the whole process group: the parent stops the run and ends this child.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    for obj in drop:
        _close_quietly(obj)
    try:
        fn(*args)
        for arg in args:  # a transport that queues (pyzmq) delivers what it holds
            if hasattr(arg, "close"):
                arg.close()
    except (BrokenPipeError, ConnectionResetError, EOFError):
        pass  # the reader went away: the benchmark is over
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then exit 1
        text = f"{type(exc).__name__}: {exc}".encode("utf-8", "replace")[:_REPORT_MAX]
        try:
            os.write(report_fd, text)
        except OSError:
            pass
        raise SystemExit(1) from None


class CellTimeout(RuntimeError):
    """A writer ran past its time limit and was killed."""


class WriterFailed(RuntimeError):
    """The writer raised; the message is its exception."""


class _Fd:
    """A raw fd with ``close()``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self) -> None:
        os.close(self.fd)


class Child:
    """A forked child running ``fn(*args)`` on connections it inherited.

    The child first closes ``drop_in_child`` (its copies of this process's ends); this process
    closes ``drop_in_parent`` once the child has started, so either side's death is an end of
    file for the other. A watchdog kills the child after ``timeout`` seconds, which turns any
    blocked read here into an error. ``child_cpu`` pins the child to that CPU. On exit
    ``close_on_exit`` is closed (which also unblocks a writer stuck on a full pipe) and the
    child joined, then killed if it lingers: no child outlives the block. An exception in the
    child becomes :class:`WriterFailed` here.
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

    def __enter__(self) -> Child:  # noqa: PYI034 - not meant to be subclassed
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


# -- settings of a run -------------------------------------------------------------------------


@dataclass(frozen=True)
class Depth:
    """How hard a run looks: each cell is the best of ``repeat`` runs of about ``seconds``;
    death detection kills ``kills`` children."""

    name: str
    repeat: int
    seconds: float
    kills: int


DEPTHS = {
    "quick": Depth("quick", repeat=1, seconds=0.05, kills=3),
    "default": Depth("default", repeat=5, seconds=0.15, kills=15),
    "full": Depth("full", repeat=5, seconds=0.3, kills=30),
}

PLACEMENTS = ("free", "same", "split")


def placement_cpus(placement: str) -> tuple[int | None, int | None]:
    """The CPUs of the reader (this process) and of the writer for ``placement``: ``free``
    (the scheduler decides), ``same`` (one CPU for both) or ``split`` (two CPUs)."""
    if placement == "free":
        return None, None
    cpus = sorted(os.sched_getaffinity(0))
    if placement == "same":
        return cpus[0], cpus[0]
    if placement == "split" and len(cpus) >= 2:
        return cpus[0], cpus[1]
    raise ValueError(
        f"placement {placement!r} needs to be one of {', '.join(PLACEMENTS)}, and split needs "
        f"2 CPUs (this process may use {len(cpus)}); pick another --placement"
    )


def _no_progress(message: str) -> None:
    pass


@dataclass
class Context:
    """Settings of one run, the implementations under test and the notes to print."""

    impls: list[Impl]
    depth: Depth = DEPTHS["default"]
    placement: str = "free"
    notes: list[str] = field(default_factory=list)
    progress: Callable[[str], None] = _no_progress
    """Called with a line for stderr as cells finish."""

    def note(self, text: str) -> None:
        """Add a line to the notes printed under the table."""
        if text not in self.notes:
            self.notes.append(text)

    @property
    def framepipe(self) -> list[Impl]:
        """framepipe's cores in this run."""
        return [impl for impl in self.impls if impl.is_framepipe]

    @property
    def full(self) -> bool:
        """Whether this is the long run."""
        return self.depth.name == "full"


# -- measuring one benchmark -------------------------------------------------------------------

Pair = Callable[[], tuple[Any, Any, Sequence[Any], Sequence[Any]]]
"""Makes ``(parent end, child end, what the child closes, what this process closes)`` (see
:class:`Child`)."""
Reader = Callable[[Any, int], float]
"""Reads ``n`` messages (or round trips) on the parent end; returns the seconds from the first
to the last."""
Writer = Callable[[Any, int], None]
"""Runs in the child: writes ``n`` messages (or answers ``n`` round trips) on the child end."""


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


def _run_once(cell: Cell, n: int, placement: str = "free") -> float:
    parent_cpu, child_cpu = placement_cpus(placement)
    saved = os.sched_getaffinity(0) if parent_cpu is not None else None
    parent, child, drop_in_child, drop_in_parent = cell.pair()
    try:
        if parent_cpu is not None:
            os.sched_setaffinity(0, {parent_cpu})
        with Child(
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


def _probe_count(size: int, depth: Depth) -> int:
    budget = (4 if depth.name == "quick" else 16) * 1024 * 1024
    cap = 2_000 if depth.name == "quick" else 10_000
    return max(4, min(cap, budget // max(size, 1)))


def describe(item: Row) -> str:
    """A cell's result in a few characters, for progress lines: ``1.29 M msg/s``."""
    if item.get("error"):
        return "error: " + str(item["error"])[:60]
    value = item.get("value")
    if not isinstance(value, (int, float)):
        return "-"
    unit = str(item.get("unit", ""))
    if unit == "msg/s":
        for scale, suffix in ((1e6, "M "), (1e3, "k ")):
            if value >= scale:
                return f"{value / scale:.2f} {suffix}msg/s"
    return f"{value:.3g} {unit}"


def measure(
    ctx: Context,
    bench: str,
    title: str,
    cells: Sequence[Cell],
    *,
    size: int,
    latency: bool = False,
    target: str | None = None,
    basis: str = "stdlib",
    judge: Callable[[Cell], bool] = lambda cell: cell.impl in ("c", "python"),
) -> list[Row]:
    """Time each cell: a probe run picks ``n`` so one run takes about ``ctx.depth.seconds``,
    then ``ctx.depth.repeat`` runs, interleaved across the cells, of which the best counts.

    Rows report messages/s and MB/s (``size`` bytes each), or microseconds per round trip when
    ``latency``. ``target`` (judged against ``basis``) goes on the rows ``judge`` picks:
    framepipe's cores with their default settings. A cell that fails is an error row; the
    others still run.
    """
    depth = ctx.depth
    probe = max(_probe_count(size, depth) // (4 if latency else 1), 4)
    for cell in cells:
        try:
            elapsed = _run_once(cell, probe, ctx.placement)
            rate = (probe - 1) / max(elapsed, 1e-9)
            cell.n = max(4, min(int(rate * depth.seconds) + 1, 50_000_000))
        except Exception as exc:  # noqa: BLE001 - one failing cell must not stop the others
            cell.error = f"{type(exc).__name__}: {exc}"
    for _attempt in range(depth.repeat):
        for cell in cells:
            if cell.error is not None:
                continue
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
            basis=basis,
        )
        if target is not None and judge(cell):
            out["target"] = target
        if cell.error is not None or cell.best is None:
            out["error"] = cell.error or "no run completed"
        else:
            per_message = cell.best / (cell.n - 1)
            out.update(
                n=cell.n,
                seconds=round(cell.best, 6),
                runs=[round(r, 6) for r in cell.runs],
                size=size,
            )
            if latency:
                out["value"] = per_message * 1e6
            else:
                out["value"] = 1.0 / per_message
                out["mb_per_s"] = size / per_message / 1e6
        ctx.progress(cell.impl + (": failed (the table says why)" if "error" in out else ""))
        rows.append(out)
    return rows


def elapsed_since(start: float) -> str:
    """``1.2 s`` since ``start`` (a ``time.monotonic()``)."""
    return f"{time.monotonic() - start:.1f} s"


@dataclass(frozen=True)
class Section:
    """One benchmark of a suite: ``run(ctx)`` returns its rows.

    ``about`` says in a line what a row measures and which way is better; ``target`` says what
    is judged, against what (empty when nothing is). ``default`` sections run without
    ``--full``.
    """

    name: str
    title: str
    about: str
    run: Callable[[Context], list[Row]]
    target: str = ""
    default: bool = False
    needs: tuple[str, ...] = ()
    """Optional modules its rows need (see :mod:`.peers`)."""
