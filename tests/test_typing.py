"""The public API's types: ``tests/typing/usage.py`` passes ``mypy --strict``, and every
sample in ``tests/typing/misuse/`` fails it with the error its ``# E: code`` comment names, on
that line (a signature that lost its types would let the misuse through)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mypy")

ROOT = Path(__file__).resolve().parent.parent
TYPING = ROOT / "tests" / "typing"
MISUSE = sorted(p for p in (TYPING / "misuse").glob("*.py") if not p.name.startswith("_"))
_MARK = re.compile(r"#\s*E:\s*([a-z-]+)")
_ERROR = re.compile(r"^(?P<path>[^:]+):(?P<line>\d+): error: .*\[(?P<code>[a-z-]+)\]$")


def _mypy(*files: Path) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, MYPYPATH=str(ROOT / "src"))
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--strict",
            "--follow-imports=silent",  # the samples' errors only, not the library's own
            "--no-error-summary",
            "--show-error-codes",
            "--no-pretty",
            *map(str, files),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def misuse_errors() -> dict[str, set[tuple[int, str]]]:
    """(line, code) of every error mypy reports, per sample file name (one run for all)."""
    out = _mypy(*MISUSE)
    found: dict[str, set[tuple[int, str]]] = {}
    for line in out.stdout.splitlines():
        m = _ERROR.match(line)
        if m:
            name = Path(m["path"]).name
            found.setdefault(name, set()).add((int(m["line"]), m["code"]))
    return found


def test_there_are_misuse_samples_and_each_marks_its_error():
    assert len(MISUSE) >= 10
    for path in MISUSE:
        marks = [i for i, line in enumerate(path.read_text().splitlines(), 1) if _MARK.search(line)]
        assert len(marks) == 1, f"{path.name}: mark the one line that must fail with # E: code"


@pytest.mark.parametrize("sample", MISUSE, ids=[p.stem for p in MISUSE])
def test_misuse_fails_mypy_strict(sample, misuse_errors):
    lines = sample.read_text().splitlines()
    (expected,) = [
        (i, m[1]) for i, line in enumerate(lines, 1) if (m := _MARK.search(line)) is not None
    ]
    got = misuse_errors.get(sample.name, set())
    assert expected in got, f"{sample.name}: expected {expected}, mypy reported {sorted(got)}"
    # and nothing else: a sample fails for its one reason
    assert got == {expected}, f"{sample.name}: mypy also reported {sorted(got - {expected})}"


def test_the_usage_program_passes_mypy_strict():
    out = _mypy(TYPING / "usage.py")
    assert out.returncode == 0, out.stdout + out.stderr
