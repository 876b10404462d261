"""Credits: how many batches a worker may load, on a counter of its own (an eventfd, a pipe
where there is none); and the beacon, where a worker writes which batch it is loading."""

from __future__ import annotations

import os
import select
import struct

_BEACON = struct.Struct("q")


def _beacon_fd() -> int:
    """A file of 8 bytes a worker and the parent both map (see ``recovery.retry``)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("framepipe-beacon", os.MFD_CLOEXEC)
    else:  # pragma: no cover - platforms without memfd
        import tempfile

        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    os.ftruncate(fd, _BEACON.size)
    return fd


# -- credits: an eventfd (a pipe where there is none) -------------------------------------------
#
# A credit is added to a counter the worker blocks on, not written to its channel: one 8-byte
# write for the parent, one read for the worker that takes every credit granted so far, no
# framing and no parsing; and its wake-up is a plain one, where a pipe's is a "sync" wake-up,
# which invites the scheduler to run the worker on the CPU of the parent, which goes on
# working. The counter also carries ATTENTION, added when the worker must read its channel
# (a reset, a close, memfds handed back).

HAVE_EVENTFD = hasattr(os, "eventfd")
ATTENTION = 1 << 32


def _credit_fds() -> tuple[int, int]:
    """``(worker's end, parent's end)`` of a new credit counter."""
    if HAVE_EVENTFD:
        fd = os.eventfd(0, os.EFD_CLOEXEC)
        return fd, fd
    r, w = os.pipe()
    return r, w


def _add_credits(fd: int, n: int) -> None:
    try:
        if HAVE_EVENTFD:
            os.eventfd_write(fd, n)
        else:
            os.write(fd, b"+" * (n % ATTENTION) + (b"!" if n >= ATTENTION else b""))
    except OSError:
        pass  # the worker is gone: reading its channel reports how


def _take_credits(fd: int, block: bool = True) -> tuple[int, bool]:
    """``(credits, attention)`` added since the last call (waiting for some when ``block``)."""
    if not block:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        if not poller.poll(0):
            return 0, False
    if HAVE_EVENTFD:
        value = os.eventfd_read(fd)
        return value % ATTENTION, value >= ATTENTION
    data = os.read(fd, 65536)
    if not data:
        raise EOFError("the parent closed the credit pipe")
    return data.count(b"+"), b"!" in data
