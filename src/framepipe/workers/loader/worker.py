"""A loader's worker: its info (:func:`get_worker_info`), fetching a batch, and its main loop."""

from __future__ import annotations

import collections
import contextlib
import itertools
import mmap
import os
import pickle
import random
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from ...remote import add_note, dumps_exception
from .. import _pin, _shm
from .._process import STACK_SIGNAL, ChildContext
from ..errors import WorkerError
from . import collate
from .collate import _TENSOR_CHARS, _stack, _torch_installed, default_collate, default_convert
from .credits import _BEACON, _take_credits
from .wire import (
    _MANY_HEAD,
    _MANY_TAIL,
    _PROTO,
    _STOP,
    END,
    FAIL,
    FAST_BATCH,
    FETCH,
    GROUP_HOLD,
    INIT_FAILED,
    OK,
    PACE,
    PACE_BATCHES,
    RESET,
    RESET_DONE,
    RETURN,
    SLOW_BATCH,
    _inline_parts,
    _short,
)


@dataclass(frozen=True)
class WorkerInfo:
    """What :func:`get_worker_info` returns in a loader's worker: its ``id`` (0 to
    ``num_workers - 1``), ``num_workers``, its ``seed`` and its copy of the ``dataset``."""

    id: int
    num_workers: int
    seed: int
    dataset: Any


_worker_info: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """In a :class:`DataLoader` worker, its :class:`WorkerInfo`; None in any other process.

    An iterable dataset shards itself with it, as under torch::

        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        yield from itertools.islice(self.items, start, None, step)
    """
    return _worker_info


class _Fetcher:
    """Turns a request into a batch, in a worker or (``num_workers=0``) in the parent."""

    def __init__(
        self,
        dataset: Any,
        iterable: bool,
        batch_size: int | None,
        collate_fn: Callable[[Any], Any] | None,
        drop_last: bool,
        auto_collation: bool,
    ) -> None:
        self.dataset = dataset
        self.iterable = iterable
        self.batch_size = batch_size
        # False: each request is one index (or a sampler's list of them, as torch takes it:
        # ``dataset[list]`` in one call), and the item goes through default_convert
        self.auto = auto_collation
        # in a worker: a batch that is one array becomes a tensor in the parent (see
        # _shm._TensorView), so the worker neither imports torch nor converts it
        self.views = False
        self.collate = collate_fn
        self.drop_last = drop_last
        self._it: Iterator[Any] | None = None
        # what was being loaded, kept raw and put into words only when an exception needs it
        self._stage = ""
        self._at: Any = None

    @property
    def where(self) -> str:
        """What was being loaded when an exception was raised."""
        stage, at = self._stage, self._at
        if stage == "index":
            return f"index {at!r}"
        if stage == "collate_one":
            return f"collate_fn of index {at!r}"
        if stage == "__getitems__":
            return f"__getitems__ of indices {_short(at)}"
        if stage == "collate":
            return f"collate_fn of indices {_short(at)}"
        return stage

    def reset(self) -> None:
        self._it = None

    def fetch(self, indices: Any) -> Any:
        """The batch for ``indices``; raises StopIteration when an iterable dataset ends."""
        if self.iterable:
            return self._next_iterable()
        dataset = self.dataset
        if not self.auto:
            self._stage, self._at = "index", indices
            item = dataset[indices]
            self._stage = "collate_one"
            return self._convert(item)
        getitems = getattr(dataset, "__getitems__", None)
        if getitems is not None:  # a batch in one call, as torch fetches it
            self._stage, self._at = "__getitems__", indices
            items = getitems(indices)
        else:
            items = []
            append = items.append
            i = None
            try:
                for i in indices:
                    append(dataset[i])
            except BaseException:
                self._stage, self._at = "index", i
                raise
        self._stage, self._at = "collate", indices
        return self._collate(items)

    def _convert(self, item: Any) -> Any:
        """An item without batching: ``collate_fn(item)``, or :func:`default_convert`."""
        if self.collate is not None:
            return self.collate(item)
        if self.views and _torch_installed():
            np = sys.modules.get("numpy")
            if (
                np is not None
                and type(item) is np.ndarray
                and item.dtype.char in _TENSOR_CHARS
                and item.dtype.isnative
                and item.flags.c_contiguous
            ):
                return _shm._TensorView(item)  # what torch.as_tensor(item) gives, in the parent
        return default_convert(item)

    def _collate(self, items: list[Any]) -> Any:
        """A batch: ``collate_fn(items)``, or :func:`default_collate`."""
        if self.collate is not None:
            return self.collate(items)
        if self.views and _torch_installed():
            stacked = _stack(items)
            if stacked is not None:
                return _shm._TensorView(stacked)
        return default_collate(items)

    def _next_iterable(self) -> Any:
        if self._it is None:
            self._stage = "iter(dataset)"
            self._it = iter(self.dataset)
        it = self._it
        self._stage = "the next item of the dataset"
        if self.batch_size is None:
            item = next(it)
            self._stage = "collate_fn"
            return self._convert(item)
        items = list(itertools.islice(it, self.batch_size))
        if not items or (self.drop_last and len(items) < self.batch_size):
            raise StopIteration
        self._stage = "collate_fn"
        return self._collate(items)


