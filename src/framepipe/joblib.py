"""A joblib backend that runs ``Parallel`` (and scikit-learn's ``n_jobs``) on framepipe workers.

Importing this module registers the backend under the name ``"framepipe"``::

    import joblib
    import framepipe.joblib  # noqa: F401 - registers the backend

    with joblib.parallel_config(backend="framepipe", n_jobs=4):
        results = joblib.Parallel()(joblib.delayed(f)(x) for x in data)

Batches are joblib's auto-batching, reaching their size in fewer steps (NOTE [ Batch growth ]);
``timeout=``, ``return_as="generator"`` and ``"generator_unordered"`` work as with loky, and a
call that returns a list wakes joblib's main thread once (NOTE [ A list waits once ]). A worker
that dies fails the call with :class:`framepipe.workers.WorkerCrashed` (which worker, its
signal or exit code, the batch it ran, its last stderr lines), not with a bare
``TerminatedWorkerError``; the workers are then replaced before the next call. Functions joblib
cannot send by reference (lambdas, closures) go by value, once per worker (see
:mod:`framepipe.workers`).

Keyword arguments given to ``parallel_config(backend="framepipe", ...)`` go to
:class:`framepipe.workers.Pool` (``start_method``, ``task_timeout``, ``max_tasks_per_worker``,
``max_rss``, ...). The workers are kept from one ``Parallel`` call to the next while those
arguments and ``n_jobs`` stay the same, as loky's are.

importing :mod:`framepipe` never imports joblib; this module does.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import threading
import time
import warnings
from typing import Any

from joblib import register_parallel_backend
from joblib._parallel_backends import (
    AutoBatchingMixin,
    FallbackToBackend,
    ParallelBackendBase,
    SequentialBackend,
)

from .workers import Pool

__all__ = ["FramepipeBackend", "register"]

NAME = "framepipe"
# What Parallel passes every backend for its memory-mapping of large arrays (loky's): results
# and arguments here travel through framepipe's own channels, large arrays in shared memory.
_JOBLIB_ONLY = frozenset(
    {"max_nbytes", "mmap_mode", "temp_folder", "idle_worker_timeout", "verbose", "context"}
)

_GROWTH = 4  # how many times a batch may grow from one to the next: NOTE [ Batch growth ]

_lock = threading.Lock()
_shared: tuple[Any, Pool] | None = None  # (its arguments, the pool) kept between calls


def _pool_for(n_jobs: int, kwargs: dict[str, Any]) -> Pool:
    """The pool kept for these arguments; a new one (the previous one shut down) otherwise."""
    global _shared
    key = (n_jobs, sorted((k, repr(v)) for k, v in kwargs.items()))
    with _lock:
        old = _shared
        if old is not None and old[0] == key and old[1].broken is None:
            return old[1]
        kwargs.setdefault("name", "joblib")
        pool = Pool(n_jobs, **kwargs)
        _shared = (key, pool)
    if old is not None:
        old[1].shutdown(wait=False)
    return pool


def _discard(pool: Pool) -> None:
    """Kill ``pool``'s workers now and forget it (a crash, a timeout, an error)."""
    global _shared
    with _lock:
        if _shared is not None and _shared[1] is pool:
            _shared = None
    pool.terminate()


