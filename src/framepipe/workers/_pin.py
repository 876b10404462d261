"""Pinned (page-locked) batches for ``DataLoader(pin_memory=True)``.

A batch is pinned in the parent, as torch pins it: the walk of :meth:`Pinner.pin` is the one
of ``torch.utils.data._utils.pin_memory.pin_memory`` (tensors, then anything with a
``pin_memory()`` method, mappings, named tuples, tuples, sequences), and it also walks
dataclass instances. A NumPy array in a pinned batch becomes a pinned torch tensor (what
torch's loader gives for it, its ``default_collate`` having made it a tensor): a copy to the
GPU with ``non_blocking=True`` is only safe from a tensor that owns its pinned memory, since
that is how torch's allocator learns not to hand the memory out again before the copy ran
(an array over pinned memory, wrapped by ``torch.from_numpy``, would not tell it).

Where the transport allows, payloads are received straight into pinned buffers instead of
being pinned after they arrive: an array a worker put in shared memory (see :mod:`._shm`) is
read from its memfd into a pinned buffer (one copy, and the memfd goes back to the worker at
once), and a pinned loader's workers put every array from :data:`PIN_SHM_MIN` bytes there.
Smaller arrays, which come inside the message, are copied into pinned memory once they have
arrived. The buffers come from torch's caching host allocator (``torch.empty(...,
pin_memory=True)``): it is the pool the loader reuses, and it is also the one that knows when
a block may be reused, since it waits for the copies to the GPU issued from a block (a pool of
our own could hand out a block whose ``non_blocking`` copy had not run yet).

Without an accelerator, ``pin_memory=True`` warns once (as torch does) and batches stay as
they are. Tests reach the walk and the receive path on a machine without a GPU through
:func:`set_backend` (a private seam), which puts other callables in place of torch's.
"""

from __future__ import annotations

import collections.abc
import copy
import dataclasses
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

#: A pinned loader's workers send arrays of at least this many bytes through shared memory,
#: from where they are read straight into pinned buffers (the default threshold, 1 MiB, is
#: where shared memory starts paying for its mapping; read into a buffer there is no mapping).
PIN_SHM_MIN = 64 * 1024

NO_ACCELERATOR = (
    "'pin_memory' argument is set as true but no accelerator is found, then device pinned "
    "memory won't be used."
)


