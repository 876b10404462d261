"""The wire format: frame kinds and their check bytes, the header codec and the frame cap.

A frame is ``CHECK`` + u64 length (native byte order, ``struct`` format ``"Q"``) + ``CHECK`` +
payload, where ``CHECK`` is two equal bytes naming the frame's kind. At a frame boundary a
TIMEOUT sentinel (``01 01`` alone) or a DEAD sentinel (``02 02`` + u64 exit status word) may
appear instead. The compiled engine decodes headers in C (``csrc/fp.h``) with the same rules.

A connection with a bulk channel over a pipe (``Pipe(duplex=False)``, ``Pipe(pipes=True)``)
pads small messages: see PAD_MIN.
"""

from __future__ import annotations

import os
import socket
import stat
import struct
from typing import Any, TypeVar

CHECK = b"\x00\x00"  # a data frame
TIMEOUT = b"\x01\x01"  # reference writers' timeout sentinel, alone at a frame boundary
DEAD = b"\x02\x02"  # + u64 status: the writer died
ERROR = b"\x03\x03"  # a serialized exception (framepipe.remote)
OBJECT = b"\x04\x04"  # a pickle whose large buffers follow as BUFFER frames
BUFFER = b"\x05\x05"  # one out-of-band buffer of the OBJECT frame before it
BULK = b"\x06\x06"  # a data or buffer frame whose payload travels on the bulk channel
PAD = b"\x07\x07"  # filler after a small message, which readers skip (see PAD_MIN)

KIND_DATA, KIND_TIMEOUT, KIND_DEAD, KIND_ERROR, KIND_OBJECT, KIND_BUFFER = 0, 1, 2, 3, 4, 5
KIND_BULK, KIND_PAD = 6, 7
CHECK_BY_KIND = dict(enumerate((CHECK, TIMEOUT, DEAD, ERROR, OBJECT, BUFFER, BULK, PAD)))

LENGTH = struct.Struct("Q")
HEADER_SIZE = 2 + LENGTH.size + 2
DEAD_SIZE = 2 + LENGTH.size

# Payloads at least this large go on the bulk channel when a connection has one: a socketpair
# with 4 MiB buffers moves large frames two to three times faster than a pipe, while a pipe
# keeps the lower latency of small frames. Measured crossover: 4 KiB payloads move faster on
# the pipe, 16 KiB and more on the socket.
BULK_MIN = 16 * 1024

# On a SOCK_SEQPACKET socket (a duplex Pipe()) every write is one record, which a read takes
# whole or loses the rest of. Readers read at a frame's start, and whenever less than
# RECORD_MAX bytes of the frame are still to come, into a buffer of READ_BUFFER bytes; else
# straight into the payload, with room for all that is still to come. So writers cut their
# bytes into records of at most RECORD_MAX, except that a record of one frame that is not its
# first may be as long as FRAME_RECORD_MAX (it never runs past the frame's end). A frame under
# RECORD_MAX then arrives, header and payload, in one read, a read never takes a byte past its
# frame's record, and a large frame moves in few records.
READ_BUFFER = 64 * 1024
RECORD_MAX = READ_BUFFER - 64
FRAME_RECORD_MAX = 1 << 20

# A pipe reader that must never take a byte past the message it returns reads a frame's header
# first and its payload next: two read() calls a message. Where both ends are framepipe's (a
# connection with a bulk channel already speaks a wire of its own: its BULK frames), writers
# make the first write of every message at least PAD_MIN bytes long, ending a shorter one with
# a PAD frame (``07 07`` + u64 length + ``07 07`` + that many zero bytes, at least a header),
# and readers read PAD_MIN bytes at a message's start. One read() then takes a small message
# whole, never past its end, and the PAD that follows it, which readers drop at once: the fd
# stays readable exactly while a message is left in it. (A write of up to PIPE_BUF bytes is
# atomic, so the PAD's first byte always comes with the message.) Measured on 64 B messages
# one way: 1.3-1.6x the messages/s of two reads.
PAD_MIN = 256


def pad_frame(first: int) -> bytes:
    """The PAD frame to end a message whose first write is ``first`` bytes long (b"" when that
    is PAD_MIN or more)."""
    if first >= PAD_MIN:
        return b""
    n = max(PAD_MIN - first - HEADER_SIZE, 0)
    return _PAD_HEADERS[n] + bytes(n)


def pads(fd: int, wfd: int, bfd: int, bwfd: int) -> tuple[bool, bool]:
    """Whether a connection over these fds (-1: none) reads padded messages (its read fd a pipe
    with a bulk channel) and writes them (its write fd a pipe with a bulk channel)."""

    def pipe(f: int) -> bool:
        try:
            return f >= 0 and stat.S_ISFIFO(os.fstat(f).st_mode)
        except OSError:
            return False  # like the stdlib: a bad handle fails on first use

    return bfd >= 0 and pipe(fd), bwfd >= 0 and pipe(wfd)


