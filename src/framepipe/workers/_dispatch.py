"""The dispatch core behind :class:`~framepipe.workers.Worker` and
:class:`~framepipe.workers.Pool`: the manager thread and the parts it joins.

One manager thread owns the workers: it waits on every worker's data channel, health channel
and stderr pipe at once (death arrives as :class:`framepipe.WriterDied` on the data channel,
the moment the kernel reports it, after every result written before it), enforces deadlines
and replaces workers. Callers never wait for that thread to send (:mod:`._submitting`); a
caller waiting for an answer may read its worker's channel itself (:mod:`._lending`). What
differs between an actor and a pool is the core's policy object (:mod:`._policy`), asked where
they differ, never tested by name; each worker's record (:class:`~._slot.Slot`) moves through
the states of :mod:`._lifecycle`.

Data flow::

    caller threads             | Core (this process)                 | each worker process
                               |                                     |
    submit(), map() --pickle-->| pending tasks                       |
                               |   | kick(): whoever holds the       |
                               |   | dispatch lock (_scheduling)     |
                               |   v                                 |
      nothing queued, a worker | Slot, one a worker: its tasks in    | task_loop (_taskloop)
      hungry: sent by the  --->| the order sent (_slot)  ==CALL,====>|   runs tasks in order,
      caller itself            |                           BATCH,MAP |   answers each
                               |                                     |
    Future.result() <--set by--| the reader of a data channel:   <===|== RESULT, ERROR, ITEM,
      (reads its own worker's  | the manager, or a caller lent it    |   END, RECYCLE; then
      channel when few answers | (_answers, _lending)                |   WriterDied (a death)
      are due: _lending)       |                                     |
                               | manager thread: Core._run() loops   | health thread
                               | on Core._step(), one turn of named  |<==> ping, stats, cancel,
                               | phases over one epoll of the wake   |    credit, revoke
                               | pipe and, per worker, its data      |
                               | channel, pidfd, health channel and  |<--- stderr (fd 2)
                               | stderr pipe                         |

Each turn of the manager (``_step``):

1. ``_rebuild_poller``: the wait set, when the fds changed (a start, a death, a lent channel);
2. ``_wait``: one poll until an fd is readable or the nearest deadline (``_next_timeout``: a
   task's timeout, a kill after ``kill_grace``, an RSS sample, a look for tasks to take over,
   a reap, a closing pool's look);
3. ``_handle_events``: drain the data channels (answers, then a death: ``_on_death``), the
   health channels' replies, the stderr pipes;
4. ``_reap_dead``: stop and close the workers that died a moment ago;
5. ``_check_deadlines``: expire tasks past their timeout, kill workers past their grace, take
   tasks back from a slow worker for an idle one;
6. ``_maintain``: close retired workers, start replacements;
7. ``kick``: hand out pending tasks; then run the done-callbacks due here.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import socket
import threading
import time
from collections.abc import Iterator

from . import _atexit, _poller, _process, _shm
from ._answers import Answers
from ._child import FdHandle
from ._corebase import _DATA, _HEALTH, _INF, _STDERR, _WAKE, CoreBase
from ._failures import Failures
from ._lending import Lending
from ._lifecycle import State
from ._poller import Poller
from ._process import WorkerProcess
from ._protocol import CALL, CLOSE, SHM_SLOTS, STREAM
from ._scheduling import _MAP_STEP as _MAP_STEP
from ._scheduling import Scheduling
from ._slot import RSS_LINGER, RSS_PERIOD, Slot
from ._submitting import Submitting
from ._taskloop import _exec as _exec
from ._taskloop import _load as _load
from ._taskloop import _store as _store
from ._taskloop import task_loop, worker_namespace
from ._tasks import _EMPTY as _EMPTY
from ._tasks import _END as _END
from ._tasks import ItemChannel, MapResults, MapTask, Task
from ._tasks import _Failure as _Failure
from .errors import WorkerError, WorkerStartError

# The names the worker classes use, where they have always been imported from (the private
# ones too, re-exported above as ``name as name``).
__all__ = [
    "CALL",
    "STREAM",
    "Core",
    "ItemChannel",
    "MapResults",
    "MapTask",
    "Slot",
    "Task",
    "task_loop",
    "worker_namespace",
]

_CLOSING_LOOK = 0.25  # seconds between a closing manager's looks at whether all is done


class Core(Submitting, Scheduling, Lending, Answers, Failures, CoreBase):
    """Workers, their queues and the manager thread."""

    def _spawn(self) -> Slot:
        index = next(self._names)
        loop_options = dict(self._loop_options)
        loop_options["spin"] = self._new_worker_spins()
        mine = theirs = None
        if _shm.HAVE_MEMFD:
            # large arrays in results travel in memfds the worker passes over this socket
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            loop_options["fdsock"] = FdHandle(theirs.fileno())
            loop_options["shm_slots"] = SHM_SLOTS
        proc = WorkerProcess(
            self._mp, f"{self.name}-{index}", self._loop, self._start_options, options=loop_options
        )
        slot = Slot(proc, index, _shm.Receiver(mine))
        slot.spins = loop_options["spin"]
        if _poller.LEND:
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
        poller = Poller()
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
                    slot.kept_out = False  # (in the set now unless lent)
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
        """One turn of the manager: a short loop of named phases (see the module docstring)."""
        if self._version != self._version_seen:
            self._rebuild_poller()
        if self._want_back:
            self._want_back = False  # before the look: a later ask wakes this thread again
            self._put_back_all()
        events = self._wait(self._next_timeout())
        if events:
            self._handle_events(events)
        if self._to_reap and time.monotonic() >= self._reap_at:
            self._reap_dead()
        if self._timers:
            self._check_deadlines()
        if self._dirty:
            self._dirty = False
            self._maintain()
        if self._pending:
            self.kick()
        if self._callbacks:
            self._run_callbacks()

    def _next_timeout(self) -> float | None:
        """How long the next wait may last: until the nearest deadline, or no limit."""
        timeout = None
        self._sleep_until = _INF
        if self._timers:
            # Cleared before the look, not after: a thread that gives a worker a deadline
            # sets it again once the deadline can be seen.
            self._timers = False
            deadline = self._next_deadline()
            if deadline is not None:
                self._timers = True
                self._sleep_until = deadline
                timeout = max(0.0, deadline - time.monotonic())
        if self.closing and (timeout is None or timeout > _CLOSING_LOOK):
            # While closing, look again now and then whether all is done, whatever wake-up
            # may have been missed: a pool never hangs in its shutdown.
            timeout = _CLOSING_LOOK
        return timeout

    def _next_deadline(self) -> float | None:
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
        return deadline

    def _wait(self, timeout: float | None) -> list[tuple[int, int]]:
        try:
            return self._poller.poll(timeout)  # type: ignore[union-attr]
        except InterruptedError:
            return []

    def _handle_events(self, events: list[tuple[int, int]]) -> None:
        """Act on the fds that are ready: answers, health replies, stderr, the wake pipe."""
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
                            # see NOTE [ Spinning while the pool is idle ] (in _submitting)
                            self._caller_read = False
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

    def _reap_dead(self) -> None:
        with self._lock:
            dead, self._to_reap = self._to_reap, []
        for slot in dead:
            self._reap(slot)
        self._dirty = True

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
            if slot.stop_reason is None:
                head = slot.outstanding[0]
                if head.timeout is not None and head.stream is None:
                    yield slot.head_since + head.timeout
                if steal and self._may_steal_from(slot):
                    yield slot.steal_at()

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
            if slot.kept_out and slot.outstanding:
                # A task nobody came to read (see NOTE [ A channel kept out ]): its answer, if
                # it is there, is read before its deadline is looked at again.
                self._put_back(slot)
                self._timers = True
                continue
            if slot.stop_reason is not None or not slot.outstanding:
                continue
            head = slot.outstanding[0]
            if (
                head.timeout is not None
                and head.stream is None
                and now >= slot.head_since + head.timeout
            ):
                self.expire(slot, head, head.timeout, "task")

    def _maintain(self) -> None:
        """Close retired workers that answered everything; keep the pool at strength."""
        with self._lock:
            slots = list(self._slots)
            # a closing pool still replaces a worker that died while tasks wait: shutdown()
            # runs every task it accepted
            closing = (self.closing and not self._pending) or self.broken is not None
        for slot in slots:
            if slot.state is State.RETIRING and not slot.outstanding:
                slot.stop("retired")
                with contextlib.suppress(OSError, ValueError):
                    slot.proc.conn.send_bytes(pickle.dumps((CLOSE,)))
                slot.kill_at = time.monotonic() + 5.0
                self._timers = True
        if closing or self._terminating:
            return
        with self._lock:
            alive = sum(1 for s in self._slots if s.stop_reason is None and not s.retiring)
            need = self.policy.replacements(
                self._n - alive,
                calls_waiting=bool(self._pending),
                any_running=any(s.stop_reason is None for s in self._slots),
            )
        for _ in range(need):
            try:
                self._spawn()
            except BaseException as exc:  # noqa: BLE001
                self._break(WorkerStartError(f"cannot start a worker for {self.name}: {exc}"))
                return

    def _shutdown_workers(self) -> None:
        with self._lock:
            slots = list(self._slots)
            self._slots.clear()
            self.closing = True
        for slot in slots:
            slot.stop("shutdown")
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
            slot.die()  # stopped and reaped here, not seen dying by the loop
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
        _atexit.unregister(self)

    # -- facts --
