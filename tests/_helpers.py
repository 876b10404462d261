"""Small helpers shared by the test modules (tests are not a package: pytest puts this
directory on sys.path)."""

from __future__ import annotations

import os
import threading

TIMEOUT = 30.0  # a hang guard only: a correct core never waits this long


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
