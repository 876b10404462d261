"""The reference ``subprocess_rpc`` module (pytorch/benchmark's worker protocol) over framepipe.

Code that imports the reference module migrates by importing this one instead (or
``from framepipe.compat import *``): every public name is here with its signature, its
constants and its protocol, so a parent written against the reference drives a worker running
this module, and the other way round for the bytes on the wire.

What changes is what the reference got wrong:

- :class:`Pipe` moves messages of any size (the reference assumed one ``os.read`` returns a
  whole message) and sees a writer's death when it happens, not a second later.
- Errors keep the reference's messages, which callers parse: a read past its timeout runs
  ``timeout_callback()`` and raises ``"Exceeded timeout: {timeout}"``; a writer that dies
  raises ``"Subprocess terminates with code {code}"`` (the absolute value of its exit code, or
  of the number of the signal that killed it). A writer that exits with code 0 while the reader
  waits goes through the timeout path, as the reference's callers expect. The exceptions raised
  are framepipe's :class:`~framepipe.ReadTimeout` and :class:`~framepipe.WriterDied` (both
  ``OSError``), so code that knows those keeps the pid, the exit code and the signal name.
- :func:`run_loop` stops when its parent goes away (the reference spun forever), and a snippet
  that sends a large value through the load pipe cannot deadlock against a parent that is still
  waiting for the snippet's result.
- :class:`SerializedException` carries any exception whole (its own class, args, attributes,
  cause chain and traceback frames) where the reference kept builtins only. ``SystemExit`` and
  ``KeyboardInterrupt`` from a worker, and anything that is not an exception, arrive as
  :class:`UnserializableException`: re-raised as themselves they would end the parent or look
  like a Ctrl-C in it.

Tracebacks of snippets run by the worker loop show ``<subprocess-worker>`` and this module's
path, ``.../framepipe/subprocess_rpc.py``, as the reference's did.
"""

from __future__ import annotations

import dataclasses
import datetime
import io
import marshal
import os
import pickle
import queue
import sys
import threading
import types
from typing import Any, NoReturn

from . import _impl
from ._pipes import USE_DEFAULT
from .errors import ReadTimeout, WriterDied
from .remote import RemoteError, RemoteTraceback, _chain_end, dumps_exception, format_exception_text
from .remote import revive as _revive_payload

__all__ = [
    "BOOTSTRAP_IMPORT_SUCCESS",
    "BOOTSTRAP_INPUT_LOOP_SUCCESS",
    "ChildTraceException",
    "EMPTY_RESULT",
    "ENCODING",
    "ExceptionUnpickler",
    "HARD_EXIT",
    "IS_WINDOWS",
    "Pipe",
    "SUCCESS",
    "SUCCESS_BYTES",
    "SerializedException",
    "UnserializableException",
    "WORKER_IMPL_NAMESPACE",
    "_log_progress",
    "_run_block",
    "from_handle",
    "hardened_repr",
    "raise_from",
    "run_loop",
    "to_handle",
]

# -- the protocol's constants (the same values as the reference's) ----------------------------

BOOTSTRAP_IMPORT_SUCCESS = b"BOOTSTRAP_IMPORT_SUCCESS"
BOOTSTRAP_INPUT_LOOP_SUCCESS = b"BOOTSTRAP_INPUT_LOOP_SUCCESS"
WORKER_IMPL_NAMESPACE = "__worker_impl_namespace"
ENCODING = "utf-8"
SUCCESS = "SUCCESS"
# A snippet that ends the worker at once: os._exit cannot be caught, unlike SystemExit.
HARD_EXIT = "import os\nos._exit(0)".encode(ENCODING)
EMPTY_RESULT = marshal.dumps({})
SUCCESS_BYTES = marshal.dumps(SUCCESS)
IS_WINDOWS = sys.platform == "win32"


def to_handle(fd: int | None) -> int | None:
    """The handle to give a child for ``fd``: on POSIX the fd itself (children inherit fds)."""
    return fd


def from_handle(handle: int | None, mode: int | None = None) -> int | None:
    """The fd for a ``handle`` given by the parent: on POSIX the handle itself."""
    return handle


# -- Pipe -------------------------------------------------------------------------------------


class _ExitedWhileReading(WriterDied, ReadTimeout):
    """The writer exited with code 0 while a read waited: reported through the timeout path
    (what the reference's callers catch) and still a WriterDied with the writer's details."""


def _reference_error(exc: BaseException, message: str) -> BaseException:
    """``exc`` with the reference's message (its class and attributes unchanged)."""
    exc.args = (message,)
    return exc


