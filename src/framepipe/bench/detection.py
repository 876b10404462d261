"""How soon a reader learns that its writer died: framepipe's watched read against the stdlib's
``multiprocessing.connection.wait([conn, process.sentinel])``, on the same kill.

Each kill starts a small child (a fresh interpreter from the ``spawn`` context) holding the
write end of a framepipe pipe and of a stdlib pipe, waits until it runs, and SIGKILLs it while
two observers are blocked: a thread of this process in the watched ``recv_bytes()`` (which
raises WriterDied with the exit status), and a helper process in the stdlib's
``wait([conn, sentinel])`` (a process of its own, so neither observer waits for the other's
GIL). The helper comes from the ``forkserver`` context, not forked from this process: a fork
would share this process's memory copy-on-write, and every page framepipe's reader then touched
after the kill would cost it a page fault and a copy (about 80 of them, some 0.3 ms, on the way
to the WriterDied), a cost of the harness that no reader without such a fork pays. Each notes
``time.monotonic()`` (CLOCK_MONOTONIC, one clock for every process) when it knows; the row is
the median over the kills of the time from ``os.kill`` to that moment. Most of it is the kernel
tearing the child down, the same for both.

``--full`` adds observers measured on kills of their own: the read while this process still
holds a copy of the write end (where the stdlib's read hangs forever), framepipe's watcher
thread, a bare pidfd in ``poll()``, a child forked from this (larger) process, and a thread that
asks psutil once a second (the reference implementation's way).
"""

from __future__ import annotations

import multiprocessing
import os
import random
import select
import signal
import statistics
import struct
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as mp_wait
from multiprocessing.reduction import DupFd
from typing import Any

from ..errors import WriterDied
from ..watch import Liveness, watcher
from .peers import Impl
from .rows import Row, row
from .runner import Context, Section

__all__ = ["SECTION", "bench_detection", "hold", "same_kill"]

BENCH = "death"
TITLE = "writer death seen"
_SETTLE = 0.01  # let the observers block before the kill; not part of the measurement
_WAIT = 30.0
STDLIB_LABEL = "stdlib wait([conn, sentinel])"


def hold(*held: Any) -> None:
    """A child that holds what it was given (a pipe's write end) until it is killed."""
    time.sleep(600)


def _sleeper(ready: Any, *held: Any) -> None:
    """The child: says it runs, then holds what it was given until it is killed."""
    ready.send_bytes(b"up")
    hold(*held)


