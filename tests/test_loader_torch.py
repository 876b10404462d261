"""framepipe's DataLoader against torch's own, as the oracle: its defaults, its collate (tensors),
its round-robin order of batches over workers, its exception types, bulk index samplers, a live
``len()``, ``DataLoader[T]``, and a spawned child that raises while it holds an iterator.

Loaders that start workers get a ``timeout`` as a hang guard; the ``no_leftover_loader_workers``
fixture (conftest) fails a test that leaves a worker running.
"""

from __future__ import annotations

import collections
import gc
import multiprocessing
import os
import signal
import time

import pytest

from framepipe import _impl
from framepipe.workers import (
    DataLoader,
    LoaderTimeout,
    TaskTimeout,
    WorkerInitError,
    WorkerStartError,
    default_collate,
    default_convert,
    get_worker_info,
)
from framepipe.workers.loader import wire as loader_wire

np = pytest.importorskip("numpy")
torch = pytest.importorskip("torch")
from torch.utils import data as tdata  # noqa: E402

GUARD = 30.0  # seconds: a batch that takes this long means a hang
Point = collections.namedtuple("Point", "x y")


@pytest.fixture(autouse=True)
def _reaped(no_leftover_loader_workers):
    yield
    # A torch iterator that raised is kept in a reference cycle by its traceback; collected
    # here, it shuts its workers down in this process, not in a worker we fork later (where
    # its __del__ would run on a copy and break that worker).
    gc.collect()


@pytest.fixture
def engine(impl, monkeypatch):
    """Loaders built in this test run on the ``impl`` core (c or py)."""
    monkeypatch.setattr(_impl, "core", impl)
    return impl


def same(a, b) -> bool:
    """Whether two batches are equal in type, structure, dtype and values."""
    if isinstance(a, torch.Tensor):
        return (
            type(b) is torch.Tensor
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    return bool(a == b)


def torch_context(workers: int) -> dict:
    """torch's loader forks its workers (it refuses a context without workers)."""
    return {"multiprocessing_context": "fork"} if workers else {}


def assert_same_batches(ours, theirs) -> None:
    ours, theirs = list(ours), list(theirs)
    assert len(ours) == len(theirs), (ours, theirs)
    for k, (a, b) in enumerate(zip(ours, theirs)):
        assert same(a, b), f"batch {k}: {a!r} != torch's {b!r}"


# -- datasets (module level: spawned workers import them) --------------------------------------


class Records:
    """Map-style: item i is a dict of an int, a float, a string, a small array and a tuple."""

    def __init__(self, n: int = 7) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return {
            "i": i,
            "f": i / 2,
            "s": f"item-{i}",
            "a": np.full(3, i, dtype=np.int16),
            "t": (i, np.float32(i)),
            "p": Point(i, np.arange(2) + i),
        }


class WhereLoaded:
    """Item i is (i, pid that loaded it, worker id or -1)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        info = get_worker_info()
        return i, os.getpid(), -1 if info is None else info.id


class TorchWhereLoaded(tdata.Dataset):
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        info = tdata.get_worker_info()
        return i, os.getpid(), -1 if info is None else info.id


class FailsAt:
    """Item 3 raises a KeyError (the dataset's own type reaches the caller)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        if i == 3:
            raise KeyError(f"no record {i}")
        return i


class Shards(tdata.IterableDataset):
    """Worker w of n yields items w, w+n, ... below ``stop`` (uneven shards, so some workers
    run out before others), sharded with ``get_info`` as torch's docs show."""

    def __init__(self, stop: int, get_info) -> None:
        self.stop = stop
        self.get_info = get_info

    def __iter__(self):
        info = self.get_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(start, self.stop, step))


class Unequal(tdata.IterableDataset):
    """Worker w yields 3 * (w + 1) items tagged with w: the shards end at different times."""

    def __init__(self, get_info) -> None:
        self.get_info = get_info

    def __iter__(self):
        info = self.get_info()
        wid = 0 if info is None else info.id
        return iter([(wid, k) for k in range(3 * (wid + 1))])


def our_info():
    return get_worker_info()


def torch_info():
    return tdata.get_worker_info()


class Bulk:
    """Map-style dataset that takes a list of indices in one call (bulk loading) and counts
    its calls in a file (the workers' calls are made in other processes)."""

    def __init__(self, log: str) -> None:
        self.log = log

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index):
        with open(self.log, "a") as f:
            f.write(f"{index!r}\n")
        if isinstance(index, list):
            return np.array(index, dtype=np.int64) * 10
        return index * 10


