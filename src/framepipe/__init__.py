"""framepipe: framed pipes for worker processes that never hang and never lose an error."""

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

Connection = _core.Connection
Pipe = _core.Pipe

__version__ = "0.1.0"

__all__ = [
    "BufferTooShort",
    "Connection",
    "FrameError",
    "FramepipeError",
    "MessageTooLong",
    "Pipe",
    "ReadTimeout",
    "WriterDied",
    "implementation",
]
