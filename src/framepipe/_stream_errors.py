"""The errors both engines raise about the stream, built in one place so that the compiled
engine and its pure-Python twin say the same thing in the same situation."""

from __future__ import annotations

import os
from collections.abc import Callable

from ._wire import BAD_CHECK, CHECK_BY_KIND, FRAME_CAP, KIND_PAD, MISMATCH, PAD_MIN
from .errors import FrameError, ReadTimeout

# At end of file on a watched connection, the writer's fds have closed; whether it died (so
# the error is WriterDied) shows a little later, when the kernel or the interpreter finishes
# the exit. Both engines wait for that up to DEATH_GRACE seconds, looking first without
# sleeping for DEATH_SPIN seconds: the death usually shows within microseconds of the end of
# file, and one more sleep and wake-up would cost more than that on a busy machine. The look
# stays short: a reader that keeps a CPU busy looking can keep the dying writer from finishing
# its exit on that CPU (measured on 2 CPUs: a 0.5 ms spin made the median death seen 1.3x
# later in one run of three, 50 us never did).
DEATH_GRACE = 1.0
DEATH_SPIN = 50e-6


def _spin_seconds() -> float:
    try:
        us = float(os.environ.get("FRAMEPIPE_SPIN_US", "50"))
    except ValueError:
        return 50e-6
    return max(us, 0.0) * 1e-6 if us == us else 50e-6


# A read that finds nothing to read tries again without sleeping for up to SPIN seconds before
# it sleeps in the kernel, when this process may run on more than one CPU and the reads of
# this connection have lately waited, on average, less than SPIN but not less than SPIN_FLOOR
# (the writer answers within microseconds, from another CPU): the bytes then arrive with no
# wake-up on either side, which on a VM costs several microseconds a hop. Reads whose writer
# takes longer, and processes pinned to one CPU (where spinning would only delay the writer),
# sleep at once. The environment variable FRAMEPIPE_SPIN_US sets SPIN in microseconds (0: never
# spin); it is read at import.
SPIN = _spin_seconds()
# The average is a moving one (each wait weighs SPIN_WEIGHT) of waits counted at most
# SPIN_LONGEST_SAMPLE: after a long sleep a few quick answers bring the spin back.
SPIN_WEIGHT = 0.125
SPIN_LONGEST_SAMPLE = 1e-3
# An average under SPIN_AVERAGE_ZERO is 0. A reader that never waits counts waits of 0, and the
# average would shrink into subnormal numbers and stay there (the smallest one times 7/8 rounds
# back to itself), where each arithmetic operation takes the CPU a hundred cycles or more: in
# the compiled engine that was most of a streaming read's own time.
SPIN_AVERAGE_ZERO = 1e-9
# Nor does a read spin while the average is under SPIN_FLOOR: then the writer is streaming
# faster than the reader needs to wait, and a reader that sleeps a little lets several messages
# pile up for it instead of contending with the writer for the pipe at every message (measured:
# a one-way stream of 64 B messages ran about 9% slower with a spin and no floor).
SPIN_FLOOR = 2e-6
# How often (in spin decisions) the CPUs this process may use are looked up again.
SPIN_CPU_CHECKS = 4096


def usable_cpus() -> int:
    """How many CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def several_cpus() -> bool:
    """Whether this process may run on more than one CPU (spinning can pay)."""
    return usable_cpus() > 1


_spin_cpus = False
_spin_checks = 0  # decisions left before the next look-up
_spin_allowed = True


_spin_listeners: list[Callable[[bool], None]] = []


def on_allow_spin(listener: Callable[[bool], None]) -> None:
    """Call ``listener(allowed)`` now and on every allow_spin() (the compiled engine keeps the
    answer where its reads look it up without a call into Python)."""
    _spin_listeners.append(listener)
    listener(_spin_allowed)


def allow_spin(allowed: bool) -> None:
    """Let this process's reads spin (the default), or not. A worker pool turns it off in its
    workers when they and the parent would need more CPUs than there are: a worker spinning for
    its next task takes a CPU the parent, or a dying worker's teardown, is waiting for."""
    global _spin_allowed
    _spin_allowed = allowed
    for listener in _spin_listeners:
        listener(allowed)


def workers_may_spin(workers: int) -> bool:
    """Whether ``workers`` worker processes and this one fit on this process's CPUs: a pool or
    loader lets its workers spin (see allow_spin) only then."""
    return workers + 1 <= usable_cpus()


def may_spin() -> bool:
    """Whether a read of either engine may spin: SPIN is on, the process allows it (see
    allow_spin) and may run on more than one CPU (looked up again every SPIN_CPU_CHECKS calls,
    and first thing after a fork)."""
    global _spin_cpus, _spin_checks
    if SPIN <= 0.0 or not _spin_allowed:
        return False
    _spin_checks -= 1
    if _spin_checks < 0:
        _spin_checks = SPIN_CPU_CHECKS
        _spin_cpus = several_cpus()
    return _spin_cpus


def _look_again_after_fork() -> None:
    global _spin_checks
    _spin_checks = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_look_again_after_fork)


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
