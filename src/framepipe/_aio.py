"""asyncio for both cores: reads on the running loop's own reader callbacks, no thread.

A read first takes whatever the connection can complete without blocking (a read with a zero
timeout keeps any partial frame on the connection); otherwise it waits for the fd, or the
watched writer's pidfd, to become readable. A cancelled read therefore leaves the stream
consistent: the bytes that arrived stay with the connection for the next read.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from . import _frames as F
from .errors import ReadTimeout

_INLINE_SEND = 64 * 1024  # larger frames are written from the default executor


async def _readable(fds: list[int], timeout: float | None) -> None:
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def wake() -> None:
        if not fut.done():
            fut.set_result(None)

    added = []
    try:
        for fd in fds:
            loop.add_reader(fd, wake)
            added.append(fd)
        if timeout is None:
            await fut
        else:
            await asyncio.wait_for(fut, timeout)
    finally:
        for fd in added:
            loop.remove_reader(fd)


async def recv_async(conn: Any, read: Callable[[float], Any], timeout: float | None) -> Any:
    loop = asyncio.get_running_loop()
    deadline = None if timeout is None else loop.time() + max(float(timeout), 0.0)
    while True:
        try:
            return read(0.0)
        except ReadTimeout as exc:
            if exc.sentinel:
                raise
        remaining = None if deadline is None else deadline - loop.time()
        if remaining is not None and remaining <= 0:
            raise F.timeout_error(timeout)
        bulk = conn._pending_bulk_fd  # a partly read bulk payload arrives on its own fd
        fds = [conn.fileno() if bulk is None else bulk]
        if conn._liveness_fd is not None:
            fds.append(conn._liveness_fd)
        try:
            await _readable(fds, remaining)
        except asyncio.TimeoutError:
            pass  # the loop above reads once more, then reports the timeout


async def send_async(conn: Any, parts: list[Any]) -> None:
    size = sum(memoryview(p).nbytes for p in parts)
    if size > _INLINE_SEND:
        await asyncio.get_running_loop().run_in_executor(None, conn._send_parts, parts)
        return
    conn._send_parts(parts)
