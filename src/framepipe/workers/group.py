"""``WorkerGroup``: start N workers, wait for all of them, report the first failure first.

A group runs one entry point as ``nprocs`` ranks, a function (each rank in a
``multiprocessing`` process: fork, spawn or forkserver) or a command line (each rank a
subprocess, under a small launcher that makes it die with the group). One supervisor thread
per group launches the ranks and then sleeps in a single ``poll()`` over every rank's pidfd,
its result channel, the output pipes it copies and a wake-up pipe: a death is seen the moment
it happens, never by a timer.

When a rank fails the others are stopped at once (the death signal to each process group, a
grace period, SIGKILL). The root cause is the rank that failed first, by the time in its error
file (the torchelastic JSON that :func:`framepipe.record` writes; each rank finds its path in
``TORCHELASTIC_ERROR_FILE``), else by the time its death was seen; a rank that only wrote its
error file after the group began stopping was stopped, not a cause.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import enum
import faulthandler
import functools
import multiprocessing.util  # noqa: F401 - before our atexit hook: see _close_all_at_exit
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from .. import connection as _connection
from .._lazy import asyncio  # imported on first use (see _lazy)
from ..errors import signal_name
from ..guard import ERROR_FILE_ENV, ProcessFailure, write_error_file
from ..remote import dumps_exception, format_exception_text, loads_exception
from ..watch import Liveness
from . import _byvalue, _launch
from ._mainguard import refuse_during_main_import
from ._process import (
    TAIL_BYTES,
    TAIL_LINES,
    _FdHandle,
    _parent_side,
    _rebind_stream,
    _Stderr,
    register_parent_side,
)
from .errors import MAIN_GUARD_EXIT, WorkerError, WorkerStartError
from .worker import get_context

__all__ = ["WorkerGroup", "GroupFailed", "GroupResult", "RankOutcome", "Std"]

#: how long start() waits for a command's launcher to report the command's pid
_LAUNCH_TIMEOUT = 60.0
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Std(enum.IntFlag):
    """Which of a rank's streams: ``NONE``, ``OUT`` (stdout), ``ERR`` (stderr) or ``ALL``.

    ``redirects`` and ``tee`` take one value for every rank or a dict ``{rank: Std}`` (ranks
    left out get ``NONE``), as torchelastic's ``Std`` does."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


Entrypoint = Callable[..., Any] | str | Sequence[str]


# --------------------------------------------------------------------------------------------
# What the caller gets
# --------------------------------------------------------------------------------------------


@dataclass
class RankOutcome:
    """How one rank ended.

    ``state`` is ``"succeeded"``, ``"failed"`` (it failed on its own), ``"stopped"`` (the
    group stopped it: after another rank's failure, ``close()``, or a signal to the parent) or
    ``"not started"``. ``exitcode`` is negative for a signal, as ``subprocess`` reports it.
    ``exception`` is the rank's exception revived with its traceback (function entry points),
    ``error`` the :class:`~framepipe.ProcessFailure` read from its error file (None without
    one), ``error_file`` its path (None without a ``log_dir``: the file is removed at close),
    ``failed_at`` when it failed in seconds since the epoch (its error file's time, else when
    its death was seen), ``ended_at`` when its death was seen, ``stderr_tail`` the last lines
    of its stderr (with the traceback shown once, in ``traceback``), ``native_stack`` the
    stack dump faulthandler wrote to its stderr as it died (``Fatal Python error: ...``), if
    one is there.
    """

    rank: int
    pid: int | None
    state: str
    exitcode: int | None = None
    core_dumped: bool = False
    oom_killed: bool | None = None
    return_value: Any = None
    exception: BaseException | None = None
    error: ProcessFailure | None = None
    error_file: str | None = None
    failed_at: float | None = None
    ended_at: float | None = None
    stderr_tail: str = ""
    stdout_path: str | None = None
    stderr_path: str | None = None
    note: str = ""
    native_stack: str | None = None

    @property
    def signal_name(self) -> str | None:
        """``SIGKILL`` when a signal ended the rank, else None."""
        code = self.exitcode
        return signal_name(-code) if code is not None and code < 0 else None

    @property
    def traceback(self) -> str | None:
        """The rank's traceback text, from its error file or its revived exception."""
        if self.error is not None and self.error.py_callstack:
            return self.error.py_callstack
        if self.exception is not None:
            return format_exception_text(self.exception)
        return None

    def how(self) -> str:
        """``exited with code 3``, ``was killed by SIGKILL (core dumped)``..."""
        code = self.exitcode
        if code is None:
            text = "ended (its exit status could not be read)"
        elif code < 0:
            text = f"was killed by {self.signal_name}" + (
                " (core dumped)" if self.core_dumped else ""
            )
        else:
            text = f"exited with code {code}"
        if self.oom_killed:
            text += "; likely the OOM killer"
        if self.note:
            text += f" {self.note}"
        return text

    def what(self) -> str:
        """What went wrong, in a phrase: the exception, else how it ended."""
        if self.exception is not None:
            return f"raised {type(self.exception).__name__}: {_first_line(self.exception)}"
        if self.error is not None and self.error.error_file != "<N/A>":
            message = self.error.message
            text = message.get("message") if isinstance(message, dict) else message
            if text:
                return f"raised {str(text).splitlines()[0]}"
        return self.how()


@dataclass
class GroupResult:
    """A group whose ranks all succeeded: ``return_values`` by rank (None for a command),
    ``exitcodes`` by rank, ``pids``, and the log files by rank (None when not kept)."""

    return_values: dict[int, Any]
    exitcodes: dict[int, int | None]
    pids: dict[int, int | None]
    stdouts: dict[int, str | None] = field(default_factory=dict)
    stderrs: dict[int, str | None] = field(default_factory=dict)


