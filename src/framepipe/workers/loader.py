"""A data loader on framepipe workers: torch's ``DataLoader`` arguments, framepipe's transport.

:class:`DataLoader` takes the arguments torch users know (``batch_size``, ``shuffle``,
``sampler``, ``batch_sampler``, ``num_workers``, ``collate_fn``, ``prefetch_factor``,
``in_order``, ``timeout``, ``worker_init_fn``, ``persistent_workers``, ``drop_last``) and needs
no torch. How it works:

- Every worker has its own duplex channel (:class:`~framepipe.workers._process.WorkerProcess`).
  No queue is shared by the workers, so a crash costs what that worker held and nothing else.
- The parent samples (the sampler runs in the parent, as under torch, so a
  ``DistributedSampler`` plugs in unchanged) and gives each worker its batches ahead of time,
  :data:`CHUNK` to a message. What a worker may load is decided by credits: it holds
  ``prefetch_factor`` of them, spends one per batch it loads, and gets it back when the caller
  takes that batch. So at most ``prefetch_factor * num_workers`` batches are loaded (or being
  loaded) and not yet taken, however far ahead the indices went: that bounds the parent's
  memory. Credits come back one at a time while a worker's batches are slow to load (it must
  never wait), and in groups of ``prefetch_factor`` while they are fast (a credit costs a
  write and a wake-up, which is most of what a fast batch costs); the worker reports which.
- In order (the default), a map-style epoch gives the workers ``prefetch_factor`` batches in
  a row each, in turn (iterable datasets: one each, torch's order), so batch k is always
  loaded by the same worker and a seed reproduces an epoch; the parent reads each batch from
  the worker that holds it, and what the other workers loaded waits in their channels (there
  is no reorder buffer to fill). ``in_order=False`` gives each worker a new chunk when it runs
  low and yields whatever any worker has ready.
- Results: a batch that is one NumPy array under :data:`INLINE_MAX` (64 KiB) is written as a
  pickle built directly (:func:`_inline_array`), and a worker with credit for several such
  batches writes them in one frame. Anything else travels with ``Connection.send`` (pickle
  protocol 5): arrays from 64 KiB out of band on the connection's bulk socketpair (one kernel
  copy each way), from :data:`SHM_MIN` (1 MiB) in a per-worker pool of memfds that the parent
  maps and hands back when the array is freed (no copy in the parent). Torch tensors travel
  as their NumPy view and are rebuilt with ``torch.from_numpy`` (no copy).
- Failures: a dead worker is seen at once (the channel is watched: :class:`framepipe.WriterDied`
  after every batch it finished) and raises :class:`WorkerCrashed` naming the worker, its pid,
  exit code or signal, the batch it was loading and the others it held (``err.batches``) and
  those queued for it (``err.queued``), the OOM hint and its stderr tail. An
  exception in the dataset or ``collate_fn`` is raised in the parent as its own type, with the
  worker's traceback and a note naming the index. ``timeout`` raises :class:`TaskTimeout` with
  the stuck worker's stack. Workers stop when the epoch ends (unless persistent), when the
  iteration is abandoned, and when the loader is deleted or closed.
- Training (docs/loader-training.md): ``worker_crash_retries`` gives the batches of a worker
  that died to a fresh one (``_Workers.retry``); ``state_dict()`` / ``load_state_dict()``
  resume an epoch (NOTE [ Resuming an epoch ], :mod:`._resume`); ``pin_memory`` pins batches
  in the parent (:mod:`._pin`).
"""

from __future__ import annotations

import collections
import contextlib
import functools
import importlib.util
import itertools
import math
import mmap
import multiprocessing
import os
import pickle
import random
import select
import socket
import struct
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic

from .. import connection as _connection
from .._spin import workers_may_spin
from ..errors import ReadTimeout, WriterDied
from ..remote import add_note, dumps_exception, loads_exception
from . import _atexit, _byvalue, _pin, _progress, _resume, _shm
from ._mainguard import refuse_during_main_import
from ._process import ChildContext, WorkerProcess, _FdHandle, register_parent_side
from .errors import (
    MAIN_GUARD_EXIT,
    TaskTimeout,
    WorkerError,
    WorkerStartError,
    revive,
    start_error,
)

__all__ = [
    "DataLoader",
    "LoaderTimeout",
    "WorkerCrashWarning",
    "WorkerInfo",
    "WorkerInitError",
    "default_collate",
    "default_convert",
    "get_worker_info",
]

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    #: what iterating a DataLoader gives: what its collate_fn returns (Any by default)
    BatchT = TypeVar("BatchT", default=Any)
else:
    from typing import TypeVar

    BatchT = TypeVar("BatchT")

# Requests, parent to worker, on its channel: (FETCH, [batch ids], [indices, ...]) gives
# batches to load later (read when the worker runs out); (RETURN, [memfds]) hands back memfds
# whose arrays were freed; (RESET,) and (CLOSE,).
# Credits, which allow loading that many batches, come on a counter of their own (below).
FETCH, RESET, CLOSE, RETURN = 0, 1, 2, 3
# Replies, worker to parent: (OK, batch id, data), (FAIL, batch id, exception blob, where),
# (END, batch id) for an iterable dataset that is exhausted, (INIT_FAILED, exception blob),
# (RESET_DONE,), (PACE, slow) when its batches turn slow or fast to load, and
# (MANY, reply, reply, ...): replies written in one frame.
OK, FAIL, END, INIT_FAILED, RESET_DONE, PACE, MANY = 0, 1, 2, 3, 4, 5, 6
_ANSWERS = frozenset((OK, FAIL, END))

_CLOSE = pickle.dumps((CLOSE,), protocol=5)
_RESET = pickle.dumps((RESET,), protocol=5)
CHUNK = 16  # batches given to a worker in one message (at least prefetch_factor)
CHUNK_INDICES = 4096  # and fewer indices than this, where batches are large
POST_MAX = 32 * 1024  # bytes: a larger message to a worker goes through a sender thread
# A worker whose batches take longer than SLOW_BATCH seconds to load (its pace, below)
# gets its credits back one at a time, so it never idles; below FAST_BATCH, in groups of
# prefetch_factor, so it wakes once per group.
SLOW_BATCH, FAST_BATCH = 20e-6, 10e-6
# A worker's pace is the least time a batch took among its last PACE_BATCHES: the scheduler
# only ever adds time (a fast batch it interrupted is not a slow batch), while batches that
# really are slow are slow every time.
PACE_BATCHES = 4
STACK_WAIT = 0.5  # seconds to wait for a stuck worker's stack
STOP_GRACE = 1.0  # seconds workers get to exit by themselves before SIGTERM, then SIGKILL
PUMP_EVERY = 0.02  # seconds between stderr pumps while batches keep arriving
WAIT_SLICE = 0.25  # seconds: while waiting for a batch, stderr is pumped this often
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


class LoaderTimeout(TaskTimeout, RuntimeError):
    """A batch took longer than the loader's ``timeout``: a :class:`TaskTimeout` (with the
    stuck worker's stack) that is also the ``RuntimeError`` torch's DataLoader raises."""


class WorkerInitError(WorkerStartError, RuntimeError):
    """``worker_init_fn`` raised in a DataLoader worker (its exception is ``__cause__``): a
    :class:`WorkerStartError` that is also the ``RuntimeError`` torch's DataLoader raises."""


class WorkerCrashWarning(RuntimeWarning):
    """A DataLoader worker died and its batches went to a fresh one
    (``worker_crash_retries``); the warning's text is the crash report."""


def get_worker_info() -> WorkerInfo | None:
    """In a :class:`DataLoader` worker, its :class:`WorkerInfo`; None in any other process.

    An iterable dataset shards itself with it, as under torch::

        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        yield from itertools.islice(self.items, start, None, step)
    """
    return _worker_info


@functools.cache
def _import_numpy() -> Any:
    """NumPy, imported if it is installed; None if not."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


@functools.cache
def _torch_installed() -> bool:
    """Whether torch can be imported here (found, not imported: a worker whose batches are
    plain arrays never imports it, the parent turns them into tensors)."""
    if "torch" in sys.modules:
        return sys.modules["torch"] is not None
    try:
        return importlib.util.find_spec("torch") is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def _import_torch() -> Any:
    """torch, imported if it is installed; None if not. In a loader's worker it gets one
    intra-op thread, as in torch's own workers (see :func:`loader_loop`)."""
    if not _torch_installed():
        return None
    try:
        import torch
    except ImportError:
        return None
    if _worker_info is not None:
        torch.set_num_threads(1)
    return torch