class _Fd:
    """A file descriptor that a ``forkserver`` child receives as its own copy (as
    ``multiprocessing`` passes a Connection's): the child gets an int."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Callable[[Any], int], tuple[Any]]:
        return _detach_fd, (DupFd(self.fd),)


def _detach_fd(dup: Any) -> int:
    fd: int = dup.detach()
    return fd


def _observe_stdlib(conn: Any, sentinel: int, ready_fd: int, out_fd: int, hold_fd: int) -> None:
    """The helper process: blocks in the stdlib's wait until the child dies, then writes the
    moment it woke, and exits only once the parent lets it (end of file on ``hold_fd``): its
    exit must not take a CPU from framepipe's reader, which is still at work on the same
    death."""
    os.write(ready_fd, b"r")
    mp_wait([conn, sentinel], _WAIT)
    os.write(out_fd, struct.pack("d", time.monotonic()))
    os.read(hold_fd, 1)


def _kill_while_blocked(pid: int, block: Callable[[], object]) -> tuple[float, float]:
    """``(moment of the kill, moment block() returned)``: ``block`` runs in a thread and is
    already blocked when SIGKILL is sent."""
    box: list[float] = []
    errors: list[BaseException] = []

    def observer() -> None:
        try:
            block()
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            errors.append(exc)
            return
        box.append(time.monotonic())

    t = threading.Thread(target=observer, daemon=True)
    t.start()
    time.sleep(_SETTLE)
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    t.join(_WAIT)
    if errors:
        raise errors[0]
    if not box:
        raise RuntimeError("the observer did not return after the kill")
    return t0, box[0]


def _expect_writer_died(reader: Any) -> Callable[[], None]:
    def block() -> None:
        try:
            reader.recv_bytes(timeout=_WAIT)
        except WriterDied:
            return
        raise RuntimeError("the read ended without WriterDied")

    return block


def _start_child(spawn: Any, *held: Any) -> Any:
    ready_r, ready_w = multiprocessing.Pipe(duplex=False)
    proc = spawn.Process(target=_sleeper, args=(ready_w, *held), daemon=True)
    proc.start()
    ready_w.close()
    try:
        if not ready_r.poll(_WAIT):
            raise RuntimeError(f"the child did not start within {_WAIT:g} s")
        ready_r.recv_bytes()
    except BaseException:
        proc.kill()
        proc.join()
        raise
    finally:
        ready_r.close()
    return proc


def _reap(proc: Any) -> None:
    if proc.exitcode is None:
        proc.kill()
    proc.join()


def same_kill(impl: Impl) -> tuple[float, float]:
    """One kill seen by both observers: ``(framepipe seconds, stdlib seconds)``."""
    spawn = multiprocessing.get_context("spawn")
    server = multiprocessing.get_context("forkserver")
    reader, writer = impl.oneway()
    mp_r, mp_w = multiprocessing.Pipe(duplex=False)
    proc = helper = None
    ready_r, ready_w = os.pipe()
    out_r, out_w = os.pipe()
    hold_r, hold_w = os.pipe()
    try:
        proc = _start_child(spawn, writer, mp_w)
        writer.close()
        mp_w.close()
        reader.watch(proc)
        helper = server.Process(
            target=_observe_stdlib,
            args=(mp_r, _Fd(proc.sentinel), _Fd(ready_w), _Fd(out_w), _Fd(hold_r)),
            daemon=True,
        )
        helper.start()
        os.close(ready_w)
        os.close(out_w)
        os.close(hold_r)
        ready_w = out_w = hold_r = -1
        if os.read(ready_r, 1) != b"r":
            raise RuntimeError("the stdlib observer did not start")
        t0, seen = _kill_while_blocked(proc.pid, _expect_writer_died(reader))
        woke = os.read(out_r, 8)
        if len(woke) != 8:
            raise RuntimeError("the stdlib observer did not report a wake-up")
        (stdlib_seen,) = struct.unpack("d", woke)
        return seen - t0, stdlib_seen - t0
    finally:
        for fd in (ready_r, ready_w, out_r, out_w, hold_r, hold_w):  # hold_w: lets the helper go
            if fd >= 0:
                os.close(fd)
        if proc is not None:
            _reap(proc)
        if helper is not None:
            helper.join(_WAIT)
            if helper.exitcode is None:
                helper.kill()
                helper.join()
        for conn in (reader, writer, mp_r, mp_w):
            conn.close()


def _stats(seconds: list[float]) -> dict[str, Any]:
    ms = sorted(s * 1000.0 for s in seconds)
    p90 = statistics.quantiles(ms, n=10, method="inclusive")[-1] if len(ms) > 1 else ms[0]
    return {"median_ms": statistics.median(ms), "p90_ms": p90, "n": len(ms)}


def _row(label: str, family: str, seconds: list[float], **extra: Any) -> Row:
    stats = _stats(seconds)
    return row(
        BENCH,
        TITLE,
        label,
        stats["median_ms"],
        "ms",
        family=family,
        better="lower",
        p90_ms=round(stats["p90_ms"], 4),
        n=stats["n"],
        **extra,
    )


def _error_row(label: str, family: str, exc: BaseException) -> Row:
    return row(
        BENCH,
        TITLE,
        label,
        None,
        "ms",
        family=family,
        better="lower",
        error=f"{type(exc).__name__}: {exc}",
    )


def bench_same_kill(ctx: Context, kills: int) -> list[Row]:
    """The default rows: each framepipe core's watched read and the stdlib's wait, on the
    same kills (the cores take turns; the stdlib observes every kill)."""
    impls = [i for i in ctx.framepipe if i.name in ("c", "python")]
    if not impls:
        ctx.note("death detection skipped: no framepipe core with its default settings ran")
        return []
    seen: dict[str, list[tuple[float, float]]] = {i.name: [] for i in impls}
    failed: dict[str, BaseException] = {}
    for k in range(kills * len(impls)):
        impl = impls[k % len(impls)]
        if impl.name in failed:
            continue
        try:
            seen[impl.name].append(same_kill(impl))
        except Exception as exc:  # noqa: BLE001 - reported in the core's row
            failed[impl.name] = exc
    rows: list[Row] = []
    stdlib_all: list[float] = []
    for impl in impls:
        pairs = seen[impl.name]
        label = f"{impl.name} recv_bytes -> WriterDied"
        if impl.name in failed or not pairs:
            rows.append(
                _error_row(label, "framepipe", failed.get(impl.name, RuntimeError("no kill")))
            )
            continue
        mine = [p[0] for p in pairs]
        theirs = [p[1] for p in pairs]
        stdlib_all += theirs
        out = _row(label, "framepipe", mine, target="<= 1.1x", basis="stdlib")
        ratio = statistics.median(mine) / statistics.median(theirs)
        out.update(
            ratio=ratio,
            met=ratio <= 1.1,
            stdlib_median_ms=round(statistics.median(theirs) * 1000, 4),
            paired_ratio_median=round(statistics.median(a / b for a, b in pairs), 4),
        )
        ctx.progress(label)
        rows.append(out)
    if stdlib_all:
        rows.append(_row(STDLIB_LABEL, "stdlib", stdlib_all))
    return rows


# -- the long run's other observers, each on kills of its own ------------------------------------


def _measure(kills: int, trial: Callable[[Any], float], *, start: str = "spawn") -> list[float]:
    ctx: Any = multiprocessing.get_context(start)
    out = []
    for _ in range(kills):
        ready_r, ready_w = multiprocessing.Pipe(duplex=False)
        proc = ctx.Process(target=_sleeper, args=(ready_w,), daemon=True)
        proc.start()
        ready_w.close()
        try:
            ready_r.recv_bytes()
            out.append(trial(proc))
        finally:
            ready_r.close()
            _reap(proc)
    return out


def _measure_recv(impl: Impl, kills: int, *, keep_write_end: bool, start: str) -> list[float]:
    ctx: Any = multiprocessing.get_context(start)
    out = []
    for _ in range(kills):
        reader, writer = impl.oneway()
        proc = None
        try:
            proc = _start_child(ctx, writer)
            if not keep_write_end:
                writer.close()
            reader.watch(proc)
            t0, seen = _kill_while_blocked(proc.pid, _expect_writer_died(reader))
            out.append(seen - t0)
        finally:
            if proc is not None:
                _reap(proc)
            reader.close()
            writer.close()
    return out


def _trial_watcher(proc: Any) -> float:
    done = threading.Event()
    seen: list[float] = []

    def on_death(lv: Any) -> None:
        seen.append(time.monotonic())
        done.set()

    with Liveness(proc) as lv:
        handle = watcher().register(lv, on_death)
        time.sleep(_SETTLE)
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        if not done.wait(_WAIT):
            watcher().unregister(handle)
            raise RuntimeError("the watcher did not report the death")
    return seen[0] - t0


def _trial_pidfd_poll(proc: Any) -> float:
    with Liveness(proc) as lv:
        fd = lv.fd
        if fd is None:
            raise RuntimeError("no pidfd on this system")

        def block() -> None:
            p = select.poll()
            p.register(fd, select.POLLIN)
            p.poll(_WAIT * 1000)

        t0, seen = _kill_while_blocked(proc.pid, block)
        return seen - t0


class _PsutilLoop:
    """A thread that looks at its watched pids once a second, as the reference watcher did."""

    cadence = 1.0

    def __init__(self) -> None:
        import psutil

        self._psutil = psutil
        self._lock = threading.Lock()
        self._watched: dict[int, tuple[threading.Event, list[float]]] = {}
        self._stop = threading.Event()
        self._rng = random.Random(0)
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        psutil = self._psutil
        while not self._stop.wait(self.cadence):
            with self._lock:
                items = list(self._watched.items())
            for pid, (event, box) in items:
                try:
                    dead = psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
                except psutil.NoSuchProcess:
                    dead = True
                if dead:
                    box.append(time.monotonic())
                    with self._lock:
                        self._watched.pop(pid, None)
                    event.set()

    def trial(self, proc: Any) -> float:
        event = threading.Event()
        box: list[float] = []
        with self._lock:
            self._watched[proc.pid] = (event, box)
        # Deaths happen at any phase of the loop: kill at a random point of its cycle.
        time.sleep(_SETTLE + self._rng.uniform(0.0, self.cadence))
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
        if not event.wait(_WAIT):
            raise RuntimeError("the psutil loop did not report the death")
        return box[0] - t0

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _rss_mb() -> float:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError):
        return float("nan")


def bench_others(ctx: Context, kills: int) -> list[Row]:
    """The long run's other observers (see the module docstring)."""
    c = next((i for i in ctx.framepipe if i.name in ("c", "python")), None)
    trials: list[tuple[str, str, Callable[[], list[float]], dict[str, Any]]] = []
    if c is not None:
        trials.append(
            (
                f"{c.name}, reader holds write end",
                "framepipe",
                lambda: _measure_recv(c, kills, keep_write_end=True, start="spawn"),
                {"note": "the stdlib's read hangs here"},
            )
        )
    trials.append(
        ("watcher thread callback", "framepipe", lambda: _measure(kills, _trial_watcher), {})
    )
    trials.append(("pidfd in poll()", "framepipe", lambda: _measure(kills, _trial_pidfd_poll), {}))
    if c is not None:
        trials.append(
            (
                f"{c.name}, fork child of {_rss_mb():.0f} MB",
                "framepipe",
                lambda: _measure_recv(c, kills, keep_write_end=False, start="fork"),
                {"small_child": False},
            )
        )
    rows: list[Row] = []
    for label, family, run, extra in trials:
        try:
            rows.append(_row(label, family, run(), **extra))
        except Exception as exc:  # noqa: BLE001 - one observer failing is its row's error
            rows.append(_error_row(label, family, exc))
        ctx.progress(label)
    loop = None
    try:
        loop = _PsutilLoop()
        rows.append(_row("psutil loop, 1 s cadence", "other", _measure(kills, loop.trial)))
    except Exception as exc:  # noqa: BLE001
        rows.append(_error_row("psutil loop, 1 s cadence", "other", exc))
    finally:
        if loop is not None:
            loop.close()
    ctx.progress("psutil loop, 1 s cadence")
    return rows


def bench_detection(ctx: Context) -> list[Row]:
    """The section's rows: the same-kill comparison, and in the long run the other observers
    (their kill count halved, the psutil loop costing about half a second a kill)."""
    kills = ctx.depth.kills
    rows = bench_same_kill(ctx, kills)
    if ctx.full:
        rows += bench_others(ctx, max(3, kills // 2))
    return rows


SECTION = Section(
    BENCH,
    TITLE,
    "ms from SIGKILL of a small child until the reader knows, median of the kills; lower is better",
    bench_detection,
    target="c's WriterDied <= 1.1x the stdlib's wait([conn, sentinel]) on the same kills",
    default=True,
)
