"""``Pool.map`` without a chunksize: a long map of fast items goes in chunks whose items still
end one by one (see NOTE [ Chunks of a map ] in ``framepipe.workers.pool``). Real processes on
both engines. Whether a map went in chunks is read from the workers' task counts, never from
timing: the probe's limits are widened where a test needs chunks for sure."""

from __future__ import annotations

import pytest
from _worker_tasks import (
    fail_at,
    identity,
    kill_once_at,
    kill_self_if,
    slow_below,
    unreadable_at,
)

from framepipe.workers import Pool, TaskUnpicklingError, WorkerCrashed
from framepipe.workers import pool as pool_module

WAIT = 60  # a hang guard only
N = 5000


@pytest.fixture(autouse=True)
def _clean(no_leftover_processes):
    yield


@pytest.fixture
def chunks_for_sure(monkeypatch):
    """The probe always ends in time and asks for the largest chunks (4 a worker)."""
    monkeypatch.setattr(pool_module, "_AUTO_WAIT", WAIT)
    monkeypatch.setattr(pool_module, "_AUTO_START_WAIT", WAIT)
    monkeypatch.setattr(pool_module, "_AUTO_CHUNK_SECONDS", 1e9)


def _tasks_for(pool: Pool, run) -> int:
    """How many tasks ``run()`` handed the pool's workers (counted as the pool queues them:
    a worker's own count is updated after its answer, and may lag a read of it)."""
    core = pool._core
    queued = []
    submit_many = core.submit_many

    def counting(fn, items, timeout=None, blame=None):
        items = list(items)
        queued.append(len(items))
        return submit_many(fn, items, timeout, blame)

    core.submit_many = counting
    try:
        run()
    finally:
        del core.submit_many
    return sum(queued)


def test_a_long_map_of_fast_items_goes_in_chunks(engine, chunks_for_sure):
    with Pool(2, start_method="fork") as pool:
        assert pool.submit(identity, 0).result(WAIT) == 0
        out: list[int] = []
        tasks = _tasks_for(pool, lambda: out.extend(pool.map(identity, range(N))))
        assert out == list(range(N))
        probe = pool_module._AUTO_PROBE * 2
        assert tasks == probe + 8  # the probe's items one by one, then 4 chunks a worker
        # two iterables, and a lambda (by value)
        assert list(pool.map(lambda a, b: a - b, range(N), range(N, 0, -1))) == [
            2 * i - N for i in range(N)
        ]


def test_short_maps_slow_items_a_chunksize_or_a_task_timeout_go_item_by_item(engine):
    with Pool(2, start_method="fork") as pool:
        assert pool.submit(identity, 0).result(WAIT) == 0
        assert _tasks_for(pool, lambda: list(pool.map(identity, range(500)))) == 500
        assert _tasks_for(pool, lambda: list(pool.map(identity, range(N), chunksize=1))) == N
        # the probe's items take 0.05 s each: far past its 20 ms, so the rest is not chunked
        assert (
            _tasks_for(
                pool, lambda: list(pool.map(slow_below, range(2000), [64] * 2000, [0.05] * 2000))
            )
            == 2000
        )
    with Pool(2, start_method="fork", task_timeout=WAIT) as pool:
        assert _tasks_for(pool, lambda: list(pool.map(identity, range(N)))) == N


def test_an_exception_is_raised_at_its_own_item(engine, chunks_for_sure):
    with Pool(2, start_method="fork") as pool:
        got = []
        with pytest.raises(ValueError, match="item 3001 is bad") as info:
            for value in pool.map(fail_at, range(N), [3001] * N):
                got.append(value)
        assert got == [i + 1 for i in range(3001)]
        assert "fail_at" in "".join(_causes(info.value))  # the worker's traceback
        assert list(pool.map(identity, range(N))) == list(range(N))
        assert pool.broken is None and pool.crashes == []


