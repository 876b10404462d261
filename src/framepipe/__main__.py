"""Command line: ``python -m framepipe bench [core|workers|loader] [--full] [--json FILE]
[--plot FILE.png]``, ``python -m framepipe demo`` and ``python -m framepipe --version``."""

from __future__ import annotations

import argparse
import platform
import sys
from collections.abc import Sequence

from . import _demo
from ._impl import implementation
from ._version import __version__
from .bench import cli


def build_parser() -> argparse.ArgumentParser:
    """The ``python -m framepipe`` argument parser, one subcommand per tool."""
    parser = argparse.ArgumentParser(
        prog="python -m framepipe",
        description="framepipe: framed pipes for worker processes",
    )
    parser.add_argument(
        "--version",
        action="version",
        version=(
            f"framepipe {__version__} ({implementation} engine, Python {platform.python_version()})"
        ),
        help="print framepipe's version and which engine runs, then exit",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True
    bench = commands.add_parser(
        "bench",
        help="compare framepipe with multiprocessing and the libraries people use",
        description="Time framepipe against the stdlib (and pyzmq, loky, pebble, mpire, "
        "torch when installed) in one run and print the ratios. Progress goes to stderr, "
        "the table to stdout.",
    )
    cli.add_arguments(bench)
    bench.set_defaults(handler=cli.main)
    demo = commands.add_parser(
        "demo",
        help="a worker pool meeting a task exception, a killed worker and a hung task",
        description="Run a short demonstration of framepipe's worker pool and its reports.",
    )
    demo.set_defaults(handler=_run_demo)
    return parser


def _run_demo(args: argparse.Namespace) -> int:
    return _demo.main(args)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` and run the chosen subcommand; returns the exit status."""
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args))
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
