"""The house: imports that only point down, one version, the guard module, typed public API."""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest

import framepipe
import framepipe._version
import framepipe.guard
import framepipe.remote
import framepipe.watch

PACKAGE = Path(framepipe.__file__).parent

# --- the layers: every module, and which way it may import ------------------------------------

# Bottom up: each layer, and each module in it with the framepipe modules it imports (at its top
# level, under TYPE_CHECKING included). A module imports nothing of framepipe that is not listed,
# and only modules of its own layer or below; the table has no cycle. Package __init__ modules
# are named by their package ("__init__" for framepipe itself); a new module must find its place
# here. framepipe.bench is on top: no library module imports it, only the command line.
LAYERS: list[tuple[str, dict[str, set[str]]]] = [
    (
        "leaves: the version, errors, the wire format, argument checks, lazy imports, closing",
        {
            "_version": set(),
            "errors": set(),
            "_lazy": set(),
            "_wire": set(),
            "_args": set(),
            "_width": set(),
            "_closing": set(),
        },
    ),
    (
        "what the engines read and write: spin policy, stream errors, pickled objects",
        {
            "_spin": set(),
            "_stream_errors": {"_wire", "errors"},
            "_pickling": {"_wire", "errors"},
        },
    ),
    (
        "the engines: the compiled core (its Cython source) and the pure-Python twin",
        {
            "_core": {"_args", "_spin", "_stream_errors", "_wire", "errors"},
            "_pycore": {"_args", "_spin", "_stream_errors", "_wire", "errors"},
        },
    ),
    (
        "liveness: native faults, process death, the watcher",
        {
            "_fault_echo": set(),  # C (csrc/fault_echo/), a leaf
            "_faults": {"_fault_echo"},
            "_liveness": {"_faults", "errors"},
            "watch": {"_liveness"},
        },
    ),
    (
        "exceptions across processes",
        {
            "_unpickle": {"errors"},
            "_rebuild": set(),
            "remote": {"_rebuild", "_unpickle"},
        },
    ),
    (
        "the connection over either engine, and the switch",
        {
            "_pipes": {"_args", "_closing"},
            "_aio": {"_args", "_lazy", "_pickling", "_stream_errors", "_wire", "errors"},
            "_control": {"_unpickle", "_wire", "errors", "remote", "watch"},
            "_connection": {
                "_aio",  # deferred, see DEFERRED
                "_args",
                "_control",
                "_core",  # the stub, under TYPE_CHECKING
                "_pickling",
                "_pipes",
                "_stream_errors",
                "_unpickle",
                "_wire",
                "errors",
            },
            "_connection_c": {"_connection", "_core", "_pipes"},
            "_connection_py": {"_connection", "_pipes", "_pycore"},
            "_impl": {"_connection"},  # and the two above, by name (see _connection.load_engine)
            "connection": {"_args", "_connection", "_impl", "_lazy", "errors"},
        },
    ),
    (
        "the guard",
        {"guard": {"_faults", "_liveness", "errors", "remote"}},
    ),
    (
        "the package: the public names of the layers below",
        {"__init__": {"_impl", "_pipes", "_version", "connection", "errors", "guard", "remote"}},
    ),
    (
        "workers",
        {
            "workers.errors": {"errors", "remote"},
            "workers._launch": set(),
            "workers._options": {"_args"},
            "workers._atexit": set(),
            "workers._lifecycle": set(),
            "workers._mainguard": {"workers.errors"},
            "workers._pin": set(),
            "workers._byvalue": set(),
            "workers._progress": {"workers.errors"},
            "workers._resume": set(),
            "workers._shm": {"workers.errors"},
            "workers._stderr": set(),
            "workers._child": {"workers._launch"},
            "workers._process": {
                "_faults",
                "_liveness",
                "_spin",
                "connection",
                "errors",
                "remote",
                "workers._child",
                "workers._launch",
                "workers._options",
                "workers._stderr",
                "workers.errors",
            },
            "workers._protocol": set(),
            "workers._tasks": {"_lazy", "workers.errors"},
            "workers._taskloop": {
                "_spin",
                "remote",
                "workers._byvalue",
                "workers._process",
                "workers._protocol",
                "workers._shm",
                "workers._tasks",
                "workers.errors",
            },
            "workers._poller": set(),
            "workers._slot": {
                "workers._lifecycle",
                "workers._process",
                "workers._shm",
                "workers._tasks",
            },
            "workers._policy": {"_args", "workers.errors"},
            "workers._corebase": {
                "_spin",
                "errors",
                "workers._atexit",
                "workers._byvalue",
                "workers._mainguard",
                "workers._options",
                "workers._policy",
                "workers._poller",
                "workers._process",
                "workers._slot",
                "workers._taskloop",
                "workers._tasks",
                "workers.errors",
            },
            "workers._scheduling": {
                "workers._corebase",
                "workers._protocol",
                "workers._slot",
                "workers._tasks",
                "workers.errors",
            },
            "workers._lending": {
                "_spin",
                "workers._corebase",
                "workers._poller",
                "workers._slot",
                "workers._tasks",
                "workers.errors",
            },
            "workers._answers": {
                "errors",
                "workers._corebase",
                "workers._lifecycle",
                "workers._protocol",
                "workers._shm",
                "workers._slot",
                "workers._tasks",
                "workers.errors",
            },
            "workers._failures": {
                "errors",
                "workers._corebase",
                "workers._slot",
                "workers._tasks",
                "workers.errors",
            },
            "workers._submitting": {
                "workers._byvalue",
                "workers._corebase",
                "workers._poller",
                "workers._protocol",
                "workers._scheduling",
                "workers._tasks",
                "workers.errors",
            },
            "workers._dispatch": {
                "workers._answers",
                "workers._atexit",
                "workers._child",
                "workers._corebase",
                "workers._failures",
                "workers._lending",
                "workers._lifecycle",
                "workers._poller",
                "workers._process",
                "workers._protocol",
                "workers._scheduling",
                "workers._shm",
                "workers._slot",
                "workers._submitting",
                "workers._taskloop",
                "workers._tasks",
                "workers.errors",
            },
            "workers.worker": {
                "_args",
                "_closing",
                "_lazy",
                "workers._dispatch",
                "workers._options",
                "workers._policy",
                "workers._process",
                "workers._stderr",
                "workers.errors",
            },
            "workers.pool": {
                "_args",
                "_lazy",
                "remote",
                "workers._byvalue",
                "workers._dispatch",
                "workers._options",
                "workers._policy",
                "workers._progress",
                "workers._tasks",
                "workers.errors",
                "workers.worker",
            },
            "workers.loader.wire": {"workers._shm"},
            "workers.loader.errors": {"workers.errors"},
            "workers.loader.collate": set(),
            "workers.loader.credits": set(),
            "workers.loader.samplers": set(),
            "workers.loader.worker": {
                "remote",
                "workers._pin",
                "workers._process",
                "workers._shm",
                "workers.errors",
                "workers.loader.collate",
                "workers.loader.credits",
                "workers.loader.wire",
            },
            "workers.loader.recovery": {
                "errors",
                "workers.errors",
                "workers.loader.errors",
                "workers.loader.wire",
            },
            "workers.loader.manager": {
                "workers.loader.collate",
                "_spin",
                "connection",
                "errors",
                "remote",
                "workers._atexit",
                "workers._byvalue",
                "workers._child",
                "workers._lifecycle",
                "workers._options",
                "workers._pin",
                "workers._policy",
                "workers._process",
                "workers._shm",
                "workers.errors",
                "workers.loader.credits",
                "workers.loader.errors",
                "workers.loader.recovery",
                "workers.loader.wire",
                "workers.loader.worker",
            },
            "workers.loader.epoch": {
                "workers.errors",
                "workers.loader.manager",
                "workers.loader.wire",
                "workers.loader.worker",
            },
            "workers.loader.dataloader": {
                "_args",
                "workers._options",
                "workers._mainguard",
                "workers._pin",
                "workers._progress",
                "workers._resume",
                "workers.loader.epoch",
                "workers.loader.manager",
                "workers.loader.samplers",
                "workers.loader.worker",
            },
            "workers.loader": {
                "workers.loader.collate",
                "workers.loader.dataloader",
                "workers.loader.errors",
                "workers.loader.worker",
            },
            "workers._rank": {
                "guard",
                "remote",
                "watch",
                "workers._child",
                "workers._launch",
                "workers._lifecycle",
                "workers._stderr",
            },
            "workers._group_report": {
                "errors",
                "guard",
                "remote",
                "workers._rank",
                "workers._stderr",
                "workers.errors",
            },
            "workers._group_stop": {"errors", "workers._rank"},
            "workers._group_supervisor": {
                "connection",
                "remote",
                "watch",
                "workers._byvalue",
                "workers._child",
                "workers._group_report",
                "workers._group_stop",
                "workers._launch",
                "workers._lifecycle",
                "workers._policy",
                "workers._rank",
                "workers._stderr",
                "workers.errors",
            },
            "workers.group": {
                "_args",
                "_lazy",
                "guard",
                "workers._atexit",
                "workers._child",
                "workers._group_report",
                "workers._group_supervisor",
                "workers._mainguard",
                "workers._options",
                "workers._rank",
            },
            "workers": {
                "workers._dispatch",
                "workers.errors",
                "workers.group",
                "workers.loader",
                "workers.pool",
                "workers.worker",
            },
            "workers.elastic": {"guard", "workers._process", "workers._stderr", "workers.group"},
        },
    ),
    (
        "drop-ins for the reference subprocess_rpc",
        {
            "subprocess_rpc": {"_impl", "_pipes", "errors", "remote"},
            "joblib": {"workers"},
            "compat": {"connection", "guard", "remote", "subprocess_rpc"},
        },
    ),
    (
        "tools: the benchmark and the command line",
        {
            "bench.rows": set(),
            "bench.load": set(),
            "bench.table": {"_width", "bench.load", "bench.rows"},
            "bench.peers": {"_impl", "bench.rows"},
            "bench.runner": {"bench.peers", "bench.rows"},
            "bench.plot": {"bench.peers", "bench.rows"},
            "bench.output": {"bench.peers", "bench.plot"},
            "bench.machine": {"_impl", "_version"},
            "bench.remote": {"bench.rows", "bench.runner", "remote"},
            "bench.detection": {"bench.peers", "bench.rows", "bench.runner", "errors", "watch"},
            "bench.core": {
                "bench.detection",
                "bench.peers",
                "bench.remote",
                "bench.rows",
                "bench.runner",
            },
            "bench.workers": {
                "bench.load",
                "connection",
                "bench.machine",
                "bench.output",
                "bench.peers",
                "bench.plot",
                "bench.table",
                "workers",
            },
            "bench.loader": {
                "bench.machine",
                "bench.output",
                "bench.peers",
                "bench.plot",
                "bench.table",
                "connection",
                "workers",
            },
            "bench.cli": {
                "bench.core",
                "bench.load",
                "bench.loader",
                "bench.machine",
                "bench.output",
                "bench.peers",
                "bench.plot",
                "bench.rows",
                "bench.runner",
                "bench.table",
                "bench.workers",
            },
            "bench": set(),
            "bench.__main__": {"bench.cli"},
            "_demo": {"_width", "remote", "workers"},
            "__main__": {"_demo", "_impl", "_version", "bench.cli"},
            "run": {"workers.elastic"},  # deferred, see DEFERRED
        },
    ),
]
LAYER = {module: i for i, (_, modules) in enumerate(LAYERS) for module in modules}
IMPORTS = {module: names for _, modules in LAYERS for module, names in modules.items()}
# Compiled modules: no Python source to read (_core's imports are read from _core.pyx).
COMPILED = {"_core", "_fault_echo"}
# Imports made inside a function, each for a stated reason; the imported module is still below.
DEFERRED = {
    ("_connection", "_aio"): "asyncio loads on a connection's first async call, not at import",
    ("run", "workers.elastic"): "torch loads when the command runs; without it, a message",
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def _source_modules() -> dict[str, Path]:
    """Every Python module of the package, by its name in the table."""
    return {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def _is_module(name: str) -> bool:
    return name in IMPORTS or name in _source_modules()


def _resolve(importer: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """The framepipe modules an import statement of ``importer`` names (a name imported from
    a package that is not a submodule is the package itself)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names if a.name.split(".")[0] == "framepipe"]
        return [n.removeprefix("framepipe").lstrip(".") or "__init__" for n in names]
    if node.level == 0:
        if not (node.module or "").startswith("framepipe"):
            return []
        base = (node.module or "").removeprefix("framepipe").lstrip(".").split(".")
        base = [b for b in base if b]
    else:
        is_package = _source_modules().get(importer, Path()).name == "__init__.py"
        package = [] if importer == "__init__" else importer.split(".")
        if not is_package:
            package = package[:-1]
        base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
        base = base + (node.module.split(".") if node.module else [])
    found = []
    for alias in node.names:
        sub = ".".join([*base, alias.name])
        found.append(sub if _is_module(sub) else ".".join(base) or "__init__")
    return found


def _framepipe_imports(module: str) -> list[tuple[str, int, bool]]:
    """``(module imported, line, at module level)`` for every framepipe import of ``module``
    (an import under ``if TYPE_CHECKING:`` or in a ``try:`` at module level is at module level;
    one in a function is not)."""
    if module == "_core":
        pyx = PACKAGE / "_core.pyx"
        if not pyx.exists():  # a wheel carries no Cython source: read the checkout's
            pyx = Path(__file__).parent.parent / "src" / "framepipe" / "_core.pyx"
        if not pyx.exists():
            pytest.skip("no _core.pyx here: neither installed nor in a checkout")
        found = []
        source = pyx.read_text(encoding="utf-8")
        for m in re.finditer(r"^([ \t]*)from \.(\w*) import ([^\n]+)", source, re.M):
            line = source.count("\n", 0, m.start()) + 1
            mods = [m.group(2)] if m.group(2) else re.findall(r"\w+", m.group(3))
            found += [(mod, line, not m.group(1)) for mod in mods]
        return found
    tree = ast.parse(_source_modules()[module].read_text(encoding="utf-8"))
    found: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                found.extend(
                    (name, child.lineno, not in_function) for name in _resolve(module, child)
                )
            nested = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, in_function or nested)

    visit(tree, False)
    return found


def test_every_module_has_its_place_in_the_layers() -> None:
    modules = set(_source_modules())
    assert not modules - IMPORTS.keys(), (
        f"modules with no place in LAYERS: {modules - IMPORTS.keys()}"
    )
    gone = IMPORTS.keys() - modules - COMPILED
    assert not gone, f"LAYERS lists modules that do not exist: {gone}"
    assert len(LAYER) == sum(len(m) for _, m in LAYERS), "a module is listed twice"


@pytest.mark.parametrize("module", sorted(IMPORTS.keys() - {"_fault_echo"}))
def test_imports_only_point_down(module: str) -> None:
    made = set()
    for name, line, at_top in _framepipe_imports(module):
        where = f"framepipe {module} line {line}"
        assert name in IMPORTS, f"{where}: imports {name}, which has no place in LAYERS"
        assert name in IMPORTS[module], f"{where}: imports {name}, not listed in LAYERS"
        assert LAYER[name] <= LAYER[module], (
            f"{where}: imports {name} of the layer above ({LAYERS[LAYER[name]][0]})"
        )
        if not at_top:
            assert (module, name) in DEFERRED, f"{where}: a deferred import of {name}"
        made.add(name)
    # the table stays honest: every import listed is one made
    assert IMPORTS[module] == made, f"{module}: listed but not imported: {IMPORTS[module] - made}"


def test_the_layer_table_has_no_cycle() -> None:
    done: set[str] = set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in path, " -> ".join((*path, module))
        if module not in done:
            for below in IMPORTS.get(module, ()):
                visit(below, (*path, module))
            done.add(module)

    for module in IMPORTS:
        visit(module, ())
    for module, names in IMPORTS.items():
        for name in names:
            assert LAYER[name] <= LAYER[module], f"{module} -> {name} points up"


def test_no_library_module_imports_the_benchmark() -> None:
    # The benchmark is a tool on top: it imports the library, never the other way.
    tools = {m for m in IMPORTS if m == "bench" or m.startswith("bench.")} | {"__main__"}
    for module, names in IMPORTS.items():
        if module not in tools:
            assert not {n for n in names if n == "bench" or n.startswith("bench.")}, module
    assert LAYER["bench.cli"] == len(LAYERS) - 1


def test_the_import_reader_sees_every_kind_of_import() -> None:
    # The checks above are only as good as what _framepipe_imports finds.
    assert ("workers", 1, True) not in _framepipe_imports("__main__")
    main = {(n, top) for n, _, top in _framepipe_imports("__main__")}
    assert main == {
        ("_impl", True),
        ("_version", True),
        ("bench.cli", True),
        ("_demo", True),
    }
    assert ("_aio", False) in {(n, top) for n, _, top in _framepipe_imports("_connection")}
    assert ("_core", True) in {(n, top) for n, _, top in _framepipe_imports("_connection")}
    assert {n for n, _, _ in _framepipe_imports("_demo")} == {"_width", "remote", "workers"}
    assert ("workers.elastic", False) in {(n, top) for n, _, top in _framepipe_imports("run")}
    assert {n for n, _, _ in _framepipe_imports("bench.machine")} == {"_impl", "_version"}
    assert {n for n, _, _ in _framepipe_imports("_faults")} == {"_fault_echo"}
    assert {"_spin", "_stream_errors"} <= {n for n, _, _ in _framepipe_imports("_core")}


def test_the_public_names_stay_where_they_were() -> None:
    from framepipe import _liveness, _unpickle

    for name in framepipe.watch.__all__:
        assert hasattr(framepipe.watch, name), name
    assert framepipe.watch.Liveness is _liveness.Liveness
    assert framepipe.watch.resolve_target is _liveness.resolve_target
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


def test_every_package_is_declared_for_the_install() -> None:
    # A package missing from pyproject's list is left out of the wheel: every test that
    # imports it fails against the installed framepipe, and so does every user.
    root = Path(__file__).resolve().parents[1]
    pyproject = root / "pyproject.toml"
    if not (root / "src" / "framepipe").is_dir() or not pyproject.exists():
        pytest.skip("not a source tree")
    text = pyproject.read_text(encoding="utf-8")
    line = next(x for x in text.splitlines() if x.startswith("packages = ["))
    declared = set(re.findall(r'"([\w.]+)"', line))
    src = root / "src"
    found = {
        ".".join(init.parent.relative_to(src).parts)
        for init in src.glob("framepipe/**/__init__.py")
    }
    assert found == declared, f"pyproject.toml's packages = [...] must list {sorted(found)}"
    # and the framepipe under test has them all (an install from before a package was added)
    for name in found:
        assert (PACKAGE.parent / name.replace(".", "/") / "__init__.py").exists(), name


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
