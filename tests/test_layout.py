"""The house: imports that only point down, one version, the guard module, typed public API."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import pytest

import framepipe
import framepipe._version
import framepipe.guard
import framepipe.remote
import framepipe.watch

PACKAGE = Path(framepipe.__file__).parent

# Each module and the framepipe modules it may import (directly below it). A module imports
# nothing from framepipe unless listed; a new import must find its place here.
LAYERS: dict[str, set[str]] = {
    "_version": set(),
    "errors": set(),
    "_faults": {"_fault_echo"},  # framepipe._fault_echo is C (csrc/fault_echo/), a leaf
    "_proc": {"_faults", "errors"},
    "watch": {"_proc"},
    "_unpickle": {"errors"},
    "remote": {"_unpickle"},
    "guard": {"_faults", "_proc", "errors", "remote"},
}


def _framepipe_imports(tree: ast.Module) -> list[tuple[str, ast.stmt, bool]]:
    """(module imported, node, at module level) for every import of a framepipe module."""
    found: list[tuple[str, ast.stmt, bool]] = []
    top = set(map(id, tree.body))
    for node in tree.body:
        if isinstance(node, ast.Try):  # an optional module, tried when the module is imported
            top.update(map(id, node.body))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            names = [node.module] if node.module else [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("framepipe"):
            names = [(node.module or "").removeprefix("framepipe").lstrip(".")]
        elif isinstance(node, ast.Import):
            names = [
                a.name.removeprefix("framepipe.")
                for a in node.names
                if a.name.startswith("framepipe.")
            ]
        else:
            continue
        found.extend((name.split(".")[0], node, id(node) in top) for name in names)
    return found


@pytest.mark.parametrize("module", sorted(LAYERS))
def test_imports_only_point_down(module: str) -> None:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text(encoding="utf-8"))
    for name, node, at_top in _framepipe_imports(tree):
        where = f"framepipe/{module}.py line {node.lineno}"
        assert at_top, f"{where}: a deferred import of framepipe.{name} (hides a cycle)"
        assert name in LAYERS[module], f"{where}: imports framepipe.{name}, not below it"
    for name in LAYERS[module]:  # the table stays honest: every import listed is one made
        assert name in {n for n, _, _ in _framepipe_imports(tree)}, f"{module} -> {name} unused"


def test_the_layer_table_has_no_cycle() -> None:
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module not in done:
            for below in LAYERS.get(module, ()):
                visit(below, (*path, module))
            done.add(module)

    for module in LAYERS:
        visit(module, ())


def test_the_public_names_stay_where_they_were() -> None:
    from framepipe import _proc, _unpickle

    for name in framepipe.watch.__all__:
        assert hasattr(framepipe.watch, name), name
    assert framepipe.watch.Liveness is _proc.Liveness
    assert framepipe.watch.resolve_target is _proc.resolve_target
    assert framepipe.remote.RefusedPayload is _unpickle.RefusedPayload
    assert framepipe.remote.RefusedPayload.__module__ == "framepipe.remote"
    for name in framepipe.remote.__all__:
        assert hasattr(framepipe.remote, name), name
    for name in framepipe.guard.__all__:
        assert hasattr(framepipe.guard, name), name
    for name in framepipe.__all__:
        assert hasattr(framepipe, name), name


# --- one version ----------------------------------------------------------------------------


def test_one_version() -> None:
    assert framepipe.__version__ == framepipe._version.__version__
    assert isinstance(framepipe.__version__, str) and framepipe.__version__[0].isdigit()
    try:
        installed = importlib.metadata.version("framepipe")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("framepipe is not installed: no package metadata to compare with")
    assert installed == framepipe.__version__


def test_the_version_is_declared_only_in_version_py() -> None:
    # Anything else that states the version must read it from _version.py.
    pyproject = PACKAGE.parent.parent / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not a source tree")
    text = pyproject.read_text(encoding="utf-8")
    version = framepipe.__version__
    assert f'version = "{version}"' not in text
    assert 'dynamic = ["version"]' in text.replace("'", '"')
    assert "framepipe._version.__version__" in text
    init = (PACKAGE / "__init__.py").read_text(encoding="utf-8")
    assert version not in init


# --- framepipe.guard, the module that can be called -------------------------------------------


def test_framepipe_guard_is_the_module_and_calls_the_function() -> None:
    import framepipe.guard as module

    assert isinstance(module, types.ModuleType)
    assert module is sys.modules["framepipe.guard"] is framepipe.guard
    assert module.fault_path is framepipe.guard.fault_path  # the module's own names
    from framepipe import guard

    assert guard is module
    with guard(label="called") as g:  # as users wrote it: with framepipe.guard(...)
        assert isinstance(g, framepipe.Guard) and g.label == "called"

    @guard
    def bare() -> int:
        return 41

    @guard(label="configured")
    def configured() -> int:
        return 1

    assert bare() + configured() == 42
    assert inspect.signature(guard) == inspect.signature(module.guard)
    with pytest.raises(TypeError):
        guard(None, "positional label")


# --- types: a user program checked by mypy --strict -----------------------------------------

USER_PROGRAM = '''
"""Uses the public API of watch, remote and guard as the docs do."""
from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import queue
import threading

import framepipe
import framepipe.guard as guard_module
from framepipe import guard
from framepipe.guard import ProcessFailure, fault_path, read_native_traceback, record
from framepipe.remote import (
    RefusedPayload,
    RemoteError,
    RemoteTraceback,
    dumps_exception,
    loads_exception,
    sender_label,
)
from framepipe.watch import Liveness, Watcher, dead_status_word, resolve_target, watcher


def worker(conn: multiprocessing.connection.Connection) -> None:
    metrics: queue.Queue[dict[str, str]] = queue.Queue()
    with guard(conn, label="loader", queue=metrics, stop_event=threading.Event()):
        raise KeyError("missing")


@guard
def bare() -> int:
    return 1


@record
def main() -> int:
    return bare()


def watch(process: multiprocessing.Process) -> str:
    with Liveness(process) as liveness:
        alive: bool = not liveness.poll_dead()
        code: int | None = liveness.status()[0]
        oom: bool | None = liveness.oom_killed()
        native: str | None = liveness.native_traceback()
        label: str | None = liveness.guard_label()
        err: framepipe.WriterDied = liveness.error(label="loader")
        handle: int = watcher().register(liveness, lambda dead: print(dead.pid))
        watcher().unregister(handle)
    pid, owner = resolve_target(process)
    word: int = dead_status_word(code)
    print(alive, oom, native, label, pid, owner, word, Watcher)
    return str(err)


def revive(data: bytes) -> BaseException:
    with sender_label("collector"):
        again = dumps_exception(ValueError("x"), label="loader")
    try:
        exc = loads_exception(again, allow=["builtins", KeyError])
    except RefusedPayload:
        raise
    if isinstance(exc, RemoteError):
        print(exc.remote_type)
    end = exc.__cause__
    if isinstance(end, RemoteTraceback):
        print(end.label, end.pid, end.text)
    failure = ProcessFailure(0, 1, 1, fault_path(1))
    tb: str | None = read_native_traceback(1)
    print(failure.host, failure.timestamp_ns, tb, guard_module.ERROR_FILE_ENV)
    return exc


version: str = framepipe.__version__
'''


def test_a_user_program_passes_mypy_strict(tmp_path: Path) -> None:
    # mypy as a module of the interpreter under test, so that it checks the program against
    # that interpreter's standard library and site-packages (a mypy found on PATH may belong to
    # another Python).
    if importlib.util.find_spec("mypy") is None:
        pytest.skip(f"mypy is not importable by {sys.executable}: pip install mypy to run this")
    program = tmp_path / "user_program.py"
    program.write_text(textwrap.dedent(USER_PROGRAM), encoding="utf-8")
    # framepipe as its users get it: its types used, its own modules' findings not reported
    env = dict(os.environ, MYPYPATH=str(PACKAGE.parent))
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
            str(program),
        ],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.startswith("Success"), result.stdout


# --- what a worker carries ------------------------------------------------------------------


def test_importing_framepipe_leaves_asyncio_for_the_async_methods() -> None:
    """asyncio (and ssl, which it imports) is imported by the first async call, and hmac
    (OpenSSL's libcrypto) by the first authkey handshake, not by framepipe: a worker process
    that never needs them is smaller, starts and dies sooner."""
    code = (
        "import sys\n"
        "import framepipe, framepipe.connection, framepipe.workers\n"
        "print(sorted(m for m in ('asyncio', 'ssl', 'hmac') if m in sys.modules))\n"
        "import asyncio\n"
        "from framepipe.connection import Pipe\n"
        "r, w = Pipe()\n"
        "async def main():\n"
        "    await w.send_async('hi')\n"
        "    return await r.recv_async(timeout=5)\n"
        "print(asyncio.run(main()))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    ).stdout.split("\n")
    assert out[0] == "[]", f"imported with framepipe: {out[0]}"
    assert out[1] == "hi"  # and the async methods still work once it is there
