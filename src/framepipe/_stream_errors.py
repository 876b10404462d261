"""The errors both engines raise about the stream, built in one place so that the compiled
engine and its pure-Python twin say the same thing in the same situation."""

from __future__ import annotations

from ._wire import BAD_CHECK, CHECK_BY_KIND, FRAME_CAP, KIND_PAD, MISMATCH, PAD_MIN
from .errors import FrameError, ReadTimeout


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


def bad_header(
    status: int, head: bytes, length: int, max_size: int | None, offset: int
) -> FrameError:
    """The error for what ``decode_header``/``fp_header_decode`` refused with ``status``:
    ``head`` holds the bytes at the frame boundary, ``length`` the length over the cap."""
    if status == BAD_CHECK:
        return bad_check(head[:2], offset, "at a frame boundary")
    if status == MISMATCH:
        return mismatched_checks(head[:2], head[10:12], offset)
    if head[:2] == CHECK_BY_KIND[KIND_PAD]:
        return FrameError(
            f"a PAD frame (07 07) at stream offset {offset:,} announces {length:,} bytes, over "
            f"the {PAD_MIN} a PAD frame may hold: the writer does not pad as framepipe's do "
            "(see framepipe._wire.PAD_MIN); the connection is now broken"
        )
    return too_large(length, max_size, offset)


def unallocatable(length: int, offset: int) -> FrameError:
    return FrameError(
        f"frame at stream offset {offset:,} announces {length:,} bytes, more than this process "
        "could allocate (MemoryError); the connection is now broken (pass max_size= to refuse "
        "such frames before allocating)"
    )


def no_bulk_channel(length: int, offset: int) -> FrameError:
    return FrameError(
        f"a bulk frame of {length:,} bytes arrived at stream offset {offset:,} but this "
        "connection has no bulk channel to read its payload from; this connection is now "
        "broken (make both ends with framepipe's pipe(), or pass bulk_handle=)"
    )


def truncated(got: int, expected: int) -> FrameError:
    return FrameError(
        f"got end of file during message: the writer closed the connection after {got:,} of "
        f"the {expected:,} bytes of a frame (header included)"
    )


def record_too_long(room: int, consumed: int) -> FrameError:
    """A SOCK_SEQPACKET record did not fit the read: the kernel dropped its rest."""
    return FrameError(
        f"a record of the socket was longer than the {room:,} bytes its read had room for (the "
        f"read buffer, or the rest of a frame) after byte {consumed:,} of the stream, so the "
        "kernel dropped its rest: the writer does not cut its records as a framepipe "
        "connection does (see framepipe._wire.RECORD_MAX); give such a writer a SOCK_STREAM "
        "socket"
    )


def broken(reason: BaseException) -> FrameError:
    return FrameError(f"connection is broken by an earlier protocol error: {reason}")


def missing_buffer(kind: int, got: int, expected: int | None) -> FrameError:
    """A frame of ``kind`` arrived where a message (``expected`` None) or an object's
    out-of-band buffer of ``expected`` bytes was due."""
    seen = CHECK_BY_KIND.get(kind, b"??").hex(" ")
    if expected is None:
        return FrameError(
            f"a frame of kind {seen} ({got:,} bytes) arrived where a message was expected; the "
            "stream is out of sync and this connection is now broken"
        )
    return FrameError(
        f"an object's out-of-band buffer of {expected:,} bytes was expected but a frame of kind "
        f"{seen} ({got:,} bytes) arrived; this connection is now broken"
    )


def watched(conn: object) -> bool:
    """Whether ``conn`` watches its writer (see ``Connection.watch``)."""
    return getattr(conn, "_watch_handle", None) is not None


def timeout_error(
    timeout: float | None, lost: int = 0, expected: int | None = None, watched: bool = True
) -> ReadTimeout:
    """The read deadline passed; ``lost`` and ``expected`` are what the connection's
    ``_lost()`` says of the frame in progress (``expected`` None: between frames);
    ``watched`` is False when no writer is watched (the message then names ``watch``)."""
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
    if timeout is not None and timeout <= 0:
        if expected is None and not lost:
            return ReadTimeout(
                f"no frame had arrived (timeout={timeout:g} does not wait: a timeout of 0 or "
                "less reads only what has already arrived); nothing was lost"
            )
        head = f"the frame had not arrived whole (timeout={timeout:g} does not wait)"
    else:
        head = f"timed out after {timeout:g} s" if timeout is not None else "timed out"
    if not watched and expected is None and not lost and timeout is not None and timeout > 0:
        # nothing came: a writer that died may be why, and only a watched one says so
        return ReadTimeout(
            f"{head}: nothing arrived; if the writer may have died, conn.watch(process) makes "
            "a read raise WriterDied as soon as it does (nothing was lost)"
        )
    return ReadTimeout(f"{head}: {state}")


def sentinel_timeout() -> ReadTimeout:
    exc = ReadTimeout("the writer sent a TIMEOUT sentinel: its read deadline expired")
    exc.sentinel = True
    return exc


def closed() -> OSError:
    """What a call on a closed connection raises (the stdlib's words)."""
    return OSError("handle is closed")


def closed_while_waiting() -> OSError:
    """What a read, poll or write under way in one thread raises when another thread closes
    the connection."""
    return OSError(
        "handle is closed: another thread closed this connection while this call was using it"
    )


def blocking_send_under_async_send() -> RuntimeError:
    return RuntimeError(
        "an async send on this thread's event loop is in the middle of a frame on this "
        "connection, so a blocking send here would wait for it forever; await the async send "
        "first, or send with send_bytes_async()/send_async() here too"
    )