class Pinner:
    """Pins batches with three callables: ``pin_tensor(t)`` (a pinned copy of tensor ``t``),
    ``alloc(nbytes)`` (a new pinned uint8 tensor of ``nbytes`` bytes) and ``is_pinned(t)``."""

    def __init__(
        self,
        pin_tensor: Callable[[Any], Any],
        alloc: Callable[[int], Any],
        is_pinned: Callable[[Any], bool],
    ) -> None:
        self.pin_tensor = pin_tensor
        self.alloc = alloc
        self.is_pinned = is_pinned

    # -- receiving into pinned memory --

    def receive(self, fd: int, nbytes: int, dtype: Any, shape: tuple[int, ...]) -> Any:
        """The array of ``dtype`` and ``shape`` in the first ``nbytes`` bytes of file
        ``fd``, read into a new pinned buffer, as a torch tensor; None when torch has no
        such dtype (the caller maps it as usual)."""
        torch_dtype = _torch_dtype(dtype)
        if torch_dtype is None:
            return None
        buf = self.alloc(nbytes)
        view, done = memoryview(buf.numpy()).cast("B"), 0
        while done < nbytes:
            n = os.preadv(fd, [view[done:]], done)
            if n <= 0:
                raise EOFError(f"a shared-memory array ended at {done} of {nbytes} bytes")
            done += n
        return buf.view(torch_dtype).view(shape)

    # -- the walk --

    def pin(self, data: Any) -> Any:
        """``data`` with every tensor and array in it in pinned memory (see the module)."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(data, torch.Tensor):
            return data if self.is_pinned(data) else self.pin_tensor(data)
        np = sys.modules.get("numpy")
        if np is not None and isinstance(data, np.ndarray):
            return self._pin_array(data)
        if hasattr(data, "pin_memory") and not isinstance(data, type):
            return data.pin_memory()
        if isinstance(data, (str, bytes, bytearray, memoryview)):
            return data
        if dataclasses.is_dataclass(data) and not isinstance(data, type):
            return self._pin_dataclass(data)
        if isinstance(data, collections.abc.Mapping):
            try:
                if isinstance(data, collections.abc.MutableMapping):
                    clone: Any = copy.copy(data)
                    clone.update({k: self.pin(v) for k, v in data.items()})
                    return clone
                return type(data)({k: self.pin(v) for k, v in data.items()})  # type: ignore[call-arg]
            except TypeError:
                return {k: self.pin(v) for k, v in data.items()}
        if isinstance(data, tuple):
            if hasattr(data, "_fields"):  # a named tuple
                return type(data)(*(self.pin(v) for v in data))
            return type(data)(self.pin(v) for v in data)
        if isinstance(data, collections.abc.Sequence):
            try:
                if isinstance(data, collections.abc.MutableSequence):
                    clone = copy.copy(data)
                    for i, item in enumerate(data):
                        clone[i] = self.pin(item)
                    return clone
                return type(data)([self.pin(v) for v in data])  # type: ignore[call-arg]
            except TypeError:
                return [self.pin(v) for v in data]
        return data

    def _pin_array(self, array: Any) -> Any:
        torch_dtype = _torch_dtype(array.dtype)
        if torch_dtype is None:
            return array  # no tensor can hold it: left as it is
        out = self.alloc(array.nbytes).view(torch_dtype).view(array.shape)
        out.numpy()[...] = array
        return out

    def _pin_dataclass(self, data: Any) -> Any:
        values = {f.name: self.pin(getattr(data, f.name)) for f in dataclasses.fields(data)}
        clone = copy.copy(data)
        for name, value in values.items():
            object.__setattr__(clone, name, value)  # frozen dataclasses too
        return clone


def _torch_dtype(dtype: Any) -> Any:
    """The torch dtype of NumPy ``dtype`` (None: torch has none)."""
    torch = sys.modules.get("torch")
    np = sys.modules.get("numpy")
    if torch is None or np is None:
        return None
    dtype = np.dtype(dtype)
    if dtype.hasobject or not dtype.isnative:
        return None
    try:
        return torch.from_numpy(np.empty(0, dtype)).dtype
    except TypeError:
        return None


def _torch_pinner() -> Pinner:
    import torch

    def alloc(nbytes: int) -> Any:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    return Pinner(lambda t: t.pin_memory(), alloc, lambda t: bool(t.is_pinned()))


def _accelerator() -> str | None:
    """The type of the accelerator torch would pin for (``"cuda"``...), None without one."""
    try:
        import torch
    except ImportError:
        return None
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        if not acc.is_available():
            return None
        current = acc.current_accelerator()
        return None if current is None else str(current.type)
    return "cuda" if torch.cuda.is_available() else None


# The private seam: a callable that returns the Pinner a pinned loader uses, or None for
# "no accelerator". Tests set one that records what it pinned.
_backend: Callable[[], Pinner | None] | None = None


def set_backend(factory: Callable[[], Pinner | None] | None) -> None:
    """Use ``factory()`` instead of torch to pin (None: torch again). For tests."""
    global _backend
    _backend = factory


def make_pinner(pin_memory: bool, device: str) -> Pinner | None:
    """The Pinner of a loader built with ``pin_memory`` and ``pin_memory_device``, or None
    (with torch's warning, once a process, where there is nothing to pin for)."""
    if not isinstance(device, str):
        raise TypeError(
            f"pin_memory_device must be a str such as 'cuda' (or '' for the current "
            f"accelerator), not {type(device).__name__}"
        )
    if not pin_memory:
        if device:
            warnings.warn(
                f"pin_memory_device={device!r} is ignored: pin_memory is False",
                stacklevel=3,
            )
        return None
    if _backend is not None:
        return _backend()
    kind = _accelerator()
    if kind is None:
        _warn(NO_ACCELERATOR)
        return None
    if kind == "mps":
        _warn(
            "'pin_memory' argument is set as true but not supported on MPS now, device "
            "pinned memory won't be used."
        )
        return None
    if device and device.split(":")[0] != kind:
        warnings.warn(
            f"pin_memory_device={device!r} is not the current accelerator: batches are "
            f"pinned for {kind!r}, as torch pins them",
            stacklevel=3,
        )
    return _torch_pinner()


def _warn(message: str) -> None:
    # One place in this module: the default warning filter shows it once a process, as
    # torch's own (raised from one place in torch) is shown.
    warnings.warn(message, UserWarning, stacklevel=1)
