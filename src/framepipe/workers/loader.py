"""A data loader on framepipe workers: torch's ``DataLoader`` arguments, framepipe's transport.

:class:`DataLoader` takes the arguments torch users know (``batch_size``, ``shuffle``,
``sampler``, ``batch_sampler``, ``num_workers``, ``collate_fn``, ``prefetch_factor``,
``in_order``, ``timeout``, ``worker_init_fn``, ``persistent_workers``, ``drop_last``) and needs
no torch. How it works:

- Every worker has its own duplex channel (:class:`~framepipe.workers._process.WorkerProcess`):
  the parent sends it the indices of ``prefetch_factor`` batches in one message and it answers
  each with its batch. No queue is shared by the workers, so a crash costs what that worker
  held and nothing else.
- The parent samples (the sampler runs in the parent, as under torch, so a
  ``DistributedSampler`` plugs in unchanged) and keeps at most ``prefetch_factor *
  num_workers`` batches requested and not yet handed to the caller: that bounds the memory of
  the parent. Batches go to the workers in turn, so batch k is always loaded by the same
  worker and a seed reproduces an epoch.
- Results travel with ``Connection.send`` (pickle protocol 5): arrays under 16 KiB inside the
  pickle, from 16 KiB out of band on the connection's bulk socketpair (one kernel copy each
  way), from :data:`SHM_MIN` (1 MiB) in a per-worker pool of memfds that the parent maps and
  hands back when the array is freed (no copy in the parent). Torch tensors travel as their
  NumPy view and are rebuilt with ``torch.from_numpy`` (no copy).
- In order (the default), the parent reads the worker that holds the next batch when it has
  data, and otherwise waits on every worker at once, moving whatever arrives into a reorder
  buffer (so a worker whose result is ready is never held up behind a slow one).
  ``in_order=False`` yields whatever arrives first.
- Failures: a dead worker is seen at once (the channel is watched: :class:`framepipe.WriterDied`
  after every batch it finished) and raises :class:`WorkerCrashed` naming the worker, its pid,
  exit code or signal, the batches and indices it held, the OOM hint and its stderr tail. An
  exception in the dataset or ``collate_fn`` is raised in the parent as its own type, with the
  worker's traceback and a note naming the index. ``timeout`` raises :class:`TaskTimeout` with
  the stuck worker's stack. Workers stop when the epoch ends (unless persistent), when the
  iteration is abandoned, and when the loader is deleted or closed.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import math
import multiprocessing
import os
import pickle
import random
import socket
import sys
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import connection as _connection
from ..errors import WriterDied
from ..remote import dumps_exception, loads_exception
from . import _shm
from ._process import ChildContext, WorkerProcess, _FdHandle, register_parent_side
from .errors import TaskTimeout, WorkerError, WorkerStartError

__all__ = ["DataLoader", "WorkerInfo", "get_worker_info", "default_collate"]

# Requests, parent to worker: (FETCH, batch id, indices), (RESET,), (CLOSE,).
FETCH, RESET, CLOSE = 0, 1, 2
# Replies, worker to parent: (OK, batch id, data), (FAIL, batch id, exception blob),
# (END, batch id) for an iterable dataset that is exhausted, (INIT_FAILED, exception blob).
OK, FAIL, END, INIT_FAILED = 0, 1, 2, 3

_CLOSE = pickle.dumps((CLOSE,), protocol=5)
_RESET = pickle.dumps((RESET,), protocol=5)
STACK_WAIT = 0.5  # seconds to wait for a stuck worker's stack
STOP_GRACE = 1.0  # seconds workers get to exit by themselves before SIGTERM, then SIGKILL
PUMP_EVERY = 0.02  # seconds between stderr pumps while batches keep arriving
RSS_EVERY = 0.1  # seconds between samples of the workers' peak RSS (for the OOM hint)


# --------------------------------------------------------------------------------------------
# What both sides share: worker info, collate, fetching
# --------------------------------------------------------------------------------------------


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


def default_collate(batch: Sequence[Any]) -> Any:
    """Merge a list of items into a batch: NumPy arrays are stacked (a new leading axis),
    numbers become a NumPy array, torch tensors are stacked with ``torch.stack``, dicts,
    named tuples, tuples and lists are collated field by field; strings, bytes and anything
    else are returned as a list."""
    elem = batch[0]
    np = sys.modules.get("numpy")
    if np is not None and isinstance(elem, np.ndarray):
        return np.stack(batch)
    if _shm._is_torch_tensor(elem):
        return sys.modules["torch"].stack(list(batch))
    if isinstance(elem, (bool, int, float, complex)) or (
            np is not None and isinstance(elem, np.generic)):
        if np is None:
            return list(batch)
        return np.asarray(batch)
    if isinstance(elem, (str, bytes)):
        return list(batch)
    if isinstance(elem, Mapping):
        out = {key: default_collate([d[key] for d in batch]) for key in elem}
        if type(elem) is dict:
            return out
        try:
            return type(elem)(out)  # type: ignore[call-arg]
        except TypeError:  # a mapping that cannot be built from a dict
            return out
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return type(elem)(*(default_collate(list(f)) for f in zip(*batch)))
    if isinstance(elem, (tuple, list)):
        size = len(elem)
        if any(len(e) != size for e in batch):
            raise RuntimeError("each element in a batch should be of equal size to be collated")
        fields = [default_collate(list(f)) for f in zip(*batch)]
        return tuple(fields) if isinstance(elem, tuple) else fields
    return list(batch)


def _is_iterable_dataset(dataset: Any) -> bool:
    if any(c.__name__ == "IterableDataset" for c in type(dataset).__mro__):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


class _Fetcher:
    """Turns a request into a batch, in a worker or (``num_workers=0``) in the parent."""

    def __init__(self, dataset: Any, iterable: bool, batch_size: int | None,
                 collate_fn: Callable[[Any], Any] | None, drop_last: bool) -> None:
        self.dataset = dataset
        self.iterable = iterable
        self.batch_size = batch_size
        self.collate = collate_fn
        self.drop_last = drop_last
        self._it: Iterator[Any] | None = None
        self.where: str = ""  # what was being loaded when an exception was raised

    def reset(self) -> None:
        self._it = None

    def fetch(self, indices: Any) -> Any:
        """The batch for ``indices``; raises StopIteration when an iterable dataset ends."""
        if self.iterable:
            return self._next_iterable()
        dataset = self.dataset
        if self.batch_size is None and not isinstance(indices, list):
            self.where = f"index {indices!r}"
            item = dataset[indices]
            if self.collate is not None:
                self.where = f"collate_fn of index {indices!r}"
                item = self.collate(item)
            return item
        items = []
        for i in indices:
            self.where = f"index {i!r}"
            items.append(dataset[i])
        self.where = f"collate_fn of indices {_short(indices)}"
        return (self.collate or default_collate)(items)

    def _next_iterable(self) -> Any:
        if self._it is None:
            self.where = "iter(dataset)"
            self._it = iter(self.dataset)
        it = self._it
        self.where = "the next item of the dataset"
        if self.batch_size is None:
            item = next(it)
            if self.collate is not None:
                self.where = "collate_fn"
                item = self.collate(item)
            return item
        items = list(itertools.islice(it, self.batch_size))
        if not items or (self.drop_last and len(items) < self.batch_size):
            raise StopIteration
        self.where = "collate_fn"
        return (self.collate or default_collate)(items)


def _short(indices: Any, limit: int = 8) -> str:
    if not isinstance(indices, list):
        return repr(indices)
    if len(indices) <= limit:
        return repr(indices)
    head = ", ".join(repr(i) for i in indices[:limit])
    return f"[{head}, ... ({len(indices)} in all)]"


# -- the wire: torch tensors as NumPy views, large arrays in shared memory -------------------


# -- seeds --------------------------------------------------------------------------------------


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


def _draw_seed(generator: Any) -> int:
    """A 63-bit base seed from ``generator`` (a torch or NumPy Generator, a random.Random,
    or None for the ``random`` module)."""
    if generator is None:
        return random.getrandbits(63)
    if hasattr(generator, "getrandbits"):
        return int(generator.getrandbits(63))
    if hasattr(generator, "integers"):
        return int(generator.integers(0, 1 << 63))
    import torch

    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())


# --------------------------------------------------------------------------------------------
# Worker side
# --------------------------------------------------------------------------------------------


def _send_failure(conn: Any, bid: int, exc: BaseException, where: str) -> None:
    info = _worker_info
    who = "DataLoader worker" if info is None else f"DataLoader worker {info.id}"
    note = f"raised in {who} (pid {os.getpid()}) while loading {where}"
    with contextlib.suppress(Exception):
        exc.add_note(note)
    conn.send((FAIL, bid, dumps_exception(exc), where))


def _answer(conn: Any, fetcher: _Fetcher, wire: _shm.Wire, bid: int, indices: Any) -> None:
    try:
        data = fetcher.fetch(indices)
    except StopIteration:
        conn.send((END, bid))
        return
    except BaseException as exc:  # noqa: BLE001 - raised in the parent
        _send_failure(conn, bid, exc, fetcher.where)
        return
    wire.used = []
    try:
        data = wire.convert(data)
        if wire.new:
            wire.flush()
        conn.send((OK, bid, data))
    except (BrokenPipeError, ConnectionError):
        raise
    except Exception as exc:  # noqa: BLE001 - an unpicklable batch
        err = WorkerError(f"the batch of indices {_short(indices)} could not be sent to the "
                          f"parent: {type(exc).__name__}: {exc}")
        err.__cause__ = exc
        wire.give_back(wire.used)  # the parent never saw these arrays
        _send_failure(conn, bid, err, "the batch")


def loader_loop(ctx: ChildContext) -> None:
    """A loader worker's main loop: answer each request in the order it came."""
    global _worker_info
    opts = ctx.options
    conn = ctx.conn
    wid = opts["worker_id"]
    seed = _seed_worker(opts["base_seed"], wid)
    dataset = opts["dataset"]
    _worker_info = WorkerInfo(wid, opts["num_workers"], seed, dataset)
    if opts["worker_init_fn"] is not None:
        try:
            opts["worker_init_fn"](wid)
        except BaseException as exc:  # noqa: BLE001 - the parent reports it
            conn.send((INIT_FAILED, dumps_exception(exc)))
            return
    fetcher = _Fetcher(dataset, opts["iterable"], opts["batch_size"], opts["collate_fn"],
                       opts["drop_last"])
    fdsock = opts["fdsock"]
    wire = _shm.Wire(None if fdsock is None else socket.socket(fileno=fdsock.fd), opts["shm_slots"])
    recv_bytes, loads = conn.recv_bytes, pickle.loads
    try:
        while True:
            msg = loads(recv_bytes())
            op = msg[0]
            if op == FETCH:
                wire.give_back(msg[3])
                for bid, indices in enumerate(msg[2], msg[1]):
                    _answer(conn, fetcher, wire, bid, indices)
            elif op == RESET:
                fetcher.reset()
            else:
                return
    except (EOFError, BrokenPipeError, ConnectionError):
        return  # the parent closed the channel


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------


