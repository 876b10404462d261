"""``Pool``: worker processes behind a ``concurrent.futures.Executor``."""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import itertools
import operator
import os
import queue
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, ParamSpec, TypeVar, overload

from .._args import check_int
from .._lazy import asyncio  # imported on first use (see _lazy)
from ..remote import dumps_exception
from . import _byvalue, _progress
from . import _dispatch as D
from ._options import ProcessOptions
from ._policy import PoolPolicy
from ._tasks import _task_name, _unpicklable
from .errors import PoolBroken, _cloudpickle_or_none, pickling_error, revive
from .worker import _check_timeout

__all__ = ["Pool"]


def _worker_count(max_workers: Any) -> int:
    """``max_workers`` checked (None: one per CPU)."""
    if max_workers is None:
        return os.cpu_count() or 1
    try:
        if isinstance(max_workers, bool):
            raise TypeError
        count: int = operator.index(max_workers)  # an int, or one such as NumPy's
    except TypeError:
        raise TypeError(
            f"max_workers must be an int, not {type(max_workers).__name__} "
            f"({max_workers!r}); pass a number such as Pool(4), or None for one per CPU"
        ) from None
    if count < 1:
        raise ValueError(f"max_workers must be a positive int, not {max_workers!r}")
    return count


T = TypeVar("T")
A = TypeVar("A")
B = TypeVar("B")
P = ParamSpec("P")
_LAUNCH_WAIT = 30.0  # seconds pids waits for the first workers to be launched


