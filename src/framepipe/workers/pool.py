"""``Pool``: worker processes behind a ``concurrent.futures.Executor``."""

from __future__ import annotations

import concurrent.futures
import itertools
import os
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

from .._lazy import asyncio  # imported on first use (see _lazy)
from . import _byvalue, _progress
from . import _dispatch as D
from .worker import _check_timeout, get_context

__all__ = ["Pool"]

T = TypeVar("T")


class Pool(concurrent.futures.Executor):
    """A pool of worker processes, each with its own private channel; a
    :class:`concurrent.futures.Executor`.

    - A worker that dies fails only the task it was running, with :class:`WorkerCrashed`
      (which worker, pid, signal or exit code, the task, peak RSS, the OOM hint, its native
      traceback and last stderr lines); tasks queued behind it go to the other workers and a
      replacement starts at once. More than ``max_restarts`` crashes within ``restart_window``
      seconds break the pool with one :class:`PoolBroken` naming the last crashes (None: never).
    - An exception raised by a task, whatever its type or constructor, reaches the caller as
      itself with the worker's traceback, and never harms the pool.
    - ``task_timeout``: a task still running that many seconds after it started fails with
      :class:`TaskTimeout` holding the worker's stack; the worker gets SIGTERM, then SIGKILL
      ``kill_grace`` seconds later (its whole process group), and is replaced.
    - Workers are replaced after ``max_tasks_per_worker`` tasks, or when their resident size
      passes ``max_rss`` bytes after a task.
    - ``initializer(*initargs)`` runs in each worker before its first task; if it raises, the
      pool is broken (:class:`PoolBroken` from :class:`WorkerStartError`).

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
        max_tasks_per_worker: int | None = None,
        max_rss: int | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        log_dir: str | None = None,
        tee: bool = False,
        name: str = "pool",
    ) -> None:
        if max_workers is None:
            max_workers = os.cpu_count() or 1
        if not isinstance(max_workers, int) or isinstance(max_workers, bool) or max_workers < 1:
            raise ValueError(f"max_workers must be a positive int, not {max_workers!r}")
        if initializer is not None and not callable(initializer):
            raise TypeError(f"initializer must be callable, not {type(initializer).__name__}")
        for label, value in (
            ("max_tasks_per_worker", max_tasks_per_worker),
            ("max_rss", max_rss),
            ("max_restarts", max_restarts),
        ):
            if value is not None and (
                not isinstance(value, int) or value < 0 or (value == 0 and label != "max_restarts")
            ):
                raise ValueError(f"{label} must be a positive int or None, not {value!r}")
        if not restart_window > 0:
            raise ValueError(f"restart_window must be positive, not {restart_window!r}")
        if not kill_grace >= 0:
            raise ValueError(f"kill_grace must be >= 0, not {kill_grace!r}")
        self._max_workers = max_workers
        self._core = D.Core(
            max_workers=max_workers,
            mp_context=get_context(start_method),
            name=name,
            policy="pool",
            initializer=initializer,
            initargs=initargs,
            env=env,
            cwd=cwd,
            log_dir=log_dir,
            tee=tee,
            max_restarts=max_restarts,
            restart_window=restart_window,
            task_timeout=_check_timeout("task_timeout", task_timeout),
            kill_grace=kill_grace,
            max_tasks_per_worker=max_tasks_per_worker,
            max_rss=max_rss,
        )

    def __repr__(self) -> str:
        state = "broken" if self._core.broken else "shut down" if self._core.closing else "running"
        return f"<Pool {self._core.name!r} max_workers={self._max_workers} {state}>"

    # -- Executor --

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        """Schedule ``fn(*args, **kwargs)``; returns a :class:`concurrent.futures.Future`."""
        return self._core.submit(D.CALL, fn, args, kwargs, timeout=self._core.task_timeout).future

    async def acall(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> T:
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

    def map(
        self,
        fn: Callable[..., T],
        *iterables: Iterable[Any],
        timeout: float | None = None,
        chunksize: int = 1,
        progress: Any = None,
    ) -> Iterator[T]:
        """Like ``Executor.map``: results in order; ``timeout`` bounds the whole iteration
        (from this call), raising ``TimeoutError``. ``chunksize`` groups that many calls into
        one task (a crash then fails the whole chunk). ``progress``: True, a callable, a tqdm
        or rich bar, to show the results handed out (see :mod:`._progress`)."""
        if not isinstance(chunksize, int) or chunksize < 1:
            raise ValueError(f"chunksize must be a positive int, not {chunksize!r}")
        if progress is not None and progress is not False:
            _progress.check(progress)
            items = list(zip(*iterables))
            plain = self.map(fn, *zip(*items), timeout=timeout, chunksize=chunksize)
            return _progress.track(plain, progress, len(items), self._core.name)
        deadline = None if timeout is None else time.monotonic() + timeout
        if chunksize == 1:
            results = self._core.submit_many(fn, zip(*iterables), self._core.task_timeout)
            return _ordered(results, len(results.values), deadline)
        it = zip(*iterables)
        chunks = iter(lambda: list(itertools.islice(it, chunksize)), [])
        fn = _byvalue.prepare(self._core, fn)  # by value if it must, once per worker
        results = self._core.submit_many(
            _run_chunk, ((fn, c) for c in chunks), self._core.task_timeout
        )
        return itertools.chain.from_iterable(_ordered(results, len(results.values), deadline))

    def imap(
        self,
        fn: Callable[..., T],
        iterable: Iterable[Any],
        chunksize: int = 1,
        *,
        progress: Any = None,
    ) -> Iterator[T]:
        """Results of ``fn(x)`` for each x of ``iterable``, in order (``map`` of one
        iterable, as ``multiprocessing.Pool.imap`` is called)."""
        return self.map(fn, iterable, chunksize=chunksize, progress=progress)

    def imap_unordered(
        self, fn: Callable[..., T], iterable: Iterable[Any], *, progress: Any = None
    ) -> Iterator[T]:
        """Results of ``fn(x)`` for each x of ``iterable`` as they complete, in any order."""
        _progress.check(progress)
        futures = [self.submit(fn, x) for x in iterable]
        return _progress.track(_unordered(futures), progress, len(futures), self._core.name)

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
        if core is not None and not core.closing:
            try:
                core.shutdown(wait=False)
            except Exception:  # noqa: BLE001 - a finalizer never raises
                pass

    # -- facts --

    @property
    def broken(self) -> BaseException | None:
        """The :class:`PoolBroken` (or start error) that ended the pool, or None."""
        return self._core.broken

    @property
    def pids(self) -> list[int]:
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


def _run_chunk(fn: Callable[..., Any], chunk: list[tuple[Any, ...]]) -> list[Any]:
    return [fn(*args) for args in chunk]


def _ordered(results: D.MapResults, n: int, deadline: float | None) -> Iterator[Any]:
    """The results of a map in order; closing the iterator early cancels what has not
    started."""
    values = results.values
    empty = D._EMPTY
    failure = D._Failure
    try:
        for i in range(n):
            if values[i] is not empty:
                pass  # ready: handed out whatever the time (as concurrent.futures does)
            elif deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("map() did not finish within its timeout")
                results.wait(i, remaining)
            else:
                results.wait(i, None)
            value = values[i]
            values[i] = None  # handed out once: let it go
            if type(value) is failure:
                raise value.exc
            yield value
    finally:
        results.cancelled = True


def _unordered(futures: list[concurrent.futures.Future[Any]]) -> Iterator[Any]:
    try:
        for fut in concurrent.futures.as_completed(futures):
            yield fut.result()
    finally:
        for fut in futures:
            fut.cancel()
