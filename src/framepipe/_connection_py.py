"""The Connection of the pure-Python engine: :class:`~framepipe._connection.ConnectionBase`
over ``framepipe._pycore.Engine``, with its ``pipe()`` and reference-style ``Pipe``. The switch
(``framepipe._impl``) imports this module when the pure-Python engine runs."""

from __future__ import annotations

from . import _pipes
from ._connection import ConnectionBase, engine_call
from ._pycore import ENGINE, Engine

__all__ = ["ENGINE", "Connection", "Engine", "Pipe", "pipe"]


class Connection(ConnectionBase, Engine):
    __doc__ = ConnectionBase.__doc__
    __module__ = "framepipe.connection"
    # _watch_handle: see ConnectionBase (the engine's instances have a __dict__ already).
    __slots__ = ("_watch_handle", "_revive_imports")

    recv_bytes = engine_call(ConnectionBase.recv_bytes, Engine)
    recv_bytes_into = engine_call(ConnectionBase.recv_bytes_into, Engine)
    recv = engine_call(ConnectionBase.recv, Engine)
    poll = engine_call(ConnectionBase.poll, Engine)
    send_bytes = engine_call(ConnectionBase.send_bytes, Engine)


class Pipe(_pipes.Pipe):
    __doc__ = _pipes.Pipe.__doc__
    __module__ = "framepipe"
    _Connection = Connection


pipe = _pipes.make_pipe(Connection)
