"""Worker pools side by side: no-op tasks through ``submit`` and ``map``, and the round trip of
one task, for framepipe's Pool, ``concurrent.futures.ProcessPoolExecutor`` and
``multiprocessing.Pool`` (2 spawned workers each). ``python -m framepipe bench workers`` runs
the same comparison with more peers and the fault rows."""

from __future__ import annotations

import concurrent.futures as cf
import multiprocessing
from collections.abc import Iterator
from typing import Any

import pytest

from framepipe.bench.workers import noop
from framepipe.workers import Pool

TASKS = 2000


class _MpPool:
    """multiprocessing.Pool behind the two calls the benchmarks make."""

    def __init__(self) -> None:
        self.pool = multiprocessing.get_context("spawn").Pool(2)

    def submit(self, fn: Any, arg: Any) -> Any:
        return _Result(self.pool.apply_async(fn, (arg,)))

    def map(self, fn: Any, items: Any, chunksize: int = 1) -> Any:
        return self.pool.map(fn, items, chunksize=chunksize)

    def shutdown(self) -> None:
        self.pool.terminate()
        self.pool.join()


class _Result:
    def __init__(self, r: Any) -> None:
        self.r = r

    def result(self, timeout: float | None = None) -> Any:
        return self.r.get(timeout)


@pytest.fixture(scope="module", params=["framepipe", "ProcessPoolExecutor", "multiprocessing"])
def pool(request: pytest.FixtureRequest) -> Iterator[Any]:
    if request.param == "framepipe":
        p: Any = Pool(2, start_method="spawn")
    elif request.param == "ProcessPoolExecutor":
        p = cf.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn"))
    else:
        p = _MpPool()
    p.submit(noop, 0).result(60)  # workers running
    yield p
    p.shutdown()


@pytest.mark.benchmark(group="workers-submit")
def test_submit_noop_tasks(benchmark: Any, pool: Any) -> None:
    def run() -> int:
        futures = [pool.submit(noop, i) for i in range(TASKS)]
        return sum(f.result(60) for f in futures)

    assert benchmark(run) == sum(range(TASKS))


@pytest.mark.benchmark(group="workers-map")
def test_map_noop_tasks(benchmark: Any, pool: Any) -> None:
    assert benchmark(lambda: sum(pool.map(noop, range(TASKS), chunksize=1))) == sum(range(TASKS))


@pytest.mark.benchmark(group="workers-roundtrip")
def test_round_trip(benchmark: Any, pool: Any) -> None:
    assert benchmark(lambda: pool.submit(noop, 7).result(60)) == 7
