"""What callers call: submit, map, cancel, shut down.

Callers never wait for the manager thread to send: a submitting thread pickles its task and,
when a worker has room, writes it to that worker's pipe itself (see :mod:`._scheduling`); the
manager only hands out what had to wait.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from . import _byvalue, _poller
from ._corebase import CoreBase
from ._protocol import ALONE, CALL, STREAM
from ._scheduling import _MAP_STEP
from ._tasks import (
    ItemChannel,
    MapResults,
    MapTask,
    Task,
    _Failure,
    _Future,
    _task_name,
    _unpicklable,
)
from .errors import WorkerCancelled


class Submitting(CoreBase):
    """The calls of the user's API onto the core."""

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
        if _poller.LEND:
            future._core = self  # type: ignore[attr-defined]
        if self.policy.crash_fails_queued:
            future._actor = self  # type: ignore[attr-defined]
        task = self._make_task(op, fn, args, kwargs, future, timeout, window)
        if not task.payload:
            return task  # failed already: what it takes could not be pickled
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

    def _make_task(
        self,
        op: int,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        future: concurrent.futures.Future[Any],
        timeout: float | None,
        window: int,
    ) -> Task:
        """The task of a call, its message pickled; one with no payload failed already (what
        it takes could not be pickled)."""
        tid = next(self._ids)
        stream = ItemChannel() if op == STREAM else None
        name = _task_name(fn)
        if self._main_by_value and getattr(fn, "__module__", None) == "__main__":
            fn = _byvalue.stand_in(self, fn)  # by value, if the worker cannot import it
        msg = (
            (self._call_op(), tid, fn, args, kwargs)
            if op == CALL
            else (STREAM, tid, fn, args, kwargs, window)
        )
        try:
            payload = pickle.dumps(msg, protocol=5)
        except Exception as exc:  # noqa: BLE001 - by value, else the future fails, naming
            try:  # what could not be sent (as concurrent.futures: at result(), not submit())
                payload = _byvalue.dumps(self, msg, fn, exc)
            except Exception:  # noqa: BLE001
                future.set_exception(_unpicklable(fn, exc, args, kwargs))
                return Task(tid, future, name, b"", timeout, stream)
        return Task(tid, future, name, payload, timeout, stream)

    # NOTE [ Which workers spin ]
    #
    # A worker whose reads spin for its next task (see framepipe._spin) gets it without a
    # wake-up, but holds a CPU while it spins: one the parent, another worker or a dying
    # worker's teardown may need. So no more of a pool's workers spin than leave this process a
    # CPU (``_spin.spinners``: the CPUs it may use, less one): all of them where they fit
    # (``workers_may_spin``), else the first ones started, a replacement taking the place of one
    # that died (``_new_worker_spins``, ``Slot.spins``). The dispatch gives a task to the first idle
    # worker, so small tasks go mostly to those. It was all or none: with 16 workers on 16 CPUs
    # none spun, with 15 all did. Measured on 2 CPUs (1 worker of 2, 4 or 16 spins now, none
    # before), the two alternating in one process: submit, map, round trip and crash rows alike
    # within the noise (Pool(2) round trip medians of 8 pools: 33.1 and 32.7 us; crash to the
    # failed future, 12 pools: 3.88 and 3.85 ms). What a spin is worth where a worker has a CPU
    # of its own, Pool(1) on 2 CPUs with its worker's spin turned off and on: 54-88k and 79-95k
    # no-op tasks/s through submit().
    #
    # NOTE [ Spinning while the pool is idle ]
    #
    # Where not all the workers may spin (NOTE [ Which workers spin ]: two workers on two CPUs), the
    # others sleep at once for their next message. But a caller's round trip on an idle pool
    # (submit, then result) keeps two things busy, the caller and one worker, and a worker asleep in
    # read() costs the hop a wake-up: the caller's write wakes it on a halted CPU, or it preempts
    # the caller mid-write. So a task goes as ALONE (``_call_op``) when no worker has a task in
    # hand, nothing is pending, and the last answer read was read by the caller that waited for it
    # (``_caller_read``, set by ``Lending.wait_for`` after its ``_serve``, cleared by the manager's
    # ``_step`` before it drains a worker: a round trip; in a burst of submits the manager reads the
    # answers); a worker that ran one may spin, and one that spins anyway spins longer
    # (``_taskloop._spin_switch``, under the usual policy of ``_spin``: only while its recent waits
    # were short), until any other message but a RETURN comes, which sets it back to what the pool
    # allowed at start. So spinning stops as soon as the pool has a second thing to do. Measured on
    # a 2-CPU VM, quiet: round trip 47 us -> 37 us (the bare transport's: 14-16 us); busy (load
    # 5-10): medians 64-95 us -> 40-60 us; submit and map rates unchanged within the noise. The rest
    # of a round trip is the caller's own work (about 25 us: pickling, the Future, the locks, taking
    # the worker's fd out of the manager's epoll set and back, the reads). Such a worker spins
    # longer than a read usually does (SPIN_ALONE, see framepipe._spin), and the caller spins for
    # its answer too, briefly and without yielding its CPU (NOTE [ A caller's spin ] in _lending).

    def _call_op(self) -> int:
        """ALONE when no worker has a task in hand and none is pending, and the last answer
        was read by the caller waiting for it (a round trip, not a burst of submits whose
        answers the manager reads), where workers do not spin otherwise; else CALL. Read
        without the lock: a hint (see NOTE [ Spinning while the pool is idle ] above)."""
        if self._spin_alone and self._caller_read and not self._pending:
            for slot in self._slots:
                if slot.outstanding:
                    return CALL
            return ALONE
        return CALL

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

    def submit_many(
        self,
        fn: Callable[..., Any],
        items: Iterable[tuple[Any, ...]],
        timeout: float | None = None,
        blame: Callable[[BaseException, tuple[Any, ...]], BaseException] | None = None,
    ) -> MapResults:
        """Queue ``fn(*args)`` for every ``args`` of ``items`` at once (``map``). ``blame``:
        the error of an item that cannot be pickled, where ``fn`` is framepipe's own (a chunk
        of a map names the user's function and argument, not the chunk)."""
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
        except Exception as exc:  # noqa: BLE001 - every item fails with it, naming fn
            err = _unpicklable(fn, exc)
            for i in range(len(items)):
                results.store(i, _Failure(err))
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
                        args = tuple(items[i])
                        failed: BaseException = (
                            _unpicklable(fn, exc, args) if blame is None else blame(exc, args)
                        )
                        results.store(i, _Failure(failed))
                        continue
                tasks.append(MapTask(tid, results, i, name, payload, timeout, fn))
            with self._submit_lock:
                self._check_open()
                self._pending.extend(tasks)
            self.kick()
        return results

    def cancel_all(self) -> int:
        """Cancel the running task and every queued one: the running task gets
        WorkerCancelled raised inside it; queued ones fail at once. Returns how many."""
        with self._submit_lock, self._lock:
            pending = list(self._pending)
            self._pending.clear()
            per_slot = [(s, list(s.outstanding)) for s in self._slots if s.outstanding]
        err = WorkerCancelled("cancelled before it started")
        self.want_back()  # the answers of the tasks cancelled (NOTE [ A channel kept out ])
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

    def dropped(self) -> None:
        """The Pool or Worker that owns this core was dropped without being shut down: the
        core shuts down without waiting (its tasks still run; see _atexit for the exit)."""
        if not self.closing:
            try:
                self.shutdown(wait=False)
            except Exception:  # noqa: BLE001 - called from a finalizer, which never raises
                pass

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
                # a pool: nor the next task of each worker with nothing in hand
                holding = sum(1 for s in self._slots if s.outstanding and not s.dead)
                kept = self.policy.kept_at_cancel(max(0, self._n - holding))
                again += pending[:kept]
                del pending[:kept]
                self._pending.clear()
                self._pending.extend(again)
            else:
                pending = []
        for task in pending:
            task.future.cancel()
            if task.stream is not None:
                task.stream.put(_Failure(concurrent.futures.CancelledError()))
        self.want_back()  # the manager reads every answer now (NOTE [ A channel kept out ])
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

    # -- at interpreter exit (see _atexit) --

    def finish_at_exit(self) -> None:
        """A pool finishes the tasks it was given, shut down or not (as ``concurrent.futures``
        does: work submitted is not dropped because nobody waited for it)."""
        if self.policy.finishes_at_exit and self.broken is None:
            self.shutdown(wait=True)

    def stop_at_exit(self) -> None:
        """Every worker is stopped and reaped."""
        self.terminate(join=True)
