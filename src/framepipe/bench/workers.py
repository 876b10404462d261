"""``python -m framepipe bench workers``: framepipe's Pool against the pools people use, side by
side in one run, 2 workers each (``--workers N``; a list such as ``1,2,4,8,16`` runs the
throughput rows at each count and prints a scaling table).

Rows: no-op tasks/s through ``submit`` and through ``map(chunksize=1)``; mixed durations (a
burst of 2,000 no-op tasks, then ``40 * N`` tasks of 2 ms: the ideal time over the time taken,
the median of 5 runs); the round trip of one task (median, p99) beside the bare transport's (a
send and a receive on a framepipe ``Pipe`` between two processes; for framepipe's Pool, measured
in turns with its round trips, see ROUND_TRIP_TURNS); 1 MiB and 16 MiB NumPy
results (MB/s); a worker SIGKILLed mid-task (time to
the failed future, time until the pool serves again, what became of the 20 tasks queued behind
it); a task raising an exception whose constructor takes two arguments; a 0.5 s task timeout
(how late the task fails, and whether the hung worker's stack is shown). Peers: the stdlib's
``ProcessPoolExecutor`` and ``multiprocessing.Pool``, and loky, pebble and mpire when installed.
Every pool starts with the ``spawn`` method (mpire: its default, ``fork``).

The task functions live at module level: spawned workers import them from here.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..connection import Pipe
from ..workers import Pool
from . import peers
from .load import LoadProbe, busy_lines
from .machine import machine_info
from .output import run_and_emit
from .plot import Bar, Group
from .table import fit, wrap

WORKERS = 2
_ARRAYS: dict[int, Any] = {}


# -- tasks (module level: spawned workers import them) ------------------------------------------


def noop(x: Any) -> Any:
    return x


def pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


MIXED_TASK = 0.002  # seconds a task of the mixed-durations row sleeps
MIXED_PER_WORKER = 40  # tasks of it per worker


def nap_mixed() -> int:
    time.sleep(MIXED_TASK)
    return os.getpid()


def echo(conn: Any) -> None:
    """The far end of the bare transport's round trip: send back what comes, until None."""
    while True:
        obj = conn.recv()
        conn.send(obj)
        if obj is None:
            return


def warm(a: Adapter, timeout: float = 60.0) -> None:
    """Returns once every one of the pool's workers has answered a task: the rows that follow
    (a crash, a timeout) then measure the pool, not a worker still starting."""
    seen: set[int] = set()
    end = time.monotonic() + timeout
    while len(seen) < WORKERS and time.monotonic() < end:
        handles = [a.submit(pid_after, 0.05) for _ in range(WORKERS)]
        seen.update(a.result(h, 60) for h in handles)


