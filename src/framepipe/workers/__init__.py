"""The layer users touch: worker processes over framepipe's channels.

- :class:`Worker`: one process, one private channel, an actor (``call``, ``submit``,
  ``stream``, ``ping``, ``cancel``, ``stack``, ``exec`` / ``store`` / ``load``).
- :class:`Pool`: a ``concurrent.futures.Executor`` whose workers each have their own channel,
  so one crash fails one task and the pool goes on.
- :class:`DataLoader`: torch's DataLoader arguments over per-worker channels (with
  :func:`get_worker_info` for iterable datasets).

Failures explain themselves: :class:`WorkerCrashed` (which worker, pid, signal, task, peak
RSS, OOM hint, native traceback, last stderr lines), :class:`TaskTimeout` (with the stuck
worker's stack), :class:`PoolBroken`, :class:`WorkerCancelled`, :class:`MainGuardError` (a
spawned worker re-imported a main module that starts workers: the ``__main__`` guard is
missing).
"""

from ._dispatch import worker_namespace
from .errors import (
    MainGuardError,
    PoolBroken,
    TaskExit,
    TaskPicklingError,
    TaskTimeout,
    TaskUnpicklingError,
    WorkerCancelled,
    WorkerCrashed,
    WorkerError,
    WorkerStartError,
)
from .loader import (
    DataLoader,
    LoaderTimeout,
    WorkerCrashWarning,
    WorkerInfo,
    WorkerInitError,
    default_collate,
    default_convert,
    get_worker_info,
)
from .pool import Pool
from .worker import Stream, Worker

__all__ = [
    "DataLoader",
    "LoaderTimeout",
    "MainGuardError",
    "Pool",
    "PoolBroken",
    "Stream",
    "TaskExit",
    "TaskPicklingError",
    "TaskTimeout",
    "TaskUnpicklingError",
    "Worker",
    "WorkerCancelled",
    "WorkerCrashWarning",
    "WorkerCrashed",
    "WorkerError",
    "WorkerInfo",
    "WorkerInitError",
    "WorkerStartError",
    "default_collate",
    "default_convert",
    "get_worker_info",
    "worker_namespace",
]

from .group import GroupFailed, GroupResult, RankOutcome, Std, WorkerGroup  # noqa: E402

__all__ += ["GroupFailed", "GroupResult", "RankOutcome", "Std", "WorkerGroup"]