def _pipe_class(base: type) -> type:
    """The reference Pipe over one core's :class:`framepipe.Pipe` (``base``)."""

    class Pipe(base):  # type: ignore[misc]
        """A one-way framed pipe with the reference ``subprocess_rpc.Pipe``'s interface.

        ``Pipe()`` owns a new ``os.pipe()`` (closed once, by :meth:`_close_fds`, which callers
        may override); ``Pipe(read_handle=..., write_handle=...)`` uses given fds and never
        closes them. ``read_fd``/``write_fd`` and ``read_handle``/``write_handle`` are the fds
        (the same numbers on POSIX), None for a missing end. ``writer_pid`` (or
        :meth:`set_writer_pid`) watches the writer: its death ends a read at once.
        """

        def read(self, timeout: float | None = USE_DEFAULT) -> bytes:
            """The next message, with the reference's errors (see the module)."""
            if timeout is USE_DEFAULT:
                timeout = self.timeout
            try:
                return super().read(timeout)  # type: ignore[no-any-return]
            except WriterDied as exc:
                code = exc.exitcode
                if code == 0:
                    self.timeout_callback()
                    clean = _ExitedWhileReading(
                        exc.pid,
                        0,
                        lost_bytes=exc.lost_bytes,
                        expected_bytes=exc.expected_bytes,
                        details=exc._resolve,  # its label and diagnostics, read when looked at
                    )
                    raise _reference_error(clean, f"Exceeded timeout: {timeout}") from None
                shown = "unknown" if code is None else abs(code)
                raise _reference_error(exc, f"Subprocess terminates with code {shown}") from None
            except ReadTimeout as exc:  # the base ran timeout_callback() already
                raise _reference_error(exc, f"Exceeded timeout: {timeout}") from None

        def _close_fds(self) -> None:
            """Close both fds of an owned pipe. Called once, by :meth:`close` or when the Pipe
            is collected; override it to change what happens to the fds."""
            for conn in (self._reader, self._writer):
                if conn is not None:
                    conn.close()

        def close(self) -> None:
            """Close the fds if this Pipe owns them (through :meth:`_close_fds`, once)."""
            if getattr(self, "_closed", True):
                return
            self._closed = True
            if self._owns_pipe:
                self._close_fds()
            else:
                super().close()  # borrowed fds stay open; only private state is released

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._closed = False

    Pipe.__module__ = __name__
    return Pipe


_PIPES: dict[str, type] = {}


def _pipe_for(core: Any) -> type:
    """The reference Pipe over ``core`` (a framepipe core module), made once per core."""
    name = core.__name__
    if name not in _PIPES:
        _PIPES[name] = _pipe_class(core.Pipe)
    return _PIPES[name]


Pipe = _pipe_for(_impl.core)


# -- exceptions -------------------------------------------------------------------------------


def hardened_repr(o: Any) -> str:
    """``repr(o)``, or ``"< Unknown >"`` when that raises (a ``__repr__`` may run any code)."""
    try:
        return repr(o)
    except Exception:
        return "< Unknown >"


class UnserializableException(RemoteError, Exception):
    """An exception that could not be revived as itself in this process.

    It stands for a class the parent cannot import (it is then also an instance of the nearest
    base of that class that could be revived, see :class:`framepipe.RemoteError`), for a
    ``SystemExit`` or ``KeyboardInterrupt`` raised in a worker, and for anything recorded that
    was not an exception. ``type_repr`` reads like ``"<class 'module.Name'>"`` and
    ``args_repr`` is the ``repr`` of the remote args.
    """

    def __init__(self, type_repr: str, args_repr: str) -> None:
        super().__init__(type_repr, args_repr)
        self.remote_type = type_repr
        self.remote_args = args_repr

    @property
    def type_repr(self) -> str:
        name = self.remote_type
        return name if name.startswith("<") else f"<class '{name}'>"

    @property
    def args_repr(self) -> str:
        return self.remote_args


class ChildTraceException(RemoteTraceback):
    """The worker's formatted traceback, at the end of a revived exception's cause chain."""


class ExceptionUnpickler(pickle.Unpickler):
    """Loads a pickled exception *class* and resolves nothing but ``builtins`` (what a reference
    worker sends in ``_type_bytes``)."""

    @classmethod
    def load_bytes(cls, data: bytes) -> type[Exception]:
        """The builtin exception class pickled in ``data``; ``UnpicklingError`` for anything
        else (another module, an instance, a class that is not an exception)."""
        result = cls(io.BytesIO(data)).load()
        if not isinstance(result, type) or not issubclass(result, Exception):
            raise pickle.UnpicklingError(f"{result!r} is not an Exception class")
        return result

    def find_class(self, module: str, name: str) -> Any:
        if module != "builtins":
            raise pickle.UnpicklingError(
                f"refusing {module}.{name}: only builtin exception classes are loaded here"
            )
        return super().find_class(module, name)