class FramepipeBackend(AutoBatchingMixin, ParallelBackendBase):  # type: ignore[misc]
    """joblib's ``ParallelBackendBase`` over a :class:`framepipe.workers.Pool`."""

    supports_retrieve_callback = True
    supports_timeout = True
    supports_return_generator = True
    supports_inner_max_num_threads = True
    supports_sharedmem = False
    uses_threads = False
    _effective_batch_size: int  # joblib's AutoBatchingMixin's state
    _smoothed_batch_duration: float

    def __init__(
        self,
        nesting_level: int | None = None,
        inner_max_num_threads: int | None = None,
        **pool_kwargs: Any,
    ) -> None:
        super().__init__(
            nesting_level=nesting_level,
            inner_max_num_threads=inner_max_num_threads,
            **pool_kwargs,
        )
        self._pool: Pool | None = None

    def effective_n_jobs(self, n_jobs: int | None) -> int:
        if n_jobs == 0:
            raise ValueError("n_jobs == 0 in Parallel has no meaning")
        if n_jobs is None:
            return 1
        if multiprocessing.current_process().daemon:
            if n_jobs != 1:  # a daemonic process may not start processes
                warnings.warn(
                    "the framepipe backend runs sequentially inside a daemonic process "
                    "(such as a multiprocessing.Pool worker): it may not start processes",
                    stacklevel=3,
                )
            return 1
        if n_jobs < 0:
            return max((os.cpu_count() or 1) + 1 + n_jobs, 1)
        return int(n_jobs)

    def configure(
        self,
        n_jobs: int = 1,
        parallel: Any = None,
        prefer: str | None = None,
        require: str | None = None,
        **kwargs: Any,
    ) -> int:
        n_jobs = self.effective_n_jobs(n_jobs)
        if n_jobs == 1:
            raise FallbackToBackend(SequentialBackend(nesting_level=self.nesting_level))
        pool_kwargs = {
            k: v for k, v in {**self.backend_kwargs, **kwargs}.items() if k not in _JOBLIB_ONLY
        }
        env = dict(self._prepare_worker_env(n_jobs))
        env.update(pool_kwargs.pop("env", None) or {})
        self._pool = _pool_for(n_jobs, {**pool_kwargs, "env": env})
        self.parallel = parallel
        # See NOTE [ Results in order ]
        self.supports_retrieve_callback = not getattr(parallel, "return_ordered", False)
        self._call = _Call(parallel)
        return n_jobs

    def submit(self, func: Any, callback: Any = None) -> concurrent.futures.Future[Any]:
        assert self._pool is not None, "configure() first"
        future = self._pool.submit(func)
        if callback is not None:
            if self.supports_retrieve_callback:
                future.add_done_callback(callback)
            else:
                future.add_done_callback(_InOrder(callback, self._call))
        return future

    def retrieve_result_callback(self, future: concurrent.futures.Future[Any]) -> Any:
        return future.result()

    def compute_batch_size(self) -> int:
        """joblib's auto-batching (batches of 0.2-2 s of work, sized from the ones that ended),
        reaching that size in fewer steps. See NOTE [ Batch growth ]."""
        old = self._effective_batch_size
        took = self._smoothed_batch_duration
        if not 0 < took < self.MIN_IDEAL_BATCH_DURATION:
            return int(super().compute_batch_size())
        ideal = 2 * int(old * self.MIN_IDEAL_BATCH_DURATION / took)  # joblib's own estimate
        size = max(min(_GROWTH * old, ideal), 1)
        if size != old:
            self._effective_batch_size = size
            self._smoothed_batch_duration = self._DEFAULT_SMOOTHED_BATCH_DURATION
            parallel = getattr(self, "parallel", None)
            if parallel is not None and parallel.verbose >= 10:  # said as joblib says it
                parallel._print(f"Batch computation too fast ({took}s.) Setting batch_size={size}.")
        return size

    def retrieve_result(
        self, out: concurrent.futures.Future[Any], timeout: float | None = None
    ) -> Any:
        """A batch's results, waited for in joblib's main thread (results in order); the
        error of another batch as soon as one failed; joblib's TimeoutError after
        ``timeout``."""
        call = self._call
        first_error = call.first_error
        if out.done() and not first_error.done():  # most batches: ended before joblib asks
            return out.result()
        if call.whole and not call.settled.done():  # see NOTE [ A list waits once ]
            deadline = None if timeout is None else time.monotonic() + timeout
            concurrent.futures.wait(
                (call.settled, first_error), timeout, return_when=concurrent.futures.FIRST_COMPLETED
            )
            if deadline is not None:
                timeout = max(0.0, deadline - time.monotonic())
        done, _ = concurrent.futures.wait(
            (out, first_error), timeout, return_when=concurrent.futures.FIRST_COMPLETED
        )
        if out in done:
            return out.result()
        if first_error in done:
            raise first_error.result()
        raise multiprocessing.TimeoutError()  # what joblib raises for a timeout, as with loky

    def terminate(self) -> None:
        self._pool = None  # its workers stay for the next call (see _pool_for)
        self.reset_batch_stats()

    def abort_everything(self, ensure_ready: bool = True) -> None:
        if self._pool is not None:
            _discard(self._pool)
            self._pool = None
        if ensure_ready and self.parallel is not None:
            self.configure(
                n_jobs=self.parallel.n_jobs,
                parallel=self.parallel,
                **self.parallel._backend_kwargs,
            )


