"""The loader's exceptions: framepipe's, and also the ``RuntimeError`` torch's DataLoader raises."""

from __future__ import annotations

from ..errors import TaskTimeout, WorkerStartError


class LoaderTimeout(TaskTimeout, RuntimeError):
    """A batch took longer than the loader's ``timeout``: a :class:`TaskTimeout` (with the
    stuck worker's stack) that is also the ``RuntimeError`` torch's DataLoader raises."""


class WorkerInitError(WorkerStartError, RuntimeError):
    """``worker_init_fn`` raised in a DataLoader worker (its exception is ``__cause__``): a
    :class:`WorkerStartError` that is also the ``RuntimeError`` torch's DataLoader raises."""


class WorkerCrashWarning(RuntimeWarning):
    """A DataLoader worker died and its batches went to a fresh one
    (``worker_crash_retries``); the warning's text is the crash report."""
