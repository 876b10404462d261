"""``--plot FILE.png``: the ratios against the stdlib as a horizontal bar chart, one group of
bars per benchmark, with matplotlib when it is installed.

Every bar is a speed relative to the stdlib's best in its group, so longer is always better:
a rate divided by the stdlib's rate, or the stdlib's latency divided by the row's. A target,
where a group has one, is drawn as a mark at the speed it asks for.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .peers import EXTRA_HINT
from .rows import Row, Target, ok

__all__ = ["Bar", "Group", "PlotUnavailable", "core_groups", "draw"]


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed; the message says how to add it."""


@dataclass
class Bar:
    label: str
    speed: float
    """Times the stdlib's best; above 1 is faster."""
    framepipe: bool


@dataclass
class Group:
    title: str
    bars: list[Bar] = field(default_factory=list)
    target: float | None = None
    """The speed a target asks for, in the same units as the bars."""


def _speed(item: Row, ratio: float) -> float:
    return 1.0 / ratio if item.get("better") == "lower" else ratio


def core_groups(rows: Sequence[Row]) -> list[Group]:
    """One group per benchmark that has a stdlib row to compare with."""
    groups: dict[str, Group] = {}
    for item in rows:
        ratio = item.get("vs_stdlib")
        if not ok(item) or not isinstance(ratio, (int, float)) or ratio <= 0:
            continue
        group = groups.setdefault(
            str(item["bench"]), Group(str(item.get("title") or item["bench"]))
        )
        group.bars.append(
            Bar(str(item["impl"]), _speed(item, float(ratio)), item.get("family") == "framepipe")
        )
        target = item.get("target")
        basis = item.get("basis", "stdlib")
        if not target or group.target is not None or basis not in ("stdlib", "duplex"):
            continue
        try:
            wanted = Target.parse(str(target)).ratio
        except ValueError:
            continue
        if basis == "duplex":  # the target's ratio is against Pipe(): restate it against the best
            vs_duplex = item.get("vs_duplex")
            if not vs_duplex:
                continue
            wanted *= float(ratio) / float(vs_duplex)
        group.target = _speed(item, wanted)
    return [g for g in groups.values() if len(g.bars) > 1]


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable(
            f"--plot needs matplotlib, which is not installed: {EXTRA_HINT} or "
            "pip install matplotlib (the table and --json do not need it)"
        ) from None
    matplotlib.use("Agg")  # a file, never a window
    import matplotlib.pyplot as plt

    return plt


def draw(groups: Sequence[Group], path: str, title: str, xlabel: str) -> None:
    """Write the bar chart of ``groups`` to ``path`` (PNG, or what its suffix names)."""
    if not groups:
        raise ValueError("nothing to plot: no benchmark has a stdlib row to compare with")
    plt = _pyplot()
    labels: list[str] = []
    speeds: list[float] = []
    colors: list[str] = []
    ticks: list[float] = []
    marks: list[tuple[float, float, float]] = []
    y = 0.0
    for group in groups:
        top = y
        for bar in group.bars:
            labels.append(f"{group.title}: {bar.label}")
            speeds.append(bar.speed)
            colors.append("tab:blue" if bar.framepipe else "tab:gray")
            ticks.append(y)
            y += 1
        if group.target is not None:
            marks.append((group.target, top - 0.5, y - 0.5))
        y += 0.8
    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.3 * len(labels) + 1.2)))
    ax.barh(ticks, speeds, color=colors, height=0.8)
    for speed, tick in zip(speeds, ticks):
        ax.text(speed, tick, f" {speed:.2f}x", va="center", fontsize=7)
    for value, low, high in marks:
        ax.vlines(value, low, high, colors="tab:red", linestyles="dashed", linewidth=1)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xscale("log")
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.invert_yaxis()
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    ax.legend(
        handles=[
            Patch(color="tab:blue", label="framepipe"),
            Patch(color="tab:gray", label="others"),
            Line2D([], [], color="tab:red", linestyle="dashed", label="target"),
        ],
        loc="lower right",
        fontsize=7,
    )
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
