"""Fixtures for the pytest-benchmark suites.

Run them with ``python -m pytest benchmarks --benchmark-only -n 0`` (group tables compare the
implementations side by side; add ``--benchmark-group-by=group`` or ``--benchmark-columns``
as usual). Every test is parametrized over ``impl``: framepipe's compiled core (``c``, skipped
when it is not built unless ``FRAMEPIPE_REQUIRE_EXTENSIONS=1``), its pure-Python twin (``py``)
and ``multiprocessing.connection`` over a socketpair (``stdlib-duplex``) and over
``os.pipe()`` (``stdlib-simplex``). The writer always runs in a forked child, managed by
:class:`framepipe.bench.runner.Child`, which kills it if it outlives its time limit.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

try:
    import framepipe  # noqa: F401
except ImportError:  # a source checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from framepipe.bench.peers import Impl, framepipe_impl, stdlib_impls
from framepipe.bench.runner import Child

IMPLS = ["c", "py", "stdlib-duplex", "stdlib-simplex"]
_CORES = {"c": "c", "py": "python"}
STREAM_LIMIT = 300.0  # a writer stops by itself, and is killed, after this many seconds


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    """``--benchmark-only`` overrides the test suite's ``--benchmark-disable`` (addopts), which
    keeps benchmarks out of a plain ``pytest`` run."""
    if config.getoption("benchmark_only", default=False):
        config.option.benchmark_enable = True


@pytest.fixture(scope="session", params=IMPLS)
def impl(request: pytest.FixtureRequest) -> Impl:
    """One implementation under test (see the module docstring for the ids)."""
    name: str = request.param
    if name in _CORES:
        try:
            return framepipe_impl(_CORES[name])
        except ImportError as exc:
            if name == "c" and os.environ.get("FRAMEPIPE_REQUIRE_EXTENSIONS"):
                pytest.fail(
                    f"FRAMEPIPE_REQUIRE_EXTENSIONS=1 but the compiled core is missing: {exc}"
                )
            pytest.skip(f"framepipe {_CORES[name]!r} core not available: {exc}")
    return {i.name.replace(" ", "-"): i for i in stdlib_impls()}[name]


def _serve_echo(end: Any) -> None:
    send, recv = end.send_bytes, end.recv_bytes
    while True:
        send(recv())  # ends with EOFError when the reader closes its end


def _stream(make: Callable[[], Any], method: str) -> Callable[[Any], None]:
    def write(end: Any) -> None:
        payload = make()
        send = getattr(end, method)
        deadline = time.monotonic() + STREAM_LIMIT
        while time.monotonic() < deadline:
            send(payload)  # ends with BrokenPipeError when the reader closes its end

    return write


@pytest.fixture
def echo(impl: Impl) -> Iterator[Any]:
    """This process's end of a duplex connection whose other end echoes every message."""
    parent, child = impl.duplex()
    with Child(
        _serve_echo,
        (child,),
        drop_in_child=[parent],
        drop_in_parent=[child],
        close_on_exit=[parent],
        timeout=STREAM_LIMIT + 30,
    ):
        yield parent


@pytest.fixture
def stream_from(impl: Impl) -> Iterator[Callable[[Callable[[], Any], str], Any]]:
    """``stream_from(make_payload, "send_bytes" | "send")`` starts a child that sends
    ``make_payload()`` over and over; returns ``(reading end, the child's Process)``. Torn
    down after the test."""
    peers: list[Child] = []

    def start(make: Callable[[], Any], method: str) -> tuple[Any, Any]:
        reader, writer = impl.oneway()
        peer = Child(
            _stream(make, method),
            (writer,),
            drop_in_child=[reader],
            drop_in_parent=[writer],
            close_on_exit=[reader],
            timeout=STREAM_LIMIT + 30,
        )
        peer.__enter__()
        peers.append(peer)
        return reader, peer.process

    yield start
    for peer in peers:
        peer.__exit__(None, None, None)


@pytest.fixture
def stream(stream_from: Callable[..., Any]) -> Callable[[Callable[[], Any], str], Any]:
    """``stream(make_payload, "send_bytes" | "send")``: the reading end of
    :func:`stream_from`."""
    return lambda make, method: stream_from(make, method)[0]
