"""The reference names, over :mod:`framepipe.remote` and :mod:`framepipe.guard`.

Code written against the reference ``subprocess_rpc`` module or the reference collector guard
migrates by importing these names from here instead (``from framepipe.compat import *``):

- everything of :mod:`framepipe.subprocess_rpc` (``Pipe``, ``run_loop``, the protocol's
  constants, ``SerializedException.from_exception(e, tb)`` / ``raise_from(se)``,
  ``UnserializableException``, ``ChildTraceException``, ``ExceptionUnpickler``...);
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

import sys
from contextlib import AbstractContextManager
from typing import Any, NoReturn

from . import connection as _connection
from . import subprocess_rpc
from .guard import Guard
from .remote import add_note, dumps_exception, format_exception_text, qualified_name
from .subprocess_rpc import *  # noqa: F403 - the reference module's names, all of them
from .subprocess_rpc import (
    _revive,
)

__all__ = [
    *subprocess_rpc.__all__,
    "ExceptionWrapper",
    "collector_error_guard",
    "create_error_pipe",
]


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
        add_note(exc, f"Caught {self._type_name} {self.where}.")
        return exc

    def reraise(self) -> NoReturn:
        """Raise the wrapped exception: its own class, args and attributes, a note naming
        ``where``, the worker's traceback in its cause chain."""
        raise self._revived()


def create_error_pipe() -> tuple[_connection.Connection, _connection.Connection]:
    """A one-way framepipe pipe for errors: ``(recv_conn, send_conn)``. The parent keeps the
    first, the child gets the second."""
    return _connection.Pipe(duplex=False)


class _CollectorGuard(Guard):
    """The reference guard's protocol: ``Exception`` only, an :class:`ExceptionWrapper` sent
    with ``conn.send`` (so the parent's ``recv()`` returns it, over any connection)."""

    conn: Any  # any connection with send()

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
