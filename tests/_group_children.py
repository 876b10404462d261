"""Code that runs in the ranks of the WorkerGroup tests (importable by spawned children), and
the parent script of the signal tests.

As a script: ``python _group_children.py MODE`` starts sleeping ranks, prints
``{"ready": pids}`` as one JSON line on stdout once every rank runs, and then waits: in
``group.wait()`` for MODE ``wait-fn`` (two function ranks) and ``wait-cmd`` (two command
ranks), in ``time.sleep`` for ``hold`` (both groups). MODE ``tee`` runs two ranks that print
many lines to stdout and stderr with tee on.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import framepipe


def identity(*args):
    """The rank's view of itself: its arguments and group variables."""
    env = {k: os.environ.get(k) for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "EXTRA")}
    return {
        "args": args,
        "env": env,
        "pid": os.getpid(),
        "pgid": os.getpgrp(),
        "error_file": os.environ.get("TORCHELASTIC_ERROR_FILE"),
    }


def sleep_until(when: float) -> None:
    while True:
        left = when - time.time()
        if left <= 0:
            return
        time.sleep(left)


@framepipe.record
def _raise_at(when: float, rank: int) -> None:
    sleep_until(when)
    raise ValueError(f"rank {rank} failed first" if rank >= 0 else "never")


def fail_at(when: float, rank: int, linger: float) -> None:
    """Raise ValueError at ``when`` (under @framepipe.record, which writes the error file),
    then take ``linger`` seconds more to die."""
    try:
        _raise_at(when, rank)
    finally:
        time.sleep(linger)


@framepipe.record
def _raise_after(path: str | None, gap: float, rank: int) -> None:
    if path is not None:
        while not os.path.exists(path):  # the other rank's error file: it has raised
            time.sleep(0.001)
        time.sleep(gap)
    raise ValueError(f"rank {rank} failed first" if path is None else f"rank {rank} failed next")


def fail_after(path: str | None, gap: float, rank: int, linger: float) -> None:
    """Raise ValueError (under @framepipe.record, which writes the error file) ``gap`` seconds
    after the file ``path`` appears (at once when None), then take ``linger`` seconds more to
    die: the order of two ranks' failures, and the time between them, hold whatever the
    scheduler does."""
    try:
        _raise_after(path, gap, rank)
    finally:
        time.sleep(linger)


def exit_at(when: float, code: int) -> None:
    """Die at ``when`` with ``code``, leaving no error file."""
    sleep_until(when)
    os._exit(code)


def kill_self(sig: int) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(30)


def sleep_forever() -> None:
    time.sleep(600)


def ignore_term_and_sleep(mark: str) -> None:
    """Ignore SIGTERM, say so by creating the file ``mark``, and sleep."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    open(mark, "w").close()
    time.sleep(600)


def write_outputs(rank: int) -> str:
    """Write to stdout and stderr through Python and straight to the fds."""
    print(f"python stdout of rank {rank}", flush=True)
    print(f"python stderr of rank {rank}", file=sys.stderr, flush=True)
    os.write(1, f"fd 1 of rank {rank}\n".encode())
    os.write(2, f"fd 2 of rank {rank}\n".encode())
    return "written"


def fail_with_output(rank: int) -> None:
    os.write(2, b"about to fail\n")
    raise KeyError(f"missing item {rank}")


def big_stderr(nbytes: int) -> int:
    line = b"x" * 99 + b"\n"
    chunk = line * 1000
    left = nbytes
    while left > 0:
        part = chunk[:left]
        view = memoryview(part)
        while view:
            view = view[os.write(2, view) :]
        left -= len(part)
    return nbytes


def many_lines(rank: int, count: int) -> int:
    """Lines ``r<rank> <n> <padding>`` on both streams, written in chunks that cut lines."""
    for fd in (1, 2):
        data = b"".join(b"r%d %d %s\n" % (rank, n, b"y" * (n % 50)) for n in range(count))
        view = memoryview(data)
        step = 777 + rank * 131
        while view:
            part = view[:step]
            while part:
                part = part[os.write(fd, part) :]
            view = view[step:]
    return count


def main(mode: str) -> None:
    from framepipe.workers import Std, WorkerGroup

    # Started from a background job of a shell without job control, this process inherits
    # SIGINT ignored (and Python then leaves it so): behave as a program run from a terminal,
    # where Ctrl-C raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)

    if mode == "tee":
        group = WorkerGroup(
            many_lines, 2, args={0: (0, 3000), 1: (1, 3000)}, tee=Std.ALL, start_method="fork"
        )
        with group:
            group.wait()
        return
    groups = []
    if mode in ("wait-fn", "hold", "exit"):
        groups.append(WorkerGroup(sleep_forever, 2, start_method="spawn", grace=5.0))
    if mode in ("wait-cmd", "hold", "exit"):
        groups.append(WorkerGroup(["sh", "-c", "sleep 600"], 2, grace=5.0))
    for group in groups:
        group.start()
    pids = [pid for group in groups for pid in group.pids.values()]
    print(json.dumps({"ready": pids}), flush=True)
    if mode == "hold":
        time.sleep(600)
    if mode == "exit":
        return  # neither waited for nor closed: the interpreter's exit stops them
    groups[0].wait()


if __name__ == "__main__":
    main(sys.argv[1])
