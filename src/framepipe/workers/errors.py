"""The errors of the worker layer.

Each is a :class:`framepipe.FramepipeError` and, where one exists, the stdlib class that code
using ``concurrent.futures`` already catches: :class:`TaskTimeout` is a ``TimeoutError``,
:class:`WorkerCancelled` a ``concurrent.futures.CancelledError``, :class:`PoolBroken` and
:class:`WorkerCrashed` a ``concurrent.futures.process.BrokenProcessPool`` (a
``BrokenExecutor``), :class:`TaskPicklingError` a ``pickle.PicklingError`` (and a
``TypeError``), :class:`TaskUnpicklingError` a ``BrokenProcessPool``, and :class:`TaskExit`
(a pool's task that called ``sys.exit``) a ``SystemExit``.
"""

from __future__ import annotations

import concurrent.futures
import pickle
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ..errors import FramepipeError, signal_name
from ..remote import loads_exception

__all__ = [
    "WorkerError",
    "WorkerCrashed",
    "TaskTimeout",
    "WorkerCancelled",
    "PoolBroken",
    "WorkerStartError",
    "TaskPicklingError",
    "TaskUnpicklingError",
    "TaskExit",
    "format_bytes",
]


def format_bytes(n: int | None) -> str:
    """``3.1 GiB`` for 3.1 * 2**30; ``unknown`` for None."""
    if n is None:
        return "unknown"
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"  # pragma: no cover - the loop always returns


def _task_text(task_name: str | None, task_id: int | None) -> str:
    if task_name is None:
        return "while idle"
    return f"while running {task_name}" + ("" if task_id is None else f" (task {task_id})")


class WorkerError(FramepipeError):
    """Base class of the worker layer's errors."""


class WorkerStartError(WorkerError):
    """A worker could not start: its initializer raised (the exception is ``__cause__``), or
    the process died before it was ready."""


class WorkerCrashed(WorkerError, BrokenProcessPool):
    """A worker process died while callers were waiting on it. Also a
    ``concurrent.futures.process.BrokenProcessPool``, what code written for
    ``ProcessPoolExecutor`` catches when a worker dies (a framepipe pool goes on).

    Attributes: ``worker`` (its name), ``pid``, ``exitcode`` (negative for a signal, as
    ``subprocess.Popen`` reports it; None when unknown), ``signal_name``, ``core_dumped``,
    ``task_name`` and ``task_id`` (the task it was running, None when idle), ``peak_rss``
    (bytes, the highest resident size seen; None when unknown), ``oom_killed`` (True when the
    OOM-kill counter of the worker's memory cgroup rose, None when unknown), ``memory_limit``
    (the limit in bytes of that cgroup, when the OOM killer struck and it has one),
    ``native_traceback`` (faulthandler's dump of a crash in C code), ``stderr_tail`` (the
    last lines the worker wrote to its stderr, at the fd level), ``log_path`` (where its
    whole stderr was kept, when it was) and ``task_crashes`` (for a pool's task that killed
    workers before this one, see ``max_task_crashes``: the reports of those earlier deaths,
    oldest first; else empty).
    """

    def __init__(
        self,
        worker: str,
        pid: int | None,
        exitcode: int | None,
        *,
        core_dumped: bool = False,
        task_name: str | None = None,
        task_id: int | None = None,
        peak_rss: int | None = None,
        oom_killed: bool | None = None,
        memory_limit: int | None = None,
        native_traceback: str | None = None,
        stderr_tail: str = "",
        log_path: str | None = None,
        reason: str | None = None,
        task_crashes: list[WorkerCrashed] | None = None,
    ) -> None:
        self.worker = worker
        self.pid = pid
        self.exitcode = exitcode
        self.core_dumped = core_dumped
        self.task_name = task_name
        self.task_id = task_id
        self.peak_rss = peak_rss
        self.oom_killed = oom_killed
        self.memory_limit = memory_limit
        self.native_traceback = native_traceback
        self.stderr_tail = stderr_tail
        self.log_path = log_path
        self.reason = reason
        self.signal_name = signal_name(-exitcode) if exitcode is not None and exitcode < 0 else None
        self.task_crashes: list[WorkerCrashed] = list(task_crashes or ())
        super().__init__(self._message())

    def blame(self, earlier: list[WorkerCrashed]) -> None:
        """Record that the task it names had killed the workers of ``earlier`` before."""
        self.task_crashes = list(earlier)
        self.args = (self._message(),)

    def _message(self) -> str:
        who = f"worker {self.worker!r} (pid {self.pid})"
        if self.exitcode is None:
            how = "died (its exit status could not be read)"
        elif self.exitcode < 0:
            how = f"was killed by {self.signal_name}"
            if self.core_dumped:
                how += " (core dumped)"
        else:
            how = f"exited with code {self.exitcode}"
        msg = f"{who} {how} {_task_text(self.task_name, self.task_id)}"
        if self.reason:
            msg += f" ({self.reason})"
        if self.task_crashes:
            earlier = ", ".join(
                f"{c.worker!r} ({c.signal_name or f'exit code {c.exitcode}'})"
                for c in self.task_crashes
            )
            n = len(self.task_crashes)
            msg += f"; the task had killed {n} worker{'s' if n > 1 else ''} before: {earlier}"
        if self.oom_killed:
            msg += f"; likely the OOM killer: peak RSS {format_bytes(self.peak_rss)}"
            if self.memory_limit is not None:
                msg += f" (its memory cgroup's limit is {format_bytes(self.memory_limit)})"
        elif self.peak_rss is not None:
            msg += f"; peak RSS {format_bytes(self.peak_rss)}"
        if self.native_traceback:
            msg += "\n\nnative traceback:\n" + self.native_traceback.rstrip()
        if self.stderr_tail:
            msg += "\n\nlast stderr:\n" + self.stderr_tail.rstrip()
        elif self.log_path:
            msg += f"\n(its stderr is in {self.log_path})"
        return msg

    def __reduce__(self) -> Any:
        state = {k: v for k, v in self.__dict__.items() if k not in ("worker", "pid", "exitcode")}
        state.pop("signal_name", None)
        return (_rebuild, (type(self), (self.worker, self.pid, self.exitcode), state))


