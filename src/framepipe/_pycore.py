"""The pure-Python engine: the executable specification of the compiled engine
(``framepipe._core``), and the fallback where the extension is not built.

An engine holds the hot loops of a connection and nothing else: framed reads against an absolute
deadline, gather writes, ``poll``, the bulk channel, the read buffer, and closing the fds. The
interface both engines implement is written down in ``_core.pyi`` and checked by the parity
test. Everything else a Connection does (pickling objects, error frames, ``watch``, asyncio, the
context manager, ``repr``, the docstrings) is written once, in ``framepipe._connection``'s
``ConnectionBase``, which provides the two hooks the engine calls back (``_message``,
``_dead_sentinel``); ``framepipe._connection_py`` writes this engine's ``Connection``, a
subclass of both.

Deadlines are absolute ``time.monotonic()`` seconds; a negative deadline means "none".
"""

from __future__ import annotations

import errno
import os
import pickle
import select
import socket
import stat
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

from ._args import check_send_args, check_timeout, poll_ms
from ._spin import (
    DEATH_GRACE,
    DEATH_SPIN,
    SPIN_FLOOR,
    may_spin,
    next_average,
    spin_window,
)
from ._stream_errors import (
    bad_header,
    blocking_send_under_async_send,
    broken,
    closed,
    closed_while_waiting,
    no_bulk_channel,
    record_too_long,
    sentinel_timeout,
    timeout_error,
    truncated,
    unallocatable,
    watched,
)
from ._wire import (
    BULK_MIN,
    FRAME_RECORD_MAX,
    HEADER_SIZE,
    KIND_BUFFER,
    KIND_BULK,
    KIND_DATA,
    KIND_DEAD,
    KIND_PAD,
    KIND_TIMEOUT,
    MORE,
    OK,
    PAD_MIN,
    READ_BUFFER,
    READ_WAITS_NONE,
    READ_WAITS_PIPE,
    READ_WAITS_SOCKET,
    RECORD_MAX,
    TIMEOUT,
    decode_header,
    frame_cap,
    header,
    pad_frame,
    padded,
    pads,
    read_waits,
    records_of,
    socket_view,
)
from .errors import BufferTooShort, MessageTooLong

__all__ = ["ENGINE", "Engine"]

ENGINE = "python"
_may_spin = may_spin  # whether a read may spin now (the compiled engine has its own)
_spin_window_now = spin_window  # the longest spin now (the compiled engine keeps its own)

_READ_CHUNK = READ_BUFFER  # read-ahead buffer: many small frames per read(), a whole record
_DIRECT_MIN = 16 * 1024  # a remainder at least this large is read straight into its frame
# A frame's buffer is allocated whole up to this size; a larger one starts here and doubles as
# its bytes arrive (bytearray(n) writes all n bytes: a header announcing 2 GiB that no body
# follows would otherwise commit 2 GiB, where the compiled engine's malloc commits nothing).
_GROW_FIRST = 256 * 1024
_IOV_MAX = 1024
_LIVENESS_SLICE = 0.01  # without a pidfd, a dead writer is noticed within this many seconds
_POLLIN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None) if hasattr(os, "pwritev") else None
_PRECISE_BELOW = 0.1  # waits shorter than this use select(), whose timeout is in microseconds
_FD_SETSIZE = 1024  # select() cannot watch fds from this number up
_POLL_WAITED = 20e-6  # a poll() that took longer had to wait for data
_RECORD_FLAGS = socket.MSG_DONTWAIT | socket.MSG_TRUNC  # a record's whole length, even if cut


class _RecordSocket(socket.socket):
    """A view of a SOCK_SEQPACKET connection's fd (see ``socket_view``) for ``recv_into`` with
    flags, which ``os.read`` has not. It never closes the fd, which stays the connection's."""

    def __del__(self) -> None:
        self.detach()


def _capped(views: list[memoryview], cap: int) -> list[memoryview]:
    """The first ``cap`` bytes of ``views`` (one record's worth, see ``_wire.RECORD_MAX``)."""
    out = []
    for v in views:
        if v.nbytes >= cap:
            out.append(v[:cap])
            break
        out.append(v)
        cap -= v.nbytes
    return out


def _reopen_nonblocking(fd: int) -> int:
    """A private O_NONBLOCK open file description of the pipe read end ``fd``, or -2.

    Opening ``/proc/self/fd/N`` of a pipe makes a second description of the same pipe, so
    its O_NONBLOCK flag is this connection's alone: children that inherited ``fd`` keep
    their blocking reads. Timed and watched reads try a read there before polling.
    """
    if not sys.platform.startswith("linux"):
        return -2
    try:
        st = os.fstat(fd)
        if not stat.S_ISFIFO(st.st_mode):
            return -2
        nfd = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return -2
    try:
        same = os.path.samestat(st, os.fstat(nfd))
    except OSError:
        same = False
    if not same:
        os.close(nfd)
        return -2
    return nfd


def _fd_identity(fd: int) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``fd``, or None when it cannot be read (a bad fd)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _close_owned(fds: tuple[int, ...], identities: tuple[Any, ...]) -> None:
    """Close each distinct fd of ``fds`` that is still the file it was when the connection
    took it (same ``_fd_identity``). A number closed behind the connection's back and reused
    since (by framepipe's watcher, or anything else) is left alone, and so is an fd that was
    not open when the connection took it (a bad handle, which failed on its first use)."""
    seen = set()
    for fd, ident in zip(fds, identities):
        if fd < 0 or fd in seen:
            continue
        seen.add(fd)
        if ident is not None and _fd_identity(fd) == ident:
            os.close(fd)


def _deadline(timeout: float | None) -> float:
    t = check_timeout(timeout)
    if t is None:
        return -1.0
    return time.monotonic() + max(t, 0.0)


