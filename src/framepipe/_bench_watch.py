"""How fast a reader learns that its writer died: framepipe's watcher against the alternatives.

Each trial starts a small child (a fresh interpreter from the ``spawn`` context), lets the
observer settle, sends it SIGKILL and measures with ``perf_counter`` the time from ``os.kill``
to the moment the observer knows. Most of that time is the kernel tearing the child down: a
child forked from a large parent takes longer to die (the last row shows it), whatever watches.
Observers compared:

- ``framepipe recv_bytes -> WriterDied``: a watched ``recv_bytes()`` blocked on a framepipe pipe
  whose write end only the child holds, until it raises WriterDied;
- the same read while this process still holds a copy of the write end (the case where the
  stdlib hangs forever): only the pidfd can tell;
- ``framepipe Watcher (pidfd/epoll)``: the callback of :func:`framepipe.watch.watcher`;
- ``framepipe Liveness.fd in poll()``: a reader blocked in ``poll()`` on the pidfd;
- ``multiprocessing.connection.wait``: a reader blocked in
  ``wait([conn, process.sentinel])``, the stdlib way;
- ``psutil thread, 1 s cadence``: a thread that wakes every second and asks psutil whether the
  writer has become a zombie (the behaviour of the reference implementation); its kills are
  spread at random over the loop's cycle, so its numbers are those of a death at any moment.
"""

from __future__ import annotations

import multiprocessing
import os
import random
import select
import signal
import statistics
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait as mp_wait
from typing import Any

from .errors import WriterDied
from .watch import HAVE_PIDFD, Liveness, watcher

__all__ = ["bench_detection"]

_SETTLE = 0.01  # let the observer block before the kill; not part of the measurement
_WAIT = 30.0


def _sleeper(*held: Any) -> None:
    """The child: holds what it was given (a pipe's write end) until it is killed."""
    time.sleep(600)


Trial = Callable[[Any], float]


def _trial_watcher(proc: Any) -> float:
    done = threading.Event()
    seen: list[float] = []

    def on_death(lv: Liveness) -> None:
        seen.append(time.perf_counter())
        done.set()

    with Liveness(proc) as lv:
        handle = watcher().register(lv, on_death)
        time.sleep(_SETTLE)
        t0 = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)
        if not done.wait(_WAIT):
            watcher().unregister(handle)
            raise RuntimeError("the watcher did not report the death")
    return seen[0] - t0


def _trial_pidfd_poll(proc: Any) -> float:
    with Liveness(proc) as lv:
        fd = lv.fd
        if fd is None:
            raise RuntimeError("no pidfd")

        def block() -> None:
            p = select.poll()
            p.register(fd, select.POLLIN)
            p.poll(_WAIT * 1000)

        return _kill_while_blocked(proc, block)


def _trial_mp_wait(proc: Any, conn: Any) -> float:
    return _kill_while_blocked(proc, lambda: mp_wait([conn, proc.sentinel], _WAIT))


def _trial_recv(proc: Any, reader: Any) -> float:
    reader.watch(proc)

    def block() -> None:
        try:
            reader.recv_bytes(timeout=_WAIT)
        except WriterDied:
            return
        raise RuntimeError("the read ended without WriterDied")

    return _kill_while_blocked(proc, block)


def _kill_while_blocked(proc: Any, block: Callable[[], object]) -> float:
    """Seconds from SIGKILL to ``block()`` returning in another thread, which was already
    blocked when the signal was sent."""
    box: list[float] = []

    def observer() -> None:
        block()
        box.append(time.perf_counter())

    t = threading.Thread(target=observer)
    t.start()
    time.sleep(_SETTLE)
    t0 = time.perf_counter()
    os.kill(proc.pid, signal.SIGKILL)
    t.join(_WAIT)
    if not box:
        raise RuntimeError("the observer did not return after the kill")
    return box[0] - t0


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
                    box.append(time.perf_counter())
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
        t0 = time.perf_counter()
        os.kill(proc.pid, signal.SIGKILL)
        if not event.wait(_WAIT):
            raise RuntimeError("the psutil loop did not report the death")
        return box[0] - t0

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def _measure(n: int, trial: Trial, *, start: str = "spawn") -> list[float]:
    ctx: Any = multiprocessing.get_context(start)
    out = []
    for _ in range(n):
        proc = ctx.Process(target=_sleeper, daemon=True)
        proc.start()
        try:
            out.append(trial(proc))
        finally:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
    return out