class GroupFailed(WorkerError):
    """A worker group failed (or was stopped): the report reads root cause first.

    Attributes: ``name``; ``root_rank`` (the rank that failed first, None when no rank failed
    on its own: the group was stopped by ``close()`` or a signal); ``root`` (its
    :class:`RankOutcome`); ``failures`` (``{rank: RankOutcome}`` of every rank that failed on
    its own); ``outcomes`` (every rank); ``reason`` (why the group stopped).
    """

    def __init__(
        self, name: str, outcomes: dict[int, RankOutcome], root_rank: int | None, reason: str
    ) -> None:
        self.name = name
        self.outcomes = dict(outcomes)
        self.root_rank = root_rank
        self.reason = reason
        self.failures = {r: o for r, o in self.outcomes.items() if o.state == "failed"}
        self.root = self.outcomes.get(root_rank) if root_rank is not None else None
        super().__init__(self._message())

    def __reduce__(self) -> Any:
        return (type(self), (self.name, self.outcomes, self.root_rank, self.reason))

    def _message(self) -> str:
        root = self.root
        if root is None:
            lines = [f"worker group {self.name!r} was stopped: {self.reason}", "", "ranks:"]
            lines += [f"  {_rank_line(o, None)}" for o in self.outcomes.values()]
            return "\n".join(lines)
        lines = [
            f"worker group {self.name!r} failed: rank {root.rank} (pid {root.pid}) {root.what()}",
            "",
            f"root cause: rank {root.rank} (pid {root.pid}) {root.how()}"
            + (f" at {_clock(root.failed_at)}" if root.failed_at else ""),
        ]
        if root.error is not None and root.error_file:
            lines.append(f"error file: {root.error_file}")
        tb = root.traceback
        if tb:
            lines.append(tb.rstrip())
        if root.stderr_tail:
            where = f" (whole log: {root.stderr_path})" if root.stderr_path else ""
            lines += ["", f"last stderr of rank {root.rank}{where}:"]
            lines += [f"  | {line}" for line in root.stderr_tail.split("\n")]
        elif root.stderr_path:
            lines += ["", f"(its stderr is in {root.stderr_path})"]
        others = [o for o in self.outcomes.values() if o.rank != root.rank]
        if others:
            lines += ["", "other ranks:"]
            lines += [f"  {_rank_line(o, root.failed_at)}" for o in others]
        return "\n".join(lines)


def _first_line(exc: BaseException) -> str:
    text = str(exc)
    return text.splitlines()[0] if text else ""


def _clock(when: float) -> str:
    return datetime.fromtimestamp(when).strftime("%H:%M:%S.%f")[:-3]


def _rank_line(o: RankOutcome, since: float | None) -> str:
    who = f"rank {o.rank} (pid {o.pid})"
    at = o.failed_at if o.state == "failed" else o.ended_at
    later = f", {at - since:+.3f} s from the root cause" if since and at else ""
    if o.state == "succeeded":
        return f"{who}: succeeded"
    if o.state == "not started":
        return f"{who}: not started"
    if o.state == "stopped":
        return f"{who}: stopped by the group; it {o.how()}{later}"
    return f"{who}: also failed: {o.what()}{later}"


# --------------------------------------------------------------------------------------------
# The worker side of a function rank
# --------------------------------------------------------------------------------------------


@dataclass
class _Boot:
    """What a function rank needs to start: built by the supervisor, pickled for spawn."""

    rank: int
    parent_pid: int
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    env: dict[str, str]
    result: Any
    stdout: _FdHandle | None
    stderr: _FdHandle
    line_buffered_stdout: bool