def _writev(
    fd: int, views: list[memoryview], nowait: bool = False, cap: int = 0, cap_after: int = -1
) -> int:
    """Write the bytes of ``views`` to ``fd`` as ``fp_writev`` (csrc/fp.c) does, looping over
    short writes: the first write at most ``cap`` bytes long when it is not 0, the later ones
    at most ``cap_after`` (-1: ``cap``); ``views`` is left holding what is not written.
    Returns the bytes written. With ``nowait`` no write blocks (RWF_NOWAIT, a per-call flag):
    BlockingIOError when the fd is full. A description someone made non-blocking raises it as
    well."""
    written = 0
    while views and not views[0].nbytes:  # empty parts first: a frame may have no payload
        views.pop(0)
    if cap_after < 0:
        cap_after = cap
    while views:
        batch = views[:_IOV_MAX] if not cap else _capped(views[:_IOV_MAX], cap)
        try:
            if nowait:
                n = os.pwritev(fd, batch, -1, _RWF_NOWAIT)  # type: ignore[arg-type]
            else:
                n = os.writev(fd, batch)
        except BlockingIOError as exc:
            exc.characters_written = written
            raise
        written += n
        cap = cap_after
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]
    return written


def _wake_open() -> tuple[int, int]:
    """A wake fd for waits (``fp_wake_open``): ``(read end, write end)``, one eventfd where
    there is one."""
    if hasattr(os, "eventfd"):
        fd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        return fd, fd
    r, w = os.pipe()
    os.set_blocking(r, False)
    os.set_blocking(w, False)
    return r, w


def _wake(wfd: int) -> None:
    try:
        os.write(wfd, (1).to_bytes(8, sys.byteorder))
    except BlockingIOError:
        pass  # readable already


_HAVE_PIPE_WAKE = sys.platform.startswith("linux")