def _seed_worker(base_seed: int, worker_id: int) -> int:
    """Seed ``random``, NumPy's global generator and torch (if imported) for one worker, as
    torch does: ``base_seed + worker_id`` for ``random`` and torch, a SeedSequence of
    ``(worker_id, base_seed)`` for NumPy. Returns the worker's seed."""
    seed = (base_seed + worker_id) % (1 << 64)
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:
        pass
    else:
        np.random.seed(np.random.SeedSequence([worker_id, base_seed]).generate_state(4))
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(seed)
    return seed


def _send_failure(conn: Any, bid: int, exc: BaseException, where: str) -> None:
    info = _worker_info
    who = "DataLoader worker" if info is None else f"DataLoader worker {info.id}"
    note = f"raised in {who} (pid {os.getpid()}) while loading {where}"
    with contextlib.suppress(Exception):
        add_note(exc, note)
    conn.send((FAIL, bid, dumps_exception(exc), where))


def _answer(
    conn: Any,
    fetcher: _Fetcher,
    wire: _shm.Wire,
    bid: int,
    indices: Any,
    pending: list[Any],
    state_of: Callable[[], Any] | None = None,
    fetch: Callable[[Any], Any] | None = None,
) -> bool:
    """Load batch ``bid`` and answer it. A small array's reply (see :data:`INLINE_MAX`) is
    added to ``pending``, to go out with the replies around it in one frame (:func:`_flush`);
    any other reply is written at once, after what is pending. With ``state_of`` (an
    iterable dataset's ``state_dict``), the reply carries the dataset's state after the batch
    (see NOTE [ Resuming an epoch ]). ``fetch``: what loads the batch (default: the fetcher's).
    True when the reply was such a small array."""
    try:
        data = (fetch or fetcher.fetch)(indices)
        state = None if state_of is None else state_of()
    except StopIteration:
        _flush(conn, pending)
        conn.send((END, bid))
        return False
    except BaseException as exc:  # noqa: BLE001 - raised in the parent
        _flush(conn, pending)
        _send_failure(conn, bid, exc, fetcher.where)
        return False
    try:
        inline = None if state_of is not None else _inline_parts(bid, data)
    except Exception:  # noqa: BLE001 - an array this path cannot read goes the usual way
        inline = None
    if inline is not None:
        pending += inline
        return True
    _flush(conn, pending)
    wire.used = []
    try:
        data = wire.convert(data)
        if wire.new:
            wire.flush()
        conn.send((OK, bid, data) if state_of is None else (OK, bid, data, state))
    except (BrokenPipeError, ConnectionError):
        raise
    except Exception as exc:  # noqa: BLE001 - an unpicklable batch
        err = WorkerError(
            f"the batch of indices {_short(indices)} could not be sent to the "
            f"parent: {type(exc).__name__}: {exc}"
        )
        err.__cause__ = exc
        wire.give_back(wire.used)  # the parent never saw these arrays
        _send_failure(conn, bid, err, "the batch")
    return False


def _flush(conn: Any, pending: list[Any]) -> None:
    """Write the replies in ``pending`` (the parts of :func:`_inline_parts`, three a reply):
    one as its pickle, several as one frame that unpickles to ``(MANY, reply, ...)``, written
    from the parts (see ``Connection._send_parts``)."""
    if not pending:
        return
    if len(pending) == 3:
        parts = [_PROTO, *pending, _STOP]
    else:
        parts = [_MANY_HEAD, *pending, _MANY_TAIL]
    pending.clear()
    conn._send_parts(parts)


def loader_loop(ctx: ChildContext) -> None:
    """A loader worker's main loop.

    The parent sends the batches to load ahead of time, a chunk at a time (``FETCH``), and
    separately the right to load them: credits, one per batch, on the credit counter.
    The worker loads the next batch it was given only while it holds a credit, so batches it
    has loaded and the parent has not yet taken never exceed the credits the parent handed
    out, whatever the chunk size. It tells the parent when its batches turn slow or fast to
    load, or small or large (``PACE``), which decides how many credits it gets and how they
    come back.
    ``RESET`` drops what is queued (an abandoned epoch) and is acknowledged after every batch
    loaded before it.
    """
    fetcher = _start_worker(ctx)
    if fetcher is None:
        return
    try:
        _Loop(ctx, fetcher).run()
    except (EOFError, BrokenPipeError, ConnectionError):
        return  # the parent closed the channel


