"""Objects on the wire: pickle protocol 5 with large buffers out of band.

A small object is one data frame holding an in-band pickle (what a reference writer sends).
An object holding buffers of 64 KiB or more becomes an OBJECT frame (the pickle, then a table of
buffer sizes) followed by one BUFFER frame per buffer, written from the buffer's own memory; on
a connection with a bulk channel, large payloads are announced by a BULK header instead and
travel on the bulk fd.
"""

from __future__ import annotations

import copyreg
import functools
import io
import pickle
import socket
import struct
import types
from multiprocessing.reduction import ForkingPickler
from typing import Any

from ._wire import KIND_BUFFER, KIND_BULK, KIND_DATA, KIND_OBJECT, LENGTH, header
from .errors import FrameError

OOB_THRESHOLD = 64 * 1024  # buffers at least this large travel out of band
META = struct.Struct("QQ")  # (length, flags) of each out-of-band buffer
FLAG_BYTES = 1  # the buffer is rebuilt as an immutable bytes object


def _as_bytes(buf: Any) -> bytes:
    return buf if type(buf) is bytes else bytes(buf)


class _Reduced:
    """Wraps a large top-level bytes object so its memory travels out of band."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (_as_bytes, (pickle.PickleBuffer(self.data),))


def dumps(obj: Any) -> list[Any]:
    """The frames that carry ``obj``, as a list of buffers to write in one go."""
    return _dumps(obj, 0)[0]  # type: ignore[no-any-return]


def dumps_bulk(obj: Any, bulk_min: int) -> list[Any]:
    """``obj`` for a connection with a bulk channel: segments alternating between a list of
    buffers for the pipe and one payload for the bulk fd, ``[pipe_parts, bulk, pipe_parts,
    ..., pipe_parts]``. A payload of ``bulk_min`` bytes or more (a buffer, or the whole pickle)
    is announced in the pipe by a BULK header and written to the bulk fd; a single element
    means nothing goes bulk."""
    return _dumps(obj, bulk_min)


# What multiprocessing.connection pickles with: ForkingPickler, whose registered reducers (the
# stdlib's, torch.multiprocessing's, a caller's ``ForkingPickler.register``) come before
# copyreg's. Those the stdlib registers itself are either what plain pickle does anyway (bound
# methods, method descriptors, partials) or what it refuses (sockets), so while nothing else is
# registered, a plain pickle runs first and ForkingPickler's table only when it fails.
_STDLIB_REDUCED = frozenset(
    {types.MethodType, type(list.append), type(int.__add__), functools.partial, socket.socket}
)
_registry: dict[type, Any] = ForkingPickler._extra_reducers  # type: ignore[attr-defined]
_seen = (-1, -1)  # the sizes of the registry and of copyreg's table when last looked at
_plain_first = True
_table: dict[Any, Any] = {}


def _look() -> None:
    """Take in what was registered since the last look (both tables only grow)."""
    global _seen, _plain_first, _table
    _plain_first = _registry.keys() <= _STDLIB_REDUCED
    _table = {**copyreg.dispatch_table, **_registry}
    _seen = (len(_registry), len(copyreg.dispatch_table))


def _pickle(obj: Any, keep: Any, buffers: list[Any]) -> bytes:
    """``obj``'s protocol 5 pickle, as ForkingPickler would make it."""
    if len(_registry) != _seen[0] or len(copyreg.dispatch_table) != _seen[1]:
        _look()
    if _plain_first:
        try:
            return pickle.dumps(obj, protocol=5, buffer_callback=keep)
        except Exception:  # noqa: BLE001 - maybe a registered reducer takes it (a socket)
            buffers.clear()
    out = io.BytesIO()
    pickler = pickle.Pickler(out, 5, buffer_callback=keep)
    pickler.dispatch_table = _table
    pickler.dump(obj)
    return out.getvalue()


def _dumps(obj: Any, bulk_min: int) -> list[Any]:
    buffers: list[pickle.PickleBuffer] = []

    def keep(pb: pickle.PickleBuffer) -> bool:
        with pb.raw() as m:
            if m.nbytes < OOB_THRESHOLD:
                return True  # in band
        buffers.append(pb)
        return False

    target = _Reduced(obj) if type(obj) is bytes and len(obj) >= OOB_THRESHOLD else obj
    data = _pickle(target, keep, buffers)
    if not buffers:
        if bulk_min and len(data) >= bulk_min:
            return [[header(KIND_BULK, len(data))], data, []]
        return [[header(KIND_DATA, len(data)), data]]
    raws = [pb.raw() for pb in buffers]
    table = b"".join(META.pack(m.nbytes, FLAG_BYTES if m.readonly else 0) for m in raws)
    head = LENGTH.pack(len(raws))
    parts: list[Any] = [header(KIND_OBJECT, len(head) + len(table) + len(data)), head, table, data]
    segments: list[Any] = [parts]
    for m in raws:
        if bulk_min and m.nbytes >= bulk_min:
            parts.append(header(KIND_BULK, m.nbytes))
            parts = []
            segments += [m, parts]
        else:
            parts.append(header(KIND_BUFFER, m.nbytes))
            parts.append(m)
    return segments


def parse_object(payload: bytes) -> tuple[bytes, list[tuple[int, int]]]:
    """Split an OBJECT frame into its pickle and the (length, flags) of each buffer."""
    if len(payload) < LENGTH.size:
        raise FrameError(f"object frame of {len(payload):,} bytes is too short for its table")
    (n,) = LENGTH.unpack_from(payload, 0)
    end = LENGTH.size + n * META.size
    if end > len(payload):
        raise FrameError(
            f"object frame lists {n:,} out-of-band buffers but is only {len(payload):,} bytes"
        )
    table = [META.unpack_from(payload, LENGTH.size + i * META.size) for i in range(n)]
    return payload[end:], table


def dumps_inband(obj: Any) -> bytes:
    """``obj`` as one in-band pickle (what ``recv_bytes`` returns for an object frame)."""
    return pickle.dumps(obj, protocol=5)


def loads(data: Any, buffers: list[Any] | None = None) -> Any:
    return pickle.loads(data, buffers=buffers)
