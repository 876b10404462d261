"""The dispatch core behind :class:`~framepipe.workers.Worker` and
:class:`~framepipe.workers.Pool`.

One manager thread owns the workers: it waits on every worker's data channel, health channel
and stderr pipe at once (death arrives as :class:`framepipe.WriterDied` on the data channel,
the moment the kernel reports it, after every result written before it), enforces deadlines
and replaces workers. Callers never wait for that thread to send: a submitting thread pickles
its task and, when a worker has room, writes it to that worker's pipe itself; the manager only
hands out what had to wait.

A worker runs its tasks in the order it received them, so the parent always knows which task
a worker is running: the oldest one without a result. When a worker dies, that task fails with
:class:`WorkerCrashed`; tasks queued behind it never started and go to another worker (a
:class:`Pool`) or fail with the same error (a :class:`Worker`, whose state is gone).

Sends never block on a worker that is itself blocked writing: a worker is given more work only
while everything it has not answered fits in its pipe, unless it has nothing at all (it is then
reading).

Answers are read by whoever holds a worker's read lock. That is the manager thread, except
while a caller waits in ``Future.result()`` for a task that worker holds: the caller then takes
the worker's data channel out of the manager's epoll set and reads it itself (setting the
futures of any other task answered meanwhile), and hands it back when its own answer came. A
round trip then costs the worker's hop and nothing else: no wake-up of the manager, no second
hand-off from the manager to the caller. A caller that finds the lock taken (another caller or
the manager reads that worker) waits on its future as before. Anything that completes a task
from outside (its deadline, a cancel, a shutdown) pokes the reading caller's eventfd, so it
never waits on a channel for an answer that has already been given.
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import contextlib
import itertools
import multiprocessing.util  # noqa: F401 - its exit hook is registered before ours
import os
import pickle
import select
import signal
import socket
import threading
import time
import types
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .._lazy import asyncio  # imported on first use (see _lazy)
from .._spin import workers_may_spin
from ..errors import ReadTimeout, WriterDied
from ..remote import dumps_exception
from . import _byvalue, _process, _shm
from ._mainguard import refuse_during_main_import
from ._process import ChildContext, WorkerProcess
from .errors import (
    PoolBroken,
    TaskPicklingError,
    TaskTimeout,
    TaskUnpicklingError,
    WorkerCancelled,
    WorkerCrashed,
    WorkerError,
    WorkerStartError,
    init_error,
    revive,
    start_error,
    unloadable_error,
    unpicklable_error,
)

# Operations, parent to worker (first item of the pickled tuple). BATCH carries the pickles of
# several tasks in one frame: one write for many small tasks. MAP carries a function once and
# the pickles of (task id, args) of several calls of it (map's items).
CALL, STREAM, CLOSE, BATCH, RETURN, MAP = 0, 1, 2, 3, 4, 5
# Replies, worker to parent.
RESULT, ERROR, ITEM, END, RECYCLE = 0, 1, 2, 3, 4

# NOTE [ Feeding ahead and balance ]
#
# A worker is fed ahead, so that it never waits for the manager between two tasks and small
# tasks share frames (BATCH, MAP): it is given about QUEUE_SECONDS of work at its recent time
# per task (``Slot.cap``, at most MAX_INFLIGHT tasks and PIPE_ROOM bytes). That measure looks
# back, and the tasks ahead may be longer than those behind: after a burst of tiny tasks, a
# worker's time per task says it may take 128 more, and 2 ms tasks given that way left the
# other workers idle (efficiency 0.29-0.62 on a burst of 40 * N tasks of 2 ms). Two rules keep
# the balance whatever came before:
#
# - A share: no worker holds more than its even part of all the work there is, pending and in
#   hand (``Core._share``: ceil(all / workers)). A burst of 20,000 tiny tasks still goes out in
#   frames of a hundred; 160 tasks of 2 ms on 4 workers go out 40 each, not 128 to one.
# - Taking over: while nothing is pending, a worker that is idle takes over the tasks another
#   holds but has not started (``_steal``, ``_revoke``: the holder's worker confirms which ones
#   it has not started, so none runs twice), as soon as that worker's queue is ``STEAL_AFTER``
#   (1 ms) of work at its time per task, or its head task has run that long. So no worker stays
#   idle much over a millisecond while another holds tasks it has not started, and a task of
#   seconds among thousands of short ones holds none of them up.
#
# Measured on 2 cores (``python -m framepipe bench workers --rows mixed``): tiny tasks then
# 40 * N tasks of 2 ms, efficiency 0.93 at N = 2 and 4 (ProcessPoolExecutor 0.87-0.88,
# multiprocessing.Pool 0.89-0.90), where it was 0.51 (median) before; no-op submit and map
# rates unchanged within the bench's noise.

PIPE_ROOM = 512 * 1024  # bytes a worker may owe us before it gets more (its pipe holds 1 MiB)
MAX_INFLIGHT = 128  # tasks sent to one worker before its first answer
BATCH_BYTES = 64 * 1024  # tasks smaller than this may share one frame
_MAP_STEP = 256  # map() queues its items this many at a time
SHM_SLOTS = 16  # memfds per worker for large arrays in results (more use the bulk channel)
LOW_WATER = 8  # a submitting thread sends directly only to a worker with fewer tasks in hand
QUEUE_SECONDS = 0.002  # a worker is given about this much work ahead
# A task at the head of a worker's queue that runs this long (or 4 times the worker's recent
# time per task, if longer) makes its worker slow: it is given nothing more until it answers,
# and while another worker is idle, the tasks queued behind it are taken back (see _steal).
SLOW_HEAD = 0.01
# A worker idle while nothing is pending takes over the tasks another worker holds but has not
# started, once that worker's head task has run this long (or its queue would take this long
# at its recent time per task). See NOTE [ Feeding ahead and balance ].
STEAL_AFTER = 0.001
STACK_WAIT = 1.0  # seconds to wait for a worker's stack dump at a deadline
_CLOSING_LOOK = 0.25  # seconds between a closing manager's looks at whether all is done
_REAP_DELAY = 0.001  # a dead worker is reaped (and replaced) this long after its report
_PARTIAL_WAIT = 1.0  # the manager waits this long for the rest of a frame that has started
RSS_PERIOD = 0.05  # a busy worker's peak RSS (and memory cgroup) is read this often
RSS_LINGER = 1.0  # the manager's samples go on this long after a worker's last work
_INF = float("inf")
_WAKE, _DATA, _HEALTH, _STDERR = range(4)
_EPOLL = getattr(select, "epoll", None)
# Callers read their worker's answers themselves only where the manager's fd set can be changed
# while it waits in it (epoll); elsewhere answers always come through the manager.
LEND = _EPOLL is not None and hasattr(os, "eventfd")
# A caller reads the channel itself only when at most this many answers are due before and with
# its own: behind a longer queue the manager is reading anyway, and lending costs two epoll_ctl.
LEND_DEPTH = 2
_EPOLL_IN = (select.EPOLLIN | select.EPOLLPRI) if _EPOLL is not None else 0
_FINISHED = concurrent.futures._base.FINISHED
_PENDING_STATES = (concurrent.futures._base.PENDING, concurrent.futures._base.RUNNING)


_names: dict[Any, str] = {}
_NO_KWARGS: dict[str, Any] = {}  # never changed: a call's **kwargs is a new dict
_SCALARS = frozenset({type(None), bool, int, float, complex})


class _Reading(threading.local):
    slot: Slot | None = None  # the worker whose channel this thread reads


_reading = _Reading()


def _task_name(fn: Any) -> str:
    try:
        return _names[fn]
    except (KeyError, TypeError):
        pass
    name = _name_of(fn)
    # Kept only for what lives as long as its module anyway: never a bound method (its
    # instance), a closure or a callable object, which the caller may expect to be freed.
    if type(fn) in _LASTING and "<locals>" not in name and len(_names) < 4096:
        _names[fn] = name
    return name


_LASTING = frozenset({types.FunctionType, types.BuiltinFunctionType, type})


def _name_of(fn: Any) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    if name is None:
        return type(fn).__qualname__
    module = getattr(fn, "__module__", None)
    return name if module in (None, "__main__", "builtins") else f"{module}.{name}"


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------

_context: ChildContext | None = None


def worker_namespace() -> dict[str, Any]:
    """The per-worker namespace of :meth:`Worker.exec`, ``store`` and ``load``."""
    if _context is None:
        raise RuntimeError("worker_namespace() is only available inside a framepipe worker")
    return _context.namespace


def task_loop(ctx: ChildContext) -> None:
    """A worker's main loop: run tasks in the order they arrive, answer each."""
    global _context
    _context = ctx
    conn = ctx.conn
    recv_bytes = conn.recv_bytes
    send = conn.send
    send_bytes = conn.send_bytes
    loads = pickle.loads
    dumps = pickle.dumps
    max_rss = ctx.options.get("max_rss")
    fdsock = ctx.options.get("fdsock")
    wire = (
        None
        if fdsock is None
        else _shm.Wire(socket.socket(fileno=fdsock.fd), ctx.options.get("shm_slots", SHM_SLOTS))
    )
    perf = time.perf_counter
    inbox: collections.deque[Any] = collections.deque()
    while True:
        if inbox:
            msg = inbox.popleft()
        else:
            try:
                blob = recv_bytes()
            except EOFError:
                return
            try:
                msg = loads(blob)
            except Exception as exc:  # noqa: BLE001 - the arguments of one task: it fails
                inbox.extend(_unloadable(blob, exc, 2))
                continue
            if msg[0] == BATCH:
                for blob in msg[1]:
                    try:
                        inbox.append(loads(blob))
                    except Exception as exc:  # noqa: BLE001 - as above
                        inbox.extend(_unloadable(blob, exc, 2))
                continue
            if msg[0] == MAP:
                fn = msg[1]
                for blob in msg[2]:
                    try:
                        tid, args = loads(blob)
                    except Exception as exc:  # noqa: BLE001 - as above
                        inbox.extend(_unloadable(blob, exc, 1))
                    else:
                        inbox.append((CALL, tid, fn, args, _NO_KWARGS))
                continue
        op = msg[0]
        if (op == CALL or op == STREAM or op == _UNLOADABLE) and not ctx.take_turn():
            continue  # the parent took it back (see Core._steal)
        if op == _UNLOADABLE:
            send((ERROR, msg[1], dumps_exception(msg[2])))
        elif op == CALL:
            tid, fn, args, kwargs = msg[1], msg[2], msg[3], msg[4]
            start = perf()
            ctx.current = tid
            try:
                if tid in ctx.cancelled:
                    raise WorkerCancelled(f"task {tid} was cancelled before it started")
                value = fn(*args, **kwargs)
                ctx.current = None
            except BaseException as exc:  # noqa: BLE001 - every failure goes to the caller
                ctx.current = None
                send((ERROR, tid, dumps_exception(exc)))
            else:
                try:
                    if type(value) in _SCALARS:
                        # pickled here: the connection's own send looks for out-of-band
                        # buffers, which a number never has
                        send_bytes(dumps((RESULT, tid, value), protocol=5))
                    else:
                        if wire is not None:
                            wire.used = []
                            value = _shm.convert_result(wire, value)
                            if wire.new:
                                wire.flush()
                        send((RESULT, tid, value))
                except (Exception, SystemExit) as exc:  # noqa: BLE001 - an unpicklable result
                    blob = None
                    if isinstance(exc, Exception):  # by value, if it can
                        blob = _byvalue.dumps_result((RESULT, tid, value))
                    if blob is not None:
                        send_bytes(blob)
                    else:
                        if wire is not None:
                            wire.give_back(wire.used)  # the parent never saw these arrays
                        err: BaseException = exc  # a SystemExit in a __reduce__: as itself
                        if isinstance(exc, Exception):
                            err = TaskPicklingError(
                                f"the result of {_task_name(fn)} could not be sent back: "
                                f"{type(exc).__name__}: {exc}"
                            )
                            err.__cause__ = exc
                        send((ERROR, tid, dumps_exception(err)))
            ctx.calls += 1
            ctx.busy += perf() - start
            # Answered: the call's objects are let go of now, not when the next one comes
            # (an argument whose __del__ tells its owner, as the stdlib's workers do).
            msg = fn = args = kwargs = value = None
            if max_rss is not None:
                rss = _process.current_rss(os.getpid())
                if rss is not None and rss > max_rss:
                    send((RECYCLE, rss, ctx.retire()))
        elif op == RETURN:
            if wire is not None:
                wire.give_back(msg[1])
        elif op == STREAM:
            _run_stream(ctx, msg[1], msg[2], msg[3], msg[4], msg[5])
        elif op == CLOSE:
            return


