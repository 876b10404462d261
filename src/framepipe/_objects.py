"""Objects on the wire: pickle protocol 5 with large buffers out of band.

A small object is one data frame holding an in-band pickle (what a reference writer sends).
An object holding buffers of 64 KiB or more becomes an OBJECT frame (the pickle, then a table of
buffer sizes) followed by one BUFFER frame per buffer, written from the buffer's own memory; on
a connection with a bulk channel, large payloads are announced by a BULK header instead and
travel on the bulk fd.
"""

from __future__ import annotations

import pickle
import struct
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


def _dumps(obj: Any, bulk_min: int) -> list[Any]:
    buffers: list[pickle.PickleBuffer] = []

    def keep(pb: pickle.PickleBuffer) -> bool:
        with pb.raw() as m:
            if m.nbytes < OOB_THRESHOLD:
                return True  # in band
        buffers.append(pb)
        return False

    target = _Reduced(obj) if type(obj) is bytes and len(obj) >= OOB_THRESHOLD else obj
    data = pickle.dumps(target, protocol=5, buffer_callback=keep)
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
