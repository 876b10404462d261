# cython: language_level=3, embedsignature=True, binding=True
"""The compiled engine: the hot loops of a connection over csrc/fp.c.

Same interface, errors and bytes on the wire as framepipe._pycore (the spec); the interface is
written down in _core.pyi. Connection (framepipe._connection_c) subclasses Engine.
"""

cimport cython
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from cpython.pythread cimport (
    NOWAIT_LOCK, PyThread_acquire_lock, PyThread_allocate_lock, PyThread_free_lock,
    PyThread_get_thread_ident, PyThread_release_lock, PyThread_type_lock,
)
from libc.errno cimport EAGAIN, EINTR, EINVAL, EMSGSIZE, ENOSYS, EOPNOTSUPP, errno
from libc.stdint cimport uint64_t
from libc.string cimport memcpy, memmove, strerror

import os
import stat
import time
from pickle import loads as _loads

from ._args import check_send_args, check_timeout
from ._spin import DEATH_GRACE as _DEATH_GRACE, DEATH_SPIN as _DEATH_SPIN
from ._spin import SPIN as _SPIN, SPIN_FLOOR as _SPIN_FLOOR
from ._spin import SPIN_LONGEST_SAMPLE as _SPIN_LONGEST, SPIN_WEIGHT as _SPIN_WEIGHT
from ._spin import SPIN_AVERAGE_ZERO as _SPIN_AVERAGE_ZERO
from ._spin import SPIN_CPU_CHECKS as _SPIN_CPU_CHECKS, on_allow_spin, several_cpus
from ._stream_errors import (
    bad_header, blocking_send_under_async_send, broken, closed, closed_while_waiting,
    no_bulk_channel, record_too_long, sentinel_timeout, timeout_error, truncated, unallocatable,
    watched,
)
from ._wire import BULK_MIN as _BULK_MIN, KIND_BULK, READ_BUFFER, RECORD_MAX as _RECORD_MAX
from ._wire import FRAME_RECORD_MAX as _FRAME_RECORD_MAX, READ_WAITS_NONE, READ_WAITS_PIPE
from ._wire import READ_WAITS_SOCKET, frame_cap, read_waits, records_of
from ._wire import KIND_PAD, PAD_MIN as _PAD_MIN, padded, pads
from .errors import BufferTooShort, MessageTooLong

__all__ = ["ENGINE", "Engine"]

ENGINE = "c"


cdef extern from "Python.h":
    ctypedef long long PY_TIMEOUT_T
    ctypedef enum PyLockStatus:
        PY_LOCK_FAILURE, PY_LOCK_ACQUIRED, PY_LOCK_INTR
    PyLockStatus PyThread_acquire_lock_timed(PyThread_type_lock, PY_TIMEOUT_T, int) nogil


cdef extern from "sys/uio.h" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len


cdef extern from "fp.h" nogil:
    int FP_OK, FP_TIMEOUT, FP_LIVENESS, FP_MORE, FP_WOKEN
    int FP_KIND_DATA, FP_KIND_TIMEOUT, FP_KIND_DEAD, FP_KIND_BUFFER, FP_KIND_BULK, FP_KIND_PAD
    enum: FP_PAD_MIN
    int FP_HEADER_SIZE
    int FP_READ, FP_WRITE
    int FP_MODE_BLOCK, FP_MODE_SOCKET, FP_MODE_PIPE, FP_MODE_NONBLOCK, FP_MODE_RECORD
    int FP_MODE_RECORD_WAIT
    ctypedef struct fp_header:
        int kind
        uint64_t value
        size_t size
    double fp_now()
    void fp_header_encode(unsigned char *out, int kind, uint64_t length)
    int fp_header_decode(const unsigned char *p, size_t avail, uint64_t cap, fp_header *h)
    int fp_wait(int fd, int direction, int liveness_fd, int wake_fd, double deadline)
    int fp_wake_open(int *rfd, int *wfd)
    int fp_wake(int wfd)
    bint FP_HAVE_PIPE_WAKE
    int fp_wake_pipe_reader(int fd)
    int fp_wake_socket_reader(int fd)
    ssize_t fp_read(int fd, void *buf, size_t n, int mode)
    int fp_spin_readable(int fd, double until)
    int fp_reopen_nonblocking(int fd)
    int fp_writev(int fd, iovec **iov, int *iovcnt, int nowait, size_t cap, size_t cap_after,
                  size_t *written)
    int fp_identity(int fd, uint64_t *dev, uint64_t *ino)
    int fp_close_if_same(int fd, uint64_t dev, uint64_t ino)


cdef extern from "unistd.h" nogil:
    int c_close "close"(int fd)


cdef enum:
    READ_CHUNK = 65536  # the read buffer: with read-ahead, many small frames per read()
    # A read or write that cannot block and moves at most this many bytes keeps the GIL: it
    # takes less time than releasing the GIL and taking it back (two futex calls when another
    # thread waits for it), and no thread waits on it for long.
    GIL_HELD_IO = 65536
    DIRECT_MIN = 16384  # a remainder at least this large is read straight into its frame

assert KIND_BULK == FP_KIND_BULK and KIND_PAD == FP_KIND_PAD  # _wire's kinds are fp.h's
assert _PAD_MIN == FP_PAD_MIN
assert READ_CHUNK == READ_BUFFER  # a record (see _wire.RECORD_MAX) fits the read buffer
cdef Py_ssize_t RECORD_MAX = _RECORD_MAX
cdef Py_ssize_t FRAME_RECORD_MAX = _FRAME_RECORD_MAX
cdef Py_ssize_t BULK_MIN = _BULK_MIN
cdef Py_ssize_t PAD_MIN = _PAD_MIN
cdef char PAD_ZEROS[FP_PAD_MIN]  # a PAD frame's payload (static: zeros)

cdef enum:  # what _wait_readable saw
    W_READY, W_TIMEOUT, W_DEAD
cdef double DEATH_GRACE = _DEATH_GRACE  # see _spin
cdef double DEATH_SPIN = _DEATH_SPIN
cdef double LIVENESS_SLICE = 0.01
cdef double POLL_WAITED = 20e-6  # a poll() that took longer had to wait for data
cdef double SPIN = _SPIN  # see _spin
cdef double SPIN_FLOOR = _SPIN_FLOOR
cdef double SPIN_LONGEST_SAMPLE = _SPIN_LONGEST
cdef double SPIN_WEIGHT = _SPIN_WEIGHT
cdef double SPIN_AVERAGE_ZERO = _SPIN_AVERAGE_ZERO


# The read and write locks. A thread takes one with the GIL held, and when it is free nothing
# more than a flag is needed: the GIL makes the test and the set one step for every other thread
# (a PyThread lock would read the clock and touch a semaphore on each take, about 5% of a small
# message's time on one CPU). Only a thread that finds it taken waits, on the gate: a PyThread
# lock held closed. A thread giving the turn back while others wait hands it over: the turn
# stays taken and the gate opens once, for the one waiter that passes it (a waiter woken only to
# compete for the turn could lose it again and again to the thread that gave it, which keeps the
# GIL until its next take). Where the GIL is optional (Py_GIL_DISABLED) the gate is a plain lock
# and the flag goes unused.
cdef extern from *:
    """
    #ifdef Py_GIL_DISABLED
    #define FP_GIL_HELD 0
    #else
    #define FP_GIL_HELD 1
    #endif
    """
    const bint FP_GIL_HELD

cdef extern from "Python.h":
    const PY_TIMEOUT_T PY_TIMEOUT_MAX

cdef struct Turn:
    bint busy  # taken, or being handed over (with the GIL)
    int waiters  # threads waiting at the gate (with the GIL)
    PyThread_type_lock gate


