"""What both cores share that is not on the hot path: the wire constants, the error messages,
object (de)serialisation with out-of-band buffers, and the hand-off to the exception layer.

Neither core knows which implementation runs; both call these helpers with the same arguments,
so the two raise the same errors with the same text.
"""

from __future__ import annotations

import os
import pickle
import struct
from typing import Any

from .errors import FrameError, ReadTimeout, WriterDied

CHECK = b"\x00\x00"  # a data frame
TIMEOUT = b"\x01\x01"  # reference writers' timeout sentinel, alone at a frame boundary
DEAD = b"\x02\x02"  # + u64 status: the writer died
ERROR = b"\x03\x03"  # a serialized exception (framepipe.remote)
OBJECT = b"\x04\x04"  # a pickle whose large buffers follow as BUFFER frames
BUFFER = b"\x05\x05"  # one out-of-band buffer of the OBJECT frame before it
BULK = b"\x06\x06"  # a data or buffer frame whose payload travels on the bulk channel

KIND_DATA, KIND_TIMEOUT, KIND_DEAD, KIND_ERROR, KIND_OBJECT, KIND_BUFFER = 0, 1, 2, 3, 4, 5
KIND_BULK = 6
KIND_BY_CHECK = {CHECK: 0, TIMEOUT: 1, DEAD: 2, ERROR: 3, OBJECT: 4, BUFFER: 5, BULK: 6}
CHECK_BY_KIND = {v: k for k, v in KIND_BY_CHECK.items()}
FRAMED_KINDS = (KIND_DATA, KIND_ERROR, KIND_OBJECT, KIND_BUFFER, KIND_BULK)

LENGTH = struct.Struct("Q")
HEADER_SIZE = 2 + LENGTH.size + 2
DEAD_SIZE = 2 + LENGTH.size
OOB_THRESHOLD = 64 * 1024  # buffers at least this large travel out of band
# Payloads at least this large go on the bulk channel when a connection has one: a socketpair
# with 4 MiB buffers moves large frames two to three times faster than a pipe, while a pipe
# keeps the lower latency of small frames (measured: see the README).
# Measured crossover: 4 KiB payloads move faster on the pipe, 16 KiB and more on the socket.
BULK_MIN = 16 * 1024
BULK_BUFFER_SIZE = 4 << 20  # SO_SNDBUF / SO_RCVBUF of the bulk socketpairs (best effort)
_META = struct.Struct("QQ")  # (length, flags) of each out-of-band buffer
FLAG_BYTES = 1  # the buffer is rebuilt as an immutable bytes object
# The frame cap: the largest payload a frame may announce on a connection without max_size.
# Both cores refuse a longer length before allocating anything (no process can hold 2**62
# bytes, so such a length is garbage: 2**63 and 2**64-1 would not even fit a Py_ssize_t). A
# length under the cap that the process cannot allocate is refused the same way, after the
# attempt; max_size lowers the cap.
FRAME_CAP = 1 << 62


def frame_cap(max_size: int | None) -> int:
    """The cap on announced payload lengths for a connection with this ``max_size``."""
    return FRAME_CAP if max_size is None else min(max_size, FRAME_CAP)


def header(kind: int, length: int) -> bytes:
    check = CHECK_BY_KIND[kind]
    return check + LENGTH.pack(length) + check


def dead_status(data: bytes) -> int:
    """The status word of a DEAD sentinel (see ``framepipe.watch.dead_status_word``)."""
    return int(LENGTH.unpack(data)[0])


# --- errors, built in one place so both cores say the same thing -------------------------


def bad_check(seen: bytes, offset: int, where: str) -> FrameError:
    return FrameError(
        f"bad check bytes {seen.hex(' ')} {where} at stream offset {offset:,} (expected 00 00 "
        "or a known sentinel); the stream is out of sync and this connection is now broken: "
        "was the other end written by something other than a framepipe writer, or by two "
        "unsynchronised writers?"
    )


