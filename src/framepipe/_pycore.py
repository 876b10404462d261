"""The pure-Python core: the executable specification of framepipe's compiled core.

Same classes, names, parameters, errors and bytes on the wire as ``framepipe._core``. It runs
where the extension is not built, and under ``FRAMEPIPE_NO_EXTENSIONS=1``.
"""

from __future__ import annotations

import errno
import os
import select
import stat
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

from . import _frames as F
from ._api import build_api
from .errors import BufferTooShort, MessageTooLong

__all__ = ["Connection", "Pipe", "pipe"]

_READ_CHUNK = 64 * 1024  # read-ahead buffer: many small frames per read()
_DIRECT_MIN = 16 * 1024  # a remainder at least this large is read straight into its frame
_DEATH_GRACE = 0.1  # after EOF, how long to wait for a watched writer's death to show
_IOV_MAX = 1024
_LIVENESS_SLICE = 0.01  # without a pidfd, a dead writer is noticed within this many seconds
_POLLIN = select.POLLIN | select.POLLPRI | select.POLLHUP | select.POLLERR
_RWF_NOWAIT: int | None = getattr(os, "RWF_NOWAIT", None) if hasattr(os, "pwritev") else None
_PRECISE_BELOW = 0.1  # waits shorter than this use select(), whose timeout is in microseconds
_FD_SETSIZE = 1024  # select() cannot watch fds from this number up
_POLL_WAITED = 20e-6  # a poll() that took longer had to wait for data


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


def _deadline(timeout: float | None) -> float | None:
    t = F.check_timeout(timeout)
    if t is None:
        return None
    return time.monotonic() + max(t, 0.0)


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