#: NumPy dtypes (by character) whose arrays :func:`_stack` turns into a tensor directly:
#: bool, the signed ints, uint8, the floats and complexes torch has
_TENSOR_CHARS = frozenset("?bBhilqefdFD")


def _stack(batch: Sequence[Any]) -> Any:
    """``batch`` stacked into one NumPy array when it is a list of plain NumPy arrays of one
    shape and one native dtype torch has, which ``torch.from_numpy`` makes the tensor torch's
    collate gives, in a fraction of its time; None for anything else."""
    np = sys.modules.get("numpy")
    if np is None or not batch:
        return None
    elem = batch[0]
    if type(elem) is not np.ndarray:
        return None
    dtype, shape = elem.dtype, elem.shape
    if dtype.char not in _TENSOR_CHARS or not dtype.isnative:
        return None
    nd = np.ndarray
    if not all(
        type(a) is nd and a.dtype == dtype and a.shape == shape and a.flags.c_contiguous
        for a in batch
    ):
        return None  # (torch refuses negative strides: its own collate says so)
    return np.array(batch)


def _collate_arrays(batch: Sequence[Any], *, collate_fn_map: Any = None) -> Any:
    """torch's collate of NumPy arrays (an entry of its ``collate_fn_map``), through
    :func:`_stack` where it can."""
    stacked = _stack(batch)
    if stacked is not None:
        return sys.modules["torch"].from_numpy(stacked)
    return _torch_collate_map()[1](batch, collate_fn_map=collate_fn_map)


@functools.cache
def _torch_collate_map() -> tuple[Any, Any, dict[Any, Any]]:
    """torch's ``collate`` (the function behind its ``default_collate``), its own collate of
    NumPy arrays, and its map of collate functions by type with :func:`_collate_arrays` for
    NumPy arrays."""
    from torch.utils.data._utils import collate as torch_collate

    fn_map = dict(torch_collate.default_collate_fn_map)
    np = sys.modules.get("numpy")
    own = fn_map.get(np.ndarray) if np is not None else None
    if own is not None:
        fn_map[np.ndarray] = _collate_arrays
    return torch_collate.collate, own, fn_map


def default_collate(batch: Sequence[Any]) -> Any:
    """Merge a list of items into a batch, as torch's ``default_collate`` does.

    With torch installed, the batch is torch's (torch is imported on the first call), and so
    are its errors: tensors, NumPy arrays and numbers become a tensor with a new leading axis;
    dicts, named tuples, tuples and lists are collated field by field (a tuple comes back as a
    list, as torch gives it); strings and bytes are kept as a list; anything else is a
    TypeError. NumPy arrays of one shape and dtype are stacked by NumPy, then made a tensor
    without a copy (the same tensor, several times faster).

    Without torch, the batch is NumPy's: arrays are stacked (a new leading axis), numbers
    become a NumPy array (a list where NumPy is missing too), dicts, named tuples, tuples and
    lists are collated field by field; strings, bytes and anything else are returned as a
    list."""
    if _import_torch() is None:
        return _numpy_collate(batch)
    collate, _, fn_map = _torch_collate_map()
    return collate(batch, collate_fn_map=fn_map)


def default_convert(data: Any) -> Any:
    """What an item becomes when batches are off (``batch_size=None``) and no ``collate_fn``
    is given, as under torch: with torch installed, torch's ``default_convert`` (NumPy arrays
    and NumPy scalars become tensors, also inside dicts, tuples and lists); without torch, the
    item as it is."""
    torch = _import_torch()
    if torch is None:
        return data
    return torch.utils.data.default_convert(data)


def _numpy_collate(batch: Sequence[Any]) -> Any:
    """:func:`default_collate` without torch."""
    elem = batch[0]
    np = sys.modules.get("numpy")
    if np is not None and isinstance(elem, np.ndarray):
        nd, shape, dtype = np.ndarray, elem.shape, elem.dtype
        if dtype.kind != "O" and all(
            type(a) is nd and a.dtype is dtype and a.shape == shape for a in batch
        ):
            return np.array(batch)  # what np.stack gives here, in half the time
        return np.stack(batch)
    if isinstance(elem, (bool, int, float, complex)) or (
        np is not None and isinstance(elem, np.generic)
    ):
        np = np or _import_numpy()  # the same batch whether NumPy was imported yet or not
        if np is None:
            return list(batch)
        return np.asarray(batch)
    if isinstance(elem, (str, bytes)):
        return list(batch)
    if isinstance(elem, Mapping):
        out = {key: _numpy_collate([d[key] for d in batch]) for key in elem}
        if type(elem) is dict:
            return out
        try:
            return type(elem)(out)  # type: ignore[call-arg]
        except TypeError:  # a mapping that cannot be built from a dict
            return out
    if isinstance(elem, tuple) and hasattr(elem, "_fields"):
        return type(elem)(*(_numpy_collate(list(f)) for f in zip(*batch)))
    if isinstance(elem, (tuple, list)):
        size = len(elem)
        if any(len(e) != size for e in batch):
            raise RuntimeError("each element in a batch should be of equal size to be collated")
        fields = [_numpy_collate(list(f)) for f in zip(*batch)]
        return tuple(fields) if isinstance(elem, tuple) else fields
    return list(batch)


def _is_iterable_dataset(dataset: Any) -> bool:
    if any(c.__name__ == "IterableDataset" for c in type(dataset).__mro__):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


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


def _short(indices: Any, limit: int = 8) -> str:
    if not isinstance(indices, list):
        return repr(indices)
    if len(indices) <= limit:
        return repr(indices)
    head = ", ".join(repr(i) for i in indices[:limit])
    return f"[{head}, ... ({len(indices)} in all)]"


# -- the wire: small arrays as a pickle built directly -----------------------------------------

#: A reply that is one NumPy array smaller than this (a plain ``ndarray``, C-contiguous, of a
#: numeric, bool, datetime, bytes or str dtype) is written as a pickle built here directly:
#: a call of :func:`_array_reply` with the array's bytes in one BYTEARRAY8 opcode. The parent
#: reads it with its usual ``recv()``. Building it costs a fraction of NumPy's own pickling
#: (which looks up its reconstructor and rebuilds the dtype for every array), both to write
#: and to read. From this size on, the pickle takes arrays out of band (no copy into the
#: pickle), and from :data:`_shm.SHM_MIN` they go through shared memory.
INLINE_MAX = 64 * 1024
_INLINE_KINDS = frozenset("biufcmMSU")


def _pickle_head(name: str) -> bytes:
    """The start of an inline reply's pickle: a call of ``name`` (a function of this module)."""
    return b"".join(
        (
            b"\x80\x05",  # PROTO 5
            b"\x8c",
            bytes([len(__name__)]),
            __name__.encode(),  # SHORT_BINUNICODE module
            b"\x8c",
            bytes([len(name)]),
            name.encode(),  # SHORT_BINUNICODE name
            b"\x93(",  # STACK_GLOBAL, MARK; then the dtype, the shape, the bytes, the batch id
        )
    )


_PICKLE_HEAD = _pickle_head("_array_reply")
_TENSOR_HEAD = _pickle_head("_tensor_reply")  # a CPU tensor, sent as its NumPy view
_PICKLE_TAIL = struct.Struct("<2sq2s")  # LONG1 of 8 bytes (the batch id), TUPLE, REDUCE
_PROTO, _STOP = b"\x80\x05", b"."
_MANY_HEAD = b"\x80\x05(K" + bytes([MANY])  # PROTO 5, MARK, BININT1 MANY; then the replies
_MANY_TAIL = b"t."  # TUPLE, STOP
_DIM = struct.Struct("<q")
_BYTEARRAY8 = struct.Struct("<BQ")
# (dtype, shape, tensor) -> the pickle from after its PROTO up to the array's bytes (None: not
# an array this path takes)
_prefix_cache: dict[tuple[Any, tuple[int, ...], bool], bytes | None] = {}
_dtype_cache: dict[str, Any] = {}


def _array_reply(dtype: str, shape: tuple[int, ...], data: bytearray, bid: int) -> Any:
    """What the parent unpickles from :func:`_inline_array`: the reply ``(OK, bid, array)``,
    the array writable, over the bytearray the pickle made."""
    dt = _dtype_cache.get(dtype)
    if dt is None:
        import numpy as np

        dt = _dtype_cache[dtype] = np.dtype(dtype)
    array = sys.modules["numpy"].frombuffer(data, dt)
    return OK, bid, array if len(shape) == 1 else array.reshape(shape)


