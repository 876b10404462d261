"""Text output: the core suite's report as a table as wide as the terminal (:data:`WIDTH`
columns when unknown), one group per benchmark under a line that says what its rows measure
and what its target means, then the targets met and missed, whether the machine was busy,
the notes and the missing peers. Helpers here (:func:`wrap`,
:func:`fit`) keep the other suites' reports within the same width."""

from __future__ import annotations

import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

from .._width import DEFAULT_WIDTH, output_width
from .load import busy_lines, spreads_of
from .rows import Row

__all__ = [
    "WIDTH",
    "width",
    "fit",
    "format_report",
    "format_table",
    "result_text",
    "targets",
    "wrap",
]

WIDTH = DEFAULT_WIDTH  # when the terminal's width is unknown (see width())
IMPL_WIDTH = 34


def width() -> int:
    """The columns a report is wrapped to: the terminal's, :data:`WIDTH` when unknown."""
    return output_width(1)


def wrap(text: str, indent: str = "", subsequent: str | None = None) -> list[str]:
    """``text`` wrapped to the output's width (:func:`width`)."""
    return textwrap.wrap(
        text,
        width(),
        initial_indent=indent,
        subsequent_indent=indent + "  " if subsequent is None else subsequent,
        break_on_hyphens=False,
    ) or [indent.rstrip()]


def fit(lines: Iterable[str]) -> list[str]:
    """Lines longer than the output's width wrapped (continuations indented under their
    start)."""
    out: list[str] = []
    cols = width()
    for line in lines:
        if len(line) <= cols:
            out.append(line)
            continue
        lead = len(line) - len(line.lstrip(" "))
        out += wrap(line.strip(), " " * lead)
    return out


def _si(value: float) -> str:
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.2f} {suffix}"
    return f"{value:.1f} "


def result_text(item: Row) -> str:
    """A row's measurement with its unit: ``1.29 M msg/s``, ``16.7 us/rt``."""
    if item.get("error"):
        return "error"
    value = item.get("value")
    if not isinstance(value, (int, float)):
        return "-"
    unit = str(item.get("unit", ""))
    if unit == "msg/s":
        return f"{_si(float(value))}msg/s"
    return f"{value:.3g} {unit}".strip()


def _ratio(value: Any) -> str:
    return f"{value:.2f}x" if isinstance(value, (int, float)) else ""


def _spread(runs: Any) -> str:
    if not isinstance(runs, list) or len(runs) < 2 or min(runs) <= 0:
        return ""
    return f"{max(runs) / min(runs):.2f}x"


def _met(item: Row) -> str:
    met = item.get("met")
    return "" if met is None else ("met" if met else "MISSED")


def _short(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 3] + "..."


HEADER = ("impl", "result", "MB/s", "ratio", "target", "met", "spread")
_RIGHT = {1, 2, 3, 6}


def format_table(rows: Sequence[Row]) -> list[str]:
    """One group's rows under a column header (the errors listed below them)."""
    lines = [
        [
            _short(str(item.get("impl", "")), IMPL_WIDTH),
            result_text(item),
            f"{item['mb_per_s']:.1f}" if isinstance(item.get("mb_per_s"), (int, float)) else "",
            _ratio(item.get("ratio")),
            str(item.get("target") or ""),
            _met(item),
            _spread(item.get("runs")),
        ]
        for item in rows
    ]
    widths = [max(len(h), *(len(line[i]) for line in lines)) for i, h in enumerate(HEADER)]

    def fmt(cells: Sequence[str]) -> str:
        return (
            "  "
            + "  ".join(
                c.rjust(w) if i in _RIGHT else c.ljust(w)
                for i, (c, w) in enumerate(zip(cells, widths))
            ).rstrip()
        )

    out = [fmt(HEADER), *(fmt(line) for line in lines)]
    for item in rows:
        if item.get("error"):
            out += wrap(f"{item.get('impl')}: {item['error']}", "    ")
    return out


