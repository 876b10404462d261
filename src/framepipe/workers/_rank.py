"""One rank of a :class:`~framepipe.workers.group.WorkerGroup`: its body in the child, its
record in the parent, and :class:`Std` (which of its streams).

A function rank starts as every worker does (:func:`~framepipe.workers._child.child_main`,
here with a :class:`RankBoot`), then calls its function and reports its value or its failure
on its result channel and in its error file. A command rank runs under the launcher of
:mod:`framepipe.workers._launch`. The supervisor keeps a :class:`Rank` for each, whose state
is a :class:`~framepipe.workers._lifecycle.State`: ``STARTING``, ``BUSY`` once it runs its
entry point, ``STOPPING`` once the group signalled it, ``DEAD`` once its death was seen.
"""

from __future__ import annotations

import contextlib
import enum
import os
import select
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn

from ..guard import ERROR_FILE_ENV, write_error_file
from ..remote import dumps_exception, format_exception_text
from ..watch import Liveness
from . import _launch
from ._child import Boot
from ._lifecycle import Lifecycle, State
from ._stderr import OutputPipe

#: how long a dead launcher's group waits for its command to end after the SIGKILL (see
#: Rank.wait_command_gone): a SIGKILLed process is gone within milliseconds unless the kernel
#: holds it (an uninterruptible sleep), and then the group does not wait for it forever
COMMAND_GONE_WAIT = 2.0

__all__ = ["Rank", "RankBoot", "Std", "flush_std"]


class Std(enum.IntFlag):
    """Which of a rank's streams: ``NONE``, ``OUT`` (stdout), ``ERR`` (stderr) or ``ALL``.

    ``redirects`` and ``tee`` take one value for every rank or a dict ``{rank: Std}`` (ranks
    left out get ``NONE``), as torchelastic's ``Std`` does."""

    NONE = 0
    OUT = 1
    ERR = 2
    ALL = 3


# --------------------------------------------------------------------------------------------
# The child side of a function rank
# --------------------------------------------------------------------------------------------


@dataclass
class RankBoot(Boot):
    """What a function rank runs after the common start-up: ``fn(*args)``, its value or its
    failure sent on ``result``."""

    rank: int = 0
    fn: Callable[..., Any] | None = None
    args: tuple[Any, ...] = ()
    result: Any = None

    kill_group_on_parent_death: ClassVar[bool] = True
    rebind_stdout: ClassVar[bool] = True

    def channels(self) -> list[Any]:
        return [self.result]

    def setup(self) -> None:
        # what a forked rank inherited (the group's own forwarding handlers) does not apply
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        _launch.start_parent_watch(self.parent_pid)

    def run(self) -> None:
        assert self.fn is not None
        try:
            # Inside the try: the parent may read "ready" and forward a SIGINT before this
            # send returns here, and that interrupt ends the rank as quietly as one in fn.
            self.result.send(("ready",))
            value = self.fn(*self.args)
        except SystemExit as exc:
            if exc.code not in (0, None):
                self._failed(exc, exc.code if isinstance(exc.code, int) else 1)
            value = None
        except KeyboardInterrupt:
            _end_by_sigint()
        except BaseException as exc:  # noqa: BLE001 - reported, then the rank exits with code 1
            self._failed(exc, 1)
        try:
            self.result.send(("ok", value))
        except KeyboardInterrupt:
            _end_by_sigint()
        except Exception as exc:  # noqa: BLE001 - e.g. a value that does not pickle
            self._failed(exc, 1)
        self.result.close()

    def _failed(self, exc: BaseException, code: int) -> None:
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame.f_code is RankBoot.run.__code__:
            exc = exc.with_traceback(tb.tb_next)  # the rank's frames start at its function
        path = os.environ.get(ERROR_FILE_ENV)
        if path and not os.path.exists(path):  # @framepipe.record in the function wrote it
            with contextlib.suppress(Exception):
                write_error_file(path, exc, label=f"rank {self.rank}")
        with contextlib.suppress(Exception):
            self.result.send(("error", dumps_exception(exc)))
        if not isinstance(exc, SystemExit):
            with contextlib.suppress(Exception):
                sys.stderr.write(format_exception_text(exc))
        elif isinstance(exc.code, str):
            with contextlib.suppress(Exception):
                sys.stderr.write(exc.code + "\n")
        flush_std()
        os._exit(code)


