"""The parent's side of a loader's workers: one record per worker (:class:`_Slot`) and
:class:`_Workers`, which starts them, hands out batches and credits, reads the replies and
reports failures."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import mmap
import multiprocessing
import os
import pickle
import socket
import threading
import time
from typing import Any

from ... import connection as _connection
from ..._spin import workers_may_spin
from ...errors import ReadTimeout, WriterDied
from ...remote import loads_exception
from .. import _atexit, _byvalue, _pin, _shm
from .._child import FdHandle
from .._lifecycle import Lifecycle, State
from .._options import ProcessOptions
from .._policy import LoaderPolicy
from .._process import WorkerProcess, register_parent_side
from ..errors import WorkerError
from . import collate, recovery
from .credits import (
    _BEACON,
    ATTENTION,
    _add_credits,
    _beacon_fd,
    _credit_fds,
)
from .errors import WorkerInitError
from .wire import (
    _ANSWERS,
    _CLOSE,
    _RESET,
    DEEP_AHEAD,
    FETCH,
    INIT_FAILED,
    KILL_GRACE,
    MANY,
    PACE,
    POST_MAX,
    PUMP_EVERY,
    RESET_DONE,
    RETURN,
    RSS_EVERY,
    STOP_GRACE,
    WAIT_SLICE,
)
from .worker import loader_loop


class _Slot(_shm.Receiver):
    """The parent's view of one worker: its place in the round robin (``id``) and what it
    holds, and the process in that place now (``proc``) with the record of that process's
    lifecycle (``life``: a :class:`~framepipe.workers._lifecycle.Lifecycle`, STARTING until
    it says it is ready, READY, then STOPPING and DEAD; a fresh process that takes a dead
    one's place, see :func:`.recovery.replace`, has a new record)."""

    __slots__ = (
        "id",
        "proc",
        "life",
        "conn",
        "credits",
        "held",
        "backlog",
        "credit",
        "owed",
        "withheld",
        "depth",
        "group",
        "exhausted",
        "outbox",
        "lock",
        "sender",
        "pinner",
        "answered",
        "wstate",
        "beacon",
    )

    def __init__(
        self,
        wid: int,
        proc: WorkerProcess,
        fdsock: socket.socket | None,
        credits: int,
        beacon: mmap.mmap | None = None,
    ) -> None:
        super().__init__(fdsock)
        self.id = wid
        self.proc = proc
        self.life = Lifecycle()
        self.conn = proc.conn
        self.credits = credits  # the parent's end of the worker's credit counter
        self.beacon = beacon  # the batch id the worker is loading (worker_crash_retries)
        self.pinner: _pin.Pinner | None = None  # arrays in shared memory are read into pinned
        # memory (see _shm._rebuild_shared)
        # an iterable dataset: batches this worker's part delivered this epoch, and the
        # dataset's state after the last of them (see NOTE [ Resuming an epoch ])
        self.answered = 0
        self.wstate: Any = None
        # batches given to the worker and not answered yet, in order: (batch id, indices)
        self.held: collections.deque[tuple[int, Any]] = collections.deque()
        self.backlog: collections.deque[Any] = collections.deque()  # replies read, not taken
        self.credit = 0  # batches it may load and send before it needs more credit
        self.owed = 0  # batches taken whose credit is not handed back yet
        self.withheld = 0  # credits to keep back (its depth shrank): the next ones taken
        self.depth = 1  # batches it may load ahead: its credits, given and owed
        self.group = 1  # credits go back when this many are owed
        self.exhausted = False  # its part of an iterable dataset has ended
        # messages waiting for a sender thread (None: no thread; see _post)
        self.outbox: collections.deque[bytes] | None = None
        self.lock = threading.Lock()
        self.sender: threading.Thread | None = None
        register_parent_side(self)  # a worker forked later closes our memfds and socket

    def close_fds(self) -> None:
        super().close_fds()
        fd, self.credits = self.credits, -1
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)
        beacon, self.beacon = self.beacon, None
        if beacon is not None:
            with contextlib.suppress(Exception):
                beacon.close()

    def loading(self) -> int | None:
        """The batch id the worker last started loading (None: no beacon, or none yet)."""
        if self.beacon is None:
            return None
        bid = int(_BEACON.unpack_from(self.beacon, 0)[0])
        return None if bid < 0 else bid

    def rebind(
        self,
        proc: WorkerProcess,
        fdsock: socket.socket | None,
        credits: int,
        beacon: mmap.mmap | None,
    ) -> None:
        """This slot's worker is now ``proc`` (the one before it died): its channels, credit
        counter and memfd pool replace the dead one's, which are closed. Arrays mapped from
        the old memfds stay valid, and their finalizers hand their memfds back to the old
        pool's list, which nobody reads any more."""
        sender = self.sender
        if sender is not None and sender.is_alive():
            sender.join(STOP_GRACE)  # its writes to the dead worker fail at once
        self.close_fds()
        self.life = Lifecycle()
        self.fdsock = fdsock
        self.memfds = []
        self.returned = collections.deque()
        self.proc, self.conn, self.credits, self.beacon = proc, proc.conn, credits, beacon
        self.backlog.clear()
        self.outbox, self.sender = None, None
        self.lock = threading.Lock()

    @property
    def state(self) -> State:
        """The lifecycle state of the process in this place now."""
        return self.life.state

    def attention(self, message: bytes | None = None) -> None:
        """Make the worker read its channel (after ``message``, posted there)."""
        if message is not None:
            _post(self, message)
        _add_credits(self.credits, ATTENTION)


