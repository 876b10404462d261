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
import contextlib
import multiprocessing
import os
import pickle
import re
import sys
import threading
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from ..errors import FramepipeError, how_it_ended, signal_name
from ..remote import RemoteTraceback, loads_exception

__all__ = [
    "WorkerError",
    "WorkerCrashed",
    "TaskTimeout",
    "WorkerCancelled",
    "PoolBroken",
    "WorkerStartError",
    "MainGuardError",
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


def _task_text(task_name: str | None, task_id: int | None, starting: bool = False) -> str:
    if task_name is None:
        return "while starting" if starting else "while idle"
    return f"while running {task_name}" + ("" if task_id is None else f" (task {task_id})")


_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+")
_FRAME_FILE = re.compile(r'^  File "(.*)", line')
_PKG = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_STDLIB = (
    os.path.dirname(os.path.abspath(multiprocessing.__file__)) + os.sep,
    os.path.abspath(threading.__file__),
    "<string>",
)
# the frames of a worker's loop below the user's (framepipe.workers, multiprocessing's start)
_LOOP = (os.path.dirname(os.path.abspath(__file__)) + os.sep, *_STDLIB)
# the frames of framepipe's own threads in a worker (the health thread)
_OWN = (_PKG, *_STDLIB)
# the frame where a worker process begins (framepipe.workers._child.child_main)
_ENTRY = re.compile(r'_child\.py", line \d+ in child_main$')


def _internal(frame: str, where: tuple[str, ...] = _LOOP) -> bool:
    """A faulthandler frame line in one of the places ``where`` (not the user's code)."""
    m = _FRAME_FILE.match(frame)
    return m is not None and m.group(1).startswith(where)


def tidy_dump(text: str) -> str:
    """A faulthandler dump (a native crash, or the stacks taken at a deadline) ordered for a
    reader: its first line, then the thread that was running (the crash's own), with the
    frames of framepipe's worker loop below the user's collapsed into one line; then the
    user's other threads. framepipe's own threads (the health thread) are left out. Text that
    is not a dump comes back as it was."""
    lines = text.rstrip().split("\n")
    head: list[str] = []
    blocks: list[list[str]] = []
    tail: list[str] = []
    for line in lines:
        if _THREAD.match(line):
            blocks.append([line])
        elif blocks and (line.startswith("  ") or not line.strip()) and not tail:
            blocks[-1].append(line)
        elif blocks:
            tail.append(line)
        else:
            head.append(line)
    if not blocks:
        return text.rstrip()
    current = [b for b in blocks if b[0].startswith("Current")]
    others = [b for b in blocks if not b[0].startswith("Current")]
    own = [b for b in others if all(_internal(f, _OWN) for f in b[1:] if f.strip())]
    out = [line for line in head if line.strip()]
    if out:
        out.append("")
    for block in current + [b for b in others if b not in own]:
        frames = [f for f in block[1:] if f.strip()]
        # below the worker's entry, a forked worker's stack goes on with the frames the parent
        # had when it forked (its own code among them): not this process's, folded too
        # (a spawned worker's has multiprocessing's own there: folded, and said as such)
        entry = next((i for i, f in enumerate(frames) if _ENTRY.search(f) and _internal(f)), None)
        scope = frames if entry is None else frames[: entry + 1]
        parent = entry is not None and any(not _internal(f) for f in frames[entry + 1 :])
        user = [i for i, f in enumerate(scope) if not _internal(f)]
        cut = user[-1] + 1 if user else (entry + 1 if parent and entry is not None else None)
        if cut is not None and cut < len(frames):
            whose = "framepipe's and Python's own" + (
                ", and the forking parent's" if parent else ""
            )
            frames = frames[:cut] + [f"  ... {len(frames) - cut} more frames below ({whose})"]
        out += [block[0], *frames, ""]
    if own:
        out.append(f"(framepipe's own threads left out: {len(own)})")
    out += [line for line in tail if line.strip()]
    return "\n".join(out).rstrip()


class WorkerError(FramepipeError):
    """Base class of the worker layer's errors."""


class WorkerStartError(WorkerError):
    """A worker could not start: its initializer raised (the exception is ``__cause__``), or
    the process died before it was ready."""


class MainGuardError(WorkerStartError):
    """A worker died while starting because the main module starts workers when it is
    imported: a spawned (or forkserver) worker imports the main module again, which would start
    workers of its own. The fix is the ``if __name__ == "__main__":`` guard around the code
    that starts workers, or ``start_method="fork"``.

    Attributes: ``worker``, ``pid``, ``where`` (``"file, line N"`` of the code that started
    workers at import, when known) and ``stderr_tail`` (the worker's last stderr lines)."""

    def __init__(
        self,
        worker: str,
        pid: int | None,
        *,
        where: str | None = None,
        stderr_tail: str = "",
    ) -> None:
        self.worker = worker
        self.pid = pid
        self.where = where
        self.stderr_tail = stderr_tail
        at = f" ({where})" if where else ""
        msg = (
            f"worker {worker!r} died while starting: the main module starts workers when it is "
            f"imported{at}, and each spawned worker imports it again; {MAIN_GUARD_FIX}"
        )
        if stderr_tail:
            msg += f"\n\nlast stderr of worker {worker!r} (pid {pid}):\n" + _indent(stderr_tail)
        super().__init__(msg)

    def __reduce__(self) -> Any:
        state = {"where": self.where, "stderr_tail": self.stderr_tail}
        return (_rebuild, (type(self), (self.worker, self.pid), state))


#: the first words of the line a worker writes when it finds itself started by the import of
#: the main module (see ``_mainguard``); the stdlib's own words for the same mistake follow
MAIN_GUARD_MARK = "framepipe: workers started while the main module was being imported"
MAIN_GUARD_FIX = 'put that code under `if __name__ == "__main__":` or pass start_method="fork"'
#: ... and the exit code it exits with (its stderr is still the parent's then, not the pipe)
MAIN_GUARD_EXIT = 121
_STDLIB_MARK = "bootstrapping phase"
_WHERE = re.compile(r"\(at (.+?, line \d+)\)")
START_TAIL_LINES = 6
#: a crash report's stderr lines are cut to keep it about this long (a native dump aside)
REPORT_LINES = 12


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.rstrip().split("\n"))


