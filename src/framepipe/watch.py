"""The watcher: one background thread per process that acts the moment a watched writer dies.

:class:`Watcher` calls a function when a writer it watches has died. On Linux it sleeps in
``epoll`` on the writers' pidfds and wakes on the event; elsewhere it polls every few
milliseconds. It is created lazily by :func:`watcher`, stopped at interpreter exit, and a forked
child gets a fresh one of its own.

What a writer is and how its death is read (pidfd, ``waitid`` without reaping, ``/proc``,
cgroup OOM counters, exit-status words) are the process facts of :mod:`framepipe._liveness`, whose
public names this module re-exports: :class:`Liveness`, :func:`resolve_target`,
:func:`dead_status_word`, :func:`exitcode_from_status_word`, :data:`HAVE_PIDFD`,
:data:`DEAD_STATUS_UNKNOWN` and :data:`Target`.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import selectors
import sys
import threading
import traceback
from collections.abc import Callable

from ._liveness import (
    DEAD_STATUS_UNKNOWN,
    HAVE_PIDFD,
    WATCHER_THREAD_NAME,
    Liveness,
    Target,
    dead_status_word,
    exitcode_from_status_word,
    resolve_target,
)

__all__ = [
    "DEAD_STATUS_UNKNOWN",
    "HAVE_PIDFD",
    "Liveness",
    "OnDeath",
    "Target",
    "Watcher",
    "dead_status_word",
    "exitcode_from_status_word",
    "resolve_target",
    "watcher",
]

# Polling period of the watcher for writers it cannot wait on through a pidfd.
_POLL_INTERVAL = 0.005


# --------------------------------------------------------------------------------------------
# Watcher
# --------------------------------------------------------------------------------------------

OnDeath = Callable[[Liveness], object]
"""A death callback: called with the dead writer's :class:`Liveness`; its result is ignored."""


class _Registration:
    __slots__ = ("fd", "liveness", "on_death")

    def __init__(self, liveness: Liveness, on_death: OnDeath, fd: int | None) -> None:
        self.liveness = liveness
        self.on_death = on_death
        self.fd = fd  # the watcher's own duplicate of the pidfd, or None: polled


