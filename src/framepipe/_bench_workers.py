"""``python -m framepipe bench workers``: the Pool against the pools people use."""

from __future__ import annotations

import argparse
import sys


def main(args: argparse.Namespace) -> int:
    print("framepipe bench workers: not available yet", file=sys.stderr)
    return 2