class Connection:
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
    whatever ``closefd`` says.

    ``bulk_handle`` adds a bulk channel (a stream socket, made by :func:`pipe`): payloads of
    16 KiB or more are written to it while their frame header still goes through ``handle``
    in order, and a reader takes them from its own ``bulk_handle``. As with ``write_handle``,
    ``bulk_write_handle`` gives a duplex connection a separate bulk fd to write.
    """

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
    ) -> None:
        handle, wfd = F.check_handles(handle, readable, writable, write_handle)
        bfd, bwfd = F.check_bulk_handles(bulk_handle, bulk_write_handle, readable, writable)
        if max_size is not None and max_size < 0:
            raise ValueError("max_size must be None or a non-negative number of bytes")
        self._gen = _fork_gen
        # Guards the fd fields against close() while the watcher writes a DEAD sentinel:
        # _sentinels such writes under way, _deferred the fds a close() left for them to close.
        self._slock = threading.Lock()
        self._sentinels = 0
        self._deferred: tuple[int, int, int, int] | None = None
        self._fd = handle
        self._wfd = wfd
        self._bfd = bfd  # bulk payloads are read from here (-1: no bulk channel)
        self._bwfd = bwfd  # and written here
        self._bpoller: Any = None
        self._pbulk = False  # the pending frame's payload comes from the bulk fd
        self._readable = bool(readable)
        self._writable = bool(writable)
        self._max_size = max_size
        self._cap = F.frame_cap(max_size)
        self._closefd = closefd
        self._read_ahead = bool(read_ahead)
        try:
            self._is_socket = stat.S_ISSOCK(os.fstat(handle).st_mode)
        except OSError:
            self._is_socket = False  # like the stdlib: a bad handle fails on first use
        self._ids = tuple(F.fd_identity(fd) if fd >= 0 else None for fd in (handle, wfd, bfd, bwfd))
        self._async_owner = 0  # the thread whose asyncio send holds the write lock, or 0
        self._nfd = -1  # a private O_NONBLOCK description of the pipe (-1: not yet, -2: none)
        self._poll_first = False
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
        self._object: Any = None  # (pickle, table, buffers) of an object being received
        self._broken: BaseException | None = None
        self._liveness: Any = None
        self._watch_handle: Any = None
        self._dead = False
        self._peer: Any = None
        self._poller: Any = None
        self._sentinel_sent = 0

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

    def fileno(self) -> int:
        """File descriptor or handle of the connection."""
        self._check_closed()
        return self._fd

    def close(self) -> None:
        """Close the connection (its fd once, if it owns it) and stop watching the writer."""
        if self._fd >= 0:
            if self._gen != _fork_gen:
                self._renew_locks_after_fork()
            with self._slock:
                fd, wfd, bfd, bwfd = self._fd, self._wfd, self._bfd, self._bwfd
                if fd < 0:
                    return  # closed by another thread meanwhile
                self._fd = self._wfd = self._bfd = self._bwfd = -1
                # The watcher thread is writing a DEAD sentinel to wfd: the fds stay open (and
                # their numbers taken) until that write is done, or it could land in whatever
                # took the number next. The sentinel writer closes them (_write_sentinel).
                defer = self._sentinels > 0 and self._closefd
                if defer:
                    self._deferred = (fd, wfd, bfd, bwfd)
            if self._nfd >= 0:
                os.close(self._nfd)  # ours whatever closefd says
                self._nfd = -1
            F.stop_watch(self._liveness, self._watch_handle)
            self._liveness = self._watch_handle = None
            if self._closefd and not defer:
                F.close_owned((fd, wfd, bfd, bwfd), self._ids)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - a finalizer never raises
            pass

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._fd < 0 else f"fd={self._fd}"
        mode = ("r" if self._readable else "") + ("w" if self._writable else "")
        return f"<framepipe.Connection {state} {mode} python>"

    def _check_closed(self) -> None:
        if self._fd < 0:
            raise OSError("handle is closed")

    def _check_readable(self) -> None:
        if not self._readable:
            raise OSError("connection is write-only")

    def _check_writable(self) -> None:
        if not self._writable:
            raise OSError("connection is read-only")

    # -- liveness ----------------------------------------------------------------------------

    def watch(self, target: Any) -> Connection:
        """Watch the process that writes to this connection.

        ``target`` is a pid, a started ``multiprocessing.Process`` or a ``subprocess.Popen``.
        While reading, the writer's death (any exit code, or a signal) raises
        :class:`framepipe.WriterDied` once the frames it wrote before dying are delivered.
        Returns the connection. ``watch(None)`` stops watching.
        """
        self._check_closed()
        F.check_watch(target, self._readable)
        F.stop_watch(self._liveness, self._watch_handle)
        self._liveness = self._watch_handle = None
        self._dead = False
        self._poller = self._bpoller = None
        if target is not None:
            self._liveness, self._watch_handle = F.start_watch(target, self._peer)
        return self

    def _write_sentinel(self, data: bytes) -> None:
        """Write a DEAD sentinel from the watcher thread. A close() from another thread while
        it is on its way leaves the fds to be closed here, once the write is done."""
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        with self._slock:
            if self._fd < 0:
                return
            self._sentinels += 1
        try:
            self._write_parts([data])
            self._sentinel_sent += len(data)
        finally:
            with self._slock:
                self._sentinels -= 1
                deferred = self._deferred if self._sentinels == 0 else None
                if deferred is not None:
                    self._deferred = None
            if deferred is not None:
                F.close_owned(deferred, self._ids)

    # -- writing -----------------------------------------------------------------------------

    def _renew_locks_after_fork(self) -> None:
        """First use in a forked child: the inherited locks may be held by parent threads
        that do not exist here."""
        with _fork_lock:
            if self._gen != _fork_gen:
                self._rlock = threading.Lock()
                self._wlock = threading.Lock()
                # Sentinel writes of the parent's watcher thread do not go on here; fds whose
                # close waited for one are left open, as after any close() that follows a fork.
                self._slock = threading.Lock()
                self._sentinels = 0
                self._deferred = None
                self._poller = self._bpoller = None  # may be marked busy by a parent thread
                self._async_owner = 0
                self._gen = _fork_gen

    def _lock_write(self) -> None:
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        if not self._wlock.acquire(False):
            if self._async_owner == threading.get_ident():
                raise F.blocking_send_under_async_send()
            self._wlock.acquire()

    def _write_parts(self, parts: list[Any]) -> None:
        views = [memoryview(p).cast("B") for p in parts]
        self._lock_write()
        try:
            fd = self._wfd
            if fd < 0:
                raise OSError("handle is closed")
            _writev_all(fd, views)
        finally:
            self._wlock.release()

    def _write_segments(self, segments: list[Any]) -> None:
        """Write ``[pipe_parts, bulk_payload, pipe_parts, ...]`` (see ``F.dumps_bulk``) under
        one hold of the write lock: each BULK header reaches the pipe before its payload
        reaches the bulk fd."""
        self._lock_write()
        try:
            for i, seg in enumerate(segments):
                fd = self._bwfd if i & 1 else self._wfd
                if fd < 0:
                    raise OSError("handle is closed")
                views = [memoryview(p).cast("B") for p in (seg if not i & 1 else [seg])]
                _writev_all(fd, views)
        finally:
            self._wlock.release()

    def send_bytes(self, buf: Any, offset: int = 0, size: int | None = None) -> None:
        """Send the bytes of ``buf[offset:offset+size]`` (a bytes-like object) as one frame."""
        self._check_closed()
        self._check_writable()
        m = memoryview(buf)
        if m.itemsize > 1:
            m = m.cast("B")
        size = F.check_send_args(m.nbytes, offset, size)
        if size >= F.BULK_MIN and self._bwfd >= 0:
            payload = m[offset : offset + size]
            self._write_segments([[F.header(F.KIND_BULK, size)], payload, []])
            return
        self._write_parts([F.header(F.KIND_DATA, size), m[offset : offset + size]])

    def send(self, obj: Any) -> None:
        """Send a picklable object (pickle protocol 5; buffers of 64 KiB or more out of band)."""
        self._check_closed()
        self._check_writable()
        if self._bwfd >= 0:
            segments = F.dumps_bulk(obj, F.BULK_MIN)
            if len(segments) > 1:
                self._write_segments(segments)
                return
            self._write_parts(segments[0])
            return
        self._write_parts(F.dumps(obj))

    def send_exception(self, exc: BaseException) -> None:
        """Send ``exc`` as an error frame: the reader's ``recv`` or ``recv_bytes`` raises it."""
        from .remote import dumps_exception

        self._check_closed()
        self._check_writable()
        F.check_exception(exc)
        payload = dumps_exception(exc)
        self._write_parts([F.header(F.KIND_ERROR, len(payload)), payload])

    # -- reading: the state machine ----------------------------------------------------------

    def _poll_once(self, deadline: float | None, bulk: bool = False) -> bool:
        """Wait until the fd (the bulk fd when ``bulk``) is readable: True if so, False if
        the deadline passed. Raises _Dead when the watched writer died and the fd has nothing
        left to read."""
        live = self._liveness
        fd = self._bfd if bulk else self._fd
        poller = self._bpoller if bulk else self._poller
        if poller is None:
            poller = select.poll()
            poller.register(fd, _POLLIN)
            if live is not None and live.fd is not None:
                poller.register(live.fd, select.POLLIN)
            if bulk:
                self._bpoller = poller
            else:
                self._poller = poller
        while True:
            wait = None if deadline is None else max(deadline - time.monotonic(), 0.0)
            if self._dead:
                wait = 0.0
            elif live is not None and live.fd is None:
                wait = _LIVENESS_SLICE if wait is None else min(wait, _LIVENESS_SLICE)
            if wait is not None and 0.0 < wait < _PRECISE_BELOW and fd < _FD_SETSIZE:
                # poll() takes whole milliseconds, rounded up: a short deadline would be
                # missed by up to one. select() takes microseconds.
                watch = [fd] if live is None or live.fd is None else [fd, live.fd]
                if max(watch) < _FD_SETSIZE:
                    ready = [(r, 0) for r in select.select(watch, [], [], wait)[0]]
                else:
                    ready = poller.poll(wait * 1000.0)
            else:
                ready = poller.poll(None if wait is None else wait * 1000.0)
            if any(rfd == fd for rfd, _ in ready):
                return True
            if live is not None and not self._dead and (ready or live.fd is None):
                if live.poll_dead():
                    self._dead = True
                    continue  # drain what the writer wrote before dying
            if self._dead:
                raise _Dead
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def _read_into(
        self, view: memoryview | None, deadline: float | None, want: int = 0, bulk: bool = False
    ) -> Any:
        """One read(): into ``view`` (the byte count, 0 at end of file), or when ``view`` is
        None, up to ``want`` bytes (bytes, empty at end of file). Raises _Expired on the
        deadline and WriterDied when the watched writer died with nothing left to read.
        ``bulk`` reads the bulk fd instead of the pipe."""
        fd = self._bfd if bulk else self._fd
        while True:
            if deadline is not None or self._liveness is not None:
                if not bulk:
                    # Try a read first when the last poll found data already there: a
                    # reader behind its writer then makes one syscall per read.
                    if self._nfd == -1:
                        self._nfd = _reopen_nonblocking(fd)
                    if self._nfd >= 0 and not self._poll_first:
                        try:
                            if view is None:
                                return os.read(self._nfd, want)
                            return os.readv(self._nfd, [view])
                        except BlockingIOError:
                            pass
                    started = time.monotonic()
                try:
                    if not self._poll_once(deadline, bulk):
                        raise _Expired
                except _Dead:
                    lost, expected = self._lost()
                    raise F.writer_died(self._liveness, lost, expected) from None
                if not bulk:
                    self._poll_first = time.monotonic() - started > _POLL_WAITED
            try:
                if view is None:
                    return os.read(fd, want)
                return os.readv(fd, [view])
            except BlockingIOError:
                continue

    def _fill(self, deadline: float | None, want: int) -> None:
        """Read up to ``want`` more bytes into the buffer; with read-ahead, up to a chunk."""
        if self._bstart:
            del self._buf[: self._bstart]
            self._bstart = 0
        if self._read_ahead or want > _READ_CHUNK:
            want = _READ_CHUNK
        data = self._read_into(None, deadline, want)
        if not data:
            self._at_eof()
        self._buf += data

    def _lost(self) -> tuple[int, int | None]:
        avail = len(self._buf) - self._bstart
        if self._pkind < 0:
            lost, expected = avail, None
        else:
            lost, expected = F.HEADER_SIZE + self._pgot + avail, F.HEADER_SIZE + self._plen
            if self._pbulk:  # a DEAD sentinel waits in the pipe, not in this payload
                return lost, expected
        return max(lost - self._sentinel_seen(), 0), expected

    def _sentinel_seen(self) -> int:
        peer = self._peer() if self._peer is not None else None
        return peer._sentinel_sent if peer is not None else 0

    def _writer_is_dead(self) -> bool:
        live = self._liveness
        if live is None:
            return False
        if self._dead:
            return True
        end = time.monotonic() + _DEATH_GRACE
        while True:
            if live.poll_dead():
                self._dead = True
                return True
            if time.monotonic() >= end:
                return False
            if live.fd is not None:
                select.select([live.fd], [], [], max(end - time.monotonic(), 0.0))
            else:
                time.sleep(0.002)

    def _at_eof(self) -> None:
        avail = len(self._buf) - self._bstart
        in_frame = self._pkind >= 0 or avail > 0
        if self._writer_is_dead():
            lost, expected = self._lost()
            raise F.writer_died(self._liveness, lost, expected)
        if in_frame:
            lost, expected = self._lost()
            raise F.truncated(lost, expected if expected is not None else F.HEADER_SIZE)
        raise EOFError

    def _consume(self, n: int) -> bytes:
        s = self._bstart
        data = bytes(self._buf[s : s + n])
        self._bstart = s + n
        self._consumed += n
        return data

    def _break(self, exc: BaseException) -> BaseException:
        self._broken = exc
        return exc

    def _read_header(self, deadline: float | None) -> None:
        while True:
            avail = len(self._buf) - self._bstart
            if avail >= 2:
                s = self._bstart
                check = bytes(self._buf[s : s + 2])
                kind = F.KIND_BY_CHECK.get(check)
                if kind is None:
                    raise self._break(F.bad_check(check, self._consumed, "at a frame boundary"))
                if kind == F.KIND_TIMEOUT:
                    self._consume(2)
                    raise F.sentinel_timeout()
                if kind == F.KIND_DEAD and avail >= F.DEAD_SIZE:
                    data = self._consume(F.DEAD_SIZE)
                    # Only a watched writer's death is remembered: without a watch there is
                    # nothing to report it again with, and a later read is an ordinary read.
                    self._dead = self._liveness is not None
                    raise F.dead_error(F.dead_status(data[2:]), self._liveness)
                if kind != F.KIND_DEAD and avail >= F.HEADER_SIZE:
                    second = bytes(self._buf[s + 10 : s + 12])
                    if second != check:
                        raise self._break(F.mismatched_checks(check, second, self._consumed))
                    (length,) = F.LENGTH.unpack_from(self._buf, s + 2)
                    if length > self._cap:
                        raise self._break(F.too_large(length, self._max_size, self._consumed))
                    if kind == F.KIND_BULK and self._bfd < 0:
                        raise self._break(F.no_bulk_channel(length, self._consumed))
                    self._pbulk = kind == F.KIND_BULK
                    if self._pbulk:
                        # a data frame at a message boundary, a buffer inside an object
                        kind = F.KIND_DATA if self._object is None else F.KIND_BUFFER
                    self._consume(F.HEADER_SIZE)
                    self._pkind, self._plen, self._pgot = kind, length, 0
                    return
            self._fill(deadline, F.HEADER_SIZE - avail)

    def _pump(self, deadline: float | None) -> None:
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
                    self._pdest[got : got + take] = self._buf[s : s + take]
                self._bstart += take
                self._consumed += take
                self._pgot = got + take
            elif not self._pdiscard and (n - got >= _DIRECT_MIN or not self._read_ahead):
                k = self._read_into(memoryview(self._pdest)[got:n], deadline)
                if k == 0:
                    self._at_eof()
                self._pgot = got + k
                self._consumed += k
            else:
                self._fill(deadline, n - got)

    def _pump_bulk(self, deadline: float | None) -> None:
        """Read the pending frame's payload from the bulk fd, straight into its destination."""
        n = self._plen
        while self._pgot < n:
            got = self._pgot
            if self._pdiscard:
                k = len(self._read_into(None, deadline, min(n - got, _READ_CHUNK), True))
            else:
                k = self._read_into(memoryview(self._pdest)[got:n], deadline, bulk=True)
            if k == 0:
                self._at_eof()
            self._pgot = got + k

    def _read_frame(
        self,
        deadline: float | None,
        maxlength: int | None = None,
        into: memoryview | None = None,
        mutable: bool = False,
    ) -> tuple[int, Any]:
        """Read one whole frame: ``(kind, payload)``. The payload is bytes (a bytearray when
        ``mutable``), or the byte count when it was read into ``into``."""
        if self._broken is not None:
            raise F.broken(self._broken)
        if self._pkind < 0:
            self._read_header(deadline)
            n = self._plen
            self._pexternal = self._pdiscard = False
            if maxlength is not None and n > maxlength and self._pkind == F.KIND_DATA:
                self._pdiscard = True
                self._pdest = maxlength
            elif into is not None and self._pkind == F.KIND_DATA and n <= into.nbytes:
                self._pdest, self._pexternal = into, True
            else:
                try:
                    self._pdest = bytearray(n)
                except MemoryError:
                    self._pkind, self._pbulk = -1, False
                    offset = self._consumed - F.HEADER_SIZE
                    raise self._break(F.unallocatable(n, offset)) from None
        try:
            self._pump(deadline)
        except BaseException:
            if self._pexternal:  # keep what arrived; the caller's buffer is theirs again
                own = bytearray(self._plen)
                own[: self._pgot] = self._pdest[: self._pgot]
                self._pdest, self._pexternal = own, False
            raise
        kind, dest, n = self._pkind, self._pdest, self._plen
        self._pkind, self._pdest, self._pbulk = -1, None, False
        if self._pdiscard:
            raise MessageTooLong(n, dest)
        if self._pexternal:
            return kind, n
        if into is not None and kind == F.KIND_DATA and n <= into.nbytes:
            into[:n] = dest
            return kind, n
        return kind, (dest if mutable else bytes(dest))

    def _locked(self, timeout: float | None, read: Callable[[float | None], Any]) -> Any:
        """Run ``read(deadline)`` holding the read lock (readers queue, never interleave)."""
        deadline = _deadline(timeout)
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        try:
            if deadline is None:
                self._rlock.acquire()
            elif not self._rlock.acquire(False) and not self._rlock.acquire(
                timeout=max(deadline - time.monotonic(), 0.0)
            ):
                raise _Expired
            try:
                return read(deadline)
            finally:
                self._rlock.release()
        except _Expired:
            raise F.timeout_error(timeout, *self._lost()) from None

    def _read_message(self, deadline: float | None, raw: bool) -> Any:
        """The next message: bytes (``raw``) or an object. Error frames raise."""
        if self._object is None:
            kind, payload = self._read_frame(deadline)
            if kind == F.KIND_DATA:
                return payload if raw else F.loads(payload)
            self._start_object(kind, payload)
        pickled, table, buffers = self._object
        while len(buffers) < len(table):
            length, flags = table[len(buffers)]
            kind, payload = self._read_frame(deadline, mutable=not flags & F.FLAG_BYTES)
            if kind != F.KIND_BUFFER or len(payload) != length:
                raise self._break(F.missing_buffer(kind, len(payload), length))
            buffers.append(payload)
        self._object = None
        obj = F.loads(pickled, buffers)
        return F.dumps_inband(obj) if raw else obj

    def _start_object(self, kind: int, payload: Any) -> None:
        if kind == F.KIND_ERROR:
            F.raise_remote(payload)
        if kind != F.KIND_OBJECT:
            raise self._break(F.missing_buffer(kind, len(payload), None))
        pickled, table = F.parse_object(payload)
        self._object = (pickled, table, [])

    # -- reading: the public API -------------------------------------------------------------

    def recv_bytes(self, maxlength: int | None = None, *, timeout: float | None = None) -> bytes:
        """Receive one message as bytes.

        Raises EOFError at end of file (:class:`WriterDied` if the watched writer died),
        :class:`ReadTimeout` when ``timeout`` seconds pass (nothing is lost), and
        :class:`MessageTooLong` (an OSError) when the message exceeds ``maxlength``; unlike
        the stdlib the message is then discarded and the connection stays usable. An error
        frame raises the exception it carries.
        """
        self._check_closed()
        self._check_readable()
        if maxlength is None:
            return self._locked(timeout, lambda d: self._read_message(d, True))  # type: ignore[no-any-return]
        if maxlength < 0:
            raise ValueError("negative maxlength")

        def read(deadline: float | None) -> bytes:
            if self._object is None:
                kind, payload = self._read_frame(deadline, maxlength)
                if kind == F.KIND_DATA:
                    return payload  # type: ignore[no-any-return]
                self._start_object(kind, payload)
            data = self._read_message(deadline, True)
            if len(data) > maxlength:
                raise MessageTooLong(len(data), maxlength)
            return data  # type: ignore[no-any-return]

        return self._locked(timeout, read)  # type: ignore[no-any-return]

    def recv_bytes_into(self, buf: Any, offset: int = 0, *, timeout: float | None = None) -> int:
        """Receive one message into ``buf`` at byte ``offset``; returns its size in bytes.

        Raises ``BufferTooShort`` (carrying the whole message as ``args[0]``) if it does not
        fit; the connection stays usable.
        """
        self._check_closed()
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
            into = flat[offset:]

            def read(deadline: float | None) -> Any:
                if self._object is None:
                    kind, payload = self._read_frame(deadline, into=into)
                    if kind == F.KIND_DATA:
                        return payload
                    self._start_object(kind, payload)
                return self._read_message(deadline, True)

            result = self._locked(timeout, read)
            if isinstance(result, int):
                return result
            if len(result) > into.nbytes:
                raise BufferTooShort(result)
            into[: len(result)] = result
            return len(result)

    def recv(self, *, timeout: float | None = None) -> Any:
        """Receive an object sent by :meth:`send` (or an in-band pickle from a reference
        writer). An error frame raises the exception it carries."""
        self._check_closed()
        self._check_readable()
        return self._locked(timeout, lambda d: self._read_message(d, False))

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether there is data to read (or end of file), waiting up to ``timeout`` seconds
        (None: forever)."""
        self._check_closed()
        self._check_readable()
        if len(self._buf) > self._bstart and not self._pbulk:
            return True
        try:
            return self._poll_once(_deadline(timeout), self._pbulk)
        except _Dead:
            return True

    def _handles(self) -> tuple[int, int, int, int]:
        """(read fd, write fd, bulk read fd, bulk write fd); -1 for no bulk fd."""
        return self._fd, self._wfd, self._bfd, self._bwfd

    @property
    def read_ahead(self) -> bool:
        """Whether reads may take more than the current frame from the fd (see the class)."""
        return self._read_ahead

    def _send_segments(self, segments: list[Any]) -> None:
        """Write one message given as ``[pipe_parts, bulk_payload, pipe_parts, ...]``."""
        self._check_closed()
        self._check_writable()
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
        self._async_owner = 0
        self._wlock.release()

    def _write_nowait(self, parts: list[Any], bulk: bool) -> int:
        """One writev() of ``parts`` to the pipe (the bulk fd when ``bulk``) that never blocks:
        the bytes written, 0 when the fd is full, -1 when this system has no non-blocking
        write. The caller holds the write lock."""
        self._check_closed()
        self._check_writable()
        fd = self._bwfd if bulk else self._wfd
        if fd < 0:
            raise OSError("handle is closed")
        if _RWF_NOWAIT is None:
            return -1
        try:
            return os.pwritev(fd, parts[:_IOV_MAX], -1, _RWF_NOWAIT)
        except (BlockingIOError, InterruptedError):
            return 0
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS):
                return -1
            raise

    @property
    def _pending_bulk_fd(self) -> int | None:
        """The bulk fd while a frame's bulk payload is partly read, else None."""
        return self._bfd if self._pbulk and self._fd >= 0 else None

    @property
    def _liveness_fd(self) -> int | None:
        return None if self._liveness is None else self._liveness.fd

    def _has_buffered(self) -> bool:
        return self._fd >= 0 and len(self._buf) > self._bstart

    # -- pickling to a child process ---------------------------------------------------------

    def __reduce__(self) -> Any:
        from .connection import _reduce_connection

        return _reduce_connection(self)

    # -- asyncio -----------------------------------------------------------------------------

    async def recv_bytes_async(
        self, maxlength: int | None = None, *, timeout: float | None = None
    ) -> bytes:
        """``recv_bytes`` on the running event loop's reader callbacks (no thread)."""
        from ._aio import recv_async

        return await recv_async(self, lambda t: self.recv_bytes(maxlength, timeout=t), timeout)

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


def _writev_all(fd: int, views: list[memoryview]) -> None:
    """Write every byte of ``views`` to ``fd`` (short writes continue where they stopped)."""
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        while views and n >= views[0].nbytes:
            n -= views[0].nbytes
            views.pop(0)
        if n:
            views[0] = views[0][n:]


pipe, Pipe = build_api(Connection)
