"""A caller reading its own answer: the worker's channel lent to the thread that waits.

Answers are read by whoever holds a worker's read lock. That is the manager thread, except
while a caller waits in ``Future.result()`` for a task that worker holds: the caller then takes
the worker's data channel out of the manager's epoll set and reads it itself (setting the
futures of any other task answered meanwhile), and hands it back when its own answer came. A
round trip then costs the worker's hop and nothing else: no wake-up of the manager, no second
hand-off from the manager to the caller. A caller that finds the lock taken (another caller or
the manager reads that worker) waits on its future as before. Anything that completes a task
from outside (its deadline, a cancel, a shutdown) pokes the reading caller's eventfd, so it
never waits on a channel for an answer that has already been given.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
from typing import Any

from .. import _spin
from ._corebase import _DATA, CoreBase
from ._poller import EPOLL_IN, LEND_DEPTH
from ._slot import Slot
from ._tasks import _PENDING_STATES, _Future, _reading
from .errors import WorkerError

# NOTE [ A caller's spin ]
#
# A caller that finds no answer on the channel it was lent looks again without sleeping (a
# poll() that does not wait) for up to SPIN seconds before it sleeps in poll(), when its waits on
# that worker have lately been shorter than SPIN on average (``Slot.caller_waited``, kept by
# ``_spin.next_average`` as the pure-Python engine keeps a read's) and this process may spin
# at all (``_spin.may_spin``: two CPUs or more). In a round trip on an idle pool the worker
# answers a few microseconds after the caller's write, while the caller takes its channel from
# the manager; a caller asleep by then is woken by the worker's write, which costs both of them
# (on a VM, the worker's send was 15% of its samples).
# Unlike a read of the engines, the spin does not yield the CPU between looks: on a loaded
# machine a sched_yield() hands it to any other runnable process for a whole time slice, and the
# caller waits that long for its answer. Measured on a 2-CPU VM, alternating rounds of 1,000
# trips in one process (medians of 5 rounds, three runs): quiet, 33.4-36.4 us with the spin,
# 34.9-40.9 us without; beside 3 CPU hogs, medians 40-60 us either way and means 130-180 us
# with, 146-165 us without. Waits for longer tasks push the average past SPIN: the caller then
# sleeps at once, as before.

# NOTE [ A channel kept out ]
#
# Lending a channel takes its data fd out of the manager's epoll set and the take-back puts it
# in again: two epoll_ctl calls and their locking in every round trip, about a tenth of one on
# an idle pool. A caller that gives back a channel whose worker holds no task leaves it out
# instead (``Slot.kept_out``), and the next caller lent it finds it out already. While it is
# out nothing is lost: the worker's death still wakes the manager (its pidfd stays in the
# set, and the manager reads the channel to its end), and a task sent to that worker gets its
# answer read by whoever waits for it:
#
# - a caller in ``result()`` or ``exception()`` is lent the channel, as ever;
# - anything else that waits for a future, or looks at it, makes its condition or calls
#   ``done()`` first (``concurrent.futures.wait``, ``as_completed``, a done-callback, asyncio,
#   ``cancel()``, ``running()``): the future then asks the manager for the channel back
#   (``want_back``: a flag and a wake-up, no lock);
# - a task that has a deadline or streams its items, or is sent from the queue (a batch, a
#   map's items), puts the channel back as it is sent; shutdown and cancel_all ask for every
#   channel kept out whose worker holds a task;
# - a worker that may write after its answer (a RECYCLE, once past ``max_rss``) never has its
#   channel kept out: that message is read at once, and the worker replaced while it is idle;
# - and the manager, which wakes every RSS_PERIOD while a worker holds a task (a task sent
#   while it sleeps longer than that wakes it: Scheduling._busy), puts back any channel kept out
#   whose worker holds one (and reads its answer before it looks at that task's deadline): a
#   future nobody looks at still completes, within that period.
#
# Those that send a task or look at a future check ``kept_out`` without a lock, after the task
# is in ``outstanding``; a take-back sets it, then looks at ``outstanding`` once more and puts
# the channel back if a task came meanwhile: whichever comes first, one of them sees the other.
#
# Measured on a 2-CPU VM, 20 alternating blocks of 1,000 round trips in one process, the
# channel given back as before or kept out (medians of the blocks): 21.5, 22.3 and 21.6 us ->
# 20.5, 20.9 and 20.7 us in three runs while the machine was quiet; 33.9 -> 32.8 and 36.7 ->
# 34.1 us in slower phases.


class Lending(CoreBase):
    """Lending a worker's data channel to the caller that waits for its answer."""

    def wait_for(self, fut: _Future, timeout: float | None) -> float | None:
        """Read the answers of the worker ``fut``'s task was sent to in this thread until
        ``fut`` is done, ``timeout`` seconds passed, or the channel cannot be lent now (another
        thread reads it, the task has not been sent yet, the worker died). Returns the time
        left of ``timeout``, for the wait on the future itself."""
        me = threading.get_ident()
        if me == self._manager_id or _reading.slot is not None:
            return timeout  # the manager, or a callback run by a reading caller: never nest
        deadline = None if timeout is None else time.monotonic() + timeout
        slot = fut._slot
        while slot is not None and fut._state in _PENDING_STATES:
            try:
                if not self._lend(slot, me):
                    break
                _reading.slot = slot
                self._serve(slot, fut, deadline)
                # see NOTE [ Spinning while the pool is idle ] (in _submitting)
                self._caller_read = True
            finally:
                _reading.slot = None
                if slot.lent == me:
                    self._take_back(slot)
            if fut._slot is slot or (deadline is not None and time.monotonic() >= deadline):
                break
            slot = fut._slot  # it died and the task went to another worker: read that one
        return None if deadline is None else max(0.0, deadline - time.monotonic())

    def _lend(self, slot: Slot, me: int) -> bool:
        """Take ``slot``'s channel from the manager (its data fd out of the epoll set) for
        thread ``me``."""
        if (
            slot.dead
            or slot.lent
            or len(slot.outstanding) > LEND_DEPTH
            or not slot.reader.acquire(False)
        ):
            return False
        try:
            with self._ep_lock:
                conn = slot.proc.conn
                if (
                    slot.dead
                    or slot.partial
                    or self._closed_poller()
                    or slot.poke_fd < 0
                    or conn._pending_bulk_fd is not None
                    or conn._liveness_fd is None
                ):
                    return False
                slot.lent = me  # from here on, the caller's take_back releases the lock
                # Its data fd only: the pidfd stays with the manager, which takes it out too if
                # the worker dies meanwhile (see _step).
                fd = conn.fileno()
                if slot.kept_out:
                    slot.kept_out = False  # out of the set already: see NOTE [ A channel kept out ]
                else:
                    try:
                        self._poller._ep.unregister(fd)  # type: ignore[union-attr]
                    except (KeyError, OSError, ValueError):
                        pass
                slot.out_fds = [fd]
                return True
        finally:
            if not slot.lent:
                slot.reader.release()

    def _take_back(self, slot: Slot) -> None:
        """Give ``slot``'s channel back to the manager; or, when its worker holds no task,
        keep it out of the manager's set until one is sent (see NOTE [ A channel kept out ])."""
        with self._ep_lock:
            slot.lent = 0
            slot.stale = True
            out, slot.out_fds = slot.out_fds, []
            if not slot.dead and not self._closed_poller():
                conn = slot.proc.conn
                bulk = conn._pending_bulk_fd
                if (
                    not slot.outstanding
                    and self._may_keep_out
                    and bulk is None
                    and out == [conn.fileno()]
                ):
                    slot.kept_out = True
                    # A task sent meanwhile by a thread that looked at kept_out before it was
                    # set (they look without a lock, after they appended): it is read by the
                    # manager. One appended after this look sees kept_out set.
                    if not slot.outstanding:
                        slot.reader.release()
                        return
                    slot.kept_out = False
                ep: Any = self._poller._ep  # type: ignore[union-attr]
                if bulk is not None:  # a payload is pending: wait on the bulk socket instead
                    data = conn.fileno()
                    out = [bulk if fd == data else fd for fd in out]
                    self._owners.setdefault(bulk, (slot, _DATA))
                for fd in out:
                    try:
                        ep.register(fd, EPOLL_IN)
                    except (OSError, ValueError):
                        pass  # (FileExistsError: a rebuild put it back already)
            slot.reader.release()

    def _serve(self, slot: Slot, fut: _Future, deadline: float | None) -> None:
        """Read ``slot``'s answers until ``fut`` is done (or the deadline, a poke, the
        worker's death, a frame whose payload lags)."""
        conn = slot.proc.conn
        poller = slot.help_poller
        if poller is None:
            poller = slot.help_poller = select.poll()
            for fd in (conn.fileno(), conn._liveness_fd, slot.poke_fd):
                poller.register(fd, select.POLLIN | select.POLLPRI)
        poke = slot.poke_fd
        while fut._state in _PENDING_STATES and not slot.dead and fut._slot is slot:
            if not conn._has_buffered():
                events = poller.poll(0)
                if not events:
                    events = self._wait_answer(slot, poller, deadline)
                    if not events:
                        return
                if len(events) == 1 and events[0][0] == poke:
                    with contextlib.suppress(OSError):
                        os.eventfd_read(poke)
                    continue
            try:
                self._drain(slot)
            except BaseException as exc:
                # A signal handler raised (Ctrl-C) while an answer was being handled: it may
                # be lost, and the channel's place in its stream of answers with it.
                self._interrupted(slot, exc)
                raise
            if self._pending:
                self.kick()  # answers make room
            if slot.partial or conn._pending_bulk_fd is not None:
                return  # the manager waits for the rest of the frame on the bulk socket

    @staticmethod
    def _wait_answer(slot: Slot, poller: Any, deadline: float | None) -> list[tuple[int, int]]:
        """Wait until ``slot``'s channel (or its liveness fd, or the poke) is readable, after a
        spin when that pays (see NOTE [ A caller's spin ]); nothing when the deadline passed
        first."""
        monotonic = time.monotonic
        begun = monotonic()
        events: list[tuple[int, int]] = []
        if slot.caller_waited < _spin.SPIN and _spin.may_spin():
            until = begun + _spin.SPIN
            if deadline is not None and deadline < until:
                until = deadline
            while not events and monotonic() < until:
                events = poller.poll(0)
        if not events:
            if deadline is None:
                events = poller.poll()
            else:
                left = deadline - monotonic()
                if left <= 0:
                    return []
                events = poller.poll(left * 1000.0)
        if events:  # (a poke counts too: it ended the wait)
            slot.caller_waited = _spin.next_average(slot.caller_waited, monotonic() - begun)
        return events

    def _interrupted(self, slot: Slot, exc: BaseException) -> None:
        """A caller's read of ``slot`` was cut short by an exception: no answer of that worker
        can be trusted to match its task any more. Its tasks fail, it is stopped (SIGKILL)
        and replaced."""
        reason = (
            f"the thread reading its answers was interrupted by {type(exc).__name__}, "
            "so it was stopped"
        )
        with self._lock:
            slot.stop("interrupted")
            tasks = list(slot.outstanding)
            slot.outstanding.clear()
            slot.done_bytes = slot.sent_bytes
        err = WorkerError(
            f"worker {slot.proc.name!r} (pid {slot.proc.pid}): {reason}; "
            "its tasks may or may not have run"
        )
        for task in tasks:
            task.fail(err)
        slot.proc.kill()
        self._on_death(slot, None, reason=reason)

    # -- channels kept out ---------------------------------------------------------------------

    def _put_back(self, slot: Slot) -> None:
        """``slot``'s channel, kept out, back in the manager's set (unless a caller reads it
        now: it puts it back itself once it finds a task there). Never called with ``_lock``
        held (``_ep_lock`` is taken first where both are)."""
        with self._ep_lock:
            if not slot.kept_out or slot.lent:
                return
            slot.kept_out = False
            if slot.dead or self._closed_poller():
                return
            with contextlib.suppress(OSError, ValueError):  # (FileExistsError: rebuilt)
                self._poller._ep.register(slot.proc.conn.fileno(), EPOLL_IN)  # type: ignore[union-attr]

    def want_back(self) -> None:
        """The manager is to put every channel kept out back in its set: a future whose task
        one holds is waited on some other way than by a caller reading it (a condition, a
        done-callback, ``done()``), or the pool shuts down or cancels. Takes no lock."""
        if not self._want_back:
            self._want_back = True
            self.wake()

    def _put_back_all(self) -> None:
        """(Manager thread.) Every channel kept out whose worker holds a task back in the set
        (one that holds none may stay out: nothing is due on it)."""
        with self._lock:
            slots = list(self._slots)
        for slot in slots:
            if slot.kept_out and slot.outstanding:
                self._put_back(slot)

    # -- the manager thread -----------------------------------------------------------------

    def _park(self, slot: Slot, fd: int) -> None:
        """Take ``fd`` out of the set while a caller reads ``slot`` (a readable fd nobody
        reads would wake this thread again and again); its take_back puts it back."""
        with self._ep_lock:
            if slot.lent and fd not in slot.out_fds and not self._closed_poller():
                self._poller.unregister(fd)  # type: ignore[union-attr]
                slot.out_fds.append(fd)

    @staticmethod
    def _still_readable(slot: Slot) -> bool:
        """After a caller read the channel, whether the event the manager holds is still true
        (the caller may have read what it announced; a read would then wait)."""
        slot.stale = False
        conn = slot.proc.conn
        return bool(conn._has_buffered() or conn.poll(0))
