"""``pipe()`` and the reference-style ``Pipe``, written once over a Connection class: each
engine's Connection module (``framepipe._connection_c``, ``framepipe._connection_py``) binds
them to its own Connection."""

from __future__ import annotations

import numbers
import os
import socket
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

from ._args import check_callable, check_int, check_timeout, check_type
from ._closing import Closing

_BUFFER_SIZE = 1 << 20  # pipe and socket buffers: fewer wake-ups for large frames
BULK_BUFFER_SIZE = 4 << 20  # SO_SNDBUF / SO_RCVBUF of the bulk socketpairs (best effort)


class _Default:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<the pipe's timeout>"


USE_DEFAULT: Any = _Default()
"""``Pipe.read``'s default timeout: the pipe's own ``timeout``."""


def _pipe_size(fd: int) -> None:
    # Best effort: a system without pipe resizing (F_SETPIPE_SZ is Linux's) keeps its default
    # size, and an unprivileged process may be capped lower.
    try:
        import fcntl
    except ImportError:
        return
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    if set_size is None:
        return
    try:
        fcntl.fcntl(fd, set_size, _BUFFER_SIZE)
    except OSError:
        pass


def _stream_pair(both_ways: bool = False) -> tuple[int, int]:
    """A stream socketpair whose buffers are raised to 4 MiB where the system allows:
    ``(a, b)``. A bulk channel uses it one way (``a`` reads, ``b`` writes); ``both_ways``
    raises both buffers of both ends, for a duplex connection over the pair, and makes it a
    SOCK_SEQPACKET pair where the system has one (see ``_wire.RECORD_MAX``)."""
    a = b = None
    if both_ways:
        try:
            a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        except OSError:
            pass  # no SOCK_SEQPACKET here: a stream, as the stdlib's
    if a is None or b is None:
        a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        opts: tuple[tuple[socket.socket, int], ...] = ((a, socket.SO_RCVBUF), (b, socket.SO_SNDBUF))
        if both_ways:
            opts += ((a, socket.SO_SNDBUF), (b, socket.SO_RCVBUF))
        for s, opt in opts:
            try:
                s.setsockopt(socket.SOL_SOCKET, opt, BULK_BUFFER_SIZE)
            except OSError:
                pass  # best effort
        return a.detach(), b.detach()
    finally:
        a.close()
        b.close()


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _one_pipe(Connection: type[Any], read_ahead: bool, fds: list[int]) -> tuple[Any, Any]:
    """``(reader, writer)`` over an ``os.pipe()`` with a bulk channel; ``fds`` holds the
    descriptors no Connection owns yet."""
    r, w = os.pipe()
    fds += (r, w)
    br, bw = _stream_pair()
    fds += (br, bw)
    _pipe_size(w)
    c1 = Connection(r, writable=False, bulk_handle=br, read_ahead=read_ahead)
    fds[:] = [w, bw]
    c2 = Connection(w, readable=False, bulk_handle=bw)
    return c1, c2


def _two_pipes(Connection: type[Any], read_ahead: bool, fds: list[int]) -> tuple[Any, Any]:
    """A duplex pair made of two one-way pipes, each with its own bulk channel (8 fds);
    ``fds`` holds the descriptors no Connection owns yet."""
    r1, w1 = os.pipe()
    fds += (r1, w1)
    r2, w2 = os.pipe()
    fds += (r2, w2)
    br1, bw1 = _stream_pair()
    fds += (br1, bw1)
    br2, bw2 = _stream_pair()
    fds += (br2, bw2)
    _pipe_size(w1)
    _pipe_size(w2)
    c1 = Connection(
        r1, write_handle=w2, bulk_handle=br1, bulk_write_handle=bw2, read_ahead=read_ahead
    )
    fds[:] = [r2, w1, br2, bw1]
    c2 = Connection(
        r2, write_handle=w1, bulk_handle=br2, bulk_write_handle=bw1, read_ahead=read_ahead
    )
    return c1, c2


def make_pipe(Connection: type[Any]) -> Callable[..., tuple[Any, Any]]:
    """``pipe()`` over ``Connection`` (one engine's class)."""

    def pipe(
        duplex: bool = True, *, read_ahead: bool = False, pipes: bool = False
    ) -> tuple[Any, Any]:
        """A pair of connected Connections, like ``multiprocessing.Pipe``: ``(reader, writer)``
        over an ``os.pipe()``, or when ``duplex``, two connections over one socketpair, as the
        stdlib makes them (2 fds in all, ``fileno()`` a Unix socket, so
        ``multiprocessing.reduction.send_handle``/``recv_handle`` work over it). The pair is
        SOCK_SEQPACKET where the system has it: a frame under RECORD_MAX is one record, read in
        one call, and no read takes a byte past its frame (see ``_wire.RECORD_MAX``); 4 MiB
        socket buffers carry large frames as fast as a separate bulk channel would. A one-way
        pipe gets a bulk channel, a socketpair that carries the payloads of frames of 16 KiB
        and more (over twice the throughput of a pipe for large frames) while their headers
        stay in the pipe: 4 fds in all. Both ends being framepipe's, its small messages are
        padded to 256 bytes, so that one read() takes each whole (see ``_wire.PAD_MIN``).

        ``pipes=True`` (duplex only) builds each direction as a one-way pipe with its own bulk
        channel instead: 8 fds and ``fileno()`` a pipe (so no ``send_handle``). The worker
        layer uses it for its channels."""
        fds: list[int] = []  # closed if a step fails (a made Connection closes its own)
        try:
            if duplex and pipes:
                c1, c2 = _two_pipes(Connection, read_ahead, fds)
            elif duplex:
                a, b = _stream_pair(both_ways=True)
                fds += (a, b)
                c1 = Connection(a, read_ahead=read_ahead)
                fds[:] = [b]
                c2 = Connection(b, read_ahead=read_ahead)
            else:
                c1, c2 = _one_pipe(Connection, read_ahead, fds)
        except BaseException:
            _close_all(fds)
            raise
        c1._peer = weakref.ref(c2)
        if duplex:
            c2._peer = weakref.ref(c1)
        return c1, c2

    pipe.__module__ = "framepipe.connection"
    return pipe


