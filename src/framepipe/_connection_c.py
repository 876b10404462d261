"""The Connection of the compiled engine: :class:`~framepipe._connection.ConnectionBase` over
``framepipe._core.Engine``, with its ``pipe()`` and reference-style ``Pipe``. The switch
(``framepipe._impl``) imports this module when the compiled engine runs."""

from __future__ import annotations

from . import _pipes
from ._connection import ConnectionBase, engine_call
from ._core import ENGINE, Engine

__all__ = ["ENGINE", "Connection", "Engine", "Pipe", "pipe"]


class Connection(ConnectionBase, Engine):
    __doc__ = ConnectionBase.__doc__
    __module__ = "framepipe.connection"
    # _watch_handle: see ConnectionBase. A __dict__, which the compiled engine has not, as the
    # stdlib's connections have one: callers hang their own attributes on connections.
    __slots__ = ("_watch_handle", "_revive_imports", "__dict__")

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