def _tensor_reply(dtype: str, shape: tuple[int, ...], data: bytearray, bid: int) -> Any:
    """:func:`_array_reply` for a CPU tensor: the reply ``(OK, bid, tensor)``, the tensor over
    the bytearray the pickle made (``torch.from_numpy``: no copy)."""
    reply = _array_reply(dtype, shape, data, bid)
    return OK, bid, _shm._rebuild_tensor(reply[2])


def _inline_prefix(array: Any, tensor: bool = False) -> bytes | None:
    """The pickle of :func:`_inline_array` from after its PROTO up to the array's bytes (the
    same for every array of this dtype and shape), or None when the dtype cannot travel as its
    name. ``tensor``: the array is a tensor's NumPy view, rebuilt as a tensor."""
    dtype = array.dtype
    if dtype.kind not in _INLINE_KINDS or dtype.metadata:
        return None
    code = dtype.str.encode()
    return b"".join(
        (
            (_TENSOR_HEAD if tensor else _PICKLE_HEAD)[2:],
            b"\x8c",
            bytes([len(code)]),
            code,
            b"(",
            *(b"\x8a\x08" + _DIM.pack(n) for n in array.shape),
            b"t",
            _BYTEARRAY8.pack(0x96, array.nbytes),
        )
    )


def _inline_array(bid: int, array: Any) -> bytes | None:
    """The reply ``(OK, bid, array)`` as a pickle built directly, or None when ``array`` is not
    one this path takes (see :data:`INLINE_MAX`)."""
    parts = _inline_parts(bid, array)
    return None if parts is None else b"".join((_PROTO, *parts, _STOP))


def _tensor_view(tensor: Any) -> Any:
    """A small CPU tensor's NumPy view, if it is one :func:`_inline_parts` takes (a plain
    strided tensor, contiguous, needing no grad, of a dtype NumPy has); None if not."""
    torch = sys.modules.get("torch")
    if (
        torch is None
        or type(tensor) is not torch.Tensor
        or tensor.requires_grad
        or tensor.layout is not torch.strided
        or not tensor.is_cpu
        or tensor.nbytes >= INLINE_MAX
        or not tensor.is_contiguous()
    ):
        return None
    try:
        return tensor.numpy()
    except TypeError:  # a dtype NumPy lacks (bfloat16): torch pickles it itself
        return None


def _inline_parts(bid: int, array: Any) -> tuple[bytes, Any, bytes] | None:
    """The pickle of :func:`_inline_array` without its PROTO and STOP, in three parts (the
    array's bytes not copied), or None when ``array`` is not one this path takes. A small CPU
    tensor goes as its NumPy view and arrives as a tensor (:func:`_tensor_reply`)."""
    np = sys.modules.get("numpy")
    if np is None:
        return None
    tensor = type(array) is not np.ndarray
    if tensor:
        array = array.array if type(array) is _shm._TensorView else _tensor_view(array)
        if type(array) is not np.ndarray:
            return None
    if array.nbytes >= INLINE_MAX or not array.flags.c_contiguous:
        return None
    key = (array.dtype, array.shape, tensor)
    prefix = _prefix_cache.get(key, b"")
    if prefix == b"":
        prefix = _inline_prefix(array, tensor)
        if len(_prefix_cache) >= 64:
            _prefix_cache.clear()
        _prefix_cache[key] = prefix
    if prefix is None:
        return None
    if array.dtype.kind in "mM" or not array.nbytes:
        raw = array.reshape(-1).view(np.uint8)  # datetimes export no buffer of their own
    else:
        raw = memoryview(array).cast("B")
    return prefix, raw, _PICKLE_TAIL.pack(b"\x8a\x08", bid, b"tR")


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
) -> None:
    """Load batch ``bid`` and answer it. A small array's reply (see :data:`INLINE_MAX`) is
    added to ``pending``, to go out with the replies around it in one frame (:func:`_flush`);
    any other reply is written at once, after what is pending. With ``state_of`` (an
    iterable dataset's ``state_dict``), the reply carries the dataset's state after the batch
    (see NOTE [ Resuming an epoch ])."""
    try:
        data = fetcher.fetch(indices)
        state = None if state_of is None else state_of()
    except StopIteration:
        _flush(conn, pending)
        conn.send((END, bid))
        return
    except BaseException as exc:  # noqa: BLE001 - raised in the parent
        _flush(conn, pending)
        _send_failure(conn, bid, exc, fetcher.where)
        return
    try:
        inline = None if state_of is not None else _inline_parts(bid, data)
    except Exception:  # noqa: BLE001 - an array this path cannot read goes the usual way
        inline = None
    if inline is not None:
        pending += inline
        return
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
    out (``prefetch_factor``), whatever the chunk size. It tells the parent when its batches
    turn slow or fast to load (``PACE``), which decides how the credits come back.
    ``RESET`` drops what is queued (an abandoned epoch) and is acknowledged after every batch
    loaded before it.
    """
    global _worker_info
    opts = ctx.options
    conn = ctx.conn
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
        conn.send((INIT_FAILED, dumps_exception(exc)))
        return
    state_of = dataset.state_dict if opts["stateful"] else None
    # where the parent reads which batch this worker was loading if it dies (a retry blames
    # that batch and no other); None unless worker_crash_retries is set
    beacon = None if opts["beacon"] is None else mmap.mmap(opts["beacon"].fd, _BEACON.size)
    fdsock = opts["fdsock"]
    wire = _shm.Wire(None if fdsock is None else socket.socket(fileno=fdsock.fd), opts["shm_slots"])
    if opts["pin"]:
        wire.shm_min = _pin.PIN_SHM_MIN  # the parent reads these straight into pinned memory
    recv_bytes, loads, clock = conn.recv_bytes, pickle.loads, time.perf_counter
    credits = opts["credits"].fd
    queue: collections.deque[tuple[int, Any]] = collections.deque()  # (batch id, indices)
    credit = 0
    # seconds a batch took, for the last few; whether the least of them is slow
    recent: collections.deque[float] = collections.deque(maxlen=PACE_BATCHES)
    slow = False
    pending: list[Any] = []

    def handle(data: bytes) -> bool:
        """One message from the parent; False on CLOSE."""
        nonlocal credit
        msg = loads(data)
        op = msg[0]
        if op == FETCH:
            queue.extend(zip(msg[1], msg[2]))
        elif op == RETURN:
            wire.give_back(msg[1])
        elif op == RESET:
            queue.clear()
            _take_credits(credits, block=False)  # none come until the parent hears RESET_DONE
            credit = 0
            fetcher.reset()
            conn.send((RESET_DONE,))
        else:
            return False
        return True

    try:
        while True:
            if credit and queue:
                # Fast batches: every one there is credit for, then their replies in one frame
                count = 1 if slow else min(credit, len(queue))
                credit -= count
                start = clock()
                for _ in range(count):
                    bid, indices = queue.popleft()
                    if beacon is not None:
                        _BEACON.pack_into(beacon, 0, bid)
                    _answer(conn, fetcher, wire, bid, indices, pending, state_of)
                # the loading only: the write below costs what the engine costs, whatever
                # the batches are
                recent.append((clock() - start) / count)
                pace = min(recent)
                _flush(conn, pending)
                if slow != (pace > (FAST_BATCH if slow else SLOW_BATCH)):
                    slow = not slow
                    conn.send((PACE, slow))
                continue
            if not queue:  # nothing to load before the parent sends more
                if not handle(recv_bytes()):
                    return
                continue
            n, attention = _take_credits(credits)
            credit += n
            if attention:
                while conn.poll(0):
                    if not handle(recv_bytes()):
                        return
    except (EOFError, BrokenPipeError, ConnectionError):
        return  # the parent closed the channel


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


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------

_BEACON = struct.Struct("q")


def _beacon_fd() -> int:
    """A file of 8 bytes a worker and the parent both map (see ``_Workers.retry``)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("framepipe-beacon", os.MFD_CLOEXEC)
    else:  # pragma: no cover - platforms without memfd
        import tempfile

        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, _BEACON.size)
    return fd


