"""The reviving policy (docs/reviving.md), through error frames on real pipes, on both cores:
nothing is imported unless the connection opts in, revival is bounded, and a remote
BaseException that is not an Exception arrives wrapped."""

from __future__ import annotations

import asyncio
import builtins
import os
import pickle
import subprocess
import sys
import textwrap
import uuid
from typing import Any

import pytest
from _helpers import TIMEOUT, Background, write_all
from _hostile import (
    Package,
    chain,
    envelope,
    error_frame,
    groups_of_chains,
    member_cycle,
    nested_groups,
    node,
    one,
    wide_group,
)

import framepipe
from framepipe import FramepipeError, RemoteBaseException, RemoteError
from framepipe.remote import (
    MAX_REVIVE_DEPTH,
    MAX_REVIVE_NODES,
    RemoteTraceback,
    dumps_exception,
    loads_exception,
)

Group: Any = getattr(builtins, "ExceptionGroup", None)  # Python 3.11+
BaseGroup: Any = getattr(builtins, "BaseExceptionGroup", None)
needs_groups = pytest.mark.skipif(Group is None, reason="exception groups need Python 3.11")


def read_error(impl, payload: bytes, **options):
    """Write ``payload`` as an error frame into a real pipe, then ``b"after"``; returns what
    ``recv`` raised, after checking the channel still delivers the next frame. Bounded: a
    revival that hangs fails the test instead of hanging it."""
    r, w = impl.pipe(False)
    try:
        for name, value in options.items():
            setattr(r, name, value)

        def write() -> None:  # a large payload fills the pipe: written while it is read
            write_all(w._handles()[1], error_frame(payload))
            w.send_bytes(b"after")

        def read():
            try:
                r.recv(timeout=TIMEOUT)
            except BaseException as exc:  # noqa: BLE001 - the test looks at it
                return exc
            raise AssertionError("the error frame raised nothing")

        writer = Background(write)
        exc = Background(read).join()
        writer.join()
        assert r.recv_bytes(timeout=TIMEOUT) == b"after"
        return exc
    finally:
        r.close()
        w.close()


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A package on the path, imported here; its submodules are not."""
    name = f"fp_hostile_{uuid.uuid4().hex[:8]}"
    pkg = Package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    __import__(name)
    yield pkg
    for mod in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
        del sys.modules[mod]


# --- nothing is imported ----------------------------------------------------------------------


def test_a_submodule_the_reader_has_not_imported_is_not_imported(impl, package):
    exc = read_error(impl, one(f"{package.name}.boom", "Boom"))
    assert isinstance(exc, RemoteError) and isinstance(exc, Exception)
    assert exc.remote_type == f"{package.name}.boom.Boom"
    assert str(exc) == "boom"
    assert f"{package.name}.boom" not in sys.modules
    assert package.ran() == [], "the submodule's code ran in the reader"


def test_a_module_getattr_is_not_called(impl, package):
    # The package's __getattr__ imports package.lazy: reading the class from the package
    # must not call it.
    exc = read_error(impl, one(package.name, "LazyError"))
    assert isinstance(exc, RemoteError) and exc.remote_type == f"{package.name}.LazyError"
    assert f"{package.name}.lazy" not in sys.modules
    assert package.ran() == []


def test_a_lazily_loaded_module_is_not_run(impl, package):
    package.lazy_load()
    exc = read_error(impl, one(f"{package.name}.loaded", "LoadedError"))
    assert isinstance(exc, RemoteError)
    assert package.ran() == [], "reading the class ran the lazily loaded module"


@pytest.mark.parametrize(
    "module",
    ["unittest.__main__", "asyncio.__main__", "email.__main__"],
)
def test_main_style_modules_of_the_stdlib_are_not_imported(impl, module):
    __import__(module.split(".")[0])  # the package is imported here: only its submodule is not
    assert module not in sys.modules
    exc = read_error(impl, one(module, "X"))  # unittest.__main__ would run unittest.main()
    assert isinstance(exc, RemoteError) and not isinstance(exc, SystemExit)
    assert exc.remote_type == f"{module}.X"
    assert module not in sys.modules


@pytest.mark.parametrize(
    "module, qualname",
    [
        ("os.path", "join"),  # a function: refused, not called
        ("importlib", "import_module"),
        ("builtins", "__import__"),
    ],
)
def test_names_that_reach_the_import_machinery_are_refused(impl, module, qualname):
    exc = read_error(impl, one(module, qualname))
    assert isinstance(exc, framepipe.RefusedPayload)


def test_classes_of_modules_already_imported_still_revive(impl):
    exc = read_error(impl, dumps_exception(subprocess.TimeoutExpired(["x"], 2.0)))
    assert type(exc) is subprocess.TimeoutExpired and exc.timeout == 2.0


def test_a_connection_opts_in_to_imports_by_module_prefix(impl, package):
    payload = one(f"{package.name}.boom", "Boom", pickled=False)
    exc = read_error(impl, payload, revive_imports=[package.name])
    assert type(exc).__qualname__ == "Boom" and not isinstance(exc, RemoteError)
    assert type(exc).__module__ == f"{package.name}.boom"
    assert package.ran() == [f"{package.name}.boom"]


def test_an_opt_in_never_imports_main_style_modules_or_other_prefixes(impl, package):
    exc = read_error(impl, one("unittest.__main__", "X"), revive_imports=True)
    assert isinstance(exc, RemoteError) and "unittest.__main__" not in sys.modules
    exc = read_error(impl, one(f"{package.name}.boom", "Boom"), revive_imports=["other"])
    assert isinstance(exc, RemoteError) and package.ran() == []


def test_revive_imports_is_checked_and_travels_with_the_connection(impl):
    r, w = impl.pipe(True)
    try:
        assert r.revive_imports is False
        with pytest.raises(TypeError, match="imports= takes"):
            r.revive_imports = [3]
        with pytest.raises(TypeError, match="imports= takes"):
            r.revive_imports = ["not a module"]
        r.revive_imports = "myapp"
        assert r.revive_imports == ("myapp",)
        again = pickle.loads(pickle.dumps(r))  # as passed to another process
        try:
            assert again.revive_imports == ("myapp",)
        finally:
            again.close()
    finally:
        r.close()
        w.close()


def test_loads_exception_imports_only_when_told(package):
    payload = one(f"{package.name}.boom", "Boom", pickled=False)
    assert isinstance(loads_exception(payload), RemoteError)
    assert package.ran() == []
    assert type(loads_exception(payload, imports=[package.name])).__qualname__ == "Boom"


def test_a_child_process_reading_hostile_frames_imports_nothing(impl, tmp_path):
    # A fresh reader, so sys.modules is its own: the frames name a submodule of a package it
    # imported, a stdlib __main__ and a lazily reached class; it must import none of them.
    name = f"fp_hostile_{uuid.uuid4().hex[:8]}"
    pkg = Package(tmp_path, name)
    payloads = [one(f"{name}.boom", "Boom"), one("unittest.__main__", "X"), one(name, "LazyError")]
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(tmp_path)!r})
        import unittest, {name}
        from framepipe import _impl, RemoteError
        core = _impl.load({"c" if impl.ENGINE == "c" else "python"!r})
        r = core.Connection(int(sys.argv[1]), writable=False)
        before = set(sys.modules)
        for _ in range(3):
            try:
                r.recv(timeout=30)
            except RemoteError as exc:
                print(exc.remote_type)
        new = sorted(m for m in set(sys.modules) - before if m.startswith(({name!r}, "unittest")))
        print("new modules:", new)
        """
    )
    rfd, wfd = os.pipe()
    src = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))
    env = {**os.environ, "PYTHONPATH": src}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(rfd)],
        pass_fds=[rfd],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    os.close(rfd)
    try:
        for payload in payloads:
            os.write(wfd, error_frame(payload))
        out, _ = proc.communicate(timeout=60)
    finally:
        os.close(wfd)
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
    assert proc.returncode == 0, out
    assert out.splitlines() == [
        f"{name}.boom.Boom",
        "unittest.__main__.X",
        f"{name}.LazyError",
        "new modules: []",
    ]
    assert pkg.ran() == [] and not pkg.log.exists()