def _measure_recv(n: int, *, keep_write_end: bool, start: str = "spawn") -> list[float]:
    """Trials of :func:`_trial_recv`: the child gets the write end of a new framepipe pipe."""
    from . import connection

    ctx: Any = multiprocessing.get_context(start)
    out = []
    for _ in range(n):
        reader, writer = connection.Pipe(duplex=False)
        proc = ctx.Process(target=_sleeper, args=(writer,), daemon=True)
        try:
            proc.start()
            if not keep_write_end:
                writer.close()
            out.append(_trial_recv(proc, reader))
        finally:
            if proc.exitcode is None:
                proc.kill()
            proc.join()
            reader.close()
            writer.close()
    return out


def _rss_mb() -> float:
    try:
        import psutil

        return float(psutil.Process().memory_info().rss) / 2**20
    except Exception:  # noqa: BLE001 - a label only
        return float("nan")


def _row(method: str, seconds: list[float]) -> dict[str, Any]:
    ms = sorted(s * 1000.0 for s in seconds)
    p90 = statistics.quantiles(ms, n=10, method="inclusive")[-1] if len(ms) > 1 else ms[0]
    return {
        "method": method,
        "median_ms": statistics.median(ms),
        "p90_ms": p90,
        "n": len(ms),
    }


def bench_detection(n: int = 30, *, include_psutil: bool = True) -> dict[str, Any]:
    """Time from SIGKILL of a child to its death being known, per observer.

    Returns ``{"n": n, "rows": [{"method", "median_ms", "p90_ms", "n"}, ...]}``. The psutil
    loop row takes about ``n / 2`` seconds (its cadence is one second); ``include_psutil=False``
    leaves it out.
    """
    if n < 1:
        raise ValueError("n must be at least 1")
    rows = [
        _row("framepipe recv_bytes -> WriterDied", _measure_recv(n, keep_write_end=False)),
        _row(
            "framepipe recv_bytes -> WriterDied, reader holds the write end",
            _measure_recv(n, keep_write_end=True),
        ),
        _row(
            "framepipe Watcher (pidfd/epoll)" if HAVE_PIDFD else "framepipe Watcher (5 ms poll)",
            _measure(n, _trial_watcher),
        ),
    ]
    if HAVE_PIDFD:
        rows.append(_row("framepipe Liveness.fd in poll()", _measure(n, _trial_pidfd_poll)))

    def mp_trial(proc: Any) -> float:
        r, w = multiprocessing.Pipe(duplex=False)
        try:
            return _trial_mp_wait(proc, r)
        finally:
            r.close()
            w.close()

    rows.append(_row("multiprocessing.connection.wait([conn, sentinel])", _measure(n, mp_trial)))
    rows.append(
        _row(
            f"framepipe recv_bytes -> WriterDied, fork child of this {_rss_mb():.0f} MB process",
            _measure_recv(n, keep_write_end=False, start="fork"),
        )
    )
    rows[-1]["small_child"] = False
    if include_psutil:
        loop = _PsutilLoop()
        try:
            rows.append(_row("psutil thread, 1 s cadence (reference)", _measure(n, loop.trial)))
        finally:
            loop.close()
    return {"n": n, "rows": rows}


if __name__ == "__main__":
    import json
    import sys

    count = int(sys.argv[1]) if len(sys.argv) > 1 else 30
    print(json.dumps(bench_detection(count), indent=2))