class _Slot(_shm.Receiver):
    """The parent's view of one worker."""

    __slots__ = (
        "id",
        "proc",
        "conn",
        "credits",
        "held",
        "backlog",
        "credit",
        "owed",
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
        self.fdsock = fdsock
        self.memfds = []
        self.returned = collections.deque()
        self.proc, self.conn, self.credits, self.beacon = proc, proc.conn, credits, beacon
        self.backlog.clear()
        self.outbox, self.sender = None, None
        self.lock = threading.Lock()

    def attention(self, message: bytes | None = None) -> None:
        """Make the worker read its channel (after ``message``, posted there)."""
        if message is not None:
            _post(self, message)
        _add_credits(self.credits, ATTENTION)


# -- credits: an eventfd (a pipe where there is none) -------------------------------------------
#
# A credit is added to a counter the worker blocks on, not written to its channel: one 8-byte
# write for the parent, one read for the worker that takes every credit granted so far, no
# framing and no parsing; and its wake-up is a plain one, where a pipe's is a "sync" wake-up,
# which invites the scheduler to run the worker on the CPU of the parent, which goes on
# working. The counter also carries ATTENTION, added when the worker must read its channel
# (a reset, a close, memfds handed back).

HAVE_EVENTFD = hasattr(os, "eventfd")
ATTENTION = 1 << 32


def _credit_fds() -> tuple[int, int]:
    """``(worker's end, parent's end)`` of a new credit counter."""
    if HAVE_EVENTFD:
        fd = os.eventfd(0, os.EFD_CLOEXEC)
        return fd, fd
    r, w = os.pipe()
    return r, w


def _add_credits(fd: int, n: int) -> None:
    try:
        if HAVE_EVENTFD:
            os.eventfd_write(fd, n)
        else:
            os.write(fd, b"+" * (n % ATTENTION) + (b"!" if n >= ATTENTION else b""))
    except OSError:
        pass  # the worker is gone: reading its channel reports how


def _take_credits(fd: int, block: bool = True) -> tuple[int, bool]:
    """``(credits, attention)`` added since the last call (waiting for some when ``block``)."""
    if not block:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(0):
            return 0, False
    if HAVE_EVENTFD:
        value = os.eventfd_read(fd)
        return value % ATTENTION, value >= ATTENTION
    data = os.read(fd, 65536)
    if not data:
        raise EOFError("the parent closed the credit pipe")
    return data.count(b"+"), b"!" in data


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
    credit, and there are ``prefetch_factor * num_workers`` credits in all (see _Epoch for
    who gets the one a taken batch frees). Credits are written one at a time while the
    receiving worker's batches are slow to load (it must never wait for one), in groups of
    ``fast_group`` while they are fast (one write then wakes it for that many batches, and
    waking is what a fast batch costs most). Batch ids count up over the workers' life;
    ``floor`` is the first of the current epoch.
    """

    def __init__(
        self, loader: DataLoader, base_seed: int, resume: list[dict[str, Any] | None] | None = None
    ) -> None:
        self.base_seed = base_seed
        self.slots: list[_Slot] = []
        self.retries = loader.worker_crash_retries
        self.on_crash = loader.on_worker_crash
        self.reports = loader.crash_reports
        self.crashes: dict[int, int] = {}  # batch id -> workers that died loading it
        self.pinner = loader._pinner
        self.prefetch = loader._prefetch
        self.fast_group = loader._prefetch  # credits per write while batches are fast
        self.next_bid = 0
        self.floor = 0  # the first batch id of the current epoch
        self.closed = False
        self.broken: BaseException | None = None
        self._last_pump = self._last_rss = 0.0  # the first reply samples the workers' peak RSS
        self._ctx = multiprocessing.get_context(loader.start_method)
        self._common = {
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
            self._common[key] = _byvalue.portable(self._ctx, self._common[key])
        _atexit.register(self)  # stopped at exit, also in a multiprocessing child
        try:
            for wid in range(loader.num_workers):
                slot = _Slot(wid, *self._spawn(wid, None if resume is None else resume[wid]))
                slot.group = self.fast_group
                slot.pinner = self.pinner
                self.slots.append(slot)
        except BaseException:
            self.close(grace=0.0)
            raise

    def _spawn(
        self, wid: int, resume: dict[str, Any] | None
    ) -> tuple[WorkerProcess, socket.socket | None, int, mmap.mmap | None]:
        """Start worker ``wid``: its process, our end of its memfd socket, of its credit
        counter, and its beacon (with ``worker_crash_retries``)."""
        mine = theirs = None
        if _shm.HAVE_MEMFD:
            mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        fdsock = None if theirs is None else _FdHandle(theirs.fileno())
        worker_end, parent_end = _credit_fds()
        beacon_fd = _beacon_fd() if self.retries else -1
        beacon = None
        try:
            if beacon_fd >= 0:
                beacon = mmap.mmap(beacon_fd, _BEACON.size)
                _BEACON.pack_into(beacon, 0, -1)
            proc = WorkerProcess(
                self._ctx,
                f"DataLoader-worker-{wid}",
                loader_loop,
                options={
                    **self._common,
                    "worker_id": wid,
                    "fdsock": fdsock,
                    "credits": _FdHandle(worker_end),
                    "beacon": _FdHandle(beacon_fd) if beacon_fd >= 0 else None,
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
        owed = slot.owed + 1
        if owed >= slot.group:
            slot.owed = 0
            self.grant(slot, owed)
        else:
            slot.owed = owed

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
            slot.credit = slot.owed = 0
            slot.exhausted = False
            slot.answered, slot.wstate = 0, None

    # -- replies --

    def read(self, slot: _Slot, timeout: float | None, resetting: bool = False) -> Any:
        """The next reply from ``slot``'s worker (waiting up to ``timeout`` seconds).
        With ``worker_crash_retries``, a worker that died is replaced and given again what
        it held (see :meth:`retry`)."""
        conn = slot.conn
        if slot.credit <= 0:
            self.settle()  # it cannot answer without credit
        first = WAIT_SLICE if timeout is None else min(WAIT_SLICE, timeout)
        deadline = None
        backlog = slot.backlog
        while True:
            if backlog:
                msg = backlog.popleft()
            else:
                try:
                    _shm.set_receiving(slot)
                    try:
                        msg = conn.recv(timeout=first)
                    finally:
                        _shm.set_receiving(None)
                except ReadTimeout:
                    # A long wait: from now on wait on every worker's stderr too (a worker
                    # blocked writing to a full stderr pipe would never answer).
                    if deadline is None:
                        deadline = (
                            time.monotonic() - first + (math.inf if timeout is None else timeout)
                        )
                    self._wait_long([slot], deadline, timeout)
                    continue
                except WriterDied as died:
                    if not self.retries:
                        raise self._crashed(slot, died) from None
                    if resetting:  # between epochs: nothing is lost, a new worker is reset
                        slot.held.clear()
                        slot.credit = 0
                        self._replace(slot, None)
                        return (RESET_DONE,)
                    self.retry(slot, died)
                    conn = slot.conn
                    continue
                except (EOFError, OSError) as exc:
                    raise self._crashed(slot, None, f"its channel failed: {exc}") from None
                if msg[0] == MANY:
                    backlog.extend(msg[2:])
                    msg = msg[1]
            kind = msg[0]
            if kind in _ANSWERS:  # the answer to the oldest batch it holds
                slot.credit -= 1
                bid = slot.held.popleft()[0]
                if msg[1] != bid:
                    raise self._fail(
                        WorkerError(
                            f"DataLoader worker {slot.id} answered batch {msg[1]} while batch "
                            f"{bid} was due"
                        )
                    )
                now = time.monotonic()
                if now - self._last_pump > PUMP_EVERY:
                    self._housekeeping(now)
                return msg
            if kind == PACE:
                slot.group = 1 if msg[1] else self.fast_group
                if slot.owed >= slot.group:
                    self.settle()
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
                raise self._fail(err)
            # "ready": the worker started

    def wait_any(self, timeout: float | None) -> _Slot:
        """A worker whose channel has data, among those that owe an answer (``in_order=False``)."""
        busy = [s for s in self.slots if s.held and s.credit > 0]
        for slot in busy:
            if slot.backlog or slot.conn.poll(0):
                return slot
        self.settle()
        busy = [s for s in self.slots if s.held and s.credit > 0]
        if not busy:
            raise self._fail(WorkerError("no DataLoader worker holds a batch to wait for"))
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
                raise self._timeout(stuck, timeout)  # type: ignore[arg-type]

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

    def _fail(self, exc: BaseException) -> BaseException:
        """The loader is broken: stop every worker, then ``exc`` is raised."""
        self.broken = exc
        self.close()
        return exc

    def _batch_text(self, bid: int, indices: Any) -> str:
        if bid < self.floor:
            return f"a batch of an abandoned epoch (indices {_short(indices)})"
        if indices is None:
            return f"batch {bid - self.floor}"
        return f"batch {bid - self.floor} (indices {_short(indices)})"

    def _crashed(
        self, slot: _Slot, died: WriterDied | None, reason: str | None = None
    ) -> BaseException:
        # The worker was loading the oldest batch it held if it had a credit for it; any
        # later ones it held with credit were still to come, and the rest were queued.
        held = list(slot.held)
        loading = held[: max(0, slot.credit)]
        why = f"DataLoader worker {slot.id}"
        if len(loading) > 1:
            shown = ", ".join(self._batch_text(b, i) for b, i in loading[1:5])
            more = len(loading) - 5
            why += f"; it also held {shown}" + (f" and {more} more" if more > 0 else "")
        queued = len(held) - len(loading)
        if queued > 0:
            why += f"; {queued} more batch{'es' if queued > 1 else ''} were queued for it"
        if reason:
            why += f"; {reason}"
        task = self._batch_text(*loading[0]) if loading else None
        err = slot.proc.crash_error(died, task, None, why)
        if err.exitcode == MAIN_GUARD_EXIT:  # it never started: see _mainguard
            return self._fail(start_error("a DataLoader", err))
        err.worker_id = slot.id  # type: ignore[attr-defined]
        err.batches = dict(loading)  # type: ignore[attr-defined]
        err.queued = dict(held[len(loading) :])  # type: ignore[attr-defined]
        return self._fail(err)

    def retry(self, slot: _Slot, died: WriterDied) -> None:
        """``slot``'s worker died: the batch it was loading is blamed (its beacon says which:
        the oldest it held when it was loading none of them), and unless that batch has now
        crashed ``worker_crash_retries + 1`` workers (WorkerCrashed, naming it), a fresh
        worker takes the slot's place with every batch the dead one held, in the same order
        and with the same credit, so the epoch goes on as if nothing happened. The report of
        the death goes to ``on_worker_crash`` (a warning without one) and to
        ``crash_reports``. An iterable dataset's part starts again where the dead worker's
        last delivered batch left it (see NOTE [ Resuming an epoch ])."""
        held = list(slot.held)
        if not held:  # nothing lost: a new worker takes its place
            self._replace(slot, None)
            return
        loading = slot.loading()
        bid: int = held[0][0]
        if loading is not None and any(b == loading for b, _ in held):
            bid = loading
        indices = dict(held)[bid]
        count = self.crashes[bid] = self.crashes.get(bid, 0) + 1
        text = self._batch_text(bid, indices)
        why = f"DataLoader worker {slot.id}; it died loading {text}"
        if count > self.retries:
            why += (
                f", which has now crashed {count} workers (worker_crash_retries="
                f"{self.retries}); the reports of the earlier crashes are in err.crashes"
            )
        else:
            why += f"; the batch goes to a fresh worker (retry {count} of {self.retries})"
        err = slot.proc.crash_error(died, text, None, why)
        err.worker_id = slot.id  # type: ignore[attr-defined]
        err.batches = {bid: indices}  # type: ignore[attr-defined]
        err.queued = {b: i for b, i in held if b != bid}  # type: ignore[attr-defined]
        if count > self.retries:
            err.crashes = list(self.reports)  # type: ignore[attr-defined]
            raise self._fail(err)
        resume = None
        if self._common["iterable"]:
            if self._common["stateful"] and slot.wstate is not None:
                resume = {"state": slot.wstate}
            elif slot.answered:
                resume = {"skip": slot.answered}
        self._replace(slot, resume)
        self.reports.append(err)
        if self.on_crash is not None:
            self.on_crash(err)
        else:
            warnings.warn(str(err), WorkerCrashWarning, stacklevel=4)

    def _replace(self, slot: _Slot, resume: dict[str, Any] | None) -> None:
        """A fresh worker in ``slot``'s place, given what the dead one held."""
        old = slot.proc
        held, credit = list(slot.held), slot.credit
        slot.rebind(*self._spawn(slot.id, resume))
        with contextlib.suppress(Exception):
            old.stop(timeout=0.0, grace=0.5)
            old.close()
        slot.held.clear()
        slot.credit = 0
        slot.group = self.fast_group
        if held:
            self.assign(slot, [b for b, _ in held], [i for _, i in held])
        if credit > 0:
            self.grant(slot, credit)

    def _timeout(self, slot: _Slot, timeout: float) -> BaseException:
        stack = slot.proc.stack(STACK_WAIT)
        task = self._batch_text(*slot.held[0]) if slot.held else "a batch"
        err = LoaderTimeout(slot.proc.name, slot.proc.pid, timeout, task_name=task, stack=stack)
        err.worker_id = slot.id  # type: ignore[attr-defined]
        return self._fail(err)

    # -- end --

    def in_flight(self) -> int:
        """Batches the workers may have loaded (or be loading) that the caller has not taken:
        never more than ``prefetch_factor * num_workers``."""
        return sum(s.credit for s in self.slots)

    def close(self, grace: float = STOP_GRACE) -> None:
        """Stop every worker (idempotent): a close request, ``grace`` seconds to exit, then
        SIGTERM and SIGKILL of its process group; every descriptor is released."""
        if self.closed:
            return
        self.closed = True
        _atexit.unregister(self)
        for slot in self.slots:
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
            slot.proc.stop(timeout=0.0, grace=0.5)
            slot.proc.close()
            slot.close_fds()
            slot.held.clear()

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.slots if s.proc.pid is not None]

    # -- at exit (see workers/_atexit.py) --

    def finish_at_exit(self) -> None:
        """Nothing to finish: batches nobody will take are dropped."""

    def stop_at_exit(self) -> None:
        self.close(grace=0.2)


