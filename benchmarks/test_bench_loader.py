"""The DataLoader against a bare framepipe transport and torch's DataLoader: the time to take
one item (float32 arrays of 4 KiB, 1 MiB, 16 MiB; 2 workers, in order) from a running loader.

Every round is ``next(items)`` plus a touch of one element, so the mean is the inverse of the
loader's items/s once it runs; groups compare the loaders side by side. torch's row is skipped
when torch is not installed (``pip install 'framepipe[bench]'``). ``multiprocessing.Pool.imap`` is
left to ``python -m framepipe bench loader``: it has no back pressure, so an open-ended run
would grow without bound.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

pytest.importorskip("numpy")

from framepipe.bench import loader as B  # noqa: E402

SOURCES = {
    "framepipe-DataLoader": B.framepipe_items,
    "bare-transport": B.bare_items,
    "torch-DataLoader": B.torch_items,
}


@pytest.fixture(params=list(SOURCES))
def loader_name(request: pytest.FixtureRequest) -> str:
    if request.param.startswith("torch"):
        pytest.importorskip("torch", reason=B.TORCH_HINT)
    return str(request.param)


def _take(items: Iterator[Any]) -> float:
    return float(next(items).reshape(-1)[0])


def _bench(benchmark: Any, name: str, size: int, batch: int | None = None) -> None:
    with SOURCES[name](size, batch, 60.0) as items:
        _take(items)  # the workers are up
        benchmark.extra_info["bytes_per_round"] = size * (batch or 1)
        benchmark.extra_info["items_per_round"] = batch or 1
        benchmark(_take, items)


@pytest.mark.benchmark(group="loader-4KiB")
def test_loader_4KiB(benchmark: Any, loader_name: str) -> None:
    _bench(benchmark, loader_name, 4 * B.KiB)


@pytest.mark.benchmark(group="loader-1MiB")
def test_loader_1MiB(benchmark: Any, loader_name: str) -> None:
    _bench(benchmark, loader_name, B.MiB)


@pytest.mark.benchmark(group="loader-16MiB")
def test_loader_16MiB(benchmark: Any, loader_name: str) -> None:
    _bench(benchmark, loader_name, 16 * B.MiB)


@pytest.mark.benchmark(group="loader-4KiB-batch32")
def test_loader_4KiB_batch32(benchmark: Any, loader_name: str) -> None:
    _bench(benchmark, loader_name, 4 * B.KiB, 32)