_UNLOADABLE = -1  # in a worker's inbox only: a task whose message could not be unpickled
_INT_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"})


def _leading_ints(blob: bytes, n: int) -> list[int]:
    """The first ``n`` integers at the head of a pickle, read without running it (fewer when
    something else comes first)."""
    import pickletools

    ints: list[int] = []
    try:
        for op, arg, _ in pickletools.genops(blob):
            if op.name in _INT_OPS:
                ints.append(arg)  # type: ignore[arg-type]
                if len(ints) == n:
                    break
            elif op.name not in ("PROTO", "FRAME", "MARK"):
                break
    except Exception:  # noqa: BLE001 - not even the head reads
        pass
    return ints


def _unloadable(blob: bytes, exc: BaseException, at: int) -> list[tuple[Any, ...]]:
    """The inbox entries for the tasks of a pickle (a message when ``at`` is 2, a map item
    when it is 1) that raised ``exc`` in the worker: those tasks fail with it, each in its
    turn, and the worker goes on. A task's id is the ``at``-th integer at the head of its
    pickle; the items of a MAP message are the pickles inside it. A message of no task ends
    the worker with ``exc``."""
    import pickletools

    ints = _leading_ints(blob, at)
    tids: list[int] = []
    if len(ints) == at and (at == 1 or ints[0] in (CALL, STREAM)):
        tids = [ints[-1]]
    elif at == 2 and ints[:1] == [MAP]:  # the function: every item fails
        for _, arg, _ in pickletools.genops(blob):
            if isinstance(arg, bytes) and arg[:1] == b"\x80":
                tids += _leading_ints(arg, 1)[:1]
    if not tids:
        raise exc
    entries = []
    for tid in tids:
        entries.append((_UNLOADABLE, tid, unloadable_error(tid, exc)))
    return entries


def _run_stream(ctx: ChildContext, tid: int, fn: Any, args: Any, kwargs: Any, window: int) -> None:
    send = ctx.conn.send
    start = time.perf_counter()
    ctx.open_stream(tid, window)
    gen: Any = None
    try:
        ctx.current = tid
        try:
            gen = fn(*args, **kwargs)
            it = iter(gen)
        finally:
            ctx.current = None
        while ctx.wait_credit(tid):
            ctx.current = tid
            try:
                item = next(it)
            except StopIteration:
                break
            finally:
                ctx.current = None
            send((ITEM, tid, item))
        if gen is not None and hasattr(gen, "close"):
            ctx.current = tid
            try:
                gen.close()
            finally:
                ctx.current = None
        send((END, tid))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the consumer
        ctx.current = None
        send((ERROR, tid, dumps_exception(exc)))
    finally:
        ctx.close_stream(tid)
        ctx.calls += 1
        ctx.busy += time.perf_counter() - start


def _exec(code: str) -> None:
    exec(compile(code, "<worker exec>", "exec"), worker_namespace())  # noqa: S102


def _store(name: str, value: Any) -> None:
    worker_namespace()[name] = value


def _load(name: str) -> Any:
    ns = worker_namespace()
    if name not in ns:
        raise KeyError(f"{name!r} is not in the worker's namespace; store() or exec() it first")
    return ns[name]


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


class _Poller:
    """The manager's wait on many fds: an epoll set (fds can be taken out of it and put back by
    another thread while the manager waits in it), or poll() where there is no epoll."""

    def __init__(self) -> None:
        self._ep = _EPOLL() if _EPOLL is not None else None
        self._poll = select.poll() if self._ep is None else None

    def register(self, fd: int) -> None:
        if self._ep is not None:
            self._ep.register(fd, select.EPOLLIN | select.EPOLLPRI)
        else:
            self._poll.register(fd, select.POLLIN | select.POLLPRI)  # type: ignore[union-attr]

    def unregister(self, fd: int) -> None:
        with contextlib.suppress(KeyError, OSError, ValueError):
            (self._ep or self._poll).unregister(fd)  # type: ignore[union-attr]

    def poll(self, timeout: float | None) -> list[tuple[int, int]]:
        """Ready (fd, events), waiting up to ``timeout`` seconds (None: no limit)."""
        if self._ep is not None:
            return self._ep.poll(-1 if timeout is None else timeout)  # type: ignore[no-any-return]
        return self._poll.poll(None if timeout is None else timeout * 1000.0)  # type: ignore[union-attr]

    def close(self) -> None:
        if self._ep is not None:
            self._ep.close()


class _Future(concurrent.futures.Future):  # type: ignore[type-arg]
    """A ``concurrent.futures.Future`` whose ``result()`` and ``exception()`` read the answer
    from the worker's channel in the waiting thread when they can (see the module docstring),
    instead of waiting for the manager thread to read it and wake them."""

    _core: Core | None = None
    _slot: Slot | None = None  # the worker the task was last sent to
    _actor: Core | None = None  # an actor's call: handing out its crash is noted (crash_seen)

    def _invoke_callbacks(self) -> None:
        # Completed by a caller that reads its worker's channel: its done-callbacks run in the
        # manager thread, as concurrent.futures runs them in its own, never in a thread that
        # waits for another result (which a slow callback would hold up) or that holds a
        # channel the manager needs (a callback that shuts the pool down would wait forever).
        core = self._core
        if _reading.slot is not None and core is not None and self._done_callbacks:  # type: ignore[attr-defined]
            core.call_soon(self)
        else:
            super()._invoke_callbacks()  # type: ignore[misc]

    def _back_to_pending(self) -> None:
        """Taken back from a worker before it started (see Core._steal): pending again."""
        with self._condition:
            if self._state == concurrent.futures._base.RUNNING:
                self._state = concurrent.futures._base.PENDING

    def result(self, timeout: float | None = None) -> Any:
        if self._state in _PENDING_STATES and self._core is not None:
            timeout = self._core.wait_for(self, timeout)
        if self._state == _FINISHED and self._exception is None:
            return self._result  # final once set: no need for the condition
        try:
            return super().result(timeout)
        finally:
            if self._actor is not None and self._exception is not None:
                self._actor.crash_seen(self._exception)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if self._state in _PENDING_STATES and self._core is not None:
            timeout = self._core.wait_for(self, timeout)
        exc = super().exception(timeout)
        if self._actor is not None and exc is not None:
            self._actor.crash_seen(exc)
        return exc


class _End:
    pass


_END = _End()


class ItemChannel:
    """Items of one stream, from the manager thread to a consumer (sync or asyncio)."""

    def __init__(self) -> None:
        self._items: collections.deque[Any] = collections.deque()
        self._cond = threading.Condition(threading.Lock())
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future[None]] | None = None

    def put(self, item: Any) -> None:
        with self._cond:
            self._items.append(item)
            self._cond.notify()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, fut = waiter
            with contextlib.suppress(RuntimeError):  # the loop is closed
                loop.call_soon_threadsafe(_wake, fut)

    def get(self, timeout: float | None) -> tuple[bool, Any]:
        """(True, item), or (False, None) when ``timeout`` passed first."""
        with self._cond:
            if not self._items:
                self._cond.wait_for(lambda: self._items, timeout)
            if not self._items:
                return False, None
            return True, self._items.popleft()

    async def aget(self, timeout: float | None) -> tuple[bool, Any]:
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._items:
                    return True, self._items.popleft()
                fut: asyncio.Future[None] = loop.create_future()
                self._waiter = (loop, fut)
            try:
                await asyncio.wait_for(fut, timeout)
            except asyncio.TimeoutError:
                with self._cond:
                    self._waiter = None
                    if self._items:
                        return True, self._items.popleft()
                return False, None


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


class _Failure:
    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Empty:
    pass


_EMPTY = _Empty()


class MapResults:
    """The outcomes of one ``map()``: a slot per item and one condition, instead of a
    ``Future`` per item. Its items stand in for futures inside the core."""

    def __init__(self, n: int) -> None:
        self.values: list[Any] = [_EMPTY] * n
        self.cond = threading.Condition(threading.Lock())
        self.waiting = -1
        self.cancelled = False

    def get(self, i: int, timeout: float | None) -> Any:
        """Item ``i``'s result (raising its exception); TimeoutError after ``timeout``."""
        values = self.values
        if values[i] is _EMPTY:
            self.wait(i, timeout)
        value = values[i]
        values[i] = None  # the iterator hands each result out once: let it go
        if type(value) is _Failure:
            raise value.exc
        return value

    def wait(self, i: int, timeout: float | None) -> None:
        """Wait until item ``i`` has its outcome; TimeoutError after ``timeout``."""
        values = self.values
        with self.cond:
            self.waiting = i
            if not self.cond.wait_for(lambda: values[i] is not _EMPTY, timeout):
                raise TimeoutError("map() did not finish within its timeout")
            self.waiting = -1

    def store(self, i: int, value: Any) -> None:
        self.values[i] = value
        if self.waiting == i:
            with self.cond:
                self.cond.notify_all()