def _builtin_form(e: BaseException) -> tuple[bytes, bytes] | None:
    """``(type_bytes, args_bytes)`` in the reference's form (a pickled builtin class, marshal'd
    args) when ``e`` can be rebuilt that way on the other side, else None."""
    try:
        args_bytes = marshal.dumps(e.args)
        type_bytes = pickle.dumps(type(e))
        ExceptionUnpickler.load_bytes(type_bytes)(*marshal.loads(args_bytes))
    except Exception:
        return None
    return type_bytes, args_bytes


@dataclasses.dataclass(init=True, frozen=True)
class SerializedException:
    """An exception and its traceback as data.

    ``dataclasses.asdict`` of it holds only bools, bytes and strings, so ``marshal`` carries it
    as the worker loop does. The first six fields are the reference's, filled the reference's
    way, so a dict from a reference worker is accepted too; ``_payload`` carries the whole
    exception (:func:`framepipe.dumps_exception`), empty when it must not be revived as itself.
    """

    _is_serializable: bool
    _type_bytes: bytes
    _args_bytes: bytes
    _type_repr: str
    _args_repr: str
    _traceback_print: str
    _payload: bytes = b""

    @staticmethod
    def from_exception(
        e: BaseException | None, tb: types.TracebackType | None = None
    ) -> SerializedException:
        """Record ``e`` with traceback ``tb`` (``e``'s own when None); never raises.

        Anything that is not an ``Exception`` (``None``, ``SystemExit``, ``KeyboardInterrupt``,
        ``GeneratorExit``) is recorded as unserializable: the other side raises an
        :class:`UnserializableException` naming it."""
        try:
            if isinstance(e, BaseException) and tb is not None and e.__traceback__ is not tb:
                e = e.with_traceback(tb)
            text = (
                format_exception_text(e)
                if isinstance(e, BaseException)
                else f"{type(e).__name__}: {hardened_repr(e)} (not an exception)\n"
            )
        except Exception:
            text = "Traceback\nFailed to extract the traceback from the worker.\n"
        revivable = isinstance(e, Exception)
        builtin = _builtin_form(e) if revivable else None  # type: ignore[arg-type]
        return SerializedException(
            _is_serializable=builtin is not None,
            _type_bytes=b"" if builtin is None else builtin[0],
            _args_bytes=b"" if builtin is None else builtin[1],
            _type_repr=hardened_repr(type(e)),
            _args_repr=hardened_repr(getattr(e, "args", None)),
            _traceback_print=text,
            _payload=dumps_exception(e) if revivable else b"",  # type: ignore[arg-type]
        )

    @staticmethod
    def raise_from(serialized_e: SerializedException, extra_context: str | None = None) -> NoReturn:
        """Revive and raise: the recorded exception as its own class where possible, else an
        :class:`UnserializableException`; the cause chain ends in a
        :class:`ChildTraceException` holding the worker's traceback text (with
        ``extra_context`` appended)."""
        if serialized_e._payload:
            raise _revive(serialized_e._payload, extra_context)
        exc: BaseException
        if serialized_e._is_serializable:
            try:
                exc = ExceptionUnpickler.load_bytes(serialized_e._type_bytes)(
                    *marshal.loads(serialized_e._args_bytes)
                )
            except Exception:
                exc = UnserializableException(serialized_e._type_repr, serialized_e._args_repr)
        else:
            exc = UnserializableException(serialized_e._type_repr, serialized_e._args_repr)
        text = serialized_e._traceback_print
        if extra_context:
            text = f"{text.rstrip()}\n{extra_context}"
        raise exc from ChildTraceException(text)


raise_from = SerializedException.raise_from


def _revive(payload: bytes, extra_context: str | None = None) -> BaseException:
    exc = _revive_payload(payload, marker=UnserializableException, trace=ChildTraceException)
    trace = _chain_end(exc)
    if extra_context and isinstance(trace, ChildTraceException):
        trace.text = f"{trace.text.rstrip()}\n{extra_context}"
        trace.args = (trace.text, *trace.args[1:])
    return exc


# -- the worker loop --------------------------------------------------------------------------


def _log_progress(suffix: str) -> None:
    """Print a timestamped ``TIMER_SUBPROCESS_<suffix>`` line (the worker's progress log)."""
    now = datetime.datetime.now().strftime("[%Y-%m-%d] %H:%M:%S.%f")
    print(f"{now}: TIMER_SUBPROCESS_{suffix}")


