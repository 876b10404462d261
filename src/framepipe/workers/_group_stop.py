"""How a :class:`~framepipe.workers.group.WorkerGroup` stops its ranks, and the signals it
forwards.

A stop is asked for from any thread or from a signal handler (:meth:`StopControl.request`):
the request is queued and a byte written to a wake-up pipe the supervisor's ``poll()``
watches. The first stop (a rank failed, ``close()``, a signal to the parent) sends its signal
to every rank's process group and sets the SIGKILL deadline; a later one only brings that
deadline closer. While the caller waits in the main thread, SIGINT and SIGTERM are taken over
(:meth:`StopControl.install_handlers`) and forwarded: a second one kills at once.
"""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterable
from typing import Any

from ..errors import signal_name
from ._rank import Rank

__all__ = ["FORWARDED_SIGNALS", "StopControl"]

FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopControl:
    """The group's stop: asked for anywhere, carried out by the supervisor thread."""

    def __init__(self, grace: float) -> None:
        self.grace = grace
        self.wake_r: int | None = None
        self.wake_w: int | None = None
        self._requests: collections.deque[tuple[int, float, str]] = collections.deque()
        self.reason: str | None = None  # why the group began stopping, once it did
        self.at_ns: int | None = None  # when (time.time_ns())
        self.kill_at: float | None = None  # time.monotonic() of the SIGKILL to every rank
        self._received: list[int] = []

    # -- the wake-up pipe --

    def open(self) -> None:
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)

    def close(self) -> None:
        for attr in ("wake_r", "wake_w"):
            fd = getattr(self, attr)
            setattr(self, attr, None)
            if fd is not None:
                os.close(fd)

    def close_in_child(self) -> None:
        for fd in (self.wake_r, self.wake_w):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    # -- asking (any thread, or a signal handler) --

    def request(self, sig: int, grace: float, reason: str) -> None:
        """Ask the supervisor to stop the group."""
        self._requests.append((sig, grace, reason))
        fd = self.wake_w
        if fd is not None:
            with contextlib.suppress(OSError):
                os.write(fd, b"!")

    # -- carrying out (the supervisor thread) --

    @property
    def stop(self) -> tuple[str, int] | None:
        """``(reason, time_ns)`` once the group began stopping."""
        if self.reason is None or self.at_ns is None:
            return None
        return self.reason, self.at_ns

    def on_wake(self, ranks: Iterable[Rank]) -> None:
        """The wake-up pipe is readable: carry out every request queued."""
        with contextlib.suppress(OSError):
            while os.read(self.wake_r, 4096):  # type: ignore[arg-type]
                pass
        ranks = list(ranks)
        while self._requests:
            self.begin(ranks, *self._requests.popleft())

    def begin(self, ranks: Iterable[Rank], sig: int, grace: float, reason: str) -> None:
        now = time.monotonic()
        if sig == signal.SIGKILL:
            grace = 0.0
        if self.reason is None:
            self.reason, self.at_ns = reason, time.time_ns()
            for r in ranks:
                r.signal(sig)
            self.kill_at = now + grace
        elif self.kill_at is not None:
            self.kill_at = min(self.kill_at, now + grace)

    def timeout(self) -> float | None:
        """How long the supervisor may sleep before the SIGKILL is due (None: no deadline)."""
        return None if self.kill_at is None else max(0.0, self.kill_at - time.monotonic())

    def kill_if_due(self, ranks: Iterable[Rank]) -> None:
        if self.kill_at is not None and time.monotonic() >= self.kill_at:
            self.kill_at = None
            for r in ranks:
                r.signal(signal.SIGKILL)

    # -- the parent's own signals, while the caller waits --

    def install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        saved: dict[int, Any] = {}
        for sig in FORWARDED_SIGNALS:
            old = signal.getsignal(sig)
            if old is None:
                continue  # installed by C code: it cannot be put back
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, self._on_parent_signal)
                saved[sig] = old
        return saved

    def restore_handlers(self, saved: dict[int, Any]) -> list[int]:
        """Put the handlers back; the first signal received meanwhile, if any."""
        for sig, old in saved.items():
            with contextlib.suppress(ValueError, OSError):
                signal.signal(sig, old)
        received, self._received = self._received, []
        return received[:1]

    def _on_parent_signal(self, signum: int, frame: Any) -> None:
        self._received.append(signum)
        if len(self._received) == 1:
            self.request(signum, self.grace, f"the parent received {signal_name(signum)}")
        else:
            self.request(signal.SIGKILL, 0.0, f"the parent received {signal_name(signum)} again")
