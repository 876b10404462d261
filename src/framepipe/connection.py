"""A drop-in for ``multiprocessing.connection``: change one import.

    from framepipe.connection import Pipe, wait      # was: from multiprocessing.connection ...

``Pipe``, ``Connection`` and ``wait`` behave like the stdlib's and raise the same errors in the
same situations, with additions: ``recv_bytes``, ``recv_bytes_into`` and ``recv`` take
``timeout=`` (raising :class:`framepipe.ReadTimeout`), ``Connection.watch(process)`` turns a
dead writer into :class:`framepipe.WriterDied` instead of a hang, and errors sent with
``send_exception`` are raised by the reader. A Connection can be passed to a
``multiprocessing`` child (fork, spawn or forkserver) like the stdlib's.

``Listener``, ``Client``, ``answer_challenge`` and ``deliver_challenge`` connect processes over
Unix sockets or TCP with the stdlib's authkey handshake; the connections they make are framepipe
Connections (frames, timeouts, ``watch``, asyncio), so both ends must be framepipe. There is no
TLS: wrap the socket yourself (or tunnel) when the network is not trusted.
"""

from __future__ import annotations

import os
import select
import socket
import time
from collections.abc import Iterable
from multiprocessing import AuthenticationError
from multiprocessing import connection as _stdlib_connection
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from . import _impl
from ._args import poll_ms
from ._lazy import hmac  # imported on first use (see _lazy)
from .errors import BufferTooShort, FrameError

__all__ = [
    "AuthenticationError",
    "BufferTooShort",
    "Client",
    "Connection",
    "Listener",
    "Pipe",
    "answer_challenge",
    "deliver_challenge",
    "wait",
]

if TYPE_CHECKING:
    # For type checkers, the class every engine's Connection derives from, which declares
    # every public call; at run time, the Connection of the engine the switch chose (both
    # written in the source: framepipe._connection_c and framepipe._connection_py).
    from ._connection import ConnectionBase as Connection
else:
    Connection = _impl.core.Connection

# The stdlib's module, for its socket helpers used below, which its type stubs leave out.
_mpc: Any = _stdlib_connection


class _HasFileno(Protocol):
    def fileno(self) -> int: ...


_Waitable = TypeVar("_Waitable", bound="_HasFileno | int")


def Pipe(
    duplex: bool = True, *, read_ahead: bool = False, pipes: bool = False
) -> tuple[Connection, Connection]:
    """Return a pair of connected :class:`Connection` objects, like ``multiprocessing.Pipe``.

    With ``duplex=False`` the first can only read and the second can only write.
    ``read_ahead=True`` trades visibility to a foreign ``select()`` for small-message speed
    (see :class:`Connection`). A duplex pair is one Unix socketpair, as the stdlib's (so
    ``multiprocessing.reduction.send_handle`` works over it), of SOCK_SEQPACKET records where
    the system has them: a small frame in one read. ``pipes=True`` makes it two one-way pipes
    instead, each with a bulk channel: 8 fds, and ``fileno()`` a pipe.
    """
    return _impl.core.pipe(duplex, read_ahead=read_ahead, pipes=pipes)


def _fileno(obj: Any) -> int:
    """The fd of a ``wait()`` object; ValueError, as the stdlib's, for anything else."""
    if isinstance(obj, int):
        fd = obj
    else:
        fileno = getattr(obj, "fileno", None)
        if fileno is None:
            raise ValueError(f"Invalid file object: {obj!r}")
        fd = int(fileno())
    if fd < 0:
        raise ValueError(f"Invalid file descriptor: {fd}")
    return fd


