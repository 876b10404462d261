"""Pickled NumPy arrays of 16 MiB through ``send``/``recv`` (framepipe sends the array's
buffer out of band with pickle protocol 5; the stdlib pickles it in band)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

np = pytest.importorskip("numpy")

SIZE = 16 * 1024 * 1024


def _array() -> Any:
    return np.arange(SIZE // 8, dtype=np.float64)


@pytest.mark.benchmark(group="numpy-16MiB")
def test_numpy_16MiB(benchmark: Any, stream: Callable[..., Any]) -> None:
    reader = stream(_array, "send")
    benchmark.extra_info["bytes_per_round"] = SIZE
    got = benchmark(reader.recv)
    assert got.nbytes == SIZE and got[-1] == SIZE // 8 - 1
