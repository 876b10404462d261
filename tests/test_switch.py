"""The switch between the compiled core and its pure-Python twin, and their parity."""

from __future__ import annotations

import inspect
import os
import shutil
import subprocess
import sys

import pytest

import framepipe
from framepipe import _impl, _pycore

SRC = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))
PACKAGE = os.path.dirname(os.path.abspath(framepipe.__file__))
REQUIRE = bool(os.environ.get("FRAMEPIPE_REQUIRE_EXTENSIONS"))
TIMEOUT = 60.0

REPORT = "import framepipe; print(framepipe.implementation, framepipe.Connection.__module__)"


def extension_present() -> bool:
    try:
        _impl.load("c")
    except ImportError:
        return False
    return True


def run(code: str, path: str = SRC, **env: str) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter that imports framepipe from ``path``, with the
    FRAMEPIPE_* variables of this process replaced by ``env``."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("FRAMEPIPE_")}
    full.update(env)
    full["PYTHONPATH"] = path
    return subprocess.run([sys.executable, "-c", code], env=full, capture_output=True,
                          text=True, timeout=TIMEOUT, cwd=path, check=False)


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
        PACKAGE, dest,
        ignore=shutil.ignore_patterns("_core.*", "_core", "__pycache__", "*.so", "*.pyd"),
    )
    assert not [p for p in os.listdir(dest) if p.startswith("_core")]
    return tmp_path


# --- the switch -------------------------------------------------------------------------------


def test_no_extensions_forces_the_python_core():
    res = run(REPORT, FRAMEPIPE_NO_EXTENSIONS="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["python", "framepipe._pycore"]


def test_default_prefers_the_compiled_core():
    needs_extension()
    res = run(REPORT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["c", "framepipe._core"]


def test_require_extensions_imports_the_compiled_core():
    needs_extension()
    res = run(REPORT, FRAMEPIPE_REQUIRE_EXTENSIONS="1")
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["c", "framepipe._core"]


def test_the_compiled_core_imports_when_required():
    if not REQUIRE:
        pytest.skip("FRAMEPIPE_REQUIRE_EXTENSIONS is not set")
    import framepipe._core as core

    assert framepipe.implementation == "c"
    assert framepipe.Connection is core.Connection
    assert _impl.available() == ["c", "python"]


def test_both_variables_set_is_an_import_error():
    res = run(REPORT, FRAMEPIPE_NO_EXTENSIONS="1", FRAMEPIPE_REQUIRE_EXTENSIONS="1")
    assert res.returncode != 0
    assert "ImportError" in res.stderr
    assert "FRAMEPIPE_NO_EXTENSIONS" in res.stderr and "FRAMEPIPE_REQUIRE_EXTENSIONS" in res.stderr


def test_missing_extension_falls_back_to_python(tree_without_extension):
    res = run(REPORT, path=str(tree_without_extension))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["python", "framepipe._pycore"]
    res = run("import framepipe; r, w = framepipe._impl.core.pipe(False); w.send_bytes(b'ok');"
              "print(r.recv_bytes(timeout=5).decode())", path=str(tree_without_extension))
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["ok"]


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
    assert res.stdout.split() == ["python", "framepipe._pycore"]
    res = run(REPORT, path=str(tree_without_extension), FRAMEPIPE_REQUIRE_EXTENSIONS="1")
    assert res.returncode != 0
    assert "this build of the core is broken" in res.stderr


def test_load_and_available():
    assert _impl.load("python") is _pycore
    assert "python" in _impl.available()
    assert ("c" in _impl.available()) == extension_present()
    with pytest.raises(ValueError):
        _impl.load("fortran")
    assert framepipe.implementation in ("c", "python")
    assert framepipe.Connection is _impl.core.Connection
    assert framepipe.Pipe is _impl.core.Pipe


# --- parity of the two cores --------------------------------------------------------------------


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
        pytest.fail(f"the compiled {what} has no signature inspect can read ({exc}); "
                    f"the twin's is {py_sig}")
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


def test_module_exports_match(ccore):
    for name in _pycore.__all__:
        assert hasattr(ccore, name), name
    _assert_same_signature(_pycore.pipe, ccore.pipe, "pipe()")


@pytest.mark.parametrize("cls", ["Connection", "Pipe"])
def test_public_names_match(ccore, cls):
    assert _public(getattr(ccore, cls)) == _public(getattr(_pycore, cls))


@pytest.mark.parametrize("cls", ["Connection", "Pipe"])
def test_constructor_signatures_match(ccore, cls):
    _assert_same_signature(getattr(_pycore, cls), getattr(ccore, cls), f"{cls}()")


def _methods(cls: type) -> list[str]:
    names = [n for n in _public(cls) if callable(getattr(cls, n))]
    return names + ["__enter__", "__exit__"]


@pytest.mark.parametrize(
    "cls, method",
    [(c, m) for c in ("Connection", "Pipe") for m in _methods(getattr(_pycore, c))],
)
def test_method_signatures_match(ccore, cls, method):
    py_cls, c_cls = getattr(_pycore, cls), getattr(ccore, cls)
    assert hasattr(c_cls, method), f"{cls}.{method} is missing from the compiled core"
    _assert_same_signature(getattr(py_cls, method), getattr(c_cls, method), f"{cls}.{method}")


def test_properties_match(ccore):
    for cls in ("Connection", "Pipe"):
        py_cls, c_cls = getattr(_pycore, cls), getattr(ccore, cls)
        for name in _public(py_cls):
            if inspect.isdatadescriptor(getattr(py_cls, name)):
                assert inspect.isdatadescriptor(getattr(c_cls, name, None)), f"{cls}.{name}"


def test_instance_attributes_match(ccore):
    for module in (_pycore, ccore):
        r, w = module.pipe(False)
        p = module.Pipe()
        try:
            if module is _pycore:
                want = (_public(r), _public(w), _public(p))
            else:
                assert (_public(r), _public(w), _public(p)) == want
        finally:
            r.close()
            w.close()
            p.close()
