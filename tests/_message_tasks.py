"""Functions the message tests run in worker processes (importable, so spawn finds them)."""

from __future__ import annotations

import os
import sys
import time

from _worker_tasks import identity  # noqa: F401 - a task of test_error_messages too


def abort_now() -> None:
    os.abort()


def hang() -> None:
    while True:
        time.sleep(0.05)


def exit_after_saying(text: str) -> None:
    """An initializer that writes ``text`` to stderr, then calls sys.exit(1)."""
    print(text, file=sys.stderr, flush=True)
    sys.exit(1)


def write_in_two_parts(first: str, second: str, pause: float) -> None:
    """One stderr line written in two pieces, ``pause`` seconds apart."""
    sys.stderr.write(first)
    sys.stderr.flush()
    time.sleep(pause)
    sys.stderr.write(second + "\n")
    sys.stderr.flush()


def exit_with_pipe_end(conn: object) -> None:
    """A child that holds a Pipe's writing end, writes nothing and dies."""
    os._exit(0)


def parse(text: str) -> int:
    return int(text)


def talk_then_die(lines: int) -> None:
    """Write ``lines`` lines to stderr, then die by SIGKILL."""
    import signal

    for i in range(lines):
        print(f"progress line {i}", file=sys.stderr)
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
