"""The :class:`DataLoader`: torch's arguments and defaults, framepipe's transport."""

from __future__ import annotations

import contextlib
import itertools
import math
import random
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any, Generic

from ..._args import check_int, check_seconds
from .. import _pin, _progress, _resume
from .._mainguard import refuse_during_main_import
from .._options import get_context
from .epoch import _Epoch, _LocalEpoch, _worker_resume
from .manager import _Workers
from .samplers import _batches, _draw_seed, _RandomSampler, _SequentialSampler
from .worker import _Fetcher

if TYPE_CHECKING:
    from typing_extensions import TypeVar

    #: what iterating a DataLoader gives: what its collate_fn returns (Any by default)
    BatchT = TypeVar("BatchT", default=Any)
else:
    from typing import TypeVar

    BatchT = TypeVar("BatchT")


def _is_iterable_dataset(dataset: Any) -> bool:
    if any(c.__name__ == "IterableDataset" for c in type(dataset).__mro__):
        return True
    return hasattr(dataset, "__iter__") and not hasattr(dataset, "__getitem__")


def _start_method(start_method: str | None, multiprocessing_context: Any) -> str | None:
    """The start method, given as itself or as torch's ``multiprocessing_context``."""
    if multiprocessing_context is None:
        return start_method
    if start_method is not None:
        raise ValueError("give start_method or multiprocessing_context, not both")
    if isinstance(multiprocessing_context, str):
        return multiprocessing_context
    if not callable(getattr(multiprocessing_context, "get_start_method", None)):
        raise TypeError(
            "multiprocessing_context must be a start method ('fork', 'spawn', 'forkserver') "
            f"or a multiprocessing context, not {type(multiprocessing_context).__name__} "
            f"({multiprocessing_context!r:.60})"
        )
    return str(multiprocessing_context.get_start_method())


def _check_workers(
    num_workers: int,
    timeout: float,
    prefetch_factor: int | None,
    persistent_workers: bool,
    worker_crash_retries: int,
) -> int | None:
    """The arguments about workers, checked as torch checks them; the prefetch factor: torch's
    default 2 with workers, None without."""
    if (
        isinstance(worker_crash_retries, bool)
        or not isinstance(worker_crash_retries, int)
        or worker_crash_retries < 0
    ):
        raise ValueError(
            f"worker_crash_retries must be an int, 0 or more (how many fresh workers a "
            f"batch whose worker died is loaded on again), not {worker_crash_retries!r}"
        )
    check_int("num_workers", num_workers, 0, why="0 loads in this process")
    check_seconds("timeout", timeout, none_ok=False, zero_ok=True, why="0: no timeout")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers needs num_workers > 0")
    if num_workers == 0 and prefetch_factor is not None:
        raise ValueError(
            f"prefetch_factor={prefetch_factor!r} needs workers: with num_workers=0 batches "
            "are loaded in this process, one at a time; give num_workers > 0, or leave "
            "prefetch_factor as None"
        )
    if prefetch_factor is None:
        return 2 if num_workers > 0 else None  # torch's default
    if isinstance(prefetch_factor, bool) or not isinstance(prefetch_factor, int):
        raise TypeError(f"prefetch_factor must be an int or None, not {prefetch_factor!r}")
    if prefetch_factor < 1:
        raise ValueError(
            f"prefetch_factor must be 1 or more (batches loaded ahead per worker), "
            f"not {prefetch_factor!r}"
        )
    return prefetch_factor


def _check_batching(
    iterable: bool,
    batch_size: int | None,
    shuffle: bool,
    sampler: Any,
    batch_sampler: Any,
    drop_last: bool,
) -> int | None:
    """The arguments about batches and samplers, checked as torch checks them; the batch size
    (None with a ``batch_sampler``, which replaces torch's default of 1)."""
    if iterable and (shuffle or sampler is not None or batch_sampler is not None):
        raise ValueError("an iterable dataset takes no shuffle, sampler or batch_sampler")
    if batch_sampler is not None and batch_size == 1:
        batch_size = None  # torch's default batch_size, which a batch_sampler replaces
    if batch_sampler is not None and (
        batch_size is not None or shuffle or sampler is not None or drop_last
    ):
        raise ValueError("batch_sampler excludes batch_size, shuffle, sampler and drop_last")
    if batch_sampler is None and batch_size is None and drop_last:
        raise ValueError(
            "drop_last=True needs a batch_size: with batch_size=None items come one by one"
        )
    if sampler is not None and shuffle:
        raise ValueError("sampler excludes shuffle")
    if batch_size is not None:
        try:  # a ValueError whatever is wrong with it, as torch's
            batch_size = check_int("batch_size", batch_size, why="None: items one by one")
        except TypeError as exc:
            raise ValueError(str(exc)) from None
    return batch_size