class Pool(concurrent.futures.Executor):
    """A pool of worker processes, each with its own private channel; a
    :class:`concurrent.futures.Executor`.

    - A worker that dies fails only the task it was running, with :class:`WorkerCrashed`
      (which worker, pid, signal or exit code, the task, peak RSS, the OOM hint, its native
      traceback and last stderr lines); tasks queued behind it go to the other workers and a
      replacement starts at once. With ``max_task_crashes=N`` (default 1), a task runs again
      on another worker until N workers have died under it; then it fails, its
      ``WorkerCrashed`` listing the earlier deaths in ``task_crashes``.
    - The pool breaks only on a crash loop: more than ``max_restarts`` workers dying in a row
      within ``restart_window`` seconds with no task finished between them (None: never), or a
      worker dying before it is ready; one :class:`PoolBroken` then names the last crashes. A
      pool that keeps finishing tasks between its crashes goes on.
    - An exception raised by a task, whatever its type or constructor, reaches the caller as
      itself with the worker's traceback, and never harms the pool.
    - ``task_timeout``: a task still running that many seconds after it started fails with
      :class:`TaskTimeout` holding the worker's stack; the worker gets SIGTERM, then SIGKILL
      ``kill_grace`` seconds later (its whole process group), and is replaced.
    - Workers are replaced after ``max_tasks_per_worker`` tasks, or when their resident size
      passes ``max_rss`` bytes after a task.
    - ``initializer(*initargs)`` runs in each worker before its first task; if it raises (or
      exits), the pool is broken (:class:`PoolBroken` from :class:`WorkerStartError`, with the
      worker's last stderr lines).
    - The workers start when the pool is made, not at the first task: their start-up is paid
      before work arrives, ``pids`` lists them at once, and a worker that cannot start (a
      missing ``if __name__ == "__main__":`` guard: :class:`MainGuardError`) is known early.

    ``start_method`` is ``"spawn"`` (default), ``"fork"`` or ``"forkserver"``; ``log_dir`` and
    ``tee`` are as for :class:`Worker`. Code written against ``Executor`` runs unchanged on
    other executors (dask.distributed's ``Client.get_executor()``, Ray's), which is how a job
    grows past one machine.
    """

    def __init__(
        self,
        max_workers: int | None = None,
        *,
        start_method: str | None = "spawn",
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] = (),
        task_timeout: float | None = None,
        kill_grace: float = 1.0,
        max_restarts: int | None = 10,
        restart_window: float = 60.0,
        max_task_crashes: int = 1,
        max_tasks_per_worker: int | None = None,
        max_rss: int | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        log_dir: str | None = None,
        tee: bool = False,
        name: str = "pool",
    ) -> None:
        max_workers = _worker_count(max_workers)
        check_int("max_tasks_per_worker", max_tasks_per_worker, none_ok=True)
        check_int("max_rss", max_rss, none_ok=True, why="bytes")
        self._max_workers = max_workers
        options = ProcessOptions(
            name=name,
            start_method=start_method,
            initializer=initializer,
            initargs=initargs,
            env=env,
            cwd=cwd,
            log_dir=log_dir,
            tee=tee,
            kill_grace=kill_grace,
        )
        policy = PoolPolicy(
            max_restarts=max_restarts,
            restart_window=restart_window,
            max_task_crashes=max_task_crashes,
        )
        self._core = D.Core(
            options,
            policy,
            max_workers=max_workers,
            task_timeout=_check_timeout("task_timeout", task_timeout),
            max_tasks_per_worker=max_tasks_per_worker,
            max_rss=max_rss,
        )

    def __repr__(self) -> str:
        state = "broken" if self._core.broken else "shut down" if self._core.closing else "running"
        return f"<Pool {self._core.name!r} max_workers={self._max_workers} {state}>"

    # -- Executor --

    def submit(
        self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
    ) -> concurrent.futures.Future[T]:
        """Schedule ``fn(*args, **kwargs)``; returns a :class:`concurrent.futures.Future`.
        A call that cannot be pickled (the function, or an argument) fails its future with
        :class:`TaskPicklingError` (a TypeError), naming what could not be sent, as
        ``concurrent.futures`` fails it at ``result()``."""
        return self._core.submit(D.CALL, fn, args, kwargs, timeout=self._core.task_timeout).future

    async def acall(self, fn: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs) -> T:
        """Run ``fn(*args, **kwargs)`` in a worker and await its result (asyncio; no thread
        per call)."""
        return await asyncio.wrap_future(self.submit(fn, *args, **kwargs))

    async def aclose(self) -> None:
        """``shutdown(wait=True)`` for asyncio: awaits the end without blocking the loop."""
        self._core.shutdown(wait=False)
        await asyncio.shield(asyncio.wrap_future(self._core.stopped))

    async def __aenter__(self) -> Pool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # Type checkers see the items' types checked against the function's parameters for one
    # and two iterables (Executor.map takes any callable: hence the ignore); more iterables
    # check the results' type only.
    @overload  # type: ignore[override]
    def map(
        self,
        fn: Callable[[A], T],
        it1: Iterable[A],
        /,
        *,
        timeout: float | None = None,
        chunksize: int | None = None,
        buffersize: int | None = None,
        progress: Any = None,
    ) -> Iterator[T]: ...

    @overload
    def map(
        self,
        fn: Callable[[A, B], T],
        it1: Iterable[A],
        it2: Iterable[B],
        /,
        *,
        timeout: float | None = None,
        chunksize: int | None = None,
        buffersize: int | None = None,
        progress: Any = None,
    ) -> Iterator[T]: ...

    @overload
    def map(
        self,
        fn: Callable[..., T],
        it1: Iterable[Any],
        it2: Iterable[Any],
        it3: Iterable[Any],
        /,
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int | None = None,
        buffersize: int | None = None,
        progress: Any = None,
    ) -> Iterator[T]: ...

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int | None = None,
        buffersize: int | None = None,
        progress: Any = None,
    ) -> Iterator[T]:
        """Like ``Executor.map``: results in order; ``timeout`` bounds the whole iteration
        (from this call), raising ``TimeoutError``. ``chunksize`` groups that many calls into
        one task (a crash then fails the whole chunk); ``chunksize=1``, one task an item.
        Without ``chunksize`` (None), a map of many items whose first items run fast is sent
        in chunks whose items still end one by one: each item's result or exception in its
        place, and a chunk whose worker died is run again item by item, so that only the item
        that kills a worker fails, with :class:`WorkerCrashed` (see :func:`_auto_map`).
        ``buffersize`` (as Python 3.14's ``Executor.map``): at most that many tasks submitted
        and not yet yielded; the items are then taken from ``iterables`` only as results are
        consumed, so an endless generator runs in bounded memory. Without it, every item is
        taken at once, as ``concurrent.futures`` does. ``progress``: True, a callable, a tqdm
        or rich bar, to show the results handed out (see :mod:`._progress`)."""
        self._core._check_open()  # at the call, whichever path the map takes below
        if chunksize is not None:
            check_int("chunksize", chunksize)
        if buffersize is not None:
            check_int("buffersize", buffersize)
        _progress.check(progress)
        deadline = None if timeout is None else time.monotonic() + timeout
        items: Iterator[tuple[Any, ...]] = zip(*iterables)
        run: Callable[..., Any] = fn
        total = _length(iterables)
        core = self._core
        if (
            chunksize is None
            and buffersize is None
            and core.task_timeout is None  # a deadline an item, and a task count a worker:
            and core.max_tasks is None  # those stay item by item
        ):
            every = list(items)
            out = _auto_map(core, self._max_workers, fn, every, deadline)
            return _progress.track(out, progress, len(every), core.name)
        source = None
        if buffersize is not None:
            source = items = _Source(items)
        chunksize = chunksize or 1
        if chunksize > 1:
            try:
                each = _byvalue.prepare(core, fn)  # by value if it must, once per worker
            except Exception as exc:  # noqa: BLE001 - raised at the first item, naming fn
                return _progress.track(_unsendable(fn, exc), progress, total, core.name)
            it = items
            items = ((each, c) for c in iter(lambda: list(itertools.islice(it, chunksize)), []))
            run = _run_chunk
            blame = functools.partial(_chunk_unpicklable, fn)
        else:
            blame = None
        if buffersize is None:
            results = core.submit_many(run, items, core.task_timeout, blame)
            out = _ordered(results, len(results.values), deadline)
            if chunksize == 1:
                total = len(results.values)
        else:
            out = _lazy(core, run, items, buffersize, deadline, source, blame)
        if chunksize > 1:
            out = _chain_lists(out)
        return _progress.track(out, progress, total, core.name)

    def imap(
        self,
        fn: Callable[[A], T],
        iterable: Iterable[A],
        chunksize: int = 1,
        buffersize: int | None = None,
        *,
        progress: Any = None,
    ) -> Iterator[T]:
        """Results of ``fn(x)`` for each x of ``iterable``, in order, taking items only as
        results are consumed: at most ``buffersize`` (default: 256 a worker) submitted and not
        yet yielded (``multiprocessing.Pool.imap``, in bounded memory)."""
        if buffersize is None:
            buffersize = D._MAP_STEP * self._max_workers
        return self.map(fn, iterable, chunksize=chunksize, buffersize=buffersize, progress=progress)

    def imap_unordered(
        self,
        fn: Callable[[A], T],
        iterable: Iterable[A],
        buffersize: int | None = None,
        *,
        progress: Any = None,
    ) -> Iterator[T]:
        """Results of ``fn(x)`` for each x of ``iterable`` as they complete, in any order,
        taking items only as results are consumed (at most ``buffersize``, default 256 a
        worker, submitted and not yet yielded)."""
        if buffersize is None:
            buffersize = D._MAP_STEP * self._max_workers
        check_int("buffersize", buffersize)
        _progress.check(progress)
        self._core._check_open()  # at the call, as map and submit raise
        out = _unordered(self, fn, _Source(iter(iterable)), buffersize)
        return _progress.track(out, progress, _length((iterable,)), self._core.name)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Stop accepting tasks; with ``wait``, wait for the submitted ones and for every
        worker to exit (reaped, descriptors closed). ``cancel_futures`` cancels the tasks no
        worker has started."""
        self._core.shutdown(wait=wait, cancel_futures=cancel_futures)

    def terminate(self) -> None:
        """Stop now: pending and running tasks fail with WorkerCancelled, workers are
        killed (SIGKILL to each process group), then reaped."""
        self._core.terminate()

    def __exit__(self, exc_type: Any, *exc: object) -> None:
        if exc_type is not None and not issubclass(exc_type, Exception):
            self.terminate()  # Ctrl-C or SystemExit: stop now, do not wait for the tasks
        else:
            self.shutdown(wait=True)

    def __del__(self) -> None:
        core = getattr(self, "_core", None)
        if core is not None:
            core.dropped()

    # -- facts --

    @property
    def broken(self) -> BaseException | None:
        """The :class:`PoolBroken` (or start error) that ended the pool, or None."""
        return self._core.broken

    @property
    def pids(self) -> list[int]:
        """The pids of the live workers. The workers start when the pool is made (not at the
        first task, so that their start-up cost is paid before the work comes and a worker
        that cannot start is known early): right after ``Pool(n)``, ``pids`` waits until the
        ``n`` processes are launched (not until they are ready), so it lists them all."""
        self._core.launched.wait(_LAUNCH_WAIT)
        return [s.proc.pid for s in self._core.slots() if s.proc.pid is not None and not s.dead]

    @property
    def crashes(self) -> list[BaseException]:
        """The last crashes (:class:`WorkerCrashed`), oldest first."""
        return list(self._core.crashes)

    def stats(self, timeout: float = 5.0) -> list[dict[str, Any]]:
        """Per worker: ``name``, ``pid``, ``calls``, ``busy_seconds``, ``peak_rss``, ``rss``,
        ``tasks_sent``; and the pool's ``restarts`` in each row."""
        rows = []
        for slot in self._core.slots():
            if not slot.ready or slot.dead:
                continue
            fut = self._core.health_request(slot, "stats")
            try:
                info = dict(fut.result(timeout))
            except Exception:  # noqa: BLE001 - a worker that just died has no stats
                continue
            info.update(
                name=slot.proc.name,
                pid=slot.proc.pid,
                tasks_sent=slot.sent,
                restarts=self._core.restarts,
            )
            rows.append(info)
        return rows


