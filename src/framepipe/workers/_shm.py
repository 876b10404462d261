"""Large NumPy arrays (and CPU torch tensors) through shared memory, for the worker layer.

A worker keeps a pool of memfds. An array of at least :data:`SHM_MIN` bytes is written into a
free one, and the message carries only its place (``_Shared``); the memfds are passed to the
parent once each (SCM_RIGHTS over a SOCK_SEQPACKET socketpair), the parent maps the array from
it, and hands the memfd back to the worker when the last view of that array is gone. The parent
thus never allocates and zero-fills fresh pages for a large array: it maps pages the worker has
written. When every memfd is in use, an array takes the connection's bulk channel instead.
"""

from __future__ import annotations

import collections
import contextlib
import mmap
import os
import socket
import sys
import threading
import weakref
from typing import Any

from .errors import WorkerError

#: Arrays of at least this many bytes travel in shared memory: a pool of memfds per worker,
#: each passed to the parent once (SCM_RIGHTS over a SOCK_SEQPACKET socketpair), mapped by
#: the parent for each array and handed back to the worker when the array is freed. Smaller
#: arrays go out of band on the connection's bulk channel (16 KiB and more) or in the pickle.
#: docs/loader.md (How the data travels) has the measurement behind the value.
SHM_MIN = int(os.environ.get("FRAMEPIPE_LOADER_SHM_MIN", str(1 << 20)))
HAVE_MEMFD = hasattr(os, "memfd_create") and hasattr(socket, "send_fds")
_MAX_FDS = 250  # descriptors per SCM_RIGHTS message (the kernel's limit is 253)