class Pipe(Closing):
    """A one-way framed pipe with timed reads and writer liveness.

    Made for code written against the reference ``subprocess_rpc.Pipe``: constructed owning a
    new ``os.pipe()`` or from given read/write handles; ``read()`` returns the next message as
    bytes and ``write(bytes)`` sends one, of any size. ``timeout`` (seconds) bounds every read
    unless ``read(timeout=...)`` says otherwise; ``timeout_callback`` runs before
    :class:`ReadTimeout` is raised. With ``writer_pid`` set, the writer's death raises
    :class:`WriterDied` instead of hanging. ``writer_pid`` may be this process's own pid, as
    the reference allows (a pipe this process writes): nothing is watched here, and a reader
    in another process (a forked child that inherited the Pipe) watches that pid there.
    """

    _Connection: ClassVar[type[Any]]  # the engine's Connection: each engine's subclass sets it

    def __init__(
        self,
        writer_pid: int | None = None,
        read_handle: int | None = None,
        write_handle: int | None = None,
        timeout: float | None = None,
        timeout_callback: Callable[[], Any] = lambda: None,
    ) -> None:
        check_int("read_handle", read_handle, 0, none_ok=True, why="a file descriptor")
        check_int("write_handle", write_handle, 0, none_ok=True, why="a file descriptor")
        if timeout is not None:
            check_type("timeout", timeout, numbers.Real, takes="a number of seconds")
            check_timeout(timeout)  # (NaN)
        check_callable("timeout_callback", timeout_callback, why="called when a read times out")
        self._owns_pipe = read_handle is None and write_handle is None
        self.read_fd: int | None
        self.write_fd: int | None
        if self._owns_pipe:
            r, w = os.pipe()
            _pipe_size(w)
            self.read_fd, self.write_fd = r, w
        else:
            self.read_fd, self.write_fd = read_handle, write_handle
        self.read_handle, self.write_handle = self.read_fd, self.write_fd
        self.timeout = timeout
        self.timeout_callback = timeout_callback
        own = self._owns_pipe
        self._reader = (
            None
            if self.read_fd is None
            else self._Connection(self.read_fd, writable=False, closefd=own)
        )
        self._writer = (
            None
            if self.write_fd is None
            else self._Connection(self.write_fd, readable=False, closefd=own)
        )
        if self._reader is not None and self._writer is not None:
            self._reader._peer = weakref.ref(self._writer)
        self._writer_pid: int | None = None
        self._deferred_watch: int | None = None  # a writer pid to watch once read elsewhere
        if writer_pid is not None:
            self.set_writer_pid(writer_pid)

    def read(self, timeout: float | None = USE_DEFAULT) -> bytes:
        """The next message. ``timeout`` defaults to the pipe's ``timeout``."""
        if self._reader is None:
            raise OSError("cannot read: this Pipe was made without a read handle")
        if timeout is USE_DEFAULT:
            timeout = self.timeout
        if self._deferred_watch is not None and self._deferred_watch != os.getpid():
            self._watch_deferred()
        try:
            data: bytes = self._reader.recv_bytes(timeout=timeout)
        except TimeoutError:
            self.timeout_callback()
            raise
        return data

    def write(self, msg: bytes) -> None:
        """Send ``msg`` (bytes-like) as one frame."""
        if self._writer is None:
            raise OSError("cannot write: this Pipe was made without a write handle")
        self._writer.send_bytes(msg)

    def get_writer_pid(self) -> int:
        if self._writer_pid is None:
            raise ValueError(
                "this Pipe has no writer pid; pass writer_pid= or call set_writer_pid()"
            )
        return self._writer_pid

    def set_writer_pid(self, writer_pid: int) -> None:
        if self._reader is None:
            raise OSError("cannot watch a writer: this Pipe was made without a read handle")
        if writer_pid == os.getpid():
            # This process writes: it cannot see its own death, so nothing is watched here;
            # a reader in another process (one forked from here) watches it there.
            self._reader.watch(None)
            self._deferred_watch = writer_pid
        else:
            self._reader.watch(writer_pid)
            self._deferred_watch = None
        self._writer_pid = writer_pid

    def _watch_deferred(self) -> None:
        """First read in a process other than the writer recorded as this Pipe's own: watch it
        from here (best effort: a writer already gone and reaped cannot be watched)."""
        pid, self._deferred_watch = self._deferred_watch, None
        assert self._reader is not None
        try:
            self._reader.watch(pid)
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        """Close the fds this Pipe owns (once)."""
        for conn in (self._reader, self._writer):
            if conn is not None:
                conn.close()