def _wake_pipe_reader(fd: int) -> None:
    """Wake a thread blocked in read() on the pipe read end ``fd`` (``fp_wake_pipe_reader``):
    a TIMEOUT sentinel written through a write description of its own, opened for it."""
    try:
        wfd = os.open(f"/proc/self/fd/{fd}", os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.write(wfd, TIMEOUT)
    except OSError:
        pass  # full: nobody is blocked
    finally:
        os.close(wfd)


def _wake_socket_reader(fd: int) -> None:
    """Wake a thread blocked in recv() on the socket ``fd`` as ``fp_wake_socket_reader``
    (csrc/fp.h) does: shut the socket's reading down, for good."""
    sock = socket_view(fd, socket.SOCK_STREAM, socket.socket)
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass
    finally:
        sock.detach()


# Locks held by threads of the parent stay held in a forked child, where those threads do not
# exist: a connection first used in a child after a fork takes fresh locks.
_fork_gen = 0
_fork_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _fork_gen, _fork_lock
    _fork_gen += 1
    _fork_lock = threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class _Dead(Exception):
    """Internal: the watched writer's pidfd fired and no data is left to read."""


class _Expired(Exception):
    """Internal: the read's deadline passed; the public method says which timeout."""


class Engine:
    """The hot loops of one connection over a pipe or socket fd (see the module)."""

    ENGINE = "python"

    # A connection that was never opened (its constructor failed) is closed.
    _fd = _wfd = _bfd = _bwfd = -1
    _nfd = -1
    _closefd = False
    _readable = _writable = _read_ahead = False
    _max_size: int | None = None
    _liveness: Any = None
    _peer: Any = None
    _object: Any = None
    _sentinel_sent = 0
    _users = 0
    _wake_r = _wake_w = -1
    _read_waits = 0  # how reads without a deadline wait in read() (READ_WAITS_*), if they do
    _blocked_reader = False  # a thread is in such a read
    _eof_until = -1.0  # end of the grace for a watched writer's death after end of file

    if TYPE_CHECKING:  # the hooks the Connection above provides (see _core.pyi)

        def _message(
            self, kind: int, payload: Any, deadline: float, raw: bool, maxlength: int
        ) -> Any: ...

        def _dead_sentinel(self, status: int) -> BaseException: ...

    def _open(
        self,
        fd: int,
        wfd: int,
        bfd: int,
        bwfd: int,
        readable: bool,
        writable: bool,
        max_size: int | None,
        closefd: bool,
        read_ahead: bool,
    ) -> None:
        """Take the (checked) fds: ``fd`` to read, ``wfd`` to write, ``bfd``/``bwfd`` the bulk
        channel (-1: none)."""
        self._gen = _fork_gen
        # Calls under way in other threads that use the fds (reads, polls, writes, the
        # watcher's DEAD sentinel), and what a close() left for the last of them to close:
        # (fds, private description, liveness). _slock orders them.
        self._slock = threading.Lock()
        self._users = 0
        self._deferred: tuple[tuple[int, int, int, int], int, Any] | None = None
        self._wake_r = self._wake_w = -1  # the wake fd of waits, made at the first wait
        self._nowait_writes = _RWF_NOWAIT is not None
        self._fd = fd
        self._wfd = wfd
        self._bfd = bfd  # bulk payloads are read from here (-1: no bulk channel)
        self._bwfd = bwfd  # and written here
        self._bpoller: Any = None
        self._pbulk = False  # the pending frame's payload comes from the bulk fd
        self._readable = bool(readable)
        self._writable = bool(writable)
        self._max_size = max_size
        self._cap = frame_cap(max_size)
        self._closefd = bool(closefd)
        self._read_ahead = bool(read_ahead)
        try:
            self._read_waits = read_waits(os.fstat(fd).st_mode, _HAVE_PIPE_WAKE, bool(closefd))
        except OSError:
            self._read_waits = READ_WAITS_NONE  # like the stdlib: a bad handle fails on first use
        # Reads take whole records (a SOCK_SEQPACKET socket, see _wire.RECORD_MAX); writes
        # are cut to records no longer than _wcap.
        self._records, self._wcap, self._wframe = records_of(fd, wfd)
        self._rpad, self._wpad = pads(fd, wfd, bfd, bwfd)  # see _wire.PAD_MIN
        self._rsock: _RecordSocket | None = None
        self._rscratch: bytearray | None = None
        self._rpeek = bytearray(1)  # MSG_PEEK's target: a record's length, before reading it
        self._rview: memoryview | None = None  # the view of a growing frame read into (_room)
        if self._records:
            self._rsock = socket_view(fd, socket.SOCK_SEQPACKET, _RecordSocket)
        self._ids = tuple(_fd_identity(f) if f >= 0 else None for f in (fd, wfd, bfd, bwfd))
        self._async_owner = 0  # the thread whose asyncio send holds the write lock, or 0
        self._nfd = -1  # a private O_NONBLOCK description of the pipe (-1: not yet, -2: none)
        self._poll_first = False
        self._waited = 0.0  # moving average of how long reads waited for data (see SPIN)
        self._spollers: dict[int, Any] = {}  # a poll object of each fd that spins, alone
        self._rlock = threading.Lock()
        self._wlock = threading.Lock()
        self._buf = bytearray()
        self._bstart = 0
        self._consumed = 0
        self._pkind = -1  # kind of the frame being received, -1 between frames
        self._plen = 0
        self._pgot = 0
        self._pdest: Any = None  # bytearray, or the caller's memoryview
        self._pexternal = False
        self._pdiscard = False
        self._broken: BaseException | None = None
        self._dead = False
        self._poller: Any = None

    def __del__(self) -> None:
        try:
            self._close()
        except Exception:  # noqa: BLE001 - a finalizer never raises
            pass

    def _close(self) -> None:
        """Close the fds (those this connection owns, and its own private ones) and the
        watched writer's liveness. A call under way in another thread is woken (it raises
        OSError) and the last such call to leave closes them: until then no number is freed,
        so no call can reach a file that took one of them."""
        if self._fd < 0:
            return
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        with self._slock:
            fds = (self._fd, self._wfd, self._bfd, self._bwfd)
            if fds[0] < 0:
                return  # closed by another thread meanwhile
            nfd, liveness = self._nfd, self._liveness
            self._fd = self._wfd = self._bfd = self._bwfd = -1
            self._nfd = -1
            self._liveness = None
            if self._users > 0:
                self._deferred = (fds, nfd, liveness)
                if self._wake_w >= 0:
                    _wake(self._wake_w)
                if self._blocked_reader:
                    if self._read_waits == READ_WAITS_PIPE:
                        _wake_pipe_reader(fds[0])
                    else:
                        _wake_socket_reader(fds[0])
                return
        self._close_now(fds, nfd, liveness)

    def _close_now(self, fds: tuple[int, int, int, int], nfd: int, liveness: Any) -> None:
        self._rsock = None  # it never closes the fd (see _RecordSocket)
        if nfd >= 0:
            os.close(nfd)  # ours whatever closefd says
        self._close_wake()
        try:
            if self._closefd:
                _close_owned(fds, self._ids)
        finally:
            if liveness is not None:
                try:
                    liveness.close()
                except OSError:
                    pass

    def _close_wake(self) -> None:
        r, w = self._wake_r, self._wake_w
        self._wake_r = self._wake_w = -1
        if r >= 0:
            os.close(r)
            if w != r:
                os.close(w)

    def _enter(self) -> None:
        """A call that uses the fds begins (see _close)."""
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        with self._slock:
            if self._fd < 0:
                raise closed()
            self._users += 1

    def _leave(self) -> None:
        """The call ends; the last one out after a close() closes the fds. Nobody to report a
        failed close() to: the connection was closed by another thread."""
        with self._slock:
            self._users -= 1
            deferred = self._deferred if self._users == 0 else None
            if deferred is not None:
                self._deferred = None
        if deferred is not None:
            try:
                self._close_now(*deferred)
            except OSError:
                pass

    def _wake_fd(self, deadline: float) -> int:
        """The wake fd for a wait until ``deadline``, made now if the wait can block; -1 when
        it cannot block, or when no fd is left to make one (then a close() is seen when the
        wait ends by itself)."""
        if self._wake_r >= 0:
            return self._wake_r
        if 0.0 <= deadline <= time.monotonic():
            return -1
        try:
            r, w = _wake_open()
        except OSError:
            return -1
        with self._slock:
            if self._fd < 0:  # closed meanwhile: this call leaves at once
                os.close(r)
                if w != r:
                    os.close(w)
                raise closed_while_waiting()
            self._wake_r, self._wake_w = r, w
        self._poller = self._bpoller = None  # made again with the wake fd in them
        return r

    def _woken(self) -> None:
        """Raise if another thread closed the connection while this call was under way."""
        if self._fd < 0:
            raise closed_while_waiting()

    def _check_readable(self) -> None:
        if self._fd < 0:
            raise closed()
        if not self._readable:
            raise OSError("connection is write-only")

    def _check_writable(self) -> None:
        if self._fd < 0:
            raise closed()
        if not self._writable:
            raise OSError("connection is read-only")

    def _handles(self) -> tuple[int, int, int, int]:
        """(read fd, write fd, bulk read fd, bulk write fd); -1 for none."""
        return self._fd, self._wfd, self._bfd, self._bwfd

    def _has_buffered(self) -> bool:
        """Whether bytes read ahead wait in the buffer (a foreign select() cannot see them)."""
        return self._fd >= 0 and len(self._buf) > self._bstart

    @property
    def _pending_bulk_fd(self) -> int | None:
        """The bulk fd while a frame's bulk payload is partly read, else None."""
        return self._bfd if self._pbulk and self._fd >= 0 else None

    @property
    def _eof_wait(self) -> float | None:
        """Seconds left for a watched writer's death to show after end of file (a waiter then
        watches the liveness fd, not the fd at end of file), or None."""
        if self._eof_until < 0 or self._dead or self._liveness is None or self._fd < 0:
            return None
        return max(self._eof_until - time.monotonic(), 0.0)

    @property
    def _liveness_fd(self) -> int | None:
        """The watched writer's pidfd, readable once it died, or None."""
        return None if self._liveness is None else self._liveness.fd

    def _set_liveness(self, liveness: Any) -> None:
        """Watch the writer through ``liveness`` (None: stop watching). It has ``fd`` (a pidfd
        or None), ``poll_dead()`` and ``error(lost_bytes=, expected_bytes=)``."""
        self._liveness = liveness
        self._dead = False
        self._eof_until = -1.0
        self._poller = self._bpoller = None

    # -- writing -----------------------------------------------------------------------------

    def _write_sentinel(self, data: bytes) -> None:
        """Write a DEAD sentinel from the watcher thread (nothing once the connection is
        closed)."""
        if self._fd < 0:
            return
        self._write_parts([data])
        self._sentinel_sent += len(data)

    def _renew_locks_after_fork(self) -> None:
        """First use in a forked child: the inherited locks may be held by parent threads
        that do not exist here."""
        with _fork_lock:
            if self._gen != _fork_gen:
                self._rlock = threading.Lock()
                self._wlock = threading.Lock()
                # Calls of the parent's threads do not go on here; fds whose close waited for
                # one are left open, as after any close() that follows a fork. The wake fd is
                # the parent's (one eventfd shared by both): a close here must not wake the
                # parent's calls.
                self._slock = threading.Lock()
                self._users = 0
                self._blocked_reader = False  # a parent thread's read: a close must not wake it
                if self._read_waits == READ_WAITS_SOCKET:
                    self._read_waits = READ_WAITS_NONE  # the parent holds it too (see read_waits)
                self._deferred = None
                self._close_wake()
                self._poller = self._bpoller = None  # may be marked busy by a parent thread
                self._async_owner = 0
                self._gen = _fork_gen

    def _lock_write(self) -> None:
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        if not self._wlock.acquire(False):
            if self._async_owner == threading.get_ident():
                raise blocking_send_under_async_send()
            self._wlock.acquire()

    def _write_locked(self, fd: int, views: list[memoryview], one_frame: bool = False) -> None:
        """Write all of ``views`` to ``fd``; the caller holds the write lock. A full fd is
        waited for in a poll() with the wake fd, so a close() wakes the writer."""
        while True:
            self._woken()
            try:
                cap = self._wcap if fd == self._wfd else 0
                after = self._wframe if cap and one_frame else cap  # see _wire.record_limits
                _writev(fd, views, self._nowait_writes, cap, after)
                return
            except BlockingIOError:
                pass
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                self._nowait_writes = False  # no non-blocking writes here: blocking ones
                continue
            self._woken()
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            wake = self._wake_fd(-1.0)
            if wake >= 0:
                poller.register(wake, select.POLLIN)
            poller.poll()

    def _write_parts(self, parts: list[Any], one_frame: bool = False) -> None:
        """Write ``parts`` under the write lock; ``one_frame``: they are one whole frame (see
        _wire.record_limits)."""
        views = [memoryview(p).cast("B") for p in parts]
        self._enter()
        try:
            self._lock_write()
            try:
                self._write_locked(self._wfd, views, one_frame)
            finally:
                self._wlock.release()
        finally:
            self._leave()

    def _write_segments(self, segments: list[Any]) -> None:
        """Write ``[pipe_parts, bulk_payload, pipe_parts, ...]`` (see ``_pickling.dumps_bulk``)
        under one hold of the write lock: each BULK header reaches the pipe before its payload
        reaches the bulk fd."""
        self._enter()
        try:
            self._lock_write()
            try:
                for i, seg in enumerate(segments):
                    views = [memoryview(p).cast("B") for p in (seg if not i & 1 else [seg])]
                    self._write_locked(self._bwfd if i & 1 else self._wfd, views)
            finally:
                self._wlock.release()
        finally:
            self._leave()

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        self._check_writable()
        m = memoryview(buf)
        if m.itemsize > 1:
            m = m.cast("B")
        size = check_send_args(m.nbytes, offset, size)
        if size >= BULK_MIN and self._bwfd >= 0:
            segments = [[header(KIND_BULK, size)], m[offset : offset + size], []]
            self._write_segments(padded(segments) if self._wpad else segments)
            return
        parts = [header(KIND_DATA, size), m[offset : offset + size]]
        if self._wpad:
            parts.append(pad_frame(HEADER_SIZE + size))
        self._write_parts(parts, True)

    def _send_segments(self, segments: list[Any]) -> None:
        """Write one message given as ``[pipe_parts, bulk_payload, pipe_parts, ...]``."""
        self._check_writable()
        if self._wpad:
            segments = padded(segments)
        if len(segments) > 1:
            self._write_segments(segments)
        else:
            self._write_parts(segments[0])

    def _lock_write_nowait(self) -> bool:
        """Take the write lock if it is free: True if taken (asyncio sends hold it across
        awaits so that no thread writes inside their frame)."""
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        if not self._wlock.acquire(False):
            return False
        self._async_owner = threading.get_ident()
        return True

    def _unlock_write(self) -> None:
        if self._async_owner == 0:
            return  # forked while an asyncio send held it: the child's lock is another
        self._async_owner = 0
        self._wlock.release()

    def _write_nowait(self, parts: list[Any], bulk: bool) -> int:
        """Write ``parts`` to the pipe (the bulk fd when ``bulk``) without ever blocking: the
        bytes written, 0 when the fd is full, -1 when this system has no non-blocking write.
        The caller holds the write lock."""
        self._check_writable()
        fd = self._bwfd if bulk else self._wfd
        if _RWF_NOWAIT is None:
            return -1
        self._enter()
        try:
            cap = 0 if bulk else self._wcap
            return _writev(fd, list(parts[:_IOV_MAX]), nowait=True, cap=cap)
        except BlockingIOError as exc:
            return exc.characters_written
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                return -1
            raise
        finally:
            self._leave()

    # -- reading: the state machine ----------------------------------------------------------

    def _poll_once(self, deadline: float, bulk: bool = False) -> bool:
        """Wait until the fd (the bulk fd when ``bulk``) is readable: True if so, False if
        the deadline passed. Raises _Dead when the watched writer died and the fd has nothing
        left to read, and OSError when another thread closes the connection."""
        live = self._liveness
        fd = self._bfd if bulk else self._fd
        while True:
            self._woken()
            wait = None if deadline < 0 else max(deadline - time.monotonic(), 0.0)
            if self._dead:
                wait = 0.0
            elif live is not None and live.fd is None:
                wait = _LIVENESS_SLICE if wait is None else min(wait, _LIVENESS_SLICE)
            wake = self._wake_fd(-1.0 if wait is None else time.monotonic() + wait)
            watch = [fd] if live is None or live.fd is None else [fd, live.fd]
            if wake >= 0:
                watch.append(wake)
            if wait is not None and 0.0 < wait < _PRECISE_BELOW and max(watch) < _FD_SETSIZE:
                # poll() takes whole milliseconds, rounded up: a short deadline would be
                # missed by up to one. select() takes microseconds.
                ready = select.select(watch, [], [], wait)[0]
            else:
                poller = self._bpoller if bulk else self._poller
                if poller is None:
                    poller = select.poll()
                    for f in watch:
                        poller.register(f, _POLLIN if f == fd else select.POLLIN)
                    if bulk:
                        self._bpoller = poller
                    else:
                        self._poller = poller
                ready = [r for r, _ in poller.poll(poll_ms(wait))]
            if wake >= 0 and wake in ready:
                self._woken()  # only close() wakes; anything else is drained and ignored
                try:
                    os.read(wake, 8)
                except OSError:
                    pass
                continue
            if fd in ready:
                return True
            if live is not None and not self._dead and (ready or live.fd is None):
                if live.poll_dead():
                    self._dead = True
                    continue  # drain what the writer wrote before dying
            if self._dead:
                raise _Dead
            if deadline >= 0 and time.monotonic() >= deadline:
                return False

    def _read_into(
        self,
        view: Any,
        deadline: float,
        want: int = 0,
        bulk: bool = False,
        eager: bool = False,
    ) -> Any:
        """One read(): into ``view`` (the byte count, 0 at end of file), or when ``view`` is
        None, up to ``want`` bytes (bytes, empty at end of file); on a record socket, ``view``
        may be a function of the record's length (see _recv_record). Raises _Expired on the
        deadline, WriterDied when the watched writer died with nothing left to read, and
        OSError when another thread closes the connection. ``bulk`` reads the bulk fd instead
        of the pipe; ``eager`` tries a read before any wait. The waiting is in _poll_once, where
        a close() wakes it (a fd without a private non-blocking description is read once a wait
        found it readable), after a spin (see SPIN); only a read of a pipe or socket without a
        deadline or a watch waits in read(), woken by _wake_pipe_reader or _wake_socket_reader."""
        fd = self._bfd if bulk else self._fd
        ready = False  # a wait just found fd readable
        started = 0.0
        if deadline < 0 and not bulk and self._read_waits and self._liveness is None:
            # No deadline, nobody to watch: wait in read() itself (see _wake_pipe_reader and
            # _wake_socket_reader), after a spin (not for an eager read: its bytes are there).
            started = time.monotonic()
            timed = eager or not self._spin(fd, deadline)  # a spin counted its wait
            while True:
                with self._slock:
                    self._woken()
                    self._blocked_reader = True
                try:
                    if self._records:
                        data = self._recv_record(view, want, wait=True)
                    elif view is None:
                        data = os.read(fd, want)
                    else:
                        data = os.readv(fd, [view])
                except BlockingIOError:
                    break  # someone made the description non-blocking: wait in poll() below
                finally:
                    self._blocked_reader = False
                self._woken()  # closed meanwhile: what the read took (the wake) is dropped
                if timed:
                    self._note_wait(time.monotonic() - started)
                return data
        spun = bulk  # the spin (see SPIN) is over, or not for this read
        timed = not bulk  # this read's wait, if it waits, is still to be counted
        while True:
            self._woken()
            if not bulk and self._nfd == -1:
                self._nfd = _reopen_nonblocking(fd)
            nfd = -2 if bulk else self._nfd
            records = self._records and not bulk
            # Try a read first when the last poll found data already there: a reader behind
            # its writer then makes one syscall per read.
            if ready or ((nfd >= 0 or records) and (eager or not self._poll_first)):
                rfd = nfd if nfd >= 0 else fd
                try:
                    if records:
                        data = self._recv_record(view, want)
                    elif view is None:
                        data = os.read(rfd, want)
                    else:
                        data = os.readv(rfd, [view])
                except BlockingIOError:
                    pass  # nothing after all (another reader of the pipe took it)
                else:
                    if spun and timed:
                        self._note_wait(time.monotonic() - started)
                    return data
            if not spun:
                spun = True
                started = time.monotonic()
                if self._spin(fd, deadline):
                    ready = True
                    timed = False  # the spin counted this wait
                    continue
            try:
                if not self._poll_once(deadline, bulk):
                    raise _Expired
            except _Dead:
                lost, expected = self._lost()
                raise self._liveness.error(lost_bytes=lost, expected_bytes=expected) from None
            ready = True
            if not bulk:
                self._poll_first = time.monotonic() - started > _POLL_WAITED

    def _recv_record(self, view: Any, want: int, wait: bool = False) -> Any:
        """One record, whole, without blocking unless ``wait`` (BlockingIOError when there is
        none): into ``view`` (the byte count), or when ``view`` is None, as bytes (at most
        ``want``). ``view`` may be a function of the record's length that returns the view to
        read it into (the length is peeked first)."""
        sock = self._rsock
        if sock is None:
            raise closed()
        if callable(view):
            peek = socket.MSG_PEEK | socket.MSG_TRUNC | (0 if wait else socket.MSG_DONTWAIT)
            length = sock.recv_into(self._rpeek, 1, peek)
            if length == 0:
                return 0  # end of file
            into = view(length)
        elif view is None:
            if self._rscratch is None:
                self._rscratch = bytearray(_READ_CHUNK)
            # a frame's later record may be longer than the buffer (see _wire.record_limits)
            into = memoryview(self._rscratch if want <= _READ_CHUNK else bytearray(want))[:want]
        else:
            into = view
        n = sock.recv_into(into, into.nbytes, socket.MSG_TRUNC if wait else _RECORD_FLAGS)
        if n > into.nbytes:  # the kernel dropped the rest of the record
            raise self._break(record_too_long(into.nbytes, self._consumed))
        return n if view is not None else into[:n].tobytes()

    def _note_wait(self, waited: float) -> None:
        """Count a wait for data of ``waited`` seconds into the average that decides spins."""
        self._waited = next_average(self._waited, waited)

    def _spin(self, fd: int, deadline: float) -> bool:
        """Before a read of ``fd`` sleeps: look without sleeping for up to the spin window
        (SPIN, or SPIN_ALONE; never past the deadline), when that pays (see SPIN). True when
        ``fd`` became readable meanwhile."""
        window = spin_window()
        if self._dead or not SPIN_FLOOR <= self._waited < window or not may_spin():
            return False
        begun = time.monotonic()
        until = begun + window
        if 0.0 <= deadline < until:
            if deadline <= begun:
                return False  # only a look: the caller's own
            until = deadline
        poller = self._spollers.get(fd)
        if poller is None:
            poller = self._spollers[fd] = select.poll()
            poller.register(fd, _POLLIN)
        while True:
            if poller.poll(0):
                self._note_wait(time.monotonic() - begun)
                return True
            if time.monotonic() >= until:
                return False
            os.sched_yield()  # a thread waiting for this CPU runs first

    def _fill(self, deadline: float, want: int) -> None:
        """Read up to ``want`` more bytes into the buffer; with read-ahead, up to a chunk."""
        if self._bstart:
            del self._buf[: self._bstart]
            self._bstart = 0
        if self._read_ahead or self._records or want > _READ_CHUNK:
            want = _READ_CHUNK
        data = self._read_into(None, deadline, want)
        if not data:
            self._at_eof(deadline)
        self._buf += data

    def _lost(self) -> tuple[int, int | None]:
        """``(bytes of the frame in progress that arrived, its size with header)``; the size
        is None between frames (then the bytes are those of the next header)."""
        avail = len(self._buf) - self._bstart
        if self._pkind < 0:
            lost, expected = avail, None
        else:
            lost, expected = HEADER_SIZE + self._pgot + avail, HEADER_SIZE + self._plen
            if self._pbulk:  # a DEAD sentinel waits in the pipe, not in this payload
                return lost, expected
        peer = self._peer() if self._peer is not None else None
        seen = peer._sentinel_sent if peer is not None else 0
        return max(lost - seen, 0), expected

    def _writer_is_dead(self, deadline: float) -> bool:
        """At end of file: whether the watched writer died. A writer's end of the pipe closes
        before its death shows (an interpreter closes its fds on the way out), so this waits
        for the death until a grace window, opened by the first end of file seen, closes. A
        read whose deadline comes first raises _Expired: a later read decides, so the same
        exit always gives the same error."""
        live = self._liveness
        if live is None:
            return False
        if self._dead:
            return True
        spin = 0.0
        if self._eof_until < 0:
            self._eof_until = time.monotonic() + DEATH_GRACE
            spin = time.monotonic() + DEATH_SPIN  # the first look does not sleep
        end = self._eof_until
        expire = 0.0 <= deadline < end
        if expire:
            end = deadline
        while True:
            if live.poll_dead():
                self._dead = True
                return True
            if time.monotonic() < spin:
                continue
            left = end - time.monotonic()
            if left <= 0:
                if expire:
                    raise _Expired
                return False
            self._woken()
            if live.fd is None:  # no pidfd: look again soon
                time.sleep(min(_LIVENESS_SLICE, left))
                continue
            wake = self._wake_fd(end)
            select.select([live.fd] if wake < 0 else [live.fd, wake], [], [], left)

    def _at_eof(self, deadline: float) -> None:
        avail = len(self._buf) - self._bstart
        in_frame = self._pkind >= 0 or avail > 0
        if self._writer_is_dead(deadline):
            lost, expected = self._lost()
            raise self._liveness.error(lost_bytes=lost, expected_bytes=expected)
        if in_frame:
            lost, expected = self._lost()
            raise truncated(lost, expected if expected is not None else HEADER_SIZE)
        raise EOFError

    def _consume(self, n: int) -> None:
        """Drop the buffer's next ``n`` bytes."""
        self._bstart += n
        self._consumed += n

    def _break(self, exc: BaseException) -> BaseException:
        """Mark the stream broken by ``exc`` (every later read raises it); returns ``exc``."""
        self._broken = exc
        return exc

    def _drop_pad_after_frame(self) -> None:
        """After a whole frame: drop the PAD that follows it (see _wire.PAD_MIN), reading what
        is not in the buffer yet only by a look that never waits. Nothing here raises: the
        frame must reach its caller. A PAD not all there (its writer is not framepipe's) or a
        bad header is left to the next read."""
        while True:
            s = self._bstart
            avail = len(self._buf) - s
            if avail <= 0 or self._buf[s] != KIND_PAD:
                return
            status, _, value, size = decode_header(self._buf, s, self._cap)
            if status == OK:
                size = HEADER_SIZE + value
                if avail >= size:
                    self._consume(size)
                    return
            elif status != MORE:
                return
            try:
                self._fill(0.0, size - avail)  # a deadline long past: only a look
            except Exception:  # noqa: BLE001 - the next read finishes the PAD or reports it
                return

    def _read_header(self, deadline: float) -> None:
        while True:
            s = self._bstart
            status, kind, value, size = decode_header(self._buf, s, self._cap)
            if status == OK:
                if kind != KIND_PAD:
                    break
                # A PAD (see _wire.PAD_MIN), dropped whole: its bytes came in the same write as
                # the message before it, so reading its rest never waits. In a loop: any number
                # of them costs no stack.
                avail, size = len(self._buf) - s, HEADER_SIZE + value
                if avail >= size:
                    self._consume(size)
                else:
                    self._fill(deadline, size - avail)
                continue
            if status != MORE:
                head = bytes(self._buf[s : s + HEADER_SIZE])
                raise self._break(bad_header(status, head, value, self._max_size, self._consumed))
            avail = len(self._buf) - s
            if avail == 0 and self._rpad and self._object is None:
                self._fill(deadline, PAD_MIN)  # a message's start: small ones whole (PAD_MIN)
            else:  # the kind unknown yet, ask for a whole header: most frames' header in one read
                self._fill(deadline, (HEADER_SIZE if kind < 0 else size) - avail)
        if kind == KIND_TIMEOUT:
            self._consume(size)
            raise sentinel_timeout()
        if kind == KIND_DEAD:
            self._consume(size)
            # Only a watched writer's death is remembered: without a watch there is nothing to
            # report it again with, and a later read is an ordinary read.
            self._dead = self._liveness is not None
            raise self._dead_sentinel(value)
        if kind == KIND_BULK and self._bfd < 0:
            raise self._break(no_bulk_channel(value, self._consumed))
        self._pbulk = kind == KIND_BULK
        if self._pbulk:
            # a data frame at a message boundary, a buffer inside an object
            kind = KIND_DATA if self._object is None else KIND_BUFFER
        self._consume(size)
        self._pkind, self._plen, self._pgot = kind, value, 0

    def _pump(self, deadline: float) -> None:
        """Fill the pending frame's destination until it is complete."""
        n = self._plen
        if self._pbulk:
            self._pump_bulk(deadline)
            return
        while self._pgot < n:
            got = self._pgot
            avail = len(self._buf) - self._bstart
            if avail:
                take = min(avail, n - got)
                if not self._pdiscard:
                    s = self._bstart
                    self._room(got + take)
                    self._pdest[got : got + take] = self._buf[s : s + take]
                self._bstart += take
                self._consumed += take
                self._pgot = got + take
            elif (
                n - got >= RECORD_MAX
                if self._records
                else not self._pdiscard and (n - got >= _DIRECT_MIN or not self._read_ahead)
            ):
                if self._pdiscard:  # a record dropped whole: it may be longer than the buffer
                    k = len(self._read_into(None, deadline, min(n - got, FRAME_RECORD_MAX)))
                elif self._records:  # room for the record that came, once its length is known
                    k = self._read_into(self._record_room, deadline, eager=got == 0)
                else:  # the payload's first bytes came with its header: read before polling
                    k = self._read_into(self._room(got + 1), deadline, eager=got == 0)
                if k == 0:
                    self._at_eof(deadline)
                self._pgot = got + k
                self._consumed += k
            else:
                self._fill(deadline, n - got)

    def _room(self, need: int, length: int | None = None) -> memoryview:
        """Grow the pending frame's buffer to hold ``need`` bytes (doubling, up to the
        frame's size: it grows with what arrives, see _GROW_FIRST); returns the view of its
        room after the bytes already there (``length`` bytes of it when given). The view is
        released by the next call or by _release_room, so the buffer can grow again whatever
        still refers to the view (a traceback's frames)."""
        self._release_room()
        dest = self._pdest
        have = len(dest)
        if need > have:
            dest += bytes(min(self._plen, max(need, 2 * have)) - have)  # calloc'd zeros
        got = self._pgot
        # never past the frame's end: a caller's buffer (recv_bytes_into) may be larger
        end = min(len(dest), self._plen) if length is None else got + length
        view = self._rview = memoryview(dest)[got:end]
        return view

    def _release_room(self) -> None:
        view, self._rview = self._rview, None
        if view is not None:
            view.release()

    def _record_room(self, length: int) -> memoryview:
        """The view a record of ``length`` bytes is read into (see _recv_record)."""
        got = self._pgot
        return self._room(min(got + length, self._plen), min(length, self._plen - got))

    def _pump_bulk(self, deadline: float) -> None:
        """Read the pending frame's payload from the bulk fd, straight into its destination."""
        n = self._plen
        while self._pgot < n:
            got = self._pgot
            if self._pdiscard:
                k = len(self._read_into(None, deadline, min(n - got, _READ_CHUNK), True))
            else:
                k = self._read_into(self._room(got + 1), deadline, bulk=True)
            if k == 0:
                self._at_eof(deadline)
            self._pgot = got + k

    def _frame(
        self, deadline: float, maxlength: int, into: memoryview | None, mutable: bool
    ) -> tuple[int, Any]:
        """Read one whole frame: ``(kind, payload)``. The payload is bytes (a bytearray when
        ``mutable``), or the byte count when it was read into ``into``. A data frame over
        ``maxlength`` (when >= 0) is read and discarded: MessageTooLong."""
        if self._broken is not None:
            raise broken(self._broken)
        if self._pkind < 0:
            self._read_header(deadline)
            n = self._plen
            self._pexternal = self._pdiscard = False
            if 0 <= maxlength < n and self._pkind == KIND_DATA:
                self._pdiscard = True
                self._pdest = maxlength
            elif into is not None and self._pkind == KIND_DATA and n <= into.nbytes:
                self._pdest, self._pexternal = into, True
            else:
                try:
                    if n > _GROW_FIRST:
                        bytes(n)  # can n bytes be had? calloc maps them, touching none
                    self._pdest = bytearray(min(n, _GROW_FIRST))
                except MemoryError:
                    self._pkind, self._pbulk = -1, False
                    offset = self._consumed - HEADER_SIZE
                    raise self._break(unallocatable(n, offset)) from None
        try:
            self._pump(deadline)
        except BaseException:
            if self._pexternal:  # keep what arrived; the caller's buffer is theirs again
                own = bytearray(self._pdest[: self._pgot])  # grows on as the rest arrives
                self._pdest, self._pexternal = own, False
            raise
        finally:
            self._release_room()
        kind, dest, n = self._pkind, self._pdest, self._plen
        self._pkind, self._pdest, self._pbulk = -1, None, False
        self._drop_pad_after_frame()  # the fd readable again only if a message is there
        if self._pdiscard:
            raise MessageTooLong(n, dest)
        if self._pexternal:
            return kind, n
        if into is not None and kind == KIND_DATA and n <= into.nbytes:
            into[:n] = dest
            return kind, n
        return kind, (dest if mutable else bytes(dest))

    def _read_frame(self, deadline: float, mutable: bool) -> tuple[int, Any]:
        """The next frame, ``(kind, payload)``, for a message hook that holds the read lock
        (the out-of-band buffers of an object: a bytearray when ``mutable``)."""
        return self._frame(deadline, -1, None, mutable)

    def _lock_read(self, deadline: float) -> None:
        """Begin a read: take the read lock (readers queue, never interleave) before
        ``deadline``; end it with _unlock_read."""
        self._enter()
        try:
            if deadline < 0:
                self._rlock.acquire()
            elif not self._rlock.acquire(False) and not self._rlock.acquire(
                timeout=min(max(deadline - time.monotonic(), 0.0), threading.TIMEOUT_MAX)
            ):
                raise _Expired
        except BaseException:  # _Expired, or a signal handler's error while it waited
            self._leave()
            raise
        if self._fd < 0:  # closed while this call waited for the reader before it
            self._unlock_read()
            raise closed_while_waiting()

    def _unlock_read(self) -> None:
        self._rlock.release()
        self._leave()

    # -- reading: the public calls -----------------------------------------------------------

    def recv_bytes(self, maxlength: int | None = None, *, timeout: float | None = None) -> bytes:
        self._check_readable()
        maxl = -1
        if maxlength is not None:
            if maxlength < 0:
                raise ValueError("negative maxlength")
            maxl = maxlength
        deadline = _deadline(timeout)
        try:
            self._lock_read(deadline)
            try:
                kind, payload = -1, None
                if self._object is None:
                    kind, payload = self._frame(deadline, maxl, None, False)
                    if kind == KIND_DATA:
                        return payload  # type: ignore[no-any-return]
                return self._message(kind, payload, deadline, True, maxl)  # type: ignore[no-any-return]
            finally:
                self._unlock_read()
        except _Expired:
            raise timeout_error(timeout, *self._lost(), watched(self)) from None

    def recv_bytes_into(self, buf: Any, offset: int = 0, *, timeout: float | None = None) -> int:
        self._check_readable()
        with memoryview(buf) as m:
            nbytes = m.nbytes
            if offset < 0:
                raise ValueError("negative offset")
            if offset > nbytes:
                raise ValueError("offset too large")
            flat = m.cast("B") if m.ndim != 1 or m.format != "B" else m
            if flat.readonly:
                raise TypeError("recv_bytes_into() argument must be a writable buffer")
            if not flat.c_contiguous:  # refused before anything is read (as the C engine)
                raise BufferError("memoryview: underlying buffer is not C-contiguous")
            into = flat[offset:]
            deadline = _deadline(timeout)
            try:
                self._lock_read(deadline)
                try:
                    kind, result = -1, None  # type: tuple[int, Any]
                    if self._object is None:
                        kind, result = self._frame(deadline, -1, into, False)
                    if kind != KIND_DATA:
                        result = self._message(kind, result, deadline, True, -1)
                finally:
                    self._unlock_read()
            except _Expired:
                raise timeout_error(timeout, *self._lost(), watched(self)) from None
            if isinstance(result, int):
                return result
            if len(result) > into.nbytes:
                raise BufferTooShort(result)
            into[: len(result)] = result
            return len(result)

    def recv(self, *, timeout: float | None = None) -> Any:
        self._check_readable()
        deadline = _deadline(timeout)
        try:
            self._lock_read(deadline)
            try:
                kind, payload = -1, None
                if self._object is None:
                    kind, payload = self._frame(deadline, -1, None, False)
                    if kind == KIND_DATA:
                        return pickle.loads(payload)
                return self._message(kind, payload, deadline, False, -1)
            finally:
                self._unlock_read()
        except _Expired:
            raise timeout_error(timeout, *self._lost(), watched(self)) from None

    def poll(self, timeout: float | None = 0.0) -> bool:
        self._check_readable()
        if len(self._buf) > self._bstart and not self._pbulk:
            return True
        deadline = _deadline(timeout)
        self._enter()
        try:
            started = time.monotonic()
            if self._spin(self._bfd if self._pbulk else self._fd, deadline):
                return True
            ready = self._poll_once(deadline, self._pbulk)
            if ready:
                self._note_wait(time.monotonic() - started)
            return ready
        except _Dead:
            return True
        finally:
            self._leave()