def mismatched_checks(first: bytes, second: bytes, offset: int) -> FrameError:
    return FrameError(
        f"frame header at stream offset {offset:,} opens with {first.hex(' ')} but its second "
        f"check bytes are {second.hex(' ')}; the stream is out of sync and this connection is "
        "now broken"
    )


def too_large(length: int, max_size: int | None, offset: int) -> FrameError:
    if max_size is None or max_size > FRAME_CAP:
        limit = f"the frame cap of {FRAME_CAP:,} (2**62)"
    else:
        limit = f"this connection's max_size of {max_size:,}"
    return FrameError(
        f"frame at stream offset {offset:,} announces {length:,} bytes, over {limit}; nothing "
        "was allocated and the connection is now broken (raise max_size if such frames are "
        "expected)"
    )


def unallocatable(length: int, offset: int) -> FrameError:
    return FrameError(
        f"frame at stream offset {offset:,} announces {length:,} bytes, more than this process "
        "could allocate (MemoryError); the connection is now broken (pass max_size= to refuse "
        "such frames before allocating)"
    )


def truncated(got: int, expected: int) -> FrameError:
    return FrameError(
        f"got end of file during message: the writer closed the connection after {got:,} of "
        f"the {expected:,} bytes of a frame (header included)"
    )


def broken(reason: BaseException) -> FrameError:
    return FrameError(f"connection is broken by an earlier protocol error: {reason}")


def timeout_error(timeout: float | None, lost: int = 0, expected: int | None = None) -> ReadTimeout:
    """The read deadline passed; ``lost`` and ``expected`` are what the connection's
    ``_lost()`` says of the frame in progress (``expected`` None: between frames)."""
    if expected is not None:
        state = (
            f"{lost:,} of the {expected:,} bytes of a frame (header included) had arrived; "
            "they are kept and the next read returns the frame whole"
        )
    elif lost:
        state = (
            f"{lost:,} bytes of the next frame's header had arrived; they are kept and the "
            "next read returns the frame whole"
        )
    else:
        state = "between frames, no byte of the next frame had arrived; nothing was lost"
    return ReadTimeout(f"timed out after {timeout} s: {state}")


def check_timeout(timeout: Any) -> float | None:
    """A read or poll timeout as seconds (None: no deadline); NaN is refused like the stdlib
    refuses it, a negative timeout means "do not wait", as in the stdlib's ``poll()``."""
    if timeout is None:
        return None
    t = float(timeout)
    if t != t:
        raise ValueError(
            "timeout is NaN; pass a number of seconds (0 or less: do not wait) or None to "
            "wait without a deadline"
        )
    return t


def check_exception(exc: Any) -> None:
    """send_exception() takes an exception instance; anything else is refused here, at the
    sender, rather than discovered by the reader."""
    if not isinstance(exc, BaseException):
        if isinstance(exc, type) and issubclass(exc, BaseException):
            hint = f"an instance, e.g. send_exception({exc.__name__}(...)), not the class"
        else:
            hint = "an exception instance; send ordinary objects with send()"
        raise TypeError(f"send_exception() takes {hint}; got {type(exc).__name__}: {exc!r:.80}")


def check_watch(target: Any, readable: bool) -> None:
    """Refuse watches that cannot work: on a connection that cannot read, of this process
    itself (it can never be seen dead by itself), and of a pid that does not exist."""
    if target is None:
        return
    if not readable:
        raise ValueError(
            "cannot watch a writer on a write-only connection: a watch makes reads raise "
            "WriterDied; watch the writer on the connection that reads from it"
        )
    from .watch import resolve_target

    pid, obj = resolve_target(target)
    if pid == os.getpid():
        raise ValueError(
            f"cannot watch pid {pid}: it is this process, which can never see its own death; "
            "watch the process that writes to this connection"
        )
    if obj is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            raise ProcessLookupError(
                f"cannot watch pid {pid}: no such process (it never existed or has already "
                "exited and been reaped); watch the Process or Popen object instead of its pid "
                "to get its exit status even after it was reaped"
            ) from None
        except PermissionError:
            pass  # it exists, owned by someone else


