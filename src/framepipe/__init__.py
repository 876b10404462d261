"""framepipe: framed pipes for worker processes that never hang and never lose an error.

``framepipe.connection`` is a drop-in for ``multiprocessing.connection``; :class:`Pipe` is the
reference ``subprocess_rpc.Pipe`` made right; :mod:`framepipe.remote` carries exceptions across
processes intact and :func:`guard` makes sure the parent hears about every failure of a worker.
``implementation`` says which core runs: ``"c"`` (compiled) or ``"python"`` (the twin).
"""

from typing import TYPE_CHECKING

from . import _impl, connection
from ._impl import implementation
from ._version import __version__
from .connection import Connection
from .errors import (
    BufferTooShort,
    FrameError,
    FramepipeError,
    MessageTooLong,
    ReadTimeout,
    RemoteBaseException,
    WriterDied,
)
from .guard import Guard, ProcessFailure, record, write_error_file

if TYPE_CHECKING:
    # For type checkers, ``framepipe.guard`` is the function; at run time it is the module
    # framepipe.guard, which is callable and calls that function (see framepipe.guard).
    from .guard import guard as guard
else:
    from . import guard
from .remote import (
    RefusedPayload,
    RemoteError,
    RemoteTraceback,
    dumps_exception,
    loads_exception,
)

if TYPE_CHECKING:
    # The reference-style Pipe every engine's Pipe derives from; at run time, the engine's.
    from ._pipes import Pipe as Pipe
else:
    Pipe = _impl.core.Pipe

__all__ = [
    "__version__",
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
    "RemoteBaseException",
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
