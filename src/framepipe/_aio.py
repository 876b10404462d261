"""asyncio for both cores: reads and writes on the running loop's own reader and writer
callbacks, no thread.

A read first takes whatever the connection can complete without blocking (a read with a zero
timeout keeps any partial frame on the connection); otherwise it waits for the fd, or the
watched writer's pidfd, to become readable. A cancelled read therefore leaves the stream
consistent: the bytes that arrived stay with the connection for the next read.

A send writes what the pipe takes at once with non-blocking writes (pwritev2 with RWF_NOWAIT:
the flag is per call, so children sharing the fd keep their blocking writes), then waits on
the loop's writer callback for the rest. The frame holds the connection's write lock until it
is whole, and a cancelled send finishes its frame in the background, so the reader never meets
half a frame. Where there are no non-blocking writes, the default executor writes instead.
If the loop ends (``asyncio.run`` cancels every task) before such a frame is whole, the rest
is written there and then, waiting up to ``FINISH_AT_END`` seconds for the reader; failing
that, the connection is closed, so that its reader meets an end of file in the frame, not a
frame spliced with the next.

Any number of coroutines may wait for one fd: the loop gets one reader (or writer) callback
per fd, which wakes them all. ``close()`` wakes the coroutines that wait on the connection
with OSError, and takes its fds out of their loops before they are closed (from the loop's
own thread; from another thread the wake-up goes through ``call_soon_threadsafe``).
"""

from __future__ import annotations

import select
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from ._args import check_send_args
from ._lazy import asyncio  # imported on first use (see _lazy)
from ._pickling import dumps, dumps_bulk
from ._stream_errors import closed, timeout_error
from ._wire import BULK_MIN, KIND_BULK, KIND_DATA, header, padded
from .errors import ReadTimeout

_CONTENDED = 0.0005  # how often an async send looks again at a write lock a thread holds


FINISH_AT_END = 5.0  # seconds a frame cut by the loop's end may take to be written whole

# Per loop, per fd: the futures of the coroutines waiting for it (readers, writers); the loop
# has one callback per fd, which wakes them all.
_waiting: weakref.WeakKeyDictionary[Any, tuple[dict[int, set[Any]], dict[int, set[Any]]]] = (
    weakref.WeakKeyDictionary()
)
# Per connection: (loop, fd, future, writer) of each coroutine waiting on it, for close().
_by_conn: weakref.WeakKeyDictionary[Any, set[tuple[Any, int, Any, bool]]] = (
    weakref.WeakKeyDictionary()
)
_by_conn_lock = threading.Lock()


def _wake_all(waiters: set[Any]) -> None:
    for fut in list(waiters):
        if not fut.done():
            fut.set_result(None)


def _watch(conn: Any, loop: Any, fd: int, fut: Any, writer: bool) -> None:
    tables = _waiting.get(loop)
    if tables is None:
        tables = _waiting[loop] = ({}, {})
    table = tables[writer]
    waiters = table.get(fd)
    if waiters is None:
        waiters = table[fd] = set()
        (loop.add_writer if writer else loop.add_reader)(fd, _wake_all, waiters)
    waiters.add(fut)
    with _by_conn_lock:
        _by_conn.setdefault(conn, set()).add((loop, fd, fut, writer))


def _unwatch(conn: Any, loop: Any, fd: int, fut: Any, writer: bool) -> None:
    with _by_conn_lock:
        mine = _by_conn.get(conn)
        if mine is not None:
            mine.discard((loop, fd, fut, writer))
    tables = _waiting.get(loop)
    waiters = None if tables is None else tables[writer].get(fd)
    if waiters is None or fut not in waiters:
        return
    waiters.discard(fut)
    if not waiters:
        del tables[writer][fd]  # type: ignore[index]
        if not loop.is_closed():
            (loop.remove_writer if writer else loop.remove_reader)(fd)


def _fail(conn: Any, loop: Any, fd: int, fut: Any, writer: bool) -> None:
    _unwatch(conn, loop, fd, fut, writer)
    if not fut.done():
        fut.set_exception(closed())


def closing(conn: Any) -> None:
    """``conn`` is about to close: wake every coroutine waiting on it with OSError, and take
    its fds out of the loops (now when the loop runs in this thread)."""
    with _by_conn_lock:
        entries = _by_conn.pop(conn, None)
    if not entries:
        return
    try:
        here = asyncio.get_running_loop()
    except RuntimeError:
        here = None
    for loop, fd, fut, writer in entries:
        if loop is here:
            _fail(conn, loop, fd, fut, writer)
        else:
            try:
                loop.call_soon_threadsafe(_fail, conn, loop, fd, fut, writer)
            except RuntimeError:  # that loop is closed: nothing waits there any more
                pass


async def _wait_for_fds(
    conn: Any, fds: list[int], timeout: float | None, writer: bool = False
) -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()
    added = []
    try:
        for fd in fds:
            _watch(conn, loop, fd, fut, writer)
            added.append(fd)
        if timeout is None:
            await fut
        else:
            await asyncio.wait_for(fut, timeout)
    finally:
        for fd in added:
            _unwatch(conn, loop, fd, fut, writer)


