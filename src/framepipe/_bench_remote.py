"""Benchmark of the exception layer: one round trip is dumps_exception then loads_exception."""

from __future__ import annotations

import time
from collections.abc import Callable

from .remote import dumps_exception, loads_exception


def _raise_plain() -> None:
    raise ValueError("bad value")


def _raise_chain() -> None:
    try:
        try:
            raise KeyError("missing")
        except KeyError as exc:
            raise ValueError("bad value") from exc
    except ValueError:
        raise RuntimeError("while handling")  # the ValueError is its context


def _caught(raiser: Callable[[], None]) -> BaseException:
    try:
        raiser()
    except BaseException as exc:
        return exc
    raise AssertionError("the raiser returned")


def bench_exceptions(iterations: int = 2000) -> list[dict[str, object]]:
    """Microseconds per serialize-and-revive round trip, for a plain ``ValueError`` and for a
    three-deep chain (cause and context), each timed with ``time.perf_counter`` over
    ``iterations`` round trips after a short warm-up."""
    rows: list[dict[str, object]] = []
    for case, raiser in (("ValueError", _raise_plain), ("chain of 3", _raise_chain)):
        exc = _caught(raiser)
        for _ in range(min(50, iterations)):
            loads_exception(dumps_exception(exc))
        start = time.perf_counter()
        for _ in range(iterations):
            loads_exception(dumps_exception(exc))
        elapsed = time.perf_counter() - start
        rows.append({"case": case, "us_per_roundtrip": elapsed / iterations * 1e6})
    return rows
