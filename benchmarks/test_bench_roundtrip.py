"""64 B round trips: send one message to an echoing child and receive the answer."""

from __future__ import annotations

from typing import Any

import pytest

SIZE = 64


@pytest.mark.benchmark(group="roundtrip-64B")
def test_roundtrip_64B(benchmark: Any, echo: Any) -> None:
    payload = b"\x5a" * SIZE
    send, recv = echo.send_bytes, echo.recv_bytes

    def round_trip() -> bytes:
        send(payload)
        return recv()

    assert benchmark(round_trip) == payload
