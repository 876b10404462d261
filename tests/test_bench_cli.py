"""``python -m framepipe bench``: the command runs, and its report has the documented shape.

Speed is not asserted here (that is the benchmark's job); only that every number is a real,
positive measurement and that ratios and targets are filled in.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import framepipe
from framepipe import _bench

CHEAP = "oneway-64B"  # a cheap row: 64 B messages, one short run per implementation
HANG_GUARD = 300  # seconds; a hung command fails the test instead of blocking the suite


def run_bench(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    src = str(Path(framepipe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (src, env.get("PYTHONPATH")) if p)
    return subprocess.run(
        [sys.executable, "-m", "framepipe", "bench", *args],
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
        env=env,
        check=False,
    )


@pytest.fixture(scope="module")
def report() -> dict[str, Any]:
    proc = run_bench("--quick", "--json", "--only", CHEAP, "--seconds", "0.05")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)  # type: ignore[no-any-return]


def test_header_describes_the_machine_and_the_run(report: dict[str, Any]) -> None:
    machine = report["machine"]
    assert machine["cpu_count"] >= 1
    assert machine["python"].endswith(platform.python_version())
    assert machine["platform"] and machine["date"][:2] == "20"
    assert report["settings"]["quick"] is True
    assert report["settings"]["repeat"] == 1


def test_every_implementation_has_a_row(report: dict[str, Any]) -> None:
    impls = set(report["implementations"])
    assert {"stdlib duplex", "stdlib simplex"} <= impls
    assert impls & {"c", "python"}, "no framepipe implementation ran"
    assert [r["impl"] for r in report["rows"]] == list(report["implementations"])
    assert {r["bench"] for r in report["rows"]} == {CHEAP}


def test_missing_implementations_are_reported(report: dict[str, Any]) -> None:
    for name in ("c", "python"):
        if name not in report["implementations"]:
            assert any(f"framepipe {name!r} skipped" in note for note in report["notes"])


def test_numbers_are_positive(report: dict[str, Any]) -> None:
    for row in report["rows"]:
        assert not row.get("error"), row
        assert row["unit"] == "msg/s" and row["better"] == "higher"
        assert row["value"] > 0
        assert row["mb_per_s"] == pytest.approx(row["value"] * 64 / 1e6)
        assert row["n"] >= 4 and row["seconds"] > 0
        assert row["vs_stdlib"] > 0 and row["vs_duplex"] > 0


def test_ratios_and_targets(report: dict[str, Any]) -> None:
    rows = report["rows"]
    stdlib = [r for r in rows if r["family"] == "stdlib"]
    assert max(r["vs_stdlib"] for r in stdlib) == pytest.approx(1.0)
    duplex = next(r for r in rows if r["impl"] == "stdlib duplex")
    assert duplex["vs_duplex"] == pytest.approx(1.0)
    for row in rows:
        if row["family"] == "framepipe":
            assert row["target"] == ">= 2.5x"
            assert row["met"] is (row["vs_stdlib"] >= 2.5)
        else:
            assert row.get("target") is None and row["met"] is None


def test_table_output() -> None:
    proc = run_bench("--quick", "--only", CHEAP, "--seconds", "0.02")
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("framepipe ") and " bench, " in lines[0]
    header = next(line for line in lines if line.startswith("bench "))
    for column in ("impl", "result", "MB/s", "vs stdlib", "vs duplex", "target", "met"):
        assert column in header
    assert any("stdlib simplex" in line and "msg/s" in line for line in lines)


def test_unknown_name_is_an_error_that_lists_the_names() -> None:
    proc = run_bench("--only", "no-such-bench")
    assert proc.returncode == 2
    assert "selects nothing" in proc.stderr and CHEAP in proc.stderr


def test_list_names_every_section() -> None:
    proc = run_bench("--list")
    assert proc.returncode == 0
    names = [line.split()[0] for line in proc.stdout.splitlines()]
    assert names == [s.name for s in _bench.SECTIONS]


def test_only_selects_by_name_prefix_and_pattern() -> None:
    def pick(*only: str) -> list[str]:
        return [s.name for s in _bench.selected(_bench.SECTIONS, only)]

    assert pick("oneway") == [
        "oneway-64B",
        "oneway-4KiB",
        "oneway-64KiB",
        "oneway-1MiB",
        "oneway-16MiB",
    ]
    assert pick("numpy-16MiB,pingpong") == ["pingpong-64B", "pingpong-64B-1cpu", "numpy-16MiB"]
    assert pick("pingpong-64B") == ["pingpong-64B"]
    assert pick("*-1MiB") == ["oneway-1MiB", "numpy-1MiB"]
    assert pick() == [s.name for s in _bench.SECTIONS]


def test_finish_judges_lower_is_better_against_the_fastest_stdlib() -> None:
    rows = [
        _bench.row("rt", "rt", "c", 6.0, "us/rt", better="lower", target="<= 0.6x"),
        _bench.row("rt", "rt", "python", 30.0, "us/rt", better="lower", target="<= 0.6x"),
        _bench.row("rt", "rt", "stdlib duplex", 20.0, "us/rt", better="lower"),
        _bench.row("rt", "rt", "stdlib simplex", 10.0, "us/rt", better="lower"),
    ]
    _bench.finish(rows)
    assert [r["vs_stdlib"] for r in rows] == pytest.approx([0.6, 3.0, 2.0, 1.0])
    assert [r["vs_duplex"] for r in rows] == pytest.approx([0.3, 1.5, 1.0, 0.5])
    assert [r["met"] for r in rows] == [True, False, None, None]


def test_finish_leaves_a_failed_cell_unjudged() -> None:
    rows = [
        _bench.row("x", "x", "c", None, "msg/s", target=">= 2x", error="WriterFailed: boom"),
        _bench.row("x", "x", "stdlib duplex", 100.0, "msg/s"),
    ]
    _bench.finish(rows)
    assert rows[0]["vs_stdlib"] is None and rows[0]["met"] is False
    assert "error" in _bench.format_table(rows).splitlines()[2]


def test_optional_section_without_its_module_is_a_note() -> None:
    section = _bench.optional_section("ghost", "ghost", "framepipe._no_such_module", "bench")
    ctx = _bench.Context(impls=_bench.stdlib_impls())
    assert section.run(ctx) == []
    assert ctx.notes == ["ghost rows skipped: framepipe._no_such_module is not present"]


def test_normalize_takes_rows_of_other_shapes() -> None:
    rows = _bench.normalize(
        [{"case": "ValueError", "us_per_roundtrip": 150.0}], "exceptions", "exceptions"
    )
    assert rows[0]["impl"] == "ValueError" and rows[0]["value"] == 150.0
    assert rows[0]["unit"] == "us per roundtrip" and rows[0]["better"] == "lower"
    rows = _bench.normalize({"n": 3, "rows": [{"method": "m", "n": 3, "hits": 7}]}, "w", "w")
    assert rows[0]["impl"] == "m" and rows[0]["value"] == 7.0 and rows[0]["better"] == "higher"
    assert rows[0]["bench"] == "w" and rows[0]["family"] == "other"


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="split placement needs 2 CPUs")
def test_pinned_placement_runs_and_is_reported() -> None:
    proc = run_bench(
        "--quick", "--json", "--only", CHEAP, "--seconds", "0.02", "--placement", "split"
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["settings"]["placement"] == "split"
    assert all(row["value"] > 0 for row in report["rows"])


def test_detection_rows_kill_real_children_and_judge_only_small_ones() -> None:
    proc = run_bench("--quick", "--json", "--only", "watch")
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)["rows"]
    methods = [r["impl"] for r in rows]
    assert methods[:2] == [
        "framepipe recv_bytes -> WriterDied",
        "framepipe recv_bytes -> WriterDied, reader holds the write end",
    ]
    assert "multiprocessing.connection.wait([conn, sentinel])" in methods
    for row in rows:
        assert not row.get("error"), row
        assert row["unit"] == "ms" and row["better"] == "lower"
        assert 0 < row["value"] <= row["p90_ms"]
        assert row["n"] == 5
        judged = row["family"] == "framepipe" and row.get("small_child", True)
        if judged:
            assert row["target"] == "median <= 2 ms, p90 <= 5 ms"
            assert row["met"] is (row["value"] <= 2.0 and row["p90_ms"] <= 5.0)
        else:
            assert row.get("target") is None and row["met"] is None
    fork_row = next(r for r in rows if "fork child" in r["impl"])
    assert fork_row["small_child"] is False
