"""``python -m framepipe bench [core|workers|loader]``: the options, the run of the core suite,
progress on stderr, and the table, ``--json`` and ``--plot`` outputs.

The default run of the core suite holds the benchmarks that carry the compiled core's targets
and finishes in well under a minute on two cores; ``--full`` runs every benchmark, every core
variant and pyzmq, each cell the best of 5 runs of ~0.3 s; ``--quick`` is a smoke test.
"""

from __future__ import annotations

import argparse
import fnmatch
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from . import loader, peers, workers
from .core import READ_TIMEOUT, SECTIONS
from .load import LoadProbe
from .machine import machine_info
from .output import check_plot, run_and_emit
from .plot import core_groups
from .rows import Row, finish
from .runner import DEPTHS, PLACEMENTS, Context, Depth, Section, placement_cpus
from .table import format_report

__all__ = ["SUITES", "add_arguments", "main", "run_argv", "run_core", "selected"]

SUITES = ("core", "workers", "loader")
DEFAULT_IMPLS = ("c", "pyzmq")
FULL_IMPLS = ("c", "c-read-ahead", "c-pipes", "python", "pyzmq")

_PLACEMENT_TEXT = {
    "free": "CPUs chosen by the scheduler",
    "same": "reader and writer pinned to one CPU",
    "split": "reader and writer pinned to two CPUs",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument(
        "suite",
        nargs="?",
        default="core",
        choices=SUITES,
        help="core: framed pipes against multiprocessing.connection (default); workers: the "
        "Pool and Worker against concurrent.futures, multiprocessing.Pool, loky, pebble, "
        "mpire; loader: the DataLoader against torch's",
    )
    depth = parser.add_mutually_exclusive_group()
    depth.add_argument(
        "--full",
        action="store_true",
        help="the long run: every benchmark and core variant, each cell the best of 5 runs "
        "of ~0.3 s (core: about 3 minutes)",
    )
    depth.add_argument(
        "--quick", action="store_true", help="a smoke test: one short run a cell, few kills"
    )
    parser.add_argument(
        "--rows",
        action="append",
        default=[],
        metavar="NAME",
        help="core: only these benchmarks (a name, a prefix such as 'oneway', or a pattern "
        "such as '*-1MiB'; comma-separated or repeated; see --list); workers: only these "
        "pools; loader: only these item sizes (4KiB, 1MiB, 16MiB, 4KiBx32)",
    )
    parser.add_argument(
        "--impls",
        default=None,
        metavar="A,B",
        help=f"core: framepipe's variants and peers to run beside the stdlib, from "
        f"{', '.join(peers.IMPL_CHOICES)} (default: {','.join(DEFAULT_IMPLS)}; --full: all)",
    )
    parser.add_argument("--list", action="store_true", help="list the core benchmarks and exit")
    parser.add_argument(
        "--json",
        metavar="FILE",
        default=None,
        help="also write the report as JSON to FILE ('-': to stdout, instead of the table)",
    )
    parser.add_argument(
        "--plot",
        metavar="FILE.png",
        default=None,
        help="draw the ratios against the stdlib as a bar chart (needs matplotlib)",
    )
    parser.add_argument(
        "--seconds", type=float, default=None, help="core: the duration of one run of a cell"
    )
    parser.add_argument(
        "--repeat", type=int, default=None, help="core: runs per cell (the best counts)"
    )
    parser.add_argument(
        "--placement",
        choices=PLACEMENTS,
        default="free",
        help="core: where reader and writer run: free (the scheduler decides), same (one "
        "CPU), split (two CPUs)",
    )
    parser.add_argument(
        "--workers",
        type=_counts,
        default=None,
        metavar="N[,N...]",
        help="workers: workers a pool (default 2); a list such as 1,2,4,8,16 runs the pools "
        "side by side at each count and prints a scaling table",
    )
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress lines on stderr")


def _counts(text: str) -> list[int]:
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        counts = []
    if not counts or any(c < 1 for c in counts):
        raise argparse.ArgumentTypeError(
            f"expected positive worker counts separated by commas, such as 1,2,4, not {text!r}"
        )
    return counts


def selected(sections: Sequence[Section], names: Sequence[str], *, full: bool) -> list[Section]:
    """The sections ``--rows`` selects, in table order: without names, the default ones (all
    with ``full``). A name that is a section's selects it; otherwise it selects by prefix
    before ``-`` (``oneway`` selects every ``oneway-*``) or as a shell pattern (``*-1MiB``)."""
    patterns = [p.strip() for value in names for p in value.split(",") if p.strip()]
    if not patterns:
        return [s for s in sections if full or s.default]
    known = {s.name for s in sections}

    def matches(name: str, pattern: str) -> bool:
        if pattern in known:
            return name == pattern
        return name.startswith(pattern + "-") or fnmatch.fnmatchcase(name, pattern)

    return [s for s in sections if any(matches(s.name, p) for p in patterns)]


def _impl_names(text: str | None, full: bool) -> list[str]:
    if text is None:
        return list(FULL_IMPLS if full else DEFAULT_IMPLS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in peers.IMPL_CHOICES]
    if unknown or not names:
        raise ValueError(
            f"--impls {text!r}: unknown {', '.join(unknown) or 'empty list'}; pick from "
            f"{', '.join(peers.IMPL_CHOICES)} (the stdlib always runs)"
        )
    return names


def _depth(args: argparse.Namespace) -> Depth:
    base = DEPTHS["full" if args.full else "quick" if args.quick else "default"]
    if args.seconds is not None and not args.seconds > 0:
        raise ValueError(f"--seconds {args.seconds:g}: give a positive duration, such as 0.2")
    if args.repeat is not None and args.repeat < 1:
        raise ValueError(f"--repeat {args.repeat}: give at least 1 run per cell")
    return Depth(
        base.name,
        repeat=args.repeat or base.repeat,
        seconds=args.seconds or base.seconds,
        kills=base.kills,
    )


def run_core(
    args: argparse.Namespace, progress: Callable[[str], None] = lambda line: None
) -> dict[str, Any]:
    """Run the selected core benchmarks; returns the report (``machine``, ``settings``,
    ``implementations``, ``sections``, ``notes``, ``missing``, ``missing_peers``, ``rows``).
    Raises ValueError for options that select nothing or cannot run here."""
    full = bool(args.full)
    chosen = selected(SECTIONS, args.rows, full=full)
    if not chosen:
        raise ValueError(
            f"--rows {','.join(args.rows)} selects nothing; the benchmarks are: "
            + ", ".join(s.name for s in SECTIONS)
        )
    depth = _depth(args)
    placement_cpus(args.placement)  # a placement this machine cannot give fails before any run
    names = _impl_names(args.impls, full)
    impls, notes = peers.implementations(names)
    if not any(i.is_framepipe for i in impls):
        fallback, more = peers.implementations(["python"])
        impls = [i for i in fallback if i.is_framepipe] + impls
        notes += more
    ctx = Context(impls, depth=depth, placement=args.placement, notes=notes)
    # where the run is (each cell's figure is in the table, once)
    ctx.progress = lambda line: progress("      " + line)
    machine = machine_info()
    progress(
        f"bench core: {len(chosen)} benchmarks, {', '.join(i.name for i in impls)}; "
        + ("the long run" if full else "--full for every benchmark and a deeper run")
    )
    started = time.monotonic()
    probe = LoadProbe()
    rows: list[Row] = []
    for k, section in enumerate(chosen, 1):
        progress(f"[{k}/{len(chosen)}] {section.title}")
        try:
            rows.extend(section.run(ctx))
        except Exception as exc:  # noqa: BLE001 - a broken benchmark is a note, not a crash
            ctx.note(f"{section.name} failed: {type(exc).__name__}: {exc}")
    finish(rows)
    load = probe.finish()
    elapsed = time.monotonic() - started
    progress(f"done in {elapsed:.1f} s")
    needs = {m for s in chosen for m in s.needs}
    if "pyzmq" in names:
        needs.add("zmq")
    if args.plot:
        needs.add("matplotlib")
    gone = [p for p in peers.missing("core") if p.module in needs]
    return {
        "machine": machine,
        "settings": {
            "suite": "core",
            "depth": depth.name,
            "repeat": depth.repeat,
            "seconds": depth.seconds,
            "kills": depth.kills,
            "placement": args.placement,
            "placement_text": _PLACEMENT_TEXT[args.placement],
            "read_timeout": READ_TIMEOUT,
            "impls": names,
            "elapsed_s": round(elapsed, 2),
        },
        "implementations": {impl.name: impl.description for impl in impls},
        "peers": peers.versions("core"),
        "sections": [
            {"name": s.name, "title": s.title, "about": s.about, "target": s.target} for s in chosen
        ],
        "load": load,
        "notes": ctx.notes,
        "missing": peers.missing_line_for(gone),
        "missing_peers": [{"package": p.package, "used_for": p.used_for} for p in gone],
        "rows": rows,
    }


def _progress(args: argparse.Namespace) -> Callable[[str], None]:
    def progress(line: str) -> None:
        if not args.quiet:
            print(line, file=sys.stderr, flush=True)

    return progress


def main(args: argparse.Namespace) -> int:
    """Run ``python -m framepipe bench`` with parsed ``args``; returns the exit status."""
    refusal = check_plot(args)
    if refusal:
        print(f"framepipe bench: {refusal}", file=sys.stderr)
        return 3
    if args.suite == "workers":
        return workers.main(args)
    if args.suite == "loader":
        return loader.main(args)
    if args.list:
        for section in SECTIONS:
            mark = "default" if section.default else "--full"
            print(f"{section.name:<18} {mark:<8} {section.title}")
        return 0
    return run_and_emit(
        args,
        lambda: run_core(args, _progress(args)),
        format_report,
        lambda report: core_groups(report["rows"]),
        "speed against the stdlib's best (x, log scale; above 1 is faster)",
    )


def run_argv(argv: Sequence[str]) -> int:
    """``python -m framepipe.bench ARGV``: the same command as ``python -m framepipe bench``."""
    parser = argparse.ArgumentParser(
        prog="python -m framepipe.bench",
        description="framepipe's benchmark (the same as python -m framepipe bench)",
    )
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return main(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