# --- bounds -----------------------------------------------------------------------------------


def group_depth(exc: BaseException) -> int:
    depth = 0
    while isinstance(exc, BaseGroup):
        depth += 1
        exc = exc.exceptions[0]
    return depth


@needs_groups
@pytest.mark.parametrize("depth", [150, 250, 1000, 5000])
def test_deeply_nested_groups_revive_to_the_bound_then_degrade(impl, depth):
    exc = read_error(impl, nested_groups(depth))
    assert isinstance(exc, Group)
    revived = group_depth(exc)
    assert revived == MAX_REVIVE_DEPTH  # then a stand-in for the group past the bound
    inner = exc
    for _ in range(revived):
        inner = inner.exceptions[0]
    assert isinstance(inner, RemoteError) and isinstance(inner, Exception)
    assert str(inner) == f"level {MAX_REVIVE_DEPTH}"
    assert "past the revival bounds" in inner.__notes__[-1]
    trace = exc.__cause__
    assert isinstance(trace, RemoteTraceback) and "hostile" in trace.text


@needs_groups
def test_a_real_nested_group_sent_by_the_writer_revives_up_to_the_bound(impl):
    exc: BaseException = ValueError("the bottom")
    for i in range(300):
        exc = Group(f"level {i}", [exc])
    r, w = impl.pipe(False)
    try:
        writer = Background(w.send_exception, exc)
        got = Background(lambda: pytest.raises(Group, r.recv, timeout=TIMEOUT)).join()
        writer.join()
        assert group_depth(got.value) == MAX_REVIVE_DEPTH
        assert str(got.value) == "level 299 (1 sub-exception)"
    finally:
        r.close()
        w.close()


@needs_groups
def test_a_wide_group_revives_up_to_the_node_bound(impl):
    exc = read_error(impl, wide_group(20_000))
    assert isinstance(exc, Group)
    assert len(exc.exceptions) == MAX_REVIVE_NODES - 1
    assert [str(e) for e in exc.exceptions[:3]] == ["member 0", "member 1", "member 2"]