def targets(rows: Sequence[Row]) -> list[Row]:
    """The judged rows of framepipe's cores with their default settings (``c``/``python``
    and their WriterDied rows), in table order."""
    return [
        r
        for r in rows
        if r.get("target")
        and r.get("family") == "framepipe"
        and "basis" in r
        and r.get("basis") != "plain"
    ]


def _judged_value(item: Row) -> str:
    if item.get("basis") == "absolute":
        p99 = item.get("p99_us")
        return result_text(item) + (f", p99 {p99:.0f} us" if isinstance(p99, (int, float)) else "")
    ratio = item.get("ratio")
    return f"{ratio:.3f}x" if isinstance(ratio, (int, float)) else result_text(item)


def _target_lines(rows: Sequence[Row]) -> list[str]:
    judged = targets(rows)
    if not judged:
        return []
    cells = [
        (str(r.get("title")), str(r["impl"]).split(" ")[0], _judged_value(r), str(r["target"]))
        for r in judged
    ]
    widths = [max(len(c[i]) for c in cells) for i in range(4)]
    out = ["targets (framepipe's cores with their default settings):"]
    for r, (title, impl, value, target) in zip(judged, cells):
        out.append(
            f"  {title:<{widths[0]}}  {impl:<{widths[1]}}  {value:>{widths[2]}}  "
            f"{target:<{widths[3]}}  {_met(r) or 'MISSED'}"
        )
    by_impl: dict[str, list[Row]] = {}
    for r in judged:
        by_impl.setdefault(str(r["impl"]).split(" ")[0], []).append(r)
    for impl, items in by_impl.items():
        met = sum(1 for r in items if r.get("met"))
        out.append(f"  {impl}: {met} of {len(items)} met")
    return out


def format_report(report: dict[str, Any]) -> str:
    """The header (date, machine, implementations, how cells are measured), one group per
    benchmark, the targets, the notes and the missing peers."""
    m, s = report["machine"], report["settings"]
    head = [
        f"framepipe {m['framepipe']} bench core: {s['depth']} run, "
        f"{len(report['sections'])} benchmarks in {s['elapsed_s']:.0f} s"
        + ("" if s["depth"] == "full" else " (--full: all of them, deeper)"),
        f"run {m['date']} on {m['platform']}",
        f"{m['cpu_count']} CPUs ({m['cpus_usable']} usable); {m['cpu_model']}; {m['python']}",
        "implementations:",
        *(f"  {name:<15} {text}" for name, text in report["implementations"].items()),
    ]
    out = fit(head)
    out += wrap(
        f"each cell: the best of {s['repeat']} run(s) of ~{s['seconds']:g} s, the writer in a "
        f"forked child ({s['placement_text']}); ratio: against the best stdlib row of the "
        "same benchmark (or the one its target names); spread: slowest run / fastest; "
        "MB = 10^6 bytes",
        "",
        "",
    )
    by_bench: dict[str, list[Row]] = {}
    for item in report["rows"]:
        by_bench.setdefault(str(item["bench"]), []).append(item)
    for section in report["sections"]:
        rows = by_bench.pop(section["name"], [])
        if not rows:
            continue
        out.append("")
        out += wrap(f"{section['title']}: {section['about']}", "")
        if section["target"]:
            out += wrap(f"target: {section['target']}", "  ")
        out += format_table(rows)
    for rows in by_bench.values():  # rows of a group no section describes
        out.append("")
        out.append(str(rows[0].get("title") or rows[0]["bench"]))
        out += format_table(rows)
    lines = _target_lines(report["rows"])
    if lines:
        out += ["", *lines]
    missed = sum(1 for r in targets(report["rows"]) if not r.get("met"))
    busy = busy_lines(report.get("load"), spreads_of(report["rows"]), missed)
    if busy:
        out += ["", *(w for line in busy for w in wrap(line, ""))]
    if report["notes"]:
        out += ["", "notes:"]
        for note in report["notes"]:
            out += wrap(note, "  ")
    if report.get("missing"):
        out += ["", *wrap(report["missing"], "")]
    return "\n".join(fit(out))
