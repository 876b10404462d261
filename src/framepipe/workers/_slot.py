"""The manager's record of one worker process: what it holds, how fast it goes, who reads it.

A :class:`Slot` holds the worker's process, the tasks sent to it and not answered yet (in the
order sent: the head is the one it runs), the bytes it owes, its recent time per task (which
sets how far ahead it is fed, see NOTE [ Feeding ahead and balance ] in :mod:`._scheduling`),
its deadlines, and who reads its data channel now (the manager, or a caller lent it: see
:mod:`._lending`).
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import os
import threading
from typing import Any

from . import _shm
from ._lifecycle import Lifecycle, State
from ._process import WorkerProcess
from ._tasks import Task

MAX_INFLIGHT = 128  # tasks sent to one worker before its first answer
QUEUE_SECONDS = 0.002  # a worker is given about this much work ahead
# A task at the head of a worker's queue that runs this long (or 4 times the worker's recent
# time per task, if longer) makes its worker slow: it is given nothing more until it answers,
# and while another worker is idle, the tasks queued behind it are taken back (see _steal).
SLOW_HEAD = 0.01
# A worker idle while nothing is pending takes over the tasks another worker holds but has not
# started, once that worker's head task has run this long (or its queue would take this long
# at its recent time per task). See NOTE [ Feeding ahead and balance ].
STEAL_AFTER = 0.001
RSS_PERIOD = 0.05  # a busy worker's peak RSS (and memory cgroup) is read this often
RSS_LINGER = 1.0  # the manager's samples go on this long after a worker's last work


def _cap(avg: float) -> int:
    """The tasks a worker taking ``avg`` seconds a task is given ahead: QUEUE_SECONDS of them,
    at least 2 and at most MAX_INFLIGHT."""
    return max(2, min(MAX_INFLIGHT, int(QUEUE_SECONDS / max(avg, 1e-7))))


def _slow_after(avg: float) -> float:
    """How long a head task runs before its worker is slow (see SLOW_HEAD)."""
    return max(SLOW_HEAD, 4.0 * avg)


class Slot(Lifecycle):
    """The manager's view of one worker. Its ``state`` (see :mod:`._lifecycle`) is STARTING
    until the worker says it is ready, READY while it may be given work (idle or not: what it
    holds is ``outstanding``; a slot does not use BUSY), RETIRING once it is given nothing more
    (``max_tasks_per_worker``, ``max_rss``: closed once it has answered everything), STOPPING
    once we asked it to exit (``stop_reason`` says why: its death is then no crash), DEAD once
    the manager saw it die. RETIRING never goes back to READY: a retired worker is replaced by
    a new one."""

    def __init__(self, proc: WorkerProcess, index: int, shm: _shm.Receiver) -> None:
        super().__init__()
        self.proc = proc
        self.index = index
        self.shm = shm
        self.outstanding: collections.deque[Task] = collections.deque()
        self.sent_bytes = 0  # written by the dispatcher only
        self.done_bytes = 0  # written by the manager only
        self.said_ready = False  # it reported ready once (stays true once it stops or dies)
        self.died_in: State | None = None  # the state it was in when it died
        self.stop_reason: str | None = None  # why we are stopping it (its death is no crash)
        self.revoking = False  # it was asked for its queued tasks back (see Scheduling._steal)
        self.cut_tid: int | None = None  # see Failures.expire and _on_death (actors)
        self.steal_look = 0.0  # not asked for its queue again before this (see _steal)
        self.kill_at: float | None = None
        self.sent = 0
        self.head_since = 0.0
        self.avg = 0.001  # its recent time per task, a moving average (see timed)
        self.cap = _cap(self.avg)  # the tasks it may hold: see NOTE [ Feeding ahead and balance ]
        # it is slow once its head task has run this long: given nothing more (see SLOW_HEAD)
        self.slow_after = _slow_after(self.avg)
        self.usable = False  # it may be given work: READY (kept by ``to``, read at every dispatch)
        self.spins = False  # its reads may spin between tasks (see NOTE [ Which workers spin ])
        self.stderr_eof = False
        self.partial = False
        self.health_waiters: dict[int, concurrent.futures.Future[Any]] = {}
        self.last_rss_sample = 0.0
        self.active_at = -RSS_LINGER  # when it last had work (see Scheduling._busy)
        self.crash_reason: str | None = None
        self.health_eof = False
        # Reading the data channel: whoever holds ``reader`` (the manager, or a caller that
        # took the channel out of the manager's fd set: ``lent`` is then that thread's id).
        # ``stale``: the manager's next event for it may predate the caller's last read.
        self.reader = threading.Lock()
        self.lent = 0
        self.stale = False
        self.poke_fd = -1  # a caller reading this channel also waits on this eventfd
        self.out_fds: list[int] = []  # its fds out of the manager's set while it is lent
        # its data fd stays out of the manager's set between two round trips (see NOTE [ A
        # channel kept out ] in _lending)
        self.kept_out = False
        self.help_poller: Any = None
        # how long a caller reading this channel waited for an answer, a moving average (see
        # NOTE [ A caller's spin ] in _lending)
        self.caller_waited = 0.0

    def poke(self) -> None:
        if self.poke_fd >= 0:  # (none where callers never read a channel: no LEND)
            with contextlib.suppress(OSError):
                os.eventfd_write(self.poke_fd, 1)

    def close_poke(self) -> None:
        fd, self.poke_fd = self.poke_fd, -1
        self.help_poller = None
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)

    @property
    def out_bytes(self) -> int:
        """Bytes of tasks sent and not answered yet."""
        return self.sent_bytes - self.done_bytes

    # -- its lifecycle --

    def mark_ready(self) -> None:
        """It said it is ready (a worker we are stopping already stays stopping)."""
        self.said_ready = True
        if self.state is State.STARTING:
            self.to(State.READY)

    def retire(self) -> None:
        """Give it no more work; it is closed once it has answered everything."""
        if self.state is State.READY:
            self.to(State.RETIRING)

    def stop(self, reason: str) -> None:
        """We stop it, for ``reason`` (the first reason given stays): its death is no crash."""
        if self.stop_reason is None:
            self.stop_reason = reason
        if self.state is not State.DEAD:
            self.to(State.STOPPING)

    def die(self) -> None:
        """The manager saw it die."""
        if self.state is not State.DEAD:
            self.died_in = self.state
            self.to(State.DEAD)

    @property
    def dead(self) -> bool:
        return self.state is State.DEAD

    @property
    def ready(self) -> bool:
        """It said it is ready once (it may have stopped or died since)."""
        return self.said_ready

    def to(self, new: State) -> None:
        super().to(new)
        self.usable = new is State.READY

    @property
    def working(self) -> bool:
        """Ready and not asked to stop: it may be given work, or finishes what it holds."""
        return self.state is State.READY or self.state is State.RETIRING

    @property
    def retiring(self) -> bool:
        """It is retiring, or died while it was."""
        return self.state is State.RETIRING or self.died_in is State.RETIRING

    # -- feeding it --

    def timed(self, per_task: float) -> None:
        """A batch of its answers took ``per_task`` seconds a task: its average, the number of
        tasks it may hold and when its head task makes it slow (kept, not worked out at every
        look: a pool's dispatch looks at every worker's)."""
        self.avg = avg = self.avg * 0.7 + per_task * 0.3
        self.cap = _cap(avg)
        self.slow_after = _slow_after(avg)

    def steal_at(self) -> float:
        """When the tasks it holds behind its head may be taken over by an idle worker: at
        once if they are that much work at its recent time per task, else once its head task
        has run ``STEAL_AFTER``. See NOTE [ Feeding ahead and balance ]."""
        if (len(self.outstanding) - 1) * self.avg >= STEAL_AFTER:
            return self.steal_look
        return max(self.head_since + STEAL_AFTER, self.steal_look)
