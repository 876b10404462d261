"""DataLoader for training: resumable epochs (state_dict / load_state_dict), batches that
survive a worker's crash (worker_crash_retries), and pinned batches (pin_memory).

Real worker processes on both engines (the ``engine`` fixture). There is no GPU here: the
pinning path runs with torch's callables replaced through the private seam
``_pin.set_backend`` by ones that record what they pinned, on real torch tensors.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
import pickle
import random
import signal
import time
import warnings

import pytest

from framepipe.workers import (
    DataLoader,
    WorkerCrashed,
    WorkerCrashWarning,
    _pin,
    get_worker_info,
)
from framepipe.workers._lifecycle import State
from framepipe.workers._options import ProcessOptions
from framepipe.workers._policy import LoaderPolicy

np = pytest.importorskip("numpy")

GUARD = 30.0  # seconds: a batch that takes this long means a hang (TaskTimeout fails the test)


pytestmark = pytest.mark.usefixtures("no_leftover_loader_workers")


# -- datasets (module level: spawned workers import them) --------------------------------------


class Tagged:
    """Item i is the array [i, the loading worker's id, its seed mod 2**31] (0 and -1 in this process)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        if info is None:
            return np.array([i, -1, -1])
        return np.array([i, info.id, info.seed % (1 << 31)])


class Shard:
    """An iterable dataset: worker w of n yields w, w + n, w + 2n, ... below ``n_items``,
    each as [value, worker id, worker seed mod 2**31]. With ``stateful``, it has
    ``state_dict`` / ``load_state_dict`` (its position in its part)."""

    def __init__(self, n_items: int) -> None:
        self.n_items = n_items
        self.pos = 0

    def _part(self) -> tuple[list[int], int, int]:
        info = get_worker_info()
        if info is None:
            return list(range(self.n_items)), -1, -1
        mine = list(range(info.id, self.n_items, info.num_workers))
        return mine, info.id, info.seed % (1 << 31)

    def __iter__(self):
        mine, wid, seed = self._part()
        while self.pos < len(mine):
            value = mine[self.pos]
            self.pos += 1
            yield np.array([value, wid, seed])


class StatefulShard(Shard):
    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def _rows(batches) -> list:
    return [b.tolist() if hasattr(b, "tolist") else b for b in batches]


def _loader(dataset, **kw) -> DataLoader:
    kw.setdefault("timeout", GUARD)
    kw.setdefault("start_method", "fork")
    kw.setdefault("num_workers", 2)
    if "batch_sampler" not in kw:
        kw.setdefault("batch_size", None)
    if kw["num_workers"] == 0:
        kw.pop("prefetch_factor", None)  # torch's rule: no prefetch_factor without workers
    return DataLoader(dataset, **kw)


# -- resumable epochs: map-style ---------------------------------------------------------------

MAP_ARGS = {"batch_size": 2, "shuffle": True, "num_workers": 2, "prefetch_factor": 2}


def _in_flight(it) -> int:
    """Batches the workers of epoch ``it`` hold loaded or loading, not taken yet."""
    return it.workers.in_flight()


def test_resume_at_every_position_of_a_shuffled_epoch(engine):
    """A state taken before iter(), before the first batch, after every batch (with batches
    prefetched and not taken) and after the last resumes with exactly the batches left, the
    same permutation, each batch loaded by the same worker with the same seed; the next
    epoch is the one the uninterrupted run had."""
    n_batches = 7  # 13 items in batches of 2
    with _loader(Tagged(13), generator=random.Random(7), **MAP_ARGS) as ref:
        full = _rows(ref)
        second = _rows(ref)
    assert len(full) == n_batches
    assert sorted(r[0] for b in full for r in b) == list(range(13))
    assert full != second  # a new permutation each epoch

    # before iter(): the resumed loader starts that very epoch
    with _loader(Tagged(13), generator=random.Random(7), **MAP_ARGS) as loader:
        state = pickle.loads(pickle.dumps(loader.state_dict()))
    assert state["epoch"] is None
    with _loader(Tagged(13), generator=random.Random(1234), **MAP_ARGS) as resumed:
        resumed.load_state_dict(state)
        assert _rows(resumed) == full
        assert _rows(resumed) == second

    saw_prefetched = False
    for k in range(n_batches + 1):
        with _loader(Tagged(13), generator=random.Random(7), **MAP_ARGS) as loader:
            it = iter(loader)
            taken = [next(it).tolist() for _ in range(k)]
            if 0 < k < n_batches:
                time.sleep(0.05)  # let the workers load ahead
                saw_prefetched |= _in_flight(it) > 0
            state = pickle.loads(pickle.dumps(loader.state_dict()))
        assert taken == full[:k]
        assert state["epoch"]["yielded"] == k
        # another loader, whose own generator would draw other seeds
        with _loader(Tagged(13), generator=random.Random(99), **MAP_ARGS) as resumed:
            resumed.load_state_dict(state)
            assert _rows(resumed) == full[k:], f"resumed after batch {k}"
            assert _rows(resumed) == second, f"the epoch after one resumed after batch {k}"
    assert saw_prefetched, "no state was taken while batches were in flight"


def test_resume_with_a_seed_a_sampler_and_persistent_workers(engine):
    """seed=, a user sampler with its own state_dict, and persistent workers resume as well;
    a state loaded into the loader that is iterating stops that iterator."""
    args = {"batch_size": 3, "num_workers": 2, "persistent_workers": True}

    with _loader(Tagged(20), seed=5, sampler=ShuffledSampler(20, 3), **args) as ref:
        full, second = _rows(ref), _rows(ref)
    assert full != second
    with _loader(Tagged(20), seed=5, sampler=ShuffledSampler(20, 3), **args) as loader:
        it = iter(loader)
        head = [next(it).tolist() for _ in range(3)]
        state = loader.state_dict()
        loader.load_state_dict(state)  # the same loader, mid-epoch
        with pytest.raises(RuntimeError, match="load_state_dict"):
            next(it)
        assert _rows(loader) == full[3:]
        assert _rows(loader) == second
    assert head == full[:3]
    # and into a fresh loader whose sampler stands elsewhere
    with _loader(Tagged(20), seed=5, sampler=ShuffledSampler(20, 42), **args) as other:
        other.load_state_dict(state)
        assert _rows(other) == full[3:]


def test_resume_with_torch_samplers_and_generators(engine):
    """torch's RandomSampler with a generator, inside a BatchSampler, and a torch Generator
    as the loader's own: the state restores them (the resumed loaders' start elsewhere)."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import BatchSampler, RandomSampler

    def batched(seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        sampler = BatchSampler(RandomSampler(range(15), generator=g), 4, False)
        return _loader(Tagged(15), batch_sampler=sampler, num_workers=2, seed=5)

    def shuffled(seed: int) -> DataLoader:
        g = torch.Generator().manual_seed(seed)
        return _loader(Tagged(15), batch_size=4, shuffle=True, generator=g, num_workers=2)

    for make in (batched, shuffled):
        with make(3) as ref:
            full, second = _rows(ref), _rows(ref)
        assert full != second
        with make(3) as loader:
            it = iter(loader)
            next(it), next(it)
            state = pickle.loads(pickle.dumps(loader.state_dict()))
        with make(77) as resumed:
            resumed.load_state_dict(state)
            assert _rows(resumed) == full[2:], make.__name__
            assert _rows(resumed) == second, make.__name__


class ShuffledSampler:
    """A sampler with its own generator and state_dict (as torchdata's stateful samplers)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.rng = random.Random(seed)

    def __iter__(self):
        order = list(range(self.n))
        self.rng.shuffle(order)
        return iter(order)

    def __len__(self) -> int:
        return self.n

    def state_dict(self) -> dict:
        return {"rng": self.rng.getstate()}

    def load_state_dict(self, state: dict) -> None:
        self.rng.setstate(state["rng"])


def test_resume_out_of_order_delivers_the_rest_once(engine):
    """in_order=False: the batches taken before the state and those after it are every
    batch exactly once."""
    with _loader(Tagged(40), batch_size=2, num_workers=2, in_order=False) as loader:
        it = iter(loader)
        before = [next(it).tolist() for _ in range(7)]
        state = loader.state_dict()
    with _loader(Tagged(40), batch_size=2, num_workers=3, in_order=False) as resumed:
        resumed.load_state_dict(state)
        after = _rows(resumed)
    items = sorted(r[0] for b in before + after for r in b)
    assert items == list(range(40))


def test_a_state_with_batches_taken_out_of_order_skips_exactly_those(engine):
    """The state of an out-of-order epoch names the requests taken above ``done_below``:
    resumed in order, exactly the others come, and the state then counts past the gap."""
    with _loader(Tagged(10), batch_size=1, num_workers=2) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
    state["epoch"].update(done_below=2, taken=[4, 5, 8])
    with _loader(Tagged(10), batch_size=1, num_workers=2) as resumed:
        resumed.load_state_dict(state)
        it = iter(resumed)
        assert [int(next(it)[0][0]) for _ in range(2)] == [2, 3]
        after = resumed.state_dict()["epoch"]
        assert (after["done_below"], after["taken"]) == (6, [8])
        assert [int(b[0][0]) for b in it] == [6, 7, 9]
        assert resumed.state_dict()["epoch"] is None  # the epoch ended


def test_resume_in_process(engine):
    """num_workers=0 resumes too (map-style and iterable)."""
    with _loader(Tagged(9), batch_size=2, shuffle=True, seed=3, num_workers=0) as ref:
        full = _rows(ref)
    for k in range(len(full) + 1):
        with _loader(Tagged(9), batch_size=2, shuffle=True, seed=3, num_workers=0) as loader:
            it = iter(loader)
            for _ in range(k):
                next(it)
            state = loader.state_dict()
        with _loader(Tagged(9), batch_size=2, shuffle=True, seed=8, num_workers=0) as resumed:
            resumed.load_state_dict(state)
            assert _rows(resumed) == full[k:]
    for kind in (Shard, StatefulShard):
        loader = _loader(kind(7), batch_size=2, num_workers=0)
        it = iter(loader)
        assert next(it).tolist() == [[0, -1, -1], [1, -1, -1]]
        state = loader.state_dict()
        resumed = _loader(kind(7), batch_size=2, num_workers=0)
        resumed.load_state_dict(state)
        assert [r[0] for b in _rows(resumed) for r in b] == [2, 3, 4, 5, 6], kind.__name__


# -- resumable epochs: iterable ----------------------------------------------------------------


@pytest.mark.parametrize("kind", [StatefulShard, Shard], ids=["state_dict", "replayed"])
def test_resume_an_iterable_dataset_at_every_position(engine, kind):
    """Each worker's part resumes where the caller's last batch from it left it (the
    dataset's own state_dict, or a replay for a dataset without one): parts of different
    lengths, batches prefetched at the snapshot."""
    args = {"batch_size": 2, "num_workers": 2, "seed": 11}
    with _loader(kind(13), **args) as ref:
        full = _rows(ref)
    # worker 0 has 7 items (4 batches), worker 1 has 6 (3 batches), in turn
    assert [b[0][1] for b in full] == [0, 1, 0, 1, 0, 1, 0]
    for k in range(len(full) + 1):
        with _loader(kind(13), **args) as loader:
            it = iter(loader)
            taken = [next(it).tolist() for _ in range(k)]
            state = pickle.loads(pickle.dumps(loader.state_dict()))
        assert taken == full[:k]
        with _loader(kind(13), batch_size=2, num_workers=2, seed=12) as resumed:
            resumed.load_state_dict(state)
            assert _rows(resumed) == full[k:], f"resumed after batch {k}"


def test_bad_states_are_refused_with_a_reason(engine):
    loader = _loader(Tagged(4), batch_size=2)
    with pytest.raises(TypeError, match="takes the dict"):
        loader.load_state_dict([1, 2])  # type: ignore[arg-type]
    state = loader.state_dict()
    with pytest.raises(ValueError, match="version"):
        loader.load_state_dict({**state, "version": 99})
    with pytest.raises(ValueError, match="iterable dataset"):
        _loader(StatefulShard(4), batch_size=2).load_state_dict(state)
    it_loader = _loader(StatefulShard(8), batch_size=2, num_workers=2)
    it = iter(it_loader)
    next(it)
    it_state = it_loader.state_dict()
    it_loader.close()
    with pytest.raises(ValueError, match="num_workers=2"):
        _loader(StatefulShard(8), batch_size=2, num_workers=3).load_state_dict(it_state)
    with pytest.raises(ValueError, match="worker_crash_retries"):
        _loader(Tagged(4), worker_crash_retries=-1)


def test_taking_a_state_is_cheap_and_never_waits_on_the_workers(engine):
    """state_dict() reads only the parent's bookkeeping: with every worker stuck in a batch,
    it still returns at once (the bench script times it; here only that it never blocks)."""
    with _loader(Sleeper(), num_workers=2, batch_size=None) as loader:
        it = iter(loader)
        assert next(it) == 0
        start = time.monotonic()
        for _ in range(100):
            state = loader.state_dict()
        assert time.monotonic() - start < 5.0  # a hang guard, not a timing
        assert state["epoch"]["yielded"] == 1


class Sleeper:
    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> int:
        if i >= 1:
            time.sleep(0.5)
        return i


# -- batches that survive a crash --------------------------------------------------------------


class CrashAt:
    """Item ``at`` kills its worker (``os._exit`` or SIGKILL) the first ``times`` times it
    is loaded, counted with files in ``marks``; every item is [i]."""

    def __init__(self, n: int, at: int, how: str, marks: str, times: int = 1) -> None:
        self.n, self.at, self.how, self.marks, self.times = n, at, how, marks, times

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        if i == self.at:
            for k in range(self.times):
                try:
                    fd = os.open(
                        os.path.join(self.marks, f"crash-{k}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY
                    )
                except FileExistsError:
                    continue
                os.close(fd)
                os.write(2, f"item {i} crashes this worker\n".encode())
                if self.how == "exit":
                    os._exit(3)
                os.kill(os.getpid(), signal.SIGKILL)
        return i


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_retried_crash_yields_every_batch_once_in_order(engine, tmp_path, how):
    reports = []
    loader = _loader(
        CrashAt(40, 13, how, str(tmp_path)),
        batch_size=2,
        num_workers=2,
        worker_crash_retries=1,
        on_worker_crash=reports.append,
    )
    with loader:
        got = _rows(loader)
    assert got == [[i, i + 1] for i in range(0, 40, 2)]
    assert sorted(os.listdir(tmp_path)) == ["crash-0"]  # it did crash, once
    assert len(reports) == 1 and loader.crash_reports == reports
    err = reports[0]
    assert isinstance(err, WorkerCrashed)
    assert list(err.batches.values()) == [[12, 13]]  # the batch it was loading, no other
    if how == "exit":
        assert err.exitcode == 3
    else:
        assert err.signal_name == "SIGKILL"
    assert "item 13 crashes this worker" in err.stderr_tail
    assert "retry 1 of 1" in str(err)


def test_a_worker_that_died_is_replaced_by_a_new_record(engine, tmp_path):
    """The dead process's lifecycle record ends DEAD; the fresh one in its place has its own,
    which goes from STARTING to READY, and every record is DEAD once the loader is closed."""
    loader = _loader(
        CrashAt(24, 9, "kill", str(tmp_path)),
        num_workers=2,
        worker_crash_retries=1,
        on_worker_crash=lambda err: None,
    )
    it = iter(loader)
    workers = it.workers
    assert workers.policy == LoaderPolicy.of(1)
    first = [slot.life for slot in workers.slots]
    got = [next(it), next(it)]  # one from each worker: both said they are ready
    assert all(slot.state is State.READY for slot in workers.slots)
    got += list(it)
    assert got == list(range(24))
    lives = [slot.life for slot in workers.slots]
    replaced = [k for k in range(2) if lives[k] is not first[k]]
    assert replaced == [9 % 2]  # item 9's worker, and only it, is a new process
    assert first[9 % 2].state is State.DEAD
    loader.close()
    assert all(life.state is State.DEAD for life in first + lives)


@pytest.mark.parametrize("method", [None, "spawn", "forkserver"])
def test_a_loader_starts_its_workers_from_one_options_record(method):
    loader = _loader(list(range(6)), num_workers=2, start_method=method)
    with loader:
        it = iter(loader)
        assert list(it) == list(range(6))
        options = it.workers.process
        assert isinstance(options, ProcessOptions)
        expected = multiprocessing.get_context(method).get_start_method()
        assert options.start_method == expected
        assert options.name == "DataLoader-worker"
        assert [s.proc.name for s in it.workers.slots] == [
            "DataLoader-worker-0",
            "DataLoader-worker-1",
        ]


def test_a_retried_crash_warns_without_a_callback(engine, tmp_path):
    with _loader(
        CrashAt(12, 5, "kill", str(tmp_path)), num_workers=2, worker_crash_retries=2
    ) as loader:
        with pytest.warns(WorkerCrashWarning, match="indices 5"):
            got = list(loader)
    assert got == list(range(12))


def test_a_retried_crash_on_spawned_workers(tmp_path):
    """The batch marker reaches a spawned worker too (its descriptor is passed, not
    inherited), and the replacement is spawned the same way."""
    reports = []
    loader = _loader(
        CrashAt(10, 6, "kill", str(tmp_path)),
        batch_size=2,
        num_workers=1,
        start_method="spawn",
        worker_crash_retries=1,
        on_worker_crash=reports.append,
    )
    with loader:
        assert _rows(loader) == [[i, i + 1] for i in range(0, 10, 2)]
    assert [list(r.batches.values()) for r in reports] == [[[6, 7]]]


def test_retries_out_of_order_on_persistent_workers(engine, tmp_path):
    """in_order=False and persistent workers: the crash costs nothing, the replacement
    serves the next epoch."""
    loader = _loader(
        CrashAt(30, 17, "exit", str(tmp_path)),
        num_workers=3,
        in_order=False,
        persistent_workers=True,
        worker_crash_retries=1,
        on_worker_crash=lambda err: None,
    )
    with loader:
        first = list(loader)
        pids = loader.worker_pids()
        second = list(loader)
        assert loader.worker_pids() == pids
    assert sorted(first) == sorted(second) == list(range(30))
    assert len(loader.crash_reports) == 1


def test_a_batch_that_crashes_retries_plus_one_workers_fails_naming_it(engine, tmp_path):
    retries = 2
    loader = _loader(
        CrashAt(40, 13, "kill", str(tmp_path), times=100),
        batch_size=2,
        num_workers=2,
        worker_crash_retries=retries,
        on_worker_crash=lambda err: None,
    )
    got = []
    with pytest.raises(WorkerCrashed) as info:
        for batch in loader:
            got.append(batch.tolist())
    err = info.value
    assert got == [[i, i + 1] for i in range(0, 12, 2)]  # everything before it, in order
    assert list(err.batches.values()) == [[12, 13]]
    assert "indices [12, 13]" in str(err)
    assert f"crashed {retries + 1} workers" in str(err)
    assert len(err.crashes) == retries and len(loader.crash_reports) == retries
    assert len(os.listdir(tmp_path)) == retries + 1
    loader.close()


class CrashingShard(StatefulShard):
    """A stateful part of an iterable dataset whose value ``at`` kills its worker once."""

    def __init__(self, n_items: int, at: int, marks: str, stateful: bool) -> None:
        super().__init__(n_items)
        self.at, self.marks, self.stateful = at, marks, stateful

    def __getattribute__(self, name: str):
        if name in ("state_dict", "load_state_dict") and not object.__getattribute__(
            self, "stateful"
        ):
            raise AttributeError(name)
        return object.__getattribute__(self, name)

    def __iter__(self):
        for row in super().__iter__():
            if int(row[0]) == self.at and not os.path.exists(os.path.join(self.marks, "crashed")):
                open(os.path.join(self.marks, "crashed"), "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            yield row


@pytest.mark.parametrize("stateful", [True, False], ids=["state_dict", "replayed"])
def test_an_iterable_part_resumes_after_its_worker_crashed(engine, tmp_path, stateful):
    args = {"batch_size": 2, "num_workers": 2, "seed": 4}
    with _loader(Shard(21), **args) as ref:
        full = [[r[0] for r in b] for b in _rows(ref)]
    loader = _loader(CrashingShard(21, 12, str(tmp_path), stateful), worker_crash_retries=1, **args)
    with loader, pytest.warns(WorkerCrashWarning):
        got = [[r[0] for r in b] for b in _rows(loader)]
    assert os.path.exists(tmp_path / "crashed")
    assert got == full


# -- pinned batches ------------------------------------------------------------------------------


class Recorder:
    """Pinner callables that pin nothing but record what they would: ``alloc`` makes plain
    CPU buffers and remembers their address ranges, ``is_pinned`` answers from those."""

    def __init__(self, torch) -> None:
        self.torch = torch
        self.buffers: list[tuple[int, int]] = []
        self.allocs: list[int] = []
        self.pinned_tensors = 0

    def alloc(self, nbytes: int):
        t = self.torch.empty(nbytes, dtype=self.torch.uint8)
        self.allocs.append(nbytes)
        self.buffers.append((t.data_ptr(), nbytes))
        return t

    def is_pinned(self, t) -> bool:
        ptr = t.data_ptr()
        return any(start <= ptr < start + n for start, n in self.buffers)

    def pin_tensor(self, t):
        self.pinned_tensors += 1
        out = self.alloc(max(1, t.numel() * t.element_size()))
        view = out[: t.numel() * t.element_size()].view(t.dtype).view(t.shape)
        view.copy_(t)
        return view

    def pinner(self) -> _pin.Pinner:
        return _pin.Pinner(self.pin_tensor, self.alloc, self.is_pinned)


Pair = collections.namedtuple("Pair", "x y")


@dataclasses.dataclass(frozen=True)
class Sample:
    image: object
    label: object
    name: str


class Custom:
    def __init__(self, t) -> None:
        self.t = t
        self.pinned = False

    def pin_memory(self):
        out = Custom(self.t)
        out.pinned = True
        return out


def test_the_walk_pins_nested_batches_as_torch_does():
    torch = pytest.importorskip("torch")
    rec = Recorder(torch)
    pinner = rec.pinner()
    already = rec.pin_tensor(torch.arange(3))
    rec.pinned_tensors = 0
    batch = {
        "a": torch.arange(4, dtype=torch.float32),
        "pair": Pair(torch.ones(2, 2), [torch.zeros(3), "text"]),
        "tup": (torch.tensor([7]), b"raw", 5),
        "sample": Sample(torch.full((2,), 3.0), np.arange(5, dtype=np.int64), "n"),
        "custom": Custom(torch.ones(1)),
        "array": np.arange(6, dtype=np.float32).reshape(2, 3),
        "already": already,
        "objects": np.array([object()], dtype=object),
    }
    out = pinner.pin(batch)
    assert type(out) is dict and list(out) == list(batch)
    assert rec.pinned_tensors == 5  # a, pair.x, pair.y[0], tup[0], sample.image
    for t in (out["a"], out["pair"].x, out["pair"].y[0], out["tup"][0], out["sample"].image):
        assert isinstance(t, torch.Tensor) and rec.is_pinned(t)
    assert torch.equal(out["a"], batch["a"]) and torch.equal(out["pair"].x, torch.ones(2, 2))
    assert type(out["pair"]) is Pair and type(out["pair"].y) is list and out["pair"].y[1] == "text"
    assert type(out["tup"]) is tuple and out["tup"][1:] == (b"raw", 5)
    assert type(out["sample"]) is Sample and out["sample"].name == "n"
    # NumPy arrays become pinned tensors (what torch's loader gives for them)
    for got, want in ((out["array"], batch["array"]), (out["sample"].label, batch["sample"].label)):
        assert isinstance(got, torch.Tensor) and rec.is_pinned(got)
        assert got.numpy().dtype == want.dtype and (got.numpy() == want).all()
    assert out["custom"].pinned and not batch["custom"].pinned
    assert out["already"] is already  # pinned already: no copy
    assert out["objects"] is batch["objects"]
    assert batch["sample"].image.data_ptr() != out["sample"].image.data_ptr()


class TensorDicts:
    """Item i: a dict with a 1 MiB tensor, a 256 KiB array and a small tensor, all filled
    with i."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> dict:
        import torch

        return {
            "big": torch.full((256 * 1024,), float(i)),
            "mid": np.full(64 * 1024, i, dtype=np.int32),
            "small": torch.tensor([i, i]),
        }


@pytest.fixture
def recorder(monkeypatch):
    torch = pytest.importorskip("torch")
    rec = Recorder(torch)
    monkeypatch.setattr(_pin, "_backend", rec.pinner)
    return rec


def test_pinned_loader_receives_large_payloads_into_pinned_buffers(engine, recorder):
    torch = pytest.importorskip("torch")
    with _loader(TensorDicts(), num_workers=2, pin_memory=True) as loader:
        got = list(loader)
    assert len(got) == 6
    for i, item in enumerate(got):
        assert float(item["big"][0]) == i and int(item["mid"][-1]) == i
        assert item["small"].tolist() == [i, i]
        for value in (item["big"], item["mid"], item["small"]):
            assert isinstance(value, torch.Tensor) and recorder.is_pinned(value)
        assert item["mid"].dtype == torch.int32
    # the 1 MiB tensor and the 256 KiB array came through shared memory, read straight into
    # pinned buffers (no copy made afterwards); the small tensor was pinned once it arrived
    assert recorder.allocs.count(1024 * 1024) == 6
    assert recorder.allocs.count(256 * 1024) == 6
    assert recorder.pinned_tensors == 6


def test_pinned_loader_in_process_and_with_batches(engine, recorder):
    with _loader(list(range(10)), batch_size=4, num_workers=0, pin_memory=True) as loader:
        got = list(loader)
    assert [b.tolist() for b in got] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    assert all(isinstance(b, recorder.torch.Tensor) and recorder.is_pinned(b) for b in got)


def test_pin_memory_without_an_accelerator_warns_once_and_runs_unpinned(engine):
    if _pin._accelerator() is not None:
        pytest.skip("an accelerator is available here")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        loaders = [_loader(list(range(4)), batch_size=2, pin_memory=True) for _ in range(3)]
    texts = [str(w.message) for w in caught]
    assert texts == [_pin.NO_ACCELERATOR]
    with loaders[0] as loader:
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    with pytest.raises(TypeError, match="pin_memory_device must be a str"):
        DataLoader([1], batch_size=None, num_workers=2, pin_memory=True, pin_memory_device=0)  # type: ignore[arg-type]
