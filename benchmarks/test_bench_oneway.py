"""One-way 1 MiB messages: receive from a child that sends as fast as it can."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

SIZE = 1024 * 1024


@pytest.mark.benchmark(group="oneway-1MiB")
def test_oneway_1MiB(benchmark: Any, stream: Callable[..., Any]) -> None:
    reader = stream(lambda: b"\xa5" * SIZE, "send_bytes")
    benchmark.extra_info["bytes_per_round"] = SIZE
    assert len(benchmark(reader.recv_bytes)) == SIZE
