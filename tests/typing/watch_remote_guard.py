"""framepipe.watch, framepipe.remote and framepipe.guard used as the README uses them, for
``mypy --strict`` (tests/test_typing.py): a program that must pass."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import queue
import threading

import framepipe
import framepipe.guard as guard_module
from framepipe import guard
from framepipe.guard import ProcessFailure, fault_path, read_native_traceback, record
from framepipe.remote import (
    RefusedPayload,
    RemoteError,
    RemoteTraceback,
    dumps_exception,
    loads_exception,
    sender_label,
)
from framepipe.watch import Liveness, Watcher, dead_status_word, resolve_target, watcher


def worker(conn: multiprocessing.connection.Connection) -> None:
    metrics: queue.Queue[dict[str, str]] = queue.Queue()
    with guard(conn, label="loader", queue=metrics, stop_event=threading.Event()):
        raise KeyError("missing")


@guard
def bare() -> int:
    return 1


@record
def main() -> int:
    return bare()


def watch(process: multiprocessing.Process) -> str:
    with Liveness(process) as liveness:
        alive: bool = not liveness.poll_dead()
        code: int | None = liveness.status()[0]
        oom: bool | None = liveness.oom_killed()
        native: str | None = liveness.native_traceback()
        label: str | None = liveness.guard_label()
        err: framepipe.WriterDied = liveness.error(label="loader")
        handle: int = watcher().register(liveness, lambda dead: print(dead.pid))
        watcher().unregister(handle)
    pid, owner = resolve_target(process)
    word: int = dead_status_word(code)
    print(alive, oom, native, label, pid, owner, word, Watcher)
    return str(err)


def revive(data: bytes) -> BaseException:
    with sender_label("collector"):
        again = dumps_exception(ValueError("x"), label="loader")
    try:
        exc = loads_exception(again, allow=["builtins", KeyError])
    except RefusedPayload:
        raise
    if isinstance(exc, RemoteError):
        print(exc.remote_type)
    end = exc.__cause__
    if isinstance(end, RemoteTraceback):
        print(end.label, end.pid, end.text)
    failure = ProcessFailure(0, 1, 1, fault_path(1))
    tb: str | None = read_native_traceback(1)
    print(failure.host, failure.timestamp_ns, tb, guard_module.ERROR_FILE_ENV)
    return exc


version: str = framepipe.__version__
