"""A drop-in for ``multiprocessing.connection``: change one import.

    from framepipe.connection import Pipe, wait      # was: from multiprocessing.connection ...

``Pipe``, ``Connection`` and ``wait`` behave like the stdlib's and raise the same errors in the
same situations, with additions: ``recv_bytes``, ``recv_bytes_into`` and ``recv`` take
``timeout=`` (raising :class:`framepipe.ReadTimeout`), ``Connection.watch(process)`` turns a
dead writer into :class:`framepipe.WriterDied` instead of a hang, and errors sent with
``send_exception`` are raised by the reader. A Connection can be passed to a
``multiprocessing`` child (fork, spawn or forkserver) like the stdlib's.
"""

from __future__ import annotations

import select
import time
from collections.abc import Iterable
from typing import Any

from . import _impl
from .errors import BufferTooShort

__all__ = ["Pipe", "Connection", "wait", "BufferTooShort"]

Connection = _impl.core.Connection


def Pipe(duplex: bool = True, *, read_ahead: bool = False) -> tuple[Any, Any]:
    """Return a pair of connected :class:`Connection` objects, like ``multiprocessing.Pipe``.

    With ``duplex=False`` the first can only read and the second can only write.
    ``read_ahead=True`` trades visibility to a foreign ``select()`` for small-message speed
    (see :class:`Connection`).
    """
    return _impl.core.pipe(duplex, read_ahead=read_ahead)  # type: ignore[no-any-return]


def _fileno(obj: Any) -> int:
    return obj if isinstance(obj, int) else int(obj.fileno())


def wait(object_list: Iterable[Any], timeout: float | None = None) -> list[Any]:
    """Wait until an object in ``object_list`` is ready; return the ready ones.

    Like ``multiprocessing.connection.wait``: the objects are Connections, sockets, fds or
    anything with ``fileno()`` (a Process ``sentinel`` is an fd). A framepipe Connection is
    ready when it has buffered data, when its fd is readable, or when the writer it watches
    has died (the next read raises :class:`framepipe.WriterDied`).
    """
    objects = list(object_list)
    ready = [o for o in objects if getattr(o, "_has_buffered", None) and o._has_buffered()]
    if ready:
        return ready
    poller = select.poll()
    owners: dict[int, list[Any]] = {}
    for obj in objects:
        bulk = getattr(obj, "_pending_bulk_fd", None)  # mid-payload: the bulk fd
        fds = [_fileno(obj) if bulk is None else bulk]
        liveness_fd = getattr(obj, "_liveness_fd", None)
        if liveness_fd is not None:
            fds.append(liveness_fd)
        for fd in fds:
            if fd not in owners:
                poller.register(fd, select.POLLIN | select.POLLPRI)
                owners[fd] = []
            owners[fd].append(obj)
    deadline = None if timeout is None else time.monotonic() + max(timeout, 0.0)
    while True:
        wait_ms = None if deadline is None else max(deadline - time.monotonic(), 0.0) * 1000.0
        events = poller.poll(wait_ms)
        if events:
            found: list[Any] = []
            for fd, _ in events:
                for obj in owners[fd]:
                    if not any(obj is f for f in found):
                        found.append(obj)
            return [o for o in objects if any(o is f for f in found)]
        if deadline is not None and time.monotonic() >= deadline:
            return []


# -- passing a Connection to another process ------------------------------------------------


def _reduce_connection(conn: Any) -> Any:
    """Pickle support (multiprocessing's ForkingPickler): the fds travel as ``DupFd``."""
    from multiprocessing import reduction

    if conn.closed:
        raise OSError("cannot pass a closed Connection to another process")
    if conn._has_buffered():
        raise ValueError(
            "cannot pass this Connection to another process: it holds bytes it has read ahead "
            "but not yet returned, which the other process would never see; receive the "
            "pending messages first"
        )
    rfd, wfd, bfd, bwfd = conn._handles()
    impl = "c" if type(conn).__module__ == "framepipe._core" else "python"
    dup_r = reduction.DupFd(rfd)
    dup_w = None if wfd == rfd else reduction.DupFd(wfd)
    # The bulk channel: one fd (read, written, or both on one socket) or a read and a write fd.
    bulk = bfd if bfd >= 0 else bwfd
    dup_b = None if bulk < 0 else reduction.DupFd(bulk)
    dup_bw = None if bfd < 0 or bwfd < 0 or bwfd == bfd else reduction.DupFd(bwfd)
    options = {"max_size": conn.max_size, "read_ahead": conn.read_ahead}
    return _rebuild_connection, (
        impl, dup_r, dup_w, conn.readable, conn.writable, options, dup_b, dup_bw
    )


def _rebuild_connection(
    impl: str,
    dup_r: Any,
    dup_w: Any,
    readable: bool,
    writable: bool,
    options: dict[str, Any],
    dup_b: Any = None,
    dup_bw: Any = None,
) -> Any:
    core = _impl.load(impl)
    rfd = dup_r.detach()
    wfd = None if dup_w is None else dup_w.detach()
    bfd = None if dup_b is None else dup_b.detach()
    bwfd = None if dup_bw is None else dup_bw.detach()
    return core.Connection(rfd, readable, writable, write_handle=wfd, bulk_handle=bfd,
                           bulk_write_handle=bwfd, **options)
