"""Was the machine busy while the benchmark ran? A target missed on a loaded machine (a VM
whose host lends its CPUs to others, a build running beside it) says little about framepipe.

:class:`LoadProbe` reads, at the start and the end of a run, the CPU time stolen by the
hypervisor and the CPU time used by every other process (``/proc/stat`` less this process and
its children), and the load average before the run; :func:`busy_lines` turns them, with the
spread of the runs of each cell, into the verdict's words: how busy, and how to get a clean
figure.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

__all__ = ["LoadProbe", "busy_reasons", "busy_lines"]

STEAL_BUSY = 0.02  # stolen CPU time over the run, as a share of all CPU time
OTHERS_BUSY = 0.10  # CPU time of other processes, as a share of all CPU time
LOAD_BUSY = 0.5  # load average before the run, per usable CPU
SPREAD_BUSY = 1.5  # slowest run / fastest run of one cell


def _cpu_ticks() -> tuple[int, int, int] | None:
    """``(total, busy, steal)`` clock ticks of all CPUs since boot (Linux), None elsewhere."""
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    try:
        values = [int(v) for v in fields[1:9]]
    except ValueError:
        return None
    values += [0] * (8 - len(values))
    user, nice, system, idle, iowait, irq, softirq, steal = values
    # guest time is counted in user time already
    return sum(values), user + nice + system + irq + softirq, steal


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


class LoadProbe:
    """Start it before a run, call :meth:`finish` after it."""

    def __init__(self) -> None:
        self._start = _cpu_ticks()
        self._own = _own_seconds()
        self._load: float | None
        try:
            self._load = os.getloadavg()[0]
        except OSError:
            self._load = None

    def finish(self) -> dict[str, Any]:
        """``steal`` and ``others`` (shares of all CPU time during the run, None when
        unknown), ``load_before`` (the 1-minute load average when it started) and ``cpus``."""
        end = _cpu_ticks()
        own = _own_seconds() - self._own
        steal = others = None
        if self._start is not None and end is not None:
            total = end[0] - self._start[0]
            if total > 0:
                steal = (end[2] - self._start[2]) / total
                hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
                busy = end[1] - self._start[1] - own * hz
                others = max(busy, 0) / total
        return {
            "steal": None if steal is None else round(steal, 4),
            "others": None if others is None else round(others, 4),
            "load_before": None if self._load is None else round(self._load, 2),
            "cpus": _usable_cpus(),
        }


def busy_reasons(load: dict[str, Any] | None, spreads: Iterable[float] = ()) -> list[str]:
    """What made the machine busy during the run, in words (empty: it was not)."""
    reasons: list[str] = []
    load = load or {}
    steal, others, before = load.get("steal"), load.get("others"), load.get("load_before")
    cpus = load.get("cpus") or 1
    if isinstance(steal, (int, float)) and steal >= STEAL_BUSY:
        reasons.append(f"{steal:.0%} of the CPU time was stolen by the hypervisor")
    if isinstance(others, (int, float)) and others >= OTHERS_BUSY:
        reasons.append(f"other processes used {others:.0%} of the CPU time")
    if isinstance(before, (int, float)) and before >= LOAD_BUSY * cpus:
        reasons.append(f"the load average was {before:.1f} on {cpus} CPUs when it started")
    worst = max((s for s in spreads if s > 0), default=0.0)
    if worst >= SPREAD_BUSY:
        reasons.append(f"runs of one cell differed by up to {worst:.1f}x")
    return reasons


def busy_lines(
    load: dict[str, Any] | None, spreads: Iterable[float] = (), missed: int = 0
) -> list[str]:
    """The verdict's sentence when the machine was busy (empty when it was not)."""
    reasons = busy_reasons(load, spreads)
    if not reasons:
        return []
    text = "the machine was busy during this run: " + "; ".join(reasons) + ". "
    if missed:
        text += f"The {missed} missed target(s) may be the load's, not framepipe's. "
    text += (
        "For a clean figure, run it again with nothing else running (on a VM, one with "
        "dedicated CPUs), e.g. python -m framepipe bench --full, and compare the spread column."
    )
    return [text]


def spreads_of(rows: Iterable[dict[str, Any]]) -> list[float]:
    """Slowest run / fastest run of every row that has several runs."""
    out = []
    for row in rows:
        runs = row.get("runs")
        if isinstance(runs, list) and len(runs) > 1 and min(runs) > 0:
            out.append(max(runs) / min(runs))
    return out