def wait(object_list: Iterable[_Waitable], timeout: float | None = None) -> list[_Waitable]:
    """Wait until an object in ``object_list`` is ready; return the ready ones.

    Like ``multiprocessing.connection.wait``: the objects are Connections, sockets, fds or
    anything with ``fileno()`` (a Process ``sentinel`` is an fd). A framepipe Connection is
    ready when it has buffered data, when its fd is readable, or when the writer it watches
    has died (the next read raises :class:`framepipe.WriterDied`). After end of file from a
    watched writer, it is ready once the writer's death shows, or when the grace for it ends.
    """
    objects = list(object_list)
    deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
    while True:
        ready = [o for o in objects if _ready_now(o)]
        if ready:
            return ready
        poller = select.poll()
        owners: dict[int, list[_Waitable]] = {}
        soonest = None  # the first end of a grace after end of file
        for obj in objects:
            eof_wait = getattr(obj, "_eof_wait", None)
            live = getattr(obj, "_liveness_fd", None)
            if eof_wait is not None:  # the fd is at end of file: the death is what comes
                soonest = eof_wait if soonest is None else min(soonest, eof_wait)
                fds = [_fileno(obj)] if live is None else [live]
            else:
                bulk = getattr(obj, "_pending_bulk_fd", None)  # mid-payload: the bulk fd
                fds = [_fileno(obj) if bulk is None else bulk]
                if live is not None:
                    fds.append(live)
            for fd in fds:
                if fd not in owners:
                    poller.register(fd, select.POLLIN | select.POLLPRI)
                    owners[fd] = []
                owners[fd].append(obj)
        wait_s = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        if soonest is not None:
            wait_s = soonest if wait_s is None else min(wait_s, soonest)
        events = poller.poll(poll_ms(wait_s))
        if events:
            found: list[_Waitable] = []
            for fd, _ in events:
                for obj in owners[fd]:
                    if not any(obj is f for f in found):
                        found.append(obj)
            return [o for o in objects if any(o is f for f in found)]
        if deadline is not None and time.monotonic() >= deadline:
            return []


def _ready_now(obj: Any) -> bool:
    """A framepipe Connection whose next read returns at once without its fd: bytes it read
    ahead, or an end of file whose grace for the writer's death is over."""
    has_buffered = getattr(obj, "_has_buffered", None)
    if has_buffered is not None and has_buffered():
        return True
    return getattr(obj, "_eof_wait", None) == 0.0


# -- Listener and Client ---------------------------------------------------------------------

# The stdlib's address helpers, as they are: the families this system has (framepipe's
# Listener and Client take the socket ones), the family of an address, a fresh address.
families = _mpc.families
default_family = _mpc.default_family
address_type = _mpc.address_type
arbitrary_address = _mpc.arbitrary_address

MESSAGE_LENGTH = 20
CHALLENGE = b"#CHALLENGE#"
WELCOME = b"#WELCOME#"
FAILURE = b"#FAILURE#"
HANDSHAKE_MAX = 256  # no handshake message is larger: a bigger frame is refused unread
_DIGEST = "sha256"


def _check_authkey(authkey: Any) -> None:
    if not isinstance(authkey, bytes):
        raise ValueError(f"Authkey must be bytes, not {type(authkey)!s}")


def _handshake_conn(connection: Connection) -> Connection:
    """A view of ``connection``'s fds for the handshake: frames over ``HANDSHAKE_MAX`` bytes
    are refused before anything is allocated or read, so a peer that has not authenticated
    cannot make this process read or allocate more than that."""
    if connection._has_buffered():
        raise ValueError("cannot authenticate a connection that has already read ahead")
    rfd, wfd, _, _ = connection._handles()
    return type(connection)(
        rfd, write_handle=None if wfd == rfd else wfd, max_size=HANDSHAKE_MAX, closefd=False
    )


def _handshake_recv(conn: Connection) -> bytes:
    try:
        return conn.recv_bytes()
    except FrameError as exc:
        raise AuthenticationError(
            f"the peer did not follow the handshake (nothing else was read): {exc}"
        ) from exc