def _start_worker(ctx: ChildContext) -> _Fetcher | None:
    """Seeds, :func:`get_worker_info`, ``worker_init_fn`` and a resumed position: the worker's
    fetcher, or None when ``worker_init_fn`` (or resuming) raised, which the parent is told."""
    global _worker_info
    collate.IN_WORKER = True
    opts = ctx.options
    wid = opts["worker_id"]
    seed = _seed_worker(opts["base_seed"], wid)
    torch = sys.modules.get("torch")
    if torch is not None:
        # One intra-op thread, as in torch's own workers: a forked child's copy of the
        # parent's thread pool has no threads behind it, and an op that used it would wait
        # for them forever.
        torch.set_num_threads(1)
    dataset = opts["dataset"]
    _worker_info = WorkerInfo(wid, opts["num_workers"], seed, dataset)
    fetcher = _Fetcher(
        dataset,
        opts["iterable"],
        opts["batch_size"],
        opts["collate_fn"],
        opts["drop_last"],
        opts["auto_collation"],
    )
    fetcher.views = True
    try:
        if opts["worker_init_fn"] is not None:
            opts["worker_init_fn"](wid)
        _resume_worker(fetcher, opts["resume"])
    except BaseException as exc:  # noqa: BLE001 - the parent reports it
        ctx.conn.send((INIT_FAILED, dumps_exception(exc)))
        return None
    return fetcher


