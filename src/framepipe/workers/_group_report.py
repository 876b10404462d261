"""What a :class:`~framepipe.workers.group.WorkerGroup` reports: how each rank ended, and the
group's result or its failure, root cause first.

:func:`group_outcome` reads the supervisor's :class:`~framepipe.workers._rank.Rank` records
once every rank has ended. The root cause is the rank that failed first, by the time in its
error file, else by the time its death was seen; a rank that failed only after the group began
stopping was stopped, not a cause.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from ..errors import signal_name
from ..guard import ProcessFailure
from ..remote import format_exception_text, loads_exception
from ._rank import Rank
from ._stderr import TAIL_LINES, file_tail, native_dump
from .errors import MAIN_GUARD_EXIT, WorkerError

__all__ = ["GroupFailed", "GroupResult", "RankOutcome", "group_outcome"]


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


def group_outcome(
    name: str,
    ranks: list[Rank],
    is_command: bool,
    keep_error_files: bool,
    stop: tuple[str, int] | None,
) -> GroupResult | GroupFailed:
    """The group's result, or its failure; ``stop`` is ``(reason, time_ns)`` when the group
    began stopping its ranks."""
    outcomes = {r.rank: _rank_outcome(r, is_command, keep_error_files, stop) for r in ranks}
    failed = [o for o in outcomes.values() if o.state == "failed"]
    if not failed and all(o.state == "succeeded" for o in outcomes.values()):
        return GroupResult(
            return_values={r: o.return_value for r, o in outcomes.items()},
            exitcodes={r: o.exitcode for r, o in outcomes.items()},
            pids={r.rank: r.pid for r in ranks if r.process is not None},
            stdouts={r.rank: r.stdout_path for r in ranks},
            stderrs={r.rank: r.stderr_path for r in ranks},
        )
    root = min(failed, key=lambda o: (o.failed_at, o.ended_at or 0.0, o.rank), default=None)
    reason = stop[0] if stop is not None else "a rank failed"
    return GroupFailed(name, outcomes, root.rank if root else None, reason)


def _rank_outcome(
    r: Rank, is_command: bool, keep_error_files: bool, stop: tuple[str, int] | None
) -> RankOutcome:
    o = RankOutcome(
        rank=r.rank,
        pid=r.pid,
        state="failed",
        exitcode=r.exitcode,
        core_dumped=r.core_dumped,
        oom_killed=r.oom_killed,
        error_file=r.error_file if keep_error_files else None,  # else: removed
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
    stop_ns = stop[1] if stop is not None else None
    if r.succeeded(is_command) and (
        is_command is False or stop_ns is None or (r.ended_ns or 0) < stop_ns
    ):
        o.state = "succeeded"
        return o
    if r.error_file and os.path.isfile(r.error_file):
        o.error = ProcessFailure(
            r.rank, r.pid or 0, r.exitcode if r.exitcode is not None else 1, r.error_file
        )
    failed_ns = _failed_ns(o.error, r.ended_ns)
    o.failed_at = failed_ns / 1e9 if failed_ns else None
    if stop_ns is not None and (failed_ns is None or failed_ns >= stop_ns):
        o.state = "stopped"
    else:
        o.note = _note(r, is_command)
    text = _stderr_text(r)
    o.stderr_tail = _stderr_tail(text, o.traceback)
    o.native_stack = native_dump(text)
    return o


def _note(r: Rank, is_command: bool) -> str:
    if not r.ready and not is_command and r.exitcode == MAIN_GUARD_EXIT:
        return (  # see _mainguard
            "while starting: the main module starts workers when it is imported; put that "
            'code under `if __name__ == "__main__":` or use start_method="fork"'
        )
    if not r.ready:
        return "before it started"
    if r.exitcode == 0 and not is_command:
        return "before returning its value"
    return ""


def _stderr_text(r: Rank) -> str:
    """The last of the rank's stderr: the tail its pipe kept, else the end of its log file."""
    if r.stderr_pipe is not None:
        return bytes(r.stderr_pipe.tail).decode("utf-8", "replace")
    if r.stderr_path:
        return file_tail(r.stderr_path) or ""
    return ""


def _failed_ns(error: ProcessFailure | None, ended_ns: int | None) -> int | None:
    if error is None or error.error_file == "<N/A>":
        return ended_ns
    if error.timestamp_ns is not None:
        return int(error.timestamp_ns)
    # torchelastic's own files keep whole seconds: place it within that second
    low, high = error.timestamp * 10**9, (error.timestamp + 1) * 10**9 - 1
    return max(low, min(high, ended_ns)) if ended_ns else low


def _stderr_tail(text: str, traceback_text: str | None) -> str:
    if traceback_text:  # shown once, as the traceback
        tb = traceback_text.rstrip().split("\n")
        end = text.rfind(tb[-1])
        start = text.rfind(tb[0], 0, end) if end >= 0 else -1
        if start >= 0:
            text = text[:start] + text[end + len(tb[-1]) :]
    lines = text.rstrip().split("\n")
    return "\n".join(lines[-TAIL_LINES:]).strip("\n") if text.strip() else ""
