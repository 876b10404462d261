"""Tasks for test_progress (module level, importable by workers)."""

from __future__ import annotations

import os

from _worker_tasks import sleep_for  # noqa: F401 - a task of test_progress too


def exit_at_4(i: int) -> int:
    if i == 4:
        os._exit(3)
    return i
