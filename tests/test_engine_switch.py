"""The switch between the compiled core and its pure-Python twin, and their parity."""

from __future__ import annotations

import ast
import inspect
import os
import re
import shutil
import subprocess
import sys

import pytest
from _helpers import src_dir

import framepipe
from framepipe import _impl, _pycore

SRC = src_dir()
PACKAGE = os.path.dirname(os.path.abspath(framepipe.__file__))
REQUIRE = bool(os.environ.get("FRAMEPIPE_REQUIRE_EXTENSIONS"))
TIMEOUT = 60.0

REPORT = (
    "import framepipe; "
    "print(framepipe.implementation, framepipe.Connection.ENGINE, "
    "framepipe._impl.core.Engine.__module__)"
)


def extension_present() -> bool:
    try:
        _impl.load("c")
    except ImportError:
        return False
    return True


def run(
    code: str, path: str = SRC, *, script: str | None = None, cwd: str | None = None, **env: str
) -> subprocess.CompletedProcess:
    """Run ``code`` (or the file ``script``) in a fresh interpreter that imports framepipe from
    ``path``, with the FRAMEPIPE_* variables of this process replaced by ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("FRAMEPIPE_")}
    full.update(env)
    full["PYTHONPATH"] = path
    return subprocess.run(
        [sys.executable, script] if script else [sys.executable, "-c", code],
        env=full,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=cwd or path,
        check=False,
    )


def needs_extension() -> None:
    if not extension_present():
        if REQUIRE:
            pytest.fail("FRAMEPIPE_REQUIRE_EXTENSIONS is set but framepipe._core does not import")
        pytest.skip("the compiled core is not built")


@pytest.fixture
def tree_without_extension(tmp_path):
    """A copy of the package with no compiled core in it: an install without a compiler."""
    dest = tmp_path / "framepipe"
    shutil.copytree(
        PACKAGE,
        dest,
        ignore=shutil.ignore_patterns("_core.*", "_core", "__pycache__", "*.so", "*.pyd"),
    )
    assert not [p for p in os.listdir(dest) if p.startswith("_core")]
    return tmp_path


# --- the switch -------------------------------------------------------------------------------


def test_no_extensions_forces_the_python_core():
    res = run(REPORT, FRAMEPIPE_NO_EXTENSIONS="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["python", "python", "framepipe._pycore"]


def test_default_prefers_the_compiled_core():
    needs_extension()
    res = run(REPORT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["c", "c", "framepipe._core"]


def test_require_extensions_imports_the_compiled_core():
    needs_extension()
    res = run(REPORT, FRAMEPIPE_REQUIRE_EXTENSIONS="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["c", "c", "framepipe._core"]


def test_the_compiled_core_imports_when_required():
    if not REQUIRE:
        pytest.skip("FRAMEPIPE_REQUIRE_EXTENSIONS is not set")
    import framepipe._core as engine

    assert framepipe.implementation == "c" == _impl.core.ENGINE
    assert issubclass(framepipe.Connection, engine.Engine)
    assert _impl.available() == ["c", "python"]


def test_both_variables_set_is_an_import_error():
    res = run(REPORT, FRAMEPIPE_NO_EXTENSIONS="1", FRAMEPIPE_REQUIRE_EXTENSIONS="1")
    assert res.returncode != 0
    assert "ImportError" in res.stderr
    assert "FRAMEPIPE_NO_EXTENSIONS" in res.stderr and "FRAMEPIPE_REQUIRE_EXTENSIONS" in res.stderr


def test_missing_extension_falls_back_to_python(tree_without_extension):
    res = run(REPORT, path=str(tree_without_extension))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["python", "python", "framepipe._pycore"]
    res = run(
        "import framepipe; r, w = framepipe.connection.Pipe(False); w.send_bytes(b'ok');"
        "print(r.recv_bytes(timeout=5).decode())",
        path=str(tree_without_extension),
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ok"]


# What a user runs: framepipe imported at line 1, then again through a submodule, then by a
# process it starts (as a spawned worker does), which inherits its environment.
USER_PROGRAM = """\
import framepipe
import framepipe.connection
import subprocess, sys
print(framepipe.implementation)
subprocess.run([sys.executable, "-c", "import framepipe; print(framepipe.implementation)"], check=True)
"""


def run_user_program(tmp_path, path: str, **env: str) -> subprocess.CompletedProcess:
    """Run USER_PROGRAM as a script, importing framepipe from ``path``, with every warning
    shown each time it is raised (PYTHONWARNINGS=always, which its child inherits)."""
    script = tmp_path / "user_program.py"
    script.write_text(USER_PROGRAM)
    return run("", path, script=str(script), cwd=str(tmp_path), PYTHONWARNINGS="always", **env)


def test_missing_extension_warns_once_at_the_import(tree_without_extension, tmp_path):
    res = run_user_program(tmp_path, str(tree_without_extension))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["python", "python"]
    warnings = re.findall(r"^(.*):(\d+): RuntimeWarning: (.*)$", res.stderr, re.M)
    assert len(warnings) == 1, res.stderr  # one, in the program and not again in its child
    filename, line, message = warnings[0]
    assert (filename, line) == (str(tmp_path / "user_program.py"), "1"), res.stderr
    assert "compiled core (framepipe._core) is missing" in message
    assert "pure-Python core" in message and "slower" in message
    assert "C compiler and the Python headers" in message and "reinstall" in message
    assert "FRAMEPIPE_NO_EXTENSIONS=1" in message


def test_no_fallback_warning_when_the_python_core_is_chosen(tree_without_extension, tmp_path):
    res = run_user_program(tmp_path, str(tree_without_extension), FRAMEPIPE_NO_EXTENSIONS="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["python", "python"]
    assert "Warning" not in res.stderr, res.stderr


def test_no_fallback_warning_when_the_compiled_core_imports(tmp_path):
    needs_extension()
    res = run_user_program(tmp_path, SRC)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["c", "c"]
    assert "Warning" not in res.stderr, res.stderr


def test_missing_extension_is_an_import_error_when_required(tree_without_extension):
    res = run(REPORT, path=str(tree_without_extension), FRAMEPIPE_REQUIRE_EXTENSIONS="1")
    assert res.returncode != 0
    assert "ImportError" in res.stderr
    assert "FRAMEPIPE_REQUIRE_EXTENSIONS" in res.stderr


def test_broken_extension_falls_back_unless_required(tree_without_extension):
    core = tree_without_extension / "framepipe" / "_core.py"
    core.write_text("raise ImportError('this build of the core is broken')\n")
    res = run(REPORT, path=str(tree_without_extension))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["python", "python", "framepipe._pycore"]
    res = run(REPORT, path=str(tree_without_extension), FRAMEPIPE_REQUIRE_EXTENSIONS="1")
    assert res.returncode != 0
    assert "this build of the core is broken" in res.stderr


def test_load_and_available():
    core = _impl.load("python")
    assert core is _impl.load("python")  # built once
    assert core.ENGINE == _pycore.ENGINE == "python" and core.Engine is _pycore.Engine
    assert core.__name__ == "framepipe._connection_py"
    assert issubclass(core.Connection, _pycore.Engine)
    assert "python" in _impl.available()
    assert ("c" in _impl.available()) == extension_present()
    with pytest.raises(ValueError):
        _impl.load("fortran")
    assert framepipe.implementation in ("c", "python")
    assert framepipe.implementation == _impl.core.ENGINE == framepipe.Connection.ENGINE
    assert framepipe.Connection is _impl.core.Connection
    assert framepipe.connection.Connection is _impl.core.Connection
    assert framepipe.Pipe is _impl.core.Pipe


# --- the engine interface: _core.pyi, checked against both engines --------------------------

STUB = os.path.join(PACKAGE, "_core.pyi")


def _stub_signature(fn: ast.FunctionDef) -> inspect.Signature:
    """The signature a ``def`` of the stub declares (names, kinds, defaults; no annotations)."""
    params = []
    args = fn.args
    positional = args.posonlyargs + args.args
    defaults = [None] * (len(positional) - len(args.defaults)) + list(args.defaults)
    for i, (a, d) in enumerate(zip(positional, defaults)):
        kind = (
            inspect.Parameter.POSITIONAL_ONLY
            if i < len(args.posonlyargs)
            else inspect.Parameter.POSITIONAL_OR_KEYWORD
        )
        default = inspect.Parameter.empty if d is None else ast.literal_eval(d)
        params.append(inspect.Parameter(a.arg, kind, default=default))
    if args.vararg:
        params.append(inspect.Parameter(args.vararg.arg, inspect.Parameter.VAR_POSITIONAL))
    for a, d in zip(args.kwonlyargs, args.kw_defaults):
        default = inspect.Parameter.empty if d is None else ast.literal_eval(d)
        params.append(inspect.Parameter(a.arg, inspect.Parameter.KEYWORD_ONLY, default=default))
    if args.kwarg:
        params.append(inspect.Parameter(args.kwarg.arg, inspect.Parameter.VAR_KEYWORD))
    return inspect.Signature(params)


def _stub_class(name: str) -> dict[str, tuple[str, inspect.Signature | None]]:
    """The members the stub declares on class ``name``: ``{member: (what, signature)}`` with
    ``what`` one of method, property, attribute."""
    tree = ast.parse(open(STUB).read())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)
    out: dict[str, tuple[str, inspect.Signature | None]] = {}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef):
            is_property = any(
                isinstance(d, ast.Name) and d.id == "property" for d in node.decorator_list
            )
            out[node.name] = (
                ("property", None) if is_property else ("method", _stub_signature(node))
            )
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out[node.target.id] = ("attribute", None)
    return out


ENGINE_MEMBERS = _stub_class("Engine")
HOOKS = _stub_class("ConnectionHooks")


def _same_signature(actual: inspect.Signature, declared: inspect.Signature, what: str) -> None:
    got = [(p.name, p.kind, p.default) for p in actual.parameters.values()]
    want = [(p.name, p.kind, p.default) for p in declared.parameters.values()]
    assert got == want, f"{what}: {actual} where _core.pyi declares {declared}"


def test_the_stub_declares_the_interface():
    # The parity checks below are only as good as the stub they read.
    methods = {n for n, (what, _) in ENGINE_MEMBERS.items() if what == "method"}
    assert {"recv_bytes", "send_bytes", "poll", "_open", "_close", "_read_frame"} <= methods
    assert {"_fd", "_peer", "_object"} <= set(ENGINE_MEMBERS)
    assert set(HOOKS) == {"_message", "_dead_sentinel"}


def test_engine_names_itself(impl):
    module = sys.modules[impl.Engine.__module__]
    assert module.ENGINE == impl.Engine.ENGINE == impl.ENGINE
    assert impl.ENGINE in ("c", "python")
    assert module.__all__ == ["ENGINE", "Engine"]


@pytest.mark.parametrize(
    "member", sorted(n for n, (w, _) in ENGINE_MEMBERS.items() if w == "method")
)
def test_engine_methods_match_the_stub(impl, member):
    fn = getattr(impl.Engine, member, None)
    assert fn is not None, f"the {impl.ENGINE} engine has no {member}"
    try:
        actual = inspect.signature(fn)
    except ValueError as exc:
        pytest.fail(f"{impl.ENGINE} engine's {member} has no signature: {exc}")
    params = list(actual.parameters.values())
    assert params[0].name == "self"
    _same_signature(
        actual.replace(parameters=params[1:]),
        _stub_signature_without_self(member),
        f"Engine.{member}",
    )


def _stub_signature_without_self(member: str) -> inspect.Signature:
    sig = ENGINE_MEMBERS[member][1]
    assert sig is not None
    params = list(sig.parameters.values())
    assert params[0].name == "self"
    return sig.replace(parameters=params[1:])


def test_engine_properties_and_attributes_match_the_stub(impl):
    r, w = impl.pipe(False)
    try:
        for name, (what, _) in ENGINE_MEMBERS.items():
            if what == "property":
                assert isinstance(inspect.getattr_static(impl.Engine, name), property) or (
                    inspect.isdatadescriptor(getattr(impl.Engine, name))
                ), f"Engine.{name}"
            if what in ("property", "attribute"):
                for conn in (r, w):
                    getattr(conn, name)  # readable on an open connection
        r._peer = None  # the two settable attributes
        r._object = None
    finally:
        r.close()
        w.close()


def test_the_compiled_engine_has_no_name_outside_the_stub():
    # The compiled engine hides its helpers (cdef); everything it shows is the interface, so
    # a layer above that used anything else would fail on it.
    try:
        engine = _impl.load("c").Engine
    except ImportError:
        needs_extension()
        raise
    shown = {n for n in dir(engine) if not (n.startswith("__") and n.endswith("__"))}
    assert shown == set(ENGINE_MEMBERS) | {"ENGINE"}


ENGINE_CALLS = sorted(
    n for n, (what, _) in ENGINE_MEMBERS.items() if what == "method" and not n.startswith("_")
)


@pytest.mark.parametrize("name", ENGINE_CALLS)
def test_the_connection_holds_the_engines_calls_with_their_docs(impl, name):
    # Each engine's Connection (a class written in the source) holds the engine's own method,
    # no wrapper, documented by the declaration on ConnectionBase, whose body never runs.
    from framepipe._connection import ConnectionBase

    conn_cls = impl.Connection
    assert conn_cls.__name__ == "Connection" and conn_cls.__module__ == "framepipe.connection"
    assert conn_cls.__bases__ == (ConnectionBase, impl.Engine)
    assert conn_cls.__dict__[name] is getattr(impl.Engine, name)
    declared = ConnectionBase.__dict__[name]
    assert declared.__doc__ and len(declared.__doc__) > 40
    assert getattr(conn_cls, name).__doc__ == declared.__doc__
    declared_sig = inspect.signature(declared)
    _same_signature(
        declared_sig.replace(parameters=list(declared_sig.parameters.values())[1:]),
        _stub_signature_without_self(name),
        f"ConnectionBase.{name}",
    )
    r, w = impl.pipe()
    try:
        assert type(r) is conn_cls and getattr(r, name).__doc__ == declared.__doc__
    finally:
        r.close()
        w.close()


def test_every_public_call_of_the_engine_is_declared_on_the_connection(impl):
    shown = {n for n in dir(impl.Engine) if not n.startswith("_") and n != "ENGINE"}
    assert shown == set(ENGINE_CALLS)


@pytest.mark.parametrize("hook", sorted(HOOKS))
def test_the_connection_provides_the_hooks(impl, hook):
    fn = getattr(impl.Connection, hook)
    assert fn is not getattr(impl.Engine, hook, None)
    sig = inspect.signature(fn)
    declared = HOOKS[hook][1]
    assert declared is not None
    _same_signature(sig, declared, f"Connection.{hook}")


# --- what users see is the same whichever engine runs -------------------------------------------


def _public(cls: type) -> list[str]:
    return sorted(n for n in dir(cls) if not n.startswith("_"))


def _same_default(a, b) -> bool:
    if a is b or a == b:
        return True
    # ``timeout_callback=lambda: None``: two functions that do the same thing
    return callable(a) and callable(b) and a() is None and b() is None


def _assert_same_signature(py_obj, c_obj, what: str) -> None:
    py_sig = inspect.signature(py_obj)
    try:
        c_sig = inspect.signature(c_obj)
    except ValueError as exc:
        pytest.fail(
            f"the compiled {what} has no signature inspect can read ({exc}); the twin's is {py_sig}"
        )
    py_params = list(py_sig.parameters.values())
    c_params = list(c_sig.parameters.values())
    assert [(p.name, p.kind) for p in c_params] == [(p.name, p.kind) for p in py_params], (
        f"{what}: compiled {c_sig} vs twin {py_sig}"
    )
    for p, c in zip(py_params, c_params):
        assert _same_default(p.default, c.default), (
            f"{what}, parameter {p.name}: {c.default!r} vs {p.default!r}"
        )


@pytest.fixture(scope="module")
def ccore():
    try:
        return _impl.load("c")
    except ImportError as exc:
        if REQUIRE:
            pytest.fail(
                f"FRAMEPIPE_REQUIRE_EXTENSIONS is set but framepipe._core does not import: {exc}"
            )
        pytest.skip("the compiled core is not built")


@pytest.fixture(scope="module")
def pycore():
    return _impl.load("python")


def test_core_exports_match(ccore, pycore):
    for name in ("Connection", "Engine", "ENGINE", "Pipe", "pipe"):
        assert hasattr(ccore, name) and hasattr(pycore, name), name
    _assert_same_signature(pycore.pipe, ccore.pipe, "pipe()")
    assert ccore.Connection is not pycore.Connection
    assert ccore.Connection.__qualname__ == pycore.Connection.__qualname__ == "Connection"


@pytest.mark.parametrize("cls", ["Connection", "Pipe"])
def test_public_names_match(ccore, pycore, cls):
    assert _public(getattr(ccore, cls)) == _public(getattr(pycore, cls))


@pytest.mark.parametrize("cls", ["Connection", "Pipe"])
def test_constructor_signatures_match(ccore, pycore, cls):
    _assert_same_signature(getattr(pycore, cls), getattr(ccore, cls), f"{cls}()")


def _methods(cls: type) -> list[str]:
    names = [n for n in _public(cls) if callable(getattr(cls, n))]
    return names + ["__enter__", "__exit__"]


@pytest.mark.parametrize(
    "cls, method",
    [(c, m) for c in ("Connection", "Pipe") for m in _methods(getattr(_impl.load("python"), c))],
)
def test_method_signatures_match(ccore, pycore, cls, method):
    py_cls, c_cls = getattr(pycore, cls), getattr(ccore, cls)
    assert hasattr(c_cls, method), f"{cls}.{method} is missing from the compiled core"
    _assert_same_signature(getattr(py_cls, method), getattr(c_cls, method), f"{cls}.{method}")


def test_every_public_method_is_documented(impl):
    # The engines' own public methods have no docstrings: the Connection gives them theirs.
    for name in _methods(impl.Connection)[:-2]:
        doc = inspect.getdoc(getattr(impl.Connection, name))
        assert doc and len(doc) > 20, f"Connection.{name} has no docstring"
    assert inspect.getdoc(impl.Connection).startswith("A framed, bidirectional")


def test_properties_match(ccore, pycore):
    for cls in ("Connection", "Pipe"):
        py_cls, c_cls = getattr(pycore, cls), getattr(ccore, cls)
        for name in _public(py_cls):
            if inspect.isdatadescriptor(getattr(py_cls, name)):
                assert inspect.isdatadescriptor(getattr(c_cls, name, None)), f"{cls}.{name}"


def test_instance_attributes_match(ccore, pycore):
    want = None
    for core in (pycore, ccore):
        r, w = core.pipe(False)
        p = core.Pipe()
        try:
            got = (_public(r), _public(w), _public(p))
            if want is None:
                want = got
            else:
                assert got == want
        finally:
            r.close()
            w.close()
            p.close()


# --- one switch: no module but the switch picks an engine ----------------------------------

# Each engine's Connection module, and the one engine it may import.
ENGINE_CONNECTION = {"_connection_c.py": "_core", "_connection_py.py": "_pycore"}


def test_the_engines_are_chosen_in_one_place():
    # Only the switch's helper names the engines' Connection modules (and loads them by name);
    # each of those imports its own engine; everything else asks framepipe._impl, and a
    # connection says which engine it runs on (conn.ENGINE).
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(root, f)
            source = open(path).read()
            rel = os.path.relpath(path, PACKAGE)
            if rel == "_connection.py":
                continue
            assert not re.search(r"['\"]framepipe\._(py)?core['\"]", source), (
                f"{rel} names an engine's module"
            )
            assert not re.search(r"['\"]framepipe\._connection_(c|py)['\"]", source), (
                f"{rel} names an engine's Connection module"
            )
            imported = set(
                re.findall(r"import (_(?:py)?core)\b|from \.(_(?:py)?core) import", source)
            )
            engines = {name for pair in imported for name in pair if name}
            allowed = {ENGINE_CONNECTION[rel]} if rel in ENGINE_CONNECTION else set()
            assert engines <= allowed, f"{rel} imports an engine directly; use framepipe._impl"
    for rel, engine in ENGINE_CONNECTION.items():
        source = open(os.path.join(PACKAGE, rel)).read()
        assert f"from .{engine} import ENGINE, Engine" in source, rel
