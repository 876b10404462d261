"""``WorkerGroup``: start N workers, wait for all of them, report the first failure first.

A group runs one entry point as ``nprocs`` ranks, a function (each rank in a
``multiprocessing`` process: fork, spawn or forkserver) or a command line (each rank a
subprocess, under a small launcher that makes it die with the group). One supervisor thread
per group (:mod:`framepipe.workers._group_supervisor`) launches the ranks and then sleeps in a
single ``poll()`` over every rank's pidfd, its result channel, the output pipes it copies and a
wake-up pipe: a death is seen the moment it happens, never by a timer.

When a rank fails the others are stopped at once (the death signal to each process group, a
grace period, SIGKILL: :mod:`framepipe.workers._group_stop`). The root cause is the rank that
failed first, by the time in its error file (the torchelastic JSON that :func:`framepipe.record`
writes; each rank finds its path in ``TORCHELASTIC_ERROR_FILE``), else by the time its death
was seen; a rank that only wrote its error file after the group began stopping was stopped,
not a cause (:mod:`framepipe.workers._group_report`, where :class:`RankOutcome`,
:class:`GroupResult` and :class:`GroupFailed` are defined; :class:`Std` is defined in
:mod:`framepipe.workers._rank`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .._args import check_int, check_seconds, check_type
from .._lazy import asyncio  # imported on first use (see _lazy)
from ..guard import ERROR_FILE_ENV
from . import _atexit
from ._child import forget_parent_side, register_parent_side
from ._group_report import GroupFailed, GroupResult, RankOutcome
from ._group_supervisor import Supervisor
from ._mainguard import refuse_during_main_import
from ._options import ProcessOptions
from ._rank import Rank, Std, flush_std

__all__ = ["WorkerGroup", "GroupFailed", "GroupResult", "RankOutcome", "Std"]

Entrypoint = Callable[..., Any] | str | Sequence[str]


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


def _empty_command() -> list[str]:
    raise ValueError("the command line is empty; pass a program name or an argv list")


def _rank_args(args: Any, nprocs: int) -> dict[int, tuple[Any, ...]]:
    """``args`` as ``{rank: tuple}``: each rank's arguments must be a tuple or a list."""
    out = {}
    for r, a in _per_rank(args, nprocs, "args", ()).items():
        if not isinstance(a, (tuple, list)):
            where = "args" if not isinstance(args, Mapping) else f"args[{r}]"
            whose = "each rank's" if not isinstance(args, Mapping) else f"rank {r}'s"
            raise TypeError(
                f"{where} must be a tuple of {whose} arguments, not {type(a).__name__} "
                f"({a!r:.60}); for one argument write ({a!r:.20},)"
            )
        out[r] = tuple(a)
    return out


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
        nprocs = check_int("nprocs", nprocs, why="the number of ranks")
        self.is_command = not callable(entrypoint)
        self._argv = self._command_line(entrypoint) if self.is_command else []
        check_seconds("grace", grace, none_ok=False, zero_ok=True, finite=True)
        death_sig = check_int("death_sig", death_sig, why="a signal number")
        if death_sig not in set(signal.valid_signals()):
            raise ValueError(
                f"death_sig {death_sig} is not a signal of this platform; pass one such as "
                "signal.SIGTERM"
            )
        self.options = ProcessOptions(
            name=name or self._default_name(entrypoint),
            start_method=start_method,
            log_dir=os.fspath(log_dir) if log_dir is not None else None,
            kill_grace=float(grace),
        )
        self._ctx = None if self.is_command else self.options.context()
        self.entrypoint = entrypoint
        self.nprocs = nprocs
        self.args = _rank_args(args, nprocs)
        where = "envs[{}]" if isinstance(envs, Mapping) else "envs"
        self.envs = {
            r: {str(k): str(v) for k, v in check_type(where.format(r), e, Mapping).items()}
            for r, e in _per_rank(envs, nprocs, "envs", {}).items()
        }
        default = Std.ALL if self.log_dir else Std.NONE
        self.redirects = {
            r: Std(v)
            for r, v in _per_rank(redirects, nprocs, "redirects", default, Std.NONE).items()
        }
        self.tee = {r: Std(v) for r, v in _per_rank(tee, nprocs, "tee", Std.NONE).items()}
        if not self.log_dir and any(self.redirects.values()):
            raise ValueError("redirects need a log_dir to put the files in")
        self.death_sig = int(death_sig)
        self._ranks = [Rank(r) for r in range(nprocs)]
        self._sup = Supervisor(self, self._ranks)
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._temp_dir: str | None = None
        self._closed = False

    @staticmethod
    def _command_line(entrypoint: Any) -> list[str]:
        one = isinstance(entrypoint, (str, bytes, os.PathLike))
        try:
            argv: list[Any] = [entrypoint] if one else list(entrypoint)
            return [os.fsdecode(a) for a in argv] or _empty_command()
        except TypeError:
            raise TypeError(
                f"entrypoint must be a function each rank calls, or a command (a program "
                f"name or an argv list of str), not {type(entrypoint).__name__} "
                f"({entrypoint!r:.60})"
            ) from None

    def _default_name(self, entrypoint: Any) -> str:
        if self.is_command:
            return os.path.basename(self._argv[0])
        return str(getattr(entrypoint, "__qualname__", "group"))

    # -- the options the group shares with every worker class --

    @property
    def name(self) -> str:
        return self.options.name

    @property
    def start_method(self) -> str | None:
        return self.options.start_method

    @property
    def log_dir(self) -> str | None:
        return self.options.log_dir

    @property
    def grace(self) -> float:
        """Seconds a stopping rank is given before SIGKILL."""
        return self.options.kill_grace

    def __repr__(self) -> str:
        if self._thread is None:
            state = "not started"
        else:
            state = "done" if self._sup.done.done() else "running"
        return f"<WorkerGroup {self.name!r} nprocs={self.nprocs} {state}>"

    # -- start --------------------------------------------------------------------------------

    def start(self) -> None:
        """Start every rank; returns once all are running. A rank that cannot start (a
        command that does not exist, a function that does not pickle for spawn) stops the
        others and raises here."""
        self._begin()
        try:
            self._sup.launched.result()
        except BaseException:
            if not self._sup.launched.done():  # interrupted (Ctrl-C): leave nothing running
                self.close(self.death_sig, self.grace)
            raise

    async def astart(self) -> None:
        """:meth:`start` for asyncio."""
        self._begin()
        await asyncio.wrap_future(self._sup.launched)

    def _begin(self) -> None:
        if not self.is_command:
            refuse_during_main_import(f"a WorkerGroup {self.name!r}")
        try:
            self._open()
        except BaseException:
            if self._thread is None and self._sup.control.wake_r is not None:
                self._release()  # what it opened before it failed (start() raises, not __exit__)
            raise

    def _open(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("this WorkerGroup is closed")
            if self._thread is not None:
                raise RuntimeError("this WorkerGroup was started already")
            self._sup.control.open()
            self._prepare_files()
            register_parent_side(self)
            _atexit.register(self)
            # The ranks are started from the supervisor thread, which lives as long as they
            # do: PR_SET_PDEATHSIG fires when the *thread* that started a process ends.
            thread = threading.Thread(
                target=self._sup.run, daemon=True, name=f"framepipe-group-{self.name}"
            )
            thread.start()
            self._thread = thread  # (only once it runs: a start that failed releases, above)

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
            if self._closed:
                raise RuntimeError(
                    "this WorkerGroup never ran: it was closed, or its start() raised, before "
                    "any rank started"
                )
            raise RuntimeError("this WorkerGroup has not been started; call start() first")
        return self._sup.done

    def _result(self) -> GroupResult:
        outcome = self._sup.done.result()
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
        saved = self._sup.control.install_handlers() if not done.done() else {}
        try:
            concurrent.futures.wait([done], timeout)
        finally:
            received = self._sup.control.restore_handlers(saved)
        if received:
            flush_std()
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

    # -- the end ------------------------------------------------------------------------------

    def close(self, death_sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """Stop the ranks still running (``death_sig`` to each process group, ``grace``
        seconds, SIGKILL), reap them and release every descriptor; it returns once each rank's
        own process (a command's too) has ended. Idempotent; never raises the group's failure
        (``wait`` or ``poll`` do)."""
        thread = self._thread
        if thread is not None and not self._sup.done.done():
            self._sup.control.request(int(death_sig), float(grace), "close() was called")
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        self._release()

    async def aclose(self, death_sig: int = signal.SIGTERM, grace: float = 30.0) -> None:
        """:meth:`close` for asyncio."""
        if self._thread is not None and not self._sup.done.done():
            self._sup.control.request(int(death_sig), float(grace), "close() was called")
            with contextlib.suppress(BaseException):
                await asyncio.wrap_future(self._sup.done)
        self.close(death_sig, grace)

    def _release(self) -> None:
        with self._lock:
            self._closed = True
            self._sup.control.close()
            _atexit.unregister(self)
            forget_parent_side(self)
            if self._temp_dir is not None:
                shutil.rmtree(self._temp_dir, ignore_errors=True)
                self._temp_dir = None

    def _close_in_child(self) -> None:
        self._sup.control.close_in_child()
        for r in self._ranks:
            r.close_in_child()

    def finish_at_exit(self) -> None:
        """At interpreter exit (see :mod:`framepipe.workers._atexit`): nothing to finish."""

    def stop_at_exit(self) -> None:
        """At interpreter exit: stop the ranks, with at most 5 s of grace."""
        self.close(grace=min(self.grace, 5.0))

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
