"""What ``DataLoader.state_dict()`` costs, and whether taking it slows the epoch.

    python benchmarks/bench_loader_state.py [--batches 3000]

For a map-style dataset (shuffled, in order and out of order) and an iterable one with a
``state_dict`` of its own (its per-worker states travel with every batch), an epoch is run
twice: once taking the loader's state after every batch, once without. Printed: the time of
one ``state_dict()`` call (median, 99th percentile, worst) and the batches/s of both runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

try:
    import framepipe  # noqa: F401
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from framepipe.workers import DataLoader, get_worker_info


class Numbers:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


class Stream:
    """An iterable dataset with a state: its position in its worker's part."""

    def __init__(self, n: int) -> None:
        self.n, self.pos = n, 0

    def __iter__(self) -> Any:
        info = get_worker_info()
        wid, k = (0, 1) if info is None else (info.id, info.num_workers)
        while wid + self.pos * k < self.n:
            self.pos += 1
            yield wid + (self.pos - 1) * k

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def run(make: Any, batches: int, take: bool) -> tuple[float, list[float]]:
    """(batches/s, seconds of each state_dict() call)."""
    costs: list[float] = []
    clock = time.perf_counter
    with make() as loader:
        it = iter(loader)
        next(it)
        start = clock()
        for _ in range(batches):
            next(it)
            if take:
                t0 = clock()
                loader.state_dict()
                costs.append(clock() - t0)
        elapsed = clock() - start
    return batches / elapsed, costs


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    n = (args.batches + 10) * 32
    w = args.workers
    cases = {
        "map, shuffled, in order": lambda: DataLoader(
            Numbers(n), batch_size=32, shuffle=True, num_workers=w
        ),
        "map, shuffled, out of order": lambda: DataLoader(
            Numbers(n), batch_size=32, shuffle=True, num_workers=w, in_order=False
        ),
        "iterable with state_dict": lambda: DataLoader(Stream(n), batch_size=32, num_workers=w),
    }
    print(f"{w} workers, batches of 32 ints, {args.batches} batches a run")
    print(
        f"{'case':<30} {'median us':>9} {'p99 us':>8} {'max us':>8} "
        f"{'batch/s taking':>15} {'batch/s not':>12}"
    )
    for name, make in cases.items():
        rate_without, _ = run(make, args.batches, False)
        rate_with, costs = run(make, args.batches, True)
        costs.sort()
        p99 = costs[int(len(costs) * 0.99)]
        print(
            f"{name:<30} {statistics.median(costs) * 1e6:>9.1f} {p99 * 1e6:>8.1f} "
            f"{costs[-1] * 1e6:>8.1f} {rate_with:>15,.0f} {rate_without:>12,.0f}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