class TaskTimeout(WorkerError, TimeoutError):
    """A task (or a stream's next item) did not finish within its deadline.

    ``stack`` holds every thread's stack in the worker, taken with faulthandler before the
    worker was stopped (None when the worker did not answer); ``worker``, ``pid``,
    ``task_name``, ``task_id`` and ``timeout`` say which task, where and how long it had."""

    def __init__(
        self,
        worker: str,
        pid: int | None,
        timeout: float,
        *,
        task_name: str | None = None,
        task_id: int | None = None,
        stack: str | None = None,
        what: str = "task",
    ) -> None:
        self.worker = worker
        self.pid = pid
        self.timeout = timeout
        self.task_name = task_name
        self.task_id = task_id
        self.stack = stack
        self.what = what
        task = task_name or "a task"
        if task_id is not None:
            task += f" (task {task_id})"
        msg = (
            f"worker {worker!r} (pid {pid}) did not finish {task} within {timeout:g} s"
            if what == "task"
            else f"worker {worker!r} (pid {pid}) produced no {what} of {task} within {timeout:g} s"
        )
        msg += "; the worker was stopped and will be replaced"
        if stack:
            msg += "\n\nits stack when the deadline passed:\n" + stack.rstrip()
        else:
            msg += " (its stack could not be taken: the worker did not answer)"
        super().__init__(msg)

    def __reduce__(self) -> Any:
        state = dict(self.__dict__)
        args = (state.pop("worker"), state.pop("pid"), state.pop("timeout"))
        return (_rebuild, (type(self), args, state))


class WorkerCancelled(WorkerError, concurrent.futures.CancelledError):
    """The call was cancelled with :meth:`Worker.cancel`: raised in the worker's main thread
    inside the running call, and to every caller whose call was running or queued."""


class PoolBroken(WorkerError, BrokenProcessPool):
    """The pool gave up: its workers crashed more than ``max_restarts`` times within
    ``restart_window`` seconds, or their initializer failed. ``crashes`` lists the last
    :class:`WorkerCrashed` errors (newest last). A ``BrokenProcessPool`` (and so a
    ``concurrent.futures.BrokenExecutor``)."""

    def __init__(self, message: str, crashes: list[BaseException] | None = None) -> None:
        self.reason = message
        self.crashes = list(crashes or [])
        text = message
        if self.crashes:
            text += "\n\nlast crashes:\n" + "\n".join(
                f"  - {str(c).splitlines()[0]}" for c in self.crashes[-5:]
            )
        super().__init__(text)

    def __reduce__(self) -> Any:
        return (type(self), (self.reason, self.crashes))


class TaskPicklingError(WorkerError, TypeError, pickle.PicklingError):
    """A task's function or arguments (in this process), or its result (in the worker), could
    not be pickled: a ``pickle.PicklingError`` as ``ProcessPoolExecutor`` raises, and a
    ``TypeError``. The pickling error is ``__cause__``; only that task fails."""


class TaskUnpicklingError(WorkerError, BrokenProcessPool, pickle.UnpicklingError):
    """A task's function or arguments could not be unpickled in the worker, or its result in
    this process (the error is ``__cause__``). Only that task fails and the pool goes on; a
    ``BrokenProcessPool`` all the same, what ``ProcessPoolExecutor`` raises then."""


class TaskExit(WorkerError, SystemExit):
    """A pool's task raised ``SystemExit`` (``sys.exit()``): re-raised in the caller as a
    ``SystemExit`` with the same ``code``, as ``ProcessPoolExecutor`` does, and also a
    :class:`WorkerError` (an ``Exception``), so that ``except Exception`` catches it too. The
    worker goes on. The task's own exception is ``__cause__``."""

    def __init__(self, message: str, code: Any = None) -> None:
        super().__init__(message)
        self.code = code

    def __reduce__(self) -> Any:
        return (type(self), (str(self), self.code))


def _rebuild(cls: type, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return cls(*args, **kwargs)


def revive(blob: bytes, executor: bool = False) -> BaseException:
    """The exception a worker sent (``dumps_exception``), to raise in the caller. A
    SystemExit, KeyboardInterrupt or GeneratorExit raised by a task comes as a
    :class:`WorkerError` whose cause it is: never re-raised as itself in the caller, where it
    would end the program or look like a Ctrl-C; for a pool (``executor``), a SystemExit
    comes as a :class:`TaskExit`, a SystemExit as ``ProcessPoolExecutor`` re-raises it."""
    exc = loads_exception(blob)
    if executor and isinstance(exc, SystemExit):
        err: WorkerError = TaskExit(f"the task raised SystemExit({exc.code!r})", exc.code)
        err.__cause__ = exc
        return err
    if not isinstance(exc, Exception):
        err = WorkerError(f"the task raised {type(exc).__name__}({exc})")
        err.__cause__ = exc
        return err
    return exc