class _Slot(_shm.Receiver):
    """The parent's view of one worker."""

    __slots__ = ("id", "proc", "conn", "outstanding", "exhausted")

    def __init__(self, wid: int, proc: WorkerProcess, fdsock: socket.socket | None) -> None:
        super().__init__(fdsock)
        self.id = wid
        self.proc = proc
        self.conn = proc.conn
        self.outstanding: collections.deque[int] = collections.deque()  # batch ids, in order
        self.exhausted = False
        register_parent_side(self)  # a worker forked later closes our memfds and socket


_live: weakref.WeakSet[_Workers] = weakref.WeakSet()


@atexit.register
def _stop_all_at_exit() -> None:
    for workers in list(_live):
        with contextlib.suppress(Exception):
            workers.close(grace=0.2)


class _Workers:
    """The worker processes of one loader and everything in flight to and from them."""

    def __init__(self, loader: DataLoader, base_seed: int) -> None:
        self.base_seed = base_seed
        self.slots: list[_Slot] = []
        self.tasks: dict[int, tuple[_Slot, Any]] = {}  # batch id -> (worker, indices)
        self.results: dict[int, Any] = {}  # the reorder buffer: batch id -> reply
        self.next_bid = 0
        self.floor = 0  # the first batch id of the current epoch
        self.closed = False
        self.broken: BaseException | None = None
        self._rr = 0
        self._last_pump = time.monotonic()
        self._last_rss = 0.0  # the first batch samples the workers' peak RSS
        ctx = multiprocessing.get_context(loader.start_method)
        common = {
            "num_workers": loader.num_workers,
            "base_seed": base_seed,
            "dataset": loader.dataset,
            "iterable": loader._iterable,
            "batch_size": loader.batch_size if loader._auto_collation else None,
            "collate_fn": loader.collate_fn,
            "drop_last": loader.drop_last,
            "worker_init_fn": loader.worker_init_fn,
            # memfds per worker: room for 8 large arrays in each of its batches in flight,
            # the one being used and the one being freed (more fall back to the bulk channel)
            "shm_slots": 8 * (loader.prefetch_factor + 2),
        }
        _live.add(self)
        try:
            for wid in range(loader.num_workers):
                mine = theirs = None
                if _shm.HAVE_MEMFD:
                    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                fdsock = None if theirs is None else _FdHandle(theirs.fileno())
                proc = WorkerProcess(ctx, f"DataLoader-worker-{wid}", loader_loop,
                                     options={**common, "worker_id": wid, "fdsock": fdsock})
                try:
                    proc.start()
                finally:
                    if theirs is not None:
                        theirs.close()
                self.slots.append(_Slot(wid, proc, mine))
        except BaseException:
            self.close(grace=0.0)
            raise

    # -- requests --

    def next_in_turn(self) -> _Slot | None:
        """The worker whose turn it is (round robin over the active ones), or None."""
        n = len(self.slots)
        for k in range(n):
            slot = self.slots[(self._rr + k) % n]
            if not slot.exhausted:
                self._rr = (self._rr + k) % n
                return slot
        return None

    def send(self, slot: _Slot, requests: list[Any]) -> list[int]:
        """Send batches to ``slot``'s worker in one message; their batch ids."""
        first = self.next_bid
        bids = list(range(first, first + len(requests)))
        self.next_bid += len(requests)
        for bid, indices in zip(bids, requests):
            self.tasks[bid] = (slot, indices)
        slot.outstanding.extend(bids)
        self._rr = (self._rr + 1) % len(self.slots)
        try:
            returned = slot.take_returned()
            slot.conn.send_bytes(pickle.dumps((FETCH, first, requests, returned), protocol=5))
        except (OSError, ValueError):
            pass  # the worker is gone: reading its channel reports how
        return bids

    def reset(self, timeout: float | None) -> None:
        """A new epoch on persistent workers: the batches of an abandoned epoch are awaited
        and dropped, and iterable datasets start over."""
        for bid in sorted(self.tasks):
            self.take(bid, timeout)
        self.tasks.clear()
        self.results.clear()
        self._rr = 0  # batch k of every epoch goes to the same worker
        for slot in self.slots:
            slot.exhausted = False
            with contextlib.suppress(OSError, ValueError):
                slot.conn.send_bytes(_RESET)

    # -- replies --

    def take(self, bid: int | None, timeout: float | None) -> tuple[int, Any]:
        """The reply to batch ``bid`` (None: whichever comes first): ``(bid, reply)``."""
        if bid is not None:
            reply = self.results.pop(bid, None)
            if reply is not None:
                return bid, reply
            slot = self.tasks[bid][0]
            if slot.outstanding and slot.outstanding[0] == bid and slot.conn.poll(0):
                got, reply = self._recv(slot)
                if got == bid:
                    self._housekeeping()
                    return got, reply
                self.results[got] = reply
        elif self.results:
            got = next(iter(self.results))
            return got, self.results.pop(got)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            busy = [s for s in self.slots if s.outstanding]
            waits: list[Any] = [s.conn for s in busy]
            for s in self.slots:
                fd = s.proc.stderr_fd()
                if fd is not None:
                    waits.append(fd)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = _connection.wait(waits, remaining)
            if not ready and deadline is not None and time.monotonic() >= deadline:
                raise self._timeout(bid, timeout)  # type: ignore[arg-type]
            for s in busy:
                if any(s.conn is r for r in ready):
                    while s.outstanding and s.conn.poll(0):
                        got, reply = self._recv(s)
                        self.results[got] = reply
            self._housekeeping(force=True)
            if bid is None:
                if self.results:
                    got = next(iter(self.results))
                    return got, self.results.pop(got)
            elif bid in self.results:
                return bid, self.results.pop(bid)

    def _recv(self, slot: _Slot) -> tuple[int, Any]:
        while True:
            try:
                with _shm.receiving(slot):
                    msg = slot.conn.recv()
            except WriterDied as died:
                raise self._crashed(slot, died) from None
            except (EOFError, OSError) as exc:
                raise self._crashed(slot, None, f"its channel failed: {exc}") from None
            kind = msg[0]
            if kind == "ready":
                continue
            if kind == INIT_FAILED:
                cause = loads_exception(msg[1])
                err = WorkerStartError(
                    f"worker_init_fn raised in DataLoader worker {slot.id} (pid {slot.proc.pid}): "
                    f"{type(cause).__name__}: {cause}")
                err.__cause__ = cause
                raise self._fail(err)
            bid = msg[1]
            head = slot.outstanding.popleft()
            if head != bid:
                raise self._fail(WorkerError(
                    f"DataLoader worker {slot.id} answered batch {bid} while batch {head} was due"))
            return bid, msg

    def _housekeeping(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self._last_pump > PUMP_EVERY:
            self._last_pump = now
            for slot in self.slots:
                with contextlib.suppress(OSError):
                    slot.proc.pump_stderr()
        if now - self._last_rss > RSS_EVERY:
            self._last_rss = now
            for slot in self.slots:
                slot.proc.sample_rss()

    # -- failures --

    def _fail(self, exc: BaseException) -> BaseException:
        """The loader is broken: stop every worker, then ``exc`` is raised."""
        self.broken = exc
        self.close()
        return exc

    def _batch_text(self, bid: int) -> str:
        return f"batch {bid - self.floor} (indices {_short(self.tasks[bid][1])})"

    def _crashed(self, slot: _Slot, died: WriterDied | None,
                 reason: str | None = None) -> BaseException:
        held = [b for b in slot.outstanding if b in self.tasks]
        why = f"DataLoader worker {slot.id}"
        if len(held) > 1:
            why += "; it also held " + ", ".join(self._batch_text(b) for b in held[1:])
        if reason:
            why += f"; {reason}"
        task = self._batch_text(held[0]) if held else None
        err = slot.proc.crash_error(died, task, None, why)
        err.worker_id = slot.id  # type: ignore[attr-defined]
        err.batches = {b: self.tasks[b][1] for b in held}  # type: ignore[attr-defined]
        return self._fail(err)

    def _timeout(self, bid: int | None, timeout: float) -> BaseException:
        if bid is not None:
            slot = self.tasks[bid][0]
        else:
            busy = [s for s in self.slots if s.outstanding]
            slot = min(busy, key=lambda s: s.outstanding[0]) if busy else self.slots[0]
            bid = slot.outstanding[0] if slot.outstanding else None
        stack = slot.proc.stack(STACK_WAIT)
        task = "a batch" if bid is None else self._batch_text(bid)
        err = TaskTimeout(slot.proc.name, slot.proc.pid, timeout, task_name=task, stack=stack)
        err.worker_id = slot.id  # type: ignore[attr-defined]
        return self._fail(err)

    # -- end --

    def close(self, grace: float = STOP_GRACE) -> None:
        """Stop every worker (idempotent): a close request, ``grace`` seconds to exit, then
        SIGTERM and SIGKILL of its process group; every descriptor is released."""
        if self.closed:
            return
        self.closed = True
        _live.discard(self)
        for slot in self.slots:
            with contextlib.suppress(OSError, ValueError):
                slot.conn.send_bytes(_CLOSE)
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
            slot.proc.stop(timeout=0.0, grace=0.5)
            slot.proc.close()
            slot.close_fds()
        self.tasks.clear()
        self.results.clear()

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.slots if s.proc.pid is not None]