# NOTE [ Batch growth ]
# joblib sizes batches from the ones that ended: while a batch takes under 0.2 s, the next may
# be up to twice its joblib-estimated ideal size (0.4 s of work at the measured rate), but at
# most twice the last size, so a call of tiny tasks starts with batches of 1 and needs a dozen
# doublings to reach a useful size. This backend keeps joblib's estimate and its cap and lets
# a batch grow four times instead: the same size is reached in half the batches (10,000 tiny
# calls: 43-44 batches, not 63-71), and each batch saved is the parent's work for one submit,
# result and callback, which is what bounds tiny calls (the parent's one core runs joblib's
# own per-call work too). The cap on work per batch is unchanged, so slow tasks are batched as
# loky batches them.

# NOTE [ Results in order ]
# With ``supports_retrieve_callback``, joblib's main thread does not wait on the batches: it
# looks whether the next one is done every 10 ms (``Parallel._retrieve``), so a call ends up to
# 10 ms after its last batch, a fifth of the time of 10,000 tiny calls. For results in order
# (``return_as="list"`` and ``"generator"``), this backend takes joblib's other way instead:
# the main thread waits on each batch's future (``retrieve_result``) and wakes when it ends.
# As with the callback, a failed batch stops the call at once: ``_InOrder`` dispatches no more
# batches after it, and the main thread, whatever batch it waits on, raises its error then.
# ``"generator_unordered"`` keeps the callback (joblib hands batches out as they end there).


# NOTE [ A list waits once ]
# joblib's main thread and the thread that runs the batches' callbacks (here the pool's manager,
# which also runs joblib's dispatch and with it the caller's generator) share one interpreter
# lock. Woken at every batch that ends, the main thread takes the lock from the manager once or
# twice a batch, and where the two threads run on different CPUs each hand-off is a wake-up
# across CPUs. A call that returns a list (``return_as="list"``, the default) hands out nothing
# before its end, so there its main thread, finding the next batch still running, sleeps until
# the call has settled (``_Call.settled``: every batch dispatched and ended, a batch failed, or
# joblib is aborting; a callback that raised settles it too) and then takes the results of
# every batch at once. ``timeout=`` keeps its meaning: the batch waited for is given that long.
# Measured on 2 CPUs, 10,000 tiny calls: the main thread's voluntary context switches a call
# 42 -> 1-7, the manager's 22 -> 2-18; calls 4% faster (median of 40 alternating pairs, in
# each of three runs). A generator (``"generator"``) is read as it goes, so its main thread
# still wakes at each batch.


class _Call:
    """One ``Parallel`` call, as its batches' callbacks and joblib's main thread see it."""

    __slots__ = ("parallel", "first_error", "settled", "whole")

    def __init__(self, parallel: Any) -> None:
        self.parallel = parallel
        self.first_error: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.settled: concurrent.futures.Future[Any] = concurrent.futures.Future()
        # see NOTE [ A list waits once ]
        self.whole = getattr(parallel, "return_generator", True) is False

    def failed(self, exc: BaseException) -> None:
        with _lock:
            if not self.first_error.done():
                self.first_error.set_result(exc)

    def settle(self) -> None:
        with _lock:
            if not self.settled.done():
                self.settled.set_result(None)

    def batch_ended(self) -> None:
        """After joblib's callback of a batch: settled when nothing is left to run (or joblib
        stops the call)."""
        p = self.parallel
        try:
            ended = p._aborting or (
                not p._iterating and p.n_completed_tasks >= p.n_dispatched_tasks
            )
        except AttributeError:  # another joblib: the main thread waits batch by batch
            ended = True
        if ended:
            self.settle()


class _InOrder:
    """The done-callback of a batch when joblib's main thread retrieves the results: joblib's
    callback (which dispatches the next batch) after a batch that ended well; after one that
    failed, its error to the call's ``first_error``, and no new batch."""

    __slots__ = ("callback", "call")

    def __init__(self, callback: Any, call: _Call) -> None:
        self.callback = callback
        self.call = call

    def __call__(self, future: concurrent.futures.Future[Any]) -> None:
        exc = concurrent.futures.CancelledError() if future.cancelled() else future.exception()
        if exc is not None:
            self.call.failed(exc)
            return
        if not self.call.whole:
            self.callback(future)
            return
        try:
            self.callback(future)
        except BaseException:
            self.call.settle()  # the main thread goes back to waiting batch by batch
            raise
        self.call.batch_ended()


def register() -> None:
    """Register the backend as ``"framepipe"`` (done when this module is imported)."""
    register_parallel_backend(NAME, FramepipeBackend)


register()