def deliver_challenge(connection: Connection, authkey: bytes) -> None:
    """Challenge the peer to prove it knows ``authkey`` (an HMAC of a random message);
    raises ``multiprocessing.AuthenticationError`` when it does not."""
    _check_authkey(authkey)
    with _handshake_conn(connection) as conn:
        message = os.urandom(MESSAGE_LENGTH)
        conn.send_bytes(CHALLENGE + message)
        digest = hmac.new(authkey, message, _DIGEST).digest()
        response = _handshake_recv(conn)
        if hmac.compare_digest(response, digest):
            conn.send_bytes(WELCOME)
        else:
            conn.send_bytes(FAILURE)
            raise AuthenticationError("digest received was wrong")


def answer_challenge(connection: Connection, authkey: bytes) -> None:
    """Answer the peer's :func:`deliver_challenge` with ``authkey``; raises
    ``multiprocessing.AuthenticationError`` when the peer rejects the answer."""
    _check_authkey(authkey)
    with _handshake_conn(connection) as conn:
        message = _handshake_recv(conn)
        if not message.startswith(CHALLENGE):
            raise AuthenticationError(f"expected a challenge from the peer, got {message[:32]!r}")
        digest = hmac.new(authkey, message[len(CHALLENGE) :], _DIGEST).digest()
        conn.send_bytes(digest)
        response = _handshake_recv(conn)
        if response != WELCOME:
            raise AuthenticationError("digest sent was rejected")


def _family(address: Any, family: str | None) -> str:
    family = family or (address and _mpc.address_type(address)) or _mpc.default_family
    _mpc._validate_family(family)
    if family == "AF_PIPE":
        raise ValueError("Family AF_PIPE is not recognized (it is Windows only)")
    return family


class Listener:
    """A bound socket listening for framepipe :func:`Client` connections, like
    ``multiprocessing.connection.Listener``: ``address`` is a path (``AF_UNIX``) or a
    ``(host, port)`` (``AF_INET``, ``AF_INET6``), None for a new private Unix address.
    With ``authkey``, :meth:`accept` authenticates each client before returning it and raises
    ``AuthenticationError`` for a client with a wrong key or no handshake."""

    def __init__(
        self,
        address: Any = None,
        family: str | None = None,
        backlog: int = 1,
        authkey: bytes | None = None,
    ) -> None:
        family = _family(address, family)
        address = address or _mpc.arbitrary_address(family)
        if authkey is not None and not isinstance(authkey, bytes):
            raise TypeError("authkey should be a byte string")
        self._listener: Any = _mpc.SocketListener(address, family, backlog)
        self._authkey = authkey

    def accept(self) -> Connection:
        """Wait for a client; return a framepipe Connection to it."""
        if self._listener is None:
            raise OSError("listener is closed")
        sock, self._listener._last_accepted = self._listener._socket.accept()
        sock.setblocking(True)
        conn = _impl.core.Connection(sock.detach())
        if self._authkey:
            try:
                deliver_challenge(conn, self._authkey)
                answer_challenge(conn, self._authkey)
            except BaseException:
                conn.close()
                raise
        return conn

    def close(self) -> None:
        """Close the listening socket (and remove its Unix socket file)."""
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()

    @property
    def address(self) -> Any:
        return self._listener._address

    @property
    def last_accepted(self) -> Any:
        return self._listener._last_accepted

    def __enter__(self) -> Listener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def Client(address: Any, family: str | None = None, authkey: bytes | None = None) -> Connection:
    """A framepipe Connection to the :class:`Listener` at ``address``, like
    ``multiprocessing.connection.Client``; with ``authkey``, authenticated both ways."""
    family = _family(address, family)
    if authkey is not None and not isinstance(authkey, bytes):
        raise TypeError("authkey should be a byte string")
    with socket.socket(getattr(socket, family)) as s:
        s.setblocking(True)
        s.connect(address)
        conn = _impl.core.Connection(s.detach())
    if authkey is not None:
        try:
            answer_challenge(conn, authkey)
            deliver_challenge(conn, authkey)
        except BaseException:
            conn.close()
            raise
    return conn
