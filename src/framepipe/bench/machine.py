"""What a run ran on: the machine, Python, framepipe and the core that runs by default."""

from __future__ import annotations

import datetime
import os
import platform
from typing import Any

from .. import _impl
from .._version import __version__

__all__ = ["machine_info"]


def machine_info() -> dict[str, Any]:
    """CPU count, CPU model, platform, Python, framepipe's version and default core, and the
    date (UTC, when the run starts)."""
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = os.cpu_count() or 0
    model = platform.processor()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": model,
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "framepipe": __version__,
        "core": _impl.implementation,
    }
