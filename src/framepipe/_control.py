"""The frames that are not data: error frames (an exception sent across) and the DEAD sentinel
(what the watcher writes when a watched writer dies, and what a reader raises on reading one),
with the watch that writes it."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from ._unpickle import Imports
from ._wire import KIND_ERROR, dead_sentinel, header
from .errors import RemoteBaseException, WriterDied
from .remote import (
    RemoteTraceback,
    _chain_end,
    dumps_exception,
    format_exception_text,
    loads_exception,
    qualified_name,
)
from .watch import Liveness, dead_status_word, exitcode_from_status_word, resolve_target, watcher

# -- error frames ---------------------------------------------------------------------------


def error_frame(exc: BaseException) -> list[bytes]:
    """The frame that carries ``exc`` (framepipe.remote serializes it; this never fails)."""
    payload = dumps_exception(exc)
    return [header(KIND_ERROR, len(payload)), payload]


def remote_error(payload: bytes, imports: Imports | None = False) -> BaseException:
    """The exception an error frame carries (framepipe.remote revives it, importing only
    what ``imports`` admits). A ``BaseException`` that is not an ``Exception`` comes wrapped
    in :class:`RemoteBaseException`: raised as itself, it would end the reader's program."""
    exc = loads_exception(payload, imports=imports)
    if isinstance(exc, Exception):
        return exc
    end = _chain_end(exc)
    text = end.text if isinstance(end, RemoteTraceback) else format_exception_text(exc)
    return RemoteBaseException(exc, qualified_name(type(exc)), text)


# -- the writer's death ---------------------------------------------------------------------


def check_watch(target: Any, readable: bool) -> None:
    """Refuse watches that cannot work: on a connection that cannot read, of this process
    itself (it can never be seen dead by itself), and of a pid that does not exist."""
    if target is None:
        return
    if not readable:
        raise ValueError(
            "cannot watch a writer on a write-only connection: a watch makes reads raise "
            "WriterDied; watch the writer on the connection that reads from it"
        )
    pid, obj = resolve_target(target)
    if pid == os.getpid():
        raise ValueError(
            f"cannot watch pid {pid}: it is this process, which can never see its own death; "
            "watch the process that writes to this connection"
        )
    if obj is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise ProcessLookupError(
                f"cannot watch pid {pid}: no such process (it never existed or has already "
                "exited and been reaped); watch the Process or Popen object instead of its pid "
                "to get its exit status even after it was reaped"
            ) from None
        except PermissionError:
            pass  # it exists, owned by someone else


def start_watch(target: Any, peer: Callable[[], Any] | None) -> tuple[Liveness, Any]:
    """Watch the writer ``target``; returns ``(liveness, watcher_handle)``.

    ``peer`` is a weak reference to the Connection of this process that holds the write end
    feeding the watched reader, or None. When there is one, the process-wide watcher writes a
    DEAD sentinel through it once the writer's death is confirmed, so a thread blocked in
    ``select()`` or ``multiprocessing.connection.wait()`` on the read end wakes up.
    """
    liveness = Liveness(target)
    handle = None
    held = peer() if peer is not None else None
    # A write end already closed here can carry no sentinel: no registration, so the watcher
    # thread does not wake (and take the GIL) at the death the reader is about to report.
    if peer is not None and held is not None and not held.closed:

        def on_death(liv: Liveness) -> None:
            conn = peer()
            if conn is None or conn.closed:
                return
            try:
                conn._write_sentinel(dead_sentinel(dead_status_word(liv.status()[0])))
            except OSError:
                pass  # the reader is gone or the pipe is full: readers still see the pidfd

        handle = watcher().register(liveness, on_death)
    return liveness, handle


def stop_watch(liveness: Liveness | None, handle: Any) -> None:
    if handle is not None:
        watcher().unregister(handle)
    if liveness is not None:
        liveness.close()


def dead_error(status: int, liveness: Liveness | None) -> WriterDied:
    """A DEAD sentinel was read: the watched writer's own account when there is one, else
    what the status word says (a code, 128 + signal, or all ones when unknown)."""
    if liveness is not None:
        return liveness.error()
    return WriterDied(None, exitcode_from_status_word(status))
