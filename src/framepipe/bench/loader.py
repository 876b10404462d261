"""``python -m framepipe bench loader``: framepipe's DataLoader against torch's, in one run.

Items are float32 arrays of 4 KiB, 1 MiB and 16 MiB, made by a map-style dataset in 2 worker
processes (``np.full``, so every byte exists), delivered in order with ``batch_size=None``
(and ``batch_size=32`` at 4 KiB); this process touches one element of each. Rows:

``framepipe DataLoader``
    :class:`framepipe.workers.DataLoader` with its defaults (2 workers, prefetch 2 per worker:
    at most 4 items in flight or waiting, 32 where they are arrays under 64 KiB that load
    fast, such as the 4 KiB ones: see docs/loader.md);
``framepipe, prefetch 8``
    the same with ``prefetch_factor=8`` (16 in flight): how much of the gap to the bare
    transport at small items is the prefetch window;
``bare transport``
    no loader logic: 2 forked writers each ``send()`` arrays on their own framepipe pipe, read
    round robin; the ceiling the loader is measured against;
``multiprocessing.Pool.imap``
    ``Pool(2).imap(make_item, range(n))`` (chunksize 1), in order;
``torch DataLoader``
    ``torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=2)`` when torch is
    installed.

Each cell is the best of 3 runs (1 of ~0.3 s with ``--quick``); a run starts with fresh
workers, is timed from the first item to the last over about a second, then stops the
workers. Rows are interleaved (one run of each, three times), so every ratio comes from the
same minutes. ``RSS+`` is the rise of this process's resident size during the run.

The dataset and the writers live at module level: ``Pool.imap`` pickles them by name.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import multiprocessing
import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ..connection import Pipe
from ..workers import DataLoader
from . import peers
from .machine import machine_info
from .output import run_and_emit
from .plot import Bar, Group
from .table import fit, wrap

KiB, MiB = 1024, 1024 * 1024
SIZES = (4 * KiB, 1 * MiB, 16 * MiB)
WORKERS = 2
TORCH_HINT = f"not installed ({peers.EXTRA_HINT})"
#: framepipe's DataLoader against torch's items/s, and against the bare transport.
TARGETS_VS_TORCH = {4 * KiB: 20.0, 1 * MiB: 4.0, 16 * MiB: 2.5}
TARGET_VS_BARE = 0.85


def _label(size: int) -> str:
    return f"{size // MiB} MiB" if size >= MiB else f"{size // KiB} KiB"


# -- the dataset (module level: Pool.imap pickles it) ------------------------------------------


def make_item(size: int, i: int) -> Any:
    import numpy as np

    return np.full(size // 4, i, dtype=np.float32)


def make_batch(size: int, batch: int, i: int) -> Any:
    import numpy as np

    return np.stack([make_item(size, i * batch + k) for k in range(batch)])


class ArrayDataset:
    """``n`` float32 arrays of ``size`` bytes; item ``i`` is filled with ``i``."""

    def __init__(self, size: int, n: int = 10**9) -> None:
        self.size = size
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        return make_item(self.size, i)


# -- one run: an iterator of items, timed ------------------------------------------------------


def _rss() -> int:
    with open("/proc/self/statm", "rb") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _drive(it: Iterator[Any], seconds: float, per_item: int) -> tuple[int, float, int]:
    """Take items from ``it`` for about ``seconds`` after the first one, touching one element
    of each: ``(items, elapsed seconds, RSS rise in bytes)``."""
    base = _rss()
    first = next(it)
    float(first.reshape(-1)[0])
    del first
    start = now = time.perf_counter()
    n = 0
    peak = base
    last_sample = start
    for item in it:
        float(item.reshape(-1)[0])
        n += per_item
        del item
        now = time.perf_counter()
        if now - last_sample > 0.005:
            last_sample = now
            peak = max(peak, _rss())
            if now - start >= seconds:
                break
    return n, now - start, max(0, peak - base)


Source = Callable[[int, "int | None", float], "contextlib.AbstractContextManager[Iterator[Any]]"]


@contextlib.contextmanager
def framepipe_items(
    size: int, batch: int | None, seconds: float, prefetch_factor: int = 2
) -> Iterator[Iterator[Any]]:
    """Items (or batches) from framepipe's DataLoader with its defaults."""
    with DataLoader(
        ArrayDataset(size), batch_size=batch, num_workers=WORKERS, prefetch_factor=prefetch_factor
    ) as loader:
        yield iter(loader)


