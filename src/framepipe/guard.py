"""The guard: make sure the parent hears of a worker's failure, whatever else breaks.

:func:`guard` wraps a worker's body (as a context manager or a decorator). When the body raises,
it prints a crash banner with the traceback to stderr, sends the exception through ``conn``,
writes a JSON error file, puts ``{"error": text}`` on ``queue`` and sets ``stop_event``, then
lets the exception propagate. Every step is best effort: one that fails prints a one-line
warning and the next steps still run, and the original exception is the one that propagates.

While the body runs, faulthandler is armed (all threads) to the file :func:`fault_path` names
for this process, so when the worker dies in native code (SIGSEGV, SIGBUS, SIGFPE, SIGABRT,
SIGILL) the parent reads the native traceback with :func:`read_native_traceback` and shows it
in its ``WriterDied``. The file is removed when the outermost guard exits normally.

:func:`record` is torchelastic's ``@record`` and :class:`ProcessFailure` reads the error files
both write back.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import inspect
import json
import os
import stat
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from types import TracebackType
from typing import IO, Any, Literal, TypeVar, overload

from .errors import signal_name as _signal_name
from .remote import (
    dumps_exception,
    exception_message,
    format_exception_text,
    origin,
    qualified_name,
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


def _warn(message: str) -> None:
    stream = sys.stderr if sys.stderr is not None else sys.__stderr__
    try:
        if stream is not None:
            print(message, file=stream, flush=True)
    except Exception:
        pass


# --- native crash hand-off ------------------------------------------------------------------


def _fault_dir() -> str:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(tempfile.gettempdir(), f"framepipe-faults-{uid}")


def fault_path(pid: int) -> str:
    """The file a guarded worker with this pid dumps its native traceback into."""
    return os.path.join(_fault_dir(), f"{int(pid)}.txt")


def _private_dir(create: bool) -> bool:
    """Whether the fault directory exists (created if asked) as a real directory that only
    this user can write: a directory planted by someone else is never trusted."""
    path = _fault_dir()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    owner_ok = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return stat.S_ISDIR(st.st_mode) and owner_ok and not st.st_mode & 0o022


def read_native_traceback(pid: int) -> str | None:
    """The native traceback a guarded worker wrote as it crashed, or None.

    Returns the text when the worker's fault file exists and is not empty, and removes the
    file either way. The parent calls it for a worker that died of a fatal signal.
    """
    if not _private_dir(create=False):
        return None
    path = fault_path(pid)
    try:
        with open(path, encoding="utf-8", errors="replace") as file:
            text = file.read()
    except OSError:
        return None
    with contextlib.suppress(OSError):
        os.remove(path)
    return text if text.strip() else None


class _FaultHandler:
    """Process-wide: arm faulthandler to this process's fault file while any guard is open."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._depth = 0
        self._file: IO[str] | None = None
        self._was_enabled = False

    def arm(self) -> None:
        with self._lock:
            pid = os.getpid()
            if self._pid != pid:  # a fresh process, or a fork child: the file is not ours
                self._pid, self._depth, self._file = pid, 0, None
            self._depth += 1
            if self._depth > 1 or not _private_dir(create=True):
                return
            try:
                # kept open while armed: faulthandler writes to its descriptor at a crash
                self._file = open(fault_path(pid), "w", encoding="utf-8")  # noqa: SIM115
                self._was_enabled = faulthandler.is_enabled()
                faulthandler.enable(file=self._file, all_threads=True)
            except Exception as err:
                _warn(f"framepipe.guard: could not arm faulthandler: {type(err).__name__}: {err}")

    def disarm(self) -> None:
        with self._lock:
            if self._pid != os.getpid() or self._depth == 0:
                return
            self._depth -= 1
            if self._depth or self._file is None:
                return
            file, self._file = self._file, None
            try:
                faulthandler.disable()
                if self._was_enabled and sys.__stderr__ is not None:
                    faulthandler.enable(file=sys.__stderr__, all_threads=True)
            except Exception:
                pass
            with contextlib.suppress(OSError):
                empty = os.fstat(file.fileno()).st_size == 0
                file.close()
                if empty:
                    os.remove(fault_path(os.getpid()))


_fault_handler = _FaultHandler()


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

    def __init__(
        self,
        conn: Any = None,
        *,
        label: str = "worker",
        error_file: str | os.PathLike[str] | None = None,
        queue: Any = None,
        stop_event: Any = None,
    ) -> None:
        self.conn = conn
        self.label = label
        self.error_file = error_file
        self.queue = queue
        self.stop_event = stop_event

    def __enter__(self) -> Guard:  # noqa: PYI034 (typing.Self needs Python 3.11)
        _fault_handler.arm()
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
        """Run every reporting step for ``exc``; never raises."""
        text = format_exception_text(exc)
        self._step("print the crash banner", self._print_banner, text)
        self._step("send the exception through conn", self.send, exc)
        self._step("write the error file", self._write_error_file, exc)
        self._step("put the error on the queue", self._put, text)
        self._step("set the stop event", self._set_stop)

    def _step(self, what: str, action: Callable[..., None], *args: Any) -> None:
        try:
            action(*args)
        except Exception as err:
            _warn(f"framepipe.guard ({self.label}): could not {what}: {type(err).__name__}: {err}")

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
            self.conn.send_bytes(dumps_exception(exc))

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
def guard(conn: F) -> F: ...


@overload
def guard(
    conn: Any = None,
    *,
    label: str = "worker",
    error_file: str | os.PathLike[str] | None = None,
    queue: Any = None,
    stop_event: Any = None,
) -> Guard: ...


def guard(
    conn: Any = None,
    *,
    label: str = "worker",
    error_file: str | os.PathLike[str] | None = None,
    queue: Any = None,
    stop_event: Any = None,
) -> Any:
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

    While the body runs, faulthandler dumps native crashes to :func:`fault_path`.
    """
    if inspect.isroutine(conn):
        return Guard()(conn)
    return Guard(conn, label=label, error_file=error_file, queue=queue, stop_event=stop_event)


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


def record(fn: F | None = None, *, error_file: str | None = None) -> Any:
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
                    _warn(f"framepipe.record: could not write the error file: {err!r}")
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
    error_file_data: dict[str, Any] = field(init=False)
    message: Any = field(init=False)
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
            else:
                timestamp = int(message["extraInfo"]["timestamp"])
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

    def _extra(self, key: str) -> Any:
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
        return self._extra("host")  # type: ignore[no-any-return]

    @property
    def exit_reason(self) -> str | None:
        """``"exception"``, ``"keyboard_interrupt"`` or ``"system_exit"`` (framepipe's only)."""
        return self._extra("exit_reason")  # type: ignore[no-any-return]

    @property
    def timestamp_ns(self) -> int | None:
        """When the error was recorded, in nanoseconds since the epoch (framepipe's only)."""
        return self._extra("timestamp_ns")  # type: ignore[no-any-return]
