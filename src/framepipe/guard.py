"""The guard: make sure the parent hears of a worker's failure, whatever else breaks.

:func:`guard` wraps a worker's body (as a context manager or a decorator). When the body raises,
it prints a crash banner with the traceback to stderr, sends the exception through ``conn``,
writes a JSON error file, puts ``{"error": text}`` on ``queue`` and sets ``stop_event``, then
lets the exception propagate. Every step is best effort: one that fails prints a one-line
warning and the next steps still run, and the original exception is the one that propagates.

The guard's ``label`` names the worker everywhere the failure is reported: in the banner, in
the error file, in the parent's revived exception (its :class:`~framepipe.remote.RemoteTraceback`
says ``Traceback from loader process 4242``) and in the parent's ``WriterDied`` when the worker
dies inside the guard (``loader 4242 was killed by signal SIGSEGV``).

While the body runs, faulthandler is armed (all threads) to the file :func:`fault_path` names
for this process, so when the worker dies in native code (SIGSEGV, SIGBUS, SIGFPE, SIGABRT,
SIGILL) the parent reads the native traceback with :func:`read_native_traceback` and shows it
in its ``WriterDied``, while the dying process copies the same dump to its own stderr (fd 2),
as a plain ``faulthandler.enable()`` would show it (see :mod:`framepipe._faults` for how). The
file is removed when the outermost guard exits normally.

:func:`record` is torchelastic's ``@record`` and :class:`ProcessFailure` reads the error files
both write back.

This module is also callable: ``framepipe.guard`` is this module (``import framepipe.guard``
and ``from framepipe.guard import fault_path`` work as for any module), and calling it,
``framepipe.guard(conn)`` or ``@framepipe.guard``, calls :func:`guard`.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import inspect
import json
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import Any, Literal, Protocol, TypeVar, overload

from ._faults import FaultHandler, fault_path, read_native_traceback, warn
from ._liveness import start_time
from .errors import signal_name as _signal_name
from .remote import (
    dumps_exception,
    exception_message,
    format_exception_text,
    origin,
    qualified_name,
    sender_label,
)

__all__ = [
    "ERROR_FILE_ENV",
    "Guard",
    "ProcessFailure",
    "fault_path",
    "guard",
    "read_native_traceback",
    "record",
    "write_error_file",
]

#: The environment variable torchelastic sets to the path of each worker's error file.
ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
_NOT_AVAILABLE = "<N/A>"

F = TypeVar("F", bound=Callable[..., Any])


class ErrorChannel(Protocol):
    """What ``conn`` may be: anything with ``send_bytes`` (a ``multiprocessing`` connection,
    which gets the :func:`~framepipe.remote.dumps_exception` bytes as one message); a framepipe
    ``Connection`` is used through its ``send_exception`` (an error frame) instead."""

    def send_bytes(self, buf: bytes, /) -> object: ...


class ErrorQueue(Protocol):
    """What ``queue`` may be: anything with ``put_nowait`` (``queue.Queue``,
    ``multiprocessing.Queue``, ...); it receives ``{"error": <formatted traceback>}``."""

    def put_nowait(self, item: dict[str, str], /) -> object: ...


class StopEvent(Protocol):
    """What ``stop_event`` may be: anything with ``set()`` (``threading.Event``,
    ``multiprocessing.Event``, ``asyncio.Event`` from its loop's thread, ...)."""

    def set(self) -> object: ...


# --- native crash hand-off ------------------------------------------------------------------

_fault_handler = FaultHandler()
_own_start: tuple[int, float | None] | None = None


def _start_of_this_process() -> float | None:
    """This process's start time (read once per process), written into its fault file so a
    watcher never takes the file of an earlier process with the same pid for this one's."""
    global _own_start
    pid = os.getpid()
    if _own_start is None or _own_start[0] != pid:
        _own_start = (pid, start_time(pid))
    return _own_start[1]


# --- error files ----------------------------------------------------------------------------


def _exit_reason(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "keyboard_interrupt"
    if isinstance(exc, SystemExit):
        return "system_exit"
    return "exception"


def write_error_file(
    path: str | os.PathLike[str], exc: BaseException, *, label: str = "worker"
) -> None:
    """Write the error file of ``exc`` at ``path`` (atomically: readers never see half of it).

    The JSON is torchelastic's (``{"message": {"message": ..., "extraInfo": {"py_callstack":
    ..., "timestamp": ...}}}``), so its agents and :class:`ProcessFailure` read it, plus a
    ``"framepipe"`` object with ``pid``, ``host``, ``process_name``, ``label``,
    ``exit_reason`` (``"exception"``, ``"keyboard_interrupt"`` or ``"system_exit"``),
    ``exception_type`` and ``timestamp_ns``.
    """
    now = time.time_ns()
    here = origin()
    data = {
        "message": {
            "message": f"{type(exc).__name__}: {exception_message(exc)}",
            "extraInfo": {
                "py_callstack": format_exception_text(exc),
                "timestamp": str(now // 1_000_000_000),
            },
        },
        "framepipe": {
            "pid": here["pid"],
            "host": here["host"],
            "process_name": here["name"],
            "label": label,
            "exit_reason": _exit_reason(exc),
            "exception_type": qualified_name(type(exc)),
            "timestamp_ns": now,
        },
    }
    _write_json(os.fspath(path), data)


def _write_json(path: str, data: Any) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fd, temp = tempfile.mkstemp(prefix=".error-", suffix=".json", dir=directory)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as file:
            json.dump(data, file)
        os.replace(temp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(temp)
        raise


# --- the guard ------------------------------------------------------------------------------


class Guard(contextlib.ContextDecorator):
    """The context manager (and decorator) :func:`guard` returns."""

    conn: ErrorChannel | None
    label: str
    error_file: str | os.PathLike[str] | None
    queue: ErrorQueue | None
    stop_event: StopEvent | None

    def __init__(
        self,
        conn: ErrorChannel | None = None,
        *,
        label: str = "worker",
        error_file: str | os.PathLike[str] | None = None,
        queue: ErrorQueue | None = None,
        stop_event: StopEvent | None = None,
    ) -> None:
        if not isinstance(label, str):
            raise TypeError(f"label must be a str naming the worker, not {type(label).__name__}")
        self.conn = conn
        self.label = label
        self.error_file = error_file
        self.queue = queue
        self.stop_event = stop_event

    def __enter__(self) -> Guard:  # noqa: PYI034 (typing.Self needs Python 3.11)
        _fault_handler.arm(self.label, _start_of_this_process())
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> Literal[False]:
        try:
            if exc is not None and self.reports(exc):
                self.report(exc)
        finally:
            _fault_handler.disarm()
        return False  # the exception propagates

    def reports(self, exc: BaseException) -> bool:
        """Whether ``exc`` is a failure to report: anything but ``SystemExit`` with code 0
        (or None) and ``GeneratorExit``."""
        if isinstance(exc, SystemExit):
            return exc.code not in (0, None)
        return not isinstance(exc, GeneratorExit)

    def report(self, exc: BaseException) -> None:
        """Run every reporting step for ``exc``; never raises. Exceptions serialized meanwhile
        (the one sent through ``conn``) carry this guard's label (see
        :func:`~framepipe.remote.sender_label`)."""
        with sender_label(self.label):
            text = format_exception_text(exc)
            self._step("print the crash banner", self._print_banner, text)
            self._step("send the exception through conn", self.send, exc)
            self._step("write the error file", self._write_error_file, exc)
            self._step("put the error on the queue", self._put, text)
            self._step("set the stop event", self._set_stop)

    def _step(self, what: str, action: Callable[..., None], *args: object) -> None:
        try:
            action(*args)
        except Exception as err:
            warn(f"framepipe.guard ({self.label}): could not {what}: {type(err).__name__}: {err}")

    def _print_banner(self, text: str) -> None:
        here = origin()
        rule = "=" * 72
        stream = sys.stderr if sys.stderr is not None else sys.__stderr__
        if stream is None:
            return
        print(
            f"\n{rule}\n[{self.label.upper()} CRASH] pid {here['pid']} ({here['name']}) "
            f"on {here['host']}\n{text.rstrip()}\n{rule}\n",
            file=stream,
            flush=True,
        )

    def send(self, exc: BaseException) -> None:
        """Send ``exc`` through ``conn``: an error frame through a framepipe Connection
        (``conn.send_exception``), else the :func:`~framepipe.remote.dumps_exception` bytes as
        one message (``conn.send_bytes``) for a ``multiprocessing`` connection, whose reader
        revives them with ``loads_exception(conn.recv_bytes())``."""
        if self.conn is None:
            return
        send_exception = getattr(self.conn, "send_exception", None)
        if send_exception is not None:
            send_exception(exc)
        else:
            self.conn.send_bytes(dumps_exception(exc, label=self.label))

    def _write_error_file(self, exc: BaseException) -> None:
        path = self.error_file if self.error_file is not None else os.environ.get(ERROR_FILE_ENV)
        if path:
            write_error_file(path, exc, label=self.label)

    def _put(self, text: str) -> None:
        if self.queue is not None:
            self.queue.put_nowait({"error": text})

    def _set_stop(self) -> None:
        if self.stop_event is not None:
            self.stop_event.set()


@overload
def guard(conn: F, /) -> F: ...


@overload
def guard(
    conn: ErrorChannel | None = None,
    *,
    label: str = "worker",
    error_file: str | os.PathLike[str] | None = None,
    queue: ErrorQueue | None = None,
    stop_event: StopEvent | None = None,
) -> Guard: ...


def guard(
    conn: ErrorChannel | Callable[..., Any] | None = None,
    *,
    label: str = "worker",
    error_file: str | os.PathLike[str] | None = None,
    queue: ErrorQueue | None = None,
    stop_event: StopEvent | None = None,
) -> Guard | Callable[..., Any]:
    """Guard a worker's body: on an exception, make sure the parent hears of it, then re-raise.

    Use it as ``with guard(conn): ...``, as ``@guard(conn)`` or as a bare ``@guard``. On an
    exception (any but ``SystemExit(0)`` and ``GeneratorExit``), in this order and each step
    best effort:

    1. print a crash banner with the traceback to stderr;
    2. send the exception through ``conn``: an error frame with a framepipe Connection (the
       parent's ``recv()`` raises the revived exception), or the
       :func:`~framepipe.remote.dumps_exception` bytes as one message with a
       ``multiprocessing`` connection (read them with ``loads_exception(conn.recv_bytes())``);
    3. write the error file (see :func:`write_error_file`) at ``error_file``, or at
       ``$TORCHELASTIC_ERROR_FILE`` when it is None;
    4. ``queue.put_nowait({"error": text})`` with the formatted traceback;
    5. ``stop_event.set()``.

    While the body runs, faulthandler dumps native crashes to :func:`fault_path` (for the
    parent) and the dump is copied to this process's stderr.
    """
    if inspect.isroutine(conn):
        return Guard()(conn)
    channel: ErrorChannel | None = conn  # type: ignore[assignment]  # not a routine: a channel
    return Guard(channel, label=label, error_file=error_file, queue=queue, stop_event=stop_event)


# --- torchelastic's @record and ProcessFailure ----------------------------------------------


def _dump_root_cause(exc: BaseException, error_file: str | None) -> bool:
    """For an error that names a child's failure (torchelastic's ``ChildFailedError``: a
    ``get_first_failure()`` returning ``(rank, failure)``), copy the child's error file into
    ours, with its exit code as ``errorCode``. Returns whether it was such an error."""
    first = getattr(exc, "get_first_failure", None)
    if not callable(first):
        return False
    _, failure = first()
    source = getattr(failure, "error_file", _NOT_AVAILABLE)
    if source == _NOT_AVAILABLE or not error_file:
        return True
    with open(source, encoding="utf-8") as file:
        data = json.load(file)
    exitcode = getattr(failure, "exitcode", 0)
    message = data.get("message") if isinstance(data, dict) else None
    if exitcode and isinstance(message, dict) and "errorCode" not in message:
        message["errorCode"] = exitcode
    with contextlib.suppress(FileNotFoundError):
        os.remove(error_file)
    _write_json(error_file, data)
    return True


@overload
def record(fn: F, /) -> F: ...


@overload
def record(fn: None = None, *, error_file: str | None = None) -> Callable[[F], F]: ...


def record(fn: F | None = None, *, error_file: str | None = None) -> F | Callable[[F], F]:
    """torchelastic's ``@record``: write the entry point's uncaught exception to an error file.

    Semantics as torchelastic's: faulthandler is enabled (to stderr, unless a guard already
    armed it); ``SystemExit`` with code 0 returns None (a ``runpy`` entry point that exits 0
    succeeds); another ``SystemExit`` and ``KeyboardInterrupt`` propagate unrecorded; an error
    naming a child's failure copies that child's error file; any other ``Exception`` is
    written with :func:`write_error_file` at ``error_file`` or ``$TORCHELASTIC_ERROR_FILE``
    (nothing is written when neither is set) and re-raised. Use ``@record`` or
    ``@record(error_file=...)``.
    """

    def wrap(f: F) -> F:
        @functools.wraps(f)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with contextlib.suppress(Exception):
                if not faulthandler.is_enabled():
                    faulthandler.enable(all_threads=True)
            try:
                return f(*args, **kwargs)
            except SystemExit as exc:
                if exc.code == 0:
                    return None
                raise
            except Exception as exc:
                path = error_file if error_file is not None else os.environ.get(ERROR_FILE_ENV)
                try:
                    if not _dump_root_cause(exc, path) and path:
                        write_error_file(path, exc, label=getattr(f, "__name__", "worker"))
                except Exception as err:
                    warn(f"framepipe.record: could not write the error file: {err!r}")
                raise

        return wrapper  # type: ignore[return-value]

    return wrap(fn) if fn is not None else wrap


@dataclass
class ProcessFailure:
    """A failed worker, read back from its error file (torchelastic's ``ProcessFailure``).

    ``message`` is the error file's ``"message"`` (the dict :func:`write_error_file` and
    torchelastic write, or a string), or one made from the exit code when there is no error
    file; ``timestamp`` is seconds since the epoch (the file's, else now) and ``error_file``
    is ``"<N/A>"`` when there is none. An error file that cannot be parsed is reported in
    ``message`` rather than raised. framepipe's own fields are properties: ``py_callstack``,
    ``host``, ``exit_reason``, ``timestamp_ns`` and ``error_code``.
    """

    local_rank: int
    pid: int
    exitcode: int
    error_file: str
    error_file_data: dict[str, Any] = field(init=False)  # parsed JSON
    message: str | dict[str, Any] = field(init=False)
    timestamp: int = field(init=False)

    def __post_init__(self) -> None:
        self.error_file_data = {"message": "<NONE>"}
        self.message = ""
        self.timestamp = int(time.time())
        if self.error_file and os.path.isfile(self.error_file):
            self._read()
        else:
            self.error_file = _NOT_AVAILABLE
        if not self.message:
            if self.exitcode < 0:
                self.message = (
                    f"process {self.pid} was killed by signal {self.signal_name()} "
                    f"({-self.exitcode})"
                )
            else:
                self.message = (
                    f"process {self.pid} exited with code {self.exitcode} and left no error "
                    "file (run its entry point under framepipe.record or framepipe.guard)"
                )

    def _read(self) -> None:
        try:
            with open(self.error_file, encoding="utf-8") as file:
                data = json.load(file)
            message = data["message"]
            if isinstance(message, str):
                timestamp = int(data.get("timestamp", 0))
            elif isinstance(message, dict):
                timestamp = int(message["extraInfo"]["timestamp"])
            else:
                raise ValueError(f'"message" is a {type(message).__name__}, not a str or object')
        except Exception as err:
            self.message = f"<error file {self.error_file} could not be read: {err!r}>"
            with contextlib.suppress(OSError):
                self.timestamp = int(os.path.getmtime(self.error_file))
            return
        self.error_file_data, self.message, self.timestamp = data, message, timestamp

    def signal_name(self) -> str:
        """``SIGSEGV`` for a worker killed by a signal, ``"<N/A>"`` otherwise."""
        return _signal_name(-self.exitcode) if self.exitcode < 0 else _NOT_AVAILABLE

    def timestamp_isoformat(self) -> str:
        """The timestamp as ``YYYY-MM-DD_HH:MM:SS``."""
        return datetime.fromtimestamp(self.timestamp).isoformat(sep="_")

    def _extra(self, key: str) -> object:
        extra = self.error_file_data.get("framepipe")
        return extra.get(key) if isinstance(extra, dict) else None

    @property
    def py_callstack(self) -> str | None:
        """The worker's formatted traceback, when its error file has one."""
        if isinstance(self.message, dict):
            stack = self.message.get("extraInfo", {}).get("py_callstack")
            return stack if isinstance(stack, str) else None
        return None

    @property
    def error_code(self) -> int | None:
        """The ``errorCode`` a parent recorded into the message, if any."""
        code = self.message.get("errorCode") if isinstance(self.message, dict) else None
        return code if isinstance(code, int) else None

    @property
    def host(self) -> str | None:
        """The host the worker ran on (framepipe's error files only)."""
        host = self._extra("host")
        return host if isinstance(host, str) else None

    @property
    def exit_reason(self) -> str | None:
        """``"exception"``, ``"keyboard_interrupt"`` or ``"system_exit"`` (framepipe's only)."""
        reason = self._extra("exit_reason")
        return reason if isinstance(reason, str) else None

    @property
    def timestamp_ns(self) -> int | None:
        """When the error was recorded, in nanoseconds since the epoch (framepipe's only)."""
        stamp = self._extra("timestamp_ns")
        return stamp if isinstance(stamp, int) and not isinstance(stamp, bool) else None


# --- the module is callable -----------------------------------------------------------------


class _CallableModule(types.ModuleType):
    """This module's class: calling the module calls :func:`guard`, so ``framepipe.guard`` can
    be the module (``import framepipe.guard`` gives it, not a function hiding it) and still
    be called as it always was (``with framepipe.guard(conn): ...``, ``@framepipe.guard``)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Guard | Callable[..., Any]:
        result: Guard | Callable[..., Any] = guard(*args, **kwargs)
        return result


__signature__ = inspect.signature(guard)  # what inspect.signature(framepipe.guard) reports
sys.modules[__name__].__class__ = _CallableModule