def _writer(
    conn: Any, size: int, batch: int | None, start: int, step: int, inherited: list[Any]
) -> None:
    for reader in inherited:  # so that the parent closing its reader ends this loop
        reader.close()
    i = start
    try:
        while True:
            conn.send(make_item(size, i) if batch is None else make_batch(size, batch, i))
            i += step
    except (BrokenPipeError, ConnectionError, OSError):
        return


@contextlib.contextmanager
def bare_items(size: int, batch: int | None, seconds: float) -> Iterator[Iterator[Any]]:
    """No loader: 2 forked writers send arrays on their own pipe; read round robin."""
    ctx = multiprocessing.get_context("fork")
    readers: list[Any] = []
    procs: list[Any] = []
    try:
        for k in range(WORKERS):
            r, w = Pipe(False, read_ahead=True)
            p = ctx.Process(
                target=_writer, args=(w, size, batch, k, WORKERS, readers + [r]), daemon=True
            )
            p.start()
            w.close()
            readers.append(r)
            procs.append(p)

        def items() -> Iterator[Any]:
            while True:
                for r in readers:
                    yield r.recv()

        yield items()
    finally:
        for r in readers:
            r.close()
        for p in procs:
            p.join(2)
            if p.exitcode is None:
                p.kill()
                p.join()


@contextlib.contextmanager
def pool_items(size: int, batch: int | None, seconds: float) -> Iterator[Iterator[Any]]:
    """``multiprocessing.Pool(2).imap``, in order, over about what ``seconds`` takes (imap
    has no back pressure: its workers run as far ahead as the task list goes)."""
    fn: Callable[[int], Any] = (
        functools.partial(make_item, size)
        if batch is None
        else functools.partial(make_batch, size, batch)
    )
    n = {4 * KiB: 200_000, 1 * MiB: 20_000, 16 * MiB: 400}[size] if batch is None else 20_000
    pool = multiprocessing.get_context("fork").Pool(WORKERS)
    try:
        yield pool.imap(fn, range(int(n * seconds) + 10))
    finally:
        pool.terminate()
        pool.join()


@contextlib.contextmanager
def torch_items(size: int, batch: int | None, seconds: float) -> Iterator[Iterator[Any]]:
    """torch's DataLoader with its defaults (2 workers, prefetch 2 per worker)."""
    from torch.utils.data import DataLoader

    loader: Any = DataLoader(
        ArrayDataset(size),  # type: ignore[arg-type, unused-ignore]  # torch absent: Any
        batch_size=batch,
        num_workers=WORKERS,
    )
    it = iter(loader)
    try:
        yield it
    finally:
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()


ROWS: list[tuple[str, Source]] = [
    ("framepipe DataLoader", framepipe_items),
    ("framepipe, prefetch 8", functools.partial(framepipe_items, prefetch_factor=8)),
    ("bare transport", bare_items),
    ("multiprocessing.Pool.imap", pool_items),
    ("torch DataLoader", torch_items),
]


def measure(source: Source, size: int, batch: int | None, seconds: float) -> tuple[int, float, int]:
    """One run of one row: ``(items, seconds, RSS rise in bytes)``."""
    with source(size, batch, seconds) as items:
        return _drive(items, seconds, batch or 1)


def torch_version() -> str | None:
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__)


def _case_label(size: int, batch: int | None) -> str:
    return f"{_label(size)}" + (f" x{batch}" if batch else "")


def _cases(names: Sequence[str]) -> list[tuple[int, int | None]]:
    cases: list[tuple[int, int | None]] = [(s, None) for s in SIZES]
    cases.append((4 * KiB, 32))
    wanted = [p.strip().lower() for value in names for p in value.split(",") if p.strip()]
    if not wanted:
        return cases
    chosen: list[tuple[int, int | None]] = [
        c for c in cases if _case_label(*c).replace(" ", "").lower() in wanted
    ]
    if not chosen:
        raise ValueError(
            f"--rows {','.join(names)} selects no item size; the sizes are: "
            + ", ".join(_case_label(*c).replace(" ", "") for c in cases)
        )
    return chosen


