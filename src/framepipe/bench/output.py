"""Where a report goes: the table to stdout, ``--json FILE`` (or ``-``), ``--plot FILE.png``,
and the refusal of a plot that cannot be drawn, for every suite."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from . import peers
from .plot import Group, PlotUnavailable, draw

__all__ = ["check_plot", "emit", "run_and_emit", "write_json"]


def write_json(report: dict[str, Any], path: str) -> None:
    """``report`` as JSON to ``path`` (``-``: stdout)."""
    text = json.dumps(report, indent=2, default=str) + "\n"
    if path == "-":
        sys.stdout.write(text)
        return
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)


def emit(
    args: argparse.Namespace,
    report: dict[str, Any],
    text: str,
    plot: Callable[[str], None] | None,
) -> int:
    """Print the table (unless JSON goes to stdout), write ``--json``, draw ``--plot``."""
    if args.json != "-":
        print(text)
    if args.json:
        write_json(report, args.json)
        if args.json != "-":
            print(f"framepipe bench: the report is in {args.json}", file=sys.stderr)
    if args.plot:
        if plot is None:
            print(f"framepipe bench: --plot draws nothing for {args.suite}", file=sys.stderr)
            return 2
        try:
            plot(args.plot)
        except (PlotUnavailable, ValueError) as exc:
            print(f"framepipe bench: {exc}", file=sys.stderr)
            return 3
        print(f"framepipe bench: the chart is in {args.plot}", file=sys.stderr)
    return 0


def run_and_emit(
    args: argparse.Namespace,
    run: Callable[[], dict[str, Any]],
    text: Callable[[dict[str, Any]], str],
    groups: Callable[[dict[str, Any]], list[Group]],
    caption: str,
) -> int:
    """Run a suite (``run`` raises ValueError for bad arguments: exit 2), then :func:`emit`
    its table, with a chart of ``groups`` captioned ``caption`` for ``--plot``."""
    try:
        report = run()
    except ValueError as exc:
        print(f"framepipe bench: {exc}", file=sys.stderr)
        return 2

    def plot(path: str) -> None:
        m = report["machine"]
        title = f"framepipe {m['framepipe']} bench {args.suite}, {m['date']}, "
        draw(groups(report), path, title + f"{m['cpus_usable']} CPUs", caption)

    return emit(args, report, text(report), plot)


def check_plot(args: argparse.Namespace) -> str | None:
    """The refusal of ``--plot`` before any run, when it cannot be drawn."""
    if not args.plot:
        return None
    if not any(p.module == "matplotlib" for p in peers.missing(args.suite)):
        return None
    return (
        f"--plot {args.plot} needs matplotlib, which is not installed: {peers.EXTRA_HINT} or "
        "pip install matplotlib (the table and --json do not need it)"
    )