def fd_identity(fd: int) -> tuple[int, int] | None:
    """``(st_dev, st_ino)`` of ``fd``, or None when it cannot be read (a bad fd)."""
    try:
        st = os.fstat(fd)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def close_owned(fds: tuple[int, ...], identities: tuple[Any, ...]) -> None:
    """Close each distinct fd of ``fds`` that is still the file it was when the connection
    took it (same ``fd_identity``). A number closed behind the connection's back and reused
    since (by framepipe's watcher, or anything else) is left alone, and so is an fd that was
    not open when the connection took it (a bad handle, which failed on its first use)."""
    seen = set()
    for fd, ident in zip(fds, identities):
        if fd < 0 or fd in seen:
            continue
        seen.add(fd)
        if ident is not None and fd_identity(fd) == ident:
            os.close(fd)


def sentinel_timeout() -> ReadTimeout:
    exc = ReadTimeout("the writer sent a TIMEOUT sentinel: its read deadline expired")
    exc.sentinel = True
    return exc


def dead_error(status: int, liveness: Any) -> WriterDied:
    """A DEAD sentinel was read: the watched writer's own account when there is one, else
    what the status word says (a code, 128 + signal, or all ones when unknown)."""
    if liveness is not None:
        return liveness.error()  # type: ignore[no-any-return]
    from .watch import exitcode_from_status_word

    return WriterDied(None, exitcode_from_status_word(status))


def blocking_send_under_async_send() -> RuntimeError:
    return RuntimeError(
        "an async send on this thread's event loop is in the middle of a frame on this "
        "connection, so a blocking send here would wait for it forever; await the async send "
        "first, or send with send_bytes_async()/send_async() here too"
    )


def writer_died(liveness: Any, lost: int, expected: int | None) -> WriterDied:
    return liveness.error(lost_bytes=lost, expected_bytes=expected)  # type: ignore[no-any-return]


def check_handles(
    handle: Any, readable: bool, writable: bool, write_handle: Any
) -> tuple[int, int]:
    """Validate a Connection's fds: ``(read fd, write fd)``, the same fd unless a separate
    ``write_handle`` makes a duplex connection over two pipes."""
    fd = handle.__index__()
    if fd < 0:
        raise ValueError("invalid handle")
    if not readable and not writable:
        raise ValueError("at least one of `readable` and `writable` must be True")
    if write_handle is None:
        return fd, fd
    wfd = write_handle.__index__()
    if wfd < 0:
        raise ValueError("invalid write_handle")
    if not (readable and writable):
        raise ValueError(
            "write_handle makes a duplex connection: readable and writable must be True"
        )
    return fd, wfd


def check_bulk_handles(
    bulk_handle: Any, bulk_write_handle: Any, readable: bool, writable: bool
) -> tuple[int, int]:
    """Validate a Connection's bulk channel: ``(bulk read fd, bulk write fd)``, -1 for none.

    ``bulk_handle`` is read when the connection is readable and written when it is writable,
    unless ``bulk_write_handle`` gives a separate fd to write (a duplex connection)."""
    if bulk_handle is None:
        if bulk_write_handle is not None:
            raise ValueError("bulk_write_handle needs a bulk_handle to read from")
        return -1, -1
    bfd = bulk_handle.__index__()
    if bfd < 0:
        raise ValueError("invalid bulk_handle")
    if bulk_write_handle is None:
        return (bfd if readable else -1), (bfd if writable else -1)
    bwfd = bulk_write_handle.__index__()
    if bwfd < 0:
        raise ValueError("invalid bulk_write_handle")
    if not (readable and writable):
        raise ValueError(
            "bulk_write_handle makes a duplex bulk channel: readable and writable must be True"
        )
    return bfd, bwfd


def no_bulk_channel(length: int, offset: int) -> FrameError:
    return FrameError(
        f"a bulk frame of {length:,} bytes arrived at stream offset {offset:,} but this "
        "connection has no bulk channel to read its payload from; this connection is now "
        "broken (make both ends with framepipe's pipe(), or pass bulk_handle=)"
    )


