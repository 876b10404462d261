"""The documentation: every example runs as shown, no page names a machine's paths, the README
stays short.

Each fenced ``python`` block of README.md and docs/*.md is a complete program, run here in a
fresh interpreter (a file in a temporary directory, which is also its working directory) and
in a session of its own, so that whatever it started is found and killed afterwards. Two HTML
comments, on the line before a fence (blank lines allowed), say more about a block:

- ``<!-- fragment -->`` before a ``python`` block: a fragment on purpose (a signature, a line
  that needs a cluster); it is not run. There should be few.
- ``<!-- output -->`` before the block that follows a program: what the program prints on
  stdout, compared line by line. ``<...>`` in it stands for any text within one line (a pid, a
  time, a path), as the pages say.
"""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import inspect
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

import framepipe

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_LIMIT = 12 * 1024
# The pages whose examples run: the README and the site's pages (the archive only records).
EXAMPLE_FILES = [README, *sorted(DOCS.glob("*.md"))] if DOCS.is_dir() else [README]
# Every Markdown file a user reads, the archive included.
ALL_DOCS = [
    *sorted(ROOT.glob("*.md")),
    *(sorted(DOCS.rglob("*.md")) if DOCS.is_dir() else []),
]
RUN_TIMEOUT = 120.0  # seconds; an example takes well under 5 s, the margin is for a busy machine
PLACEHOLDER = "<...>"
FRAGMENT = "<!-- fragment -->"
OUTPUT = "<!-- output -->"
# Optional peers an example may use: without them installed, its test is skipped.
OPTIONAL = frozenset(
    {"numpy", "torch", "dask", "distributed", "cloudpickle", "joblib", "sklearn", "tqdm", "zmq"}
)
# What a page's output shows of torch's types, and what the page says is printed instead
# without torch (a batch of NumPy arrays).
WITHOUT_TORCH = {"Tensor": "ndarray"}
# Names whose use starts a process: such a program needs the __main__ guard (spawn imports the
# main module again in each worker).
STARTS_PROCESSES = re.compile(r"\b(Pool|Worker|DataLoader|WorkerGroup|Process|Executor)\(")
MACHINE_PATH = re.compile(r"/work/|/root/|/home/[A-Za-z0-9_.-]+|/tmp/fp-|/Users/")

pytestmark = pytest.mark.skipif(not DOCS.is_dir(), reason="no docs/ beside the tests")


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


@dataclass
class Block:
    path: Path
    line: int  # of the opening fence, 1-based
    lang: str
    code: str
    marker: str | None  # the HTML comment before the fence, if any

    def where(self) -> str:
        return f"{_rel(self.path)}:{self.line}"


def _blocks(path: Path) -> list[Block]:
    """The fenced blocks of a Markdown file, with the marker before each."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    marker: str | None = None
    i = 0
    while i < len(lines):
        stripped = lines[i].strip()
        if stripped.startswith("```"):
            lang = stripped[3:].strip()
            start = i
            i += 1
            body = []
            while i < len(lines) and lines[i].strip() != "```":
                body.append(lines[i])
                i += 1
            if i == len(lines):
                raise AssertionError(f"{_rel(path)}:{start + 1}: a fence that is never closed")
            code = textwrap.dedent("\n".join(body) + "\n")  # a block inside a list item
            blocks.append(Block(path, start + 1, lang, code, marker))
            marker = None
        elif stripped in (FRAGMENT, OUTPUT):
            marker = stripped
        elif stripped:
            marker = None  # a marker counts only right before its fence
        i += 1
    return blocks


@dataclass
class Example:
    block: Block
    index: int  # among the file's python blocks, from 1
    expected: str | None


def _examples() -> list[Example]:
    out = []
    for path in EXAMPLE_FILES:
        blocks = _blocks(path)
        index = 0
        for n, block in enumerate(blocks):
            if block.lang != "python":
                continue
            index += 1
            if block.marker == FRAGMENT:
                continue
            after = blocks[n + 1] if n + 1 < len(blocks) else None
            expected = after.code if after is not None and after.marker == OUTPUT else None
            out.append(Example(block, index, expected))
    return out


EXAMPLES = _examples()


def test_the_docs_have_examples_to_run():
    """The collection below found the pages and their programs (a parser that found nothing
    would pass every test vacuously)."""
    assert README.is_file()
    pages = {ex.block.path for ex in EXAMPLES}
    assert README in pages
    assert len(pages) >= 5, sorted(_rel(p) for p in pages)
    assert sum(ex.expected is not None for ex in EXAMPLES) >= 5


@pytest.mark.parametrize("path", ALL_DOCS, ids=_rel)
def test_no_machine_paths(path):
    hits = [
        f"{_rel(path)}:{n}: {line.strip()}"
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if MACHINE_PATH.search(line)
    ]
    assert not hits, "absolute paths of a machine in the docs:\n" + "\n".join(hits)


def test_readme_is_short():
    size = README.stat().st_size
    assert size <= README_LIMIT, (
        f"README.md is {size} bytes, over {README_LIMIT}: move reference material to docs/"
    )


def _modules_in_the_map() -> set[str]:
    """The modules named in the table of docs/architecture.md ("Where each thing lives"), as
    paths below src/framepipe/: a name without a folder in a cell shares the folder of the
    cell's first name; a folder (``bench/``) stands for every module in it."""
    text = (DOCS / "architecture.md").read_text()
    table = text.split("## Where each thing lives", 1)[1].split("\n## ", 1)[0]
    named: set[str] = set()
    for line in table.splitlines():
        if not line.startswith("| `"):
            continue
        folder = ""
        for name in re.findall(r"`([\w/.]+)`", line.split(" | ")[0]):
            if "/" in name:
                folder = name[: name.rindex("/") + 1] if not name.endswith("/") else ""
            named.add(name if "/" in name or not folder else folder + name)
    return named


