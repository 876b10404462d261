"""The results model: a row is one measured cell (one implementation in one benchmark), a plain
dict so it goes to JSON as it is. :func:`finish` adds the ratios against the stdlib and judges
the targets; nothing here measures or prints."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "KiB",
    "MiB",
    "STDLIB_DUPLEX",
    "STDLIB_SIMPLEX",
    "Row",
    "Target",
    "family_of",
    "finish",
    "judged",
    "ok",
    "row",
    "size_id",
    "size_label",
]

Row = dict[str, Any]
"""One measured cell. Keys: ``bench`` (the group id, what ``--rows`` selects), ``title``,
``impl``, ``family`` (``framepipe`` | ``stdlib`` | ``other``), ``value``, ``unit``, ``better``
(``higher`` | ``lower``); optional ``mb_per_s``, ``n``, ``seconds``, ``runs``, ``target`` (such
as ``">= 2.5x"``), ``basis`` (``stdlib``: the target is judged against the best stdlib row of
the group; ``duplex``: against ``stdlib duplex``), ``error`` (then ``value`` is None), ``note``.
:func:`finish` fills ``vs_stdlib``, ``vs_duplex``, ``ratio`` (against the basis) and ``met``."""

KiB = 1024
MiB = 1024 * KiB

STDLIB_DUPLEX = "stdlib duplex"
STDLIB_SIMPLEX = "stdlib simplex"


def size_label(size: int) -> str:
    """``64 B``, ``4 KiB``, ``16 MiB``."""
    for unit, scale in (("MiB", MiB), ("KiB", KiB)):
        if size >= scale and size % scale == 0:
            return f"{size // scale} {unit}"
    return f"{size} B"


def size_id(size: int) -> str:
    """``64B``, ``4KiB``, ``16MiB``: the size as it appears in a bench name."""
    return size_label(size).replace(" ", "")


def family_of(impl: str) -> str:
    """``framepipe`` for framepipe's cores (``c``, ``python`` and their variants), ``stdlib``
    for ``multiprocessing``'s, ``other`` for the rest."""
    first = impl.split(" ")[0]
    if first in ("c", "python", "framepipe"):
        return "framepipe"
    if impl.startswith(("stdlib", "multiprocessing")):
        return "stdlib"
    return "other"


def row(
    bench: str,
    title: str,
    impl: str,
    value: float | None,
    unit: str,
    *,
    family: str | None = None,
    better: str = "higher",
    **extra: Any,
) -> Row:
    """Build a row (see :data:`Row`)."""
    out: Row = {
        "bench": bench,
        "title": title,
        "impl": impl,
        "family": family or family_of(impl),
        "value": value,
        "unit": unit,
        "better": better,
    }
    out.update(extra)
    return out


def ok(item: Row) -> bool:
    """Whether the row holds a measurement (a positive number and no error)."""
    value = item.get("value")
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and value > 0
        and not item.get("error")
    )


@dataclass(frozen=True)
class Target:
    """A ratio goal against the stdlib, such as ``>= 2.5x`` or ``<= 0.6x``."""

    op: str
    ratio: float

    @classmethod
    def parse(cls, text: str) -> Target:
        """Read ``">= 2.5x"``; a ValueError says what the form is."""
        op, _, number = text.strip().partition(" ")
        if op not in (">=", "<=") or not number.endswith("x"):
            raise ValueError(f"bad target {text!r}; write it like '>= 2.5x' or '<= 0.6x'")
        return cls(op, float(number[:-1]))

    def met(self, ratio: float) -> bool:
        """Whether ``ratio`` reaches the goal."""
        return ratio >= self.ratio if self.op == ">=" else ratio <= self.ratio

    def __str__(self) -> str:
        return f"{self.op} {self.ratio:g}x"


def finish(rows: list[Row]) -> list[Row]:
    """Fill, where a family of rows did not set them: ``vs_stdlib`` (against the best stdlib row
    of the same bench: the highest rate or the lowest latency), ``vs_duplex`` (against
    ``stdlib duplex``), ``ratio`` (against the row's ``basis``, ``stdlib`` by default) and
    ``met`` (the target judged on ``ratio``; None where there is no target). Returns ``rows``."""
    groups: dict[str, list[Row]] = {}
    for item in rows:
        groups.setdefault(str(item["bench"]), []).append(item)
    for group in groups.values():
        stdlib = [r for r in group if r.get("family") == "stdlib" and ok(r)]
        lower = any(r.get("better") == "lower" for r in group)
        best = None
        if stdlib:
            best = (min if lower else max)(float(r["value"]) for r in stdlib)
        duplex = next((float(r["value"]) for r in stdlib if r["impl"] == STDLIB_DUPLEX), None)
        for item in group:
            if not ok(item):
                item.setdefault("vs_stdlib", None)
                item.setdefault("vs_duplex", None)
                item.setdefault("ratio", None)
                item.setdefault("met", False if item.get("target") else None)
                continue
            value = float(item["value"])
            item.setdefault("vs_stdlib", value / best if best else None)
            item.setdefault("vs_duplex", value / duplex if duplex else None)
            basis = item.get("basis", "stdlib")
            item.setdefault("ratio", item["vs_duplex"] if basis == "duplex" else item["vs_stdlib"])
            target, ratio = item.get("target"), item.get("ratio")
            if "met" in item:
                continue  # the family judged its own target
            if target and ratio is not None:
                item["met"] = Target.parse(str(target)).met(float(ratio))
            else:
                item["met"] = False if target else None
    return rows


def judged(rows: Sequence[Row]) -> list[Row]:
    """The rows that carry a target."""
    return [r for r in rows if r.get("target")]
