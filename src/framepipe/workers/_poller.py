"""The manager's wait on many fds, and whether callers may read their own answers.

Where the platform has epoll and eventfd, a caller waiting for its answer may take its worker's
data fd out of the manager's epoll set and read the channel itself (see :mod:`._lending`):
``LEND``. Elsewhere :class:`_Poller` falls back to ``poll()`` and the manager reads every
answer.
"""

from __future__ import annotations

import contextlib
import os
import select

_EPOLL = getattr(select, "epoll", None)
# Callers read their worker's answers themselves only where the manager's fd set can be changed
# while it waits in it (epoll); elsewhere answers always come through the manager.
LEND = _EPOLL is not None and hasattr(os, "eventfd")
# A caller reads the channel itself only when at most this many answers are due before and with
# its own: behind a longer queue the manager is reading anyway, and lending costs two epoll_ctl.
LEND_DEPTH = 2
EPOLL_IN = (select.EPOLLIN | select.EPOLLPRI) if _EPOLL is not None else 0


class Poller:
    """The manager's wait on many fds: an epoll set (fds can be taken out of it and put back by
    another thread while the manager waits in it), or poll() where there is no epoll."""

    def __init__(self) -> None:
        self._ep = _EPOLL() if _EPOLL is not None else None
        self._poll = select.poll() if self._ep is None else None

    def register(self, fd: int) -> None:
        if self._ep is not None:
            self._ep.register(fd, select.EPOLLIN | select.EPOLLPRI)
        else:
            self._poll.register(fd, select.POLLIN | select.POLLPRI)  # type: ignore[union-attr]

    def unregister(self, fd: int) -> None:
        with contextlib.suppress(KeyError, OSError, ValueError):
            (self._ep or self._poll).unregister(fd)  # type: ignore[union-attr]

    def poll(self, timeout: float | None) -> list[tuple[int, int]]:
        """Ready (fd, events), waiting up to ``timeout`` seconds (None: no limit)."""
        if self._ep is not None:
            return self._ep.poll(-1 if timeout is None else timeout)  # type: ignore[no-any-return]
        return self._poll.poll(None if timeout is None else timeout * 1000.0)  # type: ignore[union-attr]

    def close(self) -> None:
        if self._ep is not None:
            self._ep.close()