class Growing:
    def __init__(self, n: int) -> None:
        self.items = list(range(n))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> int:
        return self.items[i]


def failing_init(worker_id: int) -> None:
    raise ValueError(f"worker {worker_id} cannot open its database")


class Stalls:
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if i == 1:
            time.sleep(60)
        return i


# -- 1. defaults ---------------------------------------------------------------------------------


def test_defaults_are_torchs():
    ours = DataLoader(list(range(5)))
    theirs = tdata.DataLoader(list(range(5)))
    for name in ("batch_size", "num_workers", "prefetch_factor", "drop_last", "timeout"):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert (ours.batch_size, ours.num_workers, ours.prefetch_factor) == (1, 0, None)
    with_workers = DataLoader(list(range(5)), num_workers=2)
    assert with_workers.prefetch_factor == 2
    assert with_workers.prefetch_factor == tdata.DataLoader(range(5), num_workers=2).prefetch_factor
    assert_same_batches(ours, theirs)


def test_prefetch_factor_without_workers_is_refused_as_by_torch():
    with pytest.raises(ValueError):
        tdata.DataLoader(list(range(4)), prefetch_factor=2)
    with pytest.raises(ValueError, match="prefetch_factor=2 needs workers"):
        DataLoader(list(range(4)), prefetch_factor=2)
    with pytest.raises(ValueError, match="prefetch_factor must be 1 or more"):
        DataLoader(list(range(4)), num_workers=1, prefetch_factor=0)
    with pytest.raises(TypeError, match="prefetch_factor must be an int or None"):
        DataLoader(list(range(4)), num_workers=1, prefetch_factor=2.5)  # type: ignore[arg-type]


def test_zero_workers_load_in_the_calling_process():
    before = set(multiprocessing.active_children())
    loader = DataLoader(WhereLoaded())
    got = list(loader)
    assert set(multiprocessing.active_children()) == before
    assert loader.worker_pids() == []
    assert {int(b[1]) for b in got} == {os.getpid()}
    assert [int(b[2]) for b in got] == [-1] * 6  # get_worker_info() is None here
    assert_same_batches([b[0] for b in got], [b[0] for b in tdata.DataLoader(TorchWhereLoaded())])


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"batch_size": None},
        {"batch_size": 3},
        {"batch_size": 3, "drop_last": True},
        {"batch_size": 2, "sampler": [6, 0, 3, 1]},
        {"batch_sampler": [[0, 1], [5], [2, 3, 4]]},
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "defaults",
)
@pytest.mark.parametrize("workers", [0, 2])
def test_batches_are_torchs(kw, workers, engine):
    extra = {"timeout": GUARD} if workers else {}
    ours = DataLoader(Records(), num_workers=workers, **kw, **extra)
    theirs = tdata.DataLoader(Records(), num_workers=workers, **kw, **torch_context(workers))
    with ours:
        assert_same_batches(ours, theirs)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_datasets_error_is_its_own_type_as_under_torch(workers, engine):
    extra = {"timeout": GUARD} if workers else {}
    # ours first: torch's iterator, kept alive by its exception's traceback, must not be in
    # the process our workers fork from
    for loader in (
        DataLoader(FailsAt(), num_workers=workers, **extra),
        tdata.DataLoader(FailsAt(), num_workers=workers, **torch_context(workers)),
    ):
        got = []
        with pytest.raises(KeyError, match="no record 3"):
            for batch in loader:
                got.append(int(batch))
        assert got == [0, 1, 2]
        if isinstance(loader, DataLoader):
            loader.close()


# -- 2. collate ----------------------------------------------------------------------------------

SAMPLES = [
    [1, 2, 3],
    [1.5, 2.5],
    [True, False],
    [np.int32(3), np.int32(4)],
    [np.float16(1.5), np.float16(2)],
    ["a", "bc"],
    [b"x", b"y"],
    [np.arange(4, dtype=np.float32), np.ones(4, dtype=np.float32)],
    [np.arange(6, dtype=np.uint8).reshape(2, 3)] * 3,
    [np.array(2.5), np.array(3.5)],
    [np.arange(3, dtype=np.int64), np.arange(6, dtype=np.int64)[::2]],
    [torch.arange(3), torch.ones(3, dtype=torch.int64)],
    [(1, "a"), (2, "b")],
    [[1, 2.0], [3, 4.0]],
    [Point(1, np.zeros(2)), Point(2, np.ones(2))],
    [Records()[0], Records()[1]],
    [{"x": [np.arange(2), 1]}, {"x": [np.arange(2) + 1, 2]}],
]


