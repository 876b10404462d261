"""The state every part of the dispatch core shares, and its small common calls.

:class:`CoreBase` holds the fields of one core (its workers, queues, locks, the manager's wait
set and its failure record) and the calls every part uses (waking the manager, health
requests, the open/closed check). The parts are mixins over it, each in its own module:
:mod:`._scheduling` (who gets which task), :mod:`._lending` (callers reading their own
answers), :mod:`._answers` (what a worker sent), :mod:`._failures` (deaths, deadlines, a
broken pool), :mod:`._submitting` (what callers call); :class:`._dispatch.Core` is the manager
that joins them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from .._spin import spinners, workers_may_spin
from ..errors import WriterDied
from . import _atexit, _byvalue, _process
from ._mainguard import refuse_during_main_import
from ._options import ProcessOptions
from ._policy import Policy
from ._poller import Poller
from ._process import ChildContext
from ._slot import Slot
from ._taskloop import task_loop
from ._tasks import Task, _Future
from .errors import WorkerCrashed, WorkerError

_INF = float("inf")
_WAKE, _DATA, _HEALTH, _STDERR = range(4)  # what an fd in the manager's wait set is


class CoreBase:
    """The fields of a dispatch core: ``options`` says how its processes start, ``policy`` what
    differs between an actor and a pool (see :mod:`._policy`)."""

    def __init__(
        self,
        options: ProcessOptions,
        policy: Policy,
        *,
        max_workers: int,
        task_timeout: float | None = None,
        max_tasks_per_worker: int | None = None,
        max_rss: int | None = None,
        loop: Callable[[ChildContext], None] = task_loop,
    ) -> None:
        mp_context = options.context()  # an unknown start method is refused first
        refuse_during_main_import(f"{policy.label} {options.name!r}")
        self.name = options.name
        self.options = options
        self.policy = policy
        self._n = max_workers
        self._mp = mp_context
        self.byvalue: _byvalue.Registry | None = None  # functions sent by value (_byvalue)
        self._main_by_value = _byvalue.main_by_value(mp_context)
        # the initializer by value where it must be (see _byvalue)
        initializer = _byvalue.portable(mp_context, options.initializer, "the initializer")
        self._start_options = options.sending(initializer)
        self._loop_options: dict[str, Any] = {
            "max_rss": max_rss,
            "spin": workers_may_spin(max_workers),
        }
        # see NOTE [ Spinning while the pool is idle ] (in _submitting)
        self._spin_alone = not self._loop_options["spin"]  # tasks may go ALONE
        self._caller_read = False  # the last answer read, by the caller waiting for it
        self._want_back = False  # channels kept out go back to the manager's set (_lending)
        # not where a worker may write after its answer (a RECYCLE past max_rss): see _lending
        self._may_keep_out = max_rss is None
        self._loop = loop
        self.task_timeout = task_timeout
        self.kill_grace = options.kill_grace
        self.max_tasks = max_tasks_per_worker
        self._init_queues()
        self._init_failures()
        self._init_manager()

    def _init_queues(self) -> None:
        """The tasks, the workers, and the locks that guard them."""
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
        self._dispatch_lock = threading.Lock()
        self._submit_lock = threading.Lock()
        self._dispatch_wanted = False

    def _init_failures(self) -> None:
        """What broke, crashed or ended, and what an actor's crash holds."""
        self._progress_at = 0.0  # when a worker last finished a task (see _count_crash)
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
        # see NOTE [an actor's crash] (in _failures); submit lock held to read or change them
        self._crash_hold: list[Task] | None = None
        self._unseen_crash: BaseException | None = None

    def _init_manager(self) -> None:
        """The manager thread, its wake pipe and its wait set (the thread starts last)."""
        self._version = 1  # bumped whenever the set of fds to wait on changes
        self._version_seen = 0
        self._poller: Poller | None = None
        self._owners: dict[int, tuple[Slot | None, int]] = {}
        self._ep_lock = threading.Lock()  # the poller and _owners, lending a channel
        self._sleep_until = _INF  # when the manager's current wait ends at the latest
        self._manager_id = 0
        self._timers = self.task_timeout is not None
        self._dirty = True  # _maintain() has work: a death, a retirement, a start
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        _process.register_parent_side(self)
        self.stopped = concurrent.futures.Future()  # type: ignore[var-annotated]
        self.launched = threading.Event()  # the first max_workers processes were started
        self._thread = threading.Thread(
            target=self._run, name=f"framepipe-{self.name}", daemon=True
        )
        _atexit.register(self)  # see finish_at_exit and stop_at_exit
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

    # -- small calls every part makes -------------------------------------------------------

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

    def _new_worker_spins(self) -> bool:
        """Whether the worker about to start may spin for its next task: all of them where they
        fit, else while fewer than ``spinners()`` live ones do (see NOTE [ Which workers spin ]
        in _submitting)."""
        if self._loop_options["spin"]:
            return True
        with self._lock:
            spinning = sum(1 for s in self._slots if s.spins and not s.dead)
        return spinning < spinners()

    def _closed_poller(self) -> bool:
        return self._poller is None or self._wake_r < 0

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
                    if slot.working:
                        return slot
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"{self.name} has no running worker")
            time.sleep(0.001)

    if TYPE_CHECKING:  # the parts' calls on each other, each defined in its own mixin

        def _run(self) -> None: ...

        def finish_at_exit(self) -> None: ...

        def stop_at_exit(self) -> None: ...

        def kick(self) -> None: ...

        def _queue(self, task: Task | None) -> None: ...

        def _busy(self, slot: Slot, task: Task) -> None: ...

        def _send_direct(self, task: Task) -> bool: ...

        def _pick(self, task: Task, queued: int) -> Slot | None: ...

        def _requeue(
            self, slot: Slot, first: int, end: int | None, retire: bool = False
        ) -> None: ...

        def _may_steal(self, slots: list[Slot]) -> bool: ...

        @staticmethod
        def _may_steal_from(slot: Slot) -> bool: ...

        def _steal(self, slots: list[Slot], now: float) -> None: ...

        def _drain(self, slot: Slot) -> None: ...

        def _on_death(
            self, slot: Slot, died: WriterDied | None, reason: str | None = None
        ) -> None: ...

        def _break(self, exc: BaseException) -> None: ...

        def expire(self, slot: Slot, task: Task, timeout: float, what: str) -> None: ...

        def _count_crash(self, err: WorkerCrashed) -> None: ...

        def _park(self, slot: Slot, fd: int) -> None: ...

        def _put_back(self, slot: Slot) -> None: ...

        def _put_back_all(self) -> None: ...

        def want_back(self) -> None: ...

        @staticmethod
        def _still_readable(slot: Slot) -> bool: ...

        def wait_for(self, fut: _Future, timeout: float | None) -> float | None: ...

        def _deadlines(self, slot: Slot, steal: bool) -> Iterator[float]: ...
