"""Deaths, deadlines and a broken pool: what a crash fails, and when the core gives up.

See NOTE [ Crashes blamed on tasks ] (a pool) and NOTE [an actor's crash] below.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import signal
import threading
import time
from typing import Any

from ..errors import WriterDied
from ._corebase import CoreBase
from ._slot import Slot
from ._tasks import Task
from .errors import PoolBroken, TaskTimeout, WorkerCrashed, start_error

STACK_WAIT = 1.0  # seconds to wait for a worker's stack dump at a deadline
_REAP_DELAY = 0.001  # a dead worker is reaped (and replaced) this long after its report

# NOTE [an actor's crash]: calls made against a crashed actor's state never run on its
# replacement. From the death's first moment (_on_death) until a caller is handed the
# crash (crash_seen), every call made fails with it: held while the error is built
# (_crash_hold), then failed at once (_unseen_crash). A call made once a caller has
# seen it starts a new process. Submit lock held to read or change either.


class Failures(CoreBase):
    """A worker's death, a task's deadline, a crash loop."""

    def _on_death(self, slot: Slot, died: WriterDied | None, reason: str | None = None) -> None:
        """``slot``'s worker died (or its channel failed): the task it ran fails or runs again,
        the rest fail or go to other workers, as the policy says; it is reaped (and replaced)
        on the loop's next turn."""
        # an actor's crash: calls made from now on wait for its error (NOTE [an actor's crash])
        crash = self.policy.crash_fails_queued and slot.stop_reason is None and not self.closing
        took = self._take_from_dead(slot, crash)
        if took is None:
            return  # seen dead already
        starting, orphans, queued, waiters = took
        expected = slot.stop_reason is not None or (slot.retiring and not orphans)
        head = orphans[0] if orphans and orphans[0].delivered else None
        err = slot.proc.crash_error(
            died,
            head.name if head else None,
            head.tid if head else None,
            reason or slot.crash_reason,
            starting=starting,
        )
        if crash:
            queued = self._hold_crash(err, orphans, queued)
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
        elif self.policy.crash_fails_queued:
            self._fail_stopped_actor(slot, orphans, err)
        else:
            self._run_again(orphans)
        self._after_death(slot, err, starting, expected)

    def _take_from_dead(
        self, slot: Slot, crash: bool
    ) -> tuple[bool, list[Task], list[Task], list[concurrent.futures.Future[Any]]] | None:
        """Mark ``slot`` dead and take what it held: (whether it died starting, its tasks, the
        calls queued that an actor's ``crash`` fails, its health requests); None when it was
        dead already."""
        with self._submit_lock if crash else contextlib.nullcontext(), self._lock:
            if slot.dead:
                return None
            queued = []
            if crash:
                queued = list(self._pending)  # made before the death: they fail with it
                self._pending.clear()
                self._crash_hold = []
            starting = not slot.said_ready
            slot.die()
            self._version += 1
            self._dirty = True
            orphans = list(slot.outstanding)
            slot.outstanding.clear()
            slot.done_bytes = slot.sent_bytes
            waiters = list(slot.health_waiters.values())
            slot.health_waiters.clear()
        return starting, orphans, queued, waiters

    def _hold_crash(
        self, err: WorkerCrashed, orphans: list[Task], queued: list[Task]
    ) -> list[Task]:
        """The actor's state is gone: the calls queued here behind the ones it held fail too,
        and so do those made since, until a caller is handed the crash (NOTE [an actor's
        crash]); a crash that failed no call (an idle worker died) holds none. Returns the
        calls to fail."""
        with self._submit_lock, self._lock:
            held, self._crash_hold = self._crash_hold or [], None
            if orphans or queued:
                self._unseen_crash = err  # before any caller can be handed it
                queued += held
            else:
                self._pending.extend(held)
                self._queue(None)
        return queued

    def _fail_stopped_actor(self, slot: Slot, orphans: list[Task], err: WorkerCrashed) -> None:
        """A stopped actor (a passed deadline): the calls queued by the time the deadline
        passed fail with it; later calls start a new process."""
        with self._submit_lock, self._lock:
            cut = self._newest_pending() if slot.stop_reason is None else slot.cut_tid
            queued = (
                [] if self.closing or cut is None else [t for t in self._pending if t.tid <= cut]
            )
            for task in queued:
                self._pending.remove(task)
        for task in orphans + queued:
            task.fail(err)

    def _run_again(self, orphans: list[Task]) -> None:
        """A pool's: the tasks a dead worker held go to the front of the queue, unless the
        pool gave up (then nothing runs again)."""
        with self._lock:
            broken = self.broken
            if broken is None:
                for task in reversed(orphans):
                    if not task.future.done():  # (one a timeout failed already)
                        task.delivered = False
                        self._pending.appendleft(task)
        if broken is not None:
            for task in orphans:
                task.fail(broken)

    def _after_death(self, slot: Slot, err: WorkerCrashed, starting: bool, expected: bool) -> None:
        """Count the crash (or break: a worker that died starting), hand out what waits, and
        have the dead worker reaped."""
        if starting and not expected and not self.closing:
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
            self.policy.retries(len(crashes))
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
        window = self.policy.restart_window
        while times and (now - times[0] > window or times[0] < self._progress_at):
            times.popleft()
        if self.policy.crash_loop(len(times)):
            self._break(
                PoolBroken(
                    f"{self.name}: {len(times)} workers crashed in a row with no task finished "
                    f"between them (max_restarts={self.policy.max_restarts}): a crash loop; "
                    "giving up",
                    self.crashes,
                )
            )

    def expire(self, slot: Slot, task: Task, timeout: float, what: str) -> None:
        """The deadline ladder: take the stack, fail the task with it, SIGTERM the worker's
        group, SIGKILL it ``kill_grace`` later; a replacement starts now."""
        with self._submit_lock, self._lock:
            if slot.stop_reason is not None or slot.dead:
                return
            slot.stop(f"{what} timeout")
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

    def _break(self, exc: BaseException) -> None:
        exc = self.policy.broken(self.name, exc)  # a pool's: PoolBroken, a BrokenExecutor
        with self._submit_lock, self._lock:
            if self.broken is None:
                self.broken = exc
            pending = list(self._pending)
            self._pending.clear()
            victims = [t for s in self._slots for t in s.outstanding]
        for task in pending + victims:
            task.fail(exc)
        for slot in list(self._slots):
            if slot.stop_reason is None:
                slot.stop("broken")
                slot.proc.signal_group(signal.SIGTERM)
                slot.kill_at = time.monotonic() + self.kill_grace
                self._timers = True
        self.wake()

    # -- cancelling --
