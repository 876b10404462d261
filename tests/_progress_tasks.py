"""Tasks for test_progress (module level, importable by workers)."""

from __future__ import annotations

import os
import time


def exit_at_4(i: int) -> int:
    if i == 4:
        os._exit(3)
    return i


def sleep_for(seconds: float) -> float:
    time.sleep(seconds)
    return seconds
