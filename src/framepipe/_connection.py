"""``ConnectionBase``: a Connection written once, over either engine.

An engine (``framepipe._core``, compiled, or its twin ``framepipe._pycore``) holds the hot
loops: framed reads against a deadline, gather writes, ``poll``, the bulk channel. Its interface
is written down in ``_core.pyi``. Everything else is here, once: the constructor's checks,
pickling objects, error frames, ``watch``, asyncio, the context manager, ``repr``, passing a
connection to another process, and the documentation of every public call. Each engine has its
own ``class Connection(ConnectionBase, Engine)``, written in ``framepipe._connection_c`` and
``framepipe._connection_py``: its hot calls (``recv_bytes``, ``recv``, ``send_bytes``,
``poll``...) are the engine's own methods, bound by :func:`engine_call`, so the compiled ones
cost no Python frame; :func:`load_engine` imports one of the two by the engine's name.

The engine calls back into two hooks defined here: :meth:`ConnectionBase._message` for a
message that is not one data frame (an object with out-of-band buffers, an error frame) and
:meth:`ConnectionBase._dead_sentinel` for a DEAD sentinel read off the stream.
"""

from __future__ import annotations

import functools
import importlib
import sys
from collections.abc import Callable
from multiprocessing import reduction
from typing import TYPE_CHECKING, Any, Protocol, TypeVar, cast

from . import _pipes
from ._args import check_bulk_handles, check_exception, check_handles, check_max_size
from ._control import check_watch, dead_error, error_frame, remote_error, start_watch, stop_watch
from ._pickling import FLAG_BYTES, dumps, dumps_bulk, dumps_inband, loads, parse_object
from ._stream_errors import closed, missing_buffer
from ._unpickle import Imports, import_prefixes
from ._wire import BULK_MIN, KIND_BUFFER, KIND_DATA, KIND_ERROR, KIND_OBJECT, header
from .errors import MessageTooLong

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

    from ._core import Engine as _EngineBase
else:
    _EngineBase = object

ENGINE_MODULES = {"c": "framepipe._connection_c", "python": "framepipe._connection_py"}
"""The module of each engine's Connection, by the name :func:`framepipe._impl.load` takes."""

_Call = TypeVar("_Call", bound=Callable[..., Any])


