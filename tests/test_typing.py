"""The types of the public API, checked by ``mypy --strict`` as its users run it.

Each file in ``tests/typing/`` is a program that must pass (``usage.py`` also runs in CI); each
file in ``tests/typing/misuse/`` is a sample of misuses that must fail, every line that must be
reported marked with ``# E: <error code>``. The samples and the programs are checked in one mypy
run, against the framepipe these tests import; a mark that mypy does not report, or an error on
a line without a mark, fails the sample.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import framepipe

PACKAGE = Path(framepipe.__file__).parent
TYPING = Path(__file__).parent / "typing"
PROGRAMS = sorted(TYPING.glob("*.py"))
MISUSES = sorted(p for p in (TYPING / "misuse").glob("*.py") if not p.name.startswith("_"))
MARK = re.compile(r"#\s*E:\s*([\w-]+)\s*$")
ERROR = re.compile(
    r"^(?P<path>.+?):(?P<line>\d+): error: (?P<text>.*?)(?:\s+\[(?P<code>[\w-]+)\])?$"
)


def _marks(path: Path) -> set[tuple[int, str]]:
    """``(line, error code)`` for every line of ``path`` marked ``# E: <code>``."""
    found = set()
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        match = MARK.search(line)
        if match:
            found.add((number, match.group(1)))
    return found


@pytest.fixture(scope="module")
def mypy_report(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[tuple[int, str]]]:
    """One ``mypy --strict`` run over the programs and every sample: ``{file name: {(line,
    code)}}`` of the errors it reported."""
    # mypy as a module of the interpreter under test, so that it checks the samples against
    # that interpreter's standard library (a mypy found on PATH may belong to another Python)
    if importlib.util.find_spec("mypy") is None:
        pytest.skip(f"mypy is not importable by {sys.executable}: pip install mypy to run this")
    # framepipe as its users get it: its types used, its own modules' findings not reported
    env = dict(os.environ)
    if PACKAGE.parent.name not in ("site-packages", "dist-packages"):
        env["MYPYPATH"] = str(PACKAGE.parent)  # a checkout's src/ (mypy finds an installed one)
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",
            "--no-incremental",
            "--cache-dir",
            os.devnull,
            "--hide-error-context",
            "--no-pretty",
            "--show-error-codes",
            *map(str, PROGRAMS),
            *map(str, MISUSES),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path_factory.mktemp("mypy"),
        timeout=600,
    )
    assert result.returncode in (0, 1), result.stdout + result.stderr  # 2: mypy itself failed
    report: dict[str, set[tuple[int, str]]] = {p.name: set() for p in (*PROGRAMS, *MISUSES)}
    for line in result.stdout.splitlines():
        match = ERROR.match(line)
        if match:
            name = Path(match.group("path")).name
            assert name in report, f"mypy reported a file outside the samples: {line}"
            report[name].add((int(match.group("line")), match.group("code") or "?"))
    assert sum(map(len, report.values())) >= len(MISUSES), result.stdout + result.stderr
    return report


def test_there_are_samples_of_misuse() -> None:
    assert len(MISUSES) >= 5
    for path in MISUSES:
        assert _marks(path), f"{path.name} marks no line that must fail"


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.stem for p in PROGRAMS])
def test_each_program_passes(mypy_report: dict[str, set[tuple[int, str]]], program: Path) -> None:
    assert {p.name for p in PROGRAMS} >= {"usage.py", "watch_remote_guard.py"}
    assert mypy_report[program.name] == set(), f"{program.name}: mypy --strict reported errors"


@pytest.mark.parametrize("sample", MISUSES, ids=[p.stem for p in MISUSES])
def test_each_misuse_is_reported(
    mypy_report: dict[str, set[tuple[int, str]]], sample: Path
) -> None:
    expected = _marks(sample)
    reported = mypy_report[sample.name]
    missed = sorted(expected - reported)
    unmarked = sorted(reported - expected)
    assert not missed, f"{sample.name}: mypy --strict accepted these misuses (line, code): {missed}"
    assert not unmarked, f"{sample.name}: errors on lines not marked to fail: {unmarked}"


def test_the_marks_are_read_as_written(tmp_path: Path) -> None:
    # The checks above are only as good as the marks they read.
    sample = tmp_path / "sample.py"
    sample.write_text("x = 1\ny: str = x  # E: assignment\nz = 2  #E:arg-type\n")
    assert _marks(sample) == {(2, "assignment"), (3, "arg-type")}
    line = "/a/b/sample.py:2: error: Incompatible types in assignment  [assignment]"
    match = ERROR.match(line)
    assert match is not None
    assert (match.group("path"), match.group("line"), match.group("code")) == (
        "/a/b/sample.py",
        "2",
        "assignment",
    )
