"""Argument checks, in one place. A Connection's calls refuse misuse with the stdlib's error
(the same class, and its words where it has them) before anything is read or written, whichever
engine runs. The settings of the workers' classes (counts, seconds, callables) are checked as
they are given: a value of the wrong type is a TypeError, one out of range a ValueError, each
naming the argument and what it takes (:func:`check_int`, :func:`check_seconds`,
:func:`check_callable`, :func:`check_type`)."""

from __future__ import annotations

import math
import operator
from typing import Any


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_int(name: str, value: Any, low: int = 1, *, none_ok: bool = False, why: str = "") -> Any:
    """``value`` as an int of at least ``low`` (anything with ``__index__``, such as a NumPy
    integer; not a bool), or None where ``none_ok``. ``why``: what the argument means, said
    in the error."""
    if value is None and none_ok:
        return None
    takes = f"an int >= {low}" + (" or None" if none_ok else "") + (f" ({why})" if why else "")
    if isinstance(value, bool):
        raise TypeError(f"{name} must be {takes}, not a bool ({value!r})")
    try:
        number = operator.index(value)
    except TypeError:
        raise TypeError(
            f"{name} must be {takes}, not {type(value).__name__} ({_shown(value)})"
        ) from None
    if number < low:
        raise ValueError(f"{name} must be {takes}, not {number!r}")
    return number


def check_seconds(
    name: str,
    value: Any,
    *,
    none_ok: bool = True,
    zero_ok: bool = False,
    finite: bool = False,
    why: str = "",
) -> float | None:
    """``value`` as a number of seconds, above 0 (or at least 0 where ``zero_ok``; infinity
    only where not ``finite``), or None where ``none_ok``. A string is refused, not
    converted; NaN too."""
    if value is None and none_ok:
        return None
    takes = (
        ("a finite " if finite else "a ") + "number of seconds " + (">= 0" if zero_ok else "> 0")
    )
    takes += (" or None" if none_ok else "") + (f" ({why})" if why else "")
    if isinstance(value, (bool, str, bytes, bytearray)):
        raise TypeError(f"{name} must be {takes}, not {type(value).__name__} ({_shown(value)})")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise TypeError(
            f"{name} must be {takes}, not {type(value).__name__} ({_shown(value)})"
        ) from None
    if (finite and not math.isfinite(seconds)) or not (seconds >= 0 if zero_ok else seconds > 0):
        raise ValueError(f"{name} must be {takes}, not {_shown(value)}")
    return seconds


def check_callable(name: str, value: Any, *, none_ok: bool = False, why: str = "") -> Any:
    """``value``, which must be callable (or None where ``none_ok``)."""
    if (value is None and none_ok) or callable(value):
        return value
    takes = "a callable" + (" or None" if none_ok else "") + (f" ({why})" if why else "")
    raise TypeError(f"{name} must be {takes}, not {type(value).__name__} ({_shown(value)})")


def check_type(
    name: str,
    value: Any,
    types: type | tuple[type, ...],
    *,
    none_ok: bool = False,
    takes: str | None = None,
) -> Any:
    """``value``, which must be an instance of ``types`` (or None where ``none_ok``), not a
    bool unless ``types`` is. ``takes``: what the error says it must be (default: the type)."""
    bool_ok = types is bool or (isinstance(types, tuple) and bool in types)
    if (value is None and none_ok) or (
        isinstance(value, types) and (bool_ok or not isinstance(value, bool))
    ):
        return value
    kinds = types if isinstance(types, tuple) else (types,)
    takes = takes or "a " + " or ".join(t.__name__ for t in kinds)
    takes += " or None" if none_ok else ""
    raise TypeError(f"{name} must be {takes}, not {type(value).__name__} ({_shown(value)})")


def check_timeout(timeout: Any) -> float | None:
    """A read or poll timeout as seconds (None: no deadline); NaN is refused like the stdlib
    refuses it, a negative timeout means "do not wait", as in the stdlib's ``poll()``. A
    string is refused (the stdlib's ``poll("1")`` raises TypeError), in the compiled engine's
    words."""
    if timeout is None:
        return None
    if isinstance(timeout, (str, bytes, bytearray)):
        raise TypeError(f"must be real number, not {type(timeout).__name__}")
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