@pytest.mark.parametrize("link", ["cause", "context"])
def test_long_cause_and_context_chains_are_cut_at_the_node_bound(impl, link):
    exc = read_error(impl, chain(5_000, link))
    seen = 0
    while exc is not None and not isinstance(exc, RemoteTraceback):
        assert str(exc) == f"link {seen}"
        seen += 1
        exc = getattr(exc, f"__{link}__")
    assert seen == MAX_REVIVE_NODES


@needs_groups
def test_groups_whose_members_have_group_causes(impl):
    exc = read_error(impl, groups_of_chains(400))
    assert isinstance(exc, Group) and str(exc) == "g0 (1 sub-exception)"
    assert str(exc.exceptions[0]) == "m0" and isinstance(exc.exceptions[0].__cause__, Exception)


@needs_groups
def test_cycles_in_members_and_causes_end(impl):
    exc = read_error(impl, member_cycle())
    assert isinstance(exc, Group) and len(exc.exceptions) == 1  # not itself
    member = exc.exceptions[0]
    assert exc.__cause__ is member and member.__context__ is member
    assert isinstance(member.__cause__, RemoteTraceback)  # the chain's end: the cycle is cut
    assert "ExceptionGroup: self" in "".join(__import__("traceback").format_exception(exc))


def test_a_malformed_root_is_refused(impl):
    exc = read_error(impl, envelope([node()], root=7))
    assert isinstance(exc, framepipe.RefusedPayload)


@needs_groups
def test_many_nodes_in_deep_and_wide_groups_revive_quickly_enough_to_never_hang(impl):
    # every node a group of the next three: 30,000 nodes
    n = 30_000
    nodes = [
        node(
            "builtins",
            "ExceptionGroup",
            f"g{i}",
            members=[j for j in (3 * i + 1, 3 * i + 2, 3 * i + 3) if j < n],
        )
        if 3 * i + 1 < n
        else node(text=f"leaf {i}", pickled=False)
        for i in range(n)
    ]
    exc = read_error(impl, envelope(nodes))
    assert isinstance(exc, Group)
    count, todo = 0, [exc]
    while todo:
        e = todo.pop()
        count += 1
        todo.extend(getattr(e, "exceptions", ()))
    assert count <= MAX_REVIVE_NODES


# --- a remote BaseException that is not an Exception --------------------------------------------


def _raise_in_child(kind: str) -> None:
    if kind == "exit":
        sys.exit(3)
    if kind == "interrupt":
        raise KeyboardInterrupt
    raise GeneratorExit("closed")


def _child(conn, kind: str) -> None:
    try:
        _raise_in_child(kind)
    except BaseException as exc:  # noqa: BLE001 - sent to the parent
        conn.send_exception(exc)
    conn.close()


@pytest.mark.parametrize(
    "kind, cls, args",
    [
        ("exit", SystemExit, (3,)),
        ("interrupt", KeyboardInterrupt, ()),
        ("gen", GeneratorExit, ("closed",)),
    ],
)
def test_a_remote_base_exception_arrives_wrapped(engine, kind, cls, args):
    import multiprocessing

    from framepipe.connection import Pipe

    r, w = Pipe(duplex=False)
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=_child, args=(w, kind))
    proc.start()
    w.close()
    try:
        with pytest.raises(RemoteBaseException) as info:
            r.recv(timeout=TIMEOUT)
        err = info.value
        assert isinstance(err, FramepipeError) and isinstance(err, Exception)
        assert type(err.original) is cls and err.original.args == args
        assert err.__cause__ is err.original
        assert err.remote_type == cls.__name__ and err.remote_args == args
        assert "_raise_in_child" in err.remote_traceback
        assert cls.__name__ in str(err) and "not an Exception" in str(err)
        again = pickle.loads(pickle.dumps(err))
        assert type(again.original) is cls and again.remote_traceback == err.remote_traceback
    finally:
        proc.join(TIMEOUT)
        if proc.is_alive():
            proc.kill()
            proc.join(TIMEOUT)
        r.close()
    assert proc.exitcode == 0


def test_a_remote_base_exception_arrives_wrapped_in_asyncio_too(impl):
    r, w = impl.pipe(False)
    try:
        w.send_exception(SystemExit(4))

        async def read():
            with pytest.raises(RemoteBaseException) as info:
                await r.recv_async(timeout=TIMEOUT)
            return info.value

        err = asyncio.run(read())
        assert type(err.original) is SystemExit and err.original.code == 4
    finally:
        r.close()
        w.close()


def test_a_base_exception_stand_in_arrives_wrapped(impl):
    class Halt(BaseException):
        pass

    Halt.__module__ = "fp_absent_module"
    Halt.__qualname__ = "Halt"
    err = read_error(impl, dumps_exception(Halt("stop")))
    assert isinstance(err, RemoteBaseException)
    assert isinstance(err.original, RemoteError) and not isinstance(err.original, Exception)
    assert err.remote_type == "fp_absent_module.Halt" and err.remote_args == ("stop",)