def run(
    quick: bool = False,
    repeat: int | None = None,
    seconds: float | None = None,
    progress: Callable[[str], None] = lambda m: None,
    names: Sequence[str] = (),
) -> dict[str, Any]:
    """Every cell, interleaved: ``{"machine", "settings", "rows", "targets", ...}``."""
    repeat = repeat or (1 if quick else 3)
    seconds = seconds or (0.3 if quick else 1.0)
    have_torch = torch_version() is not None
    cases = _cases(names)
    machine = machine_info()
    started = time.monotonic()
    runs: dict[tuple[str, int, int | None], list[tuple[int, float, int]]] = {}
    loaders = [(name, fn) for name, fn in ROWS if have_torch or not name.startswith("torch")]
    progress(
        f"bench loader: {len(cases)} item sizes x {len(loaders)} loaders, "
        f"{repeat} run(s) of ~{seconds:g} s each"
    )
    for r in range(repeat):
        for size, batch in cases:
            for name, fn in loaders:
                what = _case_label(size, batch)
                got = measure(fn, size, batch, seconds)
                runs.setdefault((name, size, batch), []).append(got)
                progress(
                    f"run {r + 1}/{repeat}: {what:<9} {name:<27} {got[0] / got[1]:>10,.0f} items/s"
                )
    rows: list[dict[str, Any]] = []
    for size, batch in cases:
        group: list[dict[str, Any]] = []
        for name, _ in ROWS:
            got_runs = runs.get((name, size, batch))
            if not got_runs:
                group.append(
                    {
                        "size": size,
                        "batch": batch,
                        "loader": name,
                        "items_per_s": None,
                        "note": TORCH_HINT,
                    }
                )
                continue
            best = max(got_runs, key=lambda t: t[0] / t[1])
            rate = best[0] / best[1]
            group.append(
                {
                    "size": size,
                    "batch": batch,
                    "loader": name,
                    "items_per_s": rate,
                    "mb_per_s": rate * size / 1e6,
                    "rss_rise": max(t[2] for t in got_runs),
                    "spread": max(t[0] / t[1] for t in got_runs)
                    / min(t[0] / t[1] for t in got_runs),
                }
            )
        by: dict[str, float | None] = {g["loader"]: g.get("items_per_s") for g in group}
        torch_rate, bare = by.get("torch DataLoader"), by.get("bare transport")
        for g in group:
            rate_g = g.get("items_per_s")
            if rate_g:
                g["vs_torch"] = rate_g / torch_rate if torch_rate else None
                g["vs_bare"] = rate_g / bare if bare else None
        rows += group
    elapsed = time.monotonic() - started
    progress(f"done in {elapsed:.1f} s")
    gone = [p for p in peers.missing("loader") if p.module != "matplotlib"]
    return {
        "machine": machine,
        "settings": {
            "suite": "loader",
            "quick": quick,
            "repeat": repeat,
            "seconds": seconds,
            "workers": WORKERS,
            "engine": machine["core"],
            "torch": torch_version(),
            "elapsed_s": round(elapsed, 2),
        },
        "rows": rows,
        "targets": _targets(rows),
        "missing_line": peers.missing_line_for(gone),
        "peers": peers.versions("loader"),
    }


def _at_least(what: str, got: float | None, want: float) -> dict[str, Any]:
    """A target row: the ratio ``got`` must be at least ``want`` (not met nor failed when
    ``got`` could not be measured)."""
    return {
        "what": what,
        "target": f">= {want:g}x",
        "got": got,
        "met": None if got is None else got >= want,
    }


def _targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for r in rows:
        if r["loader"] != "framepipe DataLoader" or r["batch"] is not None:
            continue
        label = _label(r["size"])
        out.append(_at_least(f"{label}: vs torch", r.get("vs_torch"), TARGETS_VS_TORCH[r["size"]]))
        out.append(_at_least(f"{label}: vs bare transport", r.get("vs_bare"), TARGET_VS_BARE))
    # the prefetch bound: 2 per worker in flight or waiting, plus the item the caller holds
    for r in rows:
        if (
            r["loader"] == "framepipe DataLoader"
            and r["size"] == 16 * MiB
            and r["batch"] is None
            and r.get("rss_rise") is not None
        ):
            bound = (2 * WORKERS + 2) * r["size"]
            out.append(
                {
                    "what": "16 MiB: parent RSS rise",
                    "target": f"<= {bound // MiB} MiB",
                    "got": r["rss_rise"] / MiB,
                    "met": r["rss_rise"] <= bound,
                }
            )
    return out


