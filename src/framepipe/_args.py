"""The argument checks of a Connection's calls, in one place: misuse is refused with the
stdlib's error (the same class, and its words where it has them) before anything is read or
written, whichever engine runs."""

from __future__ import annotations

import operator
from typing import Any


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


POLL_MAX_MS = float(2**31 - 1)  # the longest wait of one poll(): INT_MAX milliseconds


def poll_ms(seconds: float | None) -> float | None:
    """A wait in seconds (None: no limit) as poll()'s milliseconds: at most INT_MAX, so that a
    longer wait (an infinite timeout) waits that long at a time instead of overflowing."""
    return None if seconds is None else min(seconds * 1000.0, POLL_MAX_MS)


def check_send_args(view_len: int, offset: int, size: int | None) -> int:
    """The stdlib's argument checks for send_bytes; returns the size to send. An offset or
    size that is not an integer is a TypeError, as in the stdlib."""
    offset = operator.index(offset)
    if size is not None:
        size = operator.index(size)
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


def check_handles(
    handle: Any, readable: bool, writable: bool, write_handle: Any
) -> tuple[int, int]:
    """Validate a Connection's fds: ``(read fd, write fd)``, the same fd unless a separate
    ``write_handle`` makes a duplex connection over two pipes."""
    fd = _fd(handle, "handle")
    if not readable and not writable:
        raise ValueError("at least one of `readable` and `writable` must be True")
    if write_handle is None:
        return fd, fd
    return fd, _write_fd(write_handle, "write_handle", "a duplex connection", readable, writable)


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
    bfd = _fd(bulk_handle, "bulk_handle")
    if bulk_write_handle is None:
        return (bfd if readable else -1), (bfd if writable else -1)
    what = "a duplex bulk channel"
    return bfd, _write_fd(bulk_write_handle, "bulk_write_handle", what, readable, writable)


def _fd(handle: Any, name: str) -> int:
    """The fd number of ``handle`` (an int or an object with ``__index__``), checked."""
    fd: int = handle.__index__()
    if fd < 0:
        raise ValueError(f"invalid {name}")
    return fd


def _write_fd(handle: Any, name: str, makes: str, readable: bool, writable: bool) -> int:
    """The fd of ``handle``, a separate fd to write, which ``makes`` a duplex channel: only a
    connection both readable and writable takes one."""
    fd = _fd(handle, name)
    if not (readable and writable):
        raise ValueError(f"{name} makes {makes}: readable and writable must be True")
    return fd


def check_max_size(max_size: Any) -> None:
    if max_size is not None and max_size < 0:
        raise ValueError("max_size must be None or a non-negative number of bytes")


def check_exception(exc: Any) -> None:
    """send_exception() takes an exception instance; anything else is refused here, at the
    sender, rather than discovered by the reader."""
    if not isinstance(exc, BaseException):
        if isinstance(exc, type) and issubclass(exc, BaseException):
            hint = f"an instance, e.g. send_exception({exc.__name__}(...)), not the class"
        else:
            hint = "an exception instance; send ordinary objects with send()"
        raise TypeError(f"send_exception() takes {hint}; got {type(exc).__name__}: {exc!r:.80}")
