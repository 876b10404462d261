"""``python -m framepipe bench loader``: the DataLoader against torch's (not built yet)."""

from __future__ import annotations

import argparse
import sys


def main(args: argparse.Namespace) -> int:
    print("framepipe bench loader: the DataLoader benchmark is not available yet",
          file=sys.stderr)
    return 2