class ConnectionBase(_EngineBase):
    """A framed, bidirectional or one-way connection over a pipe or socket fd.

    A drop-in for ``multiprocessing.connection.Connection`` (same methods, same errors), plus
    per-read timeouts, writer liveness (:meth:`watch`), error frames and asyncio reads.

    By default a read never takes a byte past the frame it returns, so ``select()`` and
    ``multiprocessing.connection.wait()`` on :meth:`fileno` see every frame still to be read,
    as with the stdlib. ``read_ahead=True`` lets one read() take up to 64 KiB of following
    frames: small messages then cost a fraction of a syscall each, but frames held in the
    connection's buffer are invisible to a foreign ``select()``; wait on such connections
    with :func:`framepipe.connection.wait` (or :meth:`poll`), which sees them. ``max_size``
    bounds the payload a frame may announce (None: no bound); ``write_handle`` makes a duplex
    connection that reads ``handle`` and writes ``write_handle``; ``closefd=False`` leaves
    the fds open on :meth:`close`. On Linux, the first read of a pipe with a timeout or a
    watched writer opens a second, private non-blocking description of the pipe (through
    ``/proc/self/fd``), so the fd that children share stays blocking; :meth:`close` closes it
    whatever ``closefd`` says. :meth:`close` from another thread ends a read, poll or write
    under way on the connection with ``OSError``; the fds are closed once it has left.

    ``bulk_handle`` adds a bulk channel (a stream socket, made by :func:`pipe`): payloads of
    16 KiB or more are written to it while their frame header still goes through ``handle``
    in order, and a reader takes them from its own ``bulk_handle``. As with ``write_handle``,
    ``bulk_write_handle`` gives a duplex connection a separate bulk fd to write.

    An error frame raises the exception it carries, revived under the rules of
    ``docs/reviving.md``: nothing is imported unless ``revive_imports`` admits it, and a
    ``BaseException`` that is not an ``Exception`` (``SystemExit``...) arrives wrapped in
    :class:`framepipe.errors.RemoteBaseException`.
    """

    # No __dict__ (each engine's class adds the slots, _watch_handle: the watcher's
    # registration of the watched writer, and _revive_imports): every attribute lookup on a
    # connection, each send_bytes or recv, then goes straight to the class.
    __slots__ = ()
    _watch_handle: Any
    _revive_imports: tuple[str, ...] | bool

    def __init__(
        self,
        handle: int,
        readable: bool = True,
        writable: bool = True,
        *,
        write_handle: int | None = None,
        bulk_handle: int | None = None,
        bulk_write_handle: int | None = None,
        max_size: int | None = None,
        closefd: bool = True,
        read_ahead: bool = False,
        revive_imports: Imports = False,
    ) -> None:
        self._watch_handle = None
        self._revive_imports = import_prefixes(revive_imports)
        fd, wfd = check_handles(handle, readable, writable, write_handle)
        bfd, bwfd = check_bulk_handles(bulk_handle, bulk_write_handle, readable, writable)
        check_max_size(max_size)
        self._open(
            fd,
            wfd,
            bfd,
            bwfd,
            bool(readable),
            bool(writable),
            max_size,
            bool(closefd),
            bool(read_ahead),
        )

    # -- state -------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True if the connection is closed."""
        return self._fd < 0

    @property
    def readable(self) -> bool:
        """True if the connection is readable."""
        return self._readable

    @property
    def writable(self) -> bool:
        """True if the connection is writable."""
        return self._writable

    @property
    def max_size(self) -> int | None:
        """Largest frame payload this connection accepts, or None for no limit."""
        return self._max_size

    @property
    def revive_imports(self) -> tuple[str, ...] | bool:
        """What an error frame read here may make this process import to revive its exception
        (see ``docs/reviving.md``): False (nothing, the default: a class whose module is not
        imported yet arrives as a stand-in), a tuple of module prefixes, or True (any module
        but ``__main__``-style ones). Settable; takes module names or a bool."""
        return self._revive_imports

    @revive_imports.setter
    def revive_imports(self, value: Imports) -> None:
        self._revive_imports = import_prefixes(value)

    @property
    def read_ahead(self) -> bool:
        """Whether reads may take more than the current frame from the fd (see the class)."""
        return self._read_ahead

    def fileno(self) -> int:
        """File descriptor or handle of the connection."""
        fd = self._fd
        if fd < 0:
            raise closed()
        return fd

    def close(self) -> None:
        """Close the connection (its fd once, if it owns it) and stop watching the writer. A
        call under way in another thread (a read, a poll, a write) raises OSError at once."""
        handle, self._watch_handle = self._watch_handle, None
        aio = sys.modules.get("framepipe._aio")
        if aio is not None:
            aio.closing(self)  # coroutines waiting on it wake, its fds leave their loops
        try:
            self._close()  # the engine closes the liveness with the fds
        finally:
            stop_watch(None, handle)

    def __enter__(self) -> ConnectionBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._fd < 0 else f"fd={self._fd}"
        mode = ("r" if self._readable else "") + ("w" if self._writable else "")
        return f"<framepipe.Connection {state} {mode} {self.ENGINE}>"

    # -- the engine's calls ------------------------------------------------------------------
    # Declared and documented here; each engine's Connection puts the engine's own method in
    # their place (see engine_call), so these bodies never run.

    def recv_bytes(self, maxlength: int | None = None, *, timeout: float | None = None) -> bytes:
        """Receive one message as bytes.

        Raises EOFError at end of file (:class:`WriterDied` if the watched writer died),
        :class:`ReadTimeout` when ``timeout`` seconds pass (nothing is lost), and
        :class:`MessageTooLong` (an OSError) when the message exceeds ``maxlength``; unlike
        the stdlib the message is then discarded and the connection stays usable. An error
        frame raises the exception it carries.
        """
        raise NotImplementedError

    def recv_bytes_into(
        self, buf: WriteableBuffer, offset: int = 0, *, timeout: float | None = None
    ) -> int:
        """Receive one message into ``buf`` at byte ``offset``; returns its size in bytes.

        Raises ``BufferTooShort`` (carrying the whole message as ``args[0]``) if it does not
        fit; the connection stays usable.
        """
        raise NotImplementedError

    def recv(self, *, timeout: float | None = None) -> Any:
        """Receive an object sent by :meth:`send` (or an in-band pickle from a reference
        writer). An error frame raises the exception it carries."""
        raise NotImplementedError

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether there is data to read (or end of file), waiting up to ``timeout`` seconds
        (None: forever)."""
        raise NotImplementedError

    def send_bytes(self, buf: ReadableBuffer, offset: int = 0, size: int | None = None) -> None:
        """Send the bytes of ``buf[offset:offset+size]`` (a bytes-like object) as one
        frame."""
        raise NotImplementedError

    # -- liveness ----------------------------------------------------------------------------

    def watch(self, target: Any) -> ConnectionBase:
        """Watch the process that writes to this connection.

        ``target`` is a pid, a started ``multiprocessing.Process`` or a ``subprocess.Popen``.
        While reading, the writer's death (any exit code, or a signal) raises
        :class:`framepipe.WriterDied` once the frames it wrote before dying are delivered.
        Returns the connection. ``watch(None)`` stops watching.
        """
        if self._fd < 0:
            raise closed()
        check_watch(target, self._readable)
        liveness, handle = self._liveness, self._watch_handle
        self._set_liveness(None)
        self._watch_handle = None
        stop_watch(liveness, handle)
        if target is not None:
            liveness, self._watch_handle = start_watch(target, self._peer)
            self._set_liveness(liveness)
        return self

    def _dead_sentinel(self, status: int) -> BaseException:
        """Hook: the engine read a DEAD sentinel carrying ``status``."""
        return dead_error(status, self._liveness)

    # -- objects and errors ------------------------------------------------------------------

    def send(self, obj: Any) -> None:
        """Send a picklable object (pickle protocol 5; buffers of 64 KiB or more out of band)."""
        if self._fd < 0:
            raise closed()
        if not self._writable:
            raise OSError("connection is read-only")
        if self._handles()[3] >= 0:
            self._send_segments(dumps_bulk(obj, BULK_MIN))
        else:
            self._send_segments([dumps(obj)])

    def send_exception(self, exc: BaseException) -> None:
        """Send ``exc`` as an error frame: the reader's ``recv`` or ``recv_bytes`` raises it."""
        if self._fd < 0:
            raise closed()
        if not self._writable:
            raise OSError("connection is read-only")
        check_exception(exc)
        self._send_segments([error_frame(exc)])

    def _send_parts(self, parts: list[Any]) -> None:
        """For the layers above: ``send_bytes(b"".join(parts))`` (``parts``: bytes-like, of
        bytes), written from the parts themselves, with no copy, while the frame stays under
        the bulk channel's threshold (both ways check that the connection can write)."""
        size = 0
        for part in parts:
            size += len(part)
        if size < BULK_MIN:
            self._send_segments([[header(KIND_DATA, size), *parts]])
        else:
            self.send_bytes(b"".join(parts))

    def _message(self, kind: int, payload: Any, deadline: float, raw: bool, maxlength: int) -> Any:
        """Hook: the rest of a message that is not one data frame; the engine calls it holding
        the read lock, with the frame it just read (``kind`` -1: none, an object's buffers are
        still due). An error frame raises the exception it carries; an object frame is followed
        by its out-of-band buffers. Returns the object, or its in-band pickle when ``raw``."""
        if kind >= 0:
            if kind == KIND_ERROR:
                raise remote_error(payload, self._revive_imports)
            if kind != KIND_OBJECT:
                raise self._break(missing_buffer(kind, len(payload), None))
            pickled, table = parse_object(payload)
            self._object = (pickled, table, [])
        pickled, table, buffers = self._object
        while len(buffers) < len(table):
            length, flags = table[len(buffers)]
            kind, payload = self._read_frame(deadline, not flags & FLAG_BYTES)
            if kind != KIND_BUFFER or len(payload) != length:
                raise self._break(missing_buffer(kind, len(payload), length))
            buffers.append(payload)
        self._object = None
        obj = loads(pickled, buffers)
        if not raw:
            return obj
        data = dumps_inband(obj)
        if 0 <= maxlength < len(data):
            raise MessageTooLong(len(data), maxlength)
        return data

    # -- asyncio (asyncio itself loads on first use) -----------------------------------------

    async def recv_bytes_async(
        self, maxlength: int | None = None, *, timeout: float | None = None
    ) -> bytes:
        """``recv_bytes`` on the running event loop's reader callbacks (no thread)."""
        from ._aio import recv_async

        return await recv_async(self, lambda t: self.recv_bytes(maxlength, timeout=t), timeout)  # type: ignore[no-any-return]

    async def recv_async(self, *, timeout: float | None = None) -> Any:
        """``recv`` on the running event loop's reader callbacks (no thread)."""
        from ._aio import recv_async

        return await recv_async(self, lambda t: self.recv(timeout=t), timeout)

    async def send_bytes_async(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        """``send_bytes`` on the running event loop's writer callbacks: a full pipe suspends
        the coroutine, never the loop, and no thread is used. A cancelled send finishes its
        frame in the background, so the stream never holds half a frame."""
        from ._aio import send_bytes_async

        await send_bytes_async(self, buf, offset, size)

    async def send_async(self, obj: Any) -> None:
        """``send`` on the running event loop's writer callbacks (see
        :meth:`send_bytes_async`)."""
        from ._aio import send_object_async

        await send_object_async(self, obj)

    # -- passing a Connection to another process ---------------------------------------------

    def __reduce__(self) -> Any:
        """Pickle support (multiprocessing's ForkingPickler): the fds travel as ``DupFd``, and
        the other process rebuilds the connection over the same engine."""
        if self._fd < 0:
            raise OSError("cannot pass a closed Connection to another process")
        if self._has_buffered():
            raise ValueError(
                "cannot pass this Connection to another process: it holds bytes it has read "
                "ahead but not yet returned, which the other process would never see; receive "
                "the pending messages first"
            )
        rfd, wfd, bfd, bwfd = self._handles()
        dup_r = reduction.DupFd(rfd)
        dup_w = None if wfd == rfd else reduction.DupFd(wfd)
        # The bulk channel: one fd (read, written, or both on one socket) or a read and a write fd.
        bulk = bfd if bfd >= 0 else bwfd
        dup_b = None if bulk < 0 else reduction.DupFd(bulk)
        dup_bw = None if bfd < 0 or bwfd < 0 or bwfd == bfd else reduction.DupFd(bwfd)
        options = {
            "max_size": self._max_size,
            "read_ahead": self._read_ahead,
            "revive_imports": self._revive_imports,
        }
        return _rebuild_connection, (
            self.ENGINE,
            dup_r,
            dup_w,
            self._readable,
            self._writable,
            options,
            dup_b,
            dup_bw,
        )


def _rebuild_connection(
    engine: str,
    dup_r: Any,
    dup_w: Any,
    readable: bool,
    writable: bool,
    options: dict[str, Any],
    dup_b: Any = None,
    dup_bw: Any = None,
) -> Any:
    rfd = dup_r.detach()
    wfd = None if dup_w is None else dup_w.detach()
    bfd = None if dup_b is None else dup_b.detach()
    bwfd = None if dup_bw is None else dup_bw.detach()
    return load_engine(engine).Connection(
        rfd,
        readable,
        writable,
        write_handle=wfd,
        bulk_handle=bfd,
        bulk_write_handle=bwfd,
        **options,
    )


def engine_call(declared: _Call, engine: type) -> _Call:
    """For the body of an engine's Connection class: the engine's own method named as
    ``declared`` (a call declared on :class:`ConnectionBase`), given ``declared``'s docstring.
    The class then holds the engine's method itself: a call costs no Python frame above the
    compiled engine, and reads the documentation written once here."""
    method = getattr(engine, declared.__name__)
    method.__doc__ = declared.__doc__
    return cast(_Call, method)


# -- one engine with everything above it -----------------------------------------------------


class EngineConnections(Protocol):
    """What :func:`load_engine` returns: the module of one engine's Connection
    (``framepipe._connection_c`` or ``framepipe._connection_py``)."""

    ENGINE: str
    Engine: type[_EngineBase]
    Connection: type[ConnectionBase]
    Pipe: type[_pipes.Pipe]

    def pipe(
        self, duplex: bool = True, *, read_ahead: bool = False, pipes: bool = False
    ) -> tuple[ConnectionBase, ConnectionBase]: ...


@functools.cache
def load_engine(name: str) -> EngineConnections:
    """The Connection module of the engine ``name`` (``"c"`` or ``"python"``); raises
    ImportError when that engine does not import here, ValueError for another name."""
    try:
        module = ENGINE_MODULES[name]
    except KeyError:
        raise ValueError(f"unknown implementation {name!r}; expected 'c' or 'python'") from None
    return cast(EngineConnections, importlib.import_module(module))