def _batches(sampler: Iterable[Any], batch_size: int, drop_last: bool) -> Iterator[list[Any]]:
    """The sampler's indices in lists of ``batch_size`` (the last one shorter, unless
    ``drop_last``), cut by ``islice``: no Python step per index."""
    it = iter(sampler)
    while True:
        batch = list(itertools.islice(it, batch_size))
        if len(batch) < batch_size and (drop_last or not batch):
            return
        yield batch


class _SequentialSampler:
    """The indices of ``dataset`` in order; its length read at each epoch and each ``len()``
    (a dataset that grows is seen, as under torch)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.dataset)))

    def __len__(self) -> int:
        return len(self.dataset)


class _RandomSampler:
    """A new permutation each epoch, drawn from the loader's seed source."""

    def __init__(self, dataset: Any, loader: DataLoader) -> None:
        self.dataset = dataset
        self.loader = weakref.ref(loader)  # the loader holds this sampler

    def __iter__(self) -> Iterator[int]:
        loader = self.loader()
        seed = loader._shuffle_seed() if loader is not None else random.getrandbits(63)
        n = len(self.dataset)
        try:
            import numpy as np
        except ImportError:
            order = list(range(n))
            random.Random(seed).shuffle(order)
            return iter(order)
        return iter(np.random.default_rng(seed).permutation(n).tolist())

    def __len__(self) -> int:
        return len(self.dataset)