cdef int turn_init(Turn *t) except -1:
    t.busy = False
    t.waiters = 0
    t.gate = PyThread_allocate_lock()
    if t.gate == NULL:
        raise MemoryError()
    if FP_GIL_HELD:
        PyThread_acquire_lock(t.gate, NOWAIT_LOCK)  # closed: a waiter passes once it opens
    return 0


cdef void turn_free(Turn *t) noexcept:
    if t.gate != NULL:
        PyThread_free_lock(t.gate)
        t.gate = NULL


cdef inline bint turn_try(Turn *t) noexcept:
    """Take the turn if it is free (the GIL held): whether it was taken."""
    if not FP_GIL_HELD:
        return PyThread_acquire_lock(t.gate, NOWAIT_LOCK)
    if t.busy:
        return False
    t.busy = True
    return True


cdef bint turn_take(Turn *t, double deadline) except -1:
    """Take the turn, waiting for it (the GIL released) until the deadline (-1: none):
    whether it was taken."""
    cdef PY_TIMEOUT_T us = -1
    cdef double left
    cdef PyLockStatus st
    if turn_try(t):
        return True
    if deadline >= 0:
        left = (deadline - fp_now()) * 1e6
        us = 0 if left < 0 else (-1 if left >= PY_TIMEOUT_MAX else <PY_TIMEOUT_T>left)
    t.waiters += 1
    with nogil:
        st = PyThread_acquire_lock_timed(t.gate, us, 0)
    if st != PY_LOCK_ACQUIRED and FP_GIL_HELD:
        # The turn may have been handed over since the wait ended: the gate then is open.
        if PyThread_acquire_lock(t.gate, NOWAIT_LOCK):
            st = PY_LOCK_ACQUIRED
    t.waiters -= 1
    return st == PY_LOCK_ACQUIRED  # passed the gate: the turn is this thread's


cdef inline void turn_give(Turn *t) noexcept:
    """Give the turn back (the GIL held): to a waiting thread if there is one (the gate opens
    for it and the turn stays taken), else free."""
    if not FP_GIL_HELD:
        PyThread_release_lock(t.gate)
        return
    if t.waiters:
        PyThread_release_lock(t.gate)
    else:
        t.busy = False


# Locks held by threads of the parent stay held in a forked child, where those threads do not
# exist: a connection first used in a child after a fork takes fresh locks.
cdef unsigned long long _fork_gen = 0


def _after_fork_in_child():
    global _fork_gen, _spin_checks
    _fork_gen += 1
    _spin_checks = 0  # the child may have other CPUs


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


# _spin.may_spin, with its state in C: a read that may spin asks at every wait.
cdef bint _spin_allowed = True  # what allow_spin() last said
cdef double _spin_window = _SPIN  # the longest spin (see SPIN_ALONE)
cdef bint _spin_cpus = False  # several CPUs, when last looked up
cdef int _spin_checks = 0  # decisions left before the next look-up
cdef int SPIN_CPU_CHECKS = _SPIN_CPU_CHECKS


def _allow_spin(bint allowed, double window):
    global _spin_allowed, _spin_window
    _spin_allowed = allowed
    _spin_window = window


def _spin_window_now():
    """The longest spin now (for tests: the pure-Python engine's is _spin.spin_window)."""
    return _spin_window


on_allow_spin(_allow_spin)


cdef bint may_spin() except -1:
    global _spin_cpus, _spin_checks
    if SPIN <= 0.0 or not _spin_allowed:
        return False
    _spin_checks -= 1
    if _spin_checks < 0:
        _spin_checks = SPIN_CPU_CHECKS
        _spin_cpus = several_cpus()
    return _spin_cpus


def _may_spin():
    """Whether a read may spin now (for tests: the pure-Python engine's is
    _spin.may_spin)."""
    return may_spin()


class _Expired(Exception):
    """Internal: the read's deadline passed; the public method says which timeout."""


cdef inline double _deadline(timeout) except? -2.0:
    cdef double t
    if timeout is None:
        return -1.0
    t = timeout
    if t != t:
        check_timeout(t)  # raises: the message is shared with the twin
    return fp_now() + (t if t > 0.0 else 0.0)


cdef object _oserror(int err):
    return OSError(err, strerror(err).decode("utf-8", "replace"))


cdef int _retry(int err) except -1:
    """After a system call failed with ``err``: EINTR runs the signal handlers (which may
    raise, e.g. KeyboardInterrupt) and returns so that the caller retries against the same
    deadline (PEP 475); any other errno raises."""
    if err == EINTR:
        PyErr_CheckSignals()
        return 0
    raise _oserror(err)


cdef class _Iov:
    """The buffers of the first ``count`` of ``parts`` as an iovec array, held until
    :meth:`release` (or until collected)."""

    cdef Py_buffer *views
    cdef iovec *iov
    cdef Py_ssize_t count, held

    def __cinit__(self, list parts, Py_ssize_t count):
        cdef Py_ssize_t i
        self.views = <Py_buffer *>PyMem_Malloc(count * sizeof(Py_buffer) + 1)
        self.iov = <iovec *>PyMem_Malloc(count * sizeof(iovec) + 1)
        if self.views == NULL or self.iov == NULL:
            raise MemoryError()
        self.count = count
        for i in range(count):
            PyObject_GetBuffer(parts[i], &self.views[i], PyBUF_SIMPLE)
            self.held += 1
            self.iov[i].iov_base = self.views[i].buf
            self.iov[i].iov_len = <size_t>self.views[i].len

    cdef void release(self) noexcept:
        cdef Py_ssize_t i
        for i in range(self.held):
            PyBuffer_Release(&self.views[i])
        self.held = 0

    def __dealloc__(self):
        self.release()
        PyMem_Free(self.views)
        PyMem_Free(self.iov)
        self.views = NULL
        self.iov = NULL