def test_the_architecture_page_maps_every_module():
    """Each module of the package is in the architecture page's map, and each name there is a
    module (a renamed or moved module makes the page wrong)."""
    src = ROOT / "src" / "framepipe"
    if not src.is_dir():
        pytest.skip("not a source tree")
    named = _modules_in_the_map()
    folders = {n for n in named if n.endswith("/")}
    modules = {
        str(p.relative_to(src))
        for p in src.rglob("*.py")
        if "__pycache__" not in p.parts
        and not (p.name == "__init__.py" and p.parent != src and p.parent.name != "workers")
    }
    modules |= {str(p.relative_to(src)) for p in src.glob("*.pyx")}
    unmapped = sorted(m for m in modules - named if not any(m.startswith(f) for f in folders))
    assert not unmapped, f"modules missing from docs/architecture.md's map: {unmapped}"
    missing = sorted(n for n in named if not (src / n).exists())
    assert not missing, f"docs/architecture.md's map names modules that do not exist: {missing}"


# The classes whose signature a page shows as a fragment (``Name(arg=default, ...)``).
SIGNATURES = {
    "Pool": "framepipe.workers:Pool",
    "Worker": "framepipe.workers:Worker",
    "DataLoader": "framepipe.workers:DataLoader",
}


def _signature_fragments() -> list[tuple[Block, str, ast.arguments]]:
    out = []
    for path in EXAMPLE_FILES:
        for block in _blocks(path):
            name = block.code.split("(", 1)[0]
            if block.marker == FRAGMENT and name in SIGNATURES:
                tree = ast.parse("def " + block.code.strip() + ": pass")
                out.append((block, name, tree.body[0].args))  # type: ignore[attr-defined]
    return out


def test_the_signatures_the_pages_show_are_the_code_s():
    """Each parameter a page's signature names exists, in that order and of that kind, with
    that default; none is left out."""
    fragments = _signature_fragments()
    assert {name for _, name, _ in fragments} == set(SIGNATURES)
    for block, name, args in fragments:
        module, attr = SIGNATURES[name].split(":")
        real = inspect.signature(getattr(importlib.import_module(module), attr))
        shown = [(a.arg, "positional") for a in args.args]
        shown += [(a.arg, "keyword") for a in args.kwonlyargs]
        kinds = {
            inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
            inspect.Parameter.KEYWORD_ONLY: "keyword",
        }
        code = [(p.name, kinds.get(p.kind, str(p.kind))) for p in real.parameters.values()]
        assert shown == code, f"{block.where()}: the page shows {shown}, the code has {code}"
        defaults = dict(zip([a.arg for a in args.args][::-1], args.defaults[::-1]))
        defaults |= {a.arg: d for a, d in zip(args.kwonlyargs, args.kw_defaults) if d}
        for p in real.parameters.values():
            page = defaults.get(p.name)
            if p.default is inspect.Parameter.empty:
                assert page is None, f"{block.where()}: {p.name} has no default in the code"
                continue
            assert page is not None, f"{block.where()}: {p.name}'s default is not shown"
            assert ast.literal_eval(page) == p.default, (
                f"{block.where()}: {p.name}={ast.unparse(page)} on the page, "
                f"{p.default!r} in the code"
            )


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=_rel)
def test_markers_sit_where_they_mean_something(path):
    """A fragment marker is on a python block; an output marker follows a program."""
    blocks = _blocks(path)
    for n, block in enumerate(blocks):
        if block.marker == FRAGMENT:
            assert block.lang == "python", (
                f"{block.where()}: a fragment marker on a non-python block"
            )
        if block.marker == OUTPUT:
            before = blocks[n - 1] if n else None
            assert before is not None and before.lang == "python" and before.marker != FRAGMENT, (
                f"{block.where()}: an output marker that follows no program"
            )
            assert block.lang == "text", f"{block.where()}: an output block must be ```text"
    text = path.read_text(encoding="utf-8")
    markers = text.count(FRAGMENT) + text.count(OUTPUT)
    assert markers == sum(b.marker is not None for b in blocks), (
        f"{_rel(path)}: a marker that is not right before a fence"
    )