class DataLoader(Generic[BatchT]):
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

    For training (docs/loader-training.md): ``pin_memory=True`` delivers batches in pinned
    (page-locked) memory when an accelerator is available (``pin_memory_device`` is accepted,
    as torch's); :meth:`state_dict` and :meth:`load_state_dict` resume an epoch where it was
    left; ``worker_crash_retries=N`` loads a batch whose worker died again on a fresh worker,
    up to N times, each crash reported to ``on_worker_crash(err)`` (default: a
    :class:`WorkerCrashWarning`) and kept in ``crash_reports``.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool = False,
        sampler: Iterable[Any] | None = None,
        batch_sampler: Iterable[Any] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], BatchT] | None = None,
        prefetch_factor: int | None = None,
        in_order: bool = True,
        timeout: float = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        persistent_workers: bool = False,
        drop_last: bool = False,
        start_method: str | None = None,
        *,
        generator: Any = None,
        seed: int | None = None,
        multiprocessing_context: Any = None,
        pin_memory: bool = False,
        pin_memory_device: str = "",
        worker_crash_retries: int = 0,
        on_worker_crash: Callable[[Any], Any] | None = None,
        progress: Any = None,
    ) -> None:
        if multiprocessing_context is not None:  # torch's name for start_method
            if start_method is not None:
                raise ValueError("give start_method or multiprocessing_context, not both")
            start_method = (
                multiprocessing_context
                if isinstance(multiprocessing_context, str)
                else multiprocessing_context.get_start_method()
            )
        if (
            isinstance(worker_crash_retries, bool)
            or not isinstance(worker_crash_retries, int)
            or worker_crash_retries < 0
        ):
            raise ValueError(
                f"worker_crash_retries must be an int, 0 or more (how many fresh workers a "
                f"batch whose worker died is loaded on again), not {worker_crash_retries!r}"
            )
        if on_worker_crash is not None and not callable(on_worker_crash):
            raise TypeError(
                "on_worker_crash must be a callable taking the WorkerCrashed report, or None"
            )
        if num_workers < 0:
            raise ValueError("num_workers must be 0 or more")
        if timeout < 0:
            raise ValueError("timeout must be 0 or more")
        if num_workers == 0 and prefetch_factor is not None:
            raise ValueError(
                f"prefetch_factor={prefetch_factor!r} needs workers: with num_workers=0 batches "
                "are loaded in this process, one at a time; give num_workers > 0, or leave "
                "prefetch_factor as None"
            )
        if num_workers > 0 and prefetch_factor is None:
            prefetch_factor = 2  # torch's default
        if prefetch_factor is not None and (
            isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int)
        ):
            raise TypeError(f"prefetch_factor must be an int or None, not {prefetch_factor!r}")
        if prefetch_factor is not None and prefetch_factor < 1:
            raise ValueError(
                f"prefetch_factor must be 1 or more (batches loaded ahead per worker), "
                f"not {prefetch_factor!r}"
            )
        if persistent_workers and num_workers == 0:
            raise ValueError("persistent_workers needs num_workers > 0")
        self.dataset = dataset
        self._iterable = _is_iterable_dataset(dataset)
        if self._iterable and (shuffle or sampler is not None or batch_sampler is not None):
            raise ValueError("an iterable dataset takes no shuffle, sampler or batch_sampler")
        if batch_sampler is not None and batch_size == 1:
            batch_size = None  # torch's default batch_size, which a batch_sampler replaces
        if batch_sampler is not None and (
            batch_size is not None or shuffle or sampler is not None or drop_last
        ):
            raise ValueError("batch_sampler excludes batch_size, shuffle, sampler and drop_last")
        if batch_sampler is None and batch_size is None and drop_last:
            raise ValueError(
                "drop_last=True needs a batch_size: with batch_size=None items come one by one"
            )
        if sampler is not None and shuffle:
            raise ValueError("sampler excludes shuffle")
        if batch_size is not None and batch_size < 1:
            raise ValueError("batch_size must be None or 1 or more")
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.prefetch_factor = prefetch_factor  # None with num_workers=0, as torch's
        self._prefetch: int = prefetch_factor or 1
        self.in_order = in_order
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        self.start_method = start_method
        _progress.check(progress)
        self.progress = progress  # see _progress
        self.generator = generator
        self.seed = seed
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self._pinner = _pin.make_pinner(bool(pin_memory), pin_memory_device)
        self.worker_crash_retries = worker_crash_retries
        self.on_worker_crash = on_worker_crash
        #: the reports (WorkerCrashed) of the workers that died and whose batches were retried
        self.crash_reports: list[Any] = []
        self._stateful = (
            self._iterable
            and callable(getattr(dataset, "state_dict", None))
            and callable(getattr(dataset, "load_state_dict", None))
        )
        self._epoch = 0
        self._seed_n = 0  # seeds drawn from ``seed``
        # NOTE [ Resuming an epoch ]: what load_state_dict() put here, for the next iter()
        self._resume: dict[str, Any] | None = None
        self._loaded: dict[str, Any] | None = None
        self._persistent_seed: int | None = None
        self._shuffle_forced: int | None = None  # the next shuffle's seed, when resuming
        self._last_shuffle: int | None = None  # the seed the last shuffle drew
        if not self._iterable and sampler is None and batch_sampler is None:
            len(dataset)  # a TypeError now for a dataset without a length
            sampler = _RandomSampler(dataset, self) if shuffle else _SequentialSampler(dataset)
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self._auto_collation = batch_sampler is not None or batch_size is not None
        self._workers: _Workers | None = None
        self._epochs: weakref.WeakSet[_Epoch] = weakref.WeakSet()  # every epoch not collected
        # a weak reference: an epoch abandoned by the caller (a ``break``) is collected and
        # stops its workers
        self._current_ref: Callable[[], _Epoch | _LocalEpoch | None] = lambda: None

    # -- seeds --

    def _next_seed(self) -> int:
        """A 63-bit seed: the next of the ``seed`` sequence, or drawn from ``generator``."""
        if self.seed is None:
            return _draw_seed(self.generator)
        n = self._seed_n
        self._seed_n += 1
        return int.from_bytes(
            random.Random(f"{self.seed}/{n}").getrandbits(63).to_bytes(8, "little"), "little"
        )

    def _shuffle_seed(self) -> int:
        """The seed of a shuffled epoch's permutation (the resumed epoch's, once)."""
        seed = self._shuffle_forced
        if seed is None:
            seed = self._next_seed()
        self._shuffle_forced = None
        self._last_shuffle = seed
        return seed

    # -- the epoch --

    @property
    def window(self) -> int:
        """Batches in flight or waiting at most: ``prefetch_factor * num_workers``."""
        return self._prefetch * max(self.num_workers, 1)

    def _requests(self) -> Iterator[Any]:
        if self._iterable:
            return itertools.repeat(None)
        # the sampler starts now (a shuffle draws its permutation's seed now)
        if self.batch_sampler is not None:
            return (list(b) for b in iter(self.batch_sampler))
        assert self.sampler is not None
        if self.batch_size is None:
            return iter(self.sampler)
        return _batches(iter(self.sampler), self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[BatchT]:
        if self.progress is None or self.progress is False:
            return self._epoch_iter()
        try:
            total: int | None = len(self)
        except TypeError:
            total = None
        return _progress.track(self._epoch_iter(), self.progress, total, "DataLoader", "batch")

    def _epoch_iter(self) -> Iterator[BatchT]:
        current = self._current_ref()
        if current is not None and self.persistent_workers:
            # One set of workers serves one epoch at a time: the new one takes them over.
            current._abandon(
                "its DataLoader started another epoch (iter() again), and with "
                "persistent_workers=True its workers serve one epoch at a time; finish or drop "
                "an epoch before starting the next, or use persistent_workers=False, where each "
                "iterator has workers of its own"
            )
        self._epoch += 1
        if self.num_workers:
            refuse_during_main_import("a DataLoader's workers")
        # See NOTE [ Resuming an epoch ]
        resume, self._resume, self._loaded = self._resume, None, None
        sampled = self.batch_sampler if self.batch_sampler is not None else self.sampler
        if resume is not None:
            _resume.set_sampler_state(sampled, resume["sampler"])
            self._shuffle_forced = resume["shuffle_seed"]
            sampler_state = resume["sampler"]
        else:
            sampler_state = None if self._iterable else _resume.sampler_state(sampled)
        if self.num_workers == 0:
            fetcher = _Fetcher(
                self.dataset,
                self._iterable,
                self.batch_size if self._auto_collation else None,
                self.collate_fn,
                self.drop_last,
                self._auto_collation,
            )
            info = self._epoch_info(None, sampler_state)
            local = _LocalEpoch(self, fetcher, info, resume)
            self._current_ref = weakref.ref(local)
            return local
        wresume = None if resume is None or not self._iterable else _worker_resume(resume)
        if self.persistent_workers:
            workers = self._workers
            if resume is not None and workers is not None:
                workers.close()  # a resumed epoch needs its own seeds and positions
            if (
                resume is not None
                or workers is None
                or workers.closed
                or workers.broken is not None
            ):
                seed = self._persistent_seed
                if resume is not None:
                    seed = resume["base_seed"]
                workers = self._workers = _Workers(
                    self, self._next_seed() if seed is None else seed, wresume
                )
                self._persistent_seed = None
            else:
                workers.reset(self.timeout or None)
        else:
            seed = self._next_seed() if resume is None else resume["base_seed"]
            workers = _Workers(self, seed, wresume)
        epoch = _Epoch(self, workers, self._epoch_info(workers.base_seed, sampler_state), resume)
        self._current_ref = weakref.ref(epoch)
        self._epochs.add(epoch)
        return epoch

    def _epoch_info(self, base_seed: int | None, sampler_state: Any) -> dict[str, Any]:
        """What an epoch's state keeps of its start; starts the sampler."""
        self._last_shuffle = None
        requests = self._requests()
        shuffle_seed, self._last_shuffle, self._shuffle_forced = self._last_shuffle, None, None
        return {
            "base_seed": base_seed,
            "shuffle_seed": shuffle_seed,
            "sampler": sampler_state,
            "requests": requests,
        }

    # -- resuming --

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: a plain picklable dict that :meth:`load_state_dict` takes to
        go on from here, in this process or another (docs/loader-training.md lists what it
        holds). Taken between two batches of an epoch, a loader restored from it yields the
        rest of that epoch: the batches after the last one taken, in the same order, with the
        same permutation and worker seeds; batches prefetched and not yet taken are loaded
        again, not lost. It reads only what this process knows (the workers are never asked),
        in microseconds."""
        if self._loaded is not None:
            return dict(self._loaded)  # loaded and not started yet: the same state
        epoch = self._current_ref()
        workers = self._workers
        return {
            "version": _resume.VERSION,
            "kind": "iterable" if self._iterable else "map",
            "num_workers": self.num_workers,
            "epochs": self._epoch,
            "seed_counter": self._seed_n,
            "generator": _resume.generator_state(self.generator),
            "persistent_base_seed": (
                workers.base_seed if workers is not None and not workers.closed else None
            ),
            "epoch": None if epoch is None or epoch._complete else epoch._state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (what :meth:`state_dict` returned): the next ``iter()``
        resumes the epoch that was in progress (or, in a state taken between epochs, starts
        the next one, with the seeds it would have had). An epoch of this loader still being
        iterated is stopped (its next ``next()`` raises RuntimeError), and persistent workers
        start again."""
        state = _resume.check(state, "iterable" if self._iterable else "map", self.num_workers)
        for epoch in list(self._epochs):
            epoch._abandon("load_state_dict() was called on its DataLoader")
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        self._current_ref = lambda: None
        self._seed_n = int(state["seed_counter"])
        _resume.set_generator_state(self.generator, state["generator"])
        self._persistent_seed = state["persistent_base_seed"]
        self._resume = state["epoch"]
        self._epoch = int(state["epochs"]) - (state["epoch"] is not None)
        self._loaded = state

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
        own = current.workers if isinstance(current, _Epoch) else None
        for workers in (self._workers, own):
            if workers is not None and not workers.closed:
                return workers.pids()
        return []

    def close(self) -> None:
        """Stop the workers now (they start again at the next ``iter()``); an iterator of an
        epoch that was not over raises RuntimeError at its next ``next()``."""
        for epoch in list(self._epochs):
            epoch._abandon("its DataLoader was closed")
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


# NOTE [ Resuming an epoch ]
#
# An epoch's state is where its caller is, never where the workers are: the batches the
# caller has taken, not those prefetched. A map-style epoch numbers its requests (the
# sampler's batches) 0, 1, 2... and keeps which the caller took: all those below
# ``done_below``, and ``taken`` above it (out of order, with in_order=False). Resuming
# restores the sampler as it was when the epoch started (its state_dict, its generator, or
# the shuffle's seed, kept as drawn), samples the epoch again and gives the workers only the
# requests not taken: batches prefetched at the snapshot are loaded again, none is lost and
# none comes twice. Batch k keeps its worker (``_Epoch._offset``) and the workers their seeds
# (``base_seed``). An iterable dataset is where each worker's part of it is: a worker whose
# dataset has ``state_dict`` sends the dataset's state with every batch, the parent keeps the
# state sent with the last batch the caller took from each worker, and a resumed worker calls
# ``load_state_dict`` with it before its first batch; a dataset without one is replayed (the
# worker loads and drops the batches its part had delivered: exact for a dataset that yields
# the same items every time). A retry after a crash (``_Workers.retry``) resumes the dead
# worker's part the same way.


def _worker_resume(epoch: dict[str, Any]) -> list[dict[str, Any] | None]:
    """Per worker, where its part of an iterable dataset resumes (see the NOTE above)."""
    out: list[dict[str, Any] | None] = []
    for w in epoch["workers"]:
        if w["state"] is not None:
            out.append({"state": w["state"]})
        else:
            out.append({"skip": int(w["yielded"])} if w["yielded"] else None)
    return out


def _untaken(
    requests: Iterator[Any], done_below: int, taken: set[int], positions: list[int]
) -> Iterator[Any]:
    """The requests of a resumed epoch that its caller had not taken; the number of each
    is appended to ``positions`` as it goes out."""
    for pos, request in enumerate(itertools.islice(requests, done_below, None), done_below):
        if pos in taken:
            continue
        positions.append(pos)
        yield request


class _Taken:
    """Which requests of a map-style epoch the caller took (see NOTE [ Resuming an epoch ]),
    and the epoch's start, for its state."""

    def __init__(self, info: dict[str, Any], resume: dict[str, Any] | None) -> None:
        self.info = info
        self.yielded = 0 if resume is None else int(resume["yielded"])
        self.done_below = 0
        self.taken: set[int] = set()
        # the request number of the i-th batch given out: ``first + i``, or (a resumed epoch
        # that had batches taken out of order) ``positions[i]``
        self.first = 0
        self.positions: list[int] | None = None
        requests = info["requests"]
        if resume is not None and "done_below" in resume:
            self.done_below = self.first = int(resume["done_below"])
            self.taken = {int(p) for p in resume["taken"]}
            if self.taken:
                self.positions = []
                requests = _untaken(requests, self.done_below, set(self.taken), self.positions)
            else:
                requests = itertools.islice(requests, self.first, None)
        self.requests = requests

    def took(self, i: int) -> None:
        """The caller took the ``i``-th batch given out this epoch."""
        self.yielded += 1
        pos = self.first + i if self.positions is None else self.positions[i]
        if pos == self.done_below:
            self.done_below = pos = pos + 1
            taken = self.taken
            while taken and pos in taken:
                taken.discard(pos)
                self.done_below = pos = pos + 1
        else:
            self.taken.add(pos)

    def state(self) -> dict[str, Any]:
        info = self.info
        return {
            "base_seed": info["base_seed"],
            "shuffle_seed": info["shuffle_seed"],
            "sampler": info["sampler"],
            "yielded": self.yielded,
            "done_below": self.done_below,
            "taken": sorted(self.taken),
        }


class _LocalEpoch:
    """An epoch loaded in this process (``num_workers=0``)."""

    def __init__(
        self,
        loader: DataLoader,
        fetcher: _Fetcher,
        info: dict[str, Any],
        resume: dict[str, Any] | None,
    ) -> None:
        self.loader = loader
        self.fetcher = fetcher
        self._iterable = loader._iterable
        self._pinner = loader._pinner
        self._complete = False
        self._ended: str | None = None
        self._given = 0
        self._mark = _Taken(info, None if self._iterable else resume)
        self._requests = self._mark.requests
        self._answered, self._exhausted = 0, False
        if self._iterable and resume is not None:
            w = resume["workers"][0]
            self._answered, self._exhausted = int(w["yielded"]), bool(w["exhausted"])
            self._mark.yielded = int(resume["yielded"])
            _resume_worker(fetcher, _worker_resume(resume)[0])

    def __iter__(self) -> _LocalEpoch:
        return self

    def __next__(self) -> Any:
        if self._ended is not None:
            raise RuntimeError(
                f"this DataLoader iterator was stopped before its end: {self._ended}"
            )
        if self._complete:
            raise StopIteration
        if self._iterable:
            if self._exhausted:
                self._complete = True
                raise StopIteration
            try:
                batch = self.fetcher.fetch(None)
            except StopIteration:
                self._exhausted = self._complete = True
                raise
            self._answered += 1
            self._mark.yielded += 1
        else:
            try:
                indices = next(self._requests)
            except StopIteration:
                self._complete = True
                raise
            self._given += 1
            self._mark.took(self._given - 1)
            batch = self.fetcher.fetch(indices)
        return batch if self._pinner is None else self._pinner.pin(batch)

    def _state(self) -> dict[str, Any]:
        state = self._mark.state()
        if self._iterable:
            dataset = self.fetcher.dataset
            state["workers"] = [
                {
                    "state": dataset.state_dict() if self.loader._stateful else None,
                    "yielded": self._answered,
                    "exhausted": self._exhausted,
                }
            ]
            state["next_worker"] = 0
        return state

    def _abandon(self, why: str | None = None) -> None:
        if not self._complete:
            self._ended = why


class _Epoch:
    """One pass over the dataset (what ``iter(loader)`` returns).

    Batches are given to the workers a chunk at a time (``CHUNK``), ahead of when they are
    loaded; credits decide when they are loaded. In order, a map-style epoch goes to the
    workers in blocks of B = ``prefetch_factor`` batches, in turn: batch k to worker
    ``(k // B) % num_workers``, always, so a seed reproduces an epoch. The credit a taken batch
    k frees goes to the worker of batch k + W (W = ``prefetch_factor * num_workers``), so the
    batches loaded and not taken are always among the next W; with blocks of
    ``prefetch_factor`` that is the worker of batch k itself. While batches are fast (credits
    written in groups of B), a worker loads its next block while the parent takes the other
    workers' blocks: each wake-up loads a block, and no wake-up waits for the parent to drain
    the whole window first (a block as large as the window would make the parent and the
    workers take turns, each waiting for the other's wake-up). While they are slow (credits
    one at a time), every worker stays busy. The parent reads each batch from the worker that
    holds it: no reorder buffer, and what the other workers loaded waits in their own
    channels.

    Iterable datasets go one batch per worker in turn (torch's order), and ``in_order=False``
    gives each worker a new chunk when it runs low and takes whatever any worker has ready;
    there, a worker's credit comes back to it.
    """

    def __init__(
        self,
        loader: DataLoader,
        workers: _Workers,
        info: dict[str, Any],
        resume: dict[str, Any] | None = None,
    ) -> None:
        self.loader = loader
        self.workers = workers
        self._iterable = loader._iterable
        # what the caller took, for state_dict() (see NOTE [ Resuming an epoch ])
        self._mark = _Taken(info, None if self._iterable else resume)
        self._requests = self._mark.requests
        self._complete = False  # the epoch reached its end
        # batch k of the epoch goes to the worker of batch ``_offset + k`` of a whole epoch
        self._offset = self._mark.done_below
        self._rot = 0  # iterable, in order: the worker whose batch comes first
        self._last_wid = -1
        if self._iterable and resume is not None:
            self._mark.yielded = int(resume["yielded"])
            self._rot = int(resume.get("next_worker", 0))
            for slot, w in zip(workers.slots, resume["workers"]):
                slot.answered, slot.wstate = int(w["yielded"]), w["state"]
                slot.exhausted = bool(w["exhausted"])
        self._sampling = True
        workers.floor = workers.next_bid  # older batches belong to an abandoned epoch
        self._in_order = loader.in_order
        self._timeout = loader.timeout or None
        self._finished = False
        self._ended: str | None = None  # why the epoch was ended from outside, before its end
        self._turns: collections.deque[_Slot] = collections.deque()  # in order: whose batch
        prefetch = loader._prefetch
        n = len(workers.slots)
        self._window = window = prefetch * n
        # credits follow the batches (to the worker of batch k + W): in order, map-style
        self._positional = loader.in_order and not loader._iterable
        self._block = block = 1  # torch's round robin: batch k to worker k % num_workers
        workers.fast_group = prefetch
        for slot in workers.slots:
            if slot.group > 1:
                slot.group = workers.fast_group
        self._chunk = -(-max(CHUNK, prefetch) // block) * block
        self._low = prefetch + self._chunk // 2  # a worker holding fewer batches gets more
        self._low_all = self._low * n
        self._prefetch = prefetch
        self._supply()
        if self._positional:  # the first W batches' workers get their credits
            for slot in workers.slots:
                workers.grant(
                    slot, sum(1 for s in itertools.islice(self._turns, window) if s is slot)
                )
        else:
            for slot in workers.slots:
                workers.grant(slot, prefetch)

    def __iter__(self) -> _Epoch:
        return self

    def _take(self, batches: int, step: int, max_indices: int) -> list[Any]:
        """Up to ``batches`` requests from the sampler, fewer (a multiple of ``step``, so that
        batch k of an epoch always goes to the same worker) where they hold more than
        ``max_indices`` indices between them."""
        requests: list[Any] = []
        indices = 0
        for request in self._requests:
            requests.append(request)
            indices += len(request) if type(request) is list else 1
            if len(requests) >= batches or (indices >= max_indices and len(requests) % step == 0):
                return requests
        self._sampling = False
        return requests

    def _supply(self) -> None:
        """Give the workers more batches: in order, a chunk to each in turn (one round);
        otherwise a chunk to each worker that runs low."""
        workers = self.workers
        active = [s for s in workers.slots if not s.exhausted]
        if not active:
            self._sampling = False
            return
        if not self._in_order:
            for slot in active:
                if len(slot.held) < self._low and self._sampling:
                    requests = self._take(self._chunk, 1, CHUNK_INDICES)
                    self._low = self._prefetch + max(1, len(requests) // 2)
                    if requests:
                        first = workers.next_bid
                        workers.next_bid += len(requests)
                        workers.assign(slot, list(range(first, workers.next_bid)), requests)
            return
        k = len(active)
        block = self._block
        # a multiple of the window (when the sampler has that many): the first round fills
        # the workers' credits, and each later one refills them
        requests = self._take(k * self._chunk, k * self._prefetch, k * CHUNK_INDICES)
        # the next round is given once half of this one is taken (the workers never run dry)
        self._low_all = self._window + len(requests) // 2
        if not requests:
            return
        first = workers.next_bid
        workers.next_bid += len(requests)
        if self._iterable:  # rounds start with the worker whose turn it is (a resumed epoch)
            shift = next((i for i, s in enumerate(active) if s.id >= self._rot), 0)
        else:  # rounds hold whole blocks of every worker: batch k's worker is fixed
            shift = self._offset
        owners = [active[((j + shift) // block) % k] for j in range(len(requests))]
        for slot in active:
            mine = [j for j in range(len(requests)) if owners[j] is slot]
            if mine:
                workers.assign(slot, [first + j for j in mine], [requests[j] for j in mine])
        self._turns.extend(owners)

    def __next__(self) -> Any:
        if self._finished:
            why = self._ended
            if why is not None:
                raise RuntimeError(f"this DataLoader iterator was stopped before its end: {why}")
            raise StopIteration
        workers = self.workers
        if workers.broken is not None:
            self._finished = True
            raise StopIteration
        turns = self._turns
        while True:
            if self._in_order:
                if self._sampling and len(turns) < self._low_all:
                    self._supply()
                if not turns:
                    self._finish()
                    raise StopIteration
                slot = turns.popleft()
                if slot.exhausted and slot.credit <= 0:
                    slot.held.popleft()  # given to a worker whose part of the data ended
                    continue
            else:
                if self._sampling:
                    self._supply()
                if not any(s.held for s in workers.slots):
                    self._finish()
                    raise StopIteration
                slot = workers.wait_any(self._timeout)
            reply = workers.read(slot, self._timeout)
            kind = reply[0]
            if kind == OK:
                self._free(slot)
                self._took(slot, reply)
                pinner = workers.pinner
                return reply[2] if pinner is None else pinner.pin(reply[2])
            if kind == END:
                slot.exhausted = True  # this worker's part of an iterable dataset is done
                if not self._in_order:
                    while len(slot.held) > slot.credit:
                        slot.held.pop()  # batches it will never be allowed to answer
                continue
            self._free(slot)
            self._took(slot, reply)
            raise revive(reply[2])  # a SystemExit of the dataset's is no exit here

    def _took(self, slot: _Slot, reply: Any) -> None:
        """The caller takes ``reply`` (a batch or its error) from ``slot``'s worker."""
        if self._iterable:
            self._mark.yielded += 1
            slot.answered += 1
            if len(reply) > 3:
                slot.wstate = reply[3]
            self._last_wid = slot.id
        else:
            self._mark.took(reply[1] - self.workers.floor)

    def _state(self) -> dict[str, Any]:
        """This epoch's part of ``DataLoader.state_dict()``."""
        state = self._mark.state()
        if self._iterable:
            slots = self.workers.slots
            state["workers"] = [
                {"state": s.wstate, "yielded": s.answered, "exhausted": s.exhausted} for s in slots
            ]
            turns = self._turns
            state["next_worker"] = (
                turns[0].id if turns else (self._last_wid + 1) % max(1, len(slots))
            )
        return state

    def _free(self, slot: _Slot) -> None:
        """The caller took a batch of ``slot``'s: its credit goes to the worker of the batch
        W further on (in order, map-style), or back to ``slot``'s."""
        if self._positional:
            turns = self._turns
            if len(turns) >= self._window:  # (past the last batch no credit is needed)
                self.workers.give_back(turns[self._window - 1])
        elif not slot.exhausted:
            self.workers.give_back(slot)

    def _finish(self) -> None:
        self._finished = self._complete = True
        if not self.loader.persistent_workers:
            self.workers.close()

    def _abandon(self, why: str | None = None) -> None:
        """Stop this epoch before its end: non-persistent workers stop now; persistent ones
        keep running, and what they loaded for this epoch is dropped at the next one. With
        ``why``, the next ``next()`` raises RuntimeError saying it (nobody is told of an
        epoch that was dropped, or broken off by its own caller)."""
        if self._finished:
            return
        self._finished = True
        self._ended = why
        if not self.loader.persistent_workers:
            self.workers.close()

    def __len__(self) -> int:
        return len(self.loader)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self._abandon()
