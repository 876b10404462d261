"""Progress of a map or a DataLoader epoch: ``progress=`` of ``Pool.map``, ``imap``,
``imap_unordered`` and ``DataLoader``.

``progress`` is one of:

- ``True``: a bar on stderr: tqdm's when tqdm is installed, else a plain one-line progress
  when stderr is a terminal (nothing elsewhere);
- a tqdm bar (anything with ``update`` and ``set_postfix``): updated, left open;
- a rich ``Progress`` (anything with ``add_task`` and ``advance``): a task added to it;
- a callable: called with a :class:`Progress` after each result.

Each counts the results handed out, their rate, and the crashes (:class:`WorkerCrashed`) and
timeouts (:class:`TaskTimeout`) among them. ``None`` or ``False``: nothing at all.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

from .errors import TaskTimeout, WorkerCrashed

T = TypeVar("T")

PLAIN_PERIOD = 0.1  # seconds between two redraws of the plain line


@dataclass
class Progress:
    """What a ``progress`` callable receives after each result."""

    done: int
    total: int | None
    crashes: int
    timeouts: int
    elapsed: float

    @property
    def rate(self) -> float:
        """Results per second so far."""
        return self.done / self.elapsed if self.elapsed > 0 else 0.0


class _Plain:
    """One line on a terminal, redrawn in place at most every :data:`PLAIN_PERIOD`."""

    def __init__(self, desc: str, stream: Any, unit: str) -> None:
        self.desc = desc
        self.stream = stream
        self.unit = unit
        self.drawn = 0.0

    def __call__(self, p: Progress, final: bool = False) -> None:
        now = time.monotonic()
        if not final and now - self.drawn < PLAIN_PERIOD:
            return
        self.drawn = now
        total = f"/{p.total}" if p.total is not None else ""
        pct = f" {100 * p.done // p.total:3d}%" if p.total else ""
        line = (
            f"\r{self.desc}:{pct} {p.done}{total} {self.unit}s, {p.rate:.1f} {self.unit}s/s, "
            f"{p.crashes} crashes, {p.timeouts} timeouts"
        )
        self.stream.write(line + ("\n" if final else ""))
        self.stream.flush()


class _Tracker:
    def __init__(self, progress: Any, total: int | None, desc: str, unit: str) -> None:
        self.total = total
        self.done = self.crashes = self.timeouts = 0
        self.start = time.monotonic()
        self._bar: Any = None  # a tqdm bar we opened (closed at the end)
        self._tqdm: Any = None  # a tqdm bar to update
        self._rich: Any = None
        self._task: Any = None
        self._call: Callable[..., None] | None = None
        self._plain: _Plain | None = None
        if progress is True:
            try:
                from tqdm.auto import tqdm
            except ImportError:
                if sys.stderr is not None and sys.stderr.isatty():
                    self._plain = _Plain(desc, sys.stderr, unit)
            else:
                self._bar = self._tqdm = tqdm(
                    total=total, desc=desc, unit=unit, file=sys.stderr, dynamic_ncols=True
                )
                self._tqdm.set_postfix(crashes=0, timeouts=0, refresh=False)
        elif hasattr(progress, "update") and hasattr(progress, "set_postfix"):
            self._tqdm = progress
            if getattr(progress, "total", None) is None and total is not None:
                progress.total = total
            progress.set_postfix(crashes=0, timeouts=0, refresh=False)
        elif hasattr(progress, "add_task") and hasattr(progress, "advance"):
            self._rich = progress
            self._task = progress.add_task(desc, total=total)
        elif callable(progress):
            self._call = progress
        else:
            raise TypeError(
                "progress must be True, a callable, a tqdm bar or a rich Progress, "
                f"not {type(progress).__name__}"
            )

    def snapshot(self) -> Progress:
        return Progress(
            self.done, self.total, self.crashes, self.timeouts, time.monotonic() - self.start
        )

    def step(self, exc: BaseException | None = None) -> None:
        self.done += 1
        failed = False
        if isinstance(exc, WorkerCrashed):
            self.crashes += 1
            failed = True
        elif isinstance(exc, TaskTimeout):
            self.timeouts += 1
            failed = True
        if self._tqdm is not None:
            if failed:
                self._tqdm.set_postfix(crashes=self.crashes, timeouts=self.timeouts, refresh=False)
            self._tqdm.update(1)
        elif self._rich is not None:
            self._rich.advance(self._task, 1)
            if failed:
                self._rich.update(
                    self._task,
                    description=f"{self.crashes} crashes, {self.timeouts} timeouts",
                )
        elif self._call is not None:
            self._call(self.snapshot())
        elif self._plain is not None:
            self._plain(self.snapshot())

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self._plain is not None:
            self._plain(self.snapshot(), final=True)


def check(progress: Any) -> None:
    """Raise TypeError now for a ``progress`` that is none of the accepted kinds."""
    if progress is None or progress is False or progress is True or callable(progress):
        return
    if hasattr(progress, "update") and hasattr(progress, "set_postfix"):
        return
    if hasattr(progress, "add_task") and hasattr(progress, "advance"):
        return
    raise TypeError(
        "progress must be True, a callable, a tqdm bar or a rich Progress, "
        f"not {type(progress).__name__}"
    )


def track(
    it: Iterator[T], progress: Any, total: int | None, desc: str, unit: str = "task"
) -> Iterator[T]:
    """``it``, counting its results (and the failure that ends it) on ``progress``."""
    if progress is None or progress is False:
        return it
    return _tracked(it, progress, total, desc, unit)


def _tracked(
    it: Iterator[T], progress: Any, total: int | None, desc: str, unit: str
) -> Iterator[T]:
    tracker = _Tracker(progress, total, desc, unit)
    try:
        while True:
            try:
                value = next(it)
            except StopIteration:
                return
            except Exception as exc:
                tracker.step(exc)
                raise
            tracker.step()
            yield value
    finally:
        tracker.close()
        close = getattr(it, "close", None)
        if close is not None:
            close()