class DataLoader(Generic[BatchT]):
    """Batches of a dataset, loaded by worker processes over framepipe channels.

    The arguments are torch's (``torch.utils.data.DataLoader``):

    ``dataset``: map-style (``__getitem__`` and ``__len__``) or iterable (``__iter__``; a
    subclass of torch's ``IterableDataset`` counts as one). ``batch_size=None`` yields items;
    an int groups ``batch_size`` indices and collates them with ``collate_fn`` (default
    :func:`default_collate`). ``shuffle``, ``sampler`` (any iterable of indices, torch's
    samplers included), ``batch_sampler`` (any iterable of lists of indices), ``drop_last``.
    ``num_workers`` (0 loads in this process), ``prefetch_factor`` (batches loaded ahead
    per worker: at most ``prefetch_factor * num_workers`` are in flight or waiting; up to
    16 per worker for a worker whose batches are small arrays that load fast),
    ``in_order`` (False: yield batches as they arrive), ``timeout`` (seconds a batch may take;
    0 waits forever), ``worker_init_fn(worker_id)``, ``persistent_workers`` (keep the workers
    between epochs), ``start_method`` (``"fork"``, ``"spawn"``, ``"forkserver"``; None: the
    platform's default). ``generator`` (a ``random.Random``, NumPy or torch Generator; default
    the ``random`` module) draws each epoch's base seed and shuffle order; ``seed=`` fixes the
    base seed instead, so every run reproduces the same epochs.

    Each worker seeds ``random``, NumPy's global generator and torch (when imported) from the
    epoch's base seed and its id (as torch does), so no two workers share a random stream.

    For training (docs/loader-training.md): ``pin_memory=True`` delivers batches in pinned
    (page-locked) memory when an accelerator is available (``pin_memory_device`` is accepted,
    as torch's); :meth:`state_dict` and :meth:`load_state_dict` resume an epoch where it was
    left; ``worker_crash_retries=N`` loads a batch whose worker died again on a fresh worker,
    up to N times, each crash reported to ``on_worker_crash(err)`` (default: a
    :class:`WorkerCrashWarning`) and kept in ``crash_reports``.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool = False,
        sampler: Iterable[Any] | None = None,
        batch_sampler: Iterable[Any] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[Any], BatchT] | None = None,
        prefetch_factor: int | None = None,
        in_order: bool = True,
        timeout: float = 0,
        worker_init_fn: Callable[[int], Any] | None = None,
        persistent_workers: bool = False,
        drop_last: bool = False,
        start_method: str | None = None,
        *,
        generator: Any = None,
        seed: int | None = None,
        multiprocessing_context: Any = None,
        pin_memory: bool = False,
        pin_memory_device: str = "",
        worker_crash_retries: int = 0,
        on_worker_crash: Callable[[Any], Any] | None = None,
        progress: Any = None,
    ) -> None:
        start_method = _start_method(start_method, multiprocessing_context)
        if start_method is not None:
            get_context(start_method)  # an unknown method is refused now, as torch does
        prefetch_factor = _check_workers(
            num_workers, timeout, prefetch_factor, persistent_workers, worker_crash_retries
        )
        self.dataset = dataset
        self._iterable = _is_iterable_dataset(dataset)
        batch_size = _check_batching(
            self._iterable, batch_size, shuffle, sampler, batch_sampler, drop_last
        )
        self.batch_size = batch_size
        self.drop_last = drop_last
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.prefetch_factor = prefetch_factor  # None with num_workers=0, as torch's
        self._prefetch: int = prefetch_factor or 1
        self.in_order = in_order
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.persistent_workers = persistent_workers
        self.start_method = start_method
        _progress.check(progress)
        self.progress = progress  # see _progress
        self.generator = generator
        self.seed = seed
        self._init_training(pin_memory, pin_memory_device, worker_crash_retries, on_worker_crash)
        if not self._iterable and sampler is None and batch_sampler is None:
            len(dataset)  # a TypeError now for a dataset without a length
            sampler = _RandomSampler(dataset, self) if shuffle else _SequentialSampler(dataset)
        self.sampler = sampler
        self.batch_sampler = batch_sampler
        self._auto_collation = batch_sampler is not None or batch_size is not None
        self._init_epochs()

    def _init_training(
        self,
        pin_memory: bool,
        pin_memory_device: str,
        worker_crash_retries: int,
        on_worker_crash: Callable[[Any], Any] | None,
    ) -> None:
        """The arguments of docs/loader-training.md: pinning, retries, resuming."""
        if on_worker_crash is not None and not callable(on_worker_crash):
            raise TypeError(
                "on_worker_crash must be a callable taking the WorkerCrashed report, or None"
            )
        self.pin_memory = pin_memory
        self.pin_memory_device = pin_memory_device
        self._pinner = _pin.make_pinner(bool(pin_memory), pin_memory_device)
        self.worker_crash_retries = worker_crash_retries
        self.on_worker_crash = on_worker_crash
        #: the reports (WorkerCrashed) of the workers that died and whose batches were retried
        self.crash_reports: list[Any] = []
        dataset = self.dataset
        self._stateful = (
            self._iterable
            and callable(getattr(dataset, "state_dict", None))
            and callable(getattr(dataset, "load_state_dict", None))
        )

    def _init_epochs(self) -> None:
        """Where the epochs stand: none yet, nothing to resume."""
        self._workers: _Workers | None = None
        self._epochs: weakref.WeakSet[_Epoch] = weakref.WeakSet()  # every epoch not collected
        # a weak reference: an epoch abandoned by the caller (a ``break``) is collected and
        # stops its workers
        self._current_ref: Callable[[], _Epoch | _LocalEpoch | None] = lambda: None
        self._epoch = 0
        self._seed_n = 0  # seeds drawn from ``seed``
        # NOTE [ Resuming an epoch ]: what load_state_dict() put here, for the next iter()
        self._resume: dict[str, Any] | None = None
        self._loaded: dict[str, Any] | None = None
        self._persistent_seed: int | None = None
        self._shuffle_forced: int | None = None  # the next shuffle's seed, when resuming
        self._last_shuffle: int | None = None  # the seed the last shuffle drew

    # -- seeds --

    def _next_seed(self) -> int:
        """A 63-bit seed: the next of the ``seed`` sequence, or drawn from ``generator``."""
        if self.seed is None:
            return _draw_seed(self.generator)
        n = self._seed_n
        self._seed_n += 1
        return int.from_bytes(
            random.Random(f"{self.seed}/{n}").getrandbits(63).to_bytes(8, "little"), "little"
        )

    def _shuffle_seed(self) -> int:
        """The seed of a shuffled epoch's permutation (the resumed epoch's, once)."""
        seed = self._shuffle_forced
        if seed is None:
            seed = self._next_seed()
        self._shuffle_forced = None
        self._last_shuffle = seed
        return seed

    # -- the epoch --

    @property
    def window(self) -> int:
        """Batches in flight or waiting at most: ``prefetch_factor * num_workers`` (for
        batches that are not small arrays loaded fast, see docs/loader.md)."""
        return self._prefetch * max(self.num_workers, 1)

    def _requests(self) -> Iterator[Any]:
        if self._iterable:
            return itertools.repeat(None)
        # the sampler starts now (a shuffle draws its permutation's seed now)
        if self.batch_sampler is not None:
            return (list(b) for b in iter(self.batch_sampler))
        assert self.sampler is not None
        if self.batch_size is None:
            return iter(self.sampler)
        return _batches(iter(self.sampler), self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[BatchT]:
        if self.progress is None or self.progress is False:
            return self._epoch_iter()
        try:
            total: int | None = len(self)
        except TypeError:
            total = None
        return _progress.track(self._epoch_iter(), self.progress, total, "DataLoader", "batch")

    def _epoch_iter(self) -> Iterator[BatchT]:
        current = self._current_ref()
        if current is not None and self.persistent_workers:
            # One set of workers serves one epoch at a time: the new one takes them over.
            current._abandon(
                "its DataLoader started another epoch (iter() again), and with "
                "persistent_workers=True its workers serve one epoch at a time; finish or drop "
                "an epoch before starting the next, or use persistent_workers=False, where each "
                "iterator has workers of its own"
            )
        self._epoch += 1
        if self.num_workers:
            refuse_during_main_import("a DataLoader's workers")
        # See NOTE [ Resuming an epoch ]
        resume, self._resume, self._loaded = self._resume, None, None
        sampled = self.batch_sampler if self.batch_sampler is not None else self.sampler
        if resume is not None:
            _resume.set_sampler_state(sampled, resume["sampler"])
            self._shuffle_forced = resume["shuffle_seed"]
            sampler_state = resume["sampler"]
        else:
            sampler_state = None if self._iterable else _resume.sampler_state(sampled)
        if self.num_workers == 0:
            fetcher = _Fetcher(
                self.dataset,
                self._iterable,
                self.batch_size if self._auto_collation else None,
                self.collate_fn,
                self.drop_last,
                self._auto_collation,
            )
            info = self._epoch_info(None, sampler_state)
            local = _LocalEpoch(self, fetcher, info, resume)
            self._current_ref = weakref.ref(local)
            return local
        workers = self._workers_for(resume)
        epoch = _Epoch(self, workers, self._epoch_info(workers.base_seed, sampler_state), resume)
        self._current_ref = weakref.ref(epoch)
        self._epochs.add(epoch)
        return epoch

    def _workers_for(self, resume: dict[str, Any] | None) -> _Workers:
        """The workers of a new epoch: the persistent ones (reset, or started again where a
        resumed epoch needs its own seeds), or new ones."""
        wresume = None if resume is None or not self._iterable else _worker_resume(resume)
        if self.persistent_workers:
            workers = self._workers
            if resume is not None and workers is not None:
                workers.close()  # a resumed epoch needs its own seeds and positions
            if (
                resume is not None
                or workers is None
                or workers.closed
                or workers.broken is not None
            ):
                seed = self._persistent_seed
                if resume is not None:
                    seed = resume["base_seed"]
                workers = self._workers = _Workers(
                    self, self._next_seed() if seed is None else seed, wresume
                )
                self._persistent_seed = None
            else:
                workers.reset(self.timeout or None)
        else:
            seed = self._next_seed() if resume is None else resume["base_seed"]
            workers = _Workers(self, seed, wresume)
        return workers

    def _epoch_info(self, base_seed: int | None, sampler_state: Any) -> dict[str, Any]:
        """What an epoch's state keeps of its start; starts the sampler."""
        self._last_shuffle = None
        requests = self._requests()
        shuffle_seed, self._last_shuffle, self._shuffle_forced = self._last_shuffle, None, None
        return {
            "base_seed": base_seed,
            "shuffle_seed": shuffle_seed,
            "sampler": sampler_state,
            "requests": requests,
        }

    # -- resuming --

    def state_dict(self) -> dict[str, Any]:
        """Where this loader is: a plain picklable dict that :meth:`load_state_dict` takes to
        go on from here, in this process or another (docs/loader-training.md lists what it
        holds). Taken between two batches of an epoch, a loader restored from it yields the
        rest of that epoch: the batches after the last one taken, in the same order, with the
        same permutation and worker seeds; batches prefetched and not yet taken are loaded
        again, not lost. It reads only what this process knows (the workers are never asked),
        in microseconds."""
        if self._loaded is not None:
            return dict(self._loaded)  # loaded and not started yet: the same state
        epoch = self._current_ref()
        workers = self._workers
        return {
            "version": _resume.VERSION,
            "kind": "iterable" if self._iterable else "map",
            "num_workers": self.num_workers,
            "epochs": self._epoch,
            "seed_counter": self._seed_n,
            "generator": _resume.generator_state(self.generator),
            "persistent_base_seed": (
                workers.base_seed if workers is not None and not workers.closed else None
            ),
            "epoch": None if epoch is None or epoch._complete else epoch._state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (what :meth:`state_dict` returned): the next ``iter()``
        resumes the epoch that was in progress (or, in a state taken between epochs, starts
        the next one, with the seeds it would have had). An epoch of this loader still being
        iterated is stopped (its next ``next()`` raises RuntimeError), and persistent workers
        start again."""
        state = _resume.check(state, "iterable" if self._iterable else "map", self.num_workers)
        for epoch in list(self._epochs):
            epoch._abandon("load_state_dict() was called on its DataLoader")
        if self._workers is not None:
            self._workers.close()
            self._workers = None
        self._current_ref = lambda: None
        self._seed_n = int(state["seed_counter"])
        _resume.set_generator_state(self.generator, state["generator"])
        self._persistent_seed = state["persistent_base_seed"]
        self._resume = state["epoch"]
        self._epoch = int(state["epochs"]) - (state["epoch"] is not None)
        self._loaded = state

    def __len__(self) -> int:
        if self._iterable:
            n = len(self.dataset)
            if self.batch_size is None:
                return n
            return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)
        if self.batch_sampler is not None:
            return len(self.batch_sampler)  # type: ignore[arg-type]
        n = len(self.sampler)  # type: ignore[arg-type]
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)

    def worker_pids(self) -> list[int]:
        """The pids of the workers running now (persistent or of the current epoch)."""
        current = self._current_ref()
        own = current.workers if isinstance(current, _Epoch) else None
        for workers in (self._workers, own):
            if workers is not None and not workers.closed:
                return workers.pids()
        return []

    def close(self) -> None:
        """Stop the workers now (they start again at the next ``iter()``); an iterator of an
        epoch that was not over raises RuntimeError at its next ``next()``."""
        for epoch in list(self._epochs):
            epoch._abandon("its DataLoader was closed")
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
