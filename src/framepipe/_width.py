"""The width of text output (the demo, the bench): the terminal's, 100 columns when unknown."""

from __future__ import annotations

import os
import shutil
import textwrap

__all__ = ["DEFAULT_WIDTH", "output_width", "wrap_line"]

DEFAULT_WIDTH = 100
MIN_WIDTH = 40  # narrower than this, wrapped text reads worse than long lines


def output_width(fd: int = 1) -> int:
    """Columns to wrap at: ``$COLUMNS`` when set, else the width of the terminal on ``fd``,
    else :data:`DEFAULT_WIDTH` (output to a file or a pipe)."""
    env = os.environ.get("COLUMNS", "")
    if env.isdigit() and int(env) > 0:
        return max(int(env), MIN_WIDTH)
    try:
        columns = os.get_terminal_size(fd).columns
    except (OSError, ValueError):
        columns = 0
    if columns <= 0:
        columns = shutil.get_terminal_size((DEFAULT_WIDTH, 24)).columns if fd == 1 else 0
    return max(columns or DEFAULT_WIDTH, MIN_WIDTH)


def wrap_line(line: str, width: int, extra_indent: str = "  ") -> list[str]:
    """``line`` as lines of at most ``width`` columns: continuations keep its indentation
    (and any ``| `` quote mark) plus ``extra_indent``; words longer than a line are cut."""
    if len(line) <= width:
        return [line]
    body = line.lstrip(" ")
    lead = line[: len(line) - len(body)]
    if body.startswith("| "):
        lead, body = lead + "| ", body[2:]
    return textwrap.wrap(
        body,
        width,
        initial_indent=lead,
        subsequent_indent=lead + extra_indent,
        break_on_hyphens=False,
        drop_whitespace=True,
    ) or [line[:width]]