def start_error(owner: str, crash: WorkerCrashed) -> WorkerStartError:
    """What a worker that died before it was ready means: a :class:`MainGuardError` when its
    stderr shows the main module started workers at import, else a :class:`WorkerStartError`
    whose cause is ``crash``."""
    tail = crash.stderr_tail or ""
    if crash.exitcode == MAIN_GUARD_EXIT or MAIN_GUARD_MARK in tail or _STDLIB_MARK in tail:
        m = _WHERE.search(tail)
        main = getattr(sys.modules.get("__main__"), "__file__", None)
        where = m.group(1) if m else os.path.basename(main) if isinstance(main, str) else None
        short = "\n".join(tail.rstrip().split("\n")[-START_TAIL_LINES:]) if tail else ""
        return MainGuardError(crash.worker, crash.pid, where=where, stderr_tail=short)
    err = WorkerStartError(f"a worker of {owner} could not start: {crash}")
    err.__cause__ = crash
    return err


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
        starting: bool = False,
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
        self.starting = starting
        self.signal_name = signal_name(-exitcode) if exitcode is not None and exitcode < 0 else None
        self.task_crashes: list[WorkerCrashed] = list(task_crashes or ())
        super().__init__(self._message())

    def blame(self, earlier: list[WorkerCrashed]) -> None:
        """Record that the task it names had killed the workers of ``earlier`` before."""
        self.task_crashes = list(earlier)
        self.args = (self._message(),)

    def _message(self) -> str:
        who = f"worker {self.worker!r} (pid {self.pid})"
        how = how_it_ended(self.exitcode, self.core_dumped)
        msg = f"{who} {how} {_task_text(self.task_name, self.task_id, self.starting)}"
        if self.starting and self.exitcode == MAIN_GUARD_EXIT:
            msg += (
                ": the main module starts workers when it is imported, and each spawned "
                f"worker imports it again; {MAIN_GUARD_FIX}"
            )
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
            msg += "\n\nnative traceback:\n" + tidy_dump(self.native_traceback)
        if self.stderr_tail:
            lines = self.stderr_tail.rstrip().split("\n")
            room = max(REPORT_LINES - msg.count("\n") - 3, 3)
            if len(lines) > room:
                msg += f"\n\nlast stderr (the last {room} lines; more in .stderr_tail):\n"
                msg += "\n".join(lines[-room:])
            else:
                msg += "\n\nlast stderr:\n" + "\n".join(lines)
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
            msg += "\n\nits stack when the deadline passed:\n" + tidy_dump(stack)
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


