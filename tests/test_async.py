"""asyncio reads and writes: deadlines, dead writers, cancellation that loses nothing, large
sends that do not block the loop, and many connections at once.

Real child processes and pipes, both cores. Every await is bounded by ``asyncio.wait_for`` or a
read timeout; no assertion is about elapsed time.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import pickle
import signal
import sys
import threading

import pytest
from _fault_children import (
    MIB,
    WAIT,
    echo,
    kill_and_wait_dead,
    send_then_die,
    small_then_big,
    unread,
    write_in_thread,
)
from _helpers import header, payload, running, write_all

from framepipe import ReadTimeout, WriterDied
from framepipe.watch import dead_status_word

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="Linux processes and signals")

SHORT = 0.3


def run(coro):
    """Run ``coro`` on a fresh event loop, bounded."""
    return asyncio.run(asyncio.wait_for(coro, WAIT))


async def until(predicate, what: str) -> None:
    """Yield to the loop until ``predicate`` holds; fail after WAIT seconds."""
    loop = asyncio.get_running_loop()
    end = loop.time() + WAIT
    while not predicate():
        if loop.time() > end:
            raise AssertionError(f"gave up waiting for {what}")
        await asyncio.sleep(0.005)


def recv_async(conn, how: str, timeout):
    if how == "recv_async":
        return conn.recv_async(timeout=timeout)
    return conn.recv_bytes_async(timeout=timeout)


# -- timeouts ----------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["recv_bytes_async", "recv_async"])
def test_async_read_times_out_then_reads(impl, how):
    async def main():
        r, w = impl.pipe(False)
        try:
            with pytest.raises(ReadTimeout) as info:
                await recv_async(r, how, SHORT)
            assert info.value.sentinel is False
            assert isinstance(info.value, TimeoutError)
            with pytest.raises(ReadTimeout):
                await recv_async(r, how, 0)
            w.send({"x": 1}) if how == "recv_async" else w.send_bytes(b"x")
            assert await recv_async(r, how, WAIT) == ({"x": 1} if how == "recv_async" else b"x")
        finally:
            r.close()
            w.close()

    run(main())


def test_async_deadline_covers_the_whole_frame(impl):
    # Bytes trickle in every 5 ms; the read's deadline is for the whole frame.
    data = payload(2000)
    frame = header(len(data)) + data

    async def main():
        r, w = impl.pipe(False)
        stop = threading.Event()
        written = [0]

        def trickle() -> None:
            while written[0] < 1000 and not stop.wait(0.005):
                os.write(w.fileno(), frame[written[0] : written[0] + 1])
                written[0] += 1
            write_all(w.fileno(), frame[written[0] :])

        thread = threading.Thread(target=trickle, daemon=True)
        thread.start()
        try:
            before = written[0]
            with pytest.raises(ReadTimeout):
                await r.recv_bytes_async(timeout=SHORT)
            assert written[0] > before, "no byte arrived during the read"
        finally:
            stop.set()
            thread.join(WAIT)
        assert await r.recv_bytes_async(timeout=WAIT) == data
        r.close()
        w.close()

    run(main())


def test_async_sentinels(impl):
    async def main():
        r, w = impl.pipe(False)
        try:
            write_all(w.fileno(), b"\x01\x01" + header(2) + b"ok")
            with pytest.raises(ReadTimeout) as info:
                await r.recv_bytes_async(timeout=WAIT)
            assert info.value.sentinel is True
            assert await r.recv_bytes_async(timeout=WAIT) == b"ok"
            write_all(
                w.fileno(),
                b"\x02\x02" + dead_status_word(-signal.SIGKILL).to_bytes(8, sys.byteorder),
            )
            with pytest.raises(WriterDied) as died:
                await r.recv_async(timeout=WAIT)
            assert died.value.exitcode == -signal.SIGKILL
        finally:
            r.close()
            w.close()

    run(main())


# -- dead writers ------------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["fork", "forkserver"])
@pytest.mark.parametrize("hold", [False, True], ids=["closed", "parent-holds-writer"])
@pytest.mark.parametrize("how", ["recv_bytes_async", "recv_async"])
def test_async_writer_death(impl, method, hold, how):
    async def main():
        r, w = impl.pipe(False)
        with running(method, send_then_die, w, [], ("exit", 0)) as proc:
            if not hold:
                w.close()
            r.watch(proc)
            with pytest.raises(WriterDied) as info:
                await asyncio.wait_for(recv_async(r, how, None), WAIT)  # no read deadline
            assert type(info.value) is WriterDied
            assert info.value.exitcode == 0
            assert info.value.pid == proc.pid
            proc.join(WAIT)
        r.close()
        w.close()

    run(main())


def test_async_sigkill_mid_frame(impl):
    async def main():
        r, w = impl.pipe(False)
        with running("fork", small_then_big, w, 2, 32 * MIB) as proc:
            w.close()
            r.watch(proc)
            for i in range(2):
                assert await r.recv_bytes_async(timeout=WAIT) == payload(10 + i, i)
            assert r.poll(WAIT)
            kill_and_wait_dead(proc.pid)  # else the frame may still arrive whole
            with pytest.raises(WriterDied) as info:
                await r.recv_bytes_async(timeout=WAIT)
            assert info.value.exitcode == -signal.SIGKILL
            assert info.value.signal_name == "SIGKILL"
            assert info.value.expected_bytes == 32 * MIB + 12
            assert 0 < info.value.lost_bytes < info.value.expected_bytes
            proc.join(WAIT)
        r.close()

    run(main())


def test_async_read_survives_other_tasks_while_the_writer_dies(impl):
    # One task waits on a writer that will die while other tasks keep the loop busy.
    async def main():
        r, w = impl.pipe(False)
        with running("fork", send_then_die, w, [3], ("signal", signal.SIGTERM)) as proc:
            w.close()
            r.watch(proc)

            async def busy():
                for _ in range(50):
                    await asyncio.sleep(0)

            async def reader():
                got = await r.recv_bytes_async(timeout=WAIT)
                with pytest.raises(WriterDied) as info:
                    await r.recv_bytes_async(timeout=WAIT)
                return got, info.value.exitcode

            results = await asyncio.gather(reader(), busy(), busy())
            assert results[0] == (payload(3), -signal.SIGTERM)
            proc.join(WAIT)
        r.close()

    run(main())


# -- cancellation ------------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["recv_bytes_async", "recv_async"])
@pytest.mark.parametrize("size", [100, 400_000])
@pytest.mark.parametrize("cancel", ["cancel", "wait_for"])
def test_cancelled_read_leaves_the_stream_consistent(impl, how, size, cancel):
    obj = ["cancel me", payload(size)]
    body = pickle.dumps(obj, protocol=5) if how == "recv_async" else payload(size)
    frame = header(len(body)) + body
    expected = obj if how == "recv_async" else body
    half = len(frame) // 2

    async def main():
        r, w = impl.pipe(False)
        try:
            writer = write_in_thread(w.fileno(), frame[:half])
            if cancel == "cancel":
                task = asyncio.ensure_future(recv_async(r, how, WAIT))
                # The task takes the first half out of the pipe, then waits for the rest.
                await until(lambda: not writer.is_alive() and unread(w.fileno()) == 0, "drain")
                assert not task.done()  # half a frame: it waits for the rest
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                while True:
                    done = not writer.is_alive()
                    with pytest.raises(asyncio.TimeoutError):
                        await asyncio.wait_for(recv_async(r, how, None), 0.05)
                    if done:
                        break
            assert unread(w.fileno()) == 0
            writer = write_in_thread(w.fileno(), frame[half:] + frame)
            assert await recv_async(r, how, WAIT) == expected
            assert await recv_async(r, how, WAIT) == expected
            writer.join(WAIT)
            with pytest.raises(ReadTimeout):
                await recv_async(r, how, 0.05)
        finally:
            r.close()
            w.close()

    run(main())


# -- sending -----------------------------------------------------------------------------------

OBJECTS = [
    None,
    1,
    "text",
    {"k": [1, 2, 3]},
    b"x" * 100,
    payload(MIB),
    bytearray(payload(70_000)),
    ("tuple", payload(65_536), [payload(10)]),
]


def test_async_send_to_a_child_and_back(impl):
    async def main():
        parent, child = impl.pipe(True)
        with running("fork", echo, child) as proc:
            child.close()
            parent.watch(proc)
            big = payload(MIB, 1)
            await parent.send_bytes_async(big)
            assert await parent.recv_bytes_async(timeout=WAIT) == big
            await parent.send_bytes_async(big, 1000, 5000)
            assert await parent.recv_bytes_async(timeout=WAIT) == big[1000:6000]
            await parent.send_bytes_async(memoryview(big).cast("I"))
            assert await parent.recv_bytes_async(timeout=WAIT) == big
            for obj in OBJECTS:
                await parent.send_async(obj)
                assert await parent.recv_async(timeout=WAIT) == obj
            await parent.send_bytes_async(b"bye")
            with pytest.raises(WriterDied) as info:
                await parent.recv_bytes_async(timeout=WAIT)
            assert info.value.exitcode == 0
            proc.join(WAIT)
        parent.close()

    run(main())


class NoThreads(concurrent.futures.ThreadPoolExecutor):
    """An executor that fails the test if anything is handed to it."""

    def submit(self, fn, /, *args, **kwargs):
        raise AssertionError(f"an async send used a thread: {fn!r}")


@pytest.mark.parametrize("duplex", [False, True], ids=["oneway", "duplex"])
@pytest.mark.parametrize("how", ["send_bytes_async", "send_async"])
def test_async_large_send_does_not_block_the_loop_or_use_a_thread(impl, duplex, how):
    # 8 MiB into a pipe nobody drains yet: the send waits on the loop's writer callback while a
    # reader task on the same loop drains the pipe; no executor thread is involved.
    data = payload(8 * MIB, 2)

    async def main():
        asyncio.get_running_loop().set_default_executor(NoThreads())
        a, b = impl.pipe(duplex)
        r, w = (a, b) if not duplex else (b, a)
        try:
            if how == "send_async":
                reader = asyncio.ensure_future(r.recv_async(timeout=WAIT))
                await w.send_async(("big", data))
                assert await reader == ("big", data)
            else:
                reader = asyncio.ensure_future(r.recv_bytes_async(timeout=WAIT))
                await w.send_bytes_async(data)
                assert await reader == data
        finally:
            r.close()
            w.close()

    run(main())


def plain_pipe(impl):
    """A one-way pair over one os.pipe(), without a bulk channel."""
    rfd, wfd = os.pipe()
    return impl.Connection(rfd, writable=False), impl.Connection(wfd, readable=False)


@pytest.mark.parametrize("transport", ["plain", "bulk"])
def test_a_cancelled_send_finishes_its_frame_in_the_background(impl, transport):
    data = payload(300_000 if transport == "plain" else 32 * MIB, 3)

    async def main():
        r, w = plain_pipe(impl) if transport == "plain" else impl.pipe(False)
        try:
            sending = asyncio.ensure_future(w.send_bytes_async(data))
            # the frame has started; the rest waits for the writer callback
            await until(lambda: unread(r.fileno()) > 0, "the frame to start")
            assert not sending.done()
            sending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sending
            # The next message queues behind the rest of the cancelled frame, which a reader
            # on the same loop now drains: both arrive whole and in order.
            later = asyncio.ensure_future(w.send_bytes_async(b"after"))
            assert await r.recv_bytes_async(timeout=WAIT) == data
            assert await r.recv_bytes_async(timeout=WAIT) == b"after"
            await later
            with pytest.raises(ReadTimeout):
                await r.recv_bytes_async(timeout=0.05)
        finally:
            r.close()
            w.close()

    run(main())


def test_async_and_thread_senders_never_interleave(impl):
    # A thread sends 300 kB frames with the blocking send_bytes while coroutines send to the
    # same connection; a reader thread checks that every frame arrives whole.
    count, size = 20, 300_000

    async def main():
        r, w = impl.pipe(False)
        got: list[bytes] = []

        def read_all() -> None:
            for _ in range(3 * count):
                got.append(r.recv_bytes(timeout=WAIT))

        reader = threading.Thread(target=read_all)
        reader.start()
        sender = threading.Thread(
            target=lambda: [w.send_bytes(payload(size, 1000 + i)) for i in range(count)]
        )
        sender.start()
        try:

            async def coro(base: int) -> None:
                for i in range(count):
                    await w.send_bytes_async(payload(size + base, base + i))

            await asyncio.gather(coro(0), coro(500))
        finally:
            sender.join(WAIT)
            reader.join(WAIT)
            r.close()
            w.close()
        assert not reader.is_alive() and len(got) == 3 * count
        expected = (
            [payload(size, 1000 + i) for i in range(count)]
            + [payload(size, i) for i in range(count)]
            + [payload(size + 500, 500 + i) for i in range(count)]
        )
        assert sorted(got) == sorted(expected)

    run(main())


def test_a_blocking_send_under_an_open_async_frame_raises_instead_of_hanging(impl):
    data = payload(300_000, 4)

    async def main():
        r, w = plain_pipe(impl)
        try:
            sending = asyncio.ensure_future(w.send_bytes_async(data))
            await until(lambda: unread(r.fileno()) > 0, "the frame to open")
            assert not sending.done()  # 300 kB cannot fit a pipe: it waits for the reader
            with pytest.raises(RuntimeError, match="in the middle of a frame"):
                w.send_bytes(b"would deadlock the loop")
            with pytest.raises(RuntimeError, match="in the middle of a frame"):
                w.send({"would": "deadlock"})
            # Another thread's blocking send just waits for the frame to finish.
            other = threading.Thread(target=w.send_bytes, args=(b"from a thread",))
            other.start()
            assert await r.recv_bytes_async(timeout=WAIT) == data
            await sending
            assert await r.recv_bytes_async(timeout=WAIT) == b"from a thread"
            other.join(WAIT)
            w.send_bytes(b"and now from the loop")  # the frame is closed: no error
            assert await r.recv_bytes_async(timeout=WAIT) == b"and now from the loop"
        finally:
            r.close()
            w.close()

    run(main())


def test_async_send_errors(impl):
    async def main():
        r, w = impl.pipe(False)
        with pytest.raises(OSError, match="read-only"):
            await r.send_bytes_async(b"x")
        r.close()
        with pytest.raises(BrokenPipeError):
            await w.send_bytes_async(b"nobody reads")
        w.close()
        with pytest.raises(OSError, match="handle is closed"):
            await w.send_bytes_async(b"x")
        with pytest.raises(OSError, match="handle is closed"):
            await w.send_async({"x": 1})

    run(main())


# -- many connections at once --------------------------------------------------------------


def test_many_concurrent_tasks_on_different_connections(impl):
    workers = 8
    sizes = [0, 1, 1000, 65_536, 200_000, MIB]

    async def main():
        pairs = [impl.pipe(True) for _ in range(workers)]
        with contextlib.ExitStack() as stack:
            started = [stack.enter_context(running("fork", echo, child)) for _, child in pairs]
            for (parent, child), proc in zip(pairs, started):
                child.close()
                parent.watch(proc)

            async def talk(i, conn):
                for j, n in enumerate(sizes):
                    msg = payload(n, i * 100 + j)
                    await conn.send_bytes_async(msg)
                    assert await conn.recv_bytes_async(timeout=WAIT) == msg
                    await conn.send_async(("obj", i, j))
                    assert await conn.recv_async(timeout=WAIT) == ("obj", i, j)
                return i

            async def idle(conn):
                with pytest.raises(ReadTimeout):
                    await conn.recv_bytes_async(timeout=SHORT)
                return "idle"

            # Plus a few tasks whose reads time out on connections nobody writes to.
            quiet = [impl.pipe(False) for _ in range(3)]
            results = await asyncio.gather(
                *(talk(i, parent) for i, (parent, _) in enumerate(pairs)),
                *(idle(r) for r, _ in quiet),
            )
            assert results == list(range(workers)) + ["idle"] * 3
            for r, w in quiet:
                r.close()
                w.close()
            for parent, _ in pairs:
                await parent.send_bytes_async(b"bye")
            for (parent, _), proc in zip(pairs, started):
                with pytest.raises(WriterDied):
                    await parent.recv_bytes_async(timeout=WAIT)
                proc.join(WAIT)
                assert proc.exitcode == 0
        for parent, child in pairs:
            parent.close()
            child.close()

    run(main())


@pytest.mark.parametrize("duplex", [True, False], ids=["duplex", "oneway"])
def test_close_wakes_what_waits_and_its_fd_leaves_the_loop(impl, duplex):
    """close() wakes the coroutines waiting on a connection with OSError at once, reading or
    writing; the fd number it frees, reused by a new connection, works on the same loop."""

    async def main():
        r, w = impl.pipe(duplex)
        reading = asyncio.ensure_future(r.recv_bytes_async())
        await asyncio.sleep(0.05)  # it waits on the loop's reader callback
        old = r.fileno()
        r.close()
        with pytest.raises(OSError, match="closed"):
            await asyncio.wait_for(reading, WAIT)
        w.close()
        r2, w2 = impl.pipe(duplex)
        with r2, w2:
            assert old in (r2.fileno(), w2.fileno())  # the lowest free numbers come back
            w2.send_bytes(b"hello")
            assert await r2.recv_bytes_async(timeout=WAIT) == b"hello"
            w2.send_bytes(b"again")  # and the other end of the pair, on its number
            assert await r2.recv_bytes_async(timeout=WAIT) == b"again"
        # a writer waiting for room in a full pipe
        r, w = impl.pipe(duplex)
        with r:
            sending = asyncio.ensure_future(w.send_bytes_async(payload(32 * MIB, 1)))
            await until(lambda: unread(r.fileno()) > 0, "the frame to start")
            await asyncio.sleep(0.05)
            w.close()
            with pytest.raises(OSError, match="closed"):
                await asyncio.wait_for(sending, WAIT)

    run(main())


def test_two_coroutines_reading_one_connection_both_get_a_frame(impl):
    async def main():
        r, w = impl.pipe(False)
        with r, w:
            first = asyncio.ensure_future(r.recv_bytes_async(timeout=WAIT))
            second = asyncio.ensure_future(r.recv_bytes_async(timeout=WAIT))
            await asyncio.sleep(0.05)  # both wait for the same fd
            w.send_bytes(b"one")
            w.send_bytes(b"two")
            got = await asyncio.wait_for(asyncio.gather(first, second), WAIT)
            assert sorted(got) == [b"one", b"two"]

    run(main())


@pytest.mark.parametrize("reader", ["thread", "nobody"])
def test_a_frame_cut_by_the_end_of_its_loop(impl, reader, monkeypatch):
    """asyncio.run cancels every task at its end, the background rest of a cancelled send
    included: the rest is written there and then while a reader reads; with no reader within
    FINISH_AT_END the connection closes, and the reader meets an end of file in the frame
    instead of a frame spliced with the next."""
    from framepipe import _aio

    monkeypatch.setattr(_aio, "FINISH_AT_END", 0.5)
    data = payload(32 * MIB, 5)
    r, w = impl.pipe(False)

    go = threading.Event()  # the reader starts as the loop ends

    async def main():
        sending = asyncio.ensure_future(w.send_bytes_async(data))
        await until(lambda: unread(r.fileno()) > 0, "the frame to start")
        sending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sending
        go.set()

    def read():
        go.wait(WAIT)
        return r.recv_bytes(timeout=WAIT)

    with r:
        if reader == "thread":
            with concurrent.futures.ThreadPoolExecutor(1) as pool:
                got = pool.submit(read)
                asyncio.run(main())
                assert got.result(WAIT) == data
            w.send_bytes(b"next")
            assert r.recv_bytes(timeout=WAIT) == b"next"
            w.close()
        else:
            asyncio.run(main())
            assert w.closed
            with pytest.raises(Exception, match="end of file during message"):
                r.recv_bytes(timeout=WAIT)