def _causes(exc: BaseException) -> list[str]:
    out = []
    while exc is not None:
        out.append(str(exc))
        exc = exc.__cause__
    return out


def test_a_crash_in_a_chunk_fails_only_the_item_that_crashed(engine, chunks_for_sure):
    with Pool(2, start_method="fork", max_restarts=None) as pool:
        got = []
        with pytest.raises(WorkerCrashed) as info:
            for value in pool.map(kill_self_if, range(N), [{3001}] * N):
                got.append(value)
        assert got == [2 * i for i in range(3001)]
        assert info.value.signal_name == "SIGKILL"
        assert info.value.task_name.endswith("kill_self_if")
        assert "task 3001 is about to die" in str(info.value)  # its last stderr lines
        # the chunk died, then the item alone: two workers
        assert len(pool.crashes) == 2
        assert pool.broken is None
        assert pool.submit(identity, 5).result(WAIT) == 5


def test_a_chunk_whose_worker_died_runs_again_item_by_item(engine, chunks_for_sure, tmp_path):
    """An item that kills its worker once only: every item of its chunk, before and after it,
    still gets its result."""
    marker = tmp_path / "died"
    with Pool(2, start_method="fork") as pool:
        args = [2600] * N, [str(marker)] * N
        assert list(pool.map(kill_once_at, range(N), *args)) == [2 * i for i in range(N)]
        assert marker.exists() and len(pool.crashes) == 1


def test_a_result_that_cannot_be_read_fails_only_its_item(engine, chunks_for_sure):
    with Pool(2, start_method="fork") as pool:
        got = []
        with pytest.raises(TaskUnpicklingError, match="only_in_the_worker"):
            for value in pool.map(unreadable_at, range(N), [4000] * N):
                got.append(value)
        assert got == list(range(4000))
        assert pool.broken is None and pool.crashes == []


def test_the_timeout_bounds_a_chunked_map(engine, chunks_for_sure):
    with Pool(2, start_method="fork") as pool:
        assert pool.submit(identity, 0).result(WAIT) == 0
        got = []
        # the items of the last chunk sleep: the deadline passes while they run
        slow = list(pool.map(identity, range(N)))  # (warm)
        assert slow == list(range(N))
        it = pool.map(slow_below, range(N, 0, -1), [40] * N, [0.25] * N, timeout=2.0)
        with pytest.raises(TimeoutError):
            for value in it:
                got.append(value)
        assert got == list(range(N, N - len(got), -1))
        assert len(got) < N - 39
        pool.terminate()


def test_closing_a_chunked_map_early_leaves_the_pool_working(engine, chunks_for_sure):
    with Pool(2, start_method="fork") as pool:
        it = pool.map(identity, range(N))
        assert [next(it) for _ in range(10)] == list(range(10))
        it.close()
        assert list(pool.map(identity, range(N))) == list(range(N))


def test_a_pool_still_starting_is_waited_for_then_chunked(engine, chunks_for_sure):
    with Pool(2, start_method="fork") as pool:
        out: list[int] = []
        tasks = _tasks_for(pool, lambda: out.extend(pool.map(identity, range(N))))
        assert out == list(range(N))
        assert tasks == pool_module._AUTO_PROBE * 2 + 8


def test_the_timed_first_items_fail_and_crash_as_themselves(engine, chunks_for_sure):
    with Pool(2, start_method="fork", max_restarts=None) as pool:
        got = []
        with pytest.raises(ValueError, match="item 3 is bad"):
            for value in pool.map(fail_at, range(N), [3] * N):
                got.append(value)
        assert got == [1, 2, 3]
        with pytest.raises(WorkerCrashed) as info:
            list(pool.map(kill_self_if, range(N), [{5}] * N))
        assert info.value.task_name.endswith("kill_self_if")  # not the timing wrapper's name
        assert len(pool.crashes) == 1  # an item of the probe: sent alone, it failed alone
