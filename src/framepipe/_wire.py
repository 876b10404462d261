"""The wire format: frame kinds and their check bytes, the header codec and the frame cap.

A frame is ``CHECK`` + u64 length (native byte order, ``struct`` format ``"Q"``) + ``CHECK`` +
payload, where ``CHECK`` is two equal bytes naming the frame's kind. At a frame boundary a
TIMEOUT sentinel (``01 01`` alone) or a DEAD sentinel (``02 02`` + u64 exit status word) may
appear instead. The compiled engine decodes headers in C (``csrc/fp.h``) with the same rules.
"""

from __future__ import annotations

import struct

CHECK = b"\x00\x00"  # a data frame
TIMEOUT = b"\x01\x01"  # reference writers' timeout sentinel, alone at a frame boundary
DEAD = b"\x02\x02"  # + u64 status: the writer died
ERROR = b"\x03\x03"  # a serialized exception (framepipe.remote)
OBJECT = b"\x04\x04"  # a pickle whose large buffers follow as BUFFER frames
BUFFER = b"\x05\x05"  # one out-of-band buffer of the OBJECT frame before it
BULK = b"\x06\x06"  # a data or buffer frame whose payload travels on the bulk channel

KIND_DATA, KIND_TIMEOUT, KIND_DEAD, KIND_ERROR, KIND_OBJECT, KIND_BUFFER = 0, 1, 2, 3, 4, 5
KIND_BULK = 6
CHECK_BY_KIND = dict(enumerate((CHECK, TIMEOUT, DEAD, ERROR, OBJECT, BUFFER, BULK)))

LENGTH = struct.Struct("Q")
HEADER_SIZE = 2 + LENGTH.size + 2
DEAD_SIZE = 2 + LENGTH.size

# Payloads at least this large go on the bulk channel when a connection has one: a socketpair
# with 4 MiB buffers moves large frames two to three times faster than a pipe, while a pipe
# keeps the lower latency of small frames. Measured crossover: 4 KiB payloads move faster on
# the pipe, 16 KiB and more on the socket.
BULK_MIN = 16 * 1024

# The frame cap: the largest payload a frame may announce on a connection without max_size.
# Both engines refuse a longer length before allocating anything (no process can hold 2**62
# bytes, so such a length is garbage: 2**63 and 2**64-1 would not even fit a Py_ssize_t). A
# length under the cap that the process cannot allocate is refused the same way, after the
# attempt; max_size lowers the cap.
FRAME_CAP = 1 << 62


def frame_cap(max_size: int | None) -> int:
    """The cap on announced payload lengths for a connection with this ``max_size``."""
    return FRAME_CAP if max_size is None else min(max_size, FRAME_CAP)


def header(kind: int, length: int) -> bytes:
    """The 12-byte header of a frame of ``kind`` whose payload is ``length`` bytes."""
    check = CHECK_BY_KIND[kind]
    return check + LENGTH.pack(length) + check


# What decode_header finds (the status codes of csrc/fp.h).
OK, MORE, BAD_CHECK, MISMATCH, TOO_LARGE = 0, 4, 5, 6, 7


def decode_header(buf: bytes | bytearray, start: int, cap: int) -> tuple[int, int, int, int]:
    """Decode the header or sentinel at ``buf[start:]`` (a frame boundary): ``(status, kind,
    value, size)`` as ``fp_header_decode`` in csrc/fp.c, whose rules it restates. ``status``
    is OK (``value``: the payload length, or a DEAD sentinel's status word; ``size``: bytes to
    skip), MORE (``size``: bytes needed), BAD_CHECK, MISMATCH, or TOO_LARGE (``value``: the
    length over ``cap``)."""
    avail = len(buf) - start
    if avail < 2:
        return MORE, -1, 0, 2
    kind = buf[start]
    if buf[start + 1] != kind or kind > KIND_BULK:
        return BAD_CHECK, -1, 0, 0
    if kind == KIND_TIMEOUT:
        return OK, kind, 0, 2
    size = DEAD_SIZE if kind == KIND_DEAD else HEADER_SIZE
    if avail < size:
        return MORE, kind, 0, size
    (value,) = LENGTH.unpack_from(buf, start + 2)
    if kind == KIND_DEAD:
        return OK, kind, value, size
    if buf[start + 10] != kind or buf[start + 11] != kind:
        return MISMATCH, kind, 0, size
    if value > cap:
        return TOO_LARGE, kind, value, size
    return OK, kind, value, size


def dead_sentinel(status_word: int) -> bytes:
    """A DEAD sentinel carrying ``status_word`` (see ``framepipe.watch.dead_status_word``)."""
    return DEAD + LENGTH.pack(status_word)
