"""Code written against ``concurrent.futures.Executor`` runs on framepipe's ``Pool`` on one
machine and on a dask cluster past it (``Client.get_executor()``), unchanged."""

from __future__ import annotations

import concurrent.futures as cf

import pytest
from _worker_tasks import add, square

from framepipe.workers import Pool


def pipeline(executor: cf.Executor) -> tuple[list[int], int, list[int]]:
    """What a user's code does with an executor: map, submit, as_completed."""
    squares = list(executor.map(square, range(12)))
    total = executor.submit(add, 40, 2).result(timeout=60)
    futures = [executor.submit(square, n) for n in (3, 5, 7)]
    done = sorted(f.result() for f in cf.as_completed(futures, timeout=60))
    return squares, total, done


EXPECTED = ([n * n for n in range(12)], 42, [9, 25, 49])


def test_pipeline_on_pool():
    with Pool(2) as pool:
        assert pipeline(pool) == EXPECTED


def test_pipeline_on_a_dask_cluster():
    distributed = pytest.importorskip("distributed")
    with (
        distributed.LocalCluster(
            n_workers=1, threads_per_worker=2, processes=False, dashboard_address=None
        ) as cluster,
        distributed.Client(cluster) as client,
    ):
        executor = client.get_executor()
        assert isinstance(executor, cf.Executor)
        assert pipeline(executor) == EXPECTED
