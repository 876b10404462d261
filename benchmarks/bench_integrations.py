"""framepipe beside the peers, in one run: maps of a lambda, joblib's Parallel, and the map
of a module-level function (the path that by-value sending must not slow down).

    python benchmarks/bench_integrations.py [--items 20000] [--calls 10000] [--repeat 5]

Each figure is the median of ``--repeat`` runs on warm workers (started before timing), two
workers each. Peers that are not installed are skipped.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any


def square(x: int) -> int:
    return x * x


def _median_rate(n: int, run: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return n / statistics.median(times)


def bench_maps(items: int, repeat: int) -> dict[str, float]:
    from framepipe.workers import Pool

    data = list(range(items))
    rates: dict[str, float] = {}
    f = lambda x: x * x  # noqa: E731 - the lambda each library maps
    with Pool(2) as pool:
        list(pool.map(f, range(100)))  # warm: workers started, function defined
        rates["framepipe map(square)"] = _median_rate(
            items, lambda: list(pool.map(square, data)), repeat
        )
        rates["framepipe map(lambda)"] = _median_rate(
            items, lambda: list(pool.map(f, data)), repeat
        )
        # item by item: one task an item, as without the chunks a long map of fast items gets
        # by default (see NOTE [ Chunks of a map ] in framepipe.workers.pool)
        rates["framepipe map(square, chunksize=1)"] = _median_rate(
            items, lambda: list(pool.map(square, data, chunksize=1)), repeat
        )
        rates["framepipe map(lambda, chunksize=1)"] = _median_rate(
            items, lambda: list(pool.map(f, data, chunksize=1)), repeat
        )
        # mpire cuts a map in chunks by default (items / (4 * workers)); this is framepipe's
        # map in chunks of a size of the same order (a crash then fails its whole chunk)
        rates["framepipe map(lambda, chunksize=1000)"] = _median_rate(
            items, lambda: list(pool.map(f, data, chunksize=1000)), repeat
        )
    try:
        from loky import get_reusable_executor
    except ImportError:
        print("loky is not installed: skipped", file=sys.stderr)
    else:
        ex = get_reusable_executor(max_workers=2)
        list(ex.map(f, range(100)))
        rates["loky map(lambda)"] = _median_rate(items, lambda: list(ex.map(f, data)), repeat)
        ex.shutdown(wait=True)
    try:
        from mpire import WorkerPool
    except ImportError:
        print("mpire is not installed: skipped", file=sys.stderr)
    else:
        # mpire's default start method (fork): spawn would need use_dill=True and dill
        with WorkerPool(n_jobs=2, keep_alive=True) as mp_pool:
            mp_pool.map(f, range(100))
            rates["mpire map(lambda)"] = _median_rate(items, lambda: mp_pool.map(f, data), repeat)
    return rates


def bench_joblib(calls: int, repeat: int) -> dict[str, float]:
    try:
        import joblib
    except ImportError:
        print("joblib is not installed: skipped", file=sys.stderr)
        return {}
    import framepipe.joblib  # noqa: F401 - registers the backend

    rates = {}
    # The floor, joblib's own work in this process (making the calls, batching, results), and
    # the two backends, in turn, run by run, so that a burst of load elsewhere on the machine
    # falls on all three alike.
    runs = {
        "joblib Parallel(n_jobs=1), in this process": ("sequential", 1),
        "joblib Parallel(n_jobs=2), framepipe backend": ("framepipe", 2),
        "joblib Parallel(n_jobs=2), loky backend": ("loky", 2),
    }
    times: dict[str, list[float]] = {name: [] for name in runs}
    for i in range(repeat + 1):
        for name, (backend, n_jobs) in runs.items():
            with joblib.parallel_config(backend=backend, n_jobs=n_jobs):
                start = time.perf_counter()
                joblib.Parallel()(joblib.delayed(abs)(-i) for i in range(calls))
                if i:  # the first run of each starts its workers
                    times[name].append(time.perf_counter() - start)
    for name, run_times in times.items():
        rates[name] = calls / statistics.median(run_times)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=20_000)
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--only", choices=["maps", "joblib"], default=None)
    args = parser.parse_args()
    rates: dict[str, float] = {}
    if args.only in (None, "maps"):
        rates.update(bench_maps(args.items, args.repeat))
    if args.only in (None, "joblib"):
        rates.update(bench_joblib(args.calls, args.repeat))
    width = max(map(len, rates), default=0)
    print(f"{'':{width}}  {'per second':>12}")
    for name, rate in rates.items():
        print(f"{name:{width}}  {rate:12,.0f}")
    ratios = [
        ("framepipe map(lambda)", "loky map(lambda)"),
        ("framepipe map(lambda)", "mpire map(lambda)"),
        ("framepipe map(lambda, chunksize=1)", "mpire map(lambda)"),
        ("framepipe map(lambda, chunksize=1000)", "mpire map(lambda)"),
        ("joblib Parallel(n_jobs=2), framepipe backend", "joblib Parallel(n_jobs=2), loky backend"),
    ]
    for a, b in ratios:
        if a in rates and b in rates:
            print(f"{a} / {b}: {rates[a] / rates[b]:.2f}x")


if __name__ == "__main__":
    main()
