"""What the parent and a loader's workers say to each other: the message codes, the tunables
of the exchange, and small arrays (and tensors) as a pickle built directly."""

from __future__ import annotations

import pickle
import struct
import sys
from typing import Any

from .. import _shm

# Requests, parent to worker, on its channel: (FETCH, [batch ids], [indices, ...]) gives
# batches to load later (read when the worker runs out); (RETURN, [memfds]) hands back memfds
# whose arrays were freed; (RESET,) and (CLOSE,).
# Credits, which allow loading that many batches, come on a counter of their own (below).
FETCH, RESET, CLOSE, RETURN = 0, 1, 2, 3
# Replies, worker to parent: (OK, batch id, data), (FAIL, batch id, exception blob, where),
# (END, batch id) for an iterable dataset that is exhausted, (INIT_FAILED, exception blob),
# (RESET_DONE,), (PACE, slow, small) when its batches turn slow or fast to load, or small
# arrays sent inline (see INLINE_MAX) or not, and
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
# Replies held to go out in one frame wait at most about GROUP_HOLD seconds for a batch that
# turned slow (see NOTE [ A group that waits for a slow batch ], in .worker).
GROUP_HOLD = 0.005
# A worker whose batches are fast and small (each one array under INLINE_MAX, sent inline)
# may load up to DEEP_AHEAD of them ahead (at least prefetch_factor), and gets its credits
# back in groups of half that: one wake-up loads half of what it may hold while the parent
# takes the other half, whatever the order of the batches. Under 1 MiB a worker.
DEEP_AHEAD = 16
STACK_WAIT = 0.5  # seconds to wait for a stuck worker's stack
STOP_GRACE = 1.0  # seconds workers get to exit by themselves before SIGTERM, then SIGKILL
KILL_GRACE = 0.5  # seconds between that SIGTERM and SIGKILL
PUMP_EVERY = 0.02  # seconds between stderr pumps while batches keep arriving
WAIT_SLICE = 0.25  # seconds: while waiting for a batch, stderr is pumped this often
RSS_EVERY = 0.1  # seconds between samples of the workers' peak RSS (for the OOM hint)


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
