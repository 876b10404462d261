"""``Worker``: one process, one private channel, an actor."""

from __future__ import annotations

import concurrent.futures
import contextlib
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any, ParamSpec, TypeVar, overload

from .._args import check_callable, check_int, check_seconds
from .._closing import Closing
from .._lazy import asyncio  # imported on first use (see _lazy)
from . import _dispatch as D
from . import _process
from ._options import ProcessOptions, get_context
from ._policy import ActorPolicy
from ._stderr import read_available
from .errors import TaskTimeout

__all__ = ["Worker", "Stream", "get_context"]

T = TypeVar("T")
P = ParamSpec("P")


def _check_timeout(name: str, value: float | None) -> float | None:
    return check_seconds(name, value)


def _check_fn(fn: Any) -> None:
    """A Worker's calls take the function itself: anything else is refused at the call."""
    check_callable("fn", fn, why="the function to run in the worker, then its arguments")


class Stream(Closing, Iterator[Any], AsyncIterator[Any]):
    """The items of :meth:`Worker.stream`, as they are produced. Closing it (``close()``,
    ``break`` out of a ``for`` loop that owns it, or dropping it) stops the generator in the
    worker. Iterate it with ``for`` or ``async for``."""

    def __init__(self, core: D.Core, task: D.Task, window: int, item_timeout: float | None) -> None:
        self._core = core
        self._task = task
        self._window = window
        self._item_timeout = item_timeout
        self._unacked = 0
        self._done = False

    def __iter__(self) -> Stream:
        return self

    def _take(self, ok: bool, item: Any) -> Any:
        if not ok:
            self._expire()
        if item is D._END:
            self._done = True
            raise StopIteration
        if isinstance(item, D._Failure):
            self._done = True
            self._core.crash_seen(item.exc)
            raise item.exc
        self._unacked += 1
        if self._unacked >= max(1, self._window // 2):
            slot = self._task.slot
            if slot is not None:
                self._core.health_notify(slot, "credit", self._task.tid, self._unacked)
            self._unacked = 0
        return item

    def _expire(self) -> None:
        self._done = True
        slot = self._task.slot
        timeout = self._item_timeout or 0.0
        if slot is not None:
            self._core.expire(slot, self._task, timeout, "item")
        ok, item = self._task.stream.get(0)  # type: ignore[union-attr]
        while ok and not isinstance(item, D._Failure):
            ok, item = self._task.stream.get(0)  # type: ignore[union-attr]
        if ok:
            raise item.exc
        raise TaskTimeout(
            slot.proc.name if slot else self._core.name,
            slot.proc.pid if slot else None,
            timeout,
            task_name=self._task.name,
            task_id=self._task.tid,
            what="item",
        )

    def _wait_left(self) -> float | None:
        """After a wait of ``item_timeout`` found no item: how long to wait more (None: the
        item is late). The time counts from the stream's start or its last item, not while it
        is queued behind other calls."""
        task, timeout = self._task, self._item_timeout or 0.0
        slot = task.slot
        if slot is None or not slot.outstanding or slot.outstanding[0] is not task:
            return timeout  # not started: it is not late yet
        left = slot.head_since + timeout - time.monotonic()
        return left if left > 0 else None

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        wait = self._item_timeout
        while True:
            ok, item = self._task.stream.get(wait)  # type: ignore[union-attr]
            if ok or wait is None:
                break
            wait = self._wait_left()
            if wait is None:
                break
        return self._take(ok, item)

    def __aiter__(self) -> Stream:
        return self

    async def __anext__(self) -> Any:
        if self._done:
            raise StopAsyncIteration
        wait = self._item_timeout
        while True:
            ok, item = await self._task.stream.aget(wait)  # type: ignore[union-attr]
            if ok or wait is None:
                break
            wait = self._wait_left()
            if wait is None:
                break
        try:
            return self._take(ok, item)
        except StopIteration:
            raise StopAsyncIteration from None

    def close(self) -> None:
        """Stop the generator in the worker (it is closed there: its ``finally`` runs)."""
        if self._done:
            return
        self._done = True
        slot = self._task.slot
        if slot is not None:
            self._core.health_notify(slot, "stop", self._task.tid)
        else:
            self._task.future.cancel()

    async def aclose(self) -> None:
        self.close()


class Worker:
    """One worker process with a private duplex channel: an actor.

    Calls run one at a time, in the order they were made, in the worker's main thread.
    ``call`` returns the result or raises the worker's exception as its own type with the
    worker's traceback; ``submit`` returns a :class:`concurrent.futures.Future`. If the worker
    dies, every caller waiting on it gets :class:`WorkerCrashed` (pid, signal or exit code,
    the task, peak RSS, the OOM hint, its native traceback and last stderr lines); when the
    crash failed a call, so does every call made after it until a caller has been handed it
    (``result()``, ``exception()``, ``call``, ``acall`` or a stream raising it): those calls
    were made against the old process's state, which the new one does not have. The next call
    after that starts a new process (``stats["restarts"]`` counts them; the namespace of ``exec`` /
    ``store`` starts empty again).

    ``start_method`` is ``"spawn"`` (default), ``"fork"`` or ``"forkserver"``. ``initializer(
    *initargs)`` runs in the worker before any call. ``env`` entries are set in the worker's
    ``os.environ``; ``cwd`` is its working directory. The worker's stderr (fd 2, so C-level
    output and crash dumps too) is copied to this process's stderr, or with ``log_dir`` to
    ``log_dir/<name>/stderr.log`` (and its stdout to ``stdout.log``); ``tee=True`` also copies
    it to the console, each line prefixed with ``[name]``.

    A context manager: leaving the block closes the worker.
    """

    def __init__(
        self,
        start_method: str | None = "spawn",
        name: str | None = None,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] = (),
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        log_dir: str | None = None,
        tee: bool = False,
        *,
        kill_grace: float = 1.0,
    ) -> None:
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be callable, not {type(initializer).__name__}")
        self.name = name or f"worker-{next(_names)}"
        options = ProcessOptions(
            name=self.name,
            start_method=start_method,
            initializer=initializer,
            initargs=initargs,
            env=env,
            cwd=cwd,
            log_dir=log_dir,
            tee=tee,
            kill_grace=kill_grace,
        )
        self._core = D.Core(options, ActorPolicy(), max_workers=1)

    def __repr__(self) -> str:
        return f"<Worker {self.name!r} pid={self.pid}>"

    # -- calls --

    def submit(
        self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        """Queue ``fn(*args, **kwargs)``; the future holds its result or exception. A call
        that cannot be pickled fails its future with :class:`TaskPicklingError` (a
        TypeError), naming what could not be sent."""
        _check_fn(fn)
        return self._core.submit(D.CALL, fn, args, kwargs).future

    # Type checkers check a call's arguments against ``fn``'s parameters when no ``timeout``
    # is given (a ParamSpec cannot take a keyword of its own besides); with ``timeout``, the
    # result's type only.
    @overload
    def call(
        self, fn: Callable[..., T], /, *args: Any, timeout: float | None, **kwargs: Any
    ) -> T: ...

    @overload
    def call(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T: ...

    def call(  # type: ignore[misc]  # (a ParamSpec's kwargs could hold a timeout)
        self, fn: Callable[..., T], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> T:
        """Run ``fn(*args, **kwargs)`` in the worker and return its result.

        With ``timeout``, a call still running that many seconds after it started raises
        :class:`TaskTimeout` holding the worker's stack, and the worker is stopped (the next
        call gets a new one)."""
        _check_fn(fn)
        timeout = _check_timeout("timeout", timeout)
        task = self._core.submit(D.CALL, fn, args, kwargs, timeout=timeout)
        return task.future.result()  # type: ignore[no-any-return]

    @overload
    async def acall(
        self, fn: Callable[..., T], /, *args: Any, timeout: float | None, **kwargs: Any
    ) -> T: ...

    @overload
    async def acall(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T: ...

    async def acall(  # type: ignore[misc]  # (a ParamSpec's kwargs could hold a timeout)
        self, fn: Callable[..., T], /, *args: Any, timeout: float | None = None, **kwargs: Any
    ) -> T:
        """``call`` for asyncio: awaits the result without blocking the loop."""
        _check_fn(fn)
        timeout = _check_timeout("timeout", timeout)
        task = self._core.submit(D.CALL, fn, args, kwargs, timeout=timeout)
        return await asyncio.wrap_future(task.future)

    def stream(
        self,
        fn: Callable[..., Any],
        /,
        *args: Any,
        window: int = 8,
        item_timeout: float | None = None,
        **kwargs: Any,
    ) -> Stream:
        """Run the generator function ``fn(*args, **kwargs)`` in the worker and iterate its
        items as they are produced, the worker at most ``window`` items ahead of the
        consumer. An item that does not come within ``item_timeout`` seconds raises
        :class:`TaskTimeout` (with the worker's stack; the worker is stopped)."""
        _check_fn(fn)
        window = check_int("window", window, why="items the worker may produce ahead")
        item_timeout = _check_timeout("item_timeout", item_timeout)
        task = self._core.submit(D.STREAM, fn, args, kwargs, window=window)
        if task.future.done() and task.future.exception() is not None:
            raise task.future.exception()  # type: ignore[misc]
        return Stream(self._core, task, window, item_timeout)

    astream = stream  # a Stream is also an async iterator

    def exec(self, code: str) -> None:
        """Run Python source ``code`` in the worker's namespace (kept between calls)."""
        if not isinstance(code, str):
            raise TypeError(f"code must be a str, not {type(code).__name__}")
        self.call(D._exec, code)

    def store(self, name: str, value: Any) -> None:
        """Set ``name`` to ``value`` (any size) in the worker's namespace."""
        self.call(D._store, name, value)

    def load(self, name: str) -> Any:
        """The value of ``name`` in the worker's namespace (any size)."""
        return self.call(D._load, name)

    def cancel(self) -> int:
        """Cancel the running call (:class:`WorkerCancelled` is raised inside it, in the
        worker's main thread, and to its caller) and drop the queued ones (their callers get
        the same error). Returns how many calls were cancelled."""
        return self._core.cancel_all()

    # -- health --

    def _slot(self, timeout: float | None) -> D.Slot:
        return self._core.live_slot(timeout)

    async def _aslot(self, timeout: float | None) -> D.Slot:
        """``_slot`` for asyncio: a process that is still starting is waited for in a
        thread, not on the event loop."""
        try:
            return self._core.live_slot(0.0)
        except TimeoutError:
            return await asyncio.to_thread(self._core.live_slot, timeout)

    def ping(self, timeout: float = 5.0) -> float:
        """Round-trip time in seconds through the worker's health thread, answered even while
        a long call runs. Raises TimeoutError when no answer comes within ``timeout``."""
        check_seconds("timeout", timeout, none_ok=False)
        start = time.perf_counter()
        slot = self._slot(timeout)
        fut = self._core.health_request(slot, "ping")
        try:
            fut.result(max(0.0, timeout - (time.perf_counter() - start)))
        except concurrent.futures.TimeoutError:
            raise TimeoutError(
                f"worker {self.name!r} did not answer a ping within {timeout:g} s"
            ) from None
        return time.perf_counter() - start

    async def aping(self, timeout: float = 5.0) -> float:
        check_seconds("timeout", timeout, none_ok=False)
        start = time.perf_counter()
        slot = await self._aslot(timeout)
        fut = self._core.health_request(slot, "ping")
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"worker {self.name!r} did not answer a ping within {timeout:g} s"
            ) from None
        return time.perf_counter() - start

    def stack(self, timeout: float = 1.0) -> str:
        """Every thread's stack in the worker, as faulthandler prints it; taken with a signal,
        so it works even while the worker is stuck in C code holding the GIL."""
        check_seconds("timeout", timeout, none_ok=False)
        slot = self._slot(timeout)
        text = slot.proc.stack(timeout)
        if text is None:
            raise TimeoutError(
                f"worker {self.name!r} (pid {slot.proc.pid}) gave no stack within {timeout:g} s"
            )
        return text

    async def astack(self, timeout: float = 1.0) -> str:
        """``stack`` for asyncio: the dump is read by the event loop's own reader."""
        check_seconds("timeout", timeout, none_ok=False)
        slot = await self._aslot(timeout)
        fd = slot.proc.request_stack()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        data = b""
        last = loop.time()
        readable = asyncio.Event()
        text = None
        if fd is not None:
            loop.add_reader(fd, readable.set)
            try:
                while text is None:
                    readable.clear()
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(readable.wait(), 0.003)
                    chunk, eof = read_available(fd)
                    if chunk:
                        data += chunk
                        last = loop.time()
                    now = loop.time()
                    text = _process.stack_text(
                        data, now - last if data else None, eof or now >= deadline
                    )
            finally:
                loop.remove_reader(fd)
        if not text:
            raise TimeoutError(
                f"worker {self.name!r} (pid {slot.proc.pid}) gave no stack within {timeout:g} s"
            )
        return text

    def _current(self) -> D.Slot | None:
        """The worker's process now: the live one, else the last one started."""
        slots = self._core.slots()
        live = [s for s in slots if not s.dead and s.stop_reason is None]
        return (live or slots)[-1] if slots else None

    @property
    def pid(self) -> int | None:
        slot = self._current()
        return slot.proc.pid if slot is not None else None

    @property
    def alive(self) -> bool:
        return any(s.proc.alive and not s.dead for s in self._core.slots())

    @property
    def exitcode(self) -> int | None:
        """The last worker process's exit code (None while it runs)."""
        slot = self._current()
        if slot is not None:
            return slot.proc.exitcode
        return self._core.last_exitcode

    @property
    def stats(self) -> dict[str, Any]:
        """``calls``, ``busy_seconds`` and ``peak_rss`` (bytes) of the current process, and
        ``restarts`` (processes started after the first)."""
        slot = self._slot(5.0)
        info = dict(self._core.health_request(slot, "stats").result(5.0))
        info["restarts"] = self._core.restarts
        info["pid"] = slot.proc.pid
        return info

    # -- ending --

    def close(self, timeout: float = 5.0) -> None:
        """Finish the queued calls, then ask the worker to exit; after ``timeout`` seconds
        SIGTERM, a grace period, SIGKILL to its whole process group. Reaped; every descriptor
        closed on both sides. Idempotent."""
        self._core.shutdown(wait=True, timeout=timeout)

    async def aclose(self, timeout: float = 5.0) -> None:
        """``close`` for asyncio (cancelling it leaves the close under way)."""
        self._core.shutdown(wait=False, timeout=timeout)
        await asyncio.shield(asyncio.wrap_future(self._core.stopped))

    def terminate(self) -> None:
        """Stop now: running and queued calls fail with WorkerCancelled; the worker is
        killed."""
        self._core.terminate()

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self.terminate()  # Ctrl-C: stop now
        else:
            self.close()

    async def __aenter__(self) -> Worker:
        return self

    async def __aexit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self.terminate()  # Ctrl-C, or the task was cancelled: stop now
        else:
            await self.aclose()

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.dropped()


_names = iter(range(1, 1 << 62))