# NOTE [ Chunks of a map ]
# A map of many small items spends its time on each item's round trip (its pickle, its frame,
# its answer read and stored), not in the function. Without a ``chunksize``, ``map`` sends
# its first ``_AUTO_PROBE`` items a worker one by one, each timed in its worker (``_Timed``: a
# busy machine delays the answers, not the work); when they ran fast, the rest goes in
# chunks of about ``_AUTO_CHUNK_SECONDS`` of work (at least 4 chunks a worker, for balance),
# one pickle and one answer a chunk. Each item still ends as itself: ``_run_each`` keeps an
# item's exception in its place (raised at that item, as item by item), and a chunk that
# fails as a whole (its worker died, its results could not be pickled) runs again item by
# item when the iteration reaches it, so that only the item that kills a worker fails with
# WorkerCrashed and every other item gets its result. The cost: the items of that chunk that
# ran before the crash run twice, and the item that crashes kills a second worker before it
# fails (``chunksize=1``: each item at most once). Slow items (not a worker's share of the
# probe done within ``_AUTO_WAIT`` of its first answer), short maps, a ``task_timeout`` (a
# deadline an item) and ``max_tasks_per_worker`` (a count of items) keep to one task an item.
# On a pool whose workers are still starting, map() waits for the probe's first answer (at
# most ``_AUTO_START_WAIT``, and never past its timeout): nothing could have run before.
_AUTO_MIN_ITEMS = 1024  # a map of fewer items goes item by item
_AUTO_PROBE = 16  # items a worker, sent one by one and timed, before the rest is chunked
_AUTO_WAIT = 0.05  # seconds map() waits for them, at most, once a worker answered
_AUTO_START_WAIT = 10.0  # ... and for a first answer while no worker has started yet
_AUTO_CHUNK_SECONDS = 0.004  # the work one chunk should hold
_AUTO_MIN_CHUNK = 4  # smaller chunks are not worth it: item by item


