"""Who gets which task: the pool's scheduling policy, written down with its measured effect.

Tasks wait in the core's pending queue until a worker has room; whoever holds the dispatch
lock (a submitting caller, a caller reading answers, or the manager) hands them out
(:meth:`Scheduling.kick`). How much each worker is given, and when tasks a worker holds go
back to the queue for an idle one, is NOTE [ Feeding ahead and balance ] below.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import time
from typing import Any

from ._corebase import CoreBase
from ._protocol import BATCH, MAP
from ._slot import RSS_LINGER, RSS_PERIOD, STEAL_AFTER, Slot
from ._tasks import Task, _Future
from .errors import WorkerError

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
#   hand (``Scheduling._share``: ceil(all / workers)). A burst of 20,000 tiny tasks still goes
#   out in frames of a hundred; 160 tasks of 2 ms on 4 workers go out 40 each, not 128 to one.
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
BATCH_BYTES = 64 * 1024  # tasks smaller than this may share one frame
_MAP_STEP = 256  # map() queues its items this many at a time
LOW_WATER = 8  # a submitting thread sends directly only to a worker with fewer tasks in hand

# NOTE [ Who hands out a queued task ]
#
# A task that cannot go straight to a worker (``_send_direct``: something is queued already,
# another thread dispatches, or every worker holds LOW_WATER tasks) waits in ``_pending``
# until a worker has room, and whoever makes room hands it out: an idle worker is fed by the
# thread that queued the task (``_queue`` asks for the dispatch); a worker with work in hand
# gets more in batches as its answers are read, by the manager or by a caller lent its
# channel, both of which kick the dispatch while anything is pending; a worker that starts, or
# gives tasks back, is fed by the manager. So ``_queue`` looks at the workers only when the
# queue was empty: a look at every submit is O(workers), and with no worker idle it asked for a
# dispatch that the share rule then mostly refused. Measured with the caller and manager on one
# CPU and the workers on the other (how a many-core machine sees the caller's cost), 20,000
# no-op submits, medians of 6 alternating pools: at 16 workers 10.7 -> 8.7 us of the caller's
# CPU a task and 77k -> 108k tasks/s, at 4 workers 105k -> 108k (16 against 4: 0.73x -> 1.0x);
# unpinned on 2 CPUs, 76k -> 91k at 16 workers and 94k -> 115k at 4.
#
# And one thing more: an answer due on a channel kept out of the manager's set (NOTE [ A
# channel kept out ], in _lending) is read by nobody unless someone waits for that very task,
# so when a task is queued while such a channel holds tasks, the manager is asked to take it
# back. Without that, ten tasks submitted after a round trip on a one-worker pool, the last
# one waited for, took 40 ms (the manager's periodic look) instead of 0.5 ms.


class Scheduling(CoreBase):
    """Handing pending tasks to workers, and taking back what a slow worker has not started."""

    def _queue(self, task: Task | None) -> None:
        """Queue ``task`` (submit lock held) and see that it is handed out (see NOTE [ Who
        hands out a queued task ])."""
        if task is not None:
            self._pending.append(task)
        if self.policy.starts_on_call and not any(
            s.stop_reason is None and not s.dead for s in self._slots
        ):
            self._dirty = True  # the manager starts a new process for it
            self.wake()
        if len(self._pending) > 1:
            return  # it was asked for when the first of them was queued
        kept_out = False
        for s in self._slots:
            if s.usable and not s.outstanding:
                self._dispatch_wanted = True  # an idle worker: the dispatch now
                return
            kept_out = kept_out or (s.kept_out and bool(s.outstanding))
        if kept_out:
            self.want_back()  # their answers make room: the manager is to read them

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
                slot.retire()
                self._dirty = True
                self.wake()
        try:
            if self.byvalue is not None:
                self.byvalue.define(slot)  # what it needs of the functions sent by value
            slot.proc.conn.send_bytes(task.payload)
        except (OSError, ValueError):
            task.delivered = False  # the worker is gone: its death reschedules it
        if slot.kept_out and (task.timeout is not None or task.stream is not None):
            self._put_back(slot)  # the manager reads it: see NOTE [ A channel kept out ]
        return True

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
        fewest = 0  # what ``best`` holds
        now = 0.0
        held = 0
        size = task.size
        balances = self.policy.balances
        max_tasks = self.max_tasks
        for slot in self._slots:
            n = len(slot.outstanding)
            held += n
            # the cheapest looks first: at many workers, most of them hold all they may, and
            # one that holds no fewer than the best so far cannot be better
            if n and (n >= slot.cap or (best is not None and n >= fewest)):
                continue
            if n and slot.out_bytes + size > PIPE_ROOM:
                continue
            if not slot.usable or slot.revoking:
                continue
            if n and balances:
                now = now or time.monotonic()
                if now > slot.head_since + slot.slow_after:
                    continue  # nothing more behind a task that runs long
            if max_tasks is not None and slot.sent >= max_tasks:
                continue
            if not n:
                return slot  # idle: none is less busy, and any share lets it take one
            best, fewest = slot, n
        if best is not None and fewest >= self._share(queued, held):
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
            if slot.kept_out:
                self._put_back(slot)  # the manager reads it: see NOTE [ A channel kept out ]

    def _take_for(self, slot: Slot) -> list[Task]:
        """Move the pending tasks that ``slot`` has room for into its queue (lock held): one
        frame's worth, of tasks that share a frame format (map items of one function, or
        whole tasks)."""
        batch: list[Task] = []
        nbytes = 0
        outstanding = slot.outstanding
        pending = self._pending
        room = slot.cap
        if len(pending) < self._n * room:  # else its share is its cap, whatever the others hold
            held = sum(len(s.outstanding) for s in self._slots)
            room = min(room, self._share(len(pending), held))
        room = max(1, room - len(outstanding))
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
                slot.retire()
                self._dirty = True
                self.wake()
                break
        return batch

    def _busy(self, slot: Slot, task: Task) -> None:
        """``slot`` was idle and has ``task`` now: its deadline and RSS samples start. The
        manager is woken when it would not know of them: it sleeps without a deadline, or past
        the next sample's, only once every worker has been idle for ``RSS_LINGER`` seconds (so
        calls that come now and then do not each wake it)."""
        now = time.monotonic()
        slot.head_since = now
        if now - slot.active_at >= RSS_LINGER:
            slot.last_rss_sample = now  # a new series of samples, the first one period away
        slot.active_at = now
        self._timers = True
        if task.timeout is not None or self._sleep_until > now + RSS_PERIOD:
            self.wake()

    # -- taking queued tasks back from a slow worker --

    def _may_steal(self, slots: list[Slot]) -> bool:
        """Whether an idle worker waits while nothing is pending (a pool's only)."""
        return (
            self.policy.balances
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
        return slot.working and not slot.revoking and len(slot.outstanding) > 1

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
                slot.retire()
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
