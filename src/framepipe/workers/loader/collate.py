"""Turning items into batches, as torch does: :func:`default_collate` and
:func:`default_convert` (torch's tensors with torch installed, NumPy's arrays without)."""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Mapping, Sequence
from typing import Any

#: set in a loader's worker: torch, once imported there, gets one intra-op thread
IN_WORKER = False


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
    intra-op thread, as in torch's own workers (see ``worker.loader_loop``)."""
    if not _torch_installed():
        return None
    try:
        import torch
    except ImportError:
        return None
    if IN_WORKER:
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
    own = None if np is None else fn_map.get(np.ndarray)
    if np is not None and own is not None:
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
