"""framepipe: framed pipes for worker processes that never hang and never lose an error.

``framepipe.connection`` is a drop-in for ``multiprocessing.connection``; :class:`Pipe` is the
reference ``subprocess_rpc.Pipe`` made right; :mod:`framepipe.remote` carries exceptions across
processes intact and :func:`guard` makes sure the parent hears about every failure of a worker.
``implementation`` says which core runs: ``"c"`` (compiled) or ``"python"`` (the twin).
"""

from . import connection
from ._impl import core as _core
from ._impl import implementation
from .errors import (
    BufferTooShort,
    FrameError,
    FramepipeError,
    MessageTooLong,
    ReadTimeout,
    WriterDied,
)
from .guard import Guard, ProcessFailure, guard, record, write_error_file
from .remote import (
    RefusedPayload,
    RemoteError,
    RemoteTraceback,
    dumps_exception,
    loads_exception,
)

Connection = _core.Connection
Pipe = _core.Pipe

__version__ = "0.1.0"

__all__ = [
    "BufferTooShort",
    "Connection",
    "FrameError",
    "FramepipeError",
    "Guard",
    "MessageTooLong",
    "Pipe",
    "ProcessFailure",
    "ReadTimeout",
    "RefusedPayload",
    "RemoteError",
    "RemoteTraceback",
    "WriterDied",
    "connection",
    "dumps_exception",
    "guard",
    "implementation",
    "loads_exception",
    "record",
    "write_error_file",
]
