"""framepipe.workers.DataLoader with real worker processes, on both engines where the engine
matters (the ``engine`` fixture puts the ``impl`` core under ``framepipe.connection``).

Every test leaves no worker behind: the ``no_leftover_loader_workers`` fixture (conftest) kills
and fails on any DataLoader worker still running at the end. Loaders get a ``timeout`` as a hang guard, so a broken test
fails with TaskTimeout instead of blocking the suite.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import multiprocessing
import os
import pickle
import random
import signal
import stat
import threading
import time
import types

import pytest
from _helpers import Background, gone

from framepipe.workers import (
    DataLoader,
    TaskTimeout,
    WorkerCrashed,
    WorkerError,
    WorkerStartError,
    _pin,
    _shm,
    get_worker_info,
)
from framepipe.workers import loader as loader_module
from framepipe.workers.loader import credits as loader_credits
from framepipe.workers.loader import manager as loader_manager
from framepipe.workers.loader import wire as loader_wire
from framepipe.workers.loader import worker as loader_worker

np = pytest.importorskip("numpy")

GUARD = 30.0  # seconds: a batch that takes this long means a hang (TaskTimeout fails the test)
MiB = 1024 * 1024


pytestmark = pytest.mark.usefixtures("no_leftover_loader_workers")


# -- datasets (module level: spawned workers import them) --------------------------------------


class Uneven:
    """Item i is i; every 7th item spins for a while, so workers finish out of order."""

    def __init__(self, n: int, spin: float = 0.0005) -> None:
        self.n = n
        self.spin = spin

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i % 7 == 0:
            end = time.perf_counter() + self.spin * (1 + i % 3)
            while time.perf_counter() < end:
                pass
        return i


class Whose:
    """Item i is (i, the pid of the worker that loaded it)."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, os.getpid()


class Killer:
    """Item 50 kills its worker with SIGKILL, after a line on stderr."""

    def __len__(self) -> int:
        return 200

    def __getitem__(self, i: int) -> int:
        if i == 50:
            os.write(2, b"loading item 50, then dying\n")
            os.kill(os.getpid(), signal.SIGKILL)
        return i


class BadRecord(Exception):
    """An exception whose constructor takes two arguments (so a plain pickle fails)."""

    def __init__(self, path: str, line: int) -> None:
        super().__init__(f"{path}:{line}: bad record")
        self.path = path
        self.line = line


class Raising:
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        if i == 7:
            raise BadRecord("data.csv", 7)
        return i


def hang_here(seconds: float) -> None:
    time.sleep(seconds)


class Hanging:
    def __len__(self) -> int:
        return 10

    def __getitem__(self, i: int) -> int:
        if i == 3:
            hang_here(120)
        return i


class Shards:
    """An iterable dataset that shards itself by worker, as under torch."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield {"index": i, "worker": -1 if info is None else info.id}


class Big:
    """Items of ``size`` bytes (float32, filled with the index)."""

    def __init__(self, n: int, size: int) -> None:
        self.n = n
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full(self.size // 4, i, dtype=np.float32)


class Randoms:
    """Item i: draws from random and NumPy's global generator in the worker, with its id."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return random.random(), float(np.random.random()), get_worker_info().id


def failing_init(worker_id: int) -> None:
    raise RuntimeError(f"no config for worker {worker_id}")


class UnevenArrays(Uneven):
    """Item i is a 4 KiB float32 array filled with i; every 7th item spins a while."""

    def __getitem__(self, i: int):
        return np.full(1024, super().__getitem__(i), dtype=np.float32)


#: Bytes of an item too large to travel inline (see wire.INLINE_MAX): its worker keeps to
#: prefetch_factor, however fast it loads.
LARGE = 128 * 1024


