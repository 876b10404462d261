"""What a worker sent: its answers, in order, then its death.

Whoever holds a worker's read lock (the manager, or a caller lent the channel: see
:mod:`._lending`) drains its data channel: each answer sets the future of the task at the head
of the worker's queue (a worker runs its tasks in the order sent), and after the last answer
``WriterDied`` reports its death (see :mod:`._failures`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import pickle
import threading
import time
from typing import Any

from ..errors import ReadTimeout, WriterDied
from . import _shm
from ._corebase import CoreBase
from ._lifecycle import State
from ._protocol import END, ERROR, ITEM, RECYCLE, RESULT, RETURN
from ._slot import Slot
from ._tasks import _END
from .errors import TaskUnpicklingError, WorkerCancelled, WorkerError, init_error, revive

_PARTIAL_WAIT = 1.0  # the manager waits this long for the rest of a frame that has started


class Answers(CoreBase):
    """Reading a worker's data and health channels."""

    def _drain(self, slot: Slot) -> None:
        """Handle every message the worker has sent (its death last, after them). The caller
        holds ``slot.reader``."""
        conn = slot.proc.conn
        answered = 0
        handle = self._handle
        _shm.set_receiving(slot.shm)
        try:
            while True:
                try:
                    msg = conn.recv(timeout=_PARTIAL_WAIT)
                except ReadTimeout:
                    self._version += 1  # mid-frame: wait on wherever the rest will come from
                    return
                except (EOFError, OSError):
                    raise
                except BaseException as exc:  # noqa: BLE001 - see _unreadable
                    if not isinstance(exc, Exception) and threading.get_ident() != self._manager_id:
                        raise  # a caller's Ctrl-C, perhaps: see _serve
                    answered += self._unreadable(slot, exc)
                else:
                    answered += handle(slot, msg)
                if not conn._has_buffered():
                    if conn._pending_bulk_fd is not None or slot.partial:
                        slot.partial = conn._pending_bulk_fd is not None
                        self._version += 1
                    return
        except WriterDied as died:
            if answered:
                self._progress_at = time.monotonic()  # before its death counts
            self._on_death(slot, died)
        except (EOFError, OSError) as exc:
            if answered:
                self._progress_at = time.monotonic()
            self._on_death(slot, None, reason=f"its channel failed: {exc}")
        finally:
            _shm.set_receiving(None)
            if slot.shm.returned and not slot.dead:
                with contextlib.suppress(OSError, ValueError):
                    conn.send_bytes(pickle.dumps((RETURN, slot.shm.take_returned())))
            if answered:
                self._answered(slot, answered)

    def _answered(self, slot: Slot, answered: int) -> None:
        """``slot``'s worker answered ``answered`` tasks: its timing, and the manager's looks
        that its new state calls for."""
        # Timing once a batch of answers: the time per task (which sets how far ahead
        # a worker is fed), when the new head task started, and now and then the RSS.
        now = time.monotonic()
        per_task = (now - slot.head_since) / answered
        self._progress_at = now
        slot.timed(per_task)
        slot.head_since = slot.active_at = now
        if not slot.outstanding and self.policy.balances and not self._pending:
            for other in self._slots:
                if len(other.outstanding) > 1:
                    # Idle now, while another worker holds tasks it has not started: the
                    # manager looks at taking them over (see NOTE [ Feeding ahead and
                    # balance ]); woken for it when a caller read this.
                    self._timers = True
                    if threading.get_ident() != self._manager_id:
                        self.wake()
                    break
        if slot.outstanding and threading.get_ident() != self._manager_id:
            # Read by a caller: the manager sleeps until the deadline it knew of; a
            # new head task with a shorter one must wake it.
            head = slot.outstanding[0]
            if head.timeout is not None and now + head.timeout < self._sleep_until:
                self.wake()

    def _unreadable(self, slot: Slot, exc: BaseException) -> int:
        """A frame of ``slot``'s worker could not be unpickled here (a class this process
        cannot import, a ``__reduce__`` that raises in the parent): whole, but unreadable.
        Answers come in order, so it belonged to the task at the head: that task fails, the
        others go on. Returns 1 when that was the task's answer."""
        task = slot.outstanding[0] if slot.outstanding else None
        if task is None:
            raise WorkerError(
                f"worker {slot.proc.name} sent a message that could not be "
                f"read, with no task due: {type(exc).__name__}: {exc}"
            ) from exc
        what = "an item" if task.stream is not None else "the result"
        err = TaskUnpicklingError(
            f"{what} of {task.name} (task {task.tid}) from worker {slot.proc.name!r} could not "
            f"be unpickled in this process: {type(exc).__name__}: {exc}"
        )
        err.__cause__ = exc
        task.fail(err)
        if task.stream is not None:
            # An item (the end and errors always read): the stream stays due until its end,
            # which its generator, stopped now, sends.
            self.health_notify(slot, "stop", task.tid)
            return 0
        slot.outstanding.popleft()
        slot.done_bytes += task.size
        self._cancelled.discard(task.tid)
        return 1

    def _drain_health(self, slot: Slot) -> None:
        conn = slot.proc.health
        try:
            while conn.poll(0):
                reply = conn.recv()
                with self._lock:
                    fut = slot.health_waiters.pop(reply[1], None)
                if fut is not None and not fut.done():
                    fut.set_result(reply[2])
        except (EOFError, OSError):
            with self._ep_lock:  # at its end: wait on it no more
                slot.health_eof = True
                if self._owners.pop(conn.fileno(), None) is not None:
                    self._poller.unregister(conn.fileno())  # type: ignore[union-attr]
            if not slot.dead and slot.reader.acquire(False):  # else its reader sees the death
                try:
                    self._drain(slot)  # the data channel tells how it died
                finally:
                    slot.reader.release()

    def _handle(self, slot: Slot, msg: Any) -> int:
        """Act on one message of ``slot``'s worker; returns 1 for an answer to a task."""
        kind = msg[0]
        if kind == RESULT or kind == ERROR or kind == END:
            self._answer(slot, kind, msg)
            return 1
        if kind == ITEM:
            task = slot.outstanding[0]
            slot.head_since = time.monotonic()
            if task.stream is not None:
                task.stream.put(msg[2])
        elif kind == RECYCLE:
            # Past max_rss after a task: it runs no task it was sent after that one (msg[2]
            # on), and closes once it answered the rest. Those run elsewhere.
            self._requeue(slot, msg[2], None, retire=True)
            self._dirty = True
            self.wake()  # when a caller read it
        elif kind == "ready":
            slot.mark_ready()
            self._timers = True  # an idle worker (see _steal)
            slot.proc.sample_rss()  # its initializer may have moved it to another cgroup
            slot.last_rss_sample = time.monotonic()
        elif kind == "init-failed":
            err = init_error(slot.proc, msg[1], msg[2])
            slot.stop("initializer failed")
            self._break(err)
        else:
            raise WorkerError(f"unexpected message {kind!r} from worker {slot.proc.name}")
        return 0

    def _answer(self, slot: Slot, kind: int, msg: Any) -> None:
        """The answer ``msg`` (RESULT, ERROR or END) to the task at the head of ``slot``."""
        # No lock: only the dispatcher appends to ``outstanding`` (deque operations are
        # atomic) and only the holder of ``slot.reader`` pops it and counts answered
        # bytes. Popped once its future is set: cut short in between (a caller's Ctrl-C),
        # the task is still there for the report.
        task = slot.outstanding[0]
        if task.tid != msg[1]:
            raise WorkerError(
                f"worker {slot.proc.name} answered task {msg[1]} while task {task.tid} was due"
            )
        if kind == RESULT:
            if self._cancelled and task.tid in self._cancelled:
                self._cancelled.discard(task.tid)
                task.fail(WorkerCancelled(f"task {task.tid} was cancelled"))
            else:
                try:
                    task.future.set_result(msg[2])
                except concurrent.futures.InvalidStateError:
                    pass  # it failed already (its deadline passed, it was cancelled)
        elif kind == ERROR:
            self._cancelled.discard(task.tid)
            task.fail(revive(msg[2], executor=self.policy.executor))
        else:
            self._cancelled.discard(task.tid)
            if task.stream is not None:
                task.stream.put(_END)
            if not task.future.done():
                with contextlib.suppress(concurrent.futures.InvalidStateError):
                    task.future.set_result(None)
        slot.outstanding.popleft()
        slot.done_bytes += task.size
        task.payload = b""  # answered: its pickled call and function are not kept
        task.fn = None
        if not slot.outstanding and slot.state is State.RETIRING:
            self._dirty = True  # its last answer: the manager closes it (_maintain)
            self.wake()  # when a caller read it

    # -- deaths, deadlines, replacement --