def _type_name(value: Any) -> str:
    cls = type(value)
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _cloudpickle_or_none() -> Any:
    try:
        import cloudpickle
    except ImportError:
        return None
    return cloudpickle


def pickling_error(obj: Any, cloud: Any) -> BaseException | None:
    """What pickling ``obj`` raises, by reference and then by value with ``cloud`` (the
    cloudpickle module, or None where it is missing); None when either way works."""
    try:
        pickle.dumps(obj, protocol=5)
        return None
    except Exception as e:  # noqa: BLE001 - the culprit, unless it goes by value
        found: BaseException = e
    if cloud is not None:
        try:
            cloud.dumps(obj, protocol=5)
            return None
        except Exception as e:  # noqa: BLE001 - not by value either
            found = e
    return found


def unpicklable_error(
    name: str,
    fn: Any,
    exc: BaseException,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> TaskPicklingError:
    """The error of a call of ``fn`` (named ``name``) that cannot be pickled, by reference nor
    (where cloudpickle is installed) by value: which part (the function, or which argument,
    by position or keyword, and its type) and what to do."""
    cloud = _cloudpickle_or_none()
    parts: list[tuple[str, Any]] = [("the function", fn)]
    parts += [(f"argument {i}", a) for i, a in enumerate(args)]
    parts += [(f"keyword argument {k!r}", v) for k, v in (kwargs or {}).items()]
    label, value = "", None
    for part, obj in parts:
        found = pickling_error(obj, cloud)
        if found is not None:
            label, value, exc = part, obj, found
            break
    why = f"{type(exc).__name__}: {exc}"
    even = ", even by value" if cloud is not None else ""
    if label == "the function":
        text = f"cannot send the function {name} to a worker process{even} ({why}); " + (
            "define it at the top level of a module"
            if cloud is not None
            else "define it at the top level of a module, or install cloudpickle to send "
            "lambdas and nested functions by value: pip install 'framepipe[cloudpickle]'"
        )
    elif label:
        text = (
            f"cannot send {label} of {name} to a worker process: {_type_name(value)} "
            f"cannot be pickled{even} ({why}); pass something picklable "
            "(a path, a number, a module-level function) and build the object in the worker"
        )
    else:
        text = (
            f"cannot send {name} and its arguments to a worker process{even} ({why}); "
            "functions must be defined at module level and arguments picklable"
        )
    err = TaskPicklingError(text)
    err.__cause__ = exc
    return err


def init_error(proc: Any, pid: int, blob: bytes) -> WorkerStartError:
    """The error of a worker whose initializer raised (``blob``, from the worker): what it
    raised (a ``sys.exit()`` included, as such), with the worker's last stderr lines."""
    exc = loads_exception(blob)
    _show_once(exc)
    stderr = getattr(proc, "stderr", None)
    tail = ""
    if stderr is not None:
        with contextlib.suppress(OSError):
            stderr.drain(0.2)  # the worker exits right after it sent this
        tail = stderr.tail_text(START_TAIL_LINES)
    what = (
        f"called sys.exit({exc.code!r})"
        if isinstance(exc, SystemExit)
        else f"raised {type(exc).__name__}: {exc}"
    )
    msg = f"the initializer of worker {proc.name!r} (pid {pid}) {what}"
    if tail:
        msg += f"\n\nlast stderr of worker {proc.name!r}:\n" + _indent(tail)
    err = WorkerStartError(msg)
    err.__cause__ = exc
    return err


_MISSING_IN_MAIN = re.compile(r"Can't get attribute '([^']+)' on <module '(__mp_main__|__main__)'")


def unloadable_error(tid: int, exc: BaseException) -> TaskUnpicklingError:
    """The error of a task the worker could not unpickle. A function (or class) of the main
    module that the worker's copy of it does not have, because it is defined under
    ``if __name__ == "__main__":`` (or the program has no file: ``python -c``, ``python -``),
    gets a short message that says what to do, without the worker's traceback."""
    m = _MISSING_IN_MAIN.search(str(exc)) if isinstance(exc, AttributeError) else None
    if m is not None:
        name = m.group(1)
        if m.group(2) == "__mp_main__":
            why = (
                f'{name!r} is defined under `if __name__ == "__main__":` (or inside a '
                "function), which a spawned worker does not run when it imports the main module"
            )
        else:
            why = (
                f"{name!r} is defined in a program that has no file (python -c, python -), "
                "which a spawned worker cannot import"
            )
        err = TaskUnpicklingError(
            f"task {tid}: the worker cannot find {name!r}: {why}; define it at the top level "
            'of a module file (above the `if __name__ == "__main__":` block), use '
            'start_method="fork", or install cloudpickle to send it by value: pip install '
            "'framepipe[cloudpickle]'"
        )
        err.__suppress_context__ = True
        return err
    if isinstance(exc, ImportError) or "Can't get attribute" in str(exc):
        why = "the function, its arguments and what they refer to must be importable in the worker"
    else:
        why = (
            "raised there as the function or its arguments were rebuilt, e.g. by an object's "
            "__reduce__ or __setstate__: its traceback is the cause"
        )
    err = TaskUnpicklingError(
        f"task {tid} could not be unpickled in the worker: {type(exc).__name__}: {exc} ({why})"
    )
    err.__cause__ = exc
    return err


def revive(blob: bytes, what: str = "the task", executor: bool = False) -> BaseException:
    """The exception a worker sent (``dumps_exception``), to raise in the caller. A
    SystemExit, KeyboardInterrupt or GeneratorExit raised by a task comes as a
    :class:`WorkerError` whose cause it is: never re-raised as itself in the caller, where it
    would end the program or look like a Ctrl-C; for a pool (``executor``), a SystemExit
    comes as a :class:`TaskExit`, a SystemExit as ``ProcessPoolExecutor`` re-raises it.

    Its traceback shows once: as the worker's text (the :class:`~framepipe.RemoteTraceback`
    ending its cause chain, which names the process), without the frames grafted onto the
    revived exceptions (the same frames again) and without the text's last line (the
    exception's own line, which the caller's traceback ends with)."""
    exc = loads_exception(blob)
    _show_once(exc)
    if executor and isinstance(exc, SystemExit):
        err: WorkerError = TaskExit(f"{what} raised SystemExit({exc.code!r})", exc.code)
        err.__cause__ = exc
        return err
    if not isinstance(exc, Exception):
        err = WorkerError(f"{what} raised {type(exc).__name__}({exc})")
        err.__cause__ = exc
        return err
    return exc


def _without_loop_frames(lines: list[str]) -> list[str]:
    """A traceback's lines without the frames of framepipe's worker loop that come before the
    first frame of the user's (at the top of each ``Traceback`` block)."""
    out: list[str] = []
    leading = False
    skipping = False
    for line in lines:
        if line.startswith("Traceback (most recent call last)"):
            leading, skipping = True, False
        elif line.startswith("  File "):
            m = re.match(r'  File "(.*?)", line', line)
            skipping = leading and m is not None and m.group(1).startswith(_LOOP)
            if not skipping:
                leading = False
        elif not line.startswith("    "):
            leading = skipping = False
        if not skipping:
            out.append(line)
    return out


def _show_once(exc: BaseException) -> None:
    seen: set[int] = set()
    chain: list[BaseException] = []
    node: BaseException | None = exc
    while node is not None and id(node) not in seen and not isinstance(node, RemoteTraceback):
        seen.add(id(node))
        chain.append(node)
        node = node.__cause__ if node.__cause__ is not None else node.__context__
    remote = node if isinstance(node, RemoteTraceback) else None
    for e in chain:
        e.__traceback__ = None
    if remote is None:
        return
    lines = remote.text.rstrip().split("\n")
    names = {type(exc).__qualname__, type(exc).__name__}
    cut = None
    for i in range(len(lines) - 1, -1, -1):
        line = lines[i]
        if line.startswith(("  ", "Traceback ")):
            break
        head = line.split(":", 1)[0]
        if head.rsplit(".", 1)[-1] in names:
            cut = i
            break
    if cut is None:
        return
    text = "\n".join(_without_loop_frames(lines[:cut])).rstrip()
    if "\n  File " in "\n" + text:
        remote.text = text + "\n"
        remote.args = (remote.text, *remote.args[1:])
    else:  # nothing but the exception's line: the worker's text adds nothing
        chain[-1].__cause__ = None
        chain[-1].__suppress_context__ = True