class Counted:
    """Item i is an array of ``size`` bytes holding i (small by default); ``started`` (shared
    memory) counts the items the workers began to load."""

    def __init__(self, n: int, started, spin: float = 0.0, size: int = 128) -> None:
        self.n = n
        self.started = started
        self.spin = spin
        self.size = size

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        with self.started.get_lock():
            self.started.value += 1
        end = time.perf_counter() + self.spin
        while time.perf_counter() < end:
            pass
        return np.full(self.size // 8, i, dtype=np.int64)


class KillAt:
    """Item ``at`` kills its worker with SIGKILL, after a line on stderr."""

    def __init__(self, n: int, at: int) -> None:
        self.n = n
        self.at = at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.at:
            os.write(2, f"loading item {i}, then dying\n".encode())
            os.kill(os.getpid(), signal.SIGKILL)
        return i


class Chatty:
    """Item 2 writes 300 KiB to stderr (more than a pipe holds) before it returns."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        if i == 2:
            os.write(2, b"x" * (300 * 1024) + b"\nchatty item 2 done\n")
        return i


class UnevenShards:
    """An iterable dataset: worker 0 has 3 items, the others 20 each."""

    def __iter__(self):
        info = get_worker_info()
        for j in range(3 if info.id == 0 else 20):
            yield info.id, j


# -- order, exactly once ---------------------------------------------------------------------


def test_order_kept_over_10000_items_with_uneven_costs(engine):
    with DataLoader(Uneven(10_000), batch_size=None, num_workers=2, timeout=GUARD) as loader:
        assert list(loader) == list(range(10_000))


def test_unordered_delivers_every_index_exactly_once(engine):
    with DataLoader(
        Uneven(3000, spin=0.002), batch_size=None, num_workers=2, in_order=False, timeout=GUARD
    ) as loader:
        got = list(loader)
    assert sorted(got) == list(range(3000))
    assert got != list(range(3000)), "slow items should have been overtaken"


@pytest.mark.parametrize("workers, prefetch", [(3, 1), (2, 3), (1, 2)])
def test_order_kept_for_any_number_of_workers_and_prefetch(engine, workers, prefetch):
    with DataLoader(
        UnevenArrays(3000),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=prefetch,
        timeout=GUARD,
    ) as loader:
        assert [int(a[0]) for a in loader] == list(range(3000))


class Phases:
    """Items 0-299 load at once, 300-599 take 0.2 ms each, 600-899 load at once again."""

    def __len__(self) -> int:
        return 900

    def __getitem__(self, i: int):
        if 300 <= i < 600:
            end = time.perf_counter() + 2e-4
            while time.perf_counter() < end:
                pass
        return np.full(8, i, dtype=np.int32)


def test_order_kept_while_batches_turn_slow_and_fast_again(engine, monkeypatch):
    """Small batches that load fast run deeper than prefetch_factor, their credits going back
    in groups of half that depth; slow ones keep to prefetch_factor, one credit at a time."""
    # the slow items take 200 us: fast below 50 us, slow above 100 us leaves a busy machine
    # room (forked workers inherit the setting)
    monkeypatch.setattr(loader_worker, "SLOW_BATCH", 1e-4)
    monkeypatch.setattr(loader_worker, "FAST_BATCH", 5e-5)
    with DataLoader(Phases(), batch_size=None, num_workers=2, timeout=GUARD) as loader:
        it = iter(loader)
        got, paces = [], []
        for item in it:
            got.append(int(item[0]))
            paces.append((it.workers.slots[0].depth, it.workers.slots[0].group))
    deep = it.workers.deep
    assert got == list(range(900))
    assert deep == loader_wire.DEEP_AHEAD > loader.prefetch_factor == 2
    # Ranges, not single items: a fast batch the scheduler interrupts may count as slow for a
    # few batches on a busy machine.
    assert (deep, deep // 2) in paces[200:300]  # fast
    assert (2, 1) in paces[300:600]  # slow: the worker said so
    assert (deep, deep // 2) in paces[600:]  # fast again (by the end: it must first say so)


class WhichWorker:
    """Item i is (i, the id of the worker that loaded it)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[int, int]:
        return i, get_worker_info().id


def test_the_next_block_loads_while_the_parent_takes_this_one(engine):
    """In order, whenever the caller takes a batch of one worker's block, the other worker
    holds credit for its own next block (it loads it meanwhile): the parent and the workers
    never take turns, each waiting for the other's wake-up."""
    n = 400
    idle = []
    with DataLoader(WhichWorker(n), batch_size=None, num_workers=2, timeout=GUARD) as loader:
        it = iter(loader)
        for k, (i, wid) in enumerate(it):
            assert i == k
            other = it.workers.slots[1 - wid]
            if k < n - loader.window and other.credit <= 0:
                idle.append(k)
    assert idle == []


@pytest.mark.parametrize(
    "workers, prefetch, batch_size", [(3, 2, None), (3, 3, 1200), (2, 2, None), (4, 1, None)]
)
def test_batch_k_is_always_loaded_by_the_same_worker(workers, prefetch, batch_size):
    """Worker k % num_workers, torch's round robin, whatever prefetch_factor; also when batches
    are large enough to cut the chunks short."""
    with DataLoader(
        WhichWorker(90_000 if batch_size else 300),
        batch_size=batch_size,
        num_workers=workers,
        prefetch_factor=prefetch,
        timeout=GUARD,
    ) as loader:
        owners = [int(b[1][0]) if batch_size else int(b[1]) for b in loader]
    assert owners == [k % workers for k in range(len(owners))]


def test_unordered_batches_deliver_every_index_exactly_once(engine):
    with DataLoader(
        UnevenArrays(2000, spin=0.002), num_workers=2, batch_size=7, in_order=False, timeout=GUARD
    ) as loader:
        got = [int(v) for batch in loader for v in batch[:, 0]]
    assert sorted(got) == list(range(2000))
    assert got != list(range(2000)), "slow items should have been overtaken"


def test_batches_collate_and_len():
    data = {"x": np.arange(3.0), "y": 1}
    with DataLoader([data] * 10, num_workers=2, batch_size=4, timeout=GUARD) as loader:
        assert len(loader) == 3
        batches = list(loader)
    assert [b["x"].shape for b in batches] == [(4, 3), (4, 3), (2, 3)]
    assert batches[0]["y"].tolist() == [1, 1, 1, 1]
    with DataLoader(
        list(range(10)), num_workers=2, batch_size=4, drop_last=True, timeout=GUARD
    ) as loader:
        assert len(loader) == 2
        assert [b.tolist() for b in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_default_collate_shapes_without_torch():
    """Without torch (its import blocked in a fresh interpreter), batches are NumPy's."""
    import subprocess
    import sys

    code = (
        "import sys, collections\n"
        "sys.modules['torch'] = None  # as if it were not installed\n"
        "import numpy as np\n"
        "from framepipe.workers import DataLoader, default_collate, default_convert\n"
        "Point = collections.namedtuple('Point', 'x y')\n"
        "pair = default_collate([(1, 'a'), (2, 'b')])\n"
        "assert type(pair) is tuple and type(pair[0]) is np.ndarray, pair\n"
        "assert pair[0].tolist() == [1, 2] and pair[1] == ['a', 'b']\n"
        "pts = default_collate([Point(1, 2.0), Point(3, 4.0)])\n"
        "assert isinstance(pts, Point) and pts.x.tolist() == [1, 3]\n"
        "nested = default_collate([{'a': [np.zeros(2), 1]}, {'a': [np.ones(2), 2]}])\n"
        "assert nested['a'][0].shape == (2, 2) and nested['a'][1].tolist() == [1, 2]\n"
        "try:\n"
        "    default_collate([[1, 2], [1]])\n"
        "except RuntimeError as e:\n"
        "    assert 'equal size' in str(e)\n"
        "else:\n"
        "    raise AssertionError('no error')\n"
        "a = np.arange(3)\n"
        "assert default_convert(a) is a\n"
        "with DataLoader([a, a], batch_size=None, num_workers=2) as loader:\n"
        "    print(sorted({type(b).__name__ for b in loader}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['ndarray']"


def test_in_process_loading_with_zero_workers():
    loader = DataLoader(list(range(10)), batch_size=3, num_workers=0, shuffle=True, seed=5)
    batches = list(loader)
    assert sorted(itertools.chain.from_iterable(b.tolist() for b in batches)) == list(range(10))
    assert get_worker_info() is None


def test_samplers_are_any_iterable_of_indices():
    with DataLoader(
        Whose(), batch_size=None, num_workers=2, sampler=[5, 3, 9], timeout=GUARD
    ) as loader:
        assert [i for i, _ in loader] == [5, 3, 9]
    with DataLoader(Whose(), num_workers=2, batch_sampler=[[1, 2], [60]], timeout=GUARD) as loader:
        assert [b[0].tolist() for b in loader] == [[1, 2], [60]]


def test_shuffle_with_a_seed_reproduces_the_epochs():
    def epochs(seed):
        with DataLoader(
            list(range(50)),
            batch_size=None,
            num_workers=2,
            shuffle=True,
            seed=seed,
            timeout=GUARD,
            persistent_workers=True,
        ) as loader:
            return [list(loader) for _ in range(2)]

    a, b = epochs(11), epochs(11)
    assert a == b
    assert a[0] != a[1] and sorted(a[0]) == list(range(50))


def test_workers_get_distinct_seeds_and_a_seed_reproduces_them():
    def draws(seed):
        with DataLoader(
            Randoms(), batch_size=None, num_workers=2, seed=seed, timeout=GUARD
        ) as loader:
            return list(loader)

    first, again = draws(3), draws(3)
    assert first == again
    by_worker = collections.defaultdict(list)
    for r, n, wid in first:
        by_worker[wid].append((r, n))
    assert len(by_worker) == 2
    assert by_worker[0][0] != by_worker[1][0]  # not the same stream in both workers
    assert draws(4) != first


def test_spawned_workers():
    with DataLoader(
        Shards(40), num_workers=2, batch_size=None, start_method="spawn", timeout=GUARD
    ) as loader:
        got = list(loader)
    assert sorted(d["index"] for d in got) == list(range(40))
    assert {d["worker"] for d in got} == {0, 1}


# -- failures that explain ---------------------------------------------------------------------


def test_worker_sigkilled_mid_epoch(engine):
    loader = DataLoader(Killer(), num_workers=2, batch_size=5, timeout=GUARD)
    got = []
    with pytest.raises(WorkerCrashed) as info:
        for batch in loader:
            got.extend(batch.tolist())
    err = info.value
    text = str(err)
    assert err.signal_name == "SIGKILL" and err.exitcode == -signal.SIGKILL
    assert err.pid in (os.getpid(), err.pid) and err.pid != os.getpid()
    assert f"DataLoader worker {err.worker_id}" in text and f"pid {err.pid}" in text
    assert f"'DataLoader-worker-{err.worker_id}'" in text
    assert any(50 in indices for indices in err.batches.values())
    assert "50" in text and "SIGKILL" in text
    assert "loading item 50, then dying" in err.stderr_tail
    assert err.oom_killed in (None, False)
    assert "peak RSS" in text  # sampled while it ran, for the OOM hint
    assert got == list(range(len(got))) and len(got) <= 50
    assert gone(err.pid)
    loader.close()


def test_exception_with_two_argument_constructor(engine):
    with DataLoader(Raising(), batch_size=None, num_workers=2, timeout=GUARD) as loader:
        it = iter(loader)
        assert [next(it) for _ in range(7)] == list(range(7))
        with pytest.raises(BadRecord) as info:
            next(it)
        err = info.value
        assert (err.path, err.line) == ("data.csv", 7)
        assert any("index 7" in note for note in err.__notes__)
        assert any("DataLoader worker" in note for note in err.__notes__)
        cause = err.__cause__
        while cause is not None and "__getitem__" not in str(cause):
            cause = cause.__cause__
        assert cause is not None, "the worker's traceback is missing"
        assert "raise BadRecord" in str(cause)
        assert list(it) == list(range(8, 20))  # the loader goes on after the error


def refuse_to_collate(items):
    raise ValueError(f"cannot collate {len(items)} items")


def test_an_exception_in_a_batch_names_the_index_or_the_collate(engine):
    with DataLoader(Raising(), num_workers=2, batch_size=4, timeout=GUARD) as loader:
        it = iter(loader)
        assert next(it).tolist() == [0, 1, 2, 3]
        with pytest.raises(BadRecord) as info:
            next(it)
        assert any("while loading index 7" in note for note in info.value.__notes__)
        assert next(it).tolist() == [8, 9, 10, 11]
    with DataLoader(
        list(range(8)), num_workers=2, batch_size=4, collate_fn=refuse_to_collate, timeout=GUARD
    ) as loader:
        with pytest.raises(ValueError, match="cannot collate 4 items") as info:
            list(loader)
    assert any(
        "while loading collate_fn of indices [0, 1, 2, 3]" in note for note in info.value.__notes__
    )


def test_hung_getitem_raises_task_timeout_with_the_stack(engine):
    loader = DataLoader(Hanging(), batch_size=None, num_workers=2, timeout=1.0)
    pids = []
    start = time.monotonic()
    with pytest.raises(TaskTimeout) as info:
        for _ in loader:
            pids = pids or loader.worker_pids()
    elapsed = time.monotonic() - start
    err = info.value
    assert 0.9 < elapsed < 10
    assert err.stack and "hang_here" in err.stack
    assert "batch 3 (indices 3)" in str(err)
    assert all(gone(pid) for pid in pids)


class HangingArrays(Hanging):
    """Small arrays, whose replies a worker holds to write a group of them in one frame."""

    def __getitem__(self, i: int) -> object:
        return np.full(4, super().__getitem__(i), dtype=np.float32)


def test_a_batch_that_hangs_holds_back_none_loaded_before_it(engine):
    # Worker 1 is given batches 1 and 3 as one group; batch 3 hangs. Batch 1's reply, held to
    # go out with batch 3's, is written once the load of 3 has run a few ms (NOTE [ A group
    # that waits for a slow batch ]): the caller gets 0, 1 and 2, and the timeout names batch 3.
    # Held until the group's end, batch 1 would time out instead, with batch 3's stack.
    loader = DataLoader(HangingArrays(), batch_size=1, num_workers=2, timeout=GUARD / 3)
    got = []
    with pytest.raises(TaskTimeout) as info:
        for batch in loader:
            got.append(int(batch[0][0]))
    assert got == [0, 1, 2]
    err = info.value
    assert "did not finish batch 3 (indices [3])" in str(err), str(err)
    # the stack is the loading thread's, not the thread that writes held replies
    current = str(err).split("Current thread", 1)[1].splitlines()
    assert "in hang_here" in current[1], str(err)
    loader.close()


def test_a_crash_mid_chunk_names_the_batch_it_was_loading_and_what_was_queued(engine):
    loader = DataLoader(KillAt(1000, 37), batch_size=None, num_workers=2, timeout=GUARD)
    got = []
    with pytest.raises(WorkerCrashed) as info:
        for i in loader:
            got.append(i)
    err = info.value
    text = str(err)
    assert got == list(range(37))  # everything before the crash, in order
    assert err.signal_name == "SIGKILL"
    assert list(err.batches.values())[0] == 37  # the batch it was loading comes first
    assert "while running batch 37 (indices 37)" in text
    assert f"DataLoader worker {err.worker_id}" in text and f"pid {err.pid}" in text
    assert err.queued, "the worker was given batches ahead of its credit"
    assert all(i > 37 for i in err.queued.values())
    assert f"{len(err.queued)} more batches were queued for it" in text
    assert not set(err.queued) & set(err.batches)
    assert "loading item 37, then dying" in err.stderr_tail
    assert gone(err.pid)
    loader.close()


def test_a_worker_flooding_its_stderr_is_not_stuck(engine, capfd):
    # a worker whose stderr nobody read would block in its write: the batch's timeout (a
    # LoaderTimeout) would fail the test
    with DataLoader(Chatty(), batch_size=None, num_workers=2, timeout=GUARD) as loader:
        assert list(loader) == list(range(6))
    assert "chatty item 2 done" in capfd.readouterr().err


class Unpicklable:
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        array = np.full(_shm.SHM_MIN, i, dtype=np.uint8)  # takes a memfd first
        return (array, (lambda: i)) if i == 2 else (array, None)


def test_a_batch_that_cannot_be_sent_is_reported_and_the_loader_goes_on(small_shm):
    with DataLoader(Unpicklable(), batch_size=None, num_workers=2, timeout=GUARD) as loader:
        it = iter(loader)
        assert [int(next(it)[0][0]) for _ in range(2)] == [0, 1]
        with pytest.raises(WorkerError, match="indices 2 could not be sent"):
            next(it)
        assert [int(a[0]) for a, _ in it] == [3, 4, 5]


def test_unordered_timeout_names_the_stuck_worker():
    loader = DataLoader(Hanging(), batch_size=None, num_workers=2, timeout=1.0, in_order=False)
    with pytest.raises(TaskTimeout) as info:
        list(loader)
    assert "hang_here" in (info.value.stack or "")
    assert "(indices 3)" in str(info.value)
    loader.close()


def test_worker_init_fn_failure_is_reported():
    with DataLoader(
        list(range(4)), batch_size=None, num_workers=2, worker_init_fn=failing_init, timeout=GUARD
    ) as loader:
        with pytest.raises(WorkerStartError, match="no config for worker"):
            list(loader)


# -- iterable datasets, persistent workers -----------------------------------------------------


def test_iterable_dataset_shards_itself(engine):
    with DataLoader(Shards(1000), num_workers=2, batch_size=10, timeout=GUARD) as loader:
        batches = list(loader)
    indices = [int(i) for b in batches for i in b["index"]]
    assert sorted(indices) == list(range(1000))
    assert {int(w) for b in batches for w in b["worker"]} == {0, 1}
    assert get_worker_info() is None


def test_iterable_shards_of_different_lengths_come_in_turn(engine):
    with DataLoader(UnevenShards(), batch_size=None, num_workers=2, timeout=GUARD) as loader:
        got = [tuple(item) for item in loader]
    assert got == [(0, 0), (1, 0), (0, 1), (1, 1), (0, 2), (1, 2)] + [(1, j) for j in range(3, 20)]


def test_unordered_iterable_shards_of_different_lengths(engine):
    with DataLoader(
        UnevenShards(), num_workers=2, in_order=False, batch_size=2, timeout=GUARD
    ) as loader:
        got = [tuple(int(v) for v in pair) for batch in loader for pair in zip(*batch)]
    assert sorted(got) == sorted([(0, j) for j in range(3)] + [(1, j) for j in range(20)])


def test_persistent_workers_across_three_epochs():
    loader = DataLoader(
        Whose(), batch_size=None, num_workers=2, persistent_workers=True, timeout=GUARD
    )
    try:
        seen_pids = set()
        for _ in range(3):
            epoch = list(loader)
            assert [i for i, _ in epoch] == list(range(64))
            seen_pids |= {pid for _, pid in epoch}
        assert seen_pids == set(loader.worker_pids()) and len(seen_pids) == 2
        # an epoch abandoned halfway: the next one starts clean on the same workers
        it = iter(loader)
        next(it), next(it)
        assert [i for i, _ in loader] == list(range(64))
        assert set(loader.worker_pids()) == seen_pids
    finally:
        pids = loader.worker_pids()
        loader.close()
    assert all(gone(pid) for pid in pids)


# -- memory and clean-up -----------------------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_parent_rss_stays_within_the_prefetch_bound():
    size, n = 16 * MiB, 128  # 2 GiB flow through
    loader = DataLoader(Big(n, size), batch_size=None, num_workers=2, timeout=GUARD)
    base = _rss()
    peak = base
    most_in_flight = 0
    with loader:
        it = iter(loader)
        for k, item in enumerate(it):
            assert item.min() == k == item.max()  # touches every page
            peak = max(peak, _rss())
            most_in_flight = max(most_in_flight, it.workers.in_flight())
            del item
    assert most_in_flight <= loader.window == 4
    # the window, the item held by the loop and one being read, plus slack for the allocator
    bound = (loader.window + 2) * size + 64 * MiB
    assert peak - base <= bound, f"RSS rose by {(peak - base) / MiB:.0f} MiB"


def test_early_break_leaves_no_process_behind(engine):
    loader = DataLoader(Big(1000, MiB), batch_size=None, num_workers=2, timeout=GUARD)
    for k, _ in enumerate(loader):
        if k == 0:
            pids = loader.worker_pids()
        if k == 5:
            break
    assert len(pids) == 2
    start = time.monotonic()
    assert all(gone(pid) for pid in pids)
    assert time.monotonic() - start < 4.5  # stopped, not left to load the rest of the epoch


def _take_and_measure(epoch, started, taken: int, floor: int) -> tuple[list[int], int, int]:
    """One epoch (a loader or its iterator) of ``Counted`` items: what came, the running count of items taken
    (from ``taken``) and the most items the workers had loaded ahead of the caller. Every 40
    items the caller pauses until the workers are ``floor`` items ahead or have stopped loading
    for a while (their credits spent), however slowly a busy machine runs them."""
    seen, most = [], 0
    for k, item in enumerate(epoch):
        taken += 1
        if k % 40 == 0:
            _let_them_load(started, taken, floor)
        most = max(most, started.value - taken)
        seen.append(int(item[0]))
    return seen, taken, most


def _let_them_load(started, taken: int, floor: int, quiet: float = 0.1) -> None:
    end = time.monotonic() + 10.0
    last, since = started.value, time.monotonic()
    while time.monotonic() < end and started.value - taken < floor:
        now = started.value
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.002)


@pytest.mark.parametrize(
    "workers, prefetch, in_order, spin, size",
    [
        (2, 2, True, 0.0, LARGE),
        (3, 1, True, 0.0, LARGE),
        (1, 4, True, 0.0, LARGE),
        (2, 3, False, 0.0, LARGE),
        (2, 2, True, 1e-4, 128),
        (2, 4, False, 1e-4, 128),
    ],
)
def test_items_loaded_and_not_taken_never_exceed_the_window(
    engine, workers, prefetch, in_order, spin, size
):
    """Fast items (credits go back in groups) and slow ones (one at a time) alike: large
    items, or small ones that load slowly, keep to prefetch_factor exactly."""
    started = multiprocessing.Value("q", 0)
    loader = DataLoader(
        Counted(800, started, spin, size),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=prefetch,
        in_order=in_order,
        timeout=GUARD,
    )
    with loader:
        seen, taken, most = _take_and_measure(loader, started, 0, loader.window - workers)
    assert started.value == taken
    assert most <= loader.window
    assert most >= loader.window - workers  # the pauses let them fill the window (or nearly)
    assert sorted(seen) == list(range(800))
    assert seen == list(range(800)) or not in_order


@pytest.mark.parametrize(
    "workers, prefetch, in_order, persistent",
    [(2, 2, True, False), (3, 1, True, True), (2, 3, False, False), (1, 12, True, True)],
)
def test_small_fast_items_run_deeper_within_their_bound(
    engine, monkeypatch, workers, prefetch, in_order, persistent
):
    """Small items that load fast: each worker loads up to max(prefetch_factor, DEEP_AHEAD)
    ahead, never more, also in a second epoch of persistent workers."""
    # every batch counts as fast (a busy machine may make a few slow; forked workers inherit
    # the setting)
    monkeypatch.setattr(loader_worker, "SLOW_BATCH", 60.0)
    monkeypatch.setattr(loader_worker, "FAST_BATCH", 30.0)
    started = multiprocessing.Value("q", 0)
    loader = DataLoader(
        Counted(800, started),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=prefetch,
        in_order=in_order,
        persistent_workers=persistent,
        timeout=GUARD,
    )
    bound = workers * max(prefetch, loader_wire.DEEP_AHEAD)
    taken = most = 0
    with loader:
        for _ in range(2 if persistent else 1):
            seen, taken, deepest = _take_and_measure(loader, started, taken, bound - workers)
            most = max(most, deepest)
            assert sorted(seen) == list(range(800))
            assert seen == list(range(800)) or not in_order
    assert started.value == taken
    assert bound - workers <= most <= bound


@pytest.fixture(params=["eventfd", "pipe"])
def credits(request, monkeypatch):
    """Credits on an eventfd, or on the pipe used where there is none (forked workers inherit
    the choice)."""
    if request.param == "pipe":
        monkeypatch.setattr(loader_credits, "HAVE_EVENTFD", False)
    elif not loader_credits.HAVE_EVENTFD:
        pytest.skip("no eventfd here")
    return request.param


def test_credits_keep_the_window_across_epochs_on_either_counter(credits):
    started = multiprocessing.Value("q", 0)
    loader = DataLoader(
        Counted(600, started, size=LARGE),
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        timeout=GUARD,
    )
    taken = most = 0
    try:
        for _ in range(2):  # the second epoch starts with a reset of the workers
            it = iter(loader)
            fifo = stat.S_ISFIFO(os.fstat(it.workers.slots[0].credits).st_mode)
            assert fifo == (credits == "pipe")
            seen, taken, deepest = _take_and_measure(it, started, taken, loader.window - 2)
            assert seen == list(range(600))
            most = max(most, deepest)
    finally:
        loader.close()
    assert taken == started.value == 1200
    assert loader.window - 2 <= most <= loader.window


def test_an_abandoned_epoch_on_persistent_workers_loads_nothing_more(engine):
    started = multiprocessing.Value("q", 0)
    loader = DataLoader(
        Counted(1000, started, size=LARGE),
        batch_size=None,
        num_workers=2,
        persistent_workers=True,
        timeout=GUARD,
    )
    try:
        it = iter(loader)
        first = [int(next(it)[0]) for _ in range(9)]
        time.sleep(0.2)  # the workers fill the window
        loaded = started.value
        assert loaded - 9 <= loader.window
        again, most = [], 0
        for k, item in enumerate(loader):  # a new epoch: what the old one loaded is dropped
            again.append(int(item[0]))
            if k % 50 == 0:
                time.sleep(0.02)
            most = max(most, started.value - loaded - len(again))
        assert first == list(range(9)) and again == list(range(1000))
        assert started.value == loaded + 1000  # nothing more of the old epoch was loaded
        assert most <= loader.window  # and no credit of the old one leaked into the new one
    finally:
        loader.close()


@pytest.mark.parametrize("in_order", [True, False])
def test_early_break_with_batches_queued_stops_the_workers(engine, in_order):
    loader = DataLoader(
        UnevenArrays(100_000), batch_size=None, num_workers=2, in_order=in_order, timeout=GUARD
    )
    for k, _ in enumerate(loader):
        if k == 0:
            pids = loader.worker_pids()
        if k == 300:
            break
    assert len(pids) == 2
    start = time.monotonic()
    assert all(gone(pid) for pid in pids)
    assert time.monotonic() - start < 4.5  # stopped, not left to load the rest of the epoch


def test_a_message_larger_than_any_buffer_never_blocks_the_parent(engine):
    """A worker may be blocked writing to the parent while the parent writes to it: a message
    to a worker that cannot fit its pipe goes through a sender thread."""
    from framepipe import connection

    parent, child = connection.Pipe(True, read_ahead=True, pipes=True)
    slot = types.SimpleNamespace(outbox=None, lock=threading.Lock(), sender=None, conn=parent, id=0)
    big = b"\x80" + bytes(16 << 20)  # more than the pipe and the bulk socket hold
    posting = Background(lambda: [loader_manager._post(slot, m) for m in (big, b"3", b"5")])
    posting.thread.join(5.0)
    assert not posting.thread.is_alive(), "the parent waited for a reader"
    assert child.recv_bytes(timeout=GUARD) == big  # in order, whole
    assert child.recv_bytes(timeout=GUARD) == b"3"
    assert child.recv_bytes(timeout=GUARD) == b"5"
    deadline = time.monotonic() + GUARD
    while slot.outbox is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert slot.outbox is None  # the sender thread is done; small messages go straight out
    loader_manager._post(slot, b"7")
    assert slot.outbox is None and child.recv_bytes(timeout=GUARD) == b"7"
    parent.close()
    child.close()


class Sleepy:
    """Items from 2 on take 5 s each."""

    def __len__(self) -> int:
        return 100

    def __getitem__(self, i: int) -> int:
        if i >= 2:
            time.sleep(5)
        return i


def test_close_while_a_message_is_still_going_out_to_a_busy_worker(engine):
    loader = DataLoader(Sleepy(), batch_size=None, num_workers=2, timeout=GUARD)
    it = iter(loader)
    assert [next(it), next(it)] == [0, 1]  # one from each worker
    pids = loader.worker_pids()
    time.sleep(0.2)  # worker 0 now loads item 2 for 5 s, and reads nothing meanwhile
    loader_manager._post(it.workers.slots[0], b"9" * (16 << 20))
    assert it.workers.slots[0].outbox is not None
    start = time.monotonic()
    loader.close()
    assert time.monotonic() - start < 4.5  # stopped, not waited for (an item takes 5 s)
    assert all(gone(pid) for pid in pids)


class Scalars:
    def __len__(self) -> int:
        return 10**7

    def __getitem__(self, i: int) -> int:
        return i


def test_batches_of_many_indices(engine):
    n = 20_000  # a batch's indices alone exceed the size of one message to a worker
    batches = [list(range(k * n, (k + 1) * n)) for k in range(12)]
    with DataLoader(Scalars(), num_workers=2, batch_sampler=batches, timeout=GUARD) as loader:
        got = [(int(b[0]), len(b), int(b[-1])) for b in loader]
    assert got == [(k * n, n, (k + 1) * n - 1) for k in range(12)]


def test_deleting_the_loader_stops_persistent_workers():
    loader = DataLoader(
        Big(100, 4096), batch_size=None, num_workers=2, persistent_workers=True, timeout=GUARD
    )
    it = iter(loader)
    next(it)
    pids = loader.worker_pids()
    del it, loader
    assert all(gone(pid) for pid in pids)


# -- small arrays: a pickle built directly ------------------------------------------------------


def _arrays():
    return [
        np.arange(1024, dtype=np.float32),
        np.arange(60, dtype=">i2").reshape(3, 4, 5),
        np.array([True, False, True]),
        np.arange(6, dtype=np.complex128).reshape(2, 3) * 1j,
        np.array(["2026-01-01", "2026-11-24"], dtype="datetime64[s]"),
        np.array(["ab", "cde"]),
        np.array([b"x", b"yz"]),
        np.zeros((0, 3), dtype=np.float64),
        np.array(7.5),
        np.arange(loader_wire.INLINE_MAX // 8 - 1, dtype=np.float64),
    ]


@pytest.mark.parametrize("array", _arrays(), ids=lambda a: f"{a.dtype.str}{list(a.shape)}")
def test_small_arrays_travel_as_a_pickle_built_directly(array):
    blob = loader_wire._inline_array(7, array)
    assert blob is not None
    kind, bid, back = pickle.loads(blob)
    assert (kind, bid) == (loader_wire.OK, 7)
    assert back.dtype == array.dtype and back.shape == array.shape
    assert np.array_equal(back, array)
    assert back.flags.writeable and back.flags.c_contiguous and back.flags.aligned


def test_arrays_the_direct_pickle_leaves_to_pickle():
    big = np.zeros(loader_wire.INLINE_MAX // 8, dtype=np.float64)
    others = [
        big,  # from INLINE_MAX on: out of band
        np.arange(20.0).reshape(4, 5)[:, 1],  # not contiguous
        np.array([{"a": 1}, None], dtype=object),
        np.zeros(3, dtype=[("x", "<f4"), ("y", "<i2")]),  # structured: the fields would be lost
        np.ma.masked_array([1, 2, 3], mask=[0, 1, 0]),  # a subclass
    ]
    assert [loader_wire._inline_array(1, a) for a in others] == [None] * len(others)
    assert loader_wire._inline_array(1, [1, 2]) is None


class AllKinds:
    def __len__(self) -> int:
        return 2 * len(_arrays())

    def __getitem__(self, i: int):
        arrays = _arrays()
        return arrays[i % len(arrays)]


def keep(item):
    """A collate_fn that keeps the item as it is (NumPy's arrays, not torch's tensors)."""
    return item


def test_arrays_of_every_kind_arrive_intact_and_writable(engine):
    with DataLoader(
        AllKinds(), batch_size=None, num_workers=2, collate_fn=keep, timeout=GUARD
    ) as loader:
        got = list(loader)
    want = _arrays() * 2
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b)
        assert a.flags.writeable
    got[0][0] = -1.0  # the caller's own memory


# -- the shared-memory pool -------------------------------------------------------------------


@pytest.fixture
def small_shm(monkeypatch):
    """Arrays of 64 KiB and more in shared memory (forked workers inherit the setting)."""
    monkeypatch.setattr(_shm, "SHM_MIN", 64 * 1024)
    return 128 * 1024


def test_arrays_held_by_the_caller_are_never_overwritten(engine, small_shm):
    """Past the pool's size, arrays take the bulk channel; no memfd is reused while any view
    of its array is alive."""
    size = small_shm
    with DataLoader(Big(300, size), batch_size=None, num_workers=2, timeout=GUARD) as loader:
        kept = []
        views = []
        for k, item in enumerate(loader):
            if k % 2:
                kept.append(item)
            else:
                views.append(item[5:9])  # a view keeps the memory; the array itself is gone
            del item
    assert [int(a[0]) for a in kept] == list(range(1, 300, 2))
    assert all(a.min() == a.max() for a in kept)
    assert [v.tolist() for v in views] == [[float(k)] * 4 for k in range(0, 300, 2)]


def test_memfds_are_reused_once_the_arrays_are_freed(small_shm):
    size = small_shm
    with DataLoader(Big(400, size), batch_size=None, num_workers=2, timeout=GUARD) as loader:
        it = iter(loader)
        memfds = [0, 0]
        for k, item in enumerate(it):
            assert item[0] == k
            del item
            memfds = [max(m, len(s.memfds)) for m, s in zip(memfds, it.workers.slots)]
    # in flight, in use and being freed: a few per worker, not one per item
    assert all(0 < n <= loader.prefetch_factor + 3 for n in memfds), memfds


# -- torch, when installed ---------------------------------------------------------------------


class Tensors:
    def __len__(self) -> int:
        return 12

    def __getitem__(self, i: int):
        import torch

        return torch.full((3,), float(i))


def test_torch_tensors_and_samplers():
    torch = pytest.importorskip("torch")
    from torch.utils.data.distributed import DistributedSampler

    ds = Tensors()
    sampler = DistributedSampler(ds, num_replicas=2, rank=1, shuffle=False)
    with DataLoader(ds, num_workers=2, batch_size=2, sampler=sampler, timeout=GUARD) as loader:
        batches = list(loader)
    assert all(isinstance(b, torch.Tensor) and b.shape == (2, 3) for b in batches)
    assert [int(v) for b in batches for v in b[:, 0]] == list(range(1, 12, 2))
    assert loader_module.get_worker_info() is None
    with DataLoader(
        BigTensors(), batch_size=None, num_workers=2, timeout=GUARD
    ) as loader:  # the shared-memory path
        got = list(loader)
    assert all(isinstance(t, torch.Tensor) and t.shape == (BigTensors.n,) for t in got)
    assert [int(t[0]) for t in got] == [int(t[-1]) for t in got] == list(range(6))


class BigTensors:
    n = 512 * 1024  # 2 MiB: the shared-memory path

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        import torch

        return torch.full((self.n,), float(i))


class Exits:
    """Calls sys.exit(0) at item 5 (``KeyboardInterrupt`` with ``interrupt``)."""

    def __init__(self, interrupt: bool = False) -> None:
        self.interrupt = interrupt

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> int:
        if i == 5:
            if self.interrupt:
                raise KeyboardInterrupt
            raise SystemExit(0)
        return i


@pytest.mark.parametrize("interrupt", [False, True], ids=["exit", "interrupt"])
def test_a_dataset_that_exits_or_interrupts_is_an_error_here_not_an_exit(engine, interrupt):
    with DataLoader(Exits(interrupt), num_workers=2, batch_size=None, timeout=GUARD) as loader:
        got = []
        with pytest.raises(WorkerError) as info:
            for item in loader:
                got.append(item)
    assert got == list(range(5))
    kind = KeyboardInterrupt if interrupt else SystemExit
    assert isinstance(info.value.__cause__, kind) and kind.__name__ in str(info.value)


def test_two_iterators_of_one_loader(engine):
    data = list(range(20))
    with DataLoader(data, num_workers=2, batch_size=4, timeout=GUARD) as loader:
        # each iterator has workers of its own, as in torch: both see every batch
        pairs = list(zip(loader, loader))
        assert len(pairs) == 5 and all(a.tolist() == b.tolist() for a, b in pairs)
        first = iter(loader)
        assert next(first).tolist() == [0, 1, 2, 3]
        second = iter(loader)
        assert [b.tolist() for b in first] == [data[i : i + 4] for i in range(4, 20, 4)]
        assert next(second).tolist() == [0, 1, 2, 3]
        loader.close()  # an epoch not over is told, at its next batch, not cut short silently
        with pytest.raises(RuntimeError, match="was closed"):
            next(second)
    with DataLoader(
        data, num_workers=2, batch_size=4, persistent_workers=True, timeout=GUARD
    ) as loader:
        first = iter(loader)
        assert next(first).tolist() == [0, 1, 2, 3]
        second = iter(loader)  # takes the workers over
        with pytest.raises(RuntimeError, match="persistent_workers=True"):
            next(first)
        assert [b.tolist() for b in second] == [data[i : i + 4] for i in range(0, 20, 4)]


def test_an_empty_epoch_prints_nothing(engine, capfd):
    for _ in range(3):
        with DataLoader([], num_workers=2, batch_size=2, timeout=GUARD) as loader:
            assert list(loader) == []
    time.sleep(0.5)  # a worker that failed would print its traceback by now
    assert capfd.readouterr().err == ""


class HalfPrecision:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int):
        import torch

        return torch.full((1 << 19,), float(i), dtype=torch.bfloat16)  # 1 MiB: shared memory


def test_tensors_of_a_dtype_numpy_lacks():
    torch = pytest.importorskip("torch")
    with DataLoader(HalfPrecision(), num_workers=2, batch_size=2, timeout=GUARD) as loader:
        batches = list(loader)
    assert [b.dtype for b in batches] == [torch.bfloat16] * 2
    assert [float(b[i][-1]) for b in batches for i in range(2)] == [0.0, 1.0, 2.0, 3.0]


TORCH_AFTER_FORK = """
import sys, torch
from framepipe.workers import DataLoader

class Ops:
    def __len__(self):
        return 4
    def __getitem__(self, i):
        return torch.randn(3, 512, 512).mul(2).add(1).sum().item()

torch.ones(1 << 22).sum()  # this process used torch's thread pool before the fork
for epoch in range(2):
    with DataLoader(Ops(), batch_size=2, num_workers=2, start_method="fork", timeout=30) as dl:
        assert len(list(dl)) == 2
print("ok")
"""


def test_forked_workers_run_torch_ops_after_the_parent_used_its_thread_pool():
    """torch's thread pool does not survive a fork: a worker's op that used it would wait for
    its threads forever (TaskTimeout here). Workers run torch ops on one thread, as torch's."""
    pytest.importorskip("torch")
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", TORCH_AFTER_FORK],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


class BatchedFetch:
    """A dataset with ``__getitems__``: torch fetches a batch with one call of it."""

    def __len__(self) -> int:
        return 9

    def __getitem__(self, i: int) -> int:
        raise AssertionError("fetched one by one")

    def __getitems__(self, indices: list[int]) -> list[int]:
        return [i * 1000 for i in indices]


@pytest.mark.parametrize("workers", [0, 2])
def test_torchs_other_arguments_and_batched_fetch(engine, workers):
    with DataLoader(BatchedFetch(), batch_size=3, num_workers=workers, timeout=GUARD) as loader:
        assert [b.tolist() for b in loader] == [
            [0, 1000, 2000],
            [3000, 4000, 5000],
            [6000, 7000, 8000],
        ]
    with pytest.raises(ValueError, match="drop_last=True needs a batch_size"):
        DataLoader(list(range(4)), batch_size=None, drop_last=True, num_workers=workers)
    # batch_size=1 is torch's default: a batch_sampler goes with it
    loader = DataLoader(
        list(range(6)),
        batch_sampler=[[0, 1], [2, 3]],
        batch_size=1,
        num_workers=workers,
        timeout=GUARD,
    )
    with loader:
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    pin_warning = (
        pytest.warns(UserWarning, match="no accelerator is found")
        if _pin._accelerator() is None
        else contextlib.nullcontext()
    )
    with pin_warning:
        loader = DataLoader(
            list(range(4)),
            batch_size=2,
            pin_memory=True,
            num_workers=workers,
            multiprocessing_context=multiprocessing.get_context("fork"),
            timeout=GUARD,
        )
    with loader:
        assert loader.start_method == "fork"
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="not both"):
        DataLoader(
            [1],
            batch_size=None,
            num_workers=2,
            start_method="fork",
            multiprocessing_context="spawn",
        )


@pytest.mark.parametrize("torch_installed", [False, True])
def test_numbers_collate_to_arrays_before_numpy_is_imported(torch_installed):
    """Numbers collate the same whether NumPy (or torch) was imported yet or not: to a NumPy
    array without torch, to a tensor with it."""
    import subprocess
    import sys

    if torch_installed:
        pytest.importorskip("torch")
    code = (
        "import sys\n"
        + ("" if torch_installed else "sys.modules['torch'] = None\n")
        + "from framepipe.workers import DataLoader\n"
        "assert 'numpy' not in sys.modules\n"
        "batches = list(DataLoader(list(range(6)), batch_size=3, num_workers=0))\n"
        "print(type(batches[0]).__name__, [b.tolist() for b in batches])\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    kind = "Tensor" if torch_installed else "ndarray"
    assert out.stdout.strip() == f"{kind} [[0, 1, 2], [3, 4, 5]]"
