"""The reference names, over :mod:`framepipe.remote` and :mod:`framepipe.guard`.

Code written against the reference ``subprocess_rpc`` exception helpers or the reference
collector guard migrates by importing these names from here instead:

- ``SerializedException.from_exception(e, tb)`` / ``SerializedException.raise_from(se)``,
  ``UnserializableException`` and ``ChildTraceException``;
- ``ExceptionWrapper(where=...)`` with ``reraise()``, ``create_error_pipe()`` and
  ``collector_error_guard(...)``.

The signatures are the same; the behaviour is better where the reference lost information:
a custom exception revives as its own class with its args and attributes (the reference kept
builtins only, or called ``exc_type(msg)``, which fails for other signatures), a class the
parent cannot import becomes an ``UnserializableException`` that is still an instance of its
nearest importable base, and the revived exception keeps its cause, context, notes and
traceback frames. One difference: ``ExceptionWrapper.reraise()`` raises the original
exception (its own message, a note saying where it was caught) with the worker's traceback
in its cause chain, where the reference raised ``exc_type(<the traceback text>)``.
"""

from __future__ import annotations

import dataclasses
import sys
import types
from contextlib import AbstractContextManager
from typing import Any, NoReturn

from .guard import Guard
from .remote import (
    RemoteError,
    RemoteTraceback,
    _chain_end,
    dumps_exception,
    format_exception_text,
    qualified_name,
    revive,
)

__all__ = [
    "ChildTraceException",
    "ExceptionWrapper",
    "SerializedException",
    "UnserializableException",
    "collector_error_guard",
    "create_error_pipe",
]


class UnserializableException(RemoteError, Exception):
    """An exception whose class could not be revived in this process.

    Revived stand-ins are instances of this class *and* of the nearest base of the remote
    class that could be revived (see :class:`framepipe.RemoteError`). ``type_repr`` reads like
    ``"<class 'module.Name'>"`` and ``args_repr`` is the ``repr`` of the remote args.
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


@dataclasses.dataclass(init=True, frozen=True)
class SerializedException:
    """An exception and its traceback as data (``dataclasses.asdict`` gives bytes and strings,
    so ``marshal`` can carry it as the reference's worker loop does)."""

    _payload: bytes
    _type_repr: str
    _args_repr: str
    _traceback_print: str

    @staticmethod
    def from_exception(
        e: BaseException, tb: types.TracebackType | None = None
    ) -> SerializedException:
        """Record ``e`` (with traceback ``tb``, when it is not already ``e``'s); never raises."""
        if tb is not None and e.__traceback__ is not tb:
            e = e.with_traceback(tb)
        return SerializedException(
            _payload=dumps_exception(e),
            _type_repr=_hardened(repr, type(e)),
            _args_repr=_hardened(repr, getattr(e, "args", None)),
            _traceback_print=format_exception_text(e),
        )

    @staticmethod
    def raise_from(serialized_e: SerializedException, extra_context: str | None = None) -> NoReturn:
        """Revive and raise; the cause chain ends in a :class:`ChildTraceException` holding the
        worker's traceback text (with ``extra_context`` appended)."""
        raise _revive(serialized_e._payload, extra_context)


def _hardened(fn: Any, obj: Any) -> str:
    try:
        return str(fn(obj))
    except Exception:
        return "< Unknown >"


def _revive(payload: bytes, extra_context: str | None = None) -> BaseException:
    exc = revive(payload, marker=UnserializableException, trace=ChildTraceException)
    trace = _chain_end(exc)
    if extra_context and isinstance(trace, ChildTraceException):
        trace.text = f"{trace.text.rstrip()}\n{extra_context}"
        trace.args = (trace.text, *trace.args[1:])
    return exc


class ExceptionWrapper:
    """The exception being handled, wrapped to be pickled to another process.

    Create it inside an ``except`` block (or pass ``exc=``); ``exc_msg`` is the formatted
    traceback, ``exc_type`` the exception's class (in the receiving process, the revived
    class), ``where`` says where it was caught, and :meth:`reraise` raises it again.
    """

    def __init__(self, where: str = "in collector", *, exc: BaseException | None = None) -> None:
        if exc is None:
            exc = sys.exc_info()[1]
        self.where = where
        self._exc_type: type[BaseException] | None = type(exc) if exc is not None else None
        self._type_name = qualified_name(type(exc)) if exc is not None else None
        self._payload = dumps_exception(exc) if exc is not None else None
        self.exc_msg = format_exception_text(exc) if exc is not None else "NoneType: None\n"

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_exc_type"] = None  # revived lazily: the class may not be importable there
        return state

    @property
    def exc_type(self) -> type[BaseException] | None:
        if self._exc_type is None and self._payload is not None:
            self._exc_type = type(_revive(self._payload))
        return self._exc_type

    def _revived(self) -> BaseException:
        if self._payload is None:
            return RuntimeError(f"Unknown exception {self.where}.\n{self.exc_msg}")
        exc = _revive(self._payload)
        note = f"Caught {self._type_name} {self.where}."
        notes = getattr(exc, "__notes__", None)
        exc.__notes__ = [*notes, note] if isinstance(notes, list) else [note]  # type: ignore[attr-defined]
        return exc

    def reraise(self) -> NoReturn:
        """Raise the wrapped exception: its own class, args and attributes, a note naming
        ``where``, the worker's traceback in its cause chain."""
        raise self._revived()


def create_error_pipe() -> tuple[Any, Any]:
    """A one-way framepipe pipe for errors: ``(recv_conn, send_conn)``. The parent keeps the
    first, the child gets the second."""
    from .connection import Pipe

    return Pipe(duplex=False)  # type: ignore[no-any-return]


class _CollectorGuard(Guard):
    """The reference guard's protocol: ``Exception`` only, an :class:`ExceptionWrapper` sent
    with ``conn.send`` (so the parent's ``recv()`` returns it, over any connection)."""

    def reports(self, exc: BaseException) -> bool:
        return isinstance(exc, Exception)

    def send(self, exc: BaseException) -> None:
        if self.conn is not None:
            self.conn.send(ExceptionWrapper(where=f"in {self.label}", exc=exc))


def collector_error_guard(
    error_conn: Any | None = None,
    metrics_queue: Any | None = None,
    stop_event: Any | None = None,
    label: str = "collector",
) -> AbstractContextManager[Any]:
    """Guard a collector's body (see :func:`framepipe.guard`): on an ``Exception``, print a
    crash banner, send an :class:`ExceptionWrapper` through ``error_conn``, put
    ``{"error": text}`` on ``metrics_queue``, set ``stop_event`` and re-raise; every step
    best effort."""
    return _CollectorGuard(error_conn, label=label, queue=metrics_queue, stop_event=stop_event)