def _batches(sampler: Iterable[Any], batch_size: int, drop_last: bool) -> Iterator[list[Any]]:
    batch: list[Any] = []
    for i in sampler:
        batch.append(i)
        if len(batch) == batch_size:
            yield batch
            batch = []
    if batch and not drop_last:
        yield batch


class _SequentialSampler:
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))

    def __len__(self) -> int:
        return self.n


class _RandomSampler:
    """A new permutation each epoch, drawn from the loader's seed source."""

    def __init__(self, n: int, loader: DataLoader) -> None:
        self.n = n
        self.loader = weakref.ref(loader)  # the loader holds this sampler

    def __iter__(self) -> Iterator[int]:
        loader = self.loader()
        seed = loader._next_seed() if loader is not None else random.getrandbits(63)
        try:
            import numpy as np
        except ImportError:
            order = list(range(self.n))
            random.Random(seed).shuffle(order)
            return iter(order)
        return iter(np.random.default_rng(seed).permutation(self.n).tolist())

    def __len__(self) -> int:
        return self.n


class DataLoader:
    """Batches of a dataset, loaded by worker processes over framepipe channels.

    The arguments are torch's (``torch.utils.data.DataLoader``):

    ``dataset``: map-style (``__getitem__`` and ``__len__``) or iterable (``__iter__``; a
    subclass of torch's ``IterableDataset`` counts as one). ``batch_size=None`` yields items;
    an int groups ``batch_size`` indices and collates them with ``collate_fn`` (default
    :func:`default_collate`). ``shuffle``, ``sampler`` (any iterable of indices, torch's
    samplers included), ``batch_sampler`` (any iterable of lists of indices), ``drop_last``.
    ``num_workers`` (0 loads in this process), ``prefetch_factor`` (batches requested ahead
    per worker: at most ``prefetch_factor * num_workers`` are in flight or waiting),
    ``in_order`` (False: yield batches as they arrive), ``timeout`` (seconds a batch may take;
    0 waits forever), ``worker_init_fn(worker_id)``, ``persistent_workers`` (keep the workers
    between epochs), ``start_method`` (``"fork"``, ``"spawn"``, ``"forkserver"``; None: the
    platform's default). ``generator`` (a ``random.Random``, NumPy or torch Generator; default
    the ``random`` module) draws each epoch's base seed and shuffle order; ``seed=`` fixes the
    base seed instead, so every run reproduces the same epochs.

    Each worker seeds ``random``, NumPy's global generator and torch (when imported) from the
    epoch's base seed and its id (as torch does), so no two workers share a random stream.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = None,
        shuffle: bool = False,
        sampler: Iterable[Any] | None = None,
        batch_sampler: Iterable[Any] | None = None,
        num_workers: int = 2,
        collate_fn: Callable[[Any], Any] | None = None,
        prefetch_factor: int = 2,
        in_order: bool = True,
        timeout: float = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        persistent_workers: bool = False,
        drop_last: bool = False,
        start_method: str | None = None,
        *,
        generator: Any = None,
        seed: int | None = None,
    ) -> None:
        if num_workers < 0:
            raise ValueError("num_workers must be 0 or more")
        if timeout < 0:
            raise ValueError("timeout must be 0 or more")
        if prefetch_factor < 1:
            raise ValueError("prefetch_factor must be 1 or more")
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers needs num_workers > 0")
        self.dataset = dataset
        self._iterable = _is_iterable_dataset(dataset)
        if self._iterable and (shuffle or sampler is not None or batch_sampler is not None):
            raise ValueError("an iterable dataset takes no shuffle, sampler or batch_sampler")
        if batch_sampler is not None and (batch_size is not None or shuffle or
                                          sampler is not None or drop_last):
            raise ValueError("batch_sampler excludes batch_size, shuffle, sampler and drop_last")
        if sampler is not None and shuffle:
            raise ValueError("sampler excludes shuffle")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be None or 1 or more")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.prefetch_factor = prefetch_factor
        self.in_order = in_order
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        self.start_method = start_method
        self.generator = generator
        self.seed = seed
        self._epoch = 0
        self._seeds = itertools.count()
        if not self._iterable and sampler is None and batch_sampler is None:
            n = len(dataset)
            sampler = _RandomSampler(n, self) if shuffle else _SequentialSampler(n)
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self._auto_collation = batch_sampler is not None or batch_size is not None
        self._workers: _Workers | None = None
        self._current_ref: Callable[[], _Epoch | None] = lambda: None  # a weak reference:
        # an epoch abandoned by the caller (a ``break``) is collected and stops its workers

    # -- seeds --

    def _next_seed(self) -> int:
        """A 63-bit seed: the next of the ``seed`` sequence, or drawn from ``generator``."""
        if self.seed is None:
            return _draw_seed(self.generator)
        n = next(self._seeds)
        return int.from_bytes(
            random.Random(f"{self.seed}/{n}").getrandbits(63).to_bytes(8, "little"), "little")

    # -- the epoch --

    @property
    def window(self) -> int:
        """Batches in flight or waiting at most: ``prefetch_factor * num_workers``."""
        return self.prefetch_factor * max(self.num_workers, 1)

    def _requests(self) -> Iterator[Any]:
        if self._iterable:
            return itertools.repeat(None)
        if self.batch_sampler is not None:
            return (list(b) for b in self.batch_sampler)
        assert self.sampler is not None
        if self.batch_size is None:
            return iter(self.sampler)
        return _batches(self.sampler, self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[Any]:
        current = self._current_ref()
        if current is not None:
            current._abandon()
        self._epoch += 1
        if self.num_workers == 0:
            fetcher = _Fetcher(self.dataset, self._iterable,
                               self.batch_size if self._auto_collation else None,
                               self.collate_fn, self.drop_last)
            return _local_epoch(fetcher, self._requests())
        if self.persistent_workers:
            workers = self._workers
            if workers is None or workers.closed or workers.broken is not None:
                workers = self._workers = _Workers(self, self._next_seed())
            else:
                workers.reset(self.timeout or None)
        else:
            workers = _Workers(self, self._next_seed())
        epoch = _Epoch(self, workers, self._requests())
        self._current_ref = weakref.ref(epoch)
        return epoch

    def __len__(self) -> int:
        if self._iterable:
            n = len(self.dataset)
            if self.batch_size is None:
                return n
            return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        n = len(self.sampler)  # type: ignore[arg-type]
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def worker_pids(self) -> list[int]:
        """The pids of the workers running now (persistent or of the current epoch)."""
        current = self._current_ref()
        for workers in (self._workers, current.workers if current else None):
            if workers is not None and not workers.closed:
                return workers.pids()
        return []

    def close(self) -> None:
        """Stop the workers now (they start again at the next ``iter()``)."""
        current = self._current_ref()
        if current is not None:
            current._abandon()
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()


def _local_epoch(fetcher: _Fetcher, requests: Iterator[Any]) -> Iterator[Any]:
    for indices in requests:
        try:
            yield fetcher.fetch(indices)
        except StopIteration:
            return


class _Epoch:
    """One pass over the dataset (what ``iter(loader)`` returns)."""

    def __init__(self, loader: DataLoader, workers: _Workers, requests: Iterator[Any]) -> None:
        self.loader = loader
        self.workers = workers
        self._requests = requests
        self._sampling = True
        workers.floor = workers.next_bid  # older batches belong to an abandoned epoch
        self._pending: collections.deque[int] = collections.deque()  # our batches, in order
        self._window = loader.window
        self._per_worker = loader.prefetch_factor
        self._in_order = loader.in_order
        self._timeout = loader.timeout or None
        self._finished = False
        self._fill()

    def __iter__(self) -> _Epoch:
        return self

    def _fill(self) -> None:
        """Request batches while the window has room: ``prefetch_factor`` at a time in one
        message, to each worker in turn once it has answered its last ones. A worker wakes
        once per message, not once per batch, and batch k always goes to worker
        ``(k // prefetch_factor) % num_workers``, so a seed reproduces the epoch."""
        workers = self.workers
        if not self._sampling or workers.slots[workers._rr].outstanding:
            return  # the worker whose turn it is has not answered yet (the common case)
        per_worker = self._per_worker
        while self._sampling:
            slot = workers.next_in_turn()
            if slot is None:
                self._sampling = False
                return
            if slot.outstanding or self._window - len(workers.tasks) < per_worker:
                return
            requests = list(itertools.islice(self._requests, per_worker))
            if len(requests) < per_worker:
                self._sampling = False
            if requests:
                self._pending.extend(workers.send(slot, requests))

    def __next__(self) -> Any:
        workers = self.workers
        while True:
            if self._finished:
                raise StopIteration
            if workers.broken is not None:
                self._finished = True
                raise StopIteration
            if not self._pending:
                self._finish()
                raise StopIteration
            if self._in_order:
                bid, reply = workers.take(self._pending.popleft(), self._timeout)
            else:
                bid, reply = workers.take(None, self._timeout)
                self._pending.remove(bid)
            slot = workers.tasks.pop(bid)[0]
            if reply[0] == END:
                slot.exhausted = True  # this worker's part of an iterable dataset is done
            self._fill()
            kind = reply[0]
            if kind == OK:
                return reply[2]
            if kind == FAIL:
                raise loads_exception(reply[2])

    def _finish(self) -> None:
        self._finished = True
        if not self.loader.persistent_workers:
            self.workers.close()

    def _abandon(self) -> None:
        """Stop this epoch before its end: non-persistent workers stop now; persistent ones
        keep running, and the batches still in flight are dropped as they arrive."""
        if self._finished:
            return
        self._finished = True
        if not self.loader.persistent_workers:
            self.workers.close()

    def __len__(self) -> int:
        return len(self.loader)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._abandon()