cdef class Engine:
    """The hot loops of one connection over a pipe or socket fd (see _pycore.Engine)."""

    ENGINE = "c"

    cdef readonly int _fd
    cdef int _wfd
    cdef int _bfd, _bwfd, _bmode  # the bulk channel: read and write fds (-1: none)
    cdef bint _pbulk, _bpoll_first
    cdef readonly bint _readable, _writable
    cdef bint _closefd
    cdef int _mode
    cdef readonly bint _records  # reads take whole records (SOCK_SEQPACKET, see _wire)
    cdef readonly bint _rpad, _wpad  # reads / writes of padded messages (see _wire.PAD_MIN)
    cdef size_t _wcap, _wframe  # the longest records of the write fd (see _wire.record_limits)
    cdef unsigned long _async_owner  # the thread whose asyncio send holds the write lock, or 0
    cdef int _nfd  # a private O_NONBLOCK description of the pipe (-1: not yet, -2: none)
    cdef readonly bint _read_ahead
    cdef bint _poll_first
    cdef bint _streaming  # the last read without a deadline found its bytes there at once
    cdef readonly double _waited  # moving average of how long reads waited for data (see SPIN)
    cdef long long _max
    cdef readonly object _max_size
    cdef Turn _rturn  # the read lock (see Turn)
    cdef Turn _wturn  # the write lock
    cdef char *_buf
    cdef Py_ssize_t _bstart, _bend
    cdef unsigned long long _consumed
    cdef int _pkind
    cdef Py_ssize_t _plen, _pgot, _pmaxlen
    cdef object _pobj
    cdef char *_pptr
    cdef bint _pexternal, _pdiscard
    cdef object _result
    cdef Py_ssize_t _rsize
    cdef public object _object  # an object message in progress (the Connection's _message)
    cdef object _broken
    cdef readonly object _liveness
    cdef int _lfd
    cdef bint _dead
    cdef double _eof_until  # end of the grace for a watched writer's death after end of file
    cdef unsigned long long _gen
    cdef uint64_t _dev[4]
    cdef uint64_t _ino[4]
    cdef bint _known[4]  # whether _dev/_ino of (fd, wfd, bfd, bwfd) were read
    cdef public object _peer
    cdef readonly long long _sentinel_sent
    cdef bint _nowait_writes  # writes never block (pwritev2 RWF_NOWAIT works here)
    # Calls under way in other threads that use the fds (reads, polls, writes, the watcher's
    # DEAD sentinel), and whether close() left the fds in _dfd (fd, wfd, bfd, bwfd, nfd) and
    # the liveness in _dliveness for the last of them to close (see _close). The GIL orders
    # every use: no Python code runs between a check and an update.
    cdef int _users
    cdef bint _deferred
    cdef int _dfd[5]
    cdef object _dliveness
    cdef int _wake_r, _wake_w  # the wake fd of waits, made when a call first has to wait
    cdef int _read_waits  # how reads without a deadline wait in read() (READ_WAITS_*), if they do
    cdef bint _blocked_reader  # a thread is in such a read
    cdef object __weakref__

    def __cinit__(self):
        self._fd = -1
        self._wfd = -1
        self._bfd = -1
        self._bwfd = -1
        self._lfd = -1
        self._nfd = -1
        self._pkind = -1
        self._eof_until = -1.0
        self._wake_r = self._wake_w = -1
        turn_init(&self._rturn)
        turn_init(&self._wturn)

    def _open(self, int fd, int wfd, int bfd, int bwfd, bint readable, bint writable,
              max_size, bint closefd, bint read_ahead):
        """Take the (checked) fds: ``fd`` to read, ``wfd`` to write, ``bfd``/``bwfd`` the bulk
        channel (-1: none)."""
        cdef int i
        cdef int fds[4]
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            mode = 0  # like the stdlib: a bad handle fails on first use
        self._gen = _fork_gen
        self._fd = fd
        self._wfd = wfd
        self._bfd = bfd
        self._bwfd = bwfd
        self._bmode = FP_MODE_BLOCK
        fds[0] = fd
        fds[1] = wfd
        fds[2] = bfd
        fds[3] = bwfd
        for i in range(4):
            self._known[i] = fds[i] >= 0 and fp_identity(fds[i], &self._dev[i], &self._ino[i]) == 0
        if bfd >= 0:
            try:
                bmode = os.fstat(bfd).st_mode
            except OSError:
                bmode = 0
            if stat.S_ISSOCK(bmode):
                self._bmode = FP_MODE_SOCKET
            elif stat.S_ISFIFO(bmode):
                self._bmode = FP_MODE_PIPE
        self._readable = readable
        self._writable = writable
        self._max_size = max_size
        self._max = frame_cap(max_size)
        self._closefd = closefd
        self._read_ahead = read_ahead
        self._nowait_writes = True  # until the kernel says otherwise (EOPNOTSUPP)
        self._read_waits = read_waits(mode, FP_HAVE_PIPE_WAKE, closefd)
        self._records, self._wcap, self._wframe = records_of(fd, wfd)
        self._rpad, self._wpad = pads(fd, wfd, bfd, bwfd)
        if self._records:
            self._mode = FP_MODE_RECORD
        elif stat.S_ISSOCK(mode):
            self._mode = FP_MODE_SOCKET
        elif stat.S_ISFIFO(mode):
            self._mode = FP_MODE_PIPE
        else:
            self._mode = FP_MODE_BLOCK

    def __dealloc__(self):
        if self._nfd >= 0:
            c_close(self._nfd)
            self._nfd = -1
        self._close_wake()
        # No Python here: at interpreter shutdown the modules may already be torn down.
        if self._fd >= 0 and self._closefd:
            self._close_owned(self._fd, self._wfd, self._bfd, self._bwfd)
        self._fd = self._wfd = self._bfd = self._bwfd = -1
        if self._buf != NULL:
            PyMem_Free(self._buf)
            self._buf = NULL
        turn_free(&self._rturn)
        turn_free(&self._wturn)

    def _close(self):
        """Close the fds (those this connection owns, and its own private ones) and the
        watched writer's liveness. A call under way in another thread is woken (it raises
        OSError) and the last such call to leave closes them: until then no number is freed,
        so no call can reach a file that took one of them."""
        cdef int fd, wfd, bfd, bwfd, nfd, err
        if self._fd < 0:
            return
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        fd, wfd, bfd, bwfd, nfd = self._fd, self._wfd, self._bfd, self._bwfd, self._nfd
        liveness = self._liveness
        self._fd = self._wfd = self._bfd = self._bwfd = -1
        self._nfd = -1
        self._liveness = None
        self._lfd = -1
        if self._users > 0:
            self._dfd[0] = fd
            self._dfd[1] = wfd
            self._dfd[2] = bfd
            self._dfd[3] = bwfd
            self._dfd[4] = nfd
            self._dliveness = liveness
            self._deferred = True
            if self._wake_w >= 0:
                fp_wake(self._wake_w)
            if self._blocked_reader:
                if self._read_waits == READ_WAITS_PIPE:
                    fp_wake_pipe_reader(fd)
                else:
                    fp_wake_socket_reader(fd)
            return
        err = self._close_now(fd, wfd, bfd, bwfd, nfd, liveness)
        if err:
            raise _oserror(err)

    cdef int _close_now(self, int fd, int wfd, int bfd, int bwfd, int nfd, liveness) except -1:
        """Close what _close took off the connection; returns 0 or the errno of the first
        close() of an owned fd that failed."""
        cdef int err = 0
        if nfd >= 0:
            c_close(nfd)  # ours whatever closefd says
        self._close_wake()
        if self._closefd:
            err = self._close_owned(fd, wfd, bfd, bwfd)
        if liveness is not None:
            try:
                liveness.close()
            except OSError:
                pass
        return err

    cdef void _close_wake(self) noexcept:
        if self._wake_r >= 0:
            c_close(self._wake_r)
            if self._wake_w != self._wake_r:
                c_close(self._wake_w)
        self._wake_r = self._wake_w = -1

    cdef inline int _enter(self) except -1:
        """A call that uses the fds begins (see _close)."""
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        if self._fd < 0:
            raise closed()
        self._users += 1
        return 0

    cdef inline int _leave(self) except -1:
        """The call ends; the last one out after a close() closes the fds. Nobody to report
        a failed close() to: the connection was closed by another thread."""
        self._users -= 1
        if self._users == 0 and self._deferred:
            self._deferred = False
            liveness, self._dliveness = self._dliveness, None
            self._close_now(self._dfd[0], self._dfd[1], self._dfd[2], self._dfd[3],
                            self._dfd[4], liveness)
        return 0

    cdef int _wake_fd(self, double until) except -2:
        """The wake fd for a wait until ``until``, made now if the wait can block; -1 when it
        cannot block, or when no fd is left to make one (then a close() is seen when the
        wait ends by itself)."""
        cdef int r, w
        if self._wake_r >= 0:
            return self._wake_r
        if 0.0 <= until <= fp_now():
            return -1
        if fp_wake_open(&r, &w) < 0:
            return -1
        self._wake_r = r
        self._wake_w = w
        return r

    cdef int _drain_wake(self) except -1:
        try:
            os.read(self._wake_r, 8)
        except OSError:
            pass
        return 0

    cdef int _woken(self) except -1:
        """After a wait: raise if another thread closed the connection meanwhile."""
        if self._fd < 0:
            raise closed_while_waiting()
        return 0

    cdef int _close_owned(self, int fd, int wfd, int bfd, int bwfd) noexcept:
        """Close the distinct fds that are still the files this connection took (see
        fp_close_if_same); an fd that was not open when taken is left alone. Returns 0 or
        the errno of the first close() that failed."""
        cdef int fds[4]
        cdef int i, j, rc, err = 0
        fds[0] = fd
        fds[1] = wfd
        fds[2] = bfd
        fds[3] = bwfd
        for i in range(4):
            if fds[i] < 0:
                continue
            for j in range(i):
                if fds[j] == fds[i]:
                    break
            else:
                if not self._known[i]:
                    continue  # not open when taken: a bad handle, never ours to close
                rc = fp_close_if_same(fds[i], self._dev[i], self._ino[i])
                if rc < 0 and err == 0:
                    err = errno
        return err

    cdef inline int _check_closed(self) except -1:
        if self._fd < 0:
            raise closed()
        return 0

    cdef inline int _check_readable(self) except -1:
        self._check_closed()
        if not self._readable:
            raise OSError("connection is write-only")
        return 0

    cdef inline int _check_writable(self) except -1:
        self._check_closed()
        if not self._writable:
            raise OSError("connection is read-only")
        return 0

    # -- liveness ----------------------------------------------------------------------------

    def _set_liveness(self, liveness):
        """Watch the writer through ``liveness`` (None: stop watching). It has ``fd`` (a pidfd
        or None), ``poll_dead()`` and ``error(lost_bytes=, expected_bytes=)``."""
        self._liveness = liveness
        self._dead = False
        self._eof_until = -1.0
        fd = None if liveness is None else liveness.fd
        self._lfd = -1 if fd is None else fd

    def _write_sentinel(self, data):
        """Write a DEAD sentinel from the watcher thread (nothing once the connection is
        closed)."""
        if self._fd < 0:
            return
        self._write_parts([data])
        self._sentinel_sent += len(data)

    # -- writing -----------------------------------------------------------------------------

    cdef int _renew_locks_after_fork(self) except -1:
        """First use in a forked child: the inherited locks may be held by parent threads
        that do not exist here. (The GIL is held throughout: no other thread can interleave.)"""
        cdef Turn r, w
        turn_init(&r)
        try:
            turn_init(&w)
        except MemoryError:
            turn_free(&r)
            raise
        turn_free(&self._rturn)
        turn_free(&self._wturn)
        self._rturn = r
        self._wturn = w
        self._async_owner = 0
        # Calls of the parent's threads do not go on here; fds whose close waited for one are
        # left open, as after any close() that follows a fork. The wake fd is the parent's
        # (one eventfd shared by both): a close here must not wake the parent's calls.
        self._users = 0
        self._blocked_reader = False  # a parent thread's read: a close must not wake it
        if self._read_waits == READ_WAITS_SOCKET:
            self._read_waits = READ_WAITS_NONE  # the parent holds the socket too (see read_waits)
        self._deferred = False
        self._dliveness = None
        self._close_wake()
        self._gen = _fork_gen
        return 0

    cdef int _lock_write(self) except -1:
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        if not turn_try(&self._wturn):
            if self._async_owner == PyThread_get_thread_ident():
                raise blocking_send_under_async_send()
            turn_take(&self._wturn, -1.0)
        return 0

    cdef int _writev(self, iovec *iov, int cnt) except -1:
        self._enter()
        try:
            self._lock_write()
            try:
                self._writev_locked(iov, cnt, False, True)
            finally:
                turn_give(&self._wturn)
        finally:
            self._leave()
        return 0

    cdef int _writev_locked(self, iovec *iov, int cnt, bint bulk, bint one_frame=False) except -1:
        """Write all of iov to the pipe (the bulk fd when ``bulk``); the caller holds the
        write lock. ``one_frame``: iov is one whole frame, whose records after its first may
        be longer (see _wire.record_limits). A full fd is waited for in fp_wait, so a close()
        wakes the writer."""
        cdef size_t cap = 0 if bulk else self._wcap
        cdef size_t cap_after = self._wframe if one_frame else cap
        cdef size_t total = 0
        cdef int rc, err, fd, wake, i
        for i in range(cnt):
            total += iov[i].iov_len
        while True:
            self._woken()
            fd = self._bwfd if bulk else self._wfd
            if self._nowait_writes and total <= GIL_HELD_IO:  # cannot block (see GIL_HELD_IO)
                rc = fp_writev(fd, &iov, &cnt, 1, cap, cap_after, NULL)
                err = errno
            else:
                with nogil:
                    rc = fp_writev(fd, &iov, &cnt, self._nowait_writes, cap, cap_after, NULL)
                    err = errno
            if rc == FP_OK:
                return 0
            if err == EOPNOTSUPP:  # no non-blocking writes here: blocking ones from now on
                self._nowait_writes = False
                continue
            if err != EAGAIN:
                _retry(err)  # EINTR: the frame goes on after the signal handlers
                continue
            self._woken()
            wake = self._wake_fd(-1.0)
            with nogil:
                rc = fp_wait(fd, FP_WRITE, -1, wake, -1.0)
                err = errno
            if rc < 0:
                _retry(err)
            elif rc == FP_WOKEN:
                self._woken()
                self._drain_wake()

    cdef int _write_bulk(self, unsigned char *hdr, iovec *payload) except -1:
        """A BULK frame: its header to the pipe (padded, see _pad), then its payload to the
        bulk fd, under one hold of the write lock."""
        cdef iovec head[3]
        cdef unsigned char pad[12]
        head[0].iov_base = hdr
        head[0].iov_len = FP_HEADER_SIZE
        self._enter()
        try:
            self._lock_write()
            try:
                self._writev_locked(head, 1 + self._pad(FP_HEADER_SIZE, pad, &head[1]), False)
                self._writev_locked(payload, 1, True)
            finally:
                turn_give(&self._wturn)
        finally:
            self._leave()
        return 0

    cdef inline int _pad(self, Py_ssize_t first, unsigned char *hdr, iovec *iov) noexcept:
        """Fill iov[0], iov[1] with the PAD frame that ends a message whose first write is
        ``first`` bytes (header in ``hdr``), and return 2; 0 when it needs none (see
        _wire.PAD_MIN)."""
        cdef Py_ssize_t n
        if not self._wpad or first >= PAD_MIN:
            return 0
        n = PAD_MIN - first - FP_HEADER_SIZE
        if n < 0:
            n = 0
        fp_header_encode(hdr, FP_KIND_PAD, <uint64_t>n)
        iov[0].iov_base = hdr
        iov[0].iov_len = FP_HEADER_SIZE
        iov[1].iov_base = PAD_ZEROS
        iov[1].iov_len = <size_t>n
        return 2

    def send_bytes(self, buf, Py_ssize_t offset=0, size=None):
        cdef Py_buffer view
        cdef Py_ssize_t n
        cdef unsigned char hdr[12]
        cdef unsigned char pad[12]
        cdef iovec iov[4]
        self._check_writable()
        PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
        try:
            if offset == 0 and size is None:
                n = view.len
            else:
                n = check_send_args(view.len, offset, size)
            iov[1].iov_base = <char *>view.buf + offset
            iov[1].iov_len = <size_t>n
            if n >= BULK_MIN and self._bwfd >= 0:
                fp_header_encode(hdr, FP_KIND_BULK, <uint64_t>n)
                self._write_bulk(hdr, &iov[1])
                return
            fp_header_encode(hdr, FP_KIND_DATA, <uint64_t>n)
            iov[0].iov_base = hdr
            iov[0].iov_len = FP_HEADER_SIZE
            self._writev(iov, 2 + self._pad(FP_HEADER_SIZE + n, pad, &iov[2]))
        finally:
            PyBuffer_Release(&view)

    cdef int _write_parts(self, list parts) except -1:
        self._enter()
        try:
            self._lock_write()
            try:
                self._write_parts_locked(parts, False)
            finally:
                turn_give(&self._wturn)
        finally:
            self._leave()
        return 0

    cdef int _write_segments(self, list segments) except -1:
        """Write ``[pipe_parts, bulk_payload, pipe_parts, ...]`` (see ``_pickling.dumps_bulk``) under
        one hold of the write lock: each BULK header reaches the pipe before its payload
        reaches the bulk fd."""
        cdef Py_ssize_t i
        self._enter()
        try:
            self._lock_write()
            try:
                for i in range(len(segments)):
                    if i & 1:
                        self._write_parts_locked([segments[i]], True)
                    else:
                        self._write_parts_locked(segments[i], False)
            finally:
                turn_give(&self._wturn)
        finally:
            self._leave()
        return 0

    cdef int _write_parts_locked(self, list parts, bint bulk) except -1:
        cdef _Iov v = _Iov(parts, len(parts))
        try:
            self._writev_locked(v.iov, <int>v.count, bulk)
        finally:
            v.release()
        return 0

    # -- reading: the state machine ----------------------------------------------------------

    cdef int _note_dead(self) except -1:
        """The liveness fd fired (or the fallback slice passed): is the writer dead?"""
        if self._liveness is not None and self._liveness.poll_dead():
            self._dead = True
        return 0

    cdef int _wait_readable(self, int fd, double deadline) except -1:
        """Wait until ``fd`` is readable (W_READY), the deadline passes (W_TIMEOUT), or the
        watched writer is dead and ``fd`` has nothing more to read (W_DEAD). Signals run their
        handlers and the wait goes on against the same deadline; a close() from another
        thread ends it (OSError)."""
        cdef int rc, err, lfd, wake
        cdef double until
        while True:
            self._woken()
            lfd = -1 if self._dead else self._lfd
            until = deadline
            if self._dead:
                until = 0.0  # only look: is anything left to read?
            elif self._liveness is not None and self._lfd < 0:
                until = fp_now() + LIVENESS_SLICE  # no pidfd: look at the writer now and then
                if 0.0 <= deadline < until:
                    until = deadline
            wake = self._wake_fd(until)
            with nogil:
                rc = fp_wait(fd, FP_READ, lfd, wake, until)
                err = errno
            if rc == FP_OK:
                return W_READY
            if rc < 0:
                _retry(err)
                continue
            if rc == FP_WOKEN:
                self._woken()  # only close() wakes; anything else is drained and ignored
                self._drain_wake()
                continue
            if self._dead:
                return W_DEAD
            if self._liveness is not None:
                self._note_dead()
                if self._dead:
                    continue  # what the writer wrote before dying is read first
            if deadline >= 0 and fp_now() >= deadline:
                return W_TIMEOUT

    cdef Py_ssize_t _read_some(self, char *dst, Py_ssize_t n, double deadline,
                               bint bulk=False, bint eager=False) except -1:
        """One read() into dst: the byte count, 0 at end of file. Raises _Expired at the
        deadline, WriterDied when the watched writer died with nothing left to read, and
        OSError when another thread closes the connection. ``bulk`` reads the bulk fd
        instead of the pipe; ``eager`` tries a read before any wait. The waiting is in
        _wait_readable, where a close() wakes it, after a spin (see SPIN); only a read of a pipe
        or socket without a deadline or a watch waits in read(), woken by a close() through
        fp_wake_pipe_reader or fp_wake_socket_reader."""
        cdef ssize_t r
        cdef int rc, err, rfd, fd = self._bfd if bulk else self._fd
        cdef int mode = self._bmode if bulk else self._mode
        # With read-ahead, poll first: by the time poll() returns, more frames have arrived and
        # one read takes them all (measured: more messages/s than even a plain blocking read).
        # Without it, try a read first when the last poll found data already there.
        cdef bint adaptive = bulk or not self._read_ahead
        cdef bint poll_first = (self._bpoll_first if bulk else self._poll_first) if adaptive else True
        cdef bint ready = False  # a wait just found fd readable
        cdef bint spun = bulk  # the spin (see SPIN) is over, or not for this read
        cdef bint timed = not bulk  # this read's wait, if it waits, is still to be counted
        cdef double started = 0.0, waited
        if deadline < 0 and not bulk and self._read_waits and self._liveness is None:
            if self._streaming and n <= GIL_HELD_IO:
                # The writer keeps ahead: read without waiting, the GIL kept and no clock read
                # (two reads of the clock and a GIL hand-off cost as much as the read itself).
                r = self._read_now(fd, dst, n)
                if r >= 0:
                    if not eager:
                        self._note_wait(0.0)
                    return r
            # No deadline, nobody to watch: wait in read() itself (see fp_wake_pipe_reader and
            # fp_wake_socket_reader), after a spin (not for an eager read: its bytes are there).
            started = fp_now()
            timed = eager or not self._spin_ready(fd, deadline)  # a spin counted its wait
            while True:
                self._woken()
                self._blocked_reader = True
                with nogil:
                    r = fp_read(fd, dst, <size_t>n,
                                FP_MODE_RECORD_WAIT if self._records else FP_MODE_BLOCK)
                    err = errno
                self._blocked_reader = False
                self._woken()  # closed meanwhile: what the read took (the wake) is dropped
                if r >= 0:
                    waited = fp_now() - started
                    if timed:
                        self._note_wait(waited)
                    self._streaming = waited < SPIN_FLOOR  # too short for any sleep
                    return r
                if err == EAGAIN:
                    break  # someone made the description non-blocking: wait in poll() below
                if err == EMSGSIZE:
                    raise self._break(record_too_long(n, self._consumed))
                _retry(err)
        while True:
            self._woken()
            if mode == FP_MODE_PIPE and not bulk and self._nfd == -1:
                self._open_private()
                mode = self._mode
            # A fd with no way to read it without blocking (not a pipe or socket) is read
            # only once a wait found it readable.
            if ready or ((eager or not poll_first) and mode != FP_MODE_BLOCK):
                rfd = self._nfd if mode == FP_MODE_NONBLOCK else fd
                if n <= GIL_HELD_IO and mode != FP_MODE_BLOCK:  # cannot block (see GIL_HELD_IO)
                    r = fp_read(rfd, dst, <size_t>n, mode)
                    err = errno
                else:
                    with nogil:
                        r = fp_read(rfd, dst, <size_t>n, mode)
                        err = errno
                if r >= 0:
                    if spun and timed:
                        self._note_wait(fp_now() - started)
                    return r
                if err == EMSGSIZE:
                    raise self._break(record_too_long(n, self._consumed))
                if err == EOPNOTSUPP or err == EINVAL:
                    self._refused_nowait(bulk)
                    mode = self._bmode if bulk else self._mode
                    continue
                if err != EAGAIN:
                    _retry(err)
                    continue
                # EAGAIN: nothing to read after all (another reader of the pipe took it)
            if not spun:
                spun = True
                started = fp_now()
                if self._spin_ready(fd, deadline):
                    ready = True
                    timed = False  # the spin counted this wait
                    continue
            rc = self._wait_readable(fd, deadline)
            if rc == W_DEAD:
                lost, expected = self._lost()
                raise self._liveness.error(lost_bytes=lost, expected_bytes=expected)
            if rc == W_TIMEOUT:
                raise _Expired()
            ready = True
            if adaptive:
                # Try a read before polling next time only if this poll found data
                # already there: a reader that keeps up with its writer then makes one
                # syscall per wait instead of a failed read, a poll and a read.
                poll_first = fp_now() - started > POLL_WAITED
                if bulk:
                    self._bpoll_first = poll_first
                else:
                    self._poll_first = poll_first

    cdef Py_ssize_t _read_now(self, int fd, char *dst, Py_ssize_t n) except -2:
        """One read of the data fd that never waits: the byte count, 0 at end of file, -1 when
        there is nothing to read now (then reads wait again until one finds its bytes there
        at once: see _streaming)."""
        cdef ssize_t r
        cdef int err, mode
        while True:
            self._woken()
            mode = self._mode
            if mode == FP_MODE_BLOCK:
                self._streaming = False
                return -1
            r = fp_read(self._nfd if mode == FP_MODE_NONBLOCK else fd, dst, <size_t>n, mode)
            err = errno
            if r >= 0:
                return r
            if err == EAGAIN:
                self._streaming = False
                return -1
            if err == EMSGSIZE:
                raise self._break(record_too_long(n, self._consumed))
            if err == EOPNOTSUPP or err == EINVAL:
                self._refused_nowait(False)
                continue
            _retry(err)

    cdef int _refused_nowait(self, bint bulk) except -1:
        """The kernel refused a read that never waits (no RWF_NOWAIT for pipes before Linux
        6.4): a pipe is read through a private O_NONBLOCK description from now on, where it can
        have one; any other fd (the bulk fd when ``bulk``) is read only after a wait."""
        if not bulk and self._mode == FP_MODE_PIPE and self._nfd == -1:
            self._open_private()
        elif bulk:
            self._bmode = FP_MODE_BLOCK
        else:
            self._mode = FP_MODE_BLOCK
        return 0

    cdef inline void _note_wait(self, double waited) noexcept:
        """Count a wait for data of ``waited`` seconds into the average that decides spins."""
        if waited > SPIN_LONGEST_SAMPLE:
            waited = SPIN_LONGEST_SAMPLE
        self._waited += (waited - self._waited) * SPIN_WEIGHT
        if self._waited < SPIN_AVERAGE_ZERO:
            self._waited = 0.0

    cdef bint _spin_ready(self, int fd, double deadline) except -1:
        """Before a wait for ``fd`` sleeps: look without sleeping until it is readable, for
        up to the spin window seconds (SPIN, or SPIN_ALONE; never past the deadline), when
        that pays (see SPIN). Whether it became readable meanwhile."""
        cdef int rc, err
        cdef double begun, until
        if (
            SPIN <= 0.0
            or self._dead
            or not SPIN_FLOOR <= self._waited < _spin_window
            or not may_spin()
        ):
            return False
        begun = fp_now()
        until = begun + _spin_window
        if 0.0 <= deadline < until:
            if deadline <= begun:
                return False  # only a look: the caller's own
            until = deadline
        with nogil:
            rc = fp_spin_readable(fd, until)
            err = errno
        if rc > 0:
            self._note_wait(fp_now() - begun)
            return True
        if rc < 0:
            _retry(err)  # EINTR: the handlers run, then the caller's wait
        return False

    cdef int _open_private(self) except -1:
        """Switch timed and watched reads of the pipe to a private O_NONBLOCK description
        (see fp_reopen_nonblocking), or keep preadv2(RWF_NOWAIT) where there is none."""
        cdef int nfd
        with nogil:
            nfd = fp_reopen_nonblocking(self._fd)
        if nfd >= 0:
            self._nfd = nfd
            self._mode = FP_MODE_NONBLOCK
        else:
            self._nfd = -2  # tried: there is none
        return 0

    cdef int _fill(self, double deadline, Py_ssize_t want) except -1:
        """Read up to ``want`` more bytes into the buffer; with read-ahead, as many as fit."""
        cdef Py_ssize_t avail = self._bend - self._bstart, k
        if self._buf == NULL:
            self._buf = <char *>PyMem_Malloc(READ_CHUNK)
            if self._buf == NULL:
                raise MemoryError()
        if self._bstart:
            if avail:
                memmove(self._buf, self._buf + self._bstart, avail)
            self._bstart = 0
            self._bend = avail
        if self._read_ahead or self._records or want > READ_CHUNK - self._bend:
            want = READ_CHUNK - self._bend
        k = self._read_some(self._buf + self._bend, want, deadline)
        if k == 0:
            self._at_eof(deadline)
        self._bend += k
        return 0

    def _lost(self):
        cdef Py_ssize_t avail = self._bend - self._bstart
        if self._pkind < 0:
            lost, expected = avail, None
        else:
            lost, expected = FP_HEADER_SIZE + self._pgot + avail, FP_HEADER_SIZE + self._plen
            if self._pbulk:  # a DEAD sentinel waits in the pipe, not in this payload
                return lost, expected
        peer = self._peer() if self._peer is not None else None
        if peer is not None:
            lost -= peer._sentinel_sent
        return max(lost, 0), expected

    cdef bint _writer_is_dead(self, double deadline) except -1:
        """At end of file: whether the watched writer died. A writer's end of the pipe closes
        before its death shows (an interpreter closes its fds on the way out), so this waits
        for the death until a grace window, opened by the first end of file seen, closes. A
        read whose deadline comes first raises _Expired: a later read decides, so the same
        exit always gives the same error."""
        cdef int rc, err, lfd, wake
        cdef double end, spin
        cdef bint expire
        live = self._liveness
        if live is None:
            return False
        if self._dead:
            return True
        spin = 0.0
        if self._eof_until < 0:
            self._eof_until = fp_now() + DEATH_GRACE
            spin = fp_now() + DEATH_SPIN  # the first look does not sleep (see DEATH_SPIN)
        end = self._eof_until
        expire = 0.0 <= deadline < end
        if expire:
            end = deadline
        while True:
            if live.poll_dead():
                self._dead = True
                return True
            if fp_now() < spin:
                continue
            if fp_now() >= end:
                if expire:
                    raise _Expired()
                return False
            self._woken()
            lfd = self._lfd
            if lfd < 0:  # no pidfd: look again soon
                time.sleep(min(LIVENESS_SLICE, max(end - fp_now(), 0.0)))
                continue
            wake = self._wake_fd(end)
            with nogil:
                rc = fp_wait(lfd, FP_READ, -1, wake, end)
                err = errno
            if rc < 0:
                _retry(err)
            elif rc == FP_WOKEN:
                self._woken()
                self._drain_wake()

    cdef int _at_eof(self, double deadline) except -1:
        cdef bint in_frame = self._pkind >= 0 or self._bend > self._bstart
        if self._writer_is_dead(deadline):
            lost, expected = self._lost()
            raise self._liveness.error(lost_bytes=lost, expected_bytes=expected)
        if in_frame:
            lost, expected = self._lost()
            raise truncated(lost, expected if expected is not None else FP_HEADER_SIZE)
        raise EOFError

    def _break(self, exc):
        """Mark the stream broken by ``exc`` (every later read raises it); returns ``exc``."""
        self._broken = exc
        return exc

    cdef inline void _drop(self, Py_ssize_t size) noexcept:
        """Drop the buffer's next ``size`` bytes (all there)."""
        self._bstart += size
        self._consumed += size
        if self._bstart == self._bend:
            self._bstart = self._bend = 0

    cdef void _drop_pad_after_frame(self) noexcept:
        """After a whole frame: drop the PAD that follows it (see _pad), reading what is not
        in the buffer yet without waiting. Nothing here raises or runs a signal handler: the
        frame must reach its caller. A PAD not all there (its writer is not framepipe's) or a
        bad header is left to the next read."""
        cdef fp_header h
        cdef Py_ssize_t avail, size
        cdef ssize_t r
        cdef int rc, mode
        while True:
            avail = self._bend - self._bstart
            if avail <= 0 or <unsigned char>self._buf[self._bstart] != FP_KIND_PAD:
                return
            rc = fp_header_decode(<unsigned char *>self._buf + self._bstart, <size_t>avail,
                                  <uint64_t>self._max, &h)
            if rc == FP_OK:
                size = FP_HEADER_SIZE + <Py_ssize_t>h.value
                if avail >= size:
                    self._drop(size)
                    return
            elif rc == FP_MORE:
                size = 2 if avail < 2 else <Py_ssize_t>h.size
            else:
                return
            mode = self._mode
            if mode != FP_MODE_PIPE and mode != FP_MODE_NONBLOCK:
                return  # no read of this fd is sure not to wait
            if self._bstart:
                memmove(self._buf, self._buf + self._bstart, avail)
                self._bstart = 0
                self._bend = avail
            r = fp_read(self._nfd if mode == FP_MODE_NONBLOCK else self._fd,
                        self._buf + self._bend, <size_t>(size - avail), mode)
            if r <= 0:
                return
            self._bend += r

    cdef int _read_header(self, double deadline) except -1:
        cdef unsigned char *p
        cdef Py_ssize_t avail, size
        cdef fp_header h
        cdef int rc, kind
        while True:
            p = <unsigned char *>self._buf + self._bstart
            avail = self._bend - self._bstart
            rc = fp_header_decode(p, <size_t>avail, <uint64_t>self._max, &h)
            if rc == FP_OK:
                if h.kind != FP_KIND_PAD:
                    break
                # A PAD (see _pad), dropped whole: its bytes came in the same write as the
                # message before it, so reading its rest never waits. In a loop: any number of
                # them costs no stack.
                size = FP_HEADER_SIZE + <Py_ssize_t>h.value
                if avail >= size:
                    self._drop(size)
                else:
                    self._fill(deadline, size - avail)
                continue
            if rc != FP_MORE:
                head = p[:avail if avail < FP_HEADER_SIZE else FP_HEADER_SIZE]
                raise self._break(bad_header(rc, head, h.value, self._max_size, self._consumed))
            if avail == 0 and self._rpad and self._object is None:
                self._fill(deadline, PAD_MIN)  # a message's start: small ones whole (see _pad)
            else:  # the kind unknown yet, ask for a whole header: most frames' header in one read
                self._fill(deadline, (FP_HEADER_SIZE if avail < 2 else <Py_ssize_t>h.size) - avail)
        kind = h.kind
        if kind == FP_KIND_TIMEOUT or kind == FP_KIND_DEAD:
            self._bstart += h.size
            self._consumed += h.size
            if kind == FP_KIND_TIMEOUT:
                raise sentinel_timeout()
            # Only a watched writer's death is remembered: without a watch there is nothing to
            # report it again with, and a later read is an ordinary read.
            self._dead = self._liveness is not None
            raise self._dead_sentinel(h.value)
        if kind == FP_KIND_BULK and self._bfd < 0:
            raise self._break(no_bulk_channel(h.value, self._consumed))
        self._pbulk = kind == FP_KIND_BULK
        if self._pbulk:
            # a data frame at a message boundary, a buffer inside an object
            kind = FP_KIND_DATA if self._object is None else FP_KIND_BUFFER
        self._bstart += h.size
        self._consumed += h.size
        self._pkind = kind
        self._plen = <Py_ssize_t>h.value
        self._pgot = 0
        return 0

    cdef int _pump(self, double deadline) except -1:
        """Fill the pending frame's destination until it is complete."""
        cdef Py_ssize_t n = self._plen, got, avail, take, k
        if self._pbulk:
            return self._pump_bulk(deadline)
        while self._pgot < n:
            got = self._pgot
            avail = self._bend - self._bstart
            if avail > 0:
                take = avail if avail < n - got else n - got
                if not self._pdiscard:
                    memcpy(self._pptr + got, self._buf + self._bstart, take)
                self._bstart += take
                self._consumed += take
                self._pgot = got + take
                if self._bstart == self._bend:
                    self._bstart = self._bend = 0
            elif (
                n - got >= RECORD_MAX if self._records
                else not self._pdiscard and (n - got >= DIRECT_MIN or not self._read_ahead)
            ):
                if self._pdiscard:  # a record dropped whole: it may be longer than the buffer
                    k = self._read_dropped(min(n - got, FRAME_RECORD_MAX), deadline, False)
                else:  # the payload's first bytes came with its header: read before polling
                    k = self._read_some(self._pptr + got, n - got, deadline, False, got == 0)
                if k == 0:
                    self._at_eof(deadline)
                self._pgot = got + k
                self._consumed += k
            else:
                self._fill(deadline, min(n - got, READ_CHUNK))
        return 0

    cdef int _pump_bulk(self, double deadline) except -1:
        """Read the pending frame's payload from the bulk fd, straight into its destination."""
        cdef Py_ssize_t n = self._plen, got, k
        while self._pgot < n:
            got = self._pgot
            if self._pdiscard:
                k = self._read_dropped(min(n - got, READ_CHUNK), deadline, True)
            else:
                k = self._read_some(self._pptr + got, n - got, deadline, True)
            if k == 0:
                self._at_eof(deadline)
            self._pgot = got + k
        return 0

    cdef Py_ssize_t _read_dropped(self, Py_ssize_t n, double deadline, bint bulk) except -1:
        """One read of at most ``n`` bytes of a payload being dropped, into a scratch buffer
        of its own: the byte count, 0 at end of file."""
        cdef char *scratch = <char *>PyMem_Malloc(n)
        if scratch == NULL:
            raise MemoryError()
        try:
            return self._read_some(scratch, n, deadline, bulk)
        finally:
            PyMem_Free(scratch)

    cdef int _frame(self, double deadline, Py_ssize_t maxlength, char *into,
                    Py_ssize_t intolen, bint mutable) except -1:
        """Read one whole frame and return its kind. The payload is left in self._result
        (bytes, or a bytearray when ``mutable``), or, when it was read into ``into``, its
        size in self._rsize with self._result None."""
        cdef Py_ssize_t n
        if self._broken is not None:
            raise broken(self._broken)
        if self._pkind < 0:
            self._read_header(deadline)
            n = self._plen
            self._pexternal = self._pdiscard = False
            self._pobj = None
            if maxlength >= 0 and n > maxlength and self._pkind == FP_KIND_DATA:
                self._pdiscard = True
                self._pmaxlen = maxlength
                self._pptr = NULL
            elif into != NULL and self._pkind == FP_KIND_DATA and n <= intolen:
                self._pptr = into
                self._pexternal = True
            else:
                try:
                    if mutable:
                        self._pobj = PyByteArray_FromStringAndSize(NULL, n)
                        self._pptr = PyByteArray_AS_STRING(self._pobj)
                    else:
                        self._pobj = PyBytes_FromStringAndSize(NULL, n)
                        self._pptr = PyBytes_AS_STRING(self._pobj)
                except MemoryError:
                    # a pending frame without a destination would be read into NULL
                    self._pkind = -1
                    self._pbulk = False
                    raise self._break(unallocatable(n, self._consumed - FP_HEADER_SIZE)) from None
        try:
            self._pump(deadline)
        except BaseException:
            if self._pexternal:  # keep what arrived; the caller's buffer is theirs again
                own = PyBytes_FromStringAndSize(NULL, self._plen)
                memcpy(PyBytes_AS_STRING(own), self._pptr, self._pgot)
                self._pobj = own
                self._pptr = PyBytes_AS_STRING(own)
                self._pexternal = False
            raise
        kind = self._pkind
        n = self._plen
        self._pkind = -1
        self._pbulk = False
        self._pptr = NULL
        self._drop_pad_after_frame()  # the fd readable again only if a message is there
        if self._pdiscard:
            raise MessageTooLong(n, self._pmaxlen)
        if self._pexternal:
            self._result = None
            self._rsize = n
            return kind
        if into != NULL and kind == FP_KIND_DATA and n <= intolen:
            memcpy(into, PyBytes_AS_STRING(self._pobj), n)
            self._pobj = None
            self._result = None
            self._rsize = n
            return kind
        self._result = self._pobj
        self._pobj = None
        return kind

    cdef object _take_result(self):
        r = self._result
        self._result = None
        return r

    cdef int _lock_read(self, double deadline) except -1:
        """Begin a read: take the read lock (readers queue, never interleave) before the
        deadline; end it with _unlock_read."""
        self._enter()
        if turn_try(&self._rturn):
            return 0
        if not turn_take(&self._rturn, deadline):
            self._leave()
            raise _Expired()
        if self._fd < 0:  # closed while this call waited for the reader before it
            self._unlock_read()
            raise closed_while_waiting()
        return 0

    cdef int _unlock_read(self) except -1:
        turn_give(&self._rturn)
        self._leave()
        return 0

    def _read_frame(self, double deadline, bint mutable):
        """The next frame, ``(kind, payload)``, for a message hook that holds the read lock
        (the out-of-band buffers of an object: a bytearray when ``mutable``)."""
        cdef int kind = self._frame(deadline, -1, NULL, 0, mutable)
        return kind, self._take_result()

    # -- reading: the public calls (documented on Connection) --------------------------------

    def recv_bytes(self, maxlength=None, *, timeout=None):
        cdef Py_ssize_t maxl = -1
        cdef double deadline
        cdef int kind
        self._check_readable()
        if maxlength is not None:
            maxl = maxlength
            if maxl < 0:
                raise ValueError("negative maxlength")
        deadline = _deadline(timeout)
        try:
            self._lock_read(deadline)
            try:
                kind = -1
                payload = None
                if self._object is None:
                    kind = self._frame(deadline, maxl, NULL, 0, False)
                    payload = self._take_result()
                    if kind == FP_KIND_DATA:
                        return payload
                return self._message(kind, payload, deadline, True, maxl)
            finally:
                self._unlock_read()
        except _Expired:
            raise timeout_error(timeout, *self._lost(), watched(self)) from None

    def recv_bytes_into(self, buf, offset=0, *, timeout=None):
        cdef Py_buffer view
        cdef double deadline
        cdef int kind
        cdef Py_ssize_t off
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
            off = offset
            PyObject_GetBuffer(flat, &view, PyBUF_WRITABLE)
            try:
                deadline = _deadline(timeout)
                try:
                    self._lock_read(deadline)
                    try:
                        kind = -1
                        result = None
                        if self._object is None:
                            kind = self._frame(deadline, -1, <char *>view.buf + off,
                                               view.len - off, False)
                            result = self._take_result()
                            if result is None:
                                return self._rsize
                        if kind != FP_KIND_DATA:
                            result = self._message(kind, result, deadline, True, -1)
                    finally:
                        self._unlock_read()
                except _Expired:
                    raise timeout_error(timeout, *self._lost(), watched(self)) from None
                if len(result) > view.len - off:
                    raise BufferTooShort(result)
                memcpy(<char *>view.buf + off, PyBytes_AS_STRING(result), len(result))
                return len(result)
            finally:
                PyBuffer_Release(&view)

    def recv(self, *, timeout=None):
        cdef double deadline
        cdef int kind
        self._check_readable()
        deadline = _deadline(timeout)
        try:
            self._lock_read(deadline)
            try:
                kind = -1
                payload = None
                if self._object is None:
                    kind = self._frame(deadline, -1, NULL, 0, False)
                    payload = self._take_result()
                    if kind == FP_KIND_DATA:
                        return _loads(payload)
                return self._message(kind, payload, deadline, False, -1)
            finally:
                self._unlock_read()
        except _Expired:
            raise timeout_error(timeout, *self._lost(), watched(self)) from None

    def poll(self, timeout=0.0):
        cdef int fd, rc
        cdef double deadline, started
        self._check_readable()
        if self._bend > self._bstart and not self._pbulk:
            return True
        fd = self._bfd if self._pbulk else self._fd
        deadline = _deadline(timeout)
        self._enter()
        try:
            started = fp_now()
            if self._spin_ready(fd, deadline):
                return True
            rc = self._wait_readable(fd, deadline)
            if rc == W_READY:
                self._note_wait(fp_now() - started)
            return rc != W_TIMEOUT
        finally:
            self._leave()

    def _handles(self):
        """(read fd, write fd, bulk read fd, bulk write fd); -1 for no bulk fd."""
        return self._fd, self._wfd, self._bfd, self._bwfd

    def _send_segments(self, list segments):
        """Write one message given as ``[pipe_parts, bulk_payload, pipe_parts, ...]``."""
        self._check_writable()
        if self._wpad:
            segments = padded(segments)
        if len(segments) > 1:
            self._write_segments(segments)
        else:
            self._write_parts(segments[0])

    def _lock_write_nowait(self):
        """Take the write lock if it is free: True if taken (asyncio sends hold it across
        awaits so that no thread writes inside their frame)."""
        if self._gen != _fork_gen:
            self._renew_locks_after_fork()
        if not turn_try(&self._wturn):
            return False
        self._async_owner = PyThread_get_thread_ident()
        return True

    def _unlock_write(self):
        if self._async_owner == 0:
            return  # forked while an asyncio send held it: the child's lock is another
        self._async_owner = 0
        turn_give(&self._wturn)

    def _write_nowait(self, list parts, bint bulk):
        """Write ``parts`` to the pipe (the bulk fd when ``bulk``) without ever blocking: the
        bytes written, 0 when the fd is full, -1 when this system has no non-blocking write.
        The caller holds the write lock."""
        cdef _Iov v
        cdef iovec *iov
        cdef int rc, err, fd, cnt
        cdef size_t written = 0, cap
        self._check_writable()
        fd = self._bwfd if bulk else self._wfd
        cap = 0 if bulk else self._wcap
        v = _Iov(parts, min(len(parts), 1024))
        iov = v.iov
        cnt = <int>v.count
        self._enter()
        try:
            with nogil:
                rc = fp_writev(fd, &iov, &cnt, 1, cap, cap, &written)
                err = errno
        finally:
            v.release()
            self._leave()
        if rc == FP_OK or written > 0:
            return written
        if err == EAGAIN:
            return 0
        if err == EOPNOTSUPP or err == ENOSYS:
            return -1
        _retry(err)
        return 0

    def _has_buffered(self):
        """Whether bytes read ahead wait in the buffer (a foreign select() cannot see them)."""
        return self._fd >= 0 and self._bend > self._bstart

    @property
    def _pending_bulk_fd(self):
        """The bulk fd while a frame's bulk payload is partly read, else None."""
        return self._bfd if self._pbulk and self._fd >= 0 else None

    @property
    def _eof_wait(self):
        """Seconds left for a watched writer's death to show after end of file (a waiter then
        watches the liveness fd, not the fd at end of file), or None."""
        if self._eof_until < 0 or self._dead or self._liveness is None or self._fd < 0:
            return None
        return max(self._eof_until - fp_now(), 0.0)

    @property
    def _liveness_fd(self):
        """The watched writer's pidfd, readable once it died, or None."""
        return None if self._lfd < 0 else self._lfd
