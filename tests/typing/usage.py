"""framepipe's public API used the way the docs use it, for ``mypy --strict`` (CI runs it).

It is also a program: ``python tests/typing/usage.py`` runs every part for real and prints
``usage: ok``. ``assert_type`` pins the types the API promises: a public name whose type
becomes ``Any`` or changes fails CI, connections included. What must not pass is in
``misuse/`` (tests/test_typing.py checks both).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING

import framepipe
from framepipe import connection
from framepipe.workers import DataLoader, Pool, TaskTimeout, Worker, WorkerCrashed

if TYPE_CHECKING:
    from typing import assert_type
else:

    def assert_type(value: object, _type: object) -> object:
        return value


# --- functions run in worker processes (top level, so spawn can import them) -------------------


def square(x: int) -> int:
    return x * x


def add(x: int, y: int) -> int:
    return x + y


def label(x: int, *, prefix: str = "#") -> str:
    return f"{prefix}{x}"


def pairs(items: list[int]) -> tuple[int, ...]:
    return tuple(items)


def count(n: int) -> Iterator[int]:
    yield from range(n)


def fail_in_guard(conn: connection.Connection) -> None:
    with framepipe.guard(conn, label="usage"):
        conn.send({"batch": [0, 1, 2, 3]})
        raise KeyError("missing\nkey")


class Squares:
    """A map-style dataset."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        return index * index


# --- the core: Pipe, Connection, timeouts, watch -----------------------------------------------


def pipe_round_trip() -> bytes:
    a, b = assert_type(connection.Pipe(), tuple[connection.Connection, connection.Connection])
    with a, b:
        a.send_bytes(b"hello")
        data = assert_type(b.recv_bytes(timeout=5.0), bytes)
        a.send({"n": 1})
        obj: object = b.recv(timeout=5.0)
        assert obj == {"n": 1}
        ready = assert_type(b.poll(0.0), bool)
        assert not ready
        a.send_bytes(memoryview(b"--view--"), 2, 4)
        assert b.recv_bytes(timeout=5.0) == b"view"
        try:
            b.recv_bytes(timeout=0.01)
        except framepipe.ReadTimeout as exc:
            assert isinstance(exc, TimeoutError)
        buf = bytearray(16)
        a.send_bytes(b"into")
        size = assert_type(b.recv_bytes_into(buf, timeout=5.0), int)
        assert bytes(buf[:size]) == b"into"
        return data


def pipe_one_way(maxlength: int) -> bytes:
    r, w = connection.Pipe(duplex=False)
    try:
        w.send_bytes(b"x" * 8)
        data: bytes = r.recv_bytes(maxlength)
        return data
    finally:
        r.close()
        w.close()


def ready_connections(conns: list[connection.Connection]) -> list[connection.Connection]:
    return assert_type(connection.wait(conns, timeout=0.0), list[connection.Connection])


def listener_and_client() -> bytes:
    with connection.Listener(authkey=b"usage") as listener:
        server_side: list[connection.Connection] = []
        accepting = threading.Thread(target=lambda: server_side.append(listener.accept()))
        accepting.start()
        client = assert_type(
            connection.Client(listener.address, authkey=b"usage"), connection.Connection
        )
        accepting.join(30)
        with client, server_side[0] as server:
            client.send_bytes(b"over a socket")
            return server.recv_bytes(timeout=5.0)


def watch_a_worker() -> str:
    print("usage: a worker fails on purpose; its crash report follows", file=sys.stderr)
    parent, child = connection.Pipe()
    p = mp.get_context("spawn").Process(target=fail_in_guard, args=(child,))
    p.start()
    child.close()
    try:
        parent.watch(p)
        assert parent.recv(timeout=30) == {"batch": [0, 1, 2, 3]}
        try:
            parent.recv(timeout=30)
        except KeyError as exc:
            assert "missing" in str(exc)
        try:
            parent.recv(timeout=30)
        except framepipe.WriterDied as died:
            return str(died)
        raise AssertionError("the worker's death was not reported")
    finally:
        parent.close()
        p.join(30)


def implementation() -> str:
    return assert_type(framepipe.implementation, str)


# --- exceptions across processes ---------------------------------------------------------------


def exception_round_trip() -> BaseException:
    data = assert_type(framepipe.dumps_exception(ValueError("bad input")), bytes)
    return assert_type(framepipe.loads_exception(data), BaseException)


def send_an_exception() -> None:
    a, b = connection.Pipe()
    with a, b:
        a.send_exception(KeyError("k"))
        try:
            b.recv(timeout=5.0)
        except KeyError:
            pass


# --- workers -----------------------------------------------------------------------------------


def worker_calls() -> int:
    with Worker(name="usage") as w:
        result = assert_type(w.call(square, 7, timeout=60), int)
        assert assert_type(w.call(label, 2, prefix="n"), str) == "n2"
        assert assert_type(w.call(label, 2, timeout=60, prefix="n"), str) == "n2"
        future = assert_type(w.submit(square, 3), Future[int])
        assert future.result(60) == 9
        assert assert_type(w.submit(label, 4, prefix="k"), Future[str]).result(60) == "k4"
        items = list(w.stream(count, 3, window=2, item_timeout=60))
        assert items == [0, 1, 2]
        rtt = assert_type(w.ping(timeout=30), float)
        assert rtt >= 0
        assert_type(w.pid, int | None)
        return result


def pool_map() -> list[int]:
    with Pool(2) as pool:
        future = assert_type(pool.submit(square, 5), Future[int])
        assert future.result(60) == 25
        sums = assert_type(pool.map(add, [1, 2], [10, 20], timeout=60), Iterator[int])
        assert list(sums) == [11, 22]
        labels = assert_type(pool.imap_unordered(label, [1]), Iterator[str])
        assert list(labels) == ["#1"]
        return list(assert_type(pool.map(square, range(4), timeout=60), Iterator[int]))


def load_batches() -> list[object]:
    loader = DataLoader(Squares(), batch_size=4, num_workers=2)
    typed = DataLoader(Squares(), batch_size=4, num_workers=2, collate_fn=pairs)
    for batch in typed:
        assert len(assert_type(batch, tuple[int, ...])) == 4
    return [batch for batch in loader]


async def worker_async() -> int:
    async with Worker() as w:
        return assert_type(await w.acall(square, 6, timeout=60), int)


def failures_are_typed(exc: BaseException) -> str:
    if isinstance(exc, WorkerCrashed):
        return f"crashed: {exc}"
    if isinstance(exc, TaskTimeout):
        return f"timed out: {exc}"
    return repr(exc)


def main() -> int:
    assert pipe_round_trip() == b"hello"
    assert pipe_one_way(64) == b"x" * 8
    assert implementation() in ("c", "python")
    assert "exited with code 1" in watch_a_worker()
    assert isinstance(exception_round_trip(), ValueError)
    send_an_exception()
    assert worker_calls() == 49
    assert pool_map() == [0, 1, 4, 9]
    assert len(load_batches()) == 2
    assert asyncio.run(worker_async()) == 36
    assert failures_are_typed(ValueError()) == "ValueError()"
    a, b = connection.Pipe()
    with a, b:
        assert ready_connections([a, b]) == []
    assert listener_and_client() == b"over a socket"
    print("usage: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