def _rank_main(boot: _Boot) -> None:
    """A function rank's process: hygiene, redirects, then the function, its value or its
    failure reported on the result channel and in the error file."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    _launch.arm_parent_death()
    for obj in list(_parent_side):  # after a fork: other workers' parent-side descriptors
        with contextlib.suppress(Exception):
            obj._close_in_child()
    _parent_side.clear()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _launch.start_parent_watch(boot.parent_pid)
    if boot.stdout is not None:
        os.dup2(boot.stdout.fd, 1)
        os.close(boot.stdout.fd)
    os.dup2(boot.stderr.fd, 2)
    os.close(boot.stderr.fd)
    _rebind_stream("stdout", 1)  # a forked child's sys.stdout may write elsewhere
    _rebind_stream("stderr", 2)
    if boot.line_buffered_stdout:
        _line_buffer_stdout()  # tee shows each line as it is printed
    os.environ.update(boot.env)
    faulthandler.enable(file=2, all_threads=True)
    boot.result.send(("ready",))
    try:
        value = boot.fn(*boot.args)
    except SystemExit as exc:
        if exc.code not in (0, None):
            _rank_failed(boot, exc, exc.code if isinstance(exc.code, int) else 1)
        value = None
    except KeyboardInterrupt:
        _flush_std()  # the group forwarded SIGINT: end quietly, as the signal would
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        os._exit(128 + signal.SIGINT)
    except BaseException as exc:  # noqa: BLE001 - reported, then the rank exits with code 1
        _rank_failed(boot, exc, 1)
    try:
        boot.result.send(("ok", value))
    except Exception as exc:  # noqa: BLE001 - e.g. a value that does not pickle
        _rank_failed(boot, exc, 1)
    boot.result.close()


def _line_buffer_stdout() -> None:
    with contextlib.suppress(AttributeError, ValueError):
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def _rank_failed(boot: _Boot, exc: BaseException, code: int) -> None:
    tb = exc.__traceback__
    if tb is not None and tb.tb_frame.f_code is _rank_main.__code__:
        exc = exc.with_traceback(tb.tb_next)  # the rank's frames start at its function
    path = os.environ.get(ERROR_FILE_ENV)
    if path and not os.path.exists(path):  # @framepipe.record in the function wrote it first
        with contextlib.suppress(Exception):
            write_error_file(path, exc, label=f"rank {boot.rank}")
    with contextlib.suppress(Exception):
        boot.result.send(("error", dumps_exception(exc)))
    if not isinstance(exc, SystemExit):
        with contextlib.suppress(Exception):
            sys.stderr.write(format_exception_text(exc))
    elif isinstance(exc.code, str):
        with contextlib.suppress(Exception):
            sys.stderr.write(exc.code + "\n")
    _flush_std()
    os._exit(code)


def _flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


# --------------------------------------------------------------------------------------------
# The parent side
# --------------------------------------------------------------------------------------------


class _Rank:
    """The supervisor's record of one rank."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.process: Any = None  # multiprocessing.Process, or the launcher's Popen
        self.pid: int | None = None  # the worker's own pid (the command's, not the launcher's)
        self.pgid: int | None = None
        self.liveness: Liveness | None = None
        self.death_fd: int | None = None
        self.report_fd: int | None = None
        self.conn: Any = None
        self.conn_open = False
        self.ready = False  # running the entry point (a command: started; a function: called)
        self.result: tuple[str, Any] | None = None
        self.pipes: list[_Stderr] = []
        self.stderr_pipe: _Stderr | None = None
        self.stdout_path: str | None = None
        self.stderr_path: str | None = None
        self.error_file: str | None = None
        self.ended = False
        self.ended_ns: int | None = None
        self.exitcode: int | None = None
        self.core_dumped = False
        self.oom_killed: bool | None = None
        self.output_at = 0.0  # time.monotonic() of its start, then of its last output

    def signal(self, sig: int) -> None:
        if self.ended or self.pgid is None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pgid, sig)  # in case it has not made its group yet

    def close_in_child(self) -> None:
        fds = [self.death_fd if self.liveness is None else None, self.report_fd]
        fds += [p.fd for p in self.pipes]
        fds += [p._log.fileno() for p in self.pipes if p._log is not None]
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if self.liveness is not None:
            with contextlib.suppress(OSError):
                self.liveness.close()
        if self.conn is not None:
            with contextlib.suppress(Exception):
                self.conn.close()

    def release(self) -> None:
        for pipe in self.pipes:
            with contextlib.suppress(OSError):
                pipe.close()
        if self.conn is not None:
            self.conn.close()
            self.conn_open = False
        if self.report_fd is not None:
            fd, self.report_fd = self.report_fd, None
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.liveness is not None:
            self.liveness.close()
        if self.ended and hasattr(self.process, "close"):  # a multiprocessing.Process
            with contextlib.suppress(ValueError):
                self.process.close()  # its sentinel pipes


@dataclass
class _Stop:
    sig: int
    reason: str
    at_ns: int


_live_groups: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()


@atexit.register
def _close_all_at_exit() -> None:
    # Registered after multiprocessing's own hook (imported above), so it runs first: that
    # one joins every non-daemonic child, which would wait forever for a running group.
    for group in list(_live_groups):
        with contextlib.suppress(Exception):
            group.close(grace=min(group.grace, 5.0))


def _per_rank(
    value: Any, nprocs: int, what: str, default: Any, missing: Any = None
) -> dict[int, Any]:
    """``{rank: value}`` from one value for all ranks or a dict (a rank it leaves out gets
    ``missing``, else ``default``); None gives every rank ``default``."""
    if value is None:
        return dict.fromkeys(range(nprocs), default)
    if isinstance(value, Mapping):
        extra = set(value) - set(range(nprocs))
        if extra:
            raise ValueError(f"{what} names ranks {sorted(extra)} outside 0..{nprocs - 1}")
        fill = default if missing is None else missing
        return {r: value.get(r, fill) for r in range(nprocs)}
    return dict.fromkeys(range(nprocs), value)