def _post(slot: _Slot, data: bytes) -> None:
    """Send ``data`` to ``slot``'s worker without ever waiting on it for long.

    A worker reads its channel between batches, and may itself be blocked writing a batch
    to us: a message larger than the pipe's buffer would then wait for a reader that waits
    for us. Such a message (and every one after it, until it is out) goes through a sender
    thread of its own, while the caller goes on reading."""
    if slot.outbox is None and len(data) <= POST_MAX:
        try:
            slot.conn.send_bytes(data)
        except (OSError, ValueError):
            pass  # the worker is gone: reading its channel reports how
        return
    with slot.lock:
        if slot.outbox is not None:
            slot.outbox.append(data)
            return
        slot.outbox = collections.deque([data])
        slot.sender = threading.Thread(
            target=_send_outbox, args=(slot,), daemon=True, name=f"DataLoader-sender-{slot.id}"
        )
    slot.sender.start()


def _send_outbox(slot: _Slot) -> None:
    while True:
        with slot.lock:
            if not slot.outbox:
                slot.outbox = None
                return
            data = slot.outbox.popleft()
        try:
            slot.conn.send_bytes(data)
        except (OSError, ValueError):
            pass  # the worker is gone: reading its channel reports how


class _Workers:
    """The worker processes of one loader and everything in flight to and from them.

    A batch a worker has loaded (or is loading) and the caller has not yet taken holds one
    credit, and a worker holds ``depth`` credits: ``prefetch_factor``, or ``deep`` while its
    batches are small arrays that load fast (see :meth:`pace`); the credit a taken batch frees
    goes back to its worker (torch's round robin: the worker of batch k is that of batch
    k + its window). Credits are written one at a time while the receiving worker's batches
    are slow to load (it must never wait for one), in groups while they are fast (one write
    then wakes it for that many batches, and waking is what a fast batch costs most): of half
    its depth, so that it loads half of what it may hold while the parent takes the other
    half (of its whole depth where that is under 4). Batch ids count up over the workers'
    life; ``floor`` is the first of the current epoch.
    """

    def __init__(
        self, loader: Any, base_seed: int, resume: list[dict[str, Any] | None] | None = None
    ) -> None:
        self.base_seed = base_seed
        self.slots: list[_Slot] = []
        self.policy = LoaderPolicy.of(loader.worker_crash_retries)  # what a crash fails
        self.on_crash = loader.on_worker_crash
        self.reports = loader.crash_reports
        self.crashes: dict[int, int] = {}  # batch id -> workers that died loading it
        self.pinner = loader._pinner
        self.prefetch = loader._prefetch
        self.deep = max(loader._prefetch, DEEP_AHEAD)  # depth while they are small and fast
        self.next_bid = 0
        self.floor = 0  # the first batch id of the current epoch
        self.closed = False
        self.broken: BaseException | None = None
        self._last_pump = self._last_rss = 0.0  # the first reply samples the workers' peak RSS
        # how the workers start and stop (the start method's default: that of multiprocessing)
        ctx = multiprocessing.get_context(loader.start_method)
        if ctx.get_start_method() == "fork" and loader.collate_fn is None:
            # The default collate and convert are torch's where it is installed, so a worker
            # imports it at its first batch: over a second of CPU each, the first batch that
            # late. Imported here, once, the forked workers have it (and this process needs
            # it for the tensors they send, as torch's own loader has it before it forks).
            collate._import_torch()
        self.process = ProcessOptions(
            name="DataLoader-worker", start_method=ctx.get_start_method(), kill_grace=KILL_GRACE
        )
        self._ctx = ctx
        self.common = {
            "num_workers": loader.num_workers,
            "base_seed": base_seed,
            "dataset": loader.dataset,
            "iterable": loader._iterable,
            "batch_size": loader.batch_size if loader._auto_collation else None,
            "auto_collation": loader._auto_collation,
            "collate_fn": loader.collate_fn,
            "drop_last": loader.drop_last,
            "worker_init_fn": loader.worker_init_fn,
            # memfds per worker: room for 8 large arrays in each of its batches in flight,
            # the one being used and the one being freed (more fall back to the bulk channel)
            "shm_slots": 8 * (loader._prefetch + 2),
            "spin": workers_may_spin(loader.num_workers),
            "stateful": loader._stateful,
            "pin": loader._pinner is not None,
        }
        for key in ("dataset", "collate_fn", "worker_init_fn"):  # by value if they must
            value = self.common[key]
            what = f"the {key} ({type(value).__module__}.{type(value).__qualname__})"
            self.common[key] = _byvalue.portable(self._ctx, value, what)
        _atexit.register(self)  # stopped at exit, also in a multiprocessing child
        try:
            for wid in range(loader.num_workers):
                slot = _Slot(wid, *self.spawn(wid, None if resume is None else resume[wid]))
                slot.depth = self.prefetch
                self.pace(slot, slow=False, small=False, grant=False)  # as a worker starts
                slot.pinner = self.pinner
                self.slots.append(slot)
        except BaseException:
            self.close(grace=0.0)
            raise

    def spawn(
        self, wid: int, resume: dict[str, Any] | None
    ) -> tuple[WorkerProcess, socket.socket | None, int, mmap.mmap | None]:
        """Start worker ``wid``: its process, our end of its memfd socket, of its credit
        counter, and its beacon (with ``worker_crash_retries``)."""
        mine = theirs = None
        if _shm.HAVE_MEMFD:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fdsock = None if theirs is None else FdHandle(theirs.fileno())
        worker_end, parent_end = _credit_fds()
        beacon_fd = _beacon_fd() if self.policy.replaces_crashed else -1
        beacon = None
        try:
            if beacon_fd >= 0:
                beacon = mmap.mmap(beacon_fd, _BEACON.size)
                _BEACON.pack_into(beacon, 0, -1)
            name = f"{self.process.name}-{wid}"
            proc = WorkerProcess(
                self._ctx,
                name,
                loader_loop,
                dataclasses.replace(self.process, name=name),
                options={
                    **self.common,
                    "worker_id": wid,
                    "fdsock": fdsock,
                    "credits": FdHandle(worker_end),
                    "beacon": FdHandle(beacon_fd) if beacon_fd >= 0 else None,
                    "resume": resume,
                },
            )
            proc.start()
        except BaseException:
            os.close(parent_end)
            if mine is not None:
                mine.close()
            if beacon is not None:
                beacon.close()
            raise
        finally:
            if theirs is not None:
                theirs.close()
            if worker_end != parent_end:
                os.close(worker_end)
            if beacon_fd >= 0:
                os.close(beacon_fd)
        return proc, mine, parent_end, beacon

    # -- requests --

    def assign(self, slot: _Slot, bids: list[int], requests: list[Any]) -> None:
        """Give ``slot``'s worker batches ``bids`` (``requests``: their indices) to load once
        it has credit, in one message."""
        slot.held.extend(zip(bids, requests))
        _post(slot, pickle.dumps((FETCH, bids, requests), protocol=5))

    def grant(self, slot: _Slot, n: int) -> None:
        """Hand ``n`` credits to ``slot``'s worker (with the memfds freed since the last
        message, if any)."""
        slot.credit += n
        if slot.returned:
            _post(slot, pickle.dumps((RETURN, slot.take_returned()), protocol=5))
            n += ATTENTION
        _add_credits(slot.credits, n)

    def give_back(self, slot: _Slot) -> None:
        """A credit for ``slot``'s worker (the caller took a batch), written in groups."""
        if slot.withheld:
            slot.withheld -= 1
            return
        owed = slot.owed + 1
        if owed >= slot.group:
            slot.owed = 0
            self.grant(slot, owed)
        else:
            slot.owed = owed

    def pace(self, slot: _Slot, slow: bool, small: bool, grant: bool = True) -> None:
        """``slot``'s worker says its batches are ``slow`` to load (or fast) and ``small`` (one
        array each, sent inline) or not: small and fast, it may load ``deep`` batches ahead;
        otherwise ``prefetch_factor``. Its credits go back one at a time while its batches are
        slow, in groups of half its depth while they are fast (of its whole depth where that
        is under 4). The credits its new depth adds are owed to it (handed back now, with
        ``grant``), those it removes are withheld from the next batches taken (so a worker
        whose batches turn large goes back to ``prefetch_factor`` over its next ``deep``
        batches)."""
        depth = self.deep if small and not slow else self.prefetch
        if slow:
            slot.group = 1
        else:  # (a depth under 4 would wake it for a credit or two)
            slot.group = depth // 2 if depth >= 4 else depth
        change, slot.depth = depth - slot.depth, depth
        if change > 0:
            back = min(change, slot.withheld)
            slot.withheld -= back
            slot.owed += change - back
        elif change < 0:  # (not from what it is owed: near the epoch's end, the batches
            # taken no longer hand credits back, and what it is owed may be its last batches')
            slot.withheld -= change
        if grant and slot.owed >= slot.group and not slot.exhausted:
            n, slot.owed = slot.owed, 0
            self.grant(slot, n)

    def settle(self) -> None:
        """Hand back every credit still owed (before waiting: a worker must never wait for a
        credit the parent keeps)."""
        for slot in self.slots:
            if slot.owed and not slot.exhausted:
                n, slot.owed = slot.owed, 0
                self.grant(slot, n)

    def reset(self, timeout: float | None) -> None:
        """A new epoch on persistent workers: each worker drops what it was given, the
        batches it loaded before that are read and dropped, and iterable datasets start
        over."""
        for slot in self.slots:
            slot.owed = 0  # no more credit for batches of the abandoned epoch
            slot.attention(_RESET)
        for slot in self.slots:
            while self.read(slot, timeout, resetting=True)[0] != RESET_DONE:
                pass
            slot.held.clear()
            slot.backlog.clear()
            slot.credit = slot.owed = slot.withheld = 0
            slot.exhausted = False
            slot.answered, slot.wstate = 0, None

    # -- replies --

    def read(self, slot: _Slot, timeout: float | None, resetting: bool = False) -> Any:
        """The next reply from ``slot``'s worker (waiting up to ``timeout`` seconds).
        With ``worker_crash_retries``, a worker that died is replaced and given again what
        it held (see :func:`.recovery.retry`)."""
        if slot.credit <= 0:
            self.settle()  # it cannot answer without credit
        waited: list[float] = []  # the deadline, once the wait turned long
        while True:
            msg = self._next_message(slot, timeout, resetting, waited)
            if msg is None:
                continue
            kind = msg[0]
            if kind in _ANSWERS:  # the answer to the oldest batch it holds
                return self._answered(slot, msg)
            if kind == PACE:
                self.pace(slot, msg[1], msg[2], grant=not resetting)
                continue
            if kind == RESET_DONE:
                return msg
            if kind == INIT_FAILED:
                cause = loads_exception(msg[1])
                err = WorkerInitError(
                    f"worker_init_fn raised in DataLoader worker {slot.id} (pid {slot.proc.pid}): "
                    f"{type(cause).__name__}: {cause}"
                )
                err.__cause__ = cause
                raise self.fail(err)
            slot.life.to(State.READY)  # "ready": the worker started

    def _next_message(
        self, slot: _Slot, timeout: float | None, resetting: bool, waited: list[float]
    ) -> Any:
        """The next message of ``slot``'s worker; None when none came within a wait slice (or
        its worker died and a fresh one took its place). From the first empty slice on, the
        wait is long: every worker's stderr is watched too (a worker blocked writing to a full
        stderr pipe would never answer), up to the deadline kept in ``waited``."""
        backlog = slot.backlog
        if backlog:
            return backlog.popleft()
        first = WAIT_SLICE if timeout is None else min(WAIT_SLICE, timeout)
        try:
            _shm.set_receiving(slot)
            try:
                msg = slot.conn.recv(timeout=first)
            finally:
                _shm.set_receiving(None)
        except ReadTimeout:
            if not waited:
                waited.append(time.monotonic() - first + (math.inf if timeout is None else timeout))
            self._wait_long([slot], waited[0], timeout)
            return None
        except WriterDied as died:
            slot.life.to(State.DEAD)
            if not self.policy.replaces_crashed:
                raise recovery.crashed(self, slot, died) from None
            if resetting:  # between epochs: nothing is lost, a new worker is reset
                slot.held.clear()
                slot.credit = 0
                recovery.replace(self, slot, None)
                return (RESET_DONE,)
            recovery.retry(self, slot, died)
            return None
        except (EOFError, OSError) as exc:
            raise recovery.crashed(self, slot, None, f"its channel failed: {exc}") from None
        if msg[0] == MANY:
            backlog.extend(msg[2:])
            msg = msg[1]
        return msg

    def _answered(self, slot: _Slot, msg: Any) -> Any:
        """``msg``, the answer to the oldest batch ``slot``'s worker holds."""
        slot.credit -= 1
        bid = slot.held.popleft()[0]
        if msg[1] != bid:
            raise self.fail(
                WorkerError(
                    f"DataLoader worker {slot.id} answered batch {msg[1]} while batch {bid} was due"
                )
            )
        now = time.monotonic()
        if now - self._last_pump > PUMP_EVERY:
            self._housekeeping(now)
        return msg

    def wait_any(self, timeout: float | None) -> _Slot:
        """A worker whose channel has data, among those that owe an answer (``in_order=False``)."""
        busy = [s for s in self.slots if s.held and s.credit > 0]
        for slot in busy:
            if slot.backlog or slot.conn.poll(0):
                return slot
        self.settle()
        busy = [s for s in self.slots if s.held and s.credit > 0]
        if not busy:
            raise self.fail(WorkerError("no DataLoader worker holds a batch to wait for"))
        deadline = time.monotonic() + (math.inf if timeout is None else timeout)
        return self._wait_long(busy, deadline, timeout)

    def _wait_long(self, slots: list[_Slot], deadline: float, timeout: float | None) -> _Slot:
        """Wait until one of ``slots`` has data (or its worker died), moving every worker's
        stderr as it comes; TaskTimeout at ``deadline``."""
        self.settle()
        while True:
            waits: list[Any] = [s.conn for s in slots]
            waits += [fd for fd in (s.proc.stderr_fd() for s in self.slots) if fd is not None]
            remaining = deadline - time.monotonic()
            ready = _connection.wait(waits, None if remaining == math.inf else max(0.0, remaining))
            self._housekeeping(time.monotonic())
            for slot in slots:
                if any(r is slot.conn for r in ready):
                    return slot
            if time.monotonic() >= deadline:
                stuck = min(slots, key=lambda s: s.held[0][0] if s.held else math.inf)
                raise recovery.timed_out(self, stuck, timeout)  # type: ignore[arg-type]

    def _housekeeping(self, now: float) -> None:
        self._last_pump = now
        for slot in self.slots:
            with contextlib.suppress(OSError):
                slot.proc.pump_stderr()
        if now - self._last_rss > RSS_EVERY:
            self._last_rss = now
            for slot in self.slots:
                slot.proc.sample_rss()

    # -- failures --

    def fail(self, exc: BaseException) -> BaseException:
        """The loader is broken: stop every worker, then ``exc`` is raised."""
        self.broken = exc
        self.close()
        return exc

    # -- end --

    def in_flight(self) -> int:
        """Batches the workers may have loaded (or be loading) that the caller has not taken:
        never more than the workers' depths (``prefetch_factor`` each, or ``deep`` for a worker
        whose batches are small and fast)."""
        return sum(s.credit for s in self.slots)

    def close(self, grace: float = STOP_GRACE) -> None:
        """Stop every worker (idempotent): a close request, ``grace`` seconds to exit, then
        SIGTERM and SIGKILL of its process group; every descriptor is released."""
        if self.closed:
            return
        self.closed = True
        _atexit.unregister(self)
        for slot in self.slots:
            if slot.life.alive:
                slot.life.to(State.STOPPING)
            sender = slot.sender
            if slot.outbox is not None and sender is not None:
                # its channel is jammed (a message still going out): no close request can
                # follow it; the worker is killed, and the sender's write fails at once
                slot.proc.kill()
                sender.join(STOP_GRACE)
                if sender.is_alive():
                    continue  # its channel is closed once the worker is reaped
            with contextlib.suppress(OSError, ValueError):
                slot.conn.send_bytes(_CLOSE)
            _add_credits(slot.credits, ATTENTION)  # a worker waiting for credit reads it
            # a worker blocked writing a batch to us gets EPIPE and exits
            with contextlib.suppress(OSError, ValueError):
                slot.conn.close()
        deadline = time.monotonic() + grace
        for slot in self.slots:
            proc = slot.proc.process
            if proc is not None:
                with contextlib.suppress(Exception):
                    proc.join(max(0.0, deadline - time.monotonic()))
        for slot in self.slots:
            slot.proc.stop(timeout=0.0, grace=self.process.kill_grace)
            slot.proc.close()
            slot.life.to(State.DEAD)
            slot.close_fds()
            slot.held.clear()

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.slots if s.proc.pid is not None]

    # -- at exit (see workers/_atexit.py) --

    def finish_at_exit(self) -> None:
        """Nothing to finish: batches nobody will take are dropped."""

    def stop_at_exit(self) -> None:
        self.close(grace=0.2)
