"""The core suite's rows: framed pipes against ``multiprocessing.connection`` (and pyzmq).

Every cell forks a writer (multiprocessing's ``fork`` context, so the connections are inherited)
and times the reading side in this process from the first message to the last. The default run
holds the rows that carry the compiled core's targets; ``--full`` adds the others. The death
detection rows are in :mod:`.detection`, the exception rows in :mod:`.remote`.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from typing import Any

from .detection import SECTION as DETECTION
from .peers import Impl
from .remote import SECTION as EXCEPTIONS
from .rows import MiB, Row, row, size_id, size_label
from .runner import Cell, Context, Pair, Reader, Section, Writer, measure

__all__ = ["READ_TIMEOUT", "SECTIONS"]

SMALL = 64
READ_TIMEOUT = 5.0  # the timeout of the "with a read timeout" rows: long enough never to expire


# -- pairs, readers and writers ----------------------------------------------------------------


def _oneway_pair(impl: Impl) -> Pair:
    def pair() -> tuple[Any, Any, list[Any], list[Any]]:
        reader, writer = impl.oneway()
        return reader, writer, [reader], [writer]

    return pair


def _duplex_pair(impl: Impl) -> Pair:
    def pair() -> tuple[Any, Any, list[Any], list[Any]]:
        parent, child = impl.duplex()
        return parent, child, [parent], [child]

    return pair


def _write_bytes(size: int) -> Writer:
    def write(end: Any, n: int) -> None:
        payload = b"\xa5" * size
        send = end.send_bytes
        for _ in range(n):
            send(payload)

    return write


def _check_size(got: int, size: int) -> None:
    if got != size:
        raise RuntimeError(f"received {got} bytes, expected {size}")


def _time_reads(recv: Callable[[], Any], n: int, nbytes: Callable[[Any], int], size: int) -> float:
    """Call ``recv`` ``n`` times; the seconds from the first message to the last (the first
    call waits for the writer to start). The last message must be ``size`` bytes."""
    recv()
    start = time.perf_counter()
    for _ in range(n - 2):
        recv()
    last = recv()
    elapsed = time.perf_counter() - start
    _check_size(nbytes(last), size)
    return elapsed


def _read_bytes(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        return _time_reads(end.recv_bytes, n, len, size)

    return read


def _read_bytes_timeout(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        recv = end.recv_bytes
        timeout = READ_TIMEOUT
        recv(timeout=timeout)
        start = time.perf_counter()
        for _ in range(n - 2):
            recv(timeout=timeout)
        last = recv(timeout=timeout)
        elapsed = time.perf_counter() - start
        _check_size(len(last), size)
        return elapsed

    return read


def _read_poll_then_bytes(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        recv, poll = end.recv_bytes, end.poll
        timeout = READ_TIMEOUT

        def one() -> Any:
            if not poll(timeout):
                raise TimeoutError(f"no message within {timeout:g} s")
            return recv()

        return _time_reads(one, n, len, size)

    return read


def _echo(end: Any, n: int) -> None:
    send, recv = end.send_bytes, end.recv_bytes
    for _ in range(n):
        send(recv())


def _ping(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        send, recv = end.send_bytes, end.recv_bytes
        payload = b"\x5a" * size
        send(payload)
        recv()
        start = time.perf_counter()
        for _ in range(n - 1):
            send(payload)
            last = recv()
        elapsed = time.perf_counter() - start
        _check_size(len(last), size)
        return elapsed

    return read


def _write_array(size: int) -> Writer:
    def write(end: Any, n: int) -> None:
        import numpy

        array = numpy.arange(size // 8, dtype=numpy.float64)
        send = end.send
        for _ in range(n):
            send(array)

    return write


def _read_array(size: int) -> Reader:
    def read(end: Any, n: int) -> float:
        return _time_reads(end.recv, n, lambda array: int(array.nbytes), size)

    return read


def _ref_pipe_pair(module: Any) -> Pair:
    def pair() -> tuple[Any, Any, list[Any], list[Any]]:
        ref = module.Pipe(timeout=READ_TIMEOUT)
        return ref, ref, [], []  # the child closes its read fd itself (see _ref_pipe_write)

    return pair


def _ref_pipe_write(size: int) -> Writer:
    def write(ref: Any, n: int) -> None:
        os.close(ref.read_fd)  # this process only writes; its exit must not wait on a reader
        payload = b"\xa5" * size
        write_one = ref.write
        for _ in range(n):
            write_one(payload)

    return write


def _ref_pipe_read(size: int) -> Reader:
    def read(ref: Any, n: int) -> float:
        return _time_reads(ref.read, n, len, size)

    return read


def _set_writer_pid(ref: Any, pid: int) -> None:
    """Tell the reference-style Pipe who writes, as its users do."""
    ref.set_writer_pid(pid)


# -- sections ------------------------------------------------------------------------------------

SECTIONS: list[Section] = []
"""The core suite, in the order of the table."""


def _add(
    name: str,
    title: str,
    about: str,
    *,
    target: str = "",
    default: bool = False,
    needs: tuple[str, ...] = (),
) -> Callable[[Callable[[Context], list[Row]]], Callable[[Context], list[Row]]]:
    def register(fn: Callable[[Context], list[Row]]) -> Callable[[Context], list[Row]]:
        SECTIONS.append(Section(name, title, about, fn, target, default, needs))
        return fn

    return register


def _pingpong(ctx: Context, name: str, title: str) -> list[Row]:
    cells = [Cell(i.name, i.family, _duplex_pair(i), _ping(SMALL), _echo) for i in ctx.impls]
    return measure(
        ctx, name, title, cells, size=SMALL, latency=True, target="<= 0.6x", basis="duplex"
    )


_PINGPONG = "us per round trip: send 64 B, the child echoes it back; lower is better"
_PINGPONG_TARGET = "c <= 0.6x the latency of the stdlib's Pipe() (a socketpair); ratio vs Pipe()"


@_add(
    f"pingpong-{size_id(SMALL)}",
    f"ping-pong {size_label(SMALL)}",
    _PINGPONG + "; CPUs left to the scheduler",
    target=_PINGPONG_TARGET,
    default=True,
)
def _pingpong_free(ctx: Context) -> list[Row]:
    return _pingpong(ctx, f"pingpong-{size_id(SMALL)}", f"ping-pong {size_label(SMALL)}")


@_add(
    f"pingpong-{size_id(SMALL)}-1cpu",
    f"ping-pong {size_label(SMALL)}, one CPU",
    _PINGPONG + "; both pinned to one CPU (no cross-CPU wake-up: the libraries' own cost)",
    target=_PINGPONG_TARGET,
    default=True,
)
def _pingpong_one_cpu(ctx: Context) -> list[Row]:
    if not hasattr(os, "sched_setaffinity"):
        ctx.note("one-CPU ping-pong skipped: no sched_setaffinity on this system")
        return []
    saved, ctx.placement = ctx.placement, "same"
    try:
        return _pingpong(
            ctx, f"pingpong-{size_id(SMALL)}-1cpu", f"ping-pong {size_label(SMALL)}, one CPU"
        )
    finally:
        ctx.placement = saved


_ONEWAY_TARGETS = {SMALL: ">= 2.5x", MiB: ">= 1.6x", 16 * MiB: ">= 1.6x"}


def _oneway(size: int) -> Callable[[Context], list[Row]]:
    def run(ctx: Context) -> list[Row]:
        cells = [
            Cell(i.name, i.family, _oneway_pair(i), _read_bytes(size), _write_bytes(size))
            for i in ctx.impls
        ]
        return measure(
            ctx,
            f"oneway-{size_id(size)}",
            f"one-way {size_label(size)}",
            cells,
            size=size,
            target=_ONEWAY_TARGETS.get(size),
        )

    return run


_ONEWAY = "messages/s, a child sends_bytes(), this process recv_bytes(); higher is better"

for _size in (SMALL, 4 * 1024, 64 * 1024, MiB, 16 * MiB):
    _target = _ONEWAY_TARGETS.get(_size)
    _add(
        f"oneway-{size_id(_size)}",
        f"one-way {size_label(_size)}",
        f"{size_label(_size)} {_ONEWAY}",
        target=f"c {_target} the best stdlib rate" if _target else "",
        default=_target is not None,
    )(_oneway(_size))
    if _size == SMALL:

        @_add(
            f"timeout-{size_id(SMALL)}",
            f"{size_label(SMALL)}, read timeout",
            f"64 B messages/s, each read with a {READ_TIMEOUT:g} s timeout: framepipe "
            f"recv_bytes(timeout={READ_TIMEOUT:g}), the others poll({READ_TIMEOUT:g}) + "
            "recv_bytes(); higher is better",
            target="c >= 7x the best stdlib rate",
            default=True,
        )
        def _with_timeout(ctx: Context) -> list[Row]:
            cells = [
                Cell(
                    i.name,
                    i.family,
                    _oneway_pair(i),
                    _read_bytes_timeout(SMALL) if i.timed_read else _read_poll_then_bytes(SMALL),
                    _write_bytes(SMALL),
                )
                for i in ctx.impls
            ]
            name, title = f"timeout-{size_id(SMALL)}", f"{size_label(SMALL)}, read timeout"
            return measure(ctx, name, title, cells, size=SMALL, target=">= 7x")


def _numpy(size: int) -> Callable[[Context], list[Row]]:
    def run(ctx: Context) -> list[Row]:
        try:
            import numpy  # noqa: F401
        except ImportError:
            return []  # the missing peer is named under the table
        cells = [
            Cell(i.name, i.family, _oneway_pair(i), _read_array(size), _write_array(size))
            for i in ctx.impls
        ]
        return measure(
            ctx,
            f"numpy-{size_id(size)}",
            f"numpy {size_label(size)}",
            cells,
            size=size,
            target=">= 4x" if size == 16 * MiB else None,
        )

    return run


for _size in (MiB, 16 * MiB):
    _add(
        f"numpy-{size_id(_size)}",
        f"numpy {size_label(_size)}",
        f"float64 arrays of {size_label(_size)}/s through send()/recv() (framepipe pickles "
        "out of band, the stdlib in band); higher is better",
        target="c >= 4x the best stdlib rate" if _size == 16 * MiB else "",
        needs=("numpy",),
    )(_numpy(_size))


@_add(
    f"refpipe-{size_id(SMALL)}",
    f"Pipe.read {size_label(SMALL)}",
    "64 B messages/s through framepipe's reference-style Pipe (write()/read(), writer_pid "
    "set), the others recv_bytes(); higher is better",
)
def _ref_pipe(ctx: Context) -> list[Row]:
    cells = []
    for i in ctx.impls:
        module = i.module
        if module is not None and hasattr(module, "Pipe") and i.name in ("c", "python"):
            cells.append(
                Cell(
                    i.name,
                    i.family,
                    _ref_pipe_pair(module),
                    _ref_pipe_read(SMALL),
                    _ref_pipe_write(SMALL),
                    started=_set_writer_pid,
                )
            )
        elif not i.is_framepipe:
            cells.append(
                Cell(i.name, i.family, _oneway_pair(i), _read_bytes(SMALL), _write_bytes(SMALL))
            )
    name, title = f"refpipe-{size_id(SMALL)}", f"Pipe.read {size_label(SMALL)}"
    return measure(ctx, name, title, cells, size=SMALL)


OVERSHOOT_TIMEOUT = 0.010


def _overshoot_us(wait: Callable[[], None], tries: int) -> list[float]:
    """How far past ``OVERSHOOT_TIMEOUT`` each of ``tries`` timed-out waits returned, in us."""
    late = []
    for _ in range(tries):
        start = time.perf_counter()
        wait()
        late.append((time.perf_counter() - start - OVERSHOOT_TIMEOUT) * 1e6)
    return late


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


@_add(
    "timeout-overshoot",
    "10 ms timeout overshoot",
    "how late a 10 ms read timeout on a silent pipe returns, median us (p99 in the JSON); "
    "lower is better",
    target="c median <= 300 us and p99 <= 1 ms",
)
def _timeout_overshoot(ctx: Context) -> list[Row]:
    tries = 20 if ctx.depth.name == "quick" else 200
    title = f"{OVERSHOOT_TIMEOUT * 1e3:g} ms timeout overshoot"
    rows: list[Row] = []
    for impl in ctx.impls:
        reader, writer = impl.oneway()
        try:
            if impl.timed_read:

                def wait(reader: Any = reader) -> None:
                    try:
                        reader.recv_bytes(timeout=OVERSHOOT_TIMEOUT)
                    except TimeoutError:
                        return
                    raise RuntimeError("a message arrived on a silent pipe")

            else:

                def wait(reader: Any = reader) -> None:
                    if reader.poll(OVERSHOOT_TIMEOUT):
                        raise RuntimeError("a message arrived on a silent pipe")

            late = _overshoot_us(wait, tries)
        finally:
            reader.close()
            writer.close()
        median, p99 = statistics.median(late), _percentile(late, 0.99)
        out = row(
            "timeout-overshoot",
            title,
            impl.name,
            median,
            "us late",
            family=impl.family,
            better="lower",
            n=tries,
            p99_us=round(p99, 1),
        )
        if impl.name in ("c", "python"):
            out.update(target="<= 300 us, p99 <= 1 ms", basis="absolute")
            out["met"] = median <= 300 and p99 <= 1000
        ctx.progress(impl.name)
        rows.append(out)
    return rows


@_add(
    f"watched-{size_id(SMALL)}",
    f"{size_label(SMALL)}, watched + timed read",
    "64 B messages/s of recv_bytes(timeout=5) on a watched writer against the same core's "
    "plain recv_bytes(); higher is better",
    target="watched >= 0.9x the same core's plain read",
)
def _watched(ctx: Context) -> list[Row]:
    bench, title = f"watched-{size_id(SMALL)}", f"{size_label(SMALL)}, watched + timed read"
    cells = []
    for impl in ctx.framepipe:
        plain = Cell(
            f"{impl.name} plain",
            impl.family,
            _oneway_pair(impl),
            _read_bytes(SMALL),
            _write_bytes(SMALL),
        )
        watched = Cell(
            f"{impl.name} watched",
            impl.family,
            _oneway_pair(impl),
            _read_bytes_timeout(SMALL),
            _write_bytes(SMALL),
            started=lambda parent, pid: parent.watch(pid),
        )
        cells += [plain, watched]
    rows = measure(ctx, bench, title, cells, size=SMALL)
    by_name = {r["impl"]: r for r in rows}
    for impl in ctx.framepipe:
        plain_row = by_name.get(f"{impl.name} plain")
        watched_row = by_name.get(f"{impl.name} watched")
        if not plain_row or not watched_row:
            continue
        watched_row["target"] = ">= 0.9x"
        if plain_row.get("value") and watched_row.get("value"):
            ratio = float(watched_row["value"]) / float(plain_row["value"])
            watched_row.update(ratio=ratio, met=ratio >= 0.9, basis="plain")
    return rows


SECTIONS.append(EXCEPTIONS)
SECTIONS.append(DETECTION)
