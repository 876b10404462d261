"""Functions and classes the Pool compatibility tests run in worker processes (importable by
spawned workers: pytest puts this directory on sys.path and multiprocessing passes it on)."""

from __future__ import annotations

import importlib
import os
import threading
import time

from _worker_tasks import exit_hard  # noqa: F401 - a task of test_pool_compat too
from _worker_tasks import sleep_for as nap  # noqa: F401 - likewise


class Payload:
    """A weakly referenceable object, to tell when the parent has let go of it."""

    def __init__(self, n: int = 0) -> None:
        self.n = n

    def method(self) -> int:
        return self.n


def make_payload(n: int) -> Payload:
    return Payload(n)


def size_of(p: Payload) -> int:
    return p.n


def make_lock(_: object = None) -> threading.Lock:
    return threading.Lock()


def exit_with(code: int) -> None:
    raise SystemExit(code)


def fail_init() -> None:
    raise ValueError("the initializer failed")


def fail_to_load() -> None:
    raise KeyError("this object cannot be rebuilt here")


class LoadsBadly:
    """Pickles fine; unpickling it calls :func:`fail_to_load`."""

    def __reduce__(self) -> tuple[object, tuple[()]]:
        return fail_to_load, ()


class NeedsAMissingModule:
    """Pickles fine; unpickling it imports a module that does not exist."""

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return importlib.import_module, ("framepipe_no_such_module",)


class ExitsOnLoad:
    """Pickles fine; unpickling it exits the process that does it."""

    def __reduce__(self) -> tuple[object, tuple[int]]:
        return exit_with, (1,)


def open_fds(_: object = None) -> list[str]:
    """What each open descriptor of the worker points at."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def make_bad_result() -> LoadsBadly:
    """A result that pickles in the worker and cannot be unpickled in the parent."""
    return LoadsBadly()


class ExitsOnPickle:
    """Pickling it exits the process that does it."""

    def __reduce__(self) -> tuple[object, ...]:
        raise SystemExit(1)


def make_exit_on_result() -> ExitsOnPickle:
    return ExitsOnPickle()


#: a file the program opens before it forks a pool (see read_shared)
SHARED = None


def read_shared() -> str:
    """What the file the program opened before the fork holds, read by a forked worker."""
    assert SHARED is not None
    SHARED.seek(0)
    return SHARED.read()


def nap_and_mark(path: str, i: int, seconds: float) -> int:
    """Sleep, then append ``i`` to the file at ``path`` (one line per run)."""
    time.sleep(seconds)
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{i}\n".encode())
    finally:
        os.close(fd)
    return i