def _end_by_sigint() -> NoReturn:
    """The group forwarded SIGINT: end quietly, as the signal itself would (no traceback)."""
    flush_std()
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.kill(os.getpid(), signal.SIGINT)
    os._exit(128 + signal.SIGINT)


def flush_std() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()


# --------------------------------------------------------------------------------------------
# The parent's record
# --------------------------------------------------------------------------------------------


class Rank(Lifecycle):
    """The supervisor's record of one rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.process: Any = None  # multiprocessing.Process, or the launcher's Popen
        self.pid: int | None = None  # the worker's own pid (the command's, not the launcher's)
        self.command: Liveness | None = None  # the command itself (see watch_command)
        self.pgid: int | None = None
        self.liveness: Liveness | None = None
        self.death_fd: int | None = None
        self.report_fd: int | None = None
        self.conn: Any = None
        self.conn_open = False
        self.ready = False  # ran its entry point (a command: started; a function: called)
        self.result: tuple[str, Any] | None = None
        self.pipes: list[OutputPipe] = []
        self.stderr_pipe: OutputPipe | None = None
        self.stdout_path: str | None = None
        self.stderr_path: str | None = None
        self.error_file: str | None = None
        self.ended_ns: int | None = None
        self.exitcode: int | None = None
        self.core_dumped = False
        self.oom_killed: bool | None = None
        self.output_at = 0.0  # time.monotonic() of its start, then of its last output

    @property
    def ended(self) -> bool:
        """Its death was seen (and it was reaped)."""
        return self.state is State.DEAD

    def mark_ready(self) -> None:
        """It runs its entry point now."""
        self.ready = True
        if self.state is State.STARTING:
            self.to(State.BUSY)

    def succeeded(self, is_command: bool) -> bool:
        """It exited 0 (and a function rank sent its value)."""
        if self.exitcode != 0:
            return False
        return is_command or (self.result is not None and self.result[0] == "ok")

    def signal(self, sig: int) -> None:
        if self.ended or self.pgid is None:
            return
        self.to(State.STOPPING)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pgid, sig)  # in case it has not made its group yet

    def watch_command(self) -> None:
        """A command rank, its pid reported: watch the command itself (the launcher's child)
        for ``wait_command_gone``."""
        if self.pid is not None:
            self.command = Liveness(self.pid)

    def wait_command_gone(self, timeout: float = COMMAND_GONE_WAIT) -> None:
        """A command rank whose launcher is dead and whose process group was SIGKILLed: wait
        (up to ``timeout`` seconds) until the command itself has ended. A launcher killed by
        that SIGKILL dies before it can wait for its command, which the kernel may still be
        tearing down: without this a group's ``close()`` could return while the command still
        showed as running."""
        watch, self.command = self.command, None
        if watch is None:
            return
        try:
            end = time.monotonic() + timeout
            while not watch.poll_dead() and time.monotonic() < end:
                if watch.fd is None:
                    time.sleep(0.005)  # no pidfds here: poll_dead looks by start time
                    continue
                poller = select.poll()
                poller.register(watch.fd, select.POLLIN)
                poller.poll(max(0.0, end - time.monotonic()) * 1000.0)
        finally:
            watch.close()

    def reap(self) -> int | None:
        """Wait for its process; its exit status."""
        if hasattr(self.process, "join"):
            self.process.join()
            code: int | None = self.process.exitcode
        else:
            code = self.process.wait()
        self.to(State.DEAD)
        return code

    def close_in_child(self) -> None:
        fds = [self.death_fd if self.liveness is None else None, self.report_fd]
        for fd in fds:
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        for pipe in self.pipes:
            pipe.close_in_child()
        for watch in (self.liveness, self.command):
            if watch is not None:
                with contextlib.suppress(OSError):
                    watch.close()
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
        for watch in (self.liveness, self.command):
            if watch is not None:
                watch.close()
        if self.ended and hasattr(self.process, "close"):  # a multiprocessing.Process
            with contextlib.suppress(ValueError):
                self.process.close()  # its sentinel pipes