def check_send_args(view_len: int, offset: int, size: int | None) -> int:
    """The stdlib's argument checks for send_bytes; returns the size to send."""
    if offset < 0:
        raise ValueError("offset is negative")
    if view_len < offset:
        raise ValueError("buffer length < offset")
    if size is None:
        size = view_len - offset
    elif size < 0:
        raise ValueError("size is negative")
    elif offset + size > view_len:
        raise ValueError("buffer length < offset + size")
    return size


# --- objects --------------------------------------------------------------------------------


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
    """The frames that carry ``obj``, as a list of buffers to write in one go.

    Small objects are one data frame of an in-band pickle (what a reference writer sends).
    Objects holding buffers of 64 KiB or more become an OBJECT frame (the pickle, then a table
    of buffer sizes) followed by one BUFFER frame per buffer, written from the buffer's own
    memory.
    """
    return _dumps(obj, 0)[0]


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
    table = b"".join(
        _META.pack(m.nbytes, FLAG_BYTES if m.readonly else 0) for m in raws
    )
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
    end = LENGTH.size + n * _META.size
    if end > len(payload):
        raise FrameError(
            f"object frame lists {n:,} out-of-band buffers but is only {len(payload):,} bytes"
        )
    table = [_META.unpack_from(payload, LENGTH.size + i * _META.size) for i in range(n)]
    return payload[end:], table


def dumps_inband(obj: Any) -> bytes:
    """``obj`` as one in-band pickle (what ``recv_bytes`` returns for an object frame)."""
    return pickle.dumps(obj, protocol=5)


def missing_buffer(kind: int, got: int, expected: int | None) -> FrameError:
    if expected is None:
        return FrameError(
            f"a frame of kind {CHECK_BY_KIND.get(kind, b'??').hex(' ')} ({got:,} bytes) arrived "
            "where a message was expected; the stream is out of sync and this connection is "
            "now broken"
        )
    return FrameError(
        f"an object's out-of-band buffer of {expected:,} bytes was expected but a frame of kind "
        f"{CHECK_BY_KIND.get(kind, b'??').hex(' ')} ({got:,} bytes) arrived; this connection "
        "is now broken"
    )


def loads(data: Any, buffers: list[Any] | None = None) -> Any:
    return pickle.loads(data, buffers=buffers)


def raise_remote(payload: bytes) -> None:
    """Raise the exception an ERROR frame carries (framepipe.remote revives it)."""
    from .remote import loads_exception

    raise loads_exception(payload)


# --- liveness --------------------------------------------------------------------------------


class _Default:
    __slots__ = ()

    def __repr__(self) -> str:
        return "<the pipe's timeout>"


USE_DEFAULT: Any = _Default()


def start_watch(target: Any, peer: Any) -> tuple[Any, Any]:
    """Watch the writer ``target``; returns ``(liveness, watcher_handle)``.

    ``peer`` is a weak reference to the Connection of this process that holds the write end
    feeding the watched reader, or None. When there is one, the process-wide watcher writes a
    DEAD sentinel through it once the writer's death is confirmed, so a thread blocked in
    ``select()`` or ``multiprocessing.connection.wait()`` on the read end wakes up.
    """
    from .watch import Liveness, dead_status_word, watcher

    liveness = Liveness(target)
    handle = None
    if peer is not None and peer() is not None:

        def on_death(liv: Any) -> None:
            conn = peer()
            if conn is None or conn.closed:
                return
            word = dead_status_word(liv.status()[0])
            try:
                conn._write_sentinel(DEAD + LENGTH.pack(word))
            except OSError:
                pass  # the reader is gone or the pipe is full: readers still see the pidfd

        handle = watcher().register(liveness, on_death)
    return liveness, handle


def stop_watch(liveness: Any, handle: Any) -> None:
    if handle is not None:
        from .watch import watcher

        watcher().unregister(handle)
    if liveness is not None:
        liveness.close()