def _is_torch_tensor(obj: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def _rebuild_tensor(array: Any) -> Any:
    import torch

    if isinstance(array, torch.Tensor):  # received into pinned memory (see _pin)
        return array
    return torch.from_numpy(array)


class _TensorView:
    __slots__ = ("array",)

    def __init__(self, array: Any) -> None:
        self.array = array

    def __reduce__(self) -> Any:
        return (_rebuild_tensor, (self.array,))


class _Shared:
    """A large array's place in a worker's message: its data is in memfd ``sid``."""

    __slots__ = ("sid", "shape", "dtype", "nbytes")

    def __init__(self, sid: int, shape: tuple[int, ...], dtype: str, nbytes: int) -> None:
        self.sid, self.shape, self.dtype, self.nbytes = sid, shape, dtype, nbytes

    def __reduce__(self) -> Any:
        return (_rebuild_shared, (self.sid, self.shape, self.dtype, self.nbytes))


class Receiver:
    """The parent's side of one worker's memfd pool: the memfds it sent (by the worker's
    numbering), and the ones whose arrays were freed, to be handed back."""

    __slots__ = ("fdsock", "memfds", "returned", "__weakref__")

    def __init__(self, fdsock: socket.socket | None) -> None:
        self.fdsock = fdsock  # the worker's memfds arrive here
        self.memfds: list[int] = []  # memfd sid, as numbered by the worker
        # sids whose arrays were freed (appended by finalizers, from any thread)
        self.returned: collections.deque[int] = collections.deque()

    def memfd(self, sid: int) -> int:
        """The worker's memfd ``sid``: new ones were sent before the message that uses them,
        so this never waits for the worker."""
        while sid >= len(self.memfds):
            assert self.fdsock is not None
            _, fds, _, _ = socket.recv_fds(self.fdsock, 16, _MAX_FDS)
            if not fds:
                raise WorkerError("a worker sent a shared-memory array without its memfd")
            self.memfds.extend(fds)
        return self.memfds[sid]

    def take_returned(self) -> list[int]:
        """The sids freed since the last call (to hand back to the worker)."""
        out = []
        while self.returned:
            out.append(self.returned.popleft())
        return out

    def _close_in_child(self) -> None:
        self.close_fds()

    def close_fds(self) -> None:
        """Close the memfds here (mapped arrays stay valid) and the socket."""
        fds, self.memfds = self.memfds, []  # forgotten first, as in WorkerProcess.close
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.fdsock is not None:
            self.fdsock.close()


# Per thread, the worker whose message is being unpickled: where _rebuild_shared finds memfds
# (a pool's manager thread and a loader's consumer may unpickle at the same time).
_local = threading.local()


def set_receiving(receiver: Receiver | None) -> None:
    """Messages this thread unpickles from now on map their arrays from ``receiver``."""
    _local.receiver = receiver


@contextlib.contextmanager
def receiving(receiver: Receiver | None) -> Any:
    """While the body unpickles a message from a worker, its arrays map from ``receiver``."""
    set_receiving(receiver)
    try:
        yield
    finally:
        set_receiving(None)


def _rebuild_shared(sid: int, shape: tuple[int, ...], dtype: str, nbytes: int) -> Any:
    import numpy as np

    slot = getattr(_local, "receiver", None)
    if slot is None:
        raise RuntimeError("a shared-memory array arrived outside a worker's channel")
    pinner = getattr(slot, "pinner", None)
    if pinner is not None:
        # read straight into a pinned buffer, and the memfd goes back to the worker at once
        tensor = pinner.receive(slot.memfd(sid), nbytes, dtype, shape)
        if tensor is not None:
            slot.returned.append(sid)
            return tensor
    mm = mmap.mmap(slot.memfd(sid), nbytes)
    # the memfd goes back to the worker when the last view of the array is gone
    weakref.finalize(mm, slot.returned.append, sid)
    return np.frombuffer(mm, dtype=np.dtype(dtype)).reshape(shape)


class Wire:
    """A worker's side of the shared-memory pool: puts large arrays of a batch in memfds
    the parent is not using (see :data:`SHM_MIN`), at most ``slots`` of them; when all are
    in use the array takes the bulk channel instead."""

    def __init__(self, fdsock: socket.socket | None, slots: int) -> None:
        self.fdsock = fdsock
        self.slots = slots
        self.np = sys.modules.get("numpy")
        self.memfds: list[int] = []  # memfd number sid is memfds[sid]
        self.free: list[int] = []  # sids the parent handed back
        self.new: list[int] = []  # sids created for this batch: their fds go with it
        self.used: list[int] = []  # sids holding this batch's arrays
        self.shm_min = SHM_MIN  # arrays from this size go through shared memory

    def convert(self, obj: Any) -> Any:
        """``obj`` ready to send: large arrays replaced by their memfd, CPU torch tensors by
        their NumPy view (no copy), rebuilt with ``torch.from_numpy`` in the parent."""
        np = self.np
        if np is not None and type(obj) is np.ndarray:
            return self._array(obj)
        if type(obj) is _TensorView:  # an array the parent makes a tensor
            return _TensorView(self._array(obj.array))
        if _is_torch_tensor(obj):
            if (
                obj.device.type == "cpu"
                and not obj.requires_grad
                and str(obj.layout) == "torch.strided"
            ):
                try:
                    array = obj.detach().contiguous().numpy()
                except TypeError:  # a dtype NumPy lacks (bfloat16): torch pickles it itself
                    return obj
                return _TensorView(self._array(array))
            return obj
        if isinstance(obj, dict):
            return {k: self.convert(v) for k, v in obj.items()}
        if isinstance(obj, list):
            return [self.convert(v) for v in obj]
        if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
            return tuple(self.convert(v) for v in obj)
        return obj

    def _array(self, array: Any) -> Any:
        if (
            self.fdsock is None
            or array.nbytes < self.shm_min
            or array.dtype.hasobject
            or not array.flags.c_contiguous
        ):
            return array
        if self.free:
            sid = self.free.pop()
        elif len(self.memfds) < self.slots:
            sid = len(self.memfds)
            self.memfds.append(
                os.memfd_create(
                    "framepipe-batch",
                    os.MFD_CLOEXEC,
                )
            )
            self.new.append(sid)
        else:
            return array
        self.used.append(sid)
        fd, view, offset = self.memfds[sid], memoryview(array).cast("B"), 0
        while offset < len(view):
            offset += os.pwrite(fd, view[offset:], offset)
        return _Shared(sid, array.shape, array.dtype.str, array.nbytes)

    def flush(self) -> None:
        """Send the memfds created for this batch (before the batch itself)."""
        new, self.new = self.new, []
        fds = [self.memfds[sid] for sid in new]
        for i in range(0, len(fds), _MAX_FDS):
            part = fds[i : i + _MAX_FDS]
            socket.send_fds(self.fdsock, [b"%d" % len(part)], part)  # type: ignore[arg-type]

    def give_back(self, sids: list[int]) -> None:
        self.free.extend(sids)


def convert_result(wire: Wire, value: Any) -> Any:
    """A task's result ready to send: a large array, or large arrays directly inside a small
    tuple, list or dict, go through shared memory; anything else is sent as it is (a result is
    never walked deeply: that could cost more than it saves)."""
    np = wire.np
    if np is None:
        np = wire.np = sys.modules.get("numpy")
        if np is None:
            return value
    kind = type(value)
    if kind is np.ndarray:
        return wire._array(value)
    if kind is tuple or kind is list:
        if len(value) <= 64 and any(type(v) is np.ndarray for v in value):
            return kind(wire._array(v) if type(v) is np.ndarray else v for v in value)
    elif kind is dict and len(value) <= 64:
        if any(type(v) is np.ndarray for v in value.values()):
            return {k: wire._array(v) if type(v) is np.ndarray else v for k, v in value.items()}
    return value