@pytest.mark.parametrize("batch", SAMPLES, ids=range(len(SAMPLES)))
def test_default_collate_is_torchs(batch):
    assert same(default_collate(batch), tdata.default_collate(batch))


@pytest.mark.parametrize("batch", SAMPLES, ids=range(len(SAMPLES)))
def test_default_convert_is_torchs(batch):
    for item in batch:
        assert same(default_convert(item), tdata.default_convert(item))


@pytest.mark.parametrize(
    "batch",
    [
        [object(), object()],
        [np.array(["a"]), np.array(["b"])],
        [[1, 2], [1]],
        [np.arange(3)[::-1], np.arange(3)],
    ],
    ids=["object", "str-array", "ragged", "negative-strides"],
)
def test_default_collate_fails_as_torchs_does(batch):
    with pytest.raises(Exception) as theirs:
        tdata.default_collate(batch)
    with pytest.raises(type(theirs.value)):
        default_collate(batch)


class Arrays:
    """Item i: a float32 array of ``size`` bytes filled with i."""

    def __init__(self, size: int, n: int = 6) -> None:
        self.size, self.n = size, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return np.full(self.size // 4, i, dtype=np.float32)


@pytest.mark.parametrize(
    "size", [4096, 256 * 1024, 2 * 1024 * 1024], ids=["inline", "out-of-band", "shared-memory"]
)
@pytest.mark.parametrize("batch_size", [None, 2])
def test_batches_arrive_as_tensors_on_every_path(size, batch_size, engine):
    """Small arrays take the directly built pickle, larger ones the bulk channel, the largest
    shared memory: each arrives as the tensor torch's loader gives, writable."""
    ours = DataLoader(
        Arrays(size), batch_size=batch_size, num_workers=2, timeout=GUARD, start_method="fork"
    )
    theirs = tdata.DataLoader(
        Arrays(size), batch_size=batch_size, num_workers=2, multiprocessing_context="fork"
    )
    with ours:
        got = list(ours)
        assert_same_batches(got, theirs)
    got[0].fill_(-1.0)  # the caller's own memory
    assert float(got[0].reshape(-1)[0]) == -1.0


def test_small_tensors_travel_as_a_pickle_built_directly():
    import pickle

    for tensor in (torch.arange(12, dtype=torch.int32).reshape(3, 4), torch.tensor(2.5)):
        blob = loader_wire._inline_array(5, tensor)
        assert blob is not None
        kind, bid, back = pickle.loads(blob)
        assert (kind, bid) == (loader_wire.OK, 5)
        assert same(back, tensor)
    for other in (
        torch.zeros(3, requires_grad=True),
        torch.arange(10)[::2],  # not contiguous
        torch.zeros(4, dtype=torch.bfloat16),  # no NumPy dtype
        torch.nn.Parameter(torch.zeros(2)),  # a subclass
    ):
        assert loader_wire._inline_parts(1, other) is None


# -- 3. round robin ------------------------------------------------------------------------------


def test_six_items_over_six_workers_land_on_workers_0_to_5(engine):
    with DataLoader(WhereLoaded(), num_workers=6, timeout=GUARD) as loader:
        got = [int(b[2]) for b in loader]
    assert got == [0, 1, 2, 3, 4, 5]
    theirs = tdata.DataLoader(TorchWhereLoaded(), num_workers=6, multiprocessing_context="fork")
    assert [int(b[2]) for b in theirs] == got


@pytest.mark.parametrize("workers, stop, batch_size", [(3, 20, None), (4, 22, 2), (2, 7, 3)])
def test_an_iterable_dataset_sharded_by_worker_comes_in_torchs_order(
    workers, stop, batch_size, engine
):
    ours = DataLoader(
        Shards(stop, our_info), batch_size=batch_size, num_workers=workers, timeout=GUARD
    )
    theirs = tdata.DataLoader(
        Shards(stop, torch_info),
        batch_size=batch_size,
        num_workers=workers,
        multiprocessing_context="fork",
    )
    with ours:
        assert_same_batches(ours, theirs)


def test_exhausted_workers_are_skipped_as_by_torch(engine):
    """Shards of 3, 6 and 9 items: once a worker's shard ends, the round goes on without it."""
    ours = DataLoader(Unequal(our_info), batch_size=None, num_workers=3, timeout=GUARD)
    theirs = tdata.DataLoader(
        Unequal(torch_info), batch_size=None, num_workers=3, multiprocessing_context="fork"
    )
    with ours:
        got = [tuple(int(v) for v in b) for b in ours]
    assert got == [tuple(int(v) for v in b) for b in theirs]
    assert [w for w, _ in got][:9] == [0, 1, 2] * 3


# -- 4. exception types --------------------------------------------------------------------------


def test_a_failing_worker_init_fn_is_a_runtime_error(engine):
    loader = DataLoader(list(range(4)), num_workers=2, worker_init_fn=failing_init, timeout=GUARD)
    with pytest.raises(RuntimeError, match="cannot open its database") as info:
        list(loader)
    assert isinstance(info.value, (WorkerInitError, WorkerStartError))
    assert isinstance(info.value.__cause__, ValueError)
    loader.close()


def test_a_timeout_is_a_runtime_error_with_the_stack(engine):
    loader = DataLoader(Stalls(), num_workers=2, timeout=1.0)
    with pytest.raises(RuntimeError) as info:
        list(loader)
    assert isinstance(info.value, (LoaderTimeout, TaskTimeout, TimeoutError))
    assert "Stalls" in str(info.value) or "__getitem__" in str(info.value)
    loader.close()


# -- 5. bulk samplers, len, DataLoader[T], children that exit ------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_of_index_lists_loads_each_list_in_one_call(workers, tmp_path, engine):
    sampler = [[0, 1, 2], [7, 8], [3]]
    extra = {"timeout": GUARD} if workers else {}
    ours_log, theirs_log = tmp_path / "ours", tmp_path / "theirs"
    ours = DataLoader(
        Bulk(str(ours_log)), batch_size=None, sampler=sampler, num_workers=workers, **extra
    )
    theirs = tdata.DataLoader(
        Bulk(str(theirs_log)),
        batch_size=None,
        sampler=sampler,
        num_workers=workers,
        **torch_context(workers),
    )
    with ours:
        assert_same_batches(ours, theirs)
    calls = ours_log.read_text().splitlines()
    assert sorted(calls) == sorted(repr(s) for s in sampler)  # one call per list
    assert sorted(calls) == sorted(theirs_log.read_text().splitlines())


def test_len_is_computed_on_each_call():
    data = Growing(5)
    ours, theirs = DataLoader(data, batch_size=2), tdata.DataLoader(data, batch_size=2)
    assert len(ours) == len(theirs) == 3
    data.items += [5, 6, 7]
    assert len(ours) == len(theirs) == 4
    assert_same_batches(ours, theirs)
    shuffled = DataLoader(data, batch_size=3, shuffle=True, seed=1)
    data.items.append(8)
    assert len(shuffled) == 3
    assert sorted(int(v) for b in shuffled for v in b) == list(range(9))


def test_dataloader_is_subscriptable_at_run_time():
    alias = DataLoader[int]
    assert alias.__origin__ is DataLoader
    assert isinstance(alias(list(range(3))), DataLoader)


def _raise_while_iterating(conn) -> None:
    loader = DataLoader(list(range(100)), batch_size=2, num_workers=2, timeout=GUARD)
    it = iter(loader)
    next(it)
    conn.send(loader.worker_pids())
    conn.close()
    raise ValueError("raised while holding the iterator")


def test_a_spawned_child_that_raises_while_iterating_exits():
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_raise_while_iterating, args=(child,), name="loader-holder")
    proc.start()
    child.close()
    pids: list[int] = []
    try:
        pids = parent.recv() if parent.poll(60) else []
        proc.join(30)
        assert proc.exitcode == 1, "the child did not exit"
        assert len(pids) == 2
        for pid in pids:
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and _running(pid):
                time.sleep(0.02)
            assert not _running(pid), f"worker {pid} outlived its parent"
    finally:
        if proc.exitcode is None:
            proc.kill()
            proc.join(5)
        for pid in pids:  # what a failure left behind
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
        parent.close()


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in (b"Z", b"X")
