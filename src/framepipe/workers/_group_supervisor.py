"""The supervisor thread of a :class:`~framepipe.workers.group.WorkerGroup`.

It launches the ranks (a function rank as a ``multiprocessing`` process that starts in
:func:`~framepipe.workers._child.child_main`, a command rank under the launcher of
:mod:`framepipe.workers._launch`) and then sleeps in a single ``poll()`` over every rank's
pidfd, its result channel, the output pipes it copies and the stop's wake-up pipe: a death is
seen the moment it happens, never by a timer. Each wake-up is handled in order: output and
results first (a dead rank's last words), then deaths; a failure begins the stop
(:mod:`framepipe.workers._group_stop`). Once every rank has ended, the outcome
(:mod:`framepipe.workers._group_report`) settles the group's future.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol

from .. import connection as _connection
from ..remote import dumps_exception
from ..watch import Liveness
from . import _byvalue, _launch
from ._child import FdHandle, main_without_pseudo_file, new_process
from ._group_report import group_outcome
from ._group_stop import StopControl
from ._lifecycle import State
from ._policy import GroupPolicy
from ._rank import Rank, RankBoot, Std
from ._stderr import OutputPipe, open_output
from .errors import WorkerStartError

__all__ = ["GroupPlan", "Supervisor"]

#: how long the start waits for a command's launcher to report the command's pid
LAUNCH_TIMEOUT = 60.0


class GroupPlan(Protocol):
    """What the supervisor reads from its :class:`~framepipe.workers.group.WorkerGroup`: the
    entry point, the per-rank settings, how to stop, and the hooks a subclass may override."""

    is_command: bool
    entrypoint: Any
    args: dict[int, tuple[Any, ...]]
    tee: dict[int, Std]
    death_sig: int
    _argv: list[str]
    _ctx: Any
    _own_session: bool

    @property
    def name(self) -> str: ...

    @property
    def log_dir(self) -> str | None: ...

    @property
    def grace(self) -> float: ...

    def _env(self, rank: int) -> dict[str, str]: ...

    def _label(self, rank: int) -> str: ...

    def _stream_plan(self, rank: int, which: Std, path: str | None) -> str: ...


class Supervisor:
    """One group's ranks, launched and watched from one thread (see the module docstring).

    ``launched`` is settled once every rank runs its entry point (or ended), ``done`` with the
    group's outcome; ``control`` is the stop."""

    def __init__(self, group: GroupPlan, ranks: list[Rank]) -> None:
        self.group = group
        self.ranks = ranks
        self.policy = GroupPolicy()  # what a failed rank fails: the group (see _policy)
        self.control = StopControl(group.grace)
        self.launched: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        for fut in (self.launched, self.done):
            fut.set_running_or_notify_cancel()  # an asyncio waiter's cancel must not reach it
        self._seen_ns = 0

    # -- launching --------------------------------------------------------------------------

    def _stream(self, r: Rank, which: Std) -> int | None:
        """The fd the rank writes ``which`` to (the caller closes it after the start), or
        None to share this process's own."""
        path = r.stdout_path if which is Std.OUT else r.stderr_path
        plan = self.group._stream_plan(r.rank, which, path)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND | os.O_CLOEXEC
        if plan == "file" and path:
            return os.open(path, flags, 0o644)  # straight to the file: no copying
        if plan == "inherit" and which is Std.OUT:
            return None
        if path:
            os.close(os.open(path, flags, 0o644))
        console = plan if plan in ("prefix", "raw") else None
        stream = "stdout" if which is Std.OUT else "stderr"
        pipe, write = open_output(self.group._label(r.rank), path, console, stream)
        r.pipes.append(pipe)
        if which is Std.ERR:
            r.stderr_pipe = pipe
        return write

    def _launch_rank(self, r: Rank) -> None:
        out_fd = self._stream(r, Std.OUT)
        err_fd = self._stream(r, Std.ERR)
        assert err_fd is not None
        try:
            if self.group.is_command:
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
            r.death_fd = r.report_fd if self.group.is_command else r.process.sentinel

    def _launch_function(self, r: Rank, out_fd: int | None, err_fd: int) -> None:
        group = self.group
        ctx = group._ctx
        assert ctx is not None
        reader, writer = _connection.Pipe(False)
        r.conn, r.conn_open = reader, True
        boot = RankBoot(
            name=f"{group.name}-{r.rank}",
            parent_pid=os.getpid(),
            stderr=FdHandle(err_fd),
            stdout=None if out_fd is None else FdHandle(out_fd),
            env=group._env(r.rank),
            line_buffered_stdout=bool(group.tee[r.rank] & Std.OUT),  # tee shows each line
            rank=r.rank,
            fn=_byvalue.portable(ctx, group.entrypoint, "the entrypoint"),  # by value if it must
            args=_byvalue.portable(ctx, group.args[r.rank], f"rank {r.rank}'s args"),
            result=writer,
        )
        try:
            # what a forked rank inherited stays open, as under torch's start_processes
            process = new_process(ctx, boot, boot.name, close_inherited=False)
            with main_without_pseudo_file():
                process.start()
        finally:
            writer.close()
        r.process, r.pid, r.pgid = process, process.pid, process.pid
        with contextlib.suppress(OSError):
            os.setpgid(process.pid, process.pid)  # before the child does it too (fork)
        reader.watch(process)

    def _launch_command(self, r: Rank, out_fd: int | None, err_fd: int) -> None:
        group = self.group
        report_r, report_w = os.pipe()
        r.report_fd = report_r
        argv = [sys.executable, "-I", "-S", _launch.__file__, str(os.getpid()), str(report_w)]
        argv += ["--", *group._argv, *map(str, group.args[r.rank])]
        kwargs: dict[str, Any] = {}
        if group._own_session:
            kwargs["start_new_session"] = True
        elif sys.version_info >= (3, 11):
            kwargs["process_group"] = 0
        else:  # pragma: no cover - Python 3.10
            kwargs["start_new_session"] = True
        env = dict(os.environ)
        env.update(group._env(r.rank))
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

    def _read_report(self, r: Rank, deadline: float) -> None:
        """The command's pid from its launcher, or the reason it could not start."""
        assert r.report_fd is not None
        program = self.group._argv[0]
        data = b""
        poller = select.poll()
        poller.register(r.report_fd, select.POLLIN)
        while not data.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or not poller.poll(left * 1000):
                raise WorkerStartError(
                    f"rank {r.rank}: the launcher did not report within {LAUNCH_TIMEOUT:g} s"
                )
            chunk = os.read(r.report_fd, 4096)
            if not chunk:
                r.process.wait()
                raise WorkerStartError(
                    f"rank {r.rank}: the launcher ended (exit status {r.process.returncode}) "
                    f"before starting {program!r}"
                )
            data += chunk
        text = data.decode("utf-8", "replace").strip()
        if text.startswith("!"):
            code, _, message = text[1:].partition(" ")
            raise OSError(int(code), f"{message} (rank {r.rank})", program)
        r.pid = int(text)
        r.watch_command()

    def _launch_all(self) -> None:
        for r in self.ranks:
            self._launch_rank(r)
        if self.group.is_command:
            deadline = time.monotonic() + LAUNCH_TIMEOUT
            for r in self.ranks:
                self._read_report(r, deadline)
                r.mark_ready()
                if r.death_fd != r.report_fd and r.report_fd is not None:
                    fd, r.report_fd = r.report_fd, None  # forgotten first (a fork meanwhile)
                    os.close(fd)

    # -- the thread ---------------------------------------------------------------------------

    def run(self) -> None:
        """The supervisor thread's body."""
        try:
            self._launch_all()
        except BaseException as exc:  # noqa: BLE001 - handed to start()
            self._abort(exc)
            return
        error: BaseException | None = None
        try:
            self._check_launched()
            self._loop()
            group = self.group
            outcome = group_outcome(
                group.name, self.ranks, group.is_command, bool(group.log_dir), self.control.stop
            )
        except BaseException as exc:  # noqa: BLE001 - a bug here must not hang wait()
            self._kill_all()
            error = exc
        finally:
            for r in self.ranks:
                r.release()
        if error is not None:
            self.done.set_exception(error)
        else:
            self.done.set_result(outcome)

    def _abort(self, exc: BaseException) -> None:
        self._kill_all()
        for r in self.ranks:
            r.release()
        self.launched.set_exception(exc)
        self.done.set_exception(exc)

    def _kill_all(self) -> None:
        for r in self.ranks:
            r.signal(signal.SIGKILL)
        for r in self.ranks:
            if r.process is not None and not r.ended:
                with contextlib.suppress(Exception):
                    r.reap()
                r.to(State.DEAD)

    def _handlers(self, live: list[Rank]) -> dict[Any, Callable[[], None]]:
        """What to do when each watched object is ready."""
        assert self.control.wake_r is not None
        handlers: dict[Any, Callable[[], None]] = {
            self.control.wake_r: functools.partial(self.control.on_wake, self.ranks)
        }
        for r in live:
            handlers[r.death_fd] = functools.partial(self._on_death, r)
        for r in self.ranks:
            if r.conn_open:
                handlers[r.conn] = functools.partial(self._on_result, r)
            for p in r.pipes:
                if p.fd is not None:
                    handlers[p.fd] = functools.partial(self._on_output, p, r)
        return handlers

    def _loop(self) -> None:
        while True:
            live = [r for r in self.ranks if not r.ended]
            if not live:
                return
            handlers = self._handlers(live)
            ready = _connection.wait(list(handlers), self.control.timeout())
            # every death in this batch happened before any stop this batch begins
            self._seen_ns = time.time_ns()
            # output and results before deaths: a dead rank's last words come first
            deaths = {r.death_fd for r in live}
            order = sorted(ready, key=lambda o: isinstance(o, int) and o in deaths)
            for obj in order:
                handlers[obj]()
            self.control.kill_if_due(self.ranks)

    def _on_output(self, pipe: OutputPipe, r: Rank | None = None) -> None:
        if r is not None:
            r.output_at = time.monotonic()
        try:
            eof = pipe.pump()
        except OSError:
            eof = True
        if eof and pipe.fd is not None:
            fd, pipe.fd = pipe.fd, None  # forgotten first, as in WorkerProcess.close
            os.close(fd)

    def _on_result(self, r: Rank) -> None:
        try:
            msg = r.conn.recv()
        except (EOFError, OSError):
            msg = None  # it died without a word: its exit status tells the story
        except Exception as exc:  # noqa: BLE001 - e.g. a value that does not unpickle here
            msg = ("error", dumps_exception(exc))
        if msg == ("ready",):
            r.mark_ready()
            self._check_launched()
            return
        r.result = msg
        r.conn_open = False

    def _check_launched(self) -> None:
        if not self.launched.done() and all(r.ready or r.ended for r in self.ranks):
            self.launched.set_result(None)

    def _on_death(self, r: Rank) -> None:
        r.ended_ns = self._seen_ns
        while r.conn_open and r.conn.poll(0):
            self._on_result(r)
        r.conn_open = False
        assert r.liveness is not None
        died = r.liveness.error(label=f"rank {r.rank}")
        r.exitcode, r.core_dumped, r.oom_killed = died.exitcode, died.core_dumped, died.oom_killed
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(r.pgid, signal.SIGKILL)  # type: ignore[arg-type] # what it left behind
        code = r.reap()
        r.wait_command_gone()  # a launcher SIGKILLed before its command was gone
        if r.exitcode is None:
            r.exitcode = code
        self._check_launched()
        for p in r.pipes:
            if p.fd is not None:
                self._on_output(p)
        if not r.succeeded(self.group.is_command) and self.policy.crash_stops_all:
            group = self.group
            self.control.begin(self.ranks, group.death_sig, group.grace, f"rank {r.rank} failed")