def padded(segments: list[Any]) -> list[Any]:
    """A message given as ``[pipe_parts, bulk_payload, pipe_parts, ...]`` with its first
    write, ``pipe_parts`` of the first segment, padded to PAD_MIN (see PAD_MIN)."""
    first = segments[0]
    assert isinstance(first, list)
    size = sum(memoryview(p).nbytes for p in first)
    if size >= PAD_MIN:
        return segments
    return [[*first, pad_frame(size)], *segments[1:]]


# Python makes a socket object's fd non-blocking when socket.setdefaulttimeout() has set a
# timeout, unless the type it is given carries SOCK_NONBLOCK: then it leaves the fd alone.
_LEAVE_FLAGS = getattr(socket, "SOCK_NONBLOCK", 0)


_Socket = TypeVar("_Socket", bound=socket.socket)


def socket_view(fd: int, kind: int, cls: type[_Socket]) -> _Socket:
    """A ``cls`` socket object over the socket ``fd`` that leaves the fd's flags alone;
    ``detach()`` it when done, so that it never closes ``fd``. Its calls never wait on their
    own (timeout 0): the fd's own blocking mode decides whether a call without MSG_DONTWAIT
    blocks."""
    return cls(socket.AF_UNIX, kind | _LEAVE_FLAGS, 0, fd)


def record_limits(fd: int) -> tuple[int, int]:
    """The longest records a write to ``fd`` may make: ``(any record, a record of one frame
    that is not its first)``, ``(0, 0)`` (no limit) unless ``fd`` is a SOCK_SEQPACKET socket;
    there RECORD_MAX and FRAME_RECORD_MAX, or less when its send buffer cannot hold that."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return 0, 0
    except OSError:
        return 0, 0  # like the stdlib: a bad handle fails on first use
    sock = socket_view(fd, socket.SOCK_STREAM, socket.socket)
    try:
        if sock.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) != socket.SOCK_SEQPACKET:
            return 0, 0
        try:  # the kernel refuses a record longer than the send buffer
            room = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) // 2
        except OSError:
            room = RECORD_MAX
        first = max(min(RECORD_MAX, room), 1024)
        return first, max(min(FRAME_RECORD_MAX, room), first)
    except OSError:
        return 0, 0
    finally:
        sock.detach()


def records_of(fd: int, wfd: int) -> tuple[bool, int, int]:
    """For a connection reading ``fd`` and writing ``wfd`` (-1: none): ``(whether its reads
    take whole records, its writes' record_limits)``."""
    reads = record_limits(fd)
    writes = reads if wfd == fd else record_limits(wfd) if wfd >= 0 else (0, 0)
    return reads[0] > 0, writes[0], writes[1]


# How a read with no deadline and no watch waits for data: in poll() (0), where a close() in
# another thread wakes it through the wake fd, or in read() itself, one system call instead of
# two, where the close() has to reach it through the fd: a pipe's by writing into it, a
# socket's by shutting its reading down (see read_waits for when).
READ_WAITS_NONE, READ_WAITS_PIPE, READ_WAITS_SOCKET = 0, 1, 2


def read_waits(mode: int, pipe_wake: bool, owned: bool) -> int:
    """How reads of a fd whose ``st_mode`` is ``mode`` wait (READ_WAITS_*); ``pipe_wake``:
    whether this system can write into a pipe it only reads (Linux's /proc/self/fd); ``owned``:
    whether the connection owns the fd (``closefd``). A socket's reads wait in recv() only on a
    socket the connection owns, used in the process that opened it (a forked child's copy
    waits in poll(): see the engines' _renew_locks_after_fork), because the wake shuts the
    socket's reading down for every process that holds it."""
    if stat.S_ISFIFO(mode):
        return READ_WAITS_PIPE if pipe_wake else READ_WAITS_NONE
    return READ_WAITS_SOCKET if stat.S_ISSOCK(mode) and owned else READ_WAITS_NONE


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


_PAD_HEADERS = [header(KIND_PAD, n) for n in range(PAD_MIN)]


# What decode_header finds (the status codes of csrc/fp.h).
OK, MORE, BAD_CHECK, MISMATCH, TOO_LARGE = 0, 4, 5, 6, 7


def decode_header(buf: bytes | bytearray, start: int, cap: int) -> tuple[int, int, int, int]:
    """Decode the header or sentinel at ``buf[start:]`` (a frame boundary): ``(status, kind,
    value, size)`` as ``fp_header_decode`` in csrc/fp.c, whose rules it restates. ``status``
    is OK (``value``: the payload length, or a DEAD sentinel's status word; ``size``: bytes to
    skip), MORE (``size``: bytes needed), BAD_CHECK, MISMATCH, or TOO_LARGE (``value``: the
    length over ``cap``, or a PAD frame's over PAD_MIN)."""
    avail = len(buf) - start
    if avail < 2:
        return MORE, -1, 0, 2
    kind = buf[start]
    if buf[start + 1] != kind or kind > KIND_PAD:
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
    if value > (PAD_MIN if kind == KIND_PAD else cap):
        return TOO_LARGE, kind, value, size
    return OK, kind, value, size


def dead_sentinel(status_word: int) -> bytes:
    """A DEAD sentinel carrying ``status_word`` (see ``framepipe.watch.dead_status_word``)."""
    return DEAD + LENGTH.pack(status_word)