class _Loop:
    """What a worker's loop holds: the batches given to it, its credit and its pace."""

    def __init__(self, ctx: ChildContext, fetcher: _Fetcher) -> None:
        opts = ctx.options
        self.conn = ctx.conn
        self.fetcher = fetcher
        self.state_of = fetcher.dataset.state_dict if opts["stateful"] else None
        # where the parent reads which batch this worker was loading if it dies (a retry
        # blames that batch and no other); None unless worker_crash_retries is set
        self.beacon = None if opts["beacon"] is None else mmap.mmap(opts["beacon"].fd, _BEACON.size)
        fdsock = opts["fdsock"]
        self.wire = _shm.Wire(
            None if fdsock is None else socket.socket(fileno=fdsock.fd), opts["shm_slots"]
        )
        if opts["pin"]:
            self.wire.shm_min = _pin.PIN_SHM_MIN  # the parent reads these into pinned memory
        self.credits = opts["credits"].fd
        self.queue: collections.deque[tuple[int, Any]] = collections.deque()  # (id, indices)
        self.credit = 0
        # seconds a batch took, for the last few; whether the least of them is slow
        self.recent: collections.deque[float] = collections.deque(maxlen=PACE_BATCHES)
        self.slow = False
        self.small = False  # its last batches were small arrays, sent inline (INLINE_MAX)
        self.pending: list[Any] = []
        # See NOTE [ A group that waits for a slow batch ]
        self.lock = threading.Lock()
        self.lock.acquire()  # this thread's, but while it loads a batch with replies pending
        self.since = 0.0  # when that load began; 0 while there is none
        self.wake = threading.Event()
        self.flusher: threading.Thread | None = None
        self.flush_error: BaseException | None = None

    # NOTE [ A group that waits for a slow batch ]
    #
    # Fast batches with small replies are loaded a group at a time and their replies written in
    # one frame after the last (``load``). A batch that turns slow in the middle of a group
    # would hold the replies before it for as long as it takes: its neighbours' batches reach
    # the parent seconds late, and a timeout there blames a batch that had long been loaded
    # (it names the first batch it waits for). So a load that begins with replies pending
    # hands the channel to a flusher thread (it releases ``lock``, which the loop holds at all
    # other times, and says when it began in ``since``); the flusher, woken by ``wake`` once
    # per such stretch of loads, writes what is pending once the load has run GROUP_HOLD
    # seconds. The loop takes the lock back before it touches the channel or the pending
    # replies again. What it costs the fast path: a lock released and taken, and a clock read,
    # a batch with replies pending; the flusher wakes at most once per GROUP_HOLD while the loop
    # loads groups (the loads during its sleep find ``wake`` set), and not at all otherwise.

    def fetch(self, indices: Any) -> Any:
        """Load a batch: with replies pending, where the flusher may write them."""
        if not self.pending:
            return self.fetcher.fetch(indices)
        self.since = time.monotonic()
        if not self.wake.is_set():
            if self.flusher is None:
                self.flusher = self._start_flusher()
            self.wake.set()
        self.lock.release()
        try:
            return self.fetcher.fetch(indices)
        finally:
            self.lock.acquire()
            self.since = 0.0
            if self.flush_error is not None:  # what the flusher met, raised in the loop
                error, self.flush_error = self.flush_error, None
                raise error

    def _start_flusher(self) -> threading.Thread:
        """The flusher thread, started with stack requests blocked (see _serve_health): they
        go to the loop's thread, the one they are about, from the flusher's first moment."""
        thread = threading.Thread(target=self._flush_held, name="framepipe-loader-flush")
        thread.daemon = True
        blocked = None
        with contextlib.suppress(AttributeError, OSError, ValueError):
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_SIGNAL})
        try:
            thread.start()
        finally:
            if blocked is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        return thread

    def _flush_held(self) -> None:
        """The flusher thread: writes the pending replies of a load that runs long. What a
        write raises is the loop's to raise (``flush_error``), as it would have met it."""
        wake, lock, pending, conn = self.wake, self.lock, self.pending, self.conn
        while True:
            wake.wait()
            time.sleep(GROUP_HOLD)  # loads begin and end meanwhile: none of them wakes it
            wake.clear()  # before ``since`` is read: a load that begins later sets it again
            while True:
                since = self.since
                if not since:
                    break  # no load with replies pending: wait for the next one
                left = since + GROUP_HOLD - time.monotonic()
                if left > 0:
                    time.sleep(left)
                    continue
                if lock.acquire(blocking=False):  # else the loop has it back: nothing to do
                    try:
                        if self.since == since and pending:
                            _flush(conn, pending)
                    except BaseException as exc:  # noqa: BLE001 - raised in the loop
                        self.flush_error = exc
                        return
                    finally:
                        lock.release()
                break

    def run(self) -> None:
        conn, queue = self.conn, self.queue
        recv_bytes = conn.recv_bytes
        while True:
            if self.credit and queue:
                self.load()
                continue
            if not queue:  # nothing to load before the parent sends more
                if not self.handle(recv_bytes()):
                    return
                continue
            n, attention = _take_credits(self.credits)
            self.credit += n
            if attention:
                while conn.poll(0):
                    if not self.handle(recv_bytes()):
                        return

    def load(self) -> None:
        """Load what there is credit for (fast batches: every one, then their replies in one
        frame; slow ones: one), and tell the parent when the pace turns."""
        count = 1 if self.slow else min(self.credit, len(self.queue))
        self.credit -= count
        conn, queue, beacon, pending = self.conn, self.queue, self.beacon, self.pending
        clock = time.perf_counter
        start = clock()
        small = True
        for _ in range(count):
            bid, indices = queue.popleft()
            if beacon is not None:
                _BEACON.pack_into(beacon, 0, bid)
            small &= _answer(
                conn, self.fetcher, self.wire, bid, indices, pending, self.state_of, self.fetch
            )
        # the loading only: the write below costs what the engine costs, whatever the
        # batches are
        self.recent.append((clock() - start) / count)
        pace = min(self.recent)
        _flush(conn, pending)
        slow = pace > (FAST_BATCH if self.slow else SLOW_BATCH)
        if slow != self.slow or small != self.small:
            self.slow, self.small = slow, small
            conn.send((PACE, slow, small))

    def handle(self, data: bytes) -> bool:
        """One message from the parent; False on CLOSE."""
        msg = pickle.loads(data)
        op = msg[0]
        if op == FETCH:
            self.queue.extend(zip(msg[1], msg[2]))
        elif op == RETURN:
            self.wire.give_back(msg[1])
        elif op == RESET:
            self.queue.clear()
            _take_credits(self.credits, block=False)  # none come until RESET_DONE is read
            self.credit = 0
            self.fetcher.reset()
            self.conn.send((RESET_DONE,))
        else:
            return False
        return True


def _resume_worker(fetcher: _Fetcher, resume: dict[str, Any] | None) -> None:
    """Put a worker's part of an iterable dataset where an earlier worker left it: its
    ``load_state_dict`` with the state that worker last reported, or (a dataset without one)
    the batches it had delivered loaded again and dropped."""
    if not resume:
        return
    if resume.get("state") is not None:
        fetcher.dataset.load_state_dict(resume["state"])
        return
    for _ in range(resume.get("skip", 0)):
        try:
            fetcher.fetch(None)
        except StopIteration:
            return
        except Exception:  # noqa: BLE001 - a batch that failed was delivered as its error
            continue