async def recv_async(conn: Any, read: Callable[[float], Any], timeout: float | None) -> Any:
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + max(float(timeout), 0.0)
    while True:
        try:
            return read(0.0)
        except ReadTimeout as exc:
            if exc.sentinel:
                raise
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            raise timeout_error(timeout)
        live = conn._liveness_fd
        eof_wait = conn._eof_wait
        if eof_wait is not None:
            # End of file from a watched writer whose death has not shown yet: wait for it
            # (the fd at end of file is always readable), or for the grace to end.
            fds = [] if live is None else [live]
            wait = eof_wait if remaining is None else min(remaining, eof_wait)
        else:
            bulk = conn._pending_bulk_fd  # a partly read bulk payload arrives on its own fd
            fds = [conn.fileno() if bulk is None else bulk]
            if live is not None:
                fds.append(live)
            wait = remaining
        try:
            await _wait_for_fds(conn, fds, wait)
        except asyncio.TimeoutError:
            pass  # the loop above reads once more, then reports the timeout


class _Message:
    """What is left to write of one message: ``(bulk, [memoryview, ...])`` steps in order,
    the pipe's parts and, for a bulk frame, its payload on the bulk fd."""

    def __init__(self, segments: list[Any]) -> None:
        self.steps: list[tuple[bool, list[memoryview]]] = []
        for i, segment in enumerate(segments):
            bulk = bool(i & 1)  # [pipe_parts, bulk_payload, pipe_parts, ...]
            views = [memoryview(p).cast("B") for p in ([segment] if bulk else segment)]
            views = [v for v in views if v.nbytes]
            if views:
                self.steps.append((bulk, views))

    def write_nowait(self, conn: Any) -> bool | None:
        """Write what the fds take without blocking: True when all is written, False when a
        fd is full, None when this system has no non-blocking write (nothing written)."""
        while self.steps:
            bulk, views = self.steps[0]
            n = conn._write_nowait(views, bulk)
            if n < 0:
                return None
            if n == 0:
                return False
            while views and n >= views[0].nbytes:
                n -= views[0].nbytes
                views.pop(0)
            if n:
                views[0] = views[0][n:]
            if not views:
                self.steps.pop(0)
        return True

    def fd(self, conn: Any) -> int:
        """The fd the next bytes go to."""
        _, wfd, _, bwfd = conn._handles()
        fd: int = bwfd if self.steps and self.steps[0][0] else wfd
        if fd < 0:
            raise closed()
        return fd

    async def finish(self, conn: Any) -> None:
        """Write the rest, waiting on the loop's writer callbacks whenever a fd is full."""
        while True:
            try:
                await _wait_for_fds(conn, [self.fd(conn)], None, writer=True)
            except asyncio.CancelledError:
                self.finish_here(conn)  # the loop is ending: the frame must still be whole
                raise
            done = self.write_nowait(conn)
            if done:
                return
            if done is None:
                raise OSError("non-blocking writes stopped working in the middle of a frame")

    def finish_here(self, conn: Any) -> None:
        """Write the rest in this thread, waiting in poll() up to FINISH_AT_END seconds for
        room; if the reader does not make it, close the connection (its reader then meets an
        end of file inside the frame, and says so)."""
        end = time.monotonic() + FINISH_AT_END
        try:
            while True:
                done = self.write_nowait(conn)
                if done:
                    return
                left = end - time.monotonic()
                if done is None or left <= 0:
                    break
                poller = select.poll()
                poller.register(self.fd(conn), select.POLLOUT)
                poller.poll(left * 1000.0)
        except OSError:
            pass
        conn.close()


# Per connection: the loop its asyncio lock belongs to, and the lock.
_locks: weakref.WeakKeyDictionary[Any, tuple[Any, asyncio.Lock]] = weakref.WeakKeyDictionary()


async def _send(conn: Any, segments: list[Any]) -> None:
    """Write one message from a coroutine.

    Coroutines queue on an asyncio lock of the connection; the connection's own write lock is
    then held for the whole frame, so no thread writes inside it. A full pipe suspends the
    coroutine on the loop's writer callback. If the caller is cancelled in the middle of the
    frame, the rest is written in the background (and the locks released after it): the stream
    never holds half a frame.
    """
    message = _Message(padded(segments) if conn._wpad else segments)
    loop = asyncio.get_running_loop()
    owner, lock = _locks.get(conn, (None, None))
    if lock is None or owner is not loop:
        lock = asyncio.Lock()
        _locks[conn] = (loop, lock)
    await lock.acquire()
    try:
        while not conn._lock_write_nowait():  # a thread is writing a frame: let it finish
            await asyncio.sleep(_CONTENDED)
    except BaseException:
        lock.release()
        raise

    def release(task: asyncio.Task[None] | None = None) -> None:
        conn._unlock_write()
        lock.release()
        if task is not None and not task.cancelled():
            task.exception()  # raised to the caller, or lost with a cancelled caller

    try:
        done = message.write_nowait(conn)
    except BaseException:
        release()
        raise
    if done:
        release()
        return
    if done is None:  # no non-blocking writes here: a thread writes, taking the locks itself
        release()
        await loop.run_in_executor(None, conn._send_segments, segments)
        return
    task = loop.create_task(message.finish(conn))
    task.add_done_callback(release)
    await asyncio.shield(task)


async def send_bytes_async(conn: Any, buf: Any, offset: int, size: int | None) -> None:
    m = memoryview(buf)
    if m.itemsize > 1:
        m = m.cast("B")
    size = check_send_args(m.nbytes, offset, size)
    payload = m[offset : offset + size]
    if size >= BULK_MIN and conn._handles()[3] >= 0:
        await _send(conn, [[header(KIND_BULK, size)], payload, []])
    else:
        await _send(conn, [[header(KIND_DATA, size), payload]])


async def send_object_async(conn: Any, obj: Any) -> None:
    if conn._handles()[3] >= 0:
        await _send(conn, dumps_bulk(obj, BULK_MIN))
    else:
        await _send(conn, [dumps(obj)])