class Task:
    """One call. ``payload`` is its pickled message; for an item of a map it is the pickle of
    ``(tid, args)`` only, and ``fn`` the function, sent once per frame (see MAP)."""

    __slots__ = (
        "tid",
        "future",
        "name",
        "payload",
        "size",
        "timeout",
        "stream",
        "delivered",
        "slot",
        "running",
        "fn",
        "seq",
        "crashes",
    )

    def __init__(
        self,
        tid: int,
        future: concurrent.futures.Future[Any],
        name: str,
        payload: bytes,
        timeout: float | None,
        stream: ItemChannel | None,
        fn: Any = None,
    ) -> None:
        self.tid = tid
        self.future = future
        self.name = name
        self.payload = payload
        self.size = len(payload)
        self.timeout = timeout
        self.stream = stream
        self.delivered = False
        self.running = False
        self.slot: Slot | None = None
        self.fn = fn
        self.seq = -1  # its number in the order of the tasks sent to its worker
        self.crashes: list[WorkerCrashed] | None = None  # of workers that died under it

    def fail(self, exc: BaseException) -> None:
        if self.stream is not None:
            self.stream.put(_Failure(exc))
        if not self.future.done():
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                self.future.set_exception(exc)
        slot = self.slot
        if slot is not None and slot.lent and slot.lent != threading.get_ident():
            slot.poke()  # a caller may be reading that worker's channel for this answer


class MapTask(Task):
    """An item of a map: a :class:`Task` that is also its own stand-in future (the part of the
    Future interface the core uses), its outcome kept in slot ``index`` of ``results``."""

    __slots__ = ("results", "index", "_slot")

    @property
    def future(self) -> MapTask:  # type: ignore[override]
        return self

    def __init__(
        self,
        tid: int,
        results: MapResults,
        index: int,
        name: str,
        payload: bytes,
        timeout: float | None,
        fn: Any,
    ) -> None:
        self.tid = tid
        self.results = results
        self.index = index
        self.name = name
        self.payload = payload
        self.size = len(payload)
        self.timeout = timeout
        self.stream = None
        self.delivered = False
        self.running = False
        self.slot = None
        self._slot = None
        self.fn = fn
        self.seq = -1
        self.crashes = None

    def done(self) -> bool:
        return self.results.values[self.index] is not _EMPTY

    def set_running_or_notify_cancel(self) -> bool:
        if self.results.cancelled:
            self.set_exception(concurrent.futures.CancelledError())
            return False
        return True

    def set_result(self, value: Any) -> None:
        results = self.results
        i = self.index
        if results.values[i] is _EMPTY:
            results.values[i] = value
            if results.waiting == i:
                with results.cond:
                    results.cond.notify_all()

    def set_exception(self, exc: BaseException) -> None:
        if self.results.values[self.index] is _EMPTY:
            self.results.store(self.index, _Failure(exc))

    def cancel(self) -> bool:
        if self.done():
            return False
        self.set_exception(concurrent.futures.CancelledError())
        return True


class Slot:
    """The manager's view of one worker."""

    def __init__(self, proc: WorkerProcess, index: int, shm: _shm.Receiver) -> None:
        self.proc = proc
        self.index = index
        self.shm = shm
        self.outstanding: collections.deque[Task] = collections.deque()
        self.sent_bytes = 0  # written by the dispatcher only
        self.done_bytes = 0  # written by the manager only
        self.ready = False
        self.retiring = False  # given no more work; closed once it has answered everything
        self.revoking = False  # it was asked for its queued tasks back (see Core._steal)
        self.cut_tid: int | None = None  # see Core.expire and _on_death (actors)
        self.steal_look = 0.0  # not asked for its queue again before this (see _steal)
        self.stopping: str | None = None  # why we are stopping it (its death is no crash)
        self.kill_at: float | None = None
        self.dead = False
        self.sent = 0
        self.head_since = 0.0
        self.avg = 0.001
        self.stderr_eof = False
        self.partial = False
        self.health_waiters: dict[int, concurrent.futures.Future[Any]] = {}
        self.last_rss_sample = 0.0
        self.active_at = -RSS_LINGER  # when it last had work (see Core._busy)
        self.crash_reason: str | None = None
        self.health_eof = False
        # Reading the data channel: whoever holds ``reader`` (the manager, or a caller that
        # took the channel out of the manager's fd set: ``lent`` is then that thread's id).
        # ``stale``: the manager's next event for it may predate the caller's last read.
        self.reader = threading.Lock()
        self.lent = 0
        self.stale = False
        self.poke_fd = -1  # a caller reading this channel also waits on this eventfd
        self.out_fds: list[int] = []  # its fds out of the manager's set while it is lent
        self.help_poller: Any = None

    def poke(self) -> None:
        if self.poke_fd >= 0:  # (none where callers never read a channel: no LEND)
            with contextlib.suppress(OSError):
                os.eventfd_write(self.poke_fd, 1)

    def close_poke(self) -> None:
        fd, self.poke_fd = self.poke_fd, -1
        self.help_poller = None
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def out_bytes(self) -> int:
        """Bytes of tasks sent and not answered yet."""
        return self.sent_bytes - self.done_bytes

    @property
    def usable(self) -> bool:
        return self.ready and not self.dead and not self.retiring and self.stopping is None

    def cap(self) -> int:
        return max(2, min(MAX_INFLIGHT, int(QUEUE_SECONDS / max(self.avg, 1e-7))))

    def slow_at(self) -> float:
        """When its head task will have run longer than its tasks take (see SLOW_HEAD)."""
        return self.head_since + max(SLOW_HEAD, 4.0 * self.avg)

    def slow(self, now: float) -> bool:
        return now > self.slow_at()

    def steal_at(self) -> float:
        """When the tasks it holds behind its head may be taken over by an idle worker: at
        once if they are that much work at its recent time per task, else once its head task
        has run ``STEAL_AFTER``. See NOTE [ Feeding ahead and balance ]."""
        if (len(self.outstanding) - 1) * self.avg >= STEAL_AFTER:
            return self.steal_look
        return max(self.head_since + STEAL_AFTER, self.steal_look)


_live_cores: weakref.WeakSet[Core] = weakref.WeakSet()


@atexit.register  # runs before multiprocessing's own hook, which would join our workers forever
def _stop_all_at_exit() -> None:
    """At interpreter exit, a pool first finishes the tasks it was given, shut down or not (as
    ``concurrent.futures`` does: work submitted is not dropped because nobody waited for it);
    then every worker of every pool and actor is stopped. A Ctrl-C during that wait stops
    them at once."""
    cores = list(_live_cores)
    try:
        for core in cores:
            if core.policy == "pool" and core.broken is None:
                core.shutdown(wait=True)
    except BaseException:  # noqa: BLE001 - a Ctrl-C: what is left is stopped below
        pass
    for core in cores:
        with contextlib.suppress(Exception):
            core.terminate(join=True)