class _InputClosed(BaseException):
    """Internal: the parent is gone (end of file, or its death, on the input pipe)."""


def _run_block(*, input_pipe: Any, output_pipe: Any, globals_dict: dict[str, Any]) -> None:
    """Read one snippet, run it in ``globals_dict`` and write its result: ``SUCCESS_BYTES``,
    or the marshal'd ``dataclasses.asdict`` of a :class:`SerializedException`. Raises
    :class:`_InputClosed` (and writes nothing) when the input ends, or the result cannot be
    written because the parent is gone."""
    result = EMPTY_RESULT
    closed = False
    try:
        _log_progress("BEGIN_READ")
        try:
            cmd = input_pipe.read().decode(ENCODING)
        except EOFError as exc:  # WriterDied included: the parent is gone
            closed = True
            raise _InputClosed from exc
        _log_progress("BEGIN_EXEC")
        exec(compile(cmd, "<subprocess-worker>", "exec"), globals_dict)  # noqa: S102
        _log_progress("SUCCESS")
        result = SUCCESS_BYTES
    except (Exception, KeyboardInterrupt, SystemExit) as e:
        serialized = SerializedException.from_exception(e, e.__traceback__)
        result = marshal.dumps(dataclasses.asdict(serialized))
        _log_progress("FAILED")
    finally:
        try:
            if not closed:
                try:
                    output_pipe.write(result)
                except OSError as exc:  # the parent died while the snippet ran
                    raise _InputClosed from exc
                _log_progress("FINISHED")
        finally:
            sys.stdout.flush()
            sys.stderr.flush()


class _QueuedWriter:
    """A Pipe's ``write()`` that never blocks the snippet: messages are written in order by a
    background thread. A snippet writes the load pipe before the worker writes its result, while
    the parent reads the result first; written inline, a value larger than the pipe's buffer
    would block the worker and the parent forever."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe
        self._queue: queue.SimpleQueue[bytes] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def write(self, msg: bytes) -> None:
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._drain, name="subprocess_rpc-load-pipe", daemon=True
            )
            self._thread.start()
        self._queue.put(msg)

    def _drain(self) -> None:
        while True:
            msg = self._queue.get()
            try:
                self._pipe.write(msg)
            except OSError:
                return  # the parent is gone

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


def _watch_parent(input_pipe: Any) -> None:
    """Make the parent's death end the input read at once, even where another process still
    holds the input's write end."""
    reader = getattr(input_pipe, "_reader", None)
    ppid = os.getppid()
    if reader is None or ppid <= 1:
        return
    try:
        reader.watch(ppid)
    except (OSError, ValueError):
        pass  # not watchable here: the end of file still stops the loop


def run_loop(
    input_pipe: Any = None,
    output_pipe: Any = None,
    *,
    input_handle: int | None = None,
    load_handle: int | None = None,
    load_pipe: Any = None,
) -> None:
    """The worker: read snippets from the input, run each, write its result, until the parent
    goes away (then return).

    The reference's call, ``run_loop(input_handle=fd, output_pipe=pipe, load_handle=fd)``, works
    as it did; ``input_pipe``/``load_pipe`` take Pipes instead of fds. Snippets run in one
    globals dict holding ``WORKER_IMPL_NAMESPACE``: ``{"subprocess_rpc": this module,
    "marshal": marshal, "load_pipe": the load pipe}``. ``BOOTSTRAP_INPUT_LOOP_SUCCESS`` is
    written to the output first.
    """
    if output_pipe is None:
        raise TypeError("run_loop() needs output_pipe= (a Pipe the worker writes results to)")
    if input_pipe is None:
        if input_handle is None:
            raise TypeError("run_loop() needs input_handle= (an fd) or input_pipe= (a Pipe)")
        input_pipe = Pipe(read_handle=input_handle)
    if load_pipe is None and load_handle is not None:
        load_pipe = Pipe(write_handle=load_handle)
    _watch_parent(input_pipe)
    globals_dict: dict[str, Any] = {
        WORKER_IMPL_NAMESPACE: {
            "subprocess_rpc": sys.modules[__name__],
            "marshal": marshal,
            "load_pipe": None if load_pipe is None else _QueuedWriter(load_pipe),
        }
    }
    output_pipe.write(BOOTSTRAP_INPUT_LOOP_SUCCESS)
    while True:
        try:
            _run_block(input_pipe=input_pipe, output_pipe=output_pipe, globals_dict=globals_dict)
        except _InputClosed:
            return
