"""Reads that never hang: what a deadline and a watched writer cost, how late a 10 ms timeout
returns, and how soon a killed writer is noticed.

framepipe reads with ``recv_bytes(timeout=...)`` (and ``watch(process)``); the stdlib waits with
``multiprocessing.connection.wait([conn] (+ [process.sentinel]), timeout)`` and then reads.
"""

from __future__ import annotations

import functools
import multiprocessing
import os
import signal
import time
from collections.abc import Callable
from multiprocessing.connection import wait as mp_wait
from typing import Any

import pytest

from framepipe import WriterDied
from framepipe.bench.detection import hold
from framepipe.bench.peers import Impl

SIZE = 64
BATCH = 1000  # reads per round: a single 1 us read would be mostly timer overhead
TIMEOUT = 5.0  # long enough never to expire while the writer streams
SHORT = 0.010


def _stdlib_timed_read(reader: Any, extra: list[Any]) -> Callable[[], bytes]:
    objects = [reader, *extra]

    def read() -> bytes:
        if reader not in mp_wait(objects, TIMEOUT):
            raise TimeoutError("no message, or the writer died")
        return reader.recv_bytes()  # type: ignore[no-any-return]

    return read


@pytest.mark.benchmark(group="read-64B-x1000")
@pytest.mark.parametrize("mode", ["plain", "timed", "watched+timed"])
def test_read_64B(
    benchmark: Any, stream_from: Callable[..., Any], impl: Impl, mode: str
) -> None:
    reader, process = stream_from(lambda: b"\x5a" * SIZE, "send_bytes")
    benchmark.extra_info["bytes_per_round"] = SIZE * BATCH
    benchmark.extra_info["messages_per_round"] = BATCH
    if mode == "plain":
        read = reader.recv_bytes
    elif impl.is_framepipe:
        if mode == "watched+timed":
            reader.watch(process)
        read = functools.partial(reader.recv_bytes, timeout=TIMEOUT)  # no extra Python frame

    else:
        read = _stdlib_timed_read(reader, [process.sentinel] if "watched" in mode else [])

    def batch() -> int:
        return sum(len(read()) for _ in range(BATCH))

    assert benchmark(batch) == SIZE * BATCH


@pytest.mark.benchmark(group="timeout-10ms")
def test_timeout_10ms(benchmark: Any, impl: Impl) -> None:
    """A 10 ms read timeout on a silent pipe: the time above 10 ms is the overshoot."""
    reader, writer = impl.oneway()
    try:
        if impl.is_framepipe:

            def wait() -> None:
                try:
                    reader.recv_bytes(timeout=SHORT)
                except TimeoutError:
                    return
                raise AssertionError("a message arrived on a silent pipe")

        else:

            def wait() -> None:
                assert not reader.poll(SHORT)

        benchmark.pedantic(wait, rounds=100, iterations=1, warmup_rounds=5)
    finally:
        reader.close()
        writer.close()


def _start_small_child(impl: Impl) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """A fresh spawned interpreter holding the only write end of a new pipe."""
    reader, writer = impl.oneway()
    proc = multiprocessing.get_context("spawn").Process(target=hold, args=(writer,))
    proc.start()
    writer.close()
    if impl.is_framepipe:
        reader.watch(proc)
    time.sleep(0.01)  # the child is up and idle
    return (reader, proc), {}


@pytest.mark.benchmark(group="death-seen")
def test_sigkill_to_notice(benchmark: Any, impl: Impl) -> None:
    """SIGKILL to the reader knowing: framepipe's watched ``recv_bytes`` raising WriterDied,
    the stdlib's ``wait([conn, process.sentinel])`` returning."""
    seen: list[tuple[Any, Any]] = []

    def kill_and_notice(reader: Any, proc: Any) -> None:
        seen.append((reader, proc))
        os.kill(proc.pid, signal.SIGKILL)
        if impl.is_framepipe:
            try:
                reader.recv_bytes(timeout=30)
            except WriterDied:
                return
            raise AssertionError("the read ended without WriterDied")
        assert mp_wait([reader, proc.sentinel], 30), "the death was not seen"

    try:
        benchmark.pedantic(
            kill_and_notice, setup=lambda: _start_small_child(impl), rounds=15, iterations=1
        )
    finally:
        for reader, proc in seen:
            proc.join(30)
            reader.close()