class Core:
    """Workers, their queues and the manager thread. ``policy`` is ``"pool"`` (a crash fails
    the running task only; the worker is replaced) or ``"actor"`` (a crash fails every queued
    call; the worker is restarted for the next one)."""

    def __init__(
        self,
        *,
        max_workers: int,
        mp_context: Any,
        name: str,
        policy: str,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] = (),
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        log_dir: str | None = None,
        tee: bool = False,
        max_restarts: int | None = None,
        restart_window: float = 60.0,
        max_task_crashes: int = 1,
        task_timeout: float | None = None,
        kill_grace: float = 1.0,
        max_tasks_per_worker: int | None = None,
        max_rss: int | None = None,
        loop: Callable[[ChildContext], None] = task_loop,
    ) -> None:
        refuse_during_main_import(f"{'a Pool' if policy == 'pool' else 'a Worker'} {name!r}")
        self.name = name
        self.policy = policy
        self._n = max_workers
        self._mp = mp_context
        self.byvalue: _byvalue.Registry | None = None  # functions sent by value (_byvalue)
        self._main_by_value = _byvalue.main_by_value(mp_context)
        self._proc_kw: dict[str, Any] = dict(
            initializer=_byvalue.portable(mp_context, initializer),
            initargs=tuple(initargs),
            env=env,
            cwd=cwd,
            log_dir=log_dir,
            tee=tee,
            options={"max_rss": max_rss, "spin": workers_may_spin(max_workers)},
        )
        self._loop = loop
        self.max_restarts = max_restarts
        self.restart_window = restart_window
        self.max_task_crashes = max_task_crashes
        self._progress_at = 0.0  # when a worker last finished a task (see _count_crash)
        self.task_timeout = task_timeout
        self.kill_grace = kill_grace
        self.max_tasks = max_tasks_per_worker
        self._lock = threading.RLock()
        self._pending: collections.deque[Task] = collections.deque()
        self._slots: list[Slot] = []
        self._ids = itertools.count(1)
        self._names = itertools.count(0)
        self._tokens = itertools.count(1)
        self._cancelled: set[int] = set()
        # futures whose done-callbacks the manager runs (see _Future._invoke_callbacks)
        self._callbacks: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
        self._stopped_callbacks = False  # the manager ended: callbacks run where they are due
        self.closing = False
        self._terminating = False
        self.broken: BaseException | None = None
        self.crashes: list[BaseException] = []
        self._crash_times: collections.deque[float] = collections.deque()
        self.restarts = 0
        self.close_timeout = 5.0
        self._close_deadline: float | None = None
        self._to_reap: list[Slot] = []  # dead workers, reaped on the loop's next turn
        self._reap_at = 0.0
        self.last_exitcode: int | None = None
        self._version = 1  # bumped whenever the set of fds to wait on changes
        self._version_seen = 0
        self._poller: _Poller | None = None
        self._owners: dict[int, tuple[Slot | None, int]] = {}
        self._ep_lock = threading.Lock()  # the poller and _owners, lending a channel
        self._sleep_until = _INF  # when the manager's current wait ends at the latest
        self._manager_id = 0
        self._timers = task_timeout is not None
        self._dirty = True  # _maintain() has work: a death, a retirement, a start
        self._dispatch_lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self._dispatch_wanted = False
        # NOTE [an actor's crash]: calls made against a crashed actor's state never run on its
        # replacement. From the death's first moment (_on_death) until a caller is handed the
        # crash (crash_seen), every call made fails with it: held while the error is built
        # (_crash_hold), then failed at once (_unseen_crash). A call made once a caller has
        # seen it starts a new process. Submit lock held to read or change either.
        self._crash_hold: list[Task] | None = None
        self._unseen_crash: BaseException | None = None
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        _process.register_parent_side(self)
        self.stopped = concurrent.futures.Future()  # type: ignore[var-annotated]
        self.launched = threading.Event()  # the first max_workers processes were started
        self._thread = threading.Thread(target=self._run, name=f"framepipe-{name}", daemon=True)
        _live_cores.add(self)
        self._thread.start()

    def _close_in_child(self) -> None:
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self._poller is not None:
            with contextlib.suppress(OSError):
                self._poller.close()
        for slot in list(self._slots):
            slot.close_poke()

    # -- submitting (any thread) ------------------------------------------------------------

    def submit(
        self,
        op: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        timeout: float | None = None,
        window: int = 0,
    ) -> Task:
        self._check_open()  # before the arguments are pickled: a closed pool refuses any
        future: concurrent.futures.Future[Any] = _Future()
        if LEND:
            future._core = self  # type: ignore[attr-defined]
        if self.policy == "actor":
            future._actor = self  # type: ignore[attr-defined]
        tid = next(self._ids)
        stream = ItemChannel() if op == STREAM else None
        name = _task_name(fn)
        if self._main_by_value and getattr(fn, "__module__", None) == "__main__":
            fn = _byvalue.stand_in(self, fn)  # by value, if the worker cannot import it
        msg = (
            (CALL, tid, fn, args, kwargs) if op == CALL else (STREAM, tid, fn, args, kwargs, window)
        )
        try:
            payload = pickle.dumps(msg, protocol=5)
        except Exception as exc:  # noqa: BLE001 - by value, else the future fails, naming
            try:  # what could not be sent (as concurrent.futures: at result(), not submit())
                payload = _byvalue.dumps(self, msg, fn, exc)
            except Exception:  # noqa: BLE001
                future.set_exception(_unpicklable(fn, exc, args, kwargs))
                return Task(tid, future, name, b"", timeout, stream)
        task = Task(tid, future, name, payload, timeout, stream)
        with self._submit_lock:  # never held by the manager: submitting never waits for it
            self._check_open()  # again: it may have been shut down meanwhile
            crashed = self._behind_crash(task)
            # Nothing queued ahead of it and nobody dispatching: straight to a hungry worker.
            direct = (
                not crashed and not self._pending and self._dispatch_lock.acquire(blocking=False)
            )
            if not direct and not crashed:
                self._queue(task)
        if crashed:
            if crashed is not True:
                task.fail(crashed)
            return task
        if direct:
            try:
                sent = self._send_direct(task)
            finally:
                self._dispatch_lock.release()
            if not sent:
                with self._submit_lock:
                    crashed = self._behind_crash(task)
                    if not crashed:
                        self._pending.appendleft(task)  # ahead of any queued meanwhile
                        self._queue(None)
                        if self.broken is not None:
                            self._pending.remove(task)
                            task.fail(self.broken)
                if crashed and crashed is not True:
                    task.fail(crashed)
        if self._dispatch_wanted:
            self.kick()
        return task

    def _behind_crash(self, task: Task) -> BaseException | bool:
        """An actor's call made after its crash, before a caller saw it (submit lock held; see
        NOTE [an actor's crash]): True when it is held until the crash's error is built, the
        error to fail it with, or False when it may run."""
        if self._crash_hold is not None:
            self._crash_hold.append(task)
            return True
        return self._unseen_crash if self._unseen_crash is not None else False

    def crash_seen(self, exc: BaseException) -> None:
        """A caller was handed ``exc``: if it is the actor's crash, calls made from now on run
        on a new process (see NOTE [an actor's crash])."""
        if exc is self._unseen_crash:
            with self._submit_lock:
                if exc is self._unseen_crash:
                    self._unseen_crash = None

    def _newest_pending(self) -> int:
        """The id of the newest task queued here (submit lock held); -1 when none is."""
        return max((t.tid for t in self._pending), default=-1)

    def _check_open(self) -> None:
        """Raise what a submit to this core raises now: the error that broke it, or
        RuntimeError once it was shut down."""
        if self.broken is not None:
            raise self.broken.with_traceback(None)  # not the last raise's frames
        if self.closing:
            raise RuntimeError(f"cannot submit to {self.name}: it has been shut down")

    def _queue(self, task: Task | None) -> None:
        """Queue ``task`` (submit lock held) and kick the dispatch if a worker is hungry."""
        if task is not None:
            self._pending.append(task)
        if self.policy == "actor" and not any(
            s.stopping is None and not s.dead for s in self._slots
        ):
            self._dirty = True  # the manager starts a new process for it
            self.wake()
        # A worker with work in hand gets more from the manager, in batches, as its answers
        # arrive; only a hungry one is fed from here.
        if any(s.usable and len(s.outstanding) < LOW_WATER for s in self._slots):
            self._dispatch_wanted = True

    def _send_direct(self, task: Task) -> bool:
        """Send ``task`` alone to the least busy worker if one is hungry (dispatch lock held);
        False when none is."""
        with self._lock:
            slot = self._pick(task, 1)
            if slot is None or len(slot.outstanding) >= LOW_WATER:
                return False
            if not task.future.set_running_or_notify_cancel():
                return True  # cancelled already: nothing to send
            task.running = True
            idle = not slot.outstanding
            slot.outstanding.append(task)
            if idle:
                self._busy(slot, task)
            elif task.timeout is not None:
                self._timers = True
            slot.sent_bytes += task.size
            task.seq = slot.sent
            slot.sent += 1
            task.slot = slot
            task.future._slot = slot  # type: ignore[attr-defined]
            task.delivered = True  # before the write: the worker may die of it at once
            if self.max_tasks is not None and slot.sent >= self.max_tasks:
                slot.retiring = True
                self._dirty = True
                self.wake()
        try:
            if self.byvalue is not None:
                self.byvalue.define(slot)  # what it needs of the functions sent by value
            slot.proc.conn.send_bytes(task.payload)
        except (OSError, ValueError):
            task.delivered = False  # the worker is gone: its death reschedules it
        return True

    def submit_many(
        self, fn: Callable[..., Any], items: Iterable[tuple[Any, ...]], timeout: float | None = None
    ) -> MapResults:
        """Queue ``fn(*args)`` for every ``args`` of ``items`` at once (``map``)."""
        self._check_open()
        items = list(items)
        results = MapResults(len(items))
        name = _task_name(fn)
        dumps = pickle.dumps
        ids = self._ids
        try:
            if self._main_by_value and getattr(fn, "__module__", None) == "__main__":
                fn = _byvalue.stand_in(self, fn)
            try:
                dumps(fn, protocol=5)  # sent once per frame of items, not with each
            except Exception as exc:  # noqa: BLE001 - by value, once per worker
                fn = _byvalue.stand_in(self, fn, exc)
        except Exception as exc:  # noqa: BLE001 - every item fails with it
            for i in range(len(items)):
                results.store(i, _Failure(exc))
            return results
        # Queued a few hundred at a time, so the workers start while the rest is pickled.
        for start in range(0, len(items), _MAP_STEP):
            tasks = []
            for i in range(start, min(start + _MAP_STEP, len(items))):
                tid = next(ids)
                try:
                    payload = dumps((tid, items[i]), protocol=5)
                except Exception as exc:  # noqa: BLE001 - by value, else this item fails
                    try:
                        payload = _byvalue.dumps(self, (tid, items[i]), fn, exc)
                    except Exception:  # noqa: BLE001 - the others run
                        results.store(i, _Failure(_unpicklable(fn, exc, tuple(items[i]))))
                        continue
                tasks.append(MapTask(tid, results, i, name, payload, timeout, fn))
            with self._submit_lock:
                self._check_open()
                self._pending.extend(tasks)
            self.kick()
        return results

    def kick(self) -> None:
        """Hand pending tasks to workers with room (whoever holds the dispatch lock does it;
        a thread that finds it taken leaves the work to the holder)."""
        self._dispatch_wanted = True
        while self._dispatch_wanted and self._dispatch_lock.acquire(blocking=False):
            try:
                self._dispatch_wanted = False
                self._dispatch_locked()
            finally:
                self._dispatch_lock.release()

    def _pick(self, task: Task, queued: int) -> Slot | None:
        """The least busy worker that may take ``task`` now (lock held), of ``queued`` tasks
        waiting for one: never one already holding its share (see NOTE [ Feeding ahead and
        balance ])."""
        best = None
        now = 0.0
        held = 0
        for slot in self._slots:
            n = len(slot.outstanding)
            held += n
            if not slot.usable or slot.revoking:
                continue
            if n and (n >= slot.cap() or slot.out_bytes + task.size > PIPE_ROOM):
                continue
            if n and self.policy == "pool":
                now = now or time.monotonic()
                if slot.slow(now):
                    continue  # nothing more behind a task that runs long
            if self.max_tasks is not None and slot.sent >= self.max_tasks:
                continue
            if best is None or n < len(best.outstanding):
                best = slot
        if best is not None and len(best.outstanding) >= self._share(queued, held):
            return None
        return best

    def _share(self, queued: int, held: int) -> int:
        """The most tasks one worker may hold, of ``queued`` waiting and ``held`` in workers'
        hands: its even part of them all. See NOTE [ Feeding ahead and balance ]."""
        return max(1, -(-(queued + held) // self._n))

    def _dispatch_locked(self) -> None:
        while True:
            with self._lock:
                if not self._pending:
                    return
                task = self._pending[0]
                slot = self._pick(task, len(self._pending))
                if slot is None:
                    return
                batch = self._take_for(slot)
            if not batch:
                continue
            fn = batch[0].fn
            if fn is not None:
                payload = pickle.dumps((MAP, fn, [t.payload for t in batch]), protocol=5)
            elif len(batch) == 1:
                payload = batch[0].payload
            else:
                payload = pickle.dumps((BATCH, [t.payload for t in batch]), protocol=5)
            try:
                if self.byvalue is not None:
                    self.byvalue.define(slot)
                slot.proc.conn.send_bytes(payload)
            except (OSError, ValueError):
                for t in batch:
                    t.delivered = False  # the worker is gone: its death reschedules these

    def _take_for(self, slot: Slot) -> list[Task]:
        """Move the pending tasks that ``slot`` has room for into its queue (lock held): one
        frame's worth, of tasks that share a frame format (map items of one function, or
        whole tasks)."""
        batch: list[Task] = []
        nbytes = 0
        outstanding = slot.outstanding
        pending = self._pending
        share = self._share(len(pending), sum(len(s.outstanding) for s in self._slots))
        room = max(1, min(slot.cap(), share) - len(outstanding))
        owed = slot.sent_bytes - slot.done_bytes
        max_tasks = self.max_tasks
        while pending and len(batch) < room:
            task = pending[0]
            size = task.size
            if batch and (
                size >= BATCH_BYTES
                or nbytes + size > BATCH_BYTES
                or owed + size > PIPE_ROOM
                or task.fn is not batch[0].fn
            ):
                break
            pending.popleft()
            if not task.running:  # a task rescheduled after a crash is running already
                if not task.future.set_running_or_notify_cancel():
                    continue
                task.running = True
            idle = not outstanding
            outstanding.append(task)
            if idle:
                self._busy(slot, task)
            elif task.timeout is not None:
                self._timers = True
            slot.sent_bytes += size
            owed += size
            task.seq = slot.sent
            slot.sent += 1
            task.slot = slot
            task.future._slot = slot  # type: ignore[attr-defined]
            task.delivered = True  # before the write: the worker may die of it at once
            batch.append(task)
            nbytes += size
            if max_tasks is not None and slot.sent >= max_tasks:
                slot.retiring = True
                self._dirty = True
                self.wake()
                break
        return batch

    def _busy(self, slot: Slot, task: Task) -> None:
        """``slot`` was idle and has ``task`` now: its deadline and RSS samples start. The
        manager is woken when it would not know of them: it sleeps without a deadline only
        once every worker has been idle for ``RSS_LINGER`` seconds (so calls that come now and
        then do not each wake it)."""
        now = time.monotonic()
        slot.head_since = now
        if now - slot.active_at >= RSS_LINGER:
            slot.last_rss_sample = now  # a new series of samples, the first one period away
        slot.active_at = now
        self._timers = True
        if task.timeout is not None or self._sleep_until == _INF:
            self.wake()

    def wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"!")

    def call_soon(self, fut: concurrent.futures.Future[Any]) -> None:
        """Run ``fut``'s done-callbacks in the manager thread (at once, here, once it ended)."""
        with self._lock:
            queued = not self._stopped_callbacks
            if queued:
                self._callbacks.append(fut)
        if queued:
            self.wake()
        else:
            concurrent.futures.Future._invoke_callbacks(fut)  # type: ignore[attr-defined]

    def _run_callbacks(self) -> None:
        while self._callbacks:
            fut = self._callbacks.popleft()
            concurrent.futures.Future._invoke_callbacks(fut)  # type: ignore[attr-defined]

    # -- health requests --

    def health_request(self, slot: Slot, op: str, *args: Any) -> concurrent.futures.Future[Any]:
        fut: concurrent.futures.Future[Any] = concurrent.futures.Future()
        token = next(self._tokens)
        with self._lock:
            slot.health_waiters[token] = fut
        try:
            slot.proc.notify((op, token, *args))
        except (OSError, ValueError) as exc:
            with self._lock:
                slot.health_waiters.pop(token, None)
            fut.set_exception(WorkerError(f"worker {slot.proc.name!r} is gone: {exc}"))
        return fut

    def health_notify(self, slot: Slot, op: str, *args: Any) -> None:
        with contextlib.suppress(OSError, ValueError):
            slot.proc.notify((op, 0, *args))

    # -- a caller reading its own answer ----------------------------------------------------

    def wait_for(self, fut: _Future, timeout: float | None) -> float | None:
        """Read the answers of the worker ``fut``'s task was sent to in this thread until
        ``fut`` is done, ``timeout`` seconds passed, or the channel cannot be lent now (another
        thread reads it, the task has not been sent yet, the worker died). Returns the time
        left of ``timeout``, for the wait on the future itself."""
        me = threading.get_ident()
        if me == self._manager_id or _reading.slot is not None:
            return timeout  # the manager, or a callback run by a reading caller: never nest
        deadline = None if timeout is None else time.monotonic() + timeout
        slot = fut._slot
        while slot is not None and fut._state in _PENDING_STATES:
            try:
                if not self._lend(slot, me):
                    break
                _reading.slot = slot
                self._serve(slot, fut, deadline)
            finally:
                _reading.slot = None
                if slot.lent == me:
                    self._take_back(slot)
            if fut._slot is slot or (deadline is not None and time.monotonic() >= deadline):
                break
            slot = fut._slot  # it died and the task went to another worker: read that one
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _lend(self, slot: Slot, me: int) -> bool:
        """Take ``slot``'s channel from the manager (its data fd out of the epoll set) for
        thread ``me``."""
        if (
            slot.dead
            or slot.lent
            or len(slot.outstanding) > LEND_DEPTH
            or not slot.reader.acquire(False)
        ):
            return False
        try:
            with self._ep_lock:
                conn = slot.proc.conn
                if (
                    slot.dead
                    or slot.partial
                    or self._closed_poller()
                    or slot.poke_fd < 0
                    or conn._pending_bulk_fd is not None
                    or conn._liveness_fd is None
                ):
                    return False
                slot.lent = me  # from here on, the caller's take_back releases the lock
                # Its data fd only: the pidfd stays with the manager, which takes it out too if
                # the worker dies meanwhile (see _step).
                fd = conn.fileno()
                try:
                    self._poller._ep.unregister(fd)  # type: ignore[union-attr]
                except (KeyError, OSError, ValueError):
                    pass
                slot.out_fds = [fd]
                return True
        finally:
            if not slot.lent:
                slot.reader.release()

    def _take_back(self, slot: Slot) -> None:
        """Give ``slot``'s channel back to the manager."""
        with self._ep_lock:
            slot.lent = 0
            slot.stale = True
            out, slot.out_fds = slot.out_fds, []
            if not slot.dead and not self._closed_poller():
                ep: Any = self._poller._ep  # type: ignore[union-attr]
                conn = slot.proc.conn
                bulk = conn._pending_bulk_fd
                if bulk is not None:  # a payload is pending: wait on the bulk socket instead
                    data = conn.fileno()
                    out = [bulk if fd == data else fd for fd in out]
                    self._owners.setdefault(bulk, (slot, _DATA))
                for fd in out:
                    try:
                        ep.register(fd, _EPOLL_IN)
                    except (OSError, ValueError):
                        pass  # (FileExistsError: a rebuild put it back already)
            slot.reader.release()

    def _closed_poller(self) -> bool:
        return self._poller is None or self._wake_r < 0

    def _serve(self, slot: Slot, fut: _Future, deadline: float | None) -> None:
        """Read ``slot``'s answers until ``fut`` is done (or the deadline, a poke, the
        worker's death, a frame whose payload lags)."""
        conn = slot.proc.conn
        poller = slot.help_poller
        if poller is None:
            poller = slot.help_poller = select.poll()
            for fd in (conn.fileno(), conn._liveness_fd, slot.poke_fd):
                poller.register(fd, select.POLLIN | select.POLLPRI)
        poke = slot.poke_fd
        while fut._state in _PENDING_STATES and not slot.dead and fut._slot is slot:
            if not conn._has_buffered():
                if deadline is None:
                    events = poller.poll()
                else:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return
                    events = poller.poll(left * 1000.0)
                if not events:
                    return
                if len(events) == 1 and events[0][0] == poke:
                    with contextlib.suppress(OSError):
                        os.eventfd_read(poke)
                    continue
            try:
                self._drain(slot)
            except BaseException as exc:
                # A signal handler raised (Ctrl-C) while an answer was being handled: it may
                # be lost, and the channel's place in its stream of answers with it.
                self._interrupted(slot, exc)
                raise
            if self._pending:
                self.kick()  # answers make room
            if slot.partial or conn._pending_bulk_fd is not None:
                return  # the manager waits for the rest of the frame on the bulk socket

    def _interrupted(self, slot: Slot, exc: BaseException) -> None:
        """A caller's read of ``slot`` was cut short by an exception: no answer of that worker
        can be trusted to match its task any more. Its tasks fail, it is stopped (SIGKILL)
        and replaced."""
        reason = (
            f"the thread reading its answers was interrupted by {type(exc).__name__}, "
            "so it was stopped"
        )
        with self._lock:
            slot.stopping = slot.stopping or "interrupted"
            tasks = list(slot.outstanding)
            slot.outstanding.clear()
            slot.done_bytes = slot.sent_bytes
        err = WorkerError(
            f"worker {slot.proc.name!r} (pid {slot.proc.pid}): {reason}; "
            "its tasks may or may not have run"
        )
        for task in tasks:
            task.fail(err)
        slot.proc.kill()
        self._on_death(slot, None, reason=reason)

    # -- the manager thread -----------------------------------------------------------------

    def _spawn(self) -> Slot:
        index = next(self._names)
        kw = dict(self._proc_kw)
        mine = theirs = None
        if _shm.HAVE_MEMFD:
            # large arrays in results travel in memfds the worker passes over this socket
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            kw["options"] = {
                **kw["options"],
                "fdsock": _process._FdHandle(theirs.fileno()),
                "shm_slots": SHM_SLOTS,
            }
        proc = WorkerProcess(self._mp, f"{self.name}-{index}", self._loop, **kw)
        slot = Slot(proc, index, _shm.Receiver(mine))
        if LEND:
            slot.poke_fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        if mine is not None:
            _process.register_parent_side(slot.shm)
        try:
            proc.start()
        except BaseException:
            slot.shm.close_fds()
            raise
        finally:
            if theirs is not None:
                theirs.close()
        if index >= self._n:
            self.restarts += 1  # every process after the first max_workers
        with self._lock:
            self._slots.append(slot)
            self._version += 1
        return slot

    def _run(self) -> None:
        self._manager_id = threading.get_ident()
        try:
            try:
                for _ in range(self._n):
                    self._spawn()
            except BaseException as exc:  # noqa: BLE001 - every caller hears of it
                self._break(WorkerStartError(f"cannot start the workers of {self.name}: {exc}"))
            finally:
                self.launched.set()
            while True:
                self._step()
                if self._finished():
                    break
        except BaseException as exc:  # noqa: BLE001 - never leave callers waiting
            self._break(
                WorkerError(f"the manager of {self.name} failed: {type(exc).__name__}: {exc}")
            )
        finally:
            self._shutdown_workers()
            with self._lock:
                self._stopped_callbacks = True
            self._run_callbacks()
            self.stopped.set_result(None)

    def _finished(self) -> bool:
        with self._lock:
            if self._terminating:
                return True
            if self._close_deadline is not None and time.monotonic() >= self._close_deadline:
                return True  # closing took too long: the workers are stopped as they are
            if not self.closing and self.broken is None:
                return False
            if self._pending:
                return False
            return all(not s.outstanding for s in self._slots)

    def _rebuild_poller(self) -> None:
        """Register every fd the manager waits on: per worker its data channel (or the bulk
        socket a frame's payload is pending on), its death (pidfd), health channel and stderr
        pipe; and the wake pipe. Rebuilt only when that set changes."""
        poller = _Poller()
        owners: dict[int, tuple[Slot | None, int]] = {}

        def add(fd: int | None, slot: Slot | None, kind: int, polled: bool = True) -> None:
            if fd is not None and fd >= 0 and fd not in owners:
                owners[fd] = (slot, kind)
                if polled:
                    poller.register(fd)

        with self._ep_lock:
            self._version_seen = self._version
            add(self._wake_r, None, _WAKE)
            with self._lock:
                slots = list(self._slots)
            for slot in slots:
                if not slot.dead:
                    data, pidfd = self._data_fds(slot)
                    add(pidfd, slot, _DATA)
                    # a caller reads it: it comes back with the channel
                    add(data, slot, _DATA, polled=not slot.lent)
                    if slot.lent:
                        slot.out_fds = [] if data is None else [data]
                    if not slot.health_eof:
                        add(slot.proc.health.fileno(), slot, _HEALTH)
                fd = slot.proc.stderr_fd()
                if not slot.stderr_eof:
                    add(fd, slot, _STDERR)
            old, self._poller, self._owners = self._poller, poller, owners
        if old is not None:
            old.close()

    @staticmethod
    def _data_fds(slot: Slot) -> tuple[int | None, int | None]:
        """The fds that say an answer (or the worker's death) is there: its data channel (or
        the bulk socket a frame's payload is pending on) and its pidfd."""
        conn = slot.proc.conn
        bulk = conn._pending_bulk_fd
        return (conn.fileno() if bulk is None else bulk), conn._liveness_fd

    def _step(self) -> None:
        if self._version != self._version_seen:
            self._rebuild_poller()
        timeout = None
        self._sleep_until = _INF
        if self._timers:
            # Cleared before the look, not after: a thread that gives a worker a deadline
            # sets it again once the deadline can be seen.
            self._timers = False
            deadline = None
            with self._lock:
                slots = list(self._slots)
                steal = self._may_steal(slots)
                # the pool's own timers count even when no worker is left to carry them
                if self._to_reap:
                    deadline = self._reap_at
                if self._close_deadline is not None:
                    deadline = (
                        self._close_deadline
                        if deadline is None
                        else min(deadline, self._close_deadline)
                    )
            for slot in slots:
                for t in self._deadlines(slot, steal):
                    deadline = t if deadline is None else min(deadline, t)
            if deadline is not None:
                self._timers = True
                self._sleep_until = deadline
                timeout = max(0.0, deadline - time.monotonic())
        if self.closing and (timeout is None or timeout > _CLOSING_LOOK):
            # While closing, look again now and then whether all is done, whatever wake-up
            # may have been missed: a pool never hangs in its shutdown.
            timeout = _CLOSING_LOOK
        try:
            events = self._poller.poll(timeout)  # type: ignore[union-attr]
        except InterruptedError:
            events = []
        owners = self._owners
        for fd, _ in events:
            owner, kind = owners.get(fd, (None, -1))
            if owner is None:
                if kind == _WAKE:
                    with contextlib.suppress(OSError):
                        os.read(self._wake_r, 4096)
                continue
            if kind == _DATA:
                # Not while a caller reads it (it took the data fd out of the set, but this
                # event may have been taken just before; or it is the pidfd of a worker that
                # died while a caller read: that caller sees the death itself)
                if owner.dead:
                    continue
                if owner.reader.acquire(False):
                    try:
                        if not owner.stale or self._still_readable(owner):
                            self._drain(owner)
                    finally:
                        owner.reader.release()
                elif owner.lent:
                    self._park(owner, fd)
            elif kind == _HEALTH:
                if not owner.dead:
                    self._drain_health(owner)
            elif kind == _STDERR:
                if owner.proc.pump_stderr():
                    owner.stderr_eof = True
                    self._version += 1
        if self._to_reap and time.monotonic() >= self._reap_at:
            with self._lock:
                dead, self._to_reap = self._to_reap, []
            for slot in dead:
                self._reap(slot)
            self._dirty = True
        if self._timers:
            self._check_deadlines()
        if self._dirty:
            self._dirty = False
            self._maintain()
        if self._pending:
            self.kick()
        if self._callbacks:
            self._run_callbacks()

    def _park(self, slot: Slot, fd: int) -> None:
        """Take ``fd`` out of the set while a caller reads ``slot`` (a readable fd nobody
        reads would wake this thread again and again); its take_back puts it back."""
        with self._ep_lock:
            if slot.lent and fd not in slot.out_fds and not self._closed_poller():
                self._poller.unregister(fd)  # type: ignore[union-attr]
                slot.out_fds.append(fd)

    @staticmethod
    def _still_readable(slot: Slot) -> bool:
        """After a caller read the channel, whether the event the manager holds is still true
        (the caller may have read what it announced; a read would then wait)."""
        slot.stale = False
        conn = slot.proc.conn
        return bool(conn._has_buffered() or conn.poll(0))

    def _deadlines(self, slot: Slot, steal: bool) -> Iterator[float]:
        if self._to_reap:
            yield self._reap_at
        if self._close_deadline is not None:
            yield self._close_deadline
        if slot.kill_at is not None:
            yield slot.kill_at
        if slot.dead:
            return
        if slot.outstanding or slot.last_rss_sample < slot.active_at + RSS_LINGER:
            yield slot.last_rss_sample + RSS_PERIOD
        if slot.outstanding:
            if slot.stopping is None:
                head = slot.outstanding[0]
                if head.timeout is not None and head.stream is None:
                    yield slot.head_since + head.timeout
                if steal and self._may_steal_from(slot):
                    yield slot.steal_at()

    def _drain(self, slot: Slot) -> None:
        """Handle every message the worker has sent (its death last, after them). The caller
        holds ``slot.reader``."""
        conn = slot.proc.conn
        answered = 0
        handle = self._handle
        _shm.set_receiving(slot.shm)
        try:
            while True:
                try:
                    msg = conn.recv(timeout=_PARTIAL_WAIT)
                except ReadTimeout:
                    self._version += 1  # mid-frame: wait on wherever the rest will come from
                    return
                except (EOFError, OSError):
                    raise
                except BaseException as exc:  # noqa: BLE001 - see _unreadable
                    if not isinstance(exc, Exception) and threading.get_ident() != self._manager_id:
                        raise  # a caller's Ctrl-C, perhaps: see _serve
                    answered += self._unreadable(slot, exc)
                else:
                    answered += handle(slot, msg)
                if not conn._has_buffered():
                    if conn._pending_bulk_fd is not None or slot.partial:
                        slot.partial = conn._pending_bulk_fd is not None
                        self._version += 1
                    return
        except WriterDied as died:
            if answered:
                self._progress_at = time.monotonic()  # before its death counts
            self._on_death(slot, died)
        except (EOFError, OSError) as exc:
            if answered:
                self._progress_at = time.monotonic()
            self._on_death(slot, None, reason=f"its channel failed: {exc}")
        finally:
            _shm.set_receiving(None)
            if slot.shm.returned and not slot.dead:
                with contextlib.suppress(OSError, ValueError):
                    conn.send_bytes(pickle.dumps((RETURN, slot.shm.take_returned())))
            if answered:
                # Timing once a batch of answers: the time per task (which sets how far ahead
                # a worker is fed), when the new head task started, and now and then the RSS.
                now = time.monotonic()
                per_task = (now - slot.head_since) / answered
                self._progress_at = now
                slot.avg = slot.avg * 0.7 + per_task * 0.3
                slot.head_since = slot.active_at = now
                if (
                    not slot.outstanding
                    and self.policy == "pool"
                    and not self._pending
                    and any(len(s.outstanding) > 1 for s in self._slots)
                ):
                    # Idle now, while another worker holds tasks it has not started: the
                    # manager looks at taking them over (see NOTE [ Feeding ahead and
                    # balance ]); woken for it when a caller read this.
                    self._timers = True
                    if threading.get_ident() != self._manager_id:
                        self.wake()
                if slot.outstanding and threading.get_ident() != self._manager_id:
                    # Read by a caller: the manager sleeps until the deadline it knew of; a
                    # new head task with a shorter one must wake it.
                    head = slot.outstanding[0]
                    if head.timeout is not None and now + head.timeout < self._sleep_until:
                        self.wake()

    def _unreadable(self, slot: Slot, exc: BaseException) -> int:
        """A frame of ``slot``'s worker could not be unpickled here (a class this process
        cannot import, a ``__reduce__`` that raises in the parent): whole, but unreadable.
        Answers come in order, so it belonged to the task at the head: that task fails, the
        others go on. Returns 1 when that was the task's answer."""
        task = slot.outstanding[0] if slot.outstanding else None
        if task is None:
            raise WorkerError(
                f"worker {slot.proc.name} sent a message that could not be "
                f"read, with no task due: {type(exc).__name__}: {exc}"
            ) from exc
        what = "an item" if task.stream is not None else "the result"
        err = TaskUnpicklingError(
            f"{what} of {task.name} (task {task.tid}) from worker {slot.proc.name!r} could not "
            f"be unpickled in this process: {type(exc).__name__}: {exc}"
        )
        err.__cause__ = exc
        task.fail(err)
        if task.stream is not None:
            # An item (the end and errors always read): the stream stays due until its end,
            # which its generator, stopped now, sends.
            self.health_notify(slot, "stop", task.tid)
            return 0
        slot.outstanding.popleft()
        slot.done_bytes += task.size
        self._cancelled.discard(task.tid)
        return 1

    def _drain_health(self, slot: Slot) -> None:
        conn = slot.proc.health
        try:
            while conn.poll(0):
                reply = conn.recv()
                with self._lock:
                    fut = slot.health_waiters.pop(reply[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(reply[2])
        except (EOFError, OSError):
            with self._ep_lock:  # at its end: wait on it no more
                slot.health_eof = True
                if self._owners.pop(conn.fileno(), None) is not None:
                    self._poller.unregister(conn.fileno())  # type: ignore[union-attr]
            if not slot.dead and slot.reader.acquire(False):  # else its reader sees the death
                try:
                    self._drain(slot)  # the data channel tells how it died
                finally:
                    slot.reader.release()

    def _handle(self, slot: Slot, msg: Any) -> int:
        """Act on one message of ``slot``'s worker; returns 1 for an answer to a task."""
        kind = msg[0]
        if kind == RESULT or kind == ERROR or kind == END:
            # No lock: only the dispatcher appends to ``outstanding`` (deque operations are
            # atomic) and only the holder of ``slot.reader`` pops it and counts answered
            # bytes. Popped once its future is set: cut short in between (a caller's Ctrl-C),
            # the task is still there for the report.
            task = slot.outstanding[0]
            if task.tid != msg[1]:
                raise WorkerError(
                    f"worker {slot.proc.name} answered task {msg[1]} while task {task.tid} was due"
                )
            if kind == RESULT:
                if self._cancelled and task.tid in self._cancelled:
                    self._cancelled.discard(task.tid)
                    task.fail(WorkerCancelled(f"task {task.tid} was cancelled"))
                else:
                    try:
                        task.future.set_result(msg[2])
                    except concurrent.futures.InvalidStateError:
                        pass  # it failed already (its deadline passed, it was cancelled)
            elif kind == ERROR:
                self._cancelled.discard(task.tid)
                task.fail(revive(msg[2], executor=self.policy == "pool"))
            else:
                self._cancelled.discard(task.tid)
                if task.stream is not None:
                    task.stream.put(_END)
                if not task.future.done():
                    with contextlib.suppress(concurrent.futures.InvalidStateError):
                        task.future.set_result(None)
            slot.outstanding.popleft()
            slot.done_bytes += task.size
            task.payload = b""  # answered: its pickled call and function are not kept
            task.fn = None
            return 1
        elif kind == ITEM:
            task = slot.outstanding[0]
            slot.head_since = time.monotonic()
            if task.stream is not None:
                task.stream.put(msg[2])
        elif kind == RECYCLE:
            # Past max_rss after a task: it runs no task it was sent after that one (msg[2]
            # on), and closes once it answered the rest. Those run elsewhere.
            self._requeue(slot, msg[2], None, retire=True)
            self._dirty = True
            self.wake()  # when a caller read it
        elif kind == "ready":
            slot.ready = True
            self._timers = True  # an idle worker (see _steal)
            slot.proc.sample_rss()  # its initializer may have moved it to another cgroup
            slot.last_rss_sample = time.monotonic()
        elif kind == "init-failed":
            err = init_error(slot.proc, msg[1], msg[2])
            slot.stopping = "initializer failed"
            self._break(err)
        else:
            raise WorkerError(f"unexpected message {kind!r} from worker {slot.proc.name}")
        return 0

    # -- deaths, deadlines, replacement --

    def _on_death(self, slot: Slot, died: WriterDied | None, reason: str | None = None) -> None:
        # an actor's crash: calls made from now on wait for its error (NOTE [an actor's crash])
        crash = self.policy == "actor" and slot.stopping is None and not self.closing
        with self._submit_lock if crash else contextlib.nullcontext(), self._lock:
            if slot.dead:
                return
            if crash:
                queued = list(self._pending)  # made before the death: they fail with it
                self._pending.clear()
                self._crash_hold = []
            slot.dead = True
            self._version += 1
            self._dirty = True
            orphans = list(slot.outstanding)
            slot.outstanding.clear()
            slot.done_bytes = slot.sent_bytes
            waiters = list(slot.health_waiters.values())
            slot.health_waiters.clear()
        expected = slot.stopping is not None or (slot.retiring and not orphans)
        head = orphans[0] if orphans and orphans[0].delivered else None
        err = slot.proc.crash_error(
            died,
            head.name if head else None,
            head.tid if head else None,
            reason or slot.crash_reason,
            starting=not slot.ready,
        )
        if crash:
            # The actor's state is gone: the calls queued here behind the ones it held fail
            # too, and so do those made since, until a caller is handed the crash (NOTE [an
            # actor's crash]); a crash that failed no call (an idle worker died) holds none.
            with self._submit_lock, self._lock:
                held, self._crash_hold = self._crash_hold or [], None
                if orphans or queued:
                    self._unseen_crash = err  # before any caller can be handed it
                    queued += held
                else:
                    self._pending.extend(held)
                    self._queue(None)
        for fut in waiters:
            if not fut.done():
                fut.set_exception(err)
        if head is not None:
            orphans.pop(0)
            if self._blame(head, err):
                orphans.insert(0, head)  # it runs again, first (see NOTE [ Crashes ... ])
            else:
                head.fail(err)  # a task that timed out has failed already: this does nothing
        if crash:
            for task in orphans + queued:
                task.fail(err)
        elif self.policy == "actor":
            # A stopped actor (a passed deadline): the calls queued by the time the deadline
            # passed fail with it; later calls start a new process.
            with self._submit_lock, self._lock:
                cut = self._newest_pending() if slot.stopping is None else slot.cut_tid
                queued = (
                    []
                    if self.closing or cut is None
                    else [t for t in self._pending if t.tid <= cut]
                )
                for task in queued:
                    self._pending.remove(task)
            for task in orphans + queued:
                task.fail(err)
        else:
            with self._lock:
                broken = self.broken
                if broken is None:
                    for task in reversed(orphans):
                        if not task.future.done():  # (one a timeout failed already)
                            task.delivered = False
                            self._pending.appendleft(task)
            if broken is not None:  # the pool gave up: nothing runs again
                for task in orphans:
                    task.fail(broken)
        if not slot.ready and not expected and not self.closing:
            # It died before it could take a task (its bootstrap or imports failed): another
            # process would die the same way, so the workers are not restarted.
            self._break(start_error(self.name, err))
        elif not expected and not self.closing:
            self._count_crash(err)
        if self._pending:
            self.kick()  # the other workers take the orphans now, not after the replacement
        # Reaping and respawning wait for the next turn of the loop, after a short poll that
        # lets the callers just failed take the GIL (this thread would keep it for a switch
        # interval, 5 ms, while it reaps and starts a process).
        with self._lock:
            self._to_reap.append(slot)
            self._reap_at = time.monotonic() + _REAP_DELAY
            self._timers = True
        if threading.get_ident() != self._manager_id:
            self.wake()  # a caller reading the channel saw the death

    # NOTE [ Crashes blamed on tasks ]
    #
    # A worker that dies fails the task it was running, not the pool: that task has killed a
    # worker, and after ``max_task_crashes`` such deaths it fails with the last WorkerCrashed
    # (every report it caused in ``task_crashes``); before that it runs again, first, on
    # another worker. Tasks queued behind it never started and go to the other workers. The
    # pool itself breaks only on a crash loop: more than ``max_restarts`` workers dying in a
    # row, within ``restart_window`` seconds, with no task finished in between (a worker that
    # dies before it is ready, or a failing initializer, breaks it at once). A pool that keeps
    # finishing tasks between its crashes is never broken by them.

    def _blame(self, task: Task, err: WorkerCrashed) -> bool:
        """``task`` was running in a worker that died with ``err``: True when it goes again,
        else ``err`` carries every report of the crashes it caused. See NOTE [ Crashes blamed
        on tasks ]."""
        crashes = task.crashes = [*(task.crashes or ()), err]  # (dropped with the task)
        if (
            self.policy == "pool"
            and len(crashes) < self.max_task_crashes
            and task.stream is None
            and self.broken is None
            and not task.future.done()
        ):
            return True
        if len(crashes) > 1:
            err.blame(crashes[:-1])
        return False

    def _count_crash(self, err: WorkerCrashed) -> None:
        """Break the pool on a crash loop. See NOTE [ Crashes blamed on tasks ]."""
        self.crashes.append(err)
        del self.crashes[:-20]
        now = time.monotonic()
        times = self._crash_times
        times.append(now)
        while times and (now - times[0] > self.restart_window or times[0] < self._progress_at):
            times.popleft()
        if self.max_restarts is not None and len(times) > self.max_restarts:
            self._break(
                PoolBroken(
                    f"{self.name}: {len(times)} workers crashed in a row with no task finished "
                    f"between them (max_restarts={self.max_restarts}): a crash loop; giving up",
                    self.crashes,
                )
            )

    def _reap(self, slot: Slot) -> None:
        slot.proc.stop(timeout=1.0, grace=0.5)
        with slot.reader:  # a caller that read its channel has let go of it
            slot.proc.close()
        slot.close_poke()
        slot.shm.close_fds()
        self.last_exitcode = slot.proc.exitcode
        with self._lock:
            if slot in self._slots:
                self._slots.remove(slot)
                self._version += 1

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        with self._lock:
            slots = list(self._slots)
        self._steal(slots, now)
        for slot in slots:
            if slot.kill_at is not None and now >= slot.kill_at:
                slot.kill_at = None
                slot.proc.kill()
            if slot.dead:
                continue
            if now >= slot.last_rss_sample + RSS_PERIOD:
                # while it works: a worker the OOM killer takes has no /proc left to read
                slot.last_rss_sample = now
                if slot.outstanding:
                    slot.proc.sample_rss()
            if slot.stopping is not None or not slot.outstanding:
                continue
            head = slot.outstanding[0]
            if (
                head.timeout is not None
                and head.stream is None
                and now >= slot.head_since + head.timeout
            ):
                self.expire(slot, head, head.timeout, "task")

    # -- taking queued tasks back from a slow worker --

    def _may_steal(self, slots: list[Slot]) -> bool:
        """Whether an idle worker waits while nothing is pending (a pool's only)."""
        return (
            self.policy == "pool"
            and not self._pending
            and not self._terminating
            and any(s.usable and not s.outstanding for s in slots)
        )

    def _steal(self, slots: list[Slot], now: float) -> None:
        """A worker is idle with nothing pending, while another holds tasks it has not started:
        ask that one for them back (``_revoke``), for the idle ones to run. See NOTE [ Feeding
        ahead and balance ]."""
        if not self._may_steal(slots):
            return
        for slot in slots:
            if self._may_steal_from(slot) and now >= slot.steal_at():
                slot.steal_look = now + STEAL_AFTER
                self._revoke(slot)

    @staticmethod
    def _may_steal_from(slot: Slot) -> bool:
        """A live worker (retiring ones included) holding tasks behind its head, not asked
        for them yet."""
        return (
            slot.ready
            and not slot.dead
            and slot.stopping is None
            and not slot.revoking
            and len(slot.outstanding) > 1
        )

    def _revoke(self, slot: Slot) -> None:
        with self._lock:
            held = list(slot.outstanding)  # a copy: a caller reading its channel pops the head
            if slot.dead or slot.revoking or len(held) < 2:
                return
            first, end = held[1].seq, slot.sent
            slot.revoking = True  # given nothing until it answers
        reply = self.health_request(slot, "revoke", first, end)
        reply.add_done_callback(lambda r: self._revoked(slot, end, r))

    def _revoked(self, slot: Slot, end: int, reply: concurrent.futures.Future[Any]) -> None:
        """The worker gave back its tasks from number ``reply.result()`` to ``end``: they go
        to the front of the queue, as tasks not started (a caller may cancel them again)."""
        try:
            first = reply.result()
        except BaseException:  # noqa: BLE001 - it died: its death reschedules what it held
            slot.revoking = False
            return
        try:
            self._requeue(slot, first, end)
        except BaseException as exc:  # noqa: BLE001 - never a task left that nobody runs
            self._break(WorkerError(f"{self.name} lost track of its tasks: {exc!r}"))

    def _requeue(self, slot: Slot, first: int, end: int | None, retire: bool = False) -> None:
        """The worker of ``slot`` will not run its tasks numbered ``first`` to ``end`` (None:
        all it was sent; it said so): they go to the front of the queue, as tasks not
        started. ``retire``: it is given nothing more (decided under the same lock that
        gives tasks out, so that none is given it after ``end`` was read)."""
        with self._submit_lock, self._lock:
            slot.revoking = False
            if retire:
                slot.retiring = True
            if end is None:
                end = slot.sent
            if slot.dead:
                return
            # a copy: a caller reading the channel pops the head meanwhile (never one of these)
            moved = [t for t in list(slot.outstanding) if first <= t.seq < end]
            back = []
            for task in moved:
                slot.outstanding.remove(task)
                slot.sent_bytes -= task.size  # (done_bytes is the reader's)
                task.slot = None
                task.delivered = False
                if task.future.done():
                    continue  # failed meanwhile (the pool broke, a timeout): nothing to run
                task.running = False
                fut = task.future
                fut._slot = None  # type: ignore[attr-defined]
                if type(fut) is _Future:
                    fut._back_to_pending()
                back.append(task)
            self._pending.extendleft(reversed(back))
        if moved:
            slot.poke()  # a caller reading its channel for one of them reads elsewhere now
            self._dispatch_wanted = True
            self.kick()

    def expire(self, slot: Slot, task: Task, timeout: float, what: str) -> None:
        """The deadline ladder: take the stack, fail the task with it, SIGTERM the worker's
        group, SIGKILL it ``kill_grace`` later; a replacement starts now."""
        with self._submit_lock, self._lock:
            if slot.stopping is not None or slot.dead:
                return
            slot.stopping = f"{what} timeout"
            slot.cut_tid = self._newest_pending()  # an actor's calls queued by now fail too
        stack = slot.proc.stack(STACK_WAIT)
        task.fail(
            TaskTimeout(
                slot.proc.name,
                slot.proc.pid,
                timeout,
                task_name=task.name,
                task_id=task.tid,
                stack=stack,
                what=what,
            )
        )
        slot.proc.signal_group(signal.SIGTERM)
        slot.kill_at = time.monotonic() + self.kill_grace
        self._timers = True
        self.wake()

    def _maintain(self) -> None:
        """Close retired workers that answered everything; keep the pool at strength."""
        with self._lock:
            slots = list(self._slots)
            # a closing pool still replaces a worker that died while tasks wait: shutdown()
            # runs every task it accepted
            closing = (self.closing and not self._pending) or self.broken is not None
        for slot in slots:
            if slot.retiring and not slot.outstanding and slot.stopping is None and not slot.dead:
                slot.stopping = "retired"
                with contextlib.suppress(OSError, ValueError):
                    slot.proc.conn.send_bytes(pickle.dumps((CLOSE,)))
                slot.kill_at = time.monotonic() + 5.0
                self._timers = True
        if closing or self._terminating:
            return
        with self._lock:
            alive = sum(1 for s in self._slots if s.stopping is None and not s.retiring)
            need = self._n - alive
            if (
                self.policy == "actor"
                and not self._pending
                and need > 0
                and any(s.stopping is None for s in self._slots)
            ):
                need = 0
        for _ in range(max(0, need)):
            try:
                self._spawn()
            except BaseException as exc:  # noqa: BLE001
                self._break(WorkerStartError(f"cannot start a worker for {self.name}: {exc}"))
                return

    def _break(self, exc: BaseException) -> None:
        if self.policy == "pool" and not isinstance(exc, PoolBroken):
            # An Executor that cannot go on raises BrokenExecutor (as ProcessPoolExecutor's
            # BrokenProcessPool), the reason as its cause.
            # (the reason's first line: the rest of it is shown once, as the cause)
            broken = PoolBroken(f"{self.name} is broken: {str(exc).partition(chr(10))[0]}")
            broken.__cause__ = exc
            exc = broken
        with self._submit_lock, self._lock:
            if self.broken is None:
                self.broken = exc
            pending = list(self._pending)
            self._pending.clear()
            victims = [t for s in self._slots for t in s.outstanding]
        for task in pending + victims:
            task.fail(exc)
        for slot in list(self._slots):
            if slot.stopping is None:
                slot.stopping = "broken"
                slot.proc.signal_group(signal.SIGTERM)
                slot.kill_at = time.monotonic() + self.kill_grace
                self._timers = True
        self.wake()

    # -- cancelling --

    def cancel_all(self) -> int:
        """Cancel the running task and every queued one: the running task gets
        WorkerCancelled raised inside it; queued ones fail at once. Returns how many."""
        with self._submit_lock, self._lock:
            pending = list(self._pending)
            self._pending.clear()
            per_slot = [(s, list(s.outstanding)) for s in self._slots if s.outstanding]
        err = WorkerCancelled("cancelled before it started")
        for task in pending:
            task.fail(err)
        count = len(pending)
        for slot, tasks in per_slot:
            tids = [t.tid for t in tasks]
            self._cancelled.update(tids)
            for task in tasks[1:]:
                task.fail(err)
            self.health_notify(slot, "cancel", tids)
            count += len(tasks)
        return count

    # -- ending --

    def shutdown(
        self, wait: bool = True, cancel_futures: bool = False, timeout: float | None = None
    ) -> None:
        """Stop taking tasks; the manager ends once every task has finished, or ``timeout``
        seconds from now, whichever comes first (then the workers are stopped as they are)."""
        with self._submit_lock, self._lock:
            self.closing = True
            if timeout is not None:
                self._close_deadline = time.monotonic() + timeout
                self._timers = True
            if cancel_futures:
                # not those running already (taken from a worker that died): they run again
                pending = [t for t in self._pending if not t.running]
                again = [t for t in self._pending if t.running]
                if self.policy == "pool":
                    # Nor the next task of each worker with nothing in hand (still starting,
                    # or idle): it has it as good as handed, as ProcessPoolExecutor's workers
                    # have the tasks of its call queue, which fills before they start.
                    holding = sum(1 for s in self._slots if s.outstanding and not s.dead)
                    free = max(0, self._n - holding)
                    again += pending[:free]
                    del pending[:free]
                self._pending.clear()
                self._pending.extend(again)
            else:
                pending = []
        for task in pending:
            task.future.cancel()
            if task.stream is not None:
                task.stream.put(_Failure(concurrent.futures.CancelledError()))
        self.wake()
        if wait and threading.current_thread() is not self._thread:
            self._thread.join()

    def terminate(self, join: bool = True) -> None:
        """Stop at once: pending and running tasks fail, workers are killed."""
        with self._submit_lock, self._lock:
            self.closing = True
            self._terminating = True
            pending = list(self._pending)
            self._pending.clear()
            running = [t for s in self._slots for t in s.outstanding]
        err = WorkerCancelled(f"{self.name} was terminated")
        for task in pending + running:
            task.fail(err)
        self.wake()
        if join and threading.current_thread() is not self._thread:
            self._thread.join(30)

    def _shutdown_workers(self) -> None:
        with self._lock:
            slots = list(self._slots)
            self._slots.clear()
            self.closing = True
        for slot in slots:
            slot.stopping = slot.stopping or "shutdown"
            if not slot.dead:
                with contextlib.suppress(OSError, ValueError):
                    slot.proc.conn.send_bytes(pickle.dumps((CLOSE,)))
        for slot in slots:
            timeout = 0.0 if self._terminating else self.close_timeout
            if self._close_deadline is not None:
                timeout = max(0.0, self._close_deadline - time.monotonic())
            if self._terminating:
                slot.proc.signal_group(signal.SIGKILL)
            slot.proc.stop(timeout=timeout, grace=self.kill_grace)
            for task in list(slot.outstanding):
                task.fail(WorkerError(f"{self.name} shut down before task {task.tid} finished"))
            with slot.reader:  # a caller that read its channel has let go of it
                slot.proc.close()
            slot.close_poke()
            slot.shm.close_fds()
            self.last_exitcode = slot.proc.exitcode
        with self._submit_lock, self._lock:
            leftovers = list(self._pending)
            self._pending.clear()
        for task in leftovers:
            task.fail(self.broken or WorkerError(f"{self.name} shut down"))
        wake = (self._wake_r, self._wake_w)
        self._wake_r = self._wake_w = -1  # forgotten first: a fork meanwhile must not close them
        for fd in wake:
            with contextlib.suppress(OSError):
                os.close(fd)
        with self._ep_lock:
            if self._poller is not None:
                self._poller.close()
        _live_cores.discard(self)

    # -- facts --

    def slots(self) -> list[Slot]:
        with self._lock:
            return list(self._slots)

    def live_slot(self, timeout: float | None = None) -> Slot:
        """The (single) usable worker of an actor, waiting for it to be ready."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                if self.broken is not None:
                    raise self.broken.with_traceback(None)  # not the last raise's frames
                if self.closing:
                    raise RuntimeError(f"{self.name} has been shut down")
                for slot in self._slots:
                    if slot.ready and not slot.dead and slot.stopping is None:
                        return slot
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} has no running worker")
            time.sleep(0.001)


def _unpicklable(
    fn: Any,
    exc: BaseException,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> TypeError:
    return unpicklable_error(_task_name(fn), fn, exc, args, kwargs)
