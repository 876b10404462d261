"""``python -m framepipe bench``: the command runs, shows progress, fits 100 columns, explains its
rows, writes JSON, names the missing peers, draws (or clearly refuses to draw) its chart.

Speed is never asserted here (that is the benchmark's job): only that every number is a real,
positive measurement and that ratios and targets are worked out from them consistently. The
runs are the ``--quick`` profile on one or two benchmarks, so each takes seconds.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import pytest
from _helpers import child_env, run_python

import framepipe
from framepipe.bench import cli, core, rows, table
from framepipe.bench.loader import format_report as loader_report
from framepipe.bench.workers import format_report as workers_report

CHEAP = "oneway-64B"  # 64 B messages: one short run per implementation
HANG_GUARD = 300  # seconds; a hung command fails the test instead of blocking the suite
WIDTH = 100
ITEM_7 = {  # the compiled core's targets, judged by the default run
    "pingpong-64B": "<= 0.6x",
    "pingpong-64B-1cpu": "<= 0.6x",
    "oneway-64B": ">= 2.5x",
    "timeout-64B": ">= 7x",
    "oneway-1MiB": ">= 1.6x",
    "oneway-16MiB": ">= 1.6x",
    "death": "<= 1.1x",
}


@pytest.fixture(autouse=True)
def _width_100(monkeypatch: pytest.MonkeyPatch) -> None:
    """Reports wrap at $COLUMNS (the terminal's width); these tests read them at 100."""
    monkeypatch.setenv("COLUMNS", str(WIDTH))


def run_bench(
    *args: str, hide: tuple[str, ...] = (), tmp: Path | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m framepipe bench ARGS``. Each module in ``hide`` fails to import in that
    process (a module of that name that raises ImportError comes first on the path), as it
    does where it is not installed."""
    env = child_env(COLUMNS=str(WIDTH))  # the width the tests read reports at
    if hide:
        assert tmp is not None
        shadow = tmp / "not-installed"
        shadow.mkdir(exist_ok=True)
        for name in hide:
            (shadow / f"{name}.py").write_text(f'raise ImportError("No module named {name}")\n')
        env["PYTHONPATH"] = os.pathsep.join([str(shadow), env["PYTHONPATH"]])
    return run_python("-m", "framepipe", "bench", *args, timeout=HANG_GUARD, env=env)


def assert_fits(text: str) -> None:
    long = [line for line in text.splitlines() if len(line) > WIDTH]
    assert not long, f"{len(long)} lines wider than {WIDTH} columns, e.g. {long[0]!r}"


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One quick run of the 64 B one-way rows with both cores: stdout, stderr, the JSON."""
    path = tmp_path_factory.mktemp("bench") / "report.json"
    proc = run_bench("--quick", "--rows", CHEAP, "--impls", "c,python", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    return {"out": proc.stdout, "err": proc.stderr, "report": json.loads(path.read_text())}


def test_progress_goes_to_stderr_as_rows_run(quick: dict[str, Any]) -> None:
    err = quick["err"].splitlines()
    assert err[0].startswith("bench core: 1 benchmarks")
    assert "[1/1] one-way 64 B" in err
    for impl in quick["report"]["implementations"]:
        assert any(line.split()[: len(impl.split())] == impl.split() for line in err), impl
    assert any(line.startswith("done in ") for line in err)
    assert "[1/1]" not in quick["out"], "progress leaked into the table"


def test_table_fits_100_columns_and_explains_rows(quick: dict[str, Any]) -> None:
    out = quick["out"]
    assert_fits(out)
    section = next(s for s in core.SECTIONS if s.name == CHEAP)
    flat = " ".join(out.split())
    assert f"one-way 64 B: {section.about}" in flat
    assert f"target: {section.target}" in flat
    header = next(line for line in out.splitlines() if line.split()[:2] == ["impl", "result"])
    assert header.split() == list(table.HEADER)
    assert "targets (framepipe's cores with their default settings):" in out


def test_json_holds_the_machine_settings_and_every_implementation(quick: dict[str, Any]) -> None:
    report = quick["report"]
    machine = report["machine"]
    assert machine["cpu_count"] >= 1
    assert machine["python"].endswith(platform.python_version())
    assert machine["date"][:2] == "20" and machine["framepipe"] == framepipe.__version__
    settings = report["settings"]
    assert settings["depth"] == "quick" and settings["repeat"] == 1
    assert settings["impls"] == ["c", "python"] and settings["elapsed_s"] > 0
    assert [s["name"] for s in report["sections"]] == [CHEAP]
    assert {"c", "python", "stdlib duplex", "stdlib simplex"} <= set(report["implementations"])
    assert [r["impl"] for r in report["rows"]] == list(report["implementations"])


def test_json_numbers_are_measurements_and_targets_follow_them(quick: dict[str, Any]) -> None:
    measured = quick["report"]["rows"]
    best = max(r["value"] for r in measured if r["family"] == "stdlib")
    for r in measured:
        assert not r.get("error"), r
        assert r["unit"] == "msg/s" and r["better"] == "higher" and r["value"] > 0
        assert r["mb_per_s"] == pytest.approx(r["value"] * 64 / 1e6)
        assert r["n"] >= 4 and r["seconds"] > 0 and len(r["runs"]) == 1
        assert r["ratio"] == pytest.approx(r["value"] / best)
        if r["impl"] in ("c", "python"):
            assert r["target"] == ">= 2.5x" and r["met"] is (r["ratio"] >= 2.5)
        else:
            assert r.get("target") is None and r["met"] is None


def test_default_run_holds_the_cores_targets() -> None:
    chosen = cli.selected(core.SECTIONS, [], full=False)
    assert {s.name for s in chosen} == set(ITEM_7)
    assert all(s.target and s.about for s in chosen)
    full = cli.selected(core.SECTIONS, [], full=True)
    assert [s.name for s in full] == [s.name for s in core.SECTIONS]
    assert cli.DEFAULT_IMPLS == ("c", "pyzmq"), "the targets are judged on c's defaults"


def test_death_rows_kill_real_children_and_judge_against_the_same_kills() -> None:
    proc = run_bench("--quick", "--rows", "death", "--json", "-")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    by_impl = {r["impl"]: r for r in report["rows"]}
    mine, stdlib = by_impl["c recv_bytes -> WriterDied"], by_impl["stdlib wait([conn, sentinel])"]
    kills = report["settings"]["kills"]
    assert mine["n"] == stdlib["n"] == kills
    for r in (mine, stdlib):
        assert not r.get("error"), r
        assert r["unit"] == "ms" and r["better"] == "lower"
        assert 0 < r["value"] <= r["p90_ms"]
    assert mine["stdlib_median_ms"] == pytest.approx(stdlib["value"], rel=1e-3)
    assert mine["ratio"] == pytest.approx(mine["value"] / stdlib["value"], rel=1e-3)
    assert mine["target"] == "<= 1.1x" and mine["met"] is (mine["ratio"] <= 1.1)
    assert "c recv_bytes -> WriterDied" in proc.stderr  # its progress line


def test_missing_peer_is_named_with_how_to_add_it(tmp_path: Path) -> None:
    proc = run_bench("--quick", "--rows", CHEAP, hide=("zmq",), tmp=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "pyzmq" not in proc.stdout.split("implementations:")[1].split("each cell")[0]
    flat = " ".join(proc.stdout.split())
    assert "not installed, so left out: pyzmq (pyzmq PAIR sockets beside the stdlib)" in flat
    assert "pip install 'framepipe[bench]'" in flat
    assert_fits(proc.stdout)


def test_plot_without_matplotlib_is_refused_before_the_run(tmp_path: Path) -> None:
    png = tmp_path / "chart.png"
    proc = run_bench("--rows", CHEAP, "--plot", str(png), hide=("matplotlib",), tmp=tmp_path)
    assert proc.returncode == 3
    assert "--plot" in proc.stderr and "needs matplotlib, which is not installed" in proc.stderr
    assert "pip install 'framepipe[bench]'" in proc.stderr
    assert "[1/1]" not in proc.stderr, "it ran the benchmark before refusing"
    assert not png.exists()


def test_plot_draws_a_png(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    png = tmp_path / "chart.png"
    proc = run_bench("--quick", "--rows", CHEAP, "--plot", str(png))
    assert proc.returncode == 0, proc.stderr
    assert f"the chart is in {png}" in proc.stderr
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_unknown_rows_and_impls_are_errors_that_list_the_choices() -> None:
    proc = run_bench("--rows", "no-such-bench")
    assert proc.returncode == 2
    assert "selects nothing" in proc.stderr and CHEAP in proc.stderr
    proc = run_bench("--impls", "c,rust")
    assert proc.returncode == 2
    assert "unknown rust" in proc.stderr and "c-read-ahead" in proc.stderr
    proc = run_bench("--seconds", "0")
    assert proc.returncode == 2 and "give a positive duration" in proc.stderr


def test_list_names_every_benchmark_and_whether_it_runs_by_default() -> None:
    proc = run_bench("--list")
    assert proc.returncode == 0
    listed = [line.split()[:2] for line in proc.stdout.splitlines()]
    assert [name for name, _ in listed] == [s.name for s in core.SECTIONS]
    for (name, mark), section in zip(listed, core.SECTIONS):
        assert mark == ("default" if section.default else "--full"), name


def test_rows_select_by_name_prefix_and_pattern() -> None:
    def pick(*names: str) -> list[str]:
        return [s.name for s in cli.selected(core.SECTIONS, names, full=False)]

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


def test_finish_judges_latency_against_the_duplex_pipe() -> None:
    measured = [
        rows.row("rt", "rt", "c", 6.0, "us/rt", better="lower", target="<= 0.6x", basis="duplex"),
        rows.row(
            "rt", "rt", "python", 30.0, "us/rt", better="lower", target="<= 0.6x", basis="duplex"
        ),
        rows.row("rt", "rt", "stdlib duplex", 20.0, "us/rt", better="lower", basis="duplex"),
        rows.row("rt", "rt", "stdlib simplex", 10.0, "us/rt", better="lower", basis="duplex"),
    ]
    rows.finish(measured)
    assert [r["vs_stdlib"] for r in measured] == pytest.approx([0.6, 3.0, 2.0, 1.0])
    assert [r["ratio"] for r in measured] == pytest.approx([0.3, 1.5, 1.0, 0.5])
    assert [r["met"] for r in measured] == [True, False, None, None]


def test_finish_leaves_a_failed_cell_unjudged_and_the_table_says_why() -> None:
    measured = [
        rows.row("x", "x", "c", None, "msg/s", target=">= 2x", error="WriterFailed: boom"),
        rows.row("x", "x", "stdlib duplex", 100.0, "msg/s"),
    ]
    rows.finish(measured)
    assert measured[0]["ratio"] is None and measured[0]["met"] is False
    lines = table.format_table(measured)
    assert lines[1].split()[:2] == ["c", "error"] and "MISSED" in lines[1]
    assert lines[-1].strip() == "c: WriterFailed: boom"


def test_target_text_is_checked() -> None:
    assert rows.Target.parse(">= 2.5x").met(2.5)
    assert not rows.Target.parse("<= 0.6x").met(0.61)
    with pytest.raises(ValueError, match="write it like '>= 2.5x'"):
        rows.Target.parse("at least 2.5")


def _synthetic_report() -> dict[str, Any]:
    """A report with the longest names and errors the table has to hold."""
    long_error = "CellTimeout: the writer ran past 120 s and was killed " * 3
    measured = [
        rows.row(
            "death",
            "writer death seen",
            "c recv_bytes -> WriterDied",
            0.7,
            "ms",
            better="lower",
            target="<= 1.1x",
            basis="stdlib",
            p90_ms=0.9,
        ),
        rows.row(
            "death",
            "writer death seen",
            "stdlib wait([conn, sentinel])",
            0.6,
            "ms",
            better="lower",
            p90_ms=0.8,
        ),
        rows.row(
            "death",
            "writer death seen",
            "c, fork child of 1234567 MB, and more",
            2.0,
            "ms",
            better="lower",
        ),
        rows.row(
            "oneway-16MiB",
            "one-way 16 MiB",
            "c read-ahead pipes",
            None,
            "msg/s",
            target=">= 1.6x",
            error=long_error,
        ),
        rows.row(
            "oneway-16MiB",
            "one-way 16 MiB",
            "stdlib simplex",
            123456.7,
            "msg/s",
            mb_per_s=99999999.9,
            runs=[0.1, 0.3],
        ),
    ]
    rows.finish(measured)
    sections = [s for s in core.SECTIONS if s.name in ("death", "oneway-16MiB")]
    return {
        "machine": {
            "framepipe": "0.1.0",
            "date": "2026-11-24T00:00:00+00:00",
            "platform": "L" * 90,
            "cpu_count": 2,
            "cpus_usable": 2,
            "cpu_model": "M" * 60,
            "python": "CPython 3.11",
        },
        "settings": {
            "depth": "default",
            "elapsed_s": 20.0,
            "repeat": 3,
            "seconds": 0.12,
            "placement_text": "CPUs chosen by the scheduler",
        },
        "implementations": {"c read-ahead pipes": "D " * 70},
        "sections": [
            {"name": s.name, "title": s.title, "about": s.about, "target": s.target}
            for s in sections
        ],
        "notes": ["N " * 80],
        "missing": "not installed, so left out: " + "pyzmq (x), " * 12,
        "rows": measured,
    }


def test_report_fits_100_columns_whatever_the_names() -> None:
    text = table.format_report(_synthetic_report())
    assert_fits(text)
    assert "c recv_bytes -> WriterDied" in text and "CellTimeout" in text
    assert "targets (framepipe's cores with their default settings):" in text


def test_workers_and_loader_reports_fit_and_explain() -> None:
    machine = _synthetic_report()["machine"]
    workers = {
        "machine": {**machine, "core": "c"},
        "settings": {"repeat": 3},
        "workers": 2,
        "tasks": 20000,
        "targets": [],
        "missing_line": "not installed: " + "loky, " * 30,
        "rows": {
            "a pool with a long name": {
                "submit": 1e5,
                "map": 1e5,
                "rt_median": 1e-4,
                "rt_p99": 2e-4,
                "mb1": 1e9,
                "mb16": 1e9,
                "two_arg": "BrokenProcessPool; pool then raises " * 3,
                "crash": {"error": "E" * 80, "to_failure": 0.002, "to_serving": None},
                "timeout_late": None,
            },
        },
    }
    text = workers_report(workers)
    assert_fits(text)
    assert "throughput: submit/s and map/s are no-op tasks per second" in text
    loader = {
        "machine": machine,
        "peers": {"numpy": "2"},
        "targets": [],
        "missing_line": None,
        "settings": {"workers": 2, "repeat": 1, "seconds": 0.3, "engine": "c", "torch": None},
        "rows": [
            {
                "size": 4096,
                "batch": None,
                "loader": "torch DataLoader",
                "items_per_s": None,
                "note": "not installed: " + "x" * 90,
            }
        ],
    }
    text = loader_report(loader)
    assert_fits(text)
    assert "each row: float32 arrays made by a dataset in the workers" in text


def test_workers_suite_runs_with_progress_and_json(tmp_path: Path) -> None:
    path = tmp_path / "workers.json"
    proc = run_bench("workers", "--quick", "--rows", "framepipe", "--json", str(path))
    assert proc.returncode == 0, proc.stderr
    assert "[1/1] framepipe Pool: throughput" in proc.stderr
    assert_fits(proc.stdout)
    report = json.loads(path.read_text())
    assert list(report["rows"]) == ["framepipe Pool"]
    got = report["rows"]["framepipe Pool"]
    assert got["submit"] > 0 and got["map"] > 0 and 0 < got["rt_median"] <= got["rt_p99"]
    assert got["crash"]["queued_ok"] == 20
    assert 0 < got["mixed"] <= 1.5 and report["bare_rt"] > 0
    assert "mixed is the efficiency" in proc.stdout and "bare transport" in proc.stdout
    proc = run_bench("workers", "--rows", "no-such-pool")
    assert proc.returncode == 2 and "ProcessPoolExecutor" in proc.stderr


def test_workers_scaling_table(tmp_path: Path) -> None:
    path = tmp_path / "scaling.json"
    proc = run_bench(
        "workers",
        "--quick",
        "--rows",
        "framepipe,ProcessPool",
        "--workers",
        "1,3",
        "--json",
        str(path),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(path.read_text())
    assert list(report["scaling"]) == ["1", "3"]
    for at in report["scaling"].values():
        assert list(at) == ["framepipe Pool", "ProcessPoolExecutor"]
        assert all(r["submit"] > 0 and r["map"] > 0 and r["mixed"] > 0 for r in at.values())
    assert {t["what"] for t in report["targets"]} >= {
        "no-op submit/s vs the fastest peer, 1 workers",
        "mixed durations efficiency, 3 workers",
    }
    assert_fits(proc.stdout)  # the table too, beside the JSON file
    lines = proc.stdout.splitlines()
    assert "mixed durations efficiency" in lines
    header = lines[lines.index("submit/s") + 1]
    assert header.split() == ["pool", "N=1", "N=3"]
    proc = run_bench("workers", "--workers", "0,x")
    assert proc.returncode == 2 and "positive worker counts" in proc.stderr


def test_loader_suite_runs_with_progress_and_json(tmp_path: Path) -> None:
    pytest.importorskip("numpy")
    path = tmp_path / "loader.json"
    proc = run_bench(
        "loader", "--quick", "--seconds", "0.05", "--rows", "4KiB", "--json", str(path)
    )
    assert proc.returncode == 0, proc.stderr
    assert any(
        "4 KiB" in line and "framepipe DataLoader" in line for line in proc.stderr.splitlines()
    )
    assert_fits(proc.stdout)
    report = json.loads(path.read_text())
    by = {r["loader"]: r for r in report["rows"]}
    assert {r["size"] for r in report["rows"]} == {4096}
    assert by["framepipe DataLoader"]["items_per_s"] > 0
    assert by["bare transport"]["vs_bare"] == pytest.approx(1.0)
    if report["settings"]["torch"] is None:
        assert "pip install 'framepipe[bench]'" in by["torch DataLoader"]["note"]


def test_loader_report_shape_in_process(
    monkeypatch: pytest.MonkeyPatch, no_leftover_processes: None
) -> None:
    pytest.importorskip("numpy")
    from framepipe.bench import loader

    monkeypatch.setattr(loader, "torch_version", lambda: None)
    monkeypatch.setattr(loader, "SIZES", (4096,))
    report = loader.run(quick=True, seconds=0.05)
    got = {(r["loader"], r["batch"]): r for r in report["rows"]}
    assert got[("framepipe DataLoader", None)]["items_per_s"] > 0
    assert got[("bare transport", None)]["vs_bare"] == pytest.approx(1.0)
    assert got[("torch DataLoader", None)]["note"] == loader.TORCH_HINT
    assert got[("framepipe DataLoader", 32)]["items_per_s"] > 0
    text = loader.format_report(report)
    assert loader.TORCH_HINT in text
    assert_fits(text)
    assert any(t["what"].startswith("4 KiB: vs bare") for t in report["targets"])


def test_python_m_framepipe_bench_is_the_same_command() -> None:
    proc = run_python("-m", "framepipe.bench", "--list", timeout=HANG_GUARD)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == run_bench("--list").stdout


def test_pyzmq_rows_run_when_installed() -> None:
    pytest.importorskip("zmq")
    proc = run_bench(
        "--quick", "--impls", "pyzmq", "--rows", "oneway-64B,timeout-64B,numpy-1MiB",
        "--json", "-",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    measured = [r for r in json.loads(proc.stdout)["rows"] if r["impl"] == "pyzmq"]
    assert [r["bench"] for r in measured] == ["oneway-64B", "timeout-64B", "numpy-1MiB"]
    for r in measured:
        assert not r.get("error"), r
        assert r["value"] > 0 and r["family"] == "other" and r["met"] is None
