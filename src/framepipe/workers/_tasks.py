"""The parent's records of the work it was given: tasks, their futures, map results, streams.

A :class:`Task` is one call as the manager holds it (its pickled message, its deadline, the
worker it went to); its outcome goes to a :class:`_Future` (a ``concurrent.futures.Future``
whose ``result()`` may read the worker's channel itself, see :mod:`._lending`), to a slot of a
:class:`MapResults` (one ``map()``: a :class:`MapTask` per item, no future each), or item by
item to an :class:`ItemChannel` (a stream). ``_task_name`` names a task's function in reports.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import threading
import types
from typing import Any, Protocol

from .._lazy import asyncio  # imported on first use (see _lazy)
from .errors import WorkerCrashed, unpicklable_error

_PENDING = concurrent.futures._base.PENDING
_RUNNING = concurrent.futures._base.RUNNING
_FINISHED = concurrent.futures._base.FINISHED
_PENDING_STATES = (_PENDING, _RUNNING)
_MAKING = threading.Lock()  # see NOTE [ A future's condition, made on first use ]
_DONE_STATES = frozenset(
    (concurrent.futures._base.CANCELLED, concurrent.futures._base.CANCELLED_AND_NOTIFIED, _FINISHED)
)


class FutureOwner(Protocol):
    """What a :class:`_Future` asks of the core its task was submitted to."""

    def wait_for(self, fut: _Future, timeout: float | None) -> float | None: ...

    def call_soon(self, fut: concurrent.futures.Future[Any]) -> None: ...

    def crash_seen(self, exc: BaseException) -> None: ...

    def want_back(self) -> None: ...


_names: dict[Any, str] = {}


class _Reading(threading.local):
    slot: Any = None  # the worker (a _slot.Slot) whose channel this thread reads


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


class _Future(concurrent.futures.Future):  # type: ignore[type-arg]
    """A ``concurrent.futures.Future`` whose ``result()`` and ``exception()`` read the answer
    from the worker's channel in the waiting thread when they can (see :mod:`._lending`),
    instead of waiting for the manager thread to read it and wake them."""

    _core: FutureOwner | None = None
    # the worker (a _slot.Slot, which imports this module) the task was last sent to
    _slot: Any = None
    _actor: FutureOwner | None = None  # an actor's call: handing out its crash is noted

    # NOTE [ A future's condition, made on first use ]
    #
    # concurrent.futures makes a Condition for every Future (1.1 of its 1.2 us), for threads that
    # wait on it; a caller that reads its own answer (see _lending) never does. A _Future makes
    # it when something first asks for ``_condition`` (a wait in result(), add_done_callback(),
    # cancel(), wait() and as_completed(), ...), under _MAKING; until then its two state changes
    # on every round trip (running, then its result) are made under _MAKING instead, which
    # serialises them with the making: a thread that made the condition finds the new state
    # when it looks under it, and one that changes the state finds the condition (and takes it,
    # as concurrent.futures does) once it was made. No waiter and no callback can be there
    # before the condition is, so none is missed. Its other changes (an exception, a cancel)
    # take the condition as concurrent.futures does.

    def __init__(self) -> None:
        # concurrent.futures.Future.__init__ but for the condition (see the NOTE above; a test
        # checks that it sets the same fields)
        self._state = _PENDING
        self._result = None
        self._exception = None
        self._waiters: list[Any] = []
        self._done_callbacks: list[Any] = []
        self._made: threading.Condition | None = None

    @property
    def _condition(self) -> threading.Condition:  # type: ignore[override]
        cond = self._made
        if cond is None:
            with _MAKING:
                cond = self._made
                if cond is None:
                    cond = self._made = threading.Condition()
            self._read_by_manager()
        return cond

    def _read_by_manager(self) -> None:
        """Waited on or looked at without a caller reading its answer: the manager is to
        read it, if its worker's channel was kept out of its set (see NOTE [ A channel kept
        out ] in _lending)."""
        slot = self._slot
        if slot is not None and slot.kept_out and self._core is not None:
            self._core.want_back()

    def set_running_or_notify_cancel(self) -> bool:
        if self._made is None:
            with _MAKING:
                if self._made is None and self._state == _PENDING:
                    self._state = _RUNNING
                    return True
        return super().set_running_or_notify_cancel()  # under the condition, made by now

    def set_result(self, result: Any) -> None:
        if self._made is None:
            with _MAKING:
                done = self._made is None and self._state not in _DONE_STATES
                if done:
                    self._result = result
                    self._state = _FINISHED
            if done:
                return  # no condition yet: nobody waits and no callback was added
        super().set_result(result)  # under the condition: its waiters, its callbacks

    def done(self) -> bool:
        if self._state in _DONE_STATES:  # one read: no need for the condition
            return True
        self._read_by_manager()
        return False

    def _invoke_callbacks(self) -> None:
        # Completed by a caller that reads its worker's channel: its done-callbacks run in the
        # manager thread, as concurrent.futures runs them in its own, never in a thread that
        # waits for another result (which a slow callback would hold up) or that holds a
        # channel the manager needs (a callback that shuts the pool down would wait forever).
        core = self._core
        if _reading.slot is not None and core is not None and self._done_callbacks:
            core.call_soon(self)
        else:
            super()._invoke_callbacks()  # type: ignore[misc]

    def _back_to_pending(self) -> None:
        """Taken back from a worker before it started (see Scheduling._steal): pending again."""
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
        self.slot: Any = None  # the worker (a _slot.Slot) it was sent to
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


def _unpicklable(
    fn: Any,
    exc: BaseException,
    args: tuple[Any, ...] = (),
    kwargs: dict[str, Any] | None = None,
) -> TypeError:
    return unpicklable_error(_task_name(fn), fn, exc, args, kwargs)
