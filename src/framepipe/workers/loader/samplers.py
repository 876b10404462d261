"""The samplers a loader makes itself, cutting indices into batches, and drawing seeds."""

from __future__ import annotations

import itertools
import random
import weakref
from collections.abc import Iterable, Iterator
from typing import Any


def _batches(sampler: Iterable[Any], batch_size: int, drop_last: bool) -> Iterator[list[Any]]:
    """The sampler's indices in lists of ``batch_size`` (the last one shorter, unless
    ``drop_last``), cut by ``islice``: no Python step per index."""
    it = iter(sampler)
    while True:
        batch = list(itertools.islice(it, batch_size))
        if len(batch) < batch_size and (drop_last or not batch):
            return
        yield batch


class _SequentialSampler:
    """The indices of ``dataset`` in order; its length read at each epoch and each ``len()``
    (a dataset that grows is seen, as under torch)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.dataset)))

    def __len__(self) -> int:
        return len(self.dataset)


class _RandomSampler:
    """A new permutation each epoch, drawn from the loader's seed source."""

    def __init__(self, dataset: Any, loader: Any) -> None:
        self.dataset = dataset
        self.loader = weakref.ref(loader)  # the loader holds this sampler

    def __iter__(self) -> Iterator[int]:
        loader = self.loader()
        seed = loader._shuffle_seed() if loader is not None else random.getrandbits(63)
        n = len(self.dataset)
        try:
            import numpy as np
        except ImportError:
            order = list(range(n))
            random.Random(seed).shuffle(order)
            return iter(order)
        return iter(np.random.default_rng(seed).permutation(n).tolist())

    def __len__(self) -> int:
        return len(self.dataset)


def _draw_seed(generator: Any) -> int:
    """A 63-bit base seed from ``generator`` (a torch or NumPy Generator, a random.Random,
    or None for the ``random`` module)."""
    if generator is None:
        return random.getrandbits(63)
    if hasattr(generator, "getrandbits"):
        return int(generator.getrandbits(63))
    if hasattr(generator, "integers"):
        return int(generator.integers(0, 1 << 63))
    import torch

    return int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