def _num(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def format_report(report: dict[str, Any]) -> str:
    """The table, one group per item size, then the targets, within 100 columns."""
    m, s = report["machine"], report["settings"]
    lines = [
        f"framepipe {m['framepipe']} bench loader: {s['workers']} workers, in order, the best "
        f"of {s['repeat']} run(s) of ~{s['seconds']:g} s",
        f"run {m['date']} on {m['cpus_usable']} CPUs; {m['cpu_model']}; {m['python']}; "
        f"core {s['engine']}",
        f"numpy {report['peers'].get('numpy')}; torch {s['torch'] or 'not installed'}",
        "",
        *wrap(
            "each row: float32 arrays made by a dataset in the workers and delivered in "
            "order (x32: batches of 32), this process touching one element of each; "
            "items/s and MB/s (10^6 bytes), higher is better; vs torch and vs bare: against "
            "torch's DataLoader and against a bare framepipe transport (2 writers, no "
            "window); RSS+: the rise of this process's RSS; spread: fastest run / slowest",
            "",
        ),
        "",
        f"{'item':<12}{'loader':<27}{'items/s':>10}{'MB/s':>8}{'vs torch':>10}{'vs bare':>9}"
        f"{'RSS+ MiB':>10}{'spread':>8}",
        "-" * 94,
    ]
    last = None
    for r in report["rows"]:
        item = _case_label(r["size"], r["batch"])
        shown = item if item != last else ""
        last = item
        if r.get("items_per_s") is None:
            lines.append(f"{shown:<12}{r['loader']:<27}  {r['note']}")
            continue
        vt = r.get("vs_torch")
        vb = r.get("vs_bare")
        lines.append(
            f"{shown:<12}{r['loader']:<27}{r['items_per_s']:>10,.0f}{r['mb_per_s']:>8,.0f}"
            f"{_num(vt, '>9.2f') + ('x' if vt else ''):>10}"
            f"{_num(vb, '>8.2f') + ('x' if vb else ''):>9}{r['rss_rise'] / MiB:>10.0f}"
            f"{r['spread']:>7.2f}x"
        )
    lines += ["", "targets (framepipe's DataLoader with its defaults):"]
    for t in report["targets"]:
        met = {True: "met", False: "MISSED", None: "not measured"}[t["met"]]
        got = "-" if t["got"] is None else f"{t['got']:.2f}"
        lines.append(f"  {t['what']:<28} {t['target']:<12} got {got:<8} {met}")
    if report.get("missing_line"):
        lines += ["", *wrap(report["missing_line"], "")]
    return "\n".join(fit(lines))


def plot_groups(report: dict[str, Any]) -> list[Any]:
    """The ``--plot`` groups: each loader's items/s against ``multiprocessing.Pool.imap``."""
    groups: dict[str, Any] = {}
    base: dict[str, float] = {}
    for r in report["rows"]:
        if r["loader"] == "multiprocessing.Pool.imap" and r.get("items_per_s"):
            base[_case_label(r["size"], r["batch"])] = r["items_per_s"]
    for r in report["rows"]:
        label = _case_label(r["size"], r["batch"])
        if label not in base or not r.get("items_per_s"):
            continue
        group = groups.setdefault(label, Group(label))
        group.bars.append(
            Bar(r["loader"], r["items_per_s"] / base[label], r["loader"].startswith("framepipe"))
        )
    return list(groups.values())


def main(args: argparse.Namespace) -> int:
    """``python -m framepipe bench loader``."""
    try:
        import numpy  # noqa: F401
    except ImportError:
        print(
            f"framepipe bench loader needs numpy, which is not installed: {peers.EXTRA_HINT} "
            "(or pip install numpy)",
            file=sys.stderr,
        )
        return 2

    def progress(message: str) -> None:
        if not args.quiet:
            print(message, file=sys.stderr, flush=True)

    def run_quietly() -> dict[str, Any]:
        with contextlib.redirect_stdout(sys.stderr):  # nothing but the report on stdout
            return run(
                quick=args.quick,
                repeat=args.repeat,
                seconds=args.seconds,
                progress=progress,
                names=args.rows,
            )

    return run_and_emit(
        args,
        run_quietly,
        format_report,
        plot_groups,
        "items/s against multiprocessing.Pool.imap (x, log scale; above 1 is faster)",
    )