class WorkerGroup:
    """Run ``entrypoint`` as ``nprocs`` ranks, supervise them, report the first failure.

    ``entrypoint`` is a function (each rank calls ``entrypoint(*args[rank])`` in a
    ``multiprocessing`` process started with ``start_method``; its return value comes back)
    or a command: a program name or an argv list, to which ``args[rank]`` is appended.
    ``args`` is ``{rank: tuple}`` (or one tuple for every rank), ``envs`` ``{rank: dict}``.
    Each rank's environment has ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``
    and ``TORCHELASTIC_ERROR_FILE``, then its ``envs`` (which may override them).

    Output: with ``log_dir``, each rank's stdout and stderr go to
    ``log_dir/<rank>/stdout.log`` and ``stderr.log`` (at the fd level, so C code's output is
    kept too) and its error file is ``log_dir/<rank>/error.json``. ``redirects`` chooses the
    streams kept in files (default: ``Std.ALL`` with a ``log_dir``, else ``Std.NONE``);
    ``tee`` the streams also copied to this process's console, line by line with a ``[rank]``
    prefix (it works without a ``log_dir`` too). A stream neither redirected nor tee'd goes to
    the console as is. Stderr is always followed, so a failure report shows its last lines.

    ``death_sig`` and ``grace`` say how the other ranks are stopped when one fails and when
    this process receives SIGINT or SIGTERM during :meth:`wait` (which forwards that signal
    instead): the signal to each rank's process group, ``grace`` seconds, then SIGKILL.

    Use it as a context manager (``with WorkerGroup(...) as group: group.wait()`` starts it and
    closes it) or call :meth:`start` and :meth:`close`; ``async with`` and
    :meth:`wait_async` / :meth:`aclose` for asyncio.
    """

    def __init__(
        self,
        entrypoint: Entrypoint,
        nprocs: int,
        args: Mapping[int, tuple[Any, ...]] | tuple[Any, ...] | None = None,
        envs: Mapping[int, Mapping[str, str]] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        redirects: Std | int | Mapping[int, Std] | None = None,
        tee: Std | int | Mapping[int, Std] = Std.NONE,
        start_method: str = "spawn",
        *,
        name: str | None = None,
        death_sig: int = signal.SIGTERM,
        grace: float = 30.0,
    ) -> None:
        if isinstance(nprocs, bool) or not isinstance(nprocs, int) or nprocs < 1:
            raise ValueError(f"nprocs must be a positive int, not {nprocs!r}")
        self.is_command = not callable(entrypoint)
        if self.is_command:
            one = isinstance(entrypoint, (str, bytes, os.PathLike))
            argv: list[Any] = [entrypoint] if one else list(entrypoint)  # type: ignore[arg-type]
            if not argv:
                raise ValueError("the command line is empty")
            self._argv = [os.fsdecode(a) for a in argv]
            self._ctx = None
        else:
            self._argv = []
            self._ctx = get_context(start_method)
        self.entrypoint = entrypoint
        self.nprocs = nprocs
        self.start_method = start_method
        self.name: str = name or (
            os.path.basename(self._argv[0])
            if self.is_command
            else str(getattr(entrypoint, "__qualname__", "group"))
        )
        self.args = {r: tuple(a) for r, a in _per_rank(args, nprocs, "args", ()).items()}
        self.envs = {
            r: {str(k): str(v) for k, v in e.items()}
            for r, e in _per_rank(envs, nprocs, "envs", {}).items()
        }
        self.log_dir = os.fspath(log_dir) if log_dir is not None else None
        default = Std.ALL if self.log_dir else Std.NONE
        self.redirects = {
            r: Std(v)
            for r, v in _per_rank(redirects, nprocs, "redirects", default, Std.NONE).items()
        }
        self.tee = {r: Std(v) for r, v in _per_rank(tee, nprocs, "tee", Std.NONE).items()}
        if not self.log_dir and any(self.redirects.values()):
            raise ValueError("redirects need a log_dir to put the files in")
        self.death_sig = int(death_sig)
        self.grace = float(grace)
        self._ranks = [_Rank(r) for r in range(nprocs)]
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._launched: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        for fut in (self._launched, self._done):
            fut.set_running_or_notify_cancel()  # an asyncio waiter's cancel must not reach it
        self._wake_r: int | None = None
        self._wake_w: int | None = None
        self._requests: collections.deque[tuple[int, float, str]] = collections.deque()
        self._stop: _Stop | None = None
        self._kill_at: float | None = None
        self._temp_dir: str | None = None
        self._received: list[int] = []
        self._seen_ns = 0
        self._closed = False

    def __repr__(self) -> str:
        if self._thread is None:
            state = "not started"
        else:
            state = "done" if self._done.done() else "running"
        return f"<WorkerGroup {self.name!r} nprocs={self.nprocs} {state}>"

    # -- start --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every rank; returns once all are running. A rank that cannot start (a
        command that does not exist, a function that does not pickle for spawn) stops the
        others and raises here."""
        self._begin()
        try:
            self._launched.result()
        except BaseException:
            if not self._launched.done():  # interrupted (Ctrl-C): leave nothing running
                self.close(self.death_sig, self.grace)
            raise

    async def astart(self) -> None:
        """:meth:`start` for asyncio."""
        self._begin()
        await asyncio.wrap_future(self._launched)

    def _begin(self) -> None:
        if not self.is_command:
            refuse_during_main_import(f"a WorkerGroup {self.name!r}")
        with self._lock:
            if self._closed:
                raise RuntimeError("this WorkerGroup is closed")
            if self._thread is not None:
                raise RuntimeError("this WorkerGroup was started already")
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_r, False)
            os.set_blocking(self._wake_w, False)
            self._prepare_files()
            register_parent_side(self)
            _live_groups.add(self)
            # The ranks are started from the supervisor thread, which lives as long as they
            # do: PR_SET_PDEATHSIG fires when the *thread* that started a process ends.
            self._thread = threading.Thread(
                target=self._supervise, daemon=True, name=f"framepipe-group-{self.name}"
            )
            self._thread.start()

    def _prepare_files(self) -> None:
        if self.log_dir:
            base = self.log_dir
        else:
            base = self._temp_dir = tempfile.mkdtemp(prefix="framepipe-group-")
        for r in self._ranks:
            r.stdout_path, r.stderr_path, r.error_file = self._rank_paths(r.rank, base)
            for path in (r.stdout_path, r.stderr_path, r.error_file):
                os.makedirs(os.path.dirname(path or r.error_file), exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.remove(r.error_file)  # an earlier run's: never taken for this one's

    # -- hooks a subclass may override (framepipe.run's elastic agent lays out torchrun's) --

    def _rank_paths(self, rank: int, base: str) -> tuple[str | None, str | None, str]:
        """Where ``rank`` keeps its stdout, its stderr (None: not kept in a file) and its
        error file, under ``base`` (the ``log_dir``, else a temporary directory)."""
        d = os.path.join(base, str(rank))
        kept = self.redirects[rank] | self.tee[rank] if self.log_dir else Std.NONE
        return (
            os.path.join(d, "stdout.log") if kept & Std.OUT else None,
            os.path.join(d, "stderr.log") if kept & Std.ERR else None,
            os.path.join(d, "error.json"),
        )

    def _stream_plan(self, rank: int, which: Std, path: str | None) -> str:
        """How ``rank``'s stream ``which`` (kept in ``path``, or None) travels: ``"file"``
        (straight into ``path``), ``"inherit"`` (this process's own; stdout only), or through
        a pipe the supervisor copies and watches: ``"prefix"`` (to the console, each line
        after ``[label]``), ``"raw"`` (to the console as written), ``"quiet"`` (not to the
        console: into ``path`` if any, and the tail kept for failure reports)."""
        tee = bool(self.tee[rank] & which)
        if path and not tee:
            return "file"
        if not tee and which is Std.OUT:
            return "inherit"
        return "prefix" if tee else "raw"

    def _label(self, rank: int) -> str:
        """The console prefix of ``rank``'s lines, without the brackets."""
        return str(rank)

    #: a command rank (its launcher and the command) runs in a session of its own rather than
    #: in a process group of this one's session: where the kernel schedules by session
    #: (autogroup), each rank then gets a session's share of the CPU, as under torchrun
    _own_session = False

    def quiet_for(self) -> dict[int, float]:
        """``{rank: seconds}`` since each running rank last wrote to a stream the supervisor
        copies (or since its start): how a hang shows. Ranks that ended are left out."""
        now = time.monotonic()
        return {r.rank: now - r.output_at for r in self._ranks if r.ready and not r.ended}

    def _env(self, rank: int) -> dict[str, str]:
        env = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(self.nprocs),
            "LOCAL_WORLD_SIZE": str(self.nprocs),
            ERROR_FILE_ENV: self._ranks[rank].error_file or "",
        }
        env.update(self.envs[rank])
        return env

    def _stream(self, r: _Rank, which: Std) -> int | None:
        """The fd the rank writes ``which`` to (the caller closes it after the start), or
        None to share this process's own."""
        path = r.stdout_path if which is Std.OUT else r.stderr_path
        plan = self._stream_plan(r.rank, which, path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        if plan == "file" and path:
            return os.open(path, flags, 0o644)  # straight to the file: no copying
        if plan == "inherit" and which is Std.OUT:
            return None
        if path:
            os.close(os.open(path, flags, 0o644))
        read, write = os.pipe()
        os.set_blocking(read, False)
        console = plan if plan in ("prefix", "raw") else None
        stream = "stdout" if which is Std.OUT else "stderr"
        pipe = _Stderr(read, self._label(r.rank), path, console, stream)
        r.pipes.append(pipe)
        if which is Std.ERR:
            r.stderr_pipe = pipe
        return write

    def _launch_rank(self, r: _Rank) -> None:
        out_fd = self._stream(r, Std.OUT)
        err_fd = self._stream(r, Std.ERR)
        assert err_fd is not None
        try:
            if self.is_command:
                self._launch_command(r, out_fd, err_fd)
            else:
                self._launch_function(r, out_fd, err_fd)
        finally:
            for fd in (out_fd, err_fd):
                if fd is not None:
                    os.close(fd)
        r.output_at = time.monotonic()
        r.liveness = Liveness(r.process)
        r.death_fd = r.liveness.fd
        if r.death_fd is None:  # no pidfds here: the launcher's report pipe or the sentinel
            r.death_fd = r.report_fd if self.is_command else r.process.sentinel

    def _launch_function(self, r: _Rank, out_fd: int | None, err_fd: int) -> None:
        assert self._ctx is not None
        reader, writer = _connection.Pipe(False)
        r.conn, r.conn_open = reader, True
        boot = _Boot(
            rank=r.rank,
            parent_pid=os.getpid(),
            fn=_byvalue.portable(self._ctx, self.entrypoint),  # by value if it must
            args=_byvalue.portable(self._ctx, self.args[r.rank]),
            env=self._env(r.rank),
            result=writer,
            stdout=None if out_fd is None else _FdHandle(out_fd),
            stderr=_FdHandle(err_fd),
            line_buffered_stdout=bool(self.tee[r.rank] & Std.OUT),
        )
        try:
            process = self._ctx.Process(
                target=_rank_main, args=(boot,), name=f"{self.name}-{r.rank}", daemon=False
            )
            process.start()
        finally:
            writer.close()
        r.process, r.pid, r.pgid = process, process.pid, process.pid
        with contextlib.suppress(OSError):
            os.setpgid(process.pid, process.pid)  # before the child does it too (fork)
        reader.watch(process)

    def _launch_command(self, r: _Rank, out_fd: int | None, err_fd: int) -> None:
        report_r, report_w = os.pipe()
        r.report_fd = report_r
        argv = [
            sys.executable,
            "-I",
            "-S",
            _launch.__file__,
            str(os.getpid()),
            str(report_w),
            "--",
            *self._argv,
            *map(str, self.args[r.rank]),
        ]
        kwargs: dict[str, Any] = {}
        if self._own_session:
            kwargs["start_new_session"] = True
        elif sys.version_info >= (3, 11):
            kwargs["process_group"] = 0
        else:  # pragma: no cover - Python 3.10
            kwargs["start_new_session"] = True
        env = dict(os.environ)
        env.update(self._env(r.rank))
        try:
            r.process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out_fd,
                stderr=err_fd,
                pass_fds=(report_w,),
                **kwargs,
            )
        finally:
            os.close(report_w)
        r.pgid = r.process.pid

    def _read_report(self, r: _Rank, deadline: float) -> None:
        """The command's pid from its launcher, or the reason it could not start."""
        assert r.report_fd is not None
        data = b""
        poller = select.poll()
        poller.register(r.report_fd, select.POLLIN)
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise WorkerStartError(
                    f"rank {r.rank}: the launcher did not report within {_LAUNCH_TIMEOUT:g} s"
                )
            chunk = os.read(r.report_fd, 4096)
            if not chunk:
                r.process.wait()
                raise WorkerStartError(
                    f"rank {r.rank}: the launcher ended (exit status {r.process.returncode}) "
                    f"before starting {self._argv[0]!r}"
                )
            data += chunk
        text = data.decode("utf-8", "replace").strip()
        if text.startswith("!"):
            code, _, message = text[1:].partition(" ")
            raise OSError(int(code), f"{message} (rank {r.rank})", self._argv[0])
        r.pid = int(text)

    def _launch_all(self) -> None:
        for r in self._ranks:
            self._launch_rank(r)
        if self.is_command:
            deadline = time.monotonic() + _LAUNCH_TIMEOUT
            for r in self._ranks:
                self._read_report(r, deadline)
                r.ready = True
                if r.death_fd != r.report_fd and r.report_fd is not None:
                    fd, r.report_fd = r.report_fd, None  # forgotten first (a fork meanwhile)
                    os.close(fd)

    # -- the supervisor thread ----------------------------------------------------------------

    def _supervise(self) -> None:
        try:
            self._launch_all()
        except BaseException as exc:  # noqa: BLE001 - handed to start()
            self._abort(exc)
            return
        error: BaseException | None = None
        try:
            self._check_launched()
            self._loop()
            outcome = self._outcome()
        except BaseException as exc:  # noqa: BLE001 - a bug here must not hang wait()
            for r in self._ranks:
                r.signal(signal.SIGKILL)
            self._reap_all()
            error = exc
        finally:
            for r in self._ranks:
                r.release()
        if error is not None:
            self._done.set_exception(error)
        else:
            self._done.set_result(outcome)

    def _abort(self, exc: BaseException) -> None:
        for r in self._ranks:
            r.signal(signal.SIGKILL)
        self._reap_all()
        for r in self._ranks:
            r.release()
        self._launched.set_exception(exc)
        self._done.set_exception(exc)

    def _reap_all(self) -> None:
        for r in self._ranks:
            if r.process is not None and not r.ended:
                with contextlib.suppress(Exception):
                    r.process.join() if hasattr(r.process, "join") else r.process.wait()
                r.ended = True

    def _loop(self) -> None:
        while True:
            live = [r for r in self._ranks if not r.ended]
            if not live:
                return
            handlers: dict[Any, Callable[[], None]] = {self._wake_r: self._on_wake}
            for r in live:
                handlers[r.death_fd] = functools.partial(self._on_death, r)
            for r in self._ranks:
                if r.conn_open:
                    handlers[r.conn] = functools.partial(self._on_result, r)
                for p in r.pipes:
                    if p.fd is not None:
                        handlers[p.fd] = functools.partial(self._on_output, p, r)
            timeout = None
            if self._kill_at is not None:
                timeout = max(0.0, self._kill_at - time.monotonic())
            ready = _connection.wait(list(handlers), timeout)
            # every death in this batch happened before any stop this batch begins
            self._seen_ns = time.time_ns()
            # output and results before deaths: a dead rank's last words come first
            deaths = {r.death_fd for r in live}
            order = sorted(ready, key=lambda o: isinstance(o, int) and o in deaths)
            for obj in order:
                handlers[obj]()
            if self._kill_at is not None and time.monotonic() >= self._kill_at:
                self._kill_at = None
                for r in self._ranks:
                    r.signal(signal.SIGKILL)

    def _on_wake(self) -> None:
        with contextlib.suppress(OSError):
            while os.read(self._wake_r, 4096):  # type: ignore[arg-type]
                pass
        while self._requests:
            sig, grace, reason = self._requests.popleft()
            self._begin_stop(sig, grace, reason)

    def _on_output(self, pipe: _Stderr, r: _Rank | None = None) -> None:
        if r is not None:
            r.output_at = time.monotonic()
        try:
            eof = pipe.pump()
        except OSError:
            eof = True
        if eof and pipe.fd is not None:
            fd, pipe.fd = pipe.fd, None  # forgotten first, as in WorkerProcess.close
            os.close(fd)

    def _on_result(self, r: _Rank) -> None:
        try:
            msg = r.conn.recv()
        except (EOFError, OSError):
            msg = None  # it died without a word: its exit status tells the story
        except Exception as exc:  # noqa: BLE001 - e.g. a value that does not unpickle here
            msg = ("error", dumps_exception(exc))
        if msg == ("ready",):
            r.ready = True
            self._check_launched()
            return
        r.result = msg
        r.conn_open = False

    def _check_launched(self) -> None:
        if not self._launched.done() and all(r.ready or r.ended for r in self._ranks):
            self._launched.set_result(None)

    def _on_death(self, r: _Rank) -> None:
        r.ended_ns = self._seen_ns
        while r.conn_open and r.conn.poll(0):
            self._on_result(r)
        r.conn_open = False
        assert r.liveness is not None
        died = r.liveness.error(label=f"rank {r.rank}")
        r.exitcode, r.core_dumped, r.oom_killed = died.exitcode, died.core_dumped, died.oom_killed
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r.pgid, signal.SIGKILL)  # type: ignore[arg-type] # what it left behind
        if hasattr(r.process, "join"):
            r.process.join()
            code = r.process.exitcode
        else:
            code = r.process.wait()
        if r.exitcode is None:
            r.exitcode = code
        r.ended = True
        self._check_launched()
        for p in r.pipes:
            if p.fd is not None:
                self._on_output(p)
        if not self._succeeded(r):
            self._begin_stop(self.death_sig, self.grace, f"rank {r.rank} failed")

    def _succeeded(self, r: _Rank) -> bool:
        if r.exitcode != 0:
            return False
        return self.is_command or (r.result is not None and r.result[0] == "ok")

    def _begin_stop(self, sig: int, grace: float, reason: str) -> None:
        now = time.monotonic()
        if sig == signal.SIGKILL:
            grace = 0.0
        if self._stop is None:
            self._stop = _Stop(sig, reason, time.time_ns())
            for r in self._ranks:
                r.signal(sig)
            self._kill_at = now + grace
        elif self._kill_at is not None:
            self._kill_at = min(self._kill_at, now + grace)

    def _request(self, sig: int, grace: float, reason: str) -> None:
        """Ask the supervisor to stop the group (any thread, or a signal handler)."""
        self._requests.append((sig, grace, reason))
        fd = self._wake_w
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, b"!")

    # -- outcome --------------------------------------------------------------------------------

    def _outcome(self) -> GroupResult | GroupFailed:
        outcomes = {r.rank: self._rank_outcome(r) for r in self._ranks}
        failed = [o for o in outcomes.values() if o.state == "failed"]
        if not failed and all(o.state == "succeeded" for o in outcomes.values()):
            return GroupResult(
                return_values={r: o.return_value for r, o in outcomes.items()},
                exitcodes={r: o.exitcode for r, o in outcomes.items()},
                pids=self.pids,
                stdouts={r.rank: r.stdout_path for r in self._ranks},
                stderrs={r.rank: r.stderr_path for r in self._ranks},
            )
        root = min(failed, key=lambda o: (o.failed_at, o.ended_at or 0.0, o.rank), default=None)
        reason = self._stop.reason if self._stop is not None else "a rank failed"
        return GroupFailed(self.name, outcomes, root.rank if root else None, reason)

    def _rank_outcome(self, r: _Rank) -> RankOutcome:
        o = RankOutcome(
            rank=r.rank,
            pid=r.pid,
            state="failed",
            exitcode=r.exitcode,
            core_dumped=r.core_dumped,
            oom_killed=r.oom_killed,
            error_file=r.error_file if self.log_dir else None,  # else: removed
            stdout_path=r.stdout_path,
            stderr_path=r.stderr_path,
            ended_at=r.ended_ns / 1e9 if r.ended_ns else None,
        )
        if r.process is None:
            o.state = "not started"
            return o

        if r.result is not None and r.result[0] == "ok":
            o.return_value = r.result[1]
        elif r.result is not None:
            try:
                o.exception = loads_exception(r.result[1])
            except Exception:  # noqa: BLE001 - the error file still has the traceback
                o.exception = None
        stop_ns = self._stop.at_ns if self._stop is not None else None
        if self._succeeded(r) and (
            self.is_command is False or stop_ns is None or (r.ended_ns or 0) < stop_ns
        ):
            o.state = "succeeded"
            return o
        if r.error_file and os.path.isfile(r.error_file):
            o.error = ProcessFailure(
                r.rank, r.pid or 0, r.exitcode if r.exitcode is not None else 1, r.error_file
            )
        failed_ns = self._failed_ns(o.error, r.ended_ns)
        o.failed_at = failed_ns / 1e9 if failed_ns else None
        if stop_ns is not None and (failed_ns is None or failed_ns >= stop_ns):
            o.state = "stopped"
        elif not r.ready and not self.is_command and r.exitcode == MAIN_GUARD_EXIT:
            o.note = (  # see _mainguard
                "while starting: the main module starts workers when it is imported; put that "
                'code under `if __name__ == "__main__":` or use start_method="fork"'
            )
        elif not r.ready:
            o.note = "before it started"
        elif r.exitcode == 0 and not self.is_command:
            o.note = "before returning its value"
        o.stderr_tail = self._stderr_tail(r, o.traceback)
        o.native_stack = self._native_stack(r)
        return o

    @staticmethod
    def _native_stack(r: _Rank) -> str | None:
        if r.stderr_pipe is not None:
            return r.stderr_pipe.native_traceback()
        if r.stderr_path:
            try:
                with open(r.stderr_path, "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                return None
            at = text.rfind("Fatal Python error")
            return text[at:].rstrip() if at >= 0 else None
        return None

    @staticmethod
    def _failed_ns(error: ProcessFailure | None, ended_ns: int | None) -> int | None:
        if error is None or error.error_file == "<N/A>":
            return ended_ns
        if error.timestamp_ns is not None:
            return int(error.timestamp_ns)
        # torchelastic's own files keep whole seconds: place it within that second
        low, high = error.timestamp * 10**9, (error.timestamp + 1) * 10**9 - 1
        return max(low, min(high, ended_ns)) if ended_ns else low

    @staticmethod
    def _stderr_tail(r: _Rank, traceback_text: str | None) -> str:
        if r.stderr_pipe is not None:
            text = bytes(r.stderr_pipe.tail).decode("utf-8", "replace")
        elif r.stderr_path:
            try:
                with open(r.stderr_path, "rb") as f:
                    f.seek(max(0, os.fstat(f.fileno()).st_size - TAIL_BYTES))
                    text = f.read().decode("utf-8", "replace")
            except OSError:
                text = ""
        else:
            text = ""
        if traceback_text:  # shown once, as the traceback
            tb = traceback_text.rstrip().split("\n")
            end = text.rfind(tb[-1])
            start = text.rfind(tb[0], 0, end) if end >= 0 else -1
            if start >= 0:
                text = text[:start] + text[end + len(tb[-1]) :]
        lines = text.rstrip().split("\n")
        return "\n".join(lines[-TAIL_LINES:]).strip("\n") if text.strip() else ""

    # -- the caller's side ----------------------------------------------------------------------

    @property
    def pids(self) -> dict[int, int | None]:
        """``{rank: pid}`` of the workers (a command's own pid, not its launcher's)."""
        return {r.rank: r.pid for r in self._ranks if r.process is not None}

    @property
    def stdouts(self) -> dict[int, str | None]:
        return {r.rank: r.stdout_path for r in self._ranks}

    @property
    def stderrs(self) -> dict[int, str | None]:
        return {r.rank: r.stderr_path for r in self._ranks}

    @property
    def error_files(self) -> dict[int, str | None]:
        return {r.rank: r.error_file for r in self._ranks}

    def _started(self) -> concurrent.futures.Future[Any]:
        if self._thread is None:
            raise RuntimeError("this WorkerGroup has not been started; call start() first")
        return self._done

    def _result(self) -> GroupResult:
        outcome = self._done.result()
        if isinstance(outcome, GroupFailed):
            raise outcome.with_traceback(None)
        return outcome  # type: ignore[no-any-return]

    def poll(self) -> GroupResult | GroupFailed | None:
        """None while a rank is still running (or being stopped); then the
        :class:`GroupResult`, or the :class:`GroupFailed` (returned, not raised)."""
        done = self._started()
        if not done.done():
            return None
        return done.result()  # type: ignore[no-any-return]

    def wait(self, timeout: float | None = None) -> GroupResult:
        """Wait for every rank to end; return the :class:`GroupResult` or raise
        :class:`GroupFailed` (``TimeoutError`` when ``timeout`` passes first: the group runs
        on).

        Called in the main thread, it forwards SIGINT and SIGTERM to the group while it waits
        (the signal to every rank's process group, ``grace``, SIGKILL; a second signal kills
        at once) and, once every rank has ended, restores the previous handlers and raises
        the signal again so it means what it meant before: ``KeyboardInterrupt`` for Ctrl-C,
        the end of the process for SIGTERM under the default handler."""
        done = self._started()
        saved = self._install_handlers() if not done.done() else {}
        try:
            concurrent.futures.wait([done], timeout)
        finally:
            received = self._restore_handlers(saved)
        if received:
            _flush_std()
            for sig in received:
                signal.raise_signal(sig)
        if not done.done():
            raise TimeoutError(f"worker group {self.name!r} still running after {timeout} s")
        return self._result()

    async def wait_async(self, timeout: float | None = None) -> GroupResult:
        """:meth:`wait` for asyncio, on the event loop (no thread per call). Cancelling it
        leaves the group running; under ``asyncio.run`` Ctrl-C cancels the task and
        ``async with`` then stops the group."""
        done = self._started()
        waiter = asyncio.wrap_future(done)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"worker group {self.name!r} still running after {timeout} s"
            ) from None
        return self._result()

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        saved: dict[int, Any] = {}
        for sig in _FORWARDED_SIGNALS:
            old = signal.getsignal(sig)
            if old is None:
                continue  # installed by C code: it cannot be put back
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, self._on_parent_signal)
                saved[sig] = old
        return saved

    def _restore_handlers(self, saved: dict[int, Any]) -> list[int]:
        for sig, old in saved.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, old)
        received, self._received = self._received, []
        return received[:1]

    def _on_parent_signal(self, signum: int, frame: Any) -> None:
        self._received.append(signum)
        if len(self._received) == 1:
            self._request(signum, self.grace, f"the parent received {signal_name(signum)}")
        else:
            self._request(signal.SIGKILL, 0.0, f"the parent received {signal_name(signum)} again")

    # -- the end ------------------------------------------------------------------------------

    def close(self, death_sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """Stop the ranks still running (``death_sig`` to each process group, ``grace``
        seconds, SIGKILL), reap them and release every descriptor. Idempotent; never raises
        the group's failure (``wait`` or ``poll`` do)."""
        thread = self._thread
        if thread is not None and not self._done.done():
            self._request(int(death_sig), float(grace), "close() was called")
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._release()

    async def aclose(self, death_sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """:meth:`close` for asyncio."""
        if self._thread is not None and not self._done.done():
            self._request(int(death_sig), float(grace), "close() was called")
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(self._done)
        self.close(death_sig, grace)

    def _release(self) -> None:
        with self._lock:
            self._closed = True
            for attr in ("_wake_r", "_wake_w"):
                fd = getattr(self, attr)
                setattr(self, attr, None)
                if fd is not None:
                    os.close(fd)
            _live_groups.discard(self)
            _parent_side.discard(self)
            if self._temp_dir is not None:
                shutil.rmtree(self._temp_dir, ignore_errors=True)
                self._temp_dir = None

    def _close_in_child(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for r in self._ranks:
            r.close_in_child()

    def __enter__(self) -> WorkerGroup:
        if self._thread is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> WorkerGroup:
        if self._thread is None:
            await self.astart()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        thread = getattr(self, "_thread", None)
        if thread is not None and not thread.is_alive():
            with contextlib.suppress(Exception):
                self._release()
