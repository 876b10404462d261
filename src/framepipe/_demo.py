"""``python -m framepipe demo``: what a worker pool says when things go wrong.

Three things happen to a pool of two workers: a task raises an exception whose constructor
takes two arguments, a worker is SIGKILLed in the middle of a task, and a task hangs past its
timeout. Each is reported to the caller with what it needs to know, and the pool goes on.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import TextIO

from ._width import DEFAULT_WIDTH, output_width, wrap_line
from .remote import RemoteTraceback
from .workers import Pool, TaskTimeout, WorkerCrashed


class QuotaExceeded(Exception):
    """An exception the stdlib's pools cannot carry: two required constructor arguments."""

    def __init__(self, user: str, limit: int) -> None:
        super().__init__(f"user {user!r} is over the quota of {limit} requests")
        self.user = user
        self.limit = limit


def check_quota(user: str) -> str:
    raise QuotaExceeded(user, 100)


def resize(image_id: int) -> str:
    if image_id == 3:
        print(f"resize: image {image_id} is huge, allocating...", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would
    time.sleep(0.01)
    return f"image {image_id} resized"


def wait_for_lock() -> None:
    while True:  # a deadlock, as far as anyone can tell from outside
        time.sleep(0.05)


class _Out:
    """The demo's lines, each wrapped at the terminal's width (100 columns when unknown) and
    written whole, in one write (a worker's stderr line never lands in the middle of one)."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.width = output_width(stream.fileno() if hasattr(stream, "fileno") else 1)

    def __call__(self, text: str = "", quote: str = "") -> None:
        lines: list[str] = []
        for line in text.split("\n"):
            lines += [w.rstrip() for w in wrap_line(quote + line, self.width)]
        self.stream.write("\n".join(lines) + "\n")
        self.stream.flush()


def main(args: argparse.Namespace) -> int:
    try:
        say = _Out(sys.stdout)
    except (OSError, ValueError):  # a stdout without a file descriptor
        say = _Out.__new__(_Out)
        say.stream, say.width = sys.stdout, DEFAULT_WIDTH
    with Pool(2, task_timeout=1.0, name="demo") as pool:
        say("1. A task raises QuotaExceeded('alice', 100): it arrives as itself.\n")
        try:
            pool.submit(check_quota, "alice").result()
        except QuotaExceeded as exc:
            say(f"   caught {type(exc).__name__}: {exc}")
            say(f"   exc.user = {exc.user!r}, exc.limit = {exc.limit}")
            tb = exc.__cause__
            if isinstance(tb, RemoteTraceback):  # what a traceback of it prints above its own
                say("   its cause, the worker's traceback:")
                say(tb.text.strip("\n"), quote="   | ")
            say()

        say("2. Six resize tasks; the worker running image 3 is SIGKILLed mid-task.\n")
        futures = [pool.submit(resize, i) for i in range(6)]
        for fut in futures:
            try:
                say(f"   {fut.result()}")
            except WorkerCrashed as exc:
                first, _, rest = str(exc).partition("\n")
                say(f"   WorkerCrashed: {first}")
                if rest.strip():
                    say(rest.strip("\n"), quote="   | ")
        say("   (the other five finished; a new worker took the dead one's place)\n")

        say("3. A task hangs; task_timeout=1.0 takes its stack, then stops the worker.\n")
        start = time.monotonic()
        try:
            pool.submit(wait_for_lock).result()
        except TaskTimeout as exc:
            late = (time.monotonic() - start - 1.0) * 1000
            first, _, stack = str(exc).partition("\n\n")
            say(f"   TaskTimeout after 1 s (+{late:.1f} ms): {first}")
            say("   its stack, the stuck thread first:")
            say("\n".join(stack.splitlines()[1:6]), quote="   | ")
        say(f"\n   the pool still serves: {pool.submit(resize, 7).result()}")
    return 0