class Watcher:
    """A background thread that calls ``on_death(liveness)`` once a watched writer has died.

    Use the per-process instance from :func:`watcher`. The thread (a daemon named
    ``framepipe-watcher``) waits in ``epoll``/``poll`` on the registered pidfds and a wake-up
    pipe, so a death is seen when it happens, with no periodic wake-ups; writers without a pidfd
    are polled every 5 ms. A callback runs on the watcher thread only after
    :meth:`Liveness.poll_dead` has confirmed the death, and runs once. Callbacks should be
    short; an exception in one is printed to stderr and does not stop the watcher.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regs: dict[int, _Registration] = {}
        self._next_handle = 1
        self._polled: set[int] = set()  # handles without a selector entry
        self._to_add: list[int] = []
        self._to_close: list[int] = []  # duplicate pidfds to drop from the selector and close
        self._stopping = False
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=WATCHER_THREAD_NAME, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pid={self._pid} watching={len(self._regs)}>"

    @property
    def running(self) -> bool:
        """Whether the watcher thread is alive."""
        return self._thread.is_alive()

    def register(self, liveness: Liveness, on_death: OnDeath) -> int:
        """Call ``on_death(liveness)`` from the watcher thread once the writer is dead (at once
        if it already is). Returns a handle for :meth:`unregister`. The Liveness must stay open
        while registered only for the portable path; the watcher keeps its own copy of the
        pidfd."""
        fd = None
        if liveness.fd is not None:
            fd = os.dup(liveness.fd)
        with self._lock:
            if self._stopping:
                if fd is not None:
                    os.close(fd)
                raise RuntimeError("the framepipe watcher has been stopped")
            handle = self._next_handle
            self._next_handle += 1
            self._regs[handle] = _Registration(liveness, on_death, fd)
            if fd is None:
                self._polled.add(handle)
            else:
                self._to_add.append(handle)
            self._wake_locked()
        return handle

    def unregister(self, handle: int) -> bool:
        """Stop watching. True when the callback had not been called and now never will be;
        False when it has already been called (or is being called) or the handle is unknown."""
        with self._lock:
            reg = self._regs.pop(handle, None)
            if reg is None:
                return False
            self._polled.discard(handle)
            if reg.fd is not None:
                self._to_close.append(reg.fd)
                reg.fd = None
            self._wake_locked()
        return True

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread and release its file descriptors; pending callbacks are dropped.
        Called at interpreter exit for the per-process watcher."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._wake_locked()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- thread ---------------------------------------------------------------------------------

    def _wake_locked(self) -> None:
        # Under the lock, so the thread cannot close the pipe between the check and the write.
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is already pending

    def _sync_locked(self) -> None:
        """Apply registrations made by other threads to the selector (watcher thread only)."""
        # Forget each number before closing it: a process forked by another thread while this
        # one is in close(2) (which lets go of the GIL) must not close it again, once reused.
        while self._to_close:
            fd = self._to_close.pop()
            try:
                self._selector.unregister(fd)
            except (KeyError, ValueError, OSError):
                pass
            os.close(fd)
        for handle in self._to_add:
            reg = self._regs.get(handle)
            if reg is None or reg.fd is None:
                continue
            try:
                self._selector.register(reg.fd, selectors.EVENT_READ, handle)
            except (KeyError, ValueError, OSError):
                self._polled.add(handle)
        self._to_add.clear()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        break
                    self._sync_locked()
                    polling = list(self._polled)
                events = self._selector.select(_POLL_INTERVAL if polling else None)
                ready: list[int] = []
                for key, _ in events:
                    if key.fd == self._wake_r:
                        try:
                            while os.read(self._wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                    else:
                        ready.append(key.data)
                for handle in ready:
                    self._check(handle, from_event=True)
                for handle in polling:
                    self._check(handle, from_event=False)
        finally:
            with self._lock:
                self._stopping = True
                self._close_fds()

    def _check(self, handle: int, *, from_event: bool) -> None:
        with self._lock:
            reg = self._regs.get(handle)
        if reg is None:
            return
        try:
            dead = reg.liveness.poll_dead()
        except Exception:  # noqa: BLE001 - the watcher thread must outlive any one writer
            _report("checking a watched writer", reg)
            dead = False
        with self._lock:
            if self._regs.get(handle) is not reg:
                return  # unregistered meanwhile
            if not dead:
                if from_event and reg.fd is not None:
                    # Readable but not confirmed dead: poll it instead of spinning on epoll.
                    self._to_close.append(reg.fd)
                    reg.fd = None
                    self._polled.add(handle)
                return
            del self._regs[handle]
            self._polled.discard(handle)
            if reg.fd is not None:
                self._to_close.append(reg.fd)
                reg.fd = None
        try:
            reg.on_death(reg.liveness)
        except Exception:  # noqa: BLE001 - a failing callback must not stop the others
            _report("in a framepipe watcher callback", reg)

    def _close_fds(self) -> None:
        """Release everything (the thread's exit path, or a forked child's copies)."""
        self._closed = True
        fds = list(self._to_close) + [r.fd for r in self._regs.values() if r.fd is not None]
        self._to_close = []
        self._regs = {}
        self._polled = set()
        self._to_add = []
        fds += [self._wake_r, self._wake_w]
        self._wake_r = self._wake_w = -1
        with contextlib.suppress(OSError):
            self._selector.close()
        for fd in fds:
            if fd < 0:
                continue
            try:
                os.close(fd)
            except OSError:
                pass

    def _abandon_after_fork(self) -> None:
        # In a forked child: the thread does not exist here and the lock may have been held by
        # another thread of the parent at fork time. Only drop the inherited descriptors.
        self._stopping = True
        self._close_fds()


def _report(what: str, reg: _Registration) -> None:
    try:
        print(
            f"Exception {what} (pid {reg.liveness.pid}, callback {reg.on_death!r}):",
            file=sys.stderr,
        )
        traceback.print_exc()
    except (OSError, ValueError):
        pass  # stderr closed or gone: nothing left to tell


_watcher: Watcher | None = None
_watcher_lock = threading.Lock()


def watcher() -> Watcher:
    """The watcher of this process, started on first use."""
    global _watcher
    w = _watcher
    if w is not None:
        return w
    with _watcher_lock:
        if _watcher is None:
            _watcher = Watcher()
        return _watcher


def _stop_at_exit() -> None:
    w = _watcher
    if w is not None and w._pid == os.getpid():
        w.stop(timeout=1.0)


def _after_fork_in_child() -> None:
    global _watcher, _watcher_lock
    _watcher_lock = threading.Lock()
    w, _watcher = _watcher, None
    if w is not None:
        w._abandon_after_fork()


atexit.register(_stop_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
