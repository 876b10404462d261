"""Small helpers shared by the test modules (tests are not a package: pytest puts this
directory on sys.path)."""

from __future__ import annotations

import fcntl
import os
import threading
import time

TIMEOUT = 30.0  # a hang guard only: a correct core never waits this long

# fcntl's command to resize a pipe. Python has named it since 3.10 on Linux; the fallback is
# Linux's own number (F_LINUX_SPECIFIC_BASE + 7, from <linux/fcntl.h>), for a build of Python
# whose fcntl module lacks the name. The tests that resize pipes run on Linux only.
F_SETPIPE_SZ: int = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd`` with plain os.write calls."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Background:
    """Run ``fn(*args)`` in a daemon thread; ``join()`` returns its result or re-raises what
    it raised, and fails if the thread is still blocked after TIMEOUT seconds."""

    def __init__(self, fn, *args) -> None:
        self.error: BaseException | None = None
        self.result = None

        def run() -> None:
            try:
                self.result = fn(*args)
            except BaseException as exc:  # handed to the test thread
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "background thread still blocked"
        if self.error is not None:
            raise self.error
        return self.result


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def reuse_fd(fd: int, avoid: tuple[int, ...] = (), wait: float = 30.0) -> tuple[int, int]:
    """Put the read end of a new pipe at number ``fd``: (fd, the new write end). The write
    end is placed above ``fd`` and every number in ``avoid``. Tests use it to check that a
    closed Connection never closes an fd number that has been reused.

    A program can only be given a number that is free, so this first waits (up to ``wait``
    seconds) until ``fd`` is: a Connection closed while another thread is inside a call keeps
    its fds until that call has left, and taking the number before then (dup2 over an open
    fd) would race with that thread's own close of it."""
    end = time.monotonic() + wait
    while _is_open(fd):
        if time.monotonic() > end:
            raise AssertionError(f"fd {fd} was still open {wait:g} s after its close")
        time.sleep(0.001)
    nr, nw = os.pipe()
    floor = max((fd, *avoid)) + 1
    high_r = fcntl.fcntl(nr, fcntl.F_DUPFD_CLOEXEC, floor)
    high_w = fcntl.fcntl(nw, fcntl.F_DUPFD_CLOEXEC, floor)
    os.close(nr)
    os.close(nw)
    os.dup2(high_r, fd, inheritable=False)
    os.close(high_r)
    return fd, high_w
