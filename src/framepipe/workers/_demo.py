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

from . import Pool, TaskTimeout, WorkerCrashed


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


def main(args: argparse.Namespace) -> int:
    out = sys.stdout
    with Pool(2, task_timeout=1.0, name="demo") as pool:
        print("1. A task raises QuotaExceeded('alice', 100): it arrives as itself.\n", file=out)
        try:
            pool.submit(check_quota, "alice").result()
        except QuotaExceeded as exc:
            print(f"   caught {type(exc).__name__}: {exc}", file=out)
            print(f"   exc.user = {exc.user!r}, exc.limit = {exc.limit}", file=out)
            tb = exc.__cause__
            print(
                f"   with the worker's traceback: {type(tb).__name__} (shown when it is printed)\n",
                file=out,
            )

        print("2. Six resize tasks; the worker running image 3 is SIGKILLed mid-task.\n", file=out)
        futures = [pool.submit(resize, i) for i in range(6)]
        for fut in futures:
            try:
                print(f"   {fut.result()}", file=out)
            except WorkerCrashed as exc:
                text = str(exc).replace("\n", "\n   | ")
                print(f"   WorkerCrashed: {text}", file=out)
        print("   (the other five finished; a new worker took the dead one's place)\n", file=out)

        print(
            "3. A task hangs; task_timeout=1.0 takes its stack, then stops the worker.\n", file=out
        )
        start = time.monotonic()
        try:
            pool.submit(wait_for_lock).result()
        except TaskTimeout as exc:
            late = (time.monotonic() - start - 1.0) * 1000
            first, _, stack = str(exc).partition("\n\n")
            print(f"   TaskTimeout after 1 s (+{late:.1f} ms): {first}", file=out)
            blocks = (exc.stack or "").split("\n\n")
            stuck = next((b for b in blocks if "wait_for_lock" in b), "")
            print("   the stuck thread's stack, as the worker had it:", file=out)
            for line in stuck.splitlines()[:4]:
                print(f"   | {line}", file=out)
        print("\n   the pool still serves:", pool.submit(resize, 7).result(), file=out)
    return 0