def test_the_output_matcher():
    """The comparison used below: placeholders match within a line, nothing else is loose."""
    assert _matches("pid <...> died\n", "pid 4242 died\n")
    assert _matches("a\n<...>\nb\n", "a\n\nb\n")
    assert not _matches("pid <...> died\n", "pid 4242 lived\n")
    assert not _matches("a\n", "a\nb\n")
    assert not _matches("x (1)\n", "x 1\n")  # the rest is literal


def _matches(expected: str, actual: str) -> bool:
    want = expected.rstrip("\n").split("\n")
    got = [line.rstrip() for line in actual.rstrip("\n").split("\n")]
    if len(want) != len(got):
        return False
    for w, g in zip(want, got):
        pattern = ".*?".join(re.escape(part) for part in w.rstrip().split(PLACEHOLDER))
        if not re.fullmatch(pattern, g):
            return False
    return True


def _imports(code: str) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _session(sid: int) -> list[psutil.Process]:
    """The live processes of session ``sid`` (every process an example started, workers in
    process groups of their own included)."""
    out = []
    for p in psutil.process_iter():
        try:
            if os.getsid(p.pid) == sid and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (OSError, psutil.Error):
            continue
    return out


def _kill_session(sid: int, grace: float) -> list[int]:
    """Wait ``grace`` seconds for the session's processes to end, then SIGKILL the rest;
    returns the pids that had to be killed."""
    deadline = time.monotonic() + grace
    left = _session(sid)
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = _session(sid)
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.kill()
    return [p.pid for p in left]


def test_leftovers_are_found_and_killed():
    """The clean-up used below finds a process an example left behind, in a process group of
    its own, and kills it."""
    code = "import os, time\nif os.fork() == 0:\n    os.setpgid(0, 0)\n    time.sleep(60)\n"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    try:
        assert proc.wait(timeout=30) == 0
        killed = _kill_session(proc.pid, grace=0.2)
        assert len(killed) == 1, killed
        deadline = time.monotonic() + 10
        while _session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _session(proc.pid)
    finally:
        _kill_session(proc.pid, grace=0)


@pytest.mark.parametrize(
    "example", EXAMPLES, ids=[f"{_rel(ex.block.path)}-block{ex.index}" for ex in EXAMPLES]
)
def test_example_runs_as_shown(example, tmp_path):
    block = example.block
    code = block.code
    ast.parse(code, filename=block.where())  # a syntax error names the page and line
    missing = sorted(m for m in _imports(code) & OPTIONAL if importlib.util.find_spec(m) is None)
    if missing:
        pytest.skip(f"{block.where()} needs {', '.join(missing)}")
    if STARTS_PROCESSES.search(code):
        assert 'if __name__ == "__main__":' in code, (
            f'{block.where()} starts processes: it needs an `if __name__ == "__main__":` guard'
        )

    program = tmp_path / f"example_{block.path.stem}_{example.index}.py"
    program.write_text(code, encoding="utf-8")
    env = dict(os.environ)
    # the framepipe these tests import: the checkout's src/, or an installed package
    package_root = str(Path(framepipe.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.Popen(
        [sys.executable, str(program)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        try:
            out, err = proc.communicate(timeout=RUN_TIMEOUT)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(
                f"{block.where()} did not finish within {RUN_TIMEOUT:g} s\n"
                f"stdout:\n{out}\nstderr (end):\n{err[-3000:]}"
            )
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        leftovers = _kill_session(proc.pid, grace=10.0)
    assert proc.returncode == 0, (
        f"{block.where()} exited with {proc.returncode}\n"
        f"stdout:\n{out}\nstderr (end):\n{err[-3000:]}"
    )
    assert not leftovers, f"{block.where()} left processes running: {leftovers}"
    if example.expected is not None:
        expected = example.expected
        if importlib.util.find_spec("torch") is None:
            for word, instead in WITHOUT_TORCH.items():
                expected = re.sub(rf"\b{word}\b", instead, expected)
        assert _matches(expected, out), (
            f"{block.where()} printed something else than the page shows\n"
            f"--- the page:\n{expected}--- the program:\n{out}"
            f"--- stderr (end):\n{err[-2000:]}"
        )