class _Raised:
    """An item's exception in a chunk's results (pickled as the worker sends exceptions)."""

    __slots__ = ("blob",)

    def __init__(self, blob: bytes) -> None:
        self.blob = blob

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Raised, (self.blob,))


def _run_each(fn: Callable[..., Any], chunk: list[tuple[Any, ...]]) -> list[Any]:
    """In a worker: ``fn(*args)`` for each ``args`` of ``chunk``, an exception in its place."""
    out: list[Any] = []
    append = out.append
    for args in chunk:
        try:
            append(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - as a task's: to the caller, at its item
            append(_Raised(dumps_exception(exc)))
    return out


def _auto_map(
    core: D.Core,
    workers: int,
    fn: Callable[..., Any],
    items: list[tuple[Any, ...]],
    deadline: float | None,
) -> Iterator[Any]:
    """``map`` without a chunksize: see NOTE [ Chunks of a map ]."""
    n = len(items)
    if n < _AUTO_MIN_ITEMS:
        results = core.submit_many(fn, items, None)
        return _ordered(results, n, deadline)
    probe_n = _AUTO_PROBE * workers
    try:
        each = _byvalue.prepare(core, fn)  # by value if it must, once per worker
    except Exception as exc:  # noqa: BLE001 - raised at the first item, naming fn
        return _unsendable(fn, exc)
    probe = core.submit_many(_Timed(each, fn), items[:probe_n], None)
    size = _chunk_size(core, probe, n - probe_n, workers, deadline)
    rest = items[probe_n:]
    del items
    try:
        if size >= _AUTO_MIN_CHUNK:
            chunks = [rest[i : i + size] for i in range(0, len(rest), size)]
            results = core.submit_many(_run_each, [(each, c) for c in chunks], None)
            out = _chunks_out(core, fn, results, chunks, deadline)
        else:
            results = core.submit_many(fn, rest, None)
            out = _ordered(results, len(rest), deadline)
    except Exception as exc:  # noqa: BLE001 - broken or shut down while the probe ran:
        results = D.MapResults(len(rest))  # raised at the first item after the probe's
        for i in range(len(rest)):
            results.store(i, D._Failure(exc))
        out = _ordered(results, len(rest), deadline)
    return _joined(probe, results, out, deadline)


def _joined(
    probe: D.MapResults, results: D.MapResults, rest: Iterator[Any], deadline: float | None
) -> Iterator[Any]:
    """The probe's results, then the rest's; closed early, what has not started of either is
    cancelled."""
    values = probe.values
    try:
        for i in range(len(values)):
            if values[i] is D._EMPTY:
                _wait_for(probe, i, deadline)
            if type(values[i]) is D._Failure:
                exc = values[i].exc
                values[i] = None
                raise exc
            yield _take(values, i)[0]  # (its result, the seconds it took: see _Timed)
        yield from rest
    finally:
        probe.cancelled = results.cancelled = True


class _Timed:
    """A probe item's call (see NOTE [ Chunks of a map ]): ``fn(*args)`` and the seconds it
    took in the worker, which the parent's clock could not tell on a busy machine."""

    def __init__(self, fn: Callable[..., Any], named: Any = None) -> None:
        self.fn = fn
        self.__qualname__ = _task_name(fn if named is None else named)  # reports name fn
        self.__module__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_Timed, (self.fn, self.__qualname__))

    def __call__(self, *args: Any) -> tuple[Any, float]:
        start = time.perf_counter()
        value = self.fn(*args)
        return value, time.perf_counter() - start