def array_result(nbytes: int) -> Any:
    arr = _ARRAYS.get(nbytes)
    if arr is None:
        import numpy as np

        arr = _ARRAYS[nbytes] = np.ones(nbytes // 4, dtype=np.float32)
    return arr


def die_after_note(path: str) -> None:
    with open(path, "w") as f:
        f.write(repr(time.monotonic()))
    os.kill(os.getpid(), signal.SIGKILL)


def hang() -> None:
    while True:
        time.sleep(0.001)


class TwoArgError(Exception):
    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code
        self.detail = detail


def raise_two_arg() -> None:
    raise TwoArgError(7, "bad input")


# -- one adapter per pool ---------------------------------------------------------------------


class Adapter:
    """``submit(fn, *args) -> handle``, ``result(handle, timeout)``, ``map_all(fn, items)``."""

    name = ""
    timeout_kw: str | None = None  # how to give one task a deadline, if the pool can

    def __init__(self) -> None:
        self.pool: Any = None

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.pool.submit(fn, *args)

    def result(self, handle: Any, timeout: float | None = None) -> Any:
        return handle.result(timeout)

    def map_all(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        return list(self.pool.map(fn, items, chunksize=1))

    def submit_with_timeout(self, fn: Callable[..., Any], timeout: float) -> Any:
        raise NotImplementedError

    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


class FramepipePool(Adapter):
    name = "framepipe Pool"

    def __init__(self, task_timeout: float | None = None) -> None:
        self.pool = Pool(
            WORKERS, start_method="spawn", task_timeout=task_timeout, max_restarts=None
        )

    def submit_with_timeout(self, fn: Callable[..., Any], timeout: float) -> Any:
        return self.pool.submit(fn)

    def close(self) -> None:
        self.pool.terminate()


class StdlibExecutor(Adapter):
    name = "ProcessPoolExecutor"

    def __init__(self) -> None:
        self.pool = cf.ProcessPoolExecutor(WORKERS, mp_context=multiprocessing.get_context("spawn"))

    def close(self) -> None:
        for p in list(getattr(self.pool, "_processes", {}).values()):
            p.kill()
        self.pool.shutdown(wait=True, cancel_futures=True)


class StdlibPool(Adapter):
    name = "multiprocessing.Pool"

    def __init__(self) -> None:
        self.pool = multiprocessing.get_context("spawn").Pool(WORKERS)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.pool.apply_async(fn, args)

    def result(self, handle: Any, timeout: float | None = None) -> Any:
        try:
            return handle.get(timeout)
        except multiprocessing.TimeoutError:
            raise TimeoutError from None

    def map_all(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        results: list[Any] = self.pool.map(fn, items, chunksize=1)
        return results

    def close(self) -> None:
        self.pool.terminate()
        self.pool.join()


class LokyPool(Adapter):
    name = "loky"

    def __init__(self) -> None:
        import loky

        self.pool = loky.ProcessPoolExecutor(WORKERS)

    def close(self) -> None:
        self.pool.shutdown(wait=True, kill_workers=True)


class PebblePool(Adapter):
    name = "pebble"
    timeout_kw = "timeout"

    def __init__(self) -> None:
        import pebble

        self.pool = pebble.ProcessPool(WORKERS, context=multiprocessing.get_context("spawn"))

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.pool.schedule(fn, args=args)

    def map_all(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        return list(self.pool.map(fn, items, chunksize=1).result())

    def submit_with_timeout(self, fn: Callable[..., Any], timeout: float) -> Any:
        return self.pool.schedule(fn, timeout=timeout)

    def close(self) -> None:
        self.pool.stop()
        self.pool.join()


class MpirePool(Adapter):
    name = "mpire"
    timeout_kw = "task_timeout"

    def __init__(self) -> None:
        from mpire import WorkerPool  # type: ignore[attr-defined, unused-ignore]  # mpire absent: Any

        self.pool = WorkerPool(n_jobs=WORKERS, keep_alive=True)
        self.pool.__enter__()
        # a pool of its own for map(): mpire's map on a pool that ran apply_async tasks calls
        # the function with the wrong arguments
        self.mapper = WorkerPool(n_jobs=WORKERS, keep_alive=True)
        self.mapper.__enter__()

    def submit(self, fn: Callable[..., Any], *args: Any) -> Any:
        return self.pool.apply_async(fn, args)

    def result(self, handle: Any, timeout: float | None = None) -> Any:
        return handle.get(timeout)

    def map_all(self, fn: Callable[..., Any], items: list[Any]) -> list[Any]:
        results: list[Any] = self.mapper.map(fn, items, chunk_size=1, progress_bar=False)
        return results

    def submit_with_timeout(self, fn: Callable[..., Any], timeout: float) -> Any:
        return self.pool.apply_async(fn, (), task_timeout=timeout)

    def close(self) -> None:
        self.pool.terminate()
        self.mapper.terminate()


PEERS: list[tuple[str, type[Adapter], str | None]] = [
    ("framepipe Pool", FramepipePool, None),
    ("ProcessPoolExecutor", StdlibExecutor, None),
    ("multiprocessing.Pool", StdlibPool, None),
    ("loky", LokyPool, "loky"),
    ("pebble", PebblePool, "pebble"),
    ("mpire", MpirePool, "mpire"),
]


def missing_peers() -> list[str]:
    """The optional pools that do not import here."""
    gone = {p.module for p in peers.missing("workers")}
    return [module for _, _, module in PEERS if module is not None and module in gone]


# -- measurements -----------------------------------------------------------------------------


def _best(fn: Callable[[], float], repeat: int) -> float:
    return max(fn() for _ in range(repeat))


def tasks_per_second(a: Adapter, n: int, repeat: int) -> tuple[float, float]:
    def submit_all() -> float:
        t0 = time.perf_counter()
        handles = [a.submit(noop, i) for i in range(n)]
        for h in handles:
            a.result(h, 60)
        return n / (time.perf_counter() - t0)

    def map_all() -> float:
        t0 = time.perf_counter()
        a.map_all(noop, list(range(n)))
        return n / (time.perf_counter() - t0)

    submit_all()  # warm up: imports, connections
    a.map_all(noop, list(range(200)))
    return _best(submit_all, repeat), _best(map_all, repeat)


def mixed(a: Adapter, runs: int) -> float:
    """Efficiency under mixed durations: a burst of 2,000 no-op tasks, then
    ``MIXED_PER_WORKER * WORKERS`` tasks of ``MIXED_TASK`` seconds; the ideal time (each worker
    sleeping its share back to back) over the time taken, the median of ``runs`` runs."""
    ideal = MIXED_PER_WORKER * MIXED_TASK
    effs = []
    for _ in range(runs):
        for h in [a.submit(noop, i) for i in range(2000)]:
            a.result(h, 60)
        t0 = time.perf_counter()
        for h in [a.submit(nap_mixed) for _ in range(MIXED_PER_WORKER * WORKERS)]:
            a.result(h, 60)
        effs.append(ideal / (time.perf_counter() - t0))
    return statistics.median(effs)


class BareEcho:
    """The bare transport a pool's round trip is measured against: a framepipe ``Pipe``
    between this process and a spawned one that sends back what comes (send, receive)."""

    def __enter__(self) -> BareEcho:
        self.here, there = Pipe()
        self.child = multiprocessing.get_context("spawn").Process(target=echo, args=(there,))
        self.child.start()
        there.close()
        for i in range(100):  # warm up: imports, the reads' spin
            self.trip(i)
        return self

    def trip(self, i: int) -> float:
        """One round trip, in seconds."""
        t0 = time.perf_counter()
        self.here.send(i)
        self.here.recv()
        return time.perf_counter() - t0

    def __exit__(self, *exc: object) -> None:
        try:
            self.here.send(None)
            self.here.recv()
        finally:
            self.child.join(5)
            if self.child.is_alive():
                self.child.kill()
                self.child.join()
            self.here.close()


def bare_round_trip(n: int) -> float:
    """The median of ``n`` round trips on the bare transport (see BareEcho)."""
    with BareEcho() as bare:
        return statistics.median([bare.trip(i) for i in range(n)])


# A pool's round trip and the bare transport's are measured in turns, ROUND_TRIP_TURNS blocks of
# each, so that a change in the machine's speed during the run (other work, a VM's neighbours)
# falls on both medians alike instead of on one of them.
ROUND_TRIP_TURNS = 10


def round_trip(
    a: Adapter, n: int, bare: BareEcho | None = None
) -> tuple[float, float, float | None]:
    """One task's round trip on the idle pool ``a``: its median and p99 over ``n`` trips, and
    the bare transport's median over as many, measured in turns with them (None without
    ``bare``)."""
    times: list[float] = []
    bare_times: list[float] = []
    turns = ROUND_TRIP_TURNS if bare is not None else 1
    for _ in range(turns):
        if bare is not None:
            bare_times += [bare.trip(i) for i in range(n // turns)]
        for i in range(n // turns):
            t0 = time.perf_counter()
            a.result(a.submit(noop, i), 60)
            times.append(time.perf_counter() - t0)
    times.sort()
    return (
        statistics.median(times),
        times[int(len(times) * 0.99)],
        statistics.median(bare_times) if bare_times else None,
    )


def array_rate(a: Adapter, nbytes: int, count: int, repeat: int) -> float | None:
    try:
        import numpy  # noqa: F401
    except ImportError:
        return None

    def run() -> float:
        t0 = time.perf_counter()
        handles = [a.submit(array_result, nbytes) for _ in range(count)]
        for h in handles:
            out = a.result(h, 120)
            assert out.nbytes == nbytes
        return nbytes * count / (time.perf_counter() - t0)

    a.result(a.submit(array_result, nbytes), 120)
    return _best(run, repeat)


def crash(a: Adapter) -> dict[str, Any]:
    """SIGKILL a worker mid-task with 20 tasks queued behind it."""
    fd, note = tempfile.mkstemp(prefix="fp-bench-")
    os.close(fd)
    out: dict[str, Any] = {}
    try:
        victim = a.submit(die_after_note, note)
        behind = [a.submit(noop, i) for i in range(20)]
        try:
            a.result(victim, 5)
            out["failed"] = "returned?"
        except TimeoutError:
            out["failed"] = "never (5 s)"
        except BaseException as exc:  # noqa: BLE001 - whatever the pool raises is the finding
            failed_at = time.monotonic()
            with open(note) as f:
                killed_at = float(f.read() or "nan")
            out["to_failure"] = failed_at - killed_at
            out["error"] = type(exc).__name__
            out["says_pid"] = "pid" in str(exc)
            try:
                t = a.submit(noop, 1)
                a.result(t, 5)
                out["to_serving"] = time.monotonic() - killed_at
            except BaseException as exc2:  # noqa: BLE001
                out["to_serving"] = None
                out["serving_error"] = type(exc2).__name__
        ok = 0
        end = time.monotonic() + 5
        for h in behind:
            try:
                a.result(h, max(0.01, end - time.monotonic()))
                ok += 1
            except BaseException:  # noqa: BLE001
                pass
        out["queued_ok"] = ok
    finally:
        os.unlink(note)
    return out


def crash_median(cls: type[Adapter], times: int) -> dict[str, Any]:
    """:func:`crash` on ``times`` fresh pools: the first one's findings, with the median times
    to the failed future and to serving again (and how many crashes went into them)."""
    runs = []
    for _ in range(times):
        got = _fresh(cls, crash)
        if isinstance(got, str):
            return {"failed": got}
        runs.append(got)
    out = dict(runs[0])
    for key in ("to_failure", "to_serving"):
        values = [r[key] for r in runs if r.get(key) is not None]
        if values:
            out[key] = statistics.median(values)
    out["crashes"] = len(runs)
    return out


def two_arg(a: Adapter) -> str:
    try:
        a.result(a.submit(raise_two_arg), 10)
        return "returned?"
    except TwoArgError as exc:
        intact = exc.code == 7 and exc.detail == "bad input"
        verdict = "TwoArgError, intact" if intact else "TwoArgError, attributes lost"
    except TimeoutError:
        return "hangs"
    except BaseException as exc:  # noqa: BLE001 - what the caller gets is the finding
        verdict = type(exc).__name__
    try:
        a.result(a.submit(noop, 1), 10)
        return verdict + "; pool ok"
    except BaseException as exc:  # noqa: BLE001
        return verdict + f"; pool then raises {type(exc).__name__}"


def timeout_overshoot(a: Adapter) -> tuple[float | None, bool | None]:
    a.result(a.submit(noop, 1), 60)  # workers up
    t0 = time.monotonic()
    h = a.submit_with_timeout(hang, 0.5)
    try:
        a.result(h, 30)
    except BaseException as exc:  # noqa: BLE001 - the timeout error, whatever its class
        late = time.monotonic() - t0 - 0.5
        stack = getattr(exc, "stack", None)
        return late, bool(stack and "hang" in stack)
    return None, None


def timeout_median(cls: type[Adapter], times: int, **kw: Any) -> tuple[float | None, bool | None]:
    """:func:`timeout_overshoot` on ``times`` fresh pools: the median overshoot, and whether
    every one of them came with the stack."""
    lates, stacks = [], []
    for _ in range(times):
        got = _fresh(cls, timeout_overshoot, **kw)
        if not isinstance(got, tuple) or got[0] is None:
            return None, None
        lates.append(got[0])
        stacks.append(bool(got[1]))
    return statistics.median(lates), all(stacks)


def _fresh(cls: type[Adapter], fn: Callable[[Adapter], Any], **kw: Any) -> Any:
    """``fn`` on a pool of its own (a fault must not spoil the next row), closed after."""
    a = cls(**kw)
    try:
        warm(a)  # every pool measured once all its workers run
        return fn(a)
    except BaseException as exc:  # noqa: BLE001 - a failing peer is a finding, not a crash
        return f"failed: {type(exc).__name__}: {exc}"[:120]
    finally:
        try:
            a.close()
        except BaseException:  # noqa: BLE001
            pass


def _chosen(names: Sequence[str]) -> list[tuple[str, type[Adapter], str | None]]:
    patterns = [p.strip().lower() for value in names for p in value.split(",") if p.strip()]
    if not patterns:
        return list(PEERS)
    chosen = [peer for peer in PEERS if any(peer[0].lower().startswith(p) for p in patterns)]
    if not chosen:
        raise ValueError(
            f"--rows {','.join(names)} selects no pool; the pools are: "
            + ", ".join(name for name, _, _ in PEERS)
        )
    return chosen


def run(
    quick: bool,
    progress: Callable[[str], None] = lambda line: None,
    names: Sequence[str] = (),
    workers: Sequence[int] = (),
) -> dict[str, Any]:
    """Every chosen pool's rows: ``{"machine", "settings", "rows", "missing", ...}``; with
    more than one count in ``workers``, the throughput rows at each (``"scaling"``)."""
    global WORKERS
    counts = list(workers) or [WORKERS]
    if any(not isinstance(k, int) or k < 1 for k in counts):
        raise ValueError(f"--workers takes positive counts, not {counts}")
    chosen = _chosen(names)
    n = 5000 if quick else 20000
    repeat = 2 if quick else 3
    mixed_runs = 3 if quick else 5
    machine = machine_info()
    started = time.monotonic()
    probe = LoadProbe()
    rows: dict[str, dict[str, Any]] = {}
    scaling: dict[int, dict[str, dict[str, Any]]] = {}
    skipped = missing_peers()
    runnable = [peer for peer in chosen if peer[2] not in skipped]
    if len(counts) > 1:
        for count in counts:
            WORKERS = count
            progress(f"bench workers: {len(runnable)} pools, {count} workers each")
            at: dict[str, dict[str, Any]] = {}
            for name, cls, _module in runnable:
                cell: dict[str, Any] = {}

                def scale(a: Adapter, cell: dict[str, Any] = cell) -> None:
                    cell["submit"], cell["map"] = tasks_per_second(a, n, repeat)
                    cell["mixed"] = mixed(a, mixed_runs)

                failed = _fresh(cls, scale)
                at[name] = {"error": failed} if failed else cell
            scaling[count] = at
        rows = scaling[counts[-1]]
    else:
        WORKERS = counts[0]
        progress(f"bench workers: {len(runnable)} pools, {WORKERS} workers each, {n:,} tasks a run")
        for k, (name, cls, _module) in enumerate(runnable, 1):
            progress(f"[{k}/{len(runnable)}] {name}: throughput")
            row: dict[str, Any] = {}

            def speed(a: Adapter, row: dict[str, Any] = row) -> None:
                row["submit"], row["map"] = tasks_per_second(a, n, repeat)
                row["mixed"] = mixed(a, mixed_runs)
                trips = 1000 if quick else 3000
                if isinstance(a, FramepipePool):  # beside the bare transport, in turns
                    with BareEcho() as echo_end:
                        row["rt_median"], row["rt_p99"], row["bare_rt"] = round_trip(
                            a, trips, echo_end
                        )
                else:
                    row["rt_median"], row["rt_p99"], _ = round_trip(a, trips)
                row["mb1"] = array_rate(a, 1 << 20, 32 if quick else 64, repeat)
                row["mb16"] = array_rate(a, 16 << 20, 4 if quick else 16, repeat)

            failed = _fresh(cls, speed)
            if failed:
                row["error"] = failed
            progress(
                f"[{k}/{len(runnable)}] {name}: an exception with two arguments, a crash, a timeout"
            )
            row["two_arg"] = _fresh(cls, two_arg)
            row["crash"] = crash_median(cls, 1 if quick else 5)
            if cls is FramepipePool or cls.timeout_kw is not None:
                kw = {"task_timeout": 0.5} if cls is FramepipePool else {}
                late = timeout_median(cls, 1 if quick else 3, **kw)
            else:
                late = (None, None)
            row["timeout_late"], row["timeout_stack"] = late
            rows[name] = row
    bare = None
    if len(counts) == 1:  # framepipe's, measured in turns with its pool's round trip
        bare = rows.get(FramepipePool.name, {}).get("bare_rt")
        if bare is None:
            bare = bare_round_trip(1000 if quick else 3000)
    elapsed = time.monotonic() - started
    progress(f"done in {elapsed:.1f} s")
    gone = [p for p in peers.missing("workers") if p.module != "matplotlib"]
    return {
        "machine": machine,
        "settings": {
            "suite": "workers",
            "quick": quick,
            "workers": counts if len(counts) > 1 else WORKERS,
            "tasks": n,
            "repeat": repeat,
            "elapsed_s": round(elapsed, 2),
        },
        "workers": WORKERS,
        "tasks": n,
        "rows": rows,
        "bare_rt": bare,
        "scaling": {str(k): v for k, v in scaling.items()},
        "missing": skipped,
        "missing_line": peers.missing_line_for(gone),
        "peers": peers.versions("workers"),
        "targets": _scaling_targets(scaling) if scaling else _targets(rows, bare),
        "load": probe.finish(),
    }


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"


def _fmt_mb(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e6:,.0f}"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _target(what: str, got: float, unit: str, target: str, met: bool) -> dict[str, Any]:
    return {"what": what, "got": got, "unit": unit, "target": target, "met": met}


def _throughput_targets(rows: dict[str, dict[str, Any]], at: str = "") -> list[dict[str, Any]]:
    """submit and map against the fastest peer, mixed durations against 0.9 and the best
    peer: the targets the scaling table checks at each worker count too."""
    fp = rows.get("framepipe Pool", {})
    others = {k: v for k, v in rows.items() if k != "framepipe Pool" and "error" not in v}
    if not fp or "error" in fp or not others:
        return []
    best_submit = max(v["submit"] for v in others.values())
    best_map = max(v["map"] for v in others.values())
    best_mixed = max(v["mixed"] for v in others.values())
    submit, mapped = fp["submit"] / best_submit, fp["map"] / best_map
    return [
        _target(f"no-op submit/s vs the fastest peer{at}", submit, "x", ">= 1.3x", submit >= 1.3),
        _target(f"no-op map/s vs the fastest peer{at}", mapped, "x", ">= 2x", mapped >= 2),
        _target(
            f"mixed durations efficiency{at}",
            fp["mixed"],
            "",
            f">= 0.9, >= {best_mixed:.2f}",
            fp["mixed"] >= 0.9 and fp["mixed"] >= best_mixed,
        ),
    ]


def _scaling_targets(scaling: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    out = []
    for count, rows in scaling.items():
        out += _throughput_targets(rows, f", {count} workers")
    fp = {k: r.get("framepipe Pool", {}).get("submit") for k, r in scaling.items()}
    top = max(scaling)
    if 4 in fp and top > 4 and fp[4] and fp[top]:
        got = fp[top] / fp[4]
        out.append(_target(f"submit/s at {top} workers vs at 4", got, "x", ">= 1x", got >= 1))
    return out


def _targets(rows: dict[str, dict[str, Any]], bare: float | None = None) -> list[dict[str, Any]]:
    """framepipe's Pool against the peers of this run: ``{"what", "got", "unit", "target",
    "met"}`` each."""
    fp = rows.get("framepipe Pool", {})
    if not fp or "error" in fp:
        return []
    out = _throughput_targets(rows)

    def add(what: str, got: float, unit: str, target: str, met: bool) -> None:
        out.append(_target(what, got, unit, target, met))

    if bare:
        rt = fp["rt_median"] / bare
        add("round trip vs the bare transport's", rt, "x", "<= 2x", rt <= 2)
    ppe = rows.get("ProcessPoolExecutor", {})
    if ppe and "error" not in ppe:
        rt = fp["rt_median"] / ppe["rt_median"]
        add("round trip vs ProcessPoolExecutor", rt, "x", "<= 0.6x", rt <= 0.6)
        if fp.get("mb16") and ppe.get("mb16"):
            m = fp["mb16"] / ppe["mb16"]
            add("16 MiB results vs ProcessPoolExecutor", m, "x", ">= 3x", m >= 3)
    c = fp.get("crash", {})
    for key, what, target, limit in (
        ("to_failure", "crash to the failed future", "<= 3 ms", 0.003),
        ("to_serving", "crash to the next task served", "<= 20 ms", 0.02),
    ):
        if c.get(key) is not None:
            median = f"{what}, median of {c.get('crashes', 1)}"
            add(median, c[key] * 1e3, "ms", target, c[key] <= limit)
    if fp.get("timeout_late") is not None:
        add(
            "0.5 s timeout overshoot (median), stack captured",
            fp["timeout_late"] * 1e3,
            "ms",
            "<= 5 ms",
            bool(fp["timeout_late"] <= 0.005 and fp.get("timeout_stack")),
        )
    return out


def _format_scaling(report: dict[str, Any]) -> list[str]:
    """The scaling table: each pool's submit/s, map/s and mixed-durations efficiency at each
    worker count."""
    scaling = report["scaling"]
    counts = list(scaling)
    names = list(next(iter(scaling.values())))
    head = f"{'pool':<21}" + "".join(f"{'N=' + c:>9}" for c in counts)
    lines = [
        *wrap(
            "scaling: no-op tasks per second through submit() + result() and through "
            "map(chunksize=1), and the mixed-durations efficiency (a burst of 2,000 no-op "
            f"tasks, then {MIXED_PER_WORKER} * N tasks of {MIXED_TASK * 1e3:g} ms: the ideal "
            "time over the time taken, 1 is best), at each number N of workers a pool",
            "",
        ),
    ]
    for key, title, fmt in (
        ("submit", "submit/s", _fmt_rate),
        ("map", "map/s", _fmt_rate),
        ("mixed", "mixed durations efficiency", lambda x: "-" if x is None else f"{x:.2f}"),
    ):
        lines += ["", title, head]
        for name in names:
            cells = []
            for c in counts:
                r = scaling[c].get(name, {})
                cells.append("failed" if "error" in r else fmt(r.get(key)))
            lines.append(f"{name:<21}" + "".join(f"{cell:>9}" for cell in cells))
    return lines


def _format_targets(report: dict[str, Any]) -> list[str]:
    if not report["targets"]:
        return []
    lines = ["", "targets (framepipe's Pool against the other pools of this run):"]
    for t in report["targets"]:
        unit = t["unit"]
        got = (
            f"{t['got']:.2f}x"
            if unit == "x"
            else f"{t['got']:.1f}ms"
            if unit
            else f"{t['got']:.2f}"
        )
        lines.append(
            f"  {t['what']:<46}{got:>8}  {t['target']:<16}{'met' if t['met'] else 'MISSED'}"
        )
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The throughput table, the fault table, the timeouts, the targets and the missing
    pools, within 100 columns."""
    rows = report["rows"]
    m = report["machine"]
    if report.get("scaling"):
        lines = [
            f"framepipe {m['framepipe']} bench workers: the scaling run, {report['tasks']:,} "
            f"no-op tasks a run, the best of {report['settings']['repeat']} runs",
            f"run {m['date']} on {m['cpus_usable']} CPUs; {m['cpu_model']}; {m['python']}; "
            f"core {m['core']}",
            "",
            *_format_scaling(report),
            *_format_targets(report),
            *_format_tail(report),
        ]
        return "\n".join(fit(lines))
    lines = [
        f"framepipe {m['framepipe']} bench workers: {report['workers']} workers a pool, "
        f"{report['tasks']:,} no-op tasks a run, the best of {report['settings']['repeat']} runs",
        f"run {m['date']} on {m['cpus_usable']} CPUs; {m['cpu_model']}; {m['python']}; "
        f"core {m['core']}",
        "",
        *wrap(
            "throughput: submit/s and map/s are no-op tasks per second through submit() + "
            "result() and through map(chunksize=1); mixed is the efficiency under mixed "
            f"durations (2,000 no-op tasks, then {MIXED_PER_WORKER} * N tasks of "
            f"{MIXED_TASK * 1e3:g} ms: the ideal time over the time taken, median of 5 runs; "
            "1 is best); rt is one task's round trip (median, "
            "p99); 1MiB and 16MiB are MB/s of float32 array results; higher rates and "
            "lower times are better",
            "",
        ),
        "",
        f"{'pool':<21}{'submit/s':>9}{'map/s':>9}{'mixed':>6}{'rt med':>8}{'rt p99':>8}"
        f"{'1MiB MB/s':>10}{'16MiB MB/s':>11}",
    ]
    for name, r in rows.items():
        if "error" in r:
            lines += wrap(f"{name:<21}failed: {r['error']}", "", " " * 21)
            continue
        lines.append(
            f"{name:<21}{_fmt_rate(r.get('submit')):>9}{_fmt_rate(r.get('map')):>9}"
            f"{r.get('mixed', float('nan')):>6.2f}"
            f"{r['rt_median'] * 1e6:>6.0f}us{r['rt_p99'] * 1e6:>6.0f}us"
            f"{_fmt_mb(r.get('mb1')):>10}{_fmt_mb(r.get('mb16')):>11}"
        )
    if report.get("bare_rt"):
        lines.append(
            f"{'bare transport':<21}{'':>24}{report['bare_rt'] * 1e6:>6.0f}us"
            "  (send + recv on a framepipe Pipe, in turns)"
        )
    lines += [
        "",
        *wrap(
            "faults: a worker SIGKILLed mid-task with 20 tasks queued behind it: how soon "
            "(medians over 5 fresh pools, 1 with --quick) "
            "its future fails, how soon the pool serves again, how many of the 20 finish, "
            "what the caller gets ('pid': the error names the dead worker); then a task "
            "raising TwoArgError(code, detail), an exception the stdlib cannot unpickle",
            "",
        ),
        "",
        f"{'pool':<21}{'fails in':>9}{'serves in':>10}{'queued ok':>10}  error",
    ]
    for name, r in rows.items():
        c = r.get("crash")
        if not c:
            continue
        err = c.get("error") or c.get("failed", "")
        if c.get("says_pid"):
            err += " (pid)"
        serving = f"{_ms(c['to_serving'])}ms" if c.get("to_serving") is not None else "never"
        fails = f"{_ms(c['to_failure'])}ms" if c.get("to_failure") is not None else "never"
        lines.append(f"{name:<21}{fails:>9}{serving:>10}{c.get('queued_ok', 0):>7}/20  {err[:40]}")
        lines += wrap(f"two-arg exception: {r.get('two_arg')}", " " * 21, " " * 23)
    lines += [
        "",
        *wrap(
            "timeouts: a task that hangs, given 0.5 s: how late it fails (median over 3 fresh "
            "pools, 1 with --quick), and whether the hung worker's stack comes with the error",
            "",
        ),
        "",
    ]
    for name, r in rows.items():
        late = r.get("timeout_late")
        if late is None:
            lines.append(f"  {name:<21} no per-task timeout")
        else:
            lines.append(
                f"  {name:<21} {late * 1e3:6.1f} ms late, stack: "
                f"{'yes' if r.get('timeout_stack') else 'no'}"
            )
    lines += _format_targets(report) + _format_tail(report)
    return "\n".join(fit(lines))


def _format_tail(report: dict[str, Any]) -> list[str]:
    """Whether the machine was busy (when a target was missed), and the pools not installed."""
    lines: list[str] = []
    missed = sum(1 for t in report["targets"] if not t["met"])
    for line in busy_lines(report.get("load"), (), missed):
        lines += ["", *wrap(line, "")]
    if report.get("missing_line"):
        lines += ["", *wrap(report["missing_line"], "")]
    return lines


_METRICS = (
    ("submit", "no-op submit/s", False),
    ("map", "no-op map/s", False),
    ("rt_median", "round trip", True),
    ("mb1", "1 MiB results", False),
    ("mb16", "16 MiB results", False),
)


def plot_groups(report: dict[str, Any]) -> list[Any]:
    """The ``--plot`` groups: each pool's speed against ProcessPoolExecutor, per metric."""
    rows = report["rows"]
    base = rows.get("ProcessPoolExecutor", {})
    groups = []
    for key, title, lower in _METRICS:
        ref = base.get(key)
        if not ref:
            continue
        group = Group(title)
        for name, r in rows.items():
            value = r.get(key)
            if value:
                speed = ref / value if lower else value / ref
                group.bars.append(Bar(name, speed, name.startswith("framepipe")))
        groups.append(group)
    return groups


def main(args: argparse.Namespace) -> int:
    """``python -m framepipe bench workers``."""

    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    return run_and_emit(
        args,
        lambda: run(
            quick=args.quick, progress=progress, names=args.rows, workers=args.workers or ()
        ),
        format_report,
        plot_groups,
        "speed against concurrent.futures.ProcessPoolExecutor (x, log scale; above 1 is faster)",
    )
