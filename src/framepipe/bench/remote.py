"""The exception layer's rows: one round trip is ``dumps_exception`` then ``loads_exception``."""

from __future__ import annotations

import time
from collections.abc import Callable

from ..remote import dumps_exception, loads_exception
from .rows import Row, row
from .runner import Context, Section

__all__ = ["SECTION", "bench_exceptions"]


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
    except BaseException as exc:  # noqa: BLE001 - the exception is the point
        return exc
    raise AssertionError("the raiser returned")


def bench_exceptions(ctx: Context) -> list[Row]:
    """Microseconds per serialize-and-revive round trip, for a plain ``ValueError`` and for a
    three-deep chain (cause and context), each timed over about ``ctx.depth.seconds`` after a
    short warm-up."""
    rows: list[Row] = []
    for case, raiser in (("ValueError", _raise_plain), ("chain of 3", _raise_chain)):
        exc = _caught(raiser)
        for _ in range(20):
            loads_exception(dumps_exception(exc))
        iterations, start = 0, time.perf_counter()
        while True:
            for _ in range(50):
                loads_exception(dumps_exception(exc))
            iterations += 50
            elapsed = time.perf_counter() - start
            if elapsed >= ctx.depth.seconds * ctx.depth.repeat:
                break
        value = elapsed / iterations * 1e6
        rows.append(
            row(
                "exceptions",
                "exceptions",
                case,
                value,
                "us/rt",
                family="other",
                better="lower",
                n=iterations,
            )
        )
        ctx.progress(case)
    return rows


SECTION = Section(
    "exceptions",
    "exceptions",
    "us per dumps_exception() + loads_exception() round trip, traceback included; lower is better",
    bench_exceptions,
)