def _chunk_size(
    core: D.Core, probe: D.MapResults, left: int, workers: int, deadline: float | None
) -> int:
    """Items a chunk for the ``left`` items after ``probe``, from the time its items took in
    the workers; 0 (item by item) when fewer than ``_AUTO_PROBE`` of them (a worker's share)
    ended well within ``_AUTO_WAIT`` of the first answer (slow items, or failing ones), or
    before the map's ``deadline``."""
    values = probe.values
    until = time.monotonic() + (
        _AUTO_WAIT if any(s.ready for s in core.slots()) else _AUTO_START_WAIT
    )
    if deadline is not None:
        until = min(until, deadline)
    took: list[float] = []
    answered = False
    for i in range(len(values)):
        if values[i] is D._EMPTY:
            try:
                probe.wait(i, max(0.0, until - time.monotonic()))
            except TimeoutError:
                break
        if not answered:  # from the first answer: the workers' start-up does not count
            answered = True
            until = min(until, time.monotonic() + _AUTO_WAIT)
        if type(values[i]) is not D._Failure:
            took.append(values[i][1])
    if len(took) < _AUTO_PROBE:
        return 0
    per_item = sum(took) / len(took)
    balanced = -(-left // (4 * workers))  # at least 4 chunks a worker
    if per_item <= 0:
        return balanced
    return min(balanced, int(_AUTO_CHUNK_SECONDS / per_item))


def _chunks_out(
    core: D.Core,
    fn: Callable[..., Any],
    results: D.MapResults,
    chunks: list[Any],
    deadline: float | None,
) -> Iterator[Any]:
    """The items of each chunk of ``results`` in order (see NOTE [ Chunks of a map ])."""
    values = results.values
    try:
        for j in range(len(chunks)):
            _wait_for(results, j, deadline)
            out = values[j]
            values[j] = None
            chunk = chunks[j]
            chunks[j] = None  # let go of once its results are in
            if type(out) is D._Failure:
                yield from _again(core, fn, chunk, out.exc, deadline)
                continue
            del chunk
            out.reverse()
            while out:
                value = out.pop()
                if type(value) is _Raised:
                    raise revive(value.blob, executor=True)
                yield value
    finally:
        results.cancelled = True


def _again(
    core: D.Core,
    fn: Callable[..., Any],
    chunk: list[tuple[Any, ...]],
    exc: BaseException,
    deadline: float | None,
) -> Iterator[Any]:
    """A chunk that failed as a whole, its items run again one by one; ``exc`` itself when
    it was cancelled, or the pool cannot take them (broken, shut down)."""
    if isinstance(exc, (concurrent.futures.CancelledError, PoolBroken)):  # WorkerCancelled too
        raise exc
    try:
        again = core.submit_many(fn, chunk, None)
    except Exception:  # noqa: BLE001 - broken or shut down meanwhile: the chunk's own error
        raise exc from None
    yield from _ordered(again, len(chunk), deadline)


def _run_chunk(fn: Callable[..., Any], chunk: list[tuple[Any, ...]]) -> list[Any]:
    return [fn(*args) for args in chunk]


def _take(values: list[Any], i: int) -> Any:
    value = values[i]
    values[i] = None
    return value


def _chain_lists(lists: Iterator[list[Any]]) -> Iterator[Any]:
    """The items of each list in turn, each let go of once handed out."""
    for chunk in lists:
        chunk.reverse()
        while chunk:
            yield chunk.pop()


def _ordered(results: D.MapResults, n: int, deadline: float | None) -> Iterator[Any]:
    """The results of a map in order; closing the iterator early cancels what has not
    started."""
    values = results.values
    empty = D._EMPTY
    failure = D._Failure
    try:
        for i in range(n):
            if values[i] is empty:
                _wait_for(results, i, deadline)
            if type(values[i]) is failure:
                exc = values[i].exc
                values[i] = None
                raise exc
            # handed out once and never held here: dropped by the caller, it is freed
            yield _take(values, i)
    finally:
        results.cancelled = True


def _wait_for(results: D.MapResults, i: int, deadline: float | None) -> None:
    """Wait for item ``i`` of ``results``; TimeoutError once ``deadline`` has passed. One that
    is ready is handed out whatever the time (as concurrent.futures does)."""
    if results.values[i] is not D._EMPTY:
        return
    if deadline is None:
        results.wait(i, None)
        return
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise TimeoutError("map() did not finish within its timeout")
    results.wait(i, remaining)


def _length(iterables: tuple[Iterable[Any], ...]) -> int | None:
    """How many items ``zip(*iterables)`` gives, where they all say (else None)."""
    try:
        return min(len(it) for it in iterables)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def _chunk_unpicklable(
    fn: Callable[..., Any], exc: BaseException, args: tuple[Any, ...]
) -> BaseException:
    """The error of a chunk of ``map(fn, ..., chunksize=n)`` that cannot be pickled
    (``args``: the stand-in of ``fn`` and the chunk's items): it names ``fn`` and the argument
    of the first item that cannot be sent, as an unchunked map's item does."""
    cloud = _cloudpickle_or_none()
    for item in args[1]:
        found = pickling_error(item, cloud)
        if found is not None:
            return _unpicklable(fn, found, tuple(item))
    return _unpicklable(fn, exc, ())


def _unsendable(fn: Callable[..., Any], exc: BaseException) -> Iterator[Any]:
    """The results of a map whose function cannot be sent to a worker, by reference nor by
    value: its first raises the TaskPicklingError that names the function (as each item of an
    unchunked map does)."""
    raise _unpicklable(fn, exc)
    yield  # a generator: raised at the first next(), as a failed item is


def _lazy(
    core: D.Core,
    fn: Callable[..., Any],
    items: Iterator[tuple[Any, ...]],
    buffersize: int,
    deadline: float | None,
    source: _Source | None = None,
    blame: Any = None,
) -> Iterator[Any]:
    """``map`` with a ``buffersize``: items are submitted in blocks of a quarter of it (so
    small tasks still share frames) while at most ``buffersize`` are submitted and not yet
    yielded; closing the iterator cancels what has not started. What the items' ``source``
    raised is raised after the results of the items taken before it."""
    step = max(1, buffersize // 4)
    blocks: collections.deque[D.MapResults] = collections.deque()
    unyielded = 0
    try:
        while True:
            while buffersize - unyielded >= step or not blocks:
                chunk = list(itertools.islice(items, min(step, buffersize - unyielded) or 1))
                if not chunk:
                    break
                blocks.append(core.submit_many(fn, chunk, core.task_timeout, blame))
                unyielded += len(chunk)
                del chunk  # the items' objects: not held here while they run
            if not blocks:
                if source is not None:
                    source.raise_error()
                return
            results = blocks.popleft()
            ordered = _ordered(results, len(results.values), deadline)
            for _ in range(len(results.values)):
                unyielded -= 1
                yield next(ordered)  # (not held here while the caller has it)
    finally:
        for results in blocks:
            results.cancelled = True  # (the block being read cancels itself)


class _Source:
    """The items of a map that takes them as results are consumed. An exception the iterable
    raises ends the items and is kept (``raise_error``), so that the items taken before it
    still run and their results are handed out first, as ``multiprocessing.Pool.imap`` does."""

    def __init__(self, items: Iterator[Any]) -> None:
        self.items = items
        self.error: Exception | None = None

    def __iter__(self) -> _Source:
        return self

    def __next__(self) -> Any:
        if self.error is not None:
            raise StopIteration
        try:
            return next(self.items)
        except StopIteration:
            raise
        except Exception as exc:  # noqa: BLE001 - raised after the results before it
            self.error = exc
            raise StopIteration from None

    def raise_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error


def _unordered(
    pool: Pool, fn: Callable[..., Any], items: _Source, buffersize: int
) -> Iterator[Any]:
    """Results as they come; no item, future or result is held here once handed out. What
    the items raised comes last (see :class:`_Source`)."""
    done: queue.SimpleQueue[concurrent.futures.Future[Any]] = queue.SimpleQueue()
    running: set[concurrent.futures.Future[Any]] = set()

    def launch(x: Any) -> None:
        fut = pool.submit(fn, x)
        running.add(fut)
        fut.add_done_callback(done.put)

    try:
        collections.deque(map(launch, itertools.islice(items, buffersize)), maxlen=0)
        while running:
            finished = [done.get()]  # popped as it is yielded: not held here meanwhile
            running.discard(finished[0])
            collections.deque(map(launch, itertools.islice(items, 1)), maxlen=0)
            yield finished.pop().result()
        items.raise_error()
    finally:
        for fut in running:
            fut.cancel()
