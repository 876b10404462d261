"""End to end: a worker under framepipe.guard that crashes in C code, or raises, and the
parent that reads from it (both cores, fork and spawn children)."""

from __future__ import annotations

import contextlib
import importlib
import os
import shutil
import signal
import subprocess
import sys

import pytest
from _fault_children import TwoArgError, guarded_crash, guarded_raise
from _helpers import TESTS, running

import framepipe
from framepipe import RemoteTraceback, WriterDied, _faults, _impl

WAIT = 60.0

PACKAGE = os.path.dirname(os.path.abspath(framepipe.__file__))
REQUIRE = bool(os.environ.get("FRAMEPIPE_REQUIRE_EXTENSIONS"))
CRASHES = [
    ("segv", signal.SIGSEGV, "Segmentation fault"),
    ("abort", signal.SIGABRT, "Aborted"),
    ("bus", signal.SIGBUS, "Bus error"),
    ("fpe", signal.SIGFPE, "Floating point exception"),
    ("ill", signal.SIGILL, "Illegal instruction"),
]


@contextlib.contextmanager
def guarded_child(impl, method: str, target):
    """(parent's end, process): ``target`` runs in a ``method`` child with the other end of a
    duplex pipe, which the parent watches; the child is killed and joined on the way out."""
    parent, child = impl.pipe(True)
    try:
        with running(method, target, child) as proc:
            child.close()
            parent.watch(proc)
            yield parent, proc
    finally:
        child.close()
        parent.close()


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_segfault_reaches_the_parent_with_the_native_traceback(impl, method):
    with guarded_child(impl, method, guarded_crash) as (parent, proc):
        assert parent.recv_bytes(timeout=WAIT) == b"before the crash"
        with pytest.raises(WriterDied) as info:
            parent.recv_bytes(timeout=WAIT)
        err = info.value
        assert err.pid == proc.pid
        assert err.exitcode == -signal.SIGSEGV
        assert err.signal_name == "SIGSEGV"
        assert err.native_traceback is not None
        assert "Segmentation fault" in err.native_traceback
        assert "crash_in_c_code" in err.native_traceback
        assert "guarded_crash" in err.native_traceback
        assert "Segmentation fault" in str(err) and "crash_in_c_code" in str(err)
        # the guard's label names the worker in the parent's message
        assert err.label == "crasher"
        assert str(err).startswith(f"crasher {proc.pid} was killed by signal SIGSEGV")
        proc.join(WAIT)
        assert proc.exitcode == -signal.SIGSEGV  # never reaped by framepipe


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_guarded_exception_is_raised_by_recv(impl, method):
    with guarded_child(impl, method, guarded_raise) as (parent, proc):
        with pytest.raises(TwoArgError) as info:
            parent.recv(timeout=WAIT)
        err = info.value
        assert err.args == ("bad batch", 7)
        assert (err.what, err.index) == ("bad batch", 7)
        import traceback

        text = "".join(traceback.format_exception(err))
        assert "guarded_raise" in text
        # the guard's label names the worker in the parent's message
        assert f"Traceback from raiser process {proc.pid} (" in text
        end = err.__cause__
        assert isinstance(end, RemoteTraceback) and end.label == "raiser"
        # After the error frame, the worker's exit is reported, not a hang.
        with pytest.raises(WriterDied) as died:
            parent.recv(timeout=WAIT)
        assert died.value.exitcode == 1


# --- the dump in the crashing child's own stderr ---------------------------------------------


def needs_fault_echo() -> None:
    """The stderr copy is made by the C helper framepipe._fault_echo (built with any C
    compiler, used with either engine); an install without it dumps to the fault file only."""
    try:
        importlib.import_module("framepipe._fault_echo")
    except ImportError:
        if REQUIRE:
            pytest.fail("FRAMEPIPE_REQUIRE_EXTENSIONS is set but framepipe._fault_echo is missing")
        pytest.skip("framepipe._fault_echo is not built (no C compiler)")


def crash_child(
    impl, how, *, before="none", stderr=subprocess.PIPE, package_root=None, core=False, cwd=None
):
    """Run ``_fault_children.crash_writer`` in a fresh interpreter on ``impl``'s engine (the
    pure-Python one forced with FRAMEPIPE_NO_EXTENSIONS=1), its fd 2 a pipe read here (or
    ``stderr``); returns (WriterDied, the child's exit code, all it wrote to fd 2)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAMEPIPE_")}
    if impl.ENGINE == "python":
        env["FRAMEPIPE_NO_EXTENSIONS"] = "1"
    elif REQUIRE:
        env["FRAMEPIPE_REQUIRE_EXTENSIONS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(
        [package_root or os.path.dirname(PACKAGE), TESTS, *(p for p in sys.path if p)]
    )
    r, w = os.pipe()
    parent = impl.Connection(r, writable=False)
    code = (
        "from _fault_children import crash_writer; "
        f"crash_writer({w}, {how!r}, {before!r}, {core!r})"
    )
    try:
        proc = subprocess.Popen(
            [sys.executable, "-c", code],
            env=env,
            pass_fds=[w],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
            cwd=cwd,
        )
    except BaseException:
        parent.close()
        raise
    finally:
        os.close(w)
    try:
        parent.watch(proc)
        assert parent.recv_bytes(timeout=WAIT) == f"engine {impl.ENGINE}".encode()
        with pytest.raises(WriterDied) as info:
            parent.recv_bytes(timeout=WAIT)
        _, err = proc.communicate(timeout=WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=WAIT)
        parent.close()
    return info.value, proc.returncode, (err or b"").decode("utf-8", "replace")


@pytest.mark.parametrize("before", ["none", "faulthandler"])
@pytest.mark.parametrize(("how", "signum", "what"), CRASHES, ids=[c[0] for c in CRASHES])
def test_a_native_crash_dump_reaches_both_the_parent_and_the_childs_stderr(
    impl, how, signum, what, before
):
    # A guarded child that crashes in C code shows faulthandler's dump in its own stderr, as a
    # plain faulthandler.enable() would, and the parent's WriterDied still carries it. With
    # faulthandler enabled on stderr before the guard (as in a worker process) the dump is
    # shown once, not twice.
    needs_fault_echo()
    err, exitcode, stderr = crash_child(impl, how, before=before)
    # the process still dies by the signal it crashed with
    assert exitcode == -signum
    assert err.exitcode == -signum and err.signal_name == signal.Signals(signum).name
    assert not err.core_dumped  # RLIMIT_CORE is 0 in the child
    # the parent's report is as before
    assert err.label == "crasher"
    assert str(err).startswith(f"crasher {err.pid} was killed by signal {err.signal_name}")
    native = err.native_traceback
    assert native is not None
    assert native.startswith(f"Fatal Python error: {what}\n")
    assert "crash_in_c_code" in native and "crash_writer" in native
    # the child's stderr has the same dump, whole, once
    assert native in stderr, stderr
    assert stderr.count("Fatal Python error") == 1, stderr
    assert not os.path.exists(_faults.fault_path(err.pid))


@pytest.mark.parametrize(("how", "signum", "what"), CRASHES, ids=[c[0] for c in CRASHES])
def test_a_crash_after_the_guard_exited_is_dumped_once_to_stderr(impl, how, signum, what):
    # After the guard, faulthandler is back on stderr and the signals have their actions from
    # before the guard: one dump in stderr, none for the parent, the same death.
    err, exitcode, stderr = crash_child(impl, how, before="guard exited")
    assert exitcode == -signum and err.exitcode == -signum
    assert err.native_traceback is None and err.label == "worker"
    assert stderr.count("Fatal Python error") == 1, stderr
    assert f"Fatal Python error: {what}\n" in stderr and "crash_in_c_code" in stderr


def test_the_core_dump_flag_is_what_faulthandler_alone_gives(impl, tmp_path):
    # With core files allowed, a guarded crash dumps core exactly when an unguarded one with
    # plain faulthandler does (whether it does depends on this machine's limits and
    # core_pattern, so the two are compared): the helper re-raises the signal with its
    # default action, as faulthandler would.
    needs_fault_echo()
    flags = {}
    for before in ("unguarded", "none"):
        cwd = tmp_path / before  # where a core_pattern of "core" puts the file
        cwd.mkdir()
        err, exitcode, stderr = crash_child(impl, "segv", before=before, core=True, cwd=cwd)
        assert exitcode == -signal.SIGSEGV and err.exitcode == -signal.SIGSEGV
        assert stderr.count("Fatal Python error: Segmentation fault\n") == 1, stderr
        flags[before] = err.core_dumped
        shutil.rmtree(cwd)  # a core file is tens of megabytes
    assert flags["none"] == flags["unguarded"]
    assert (flags["none"] is not None) and (err.native_traceback is not None)


def test_a_full_stderr_pipe_nobody_reads_does_not_keep_the_crash_from_dying(impl):
    # Copying the dump to stderr must never stand between the process and its death: fd 2 is
    # a full pipe nobody reads, the copy gives up after a second without progress, and the
    # child still dies by SIGSEGV with its dump in the parent's WriterDied.
    needs_fault_echo()
    r, w = os.pipe()
    try:
        os.set_blocking(w, False)
        filled = 0
        try:
            while True:
                filled += os.write(w, b"x" * 4096)
        except BlockingIOError:
            pass
        os.set_blocking(w, True)
        err, exitcode, _ = crash_child(impl, "segv", stderr=w)
        assert exitcode == -signal.SIGSEGV and err.exitcode == -signal.SIGSEGV
        assert err.native_traceback is not None
        assert err.native_traceback.startswith("Fatal Python error: Segmentation fault\n")
        assert "crash_in_c_code" in err.native_traceback
        # the child wrote nothing: the pipe holds only what was put in it here
        os.close(w)
        w = -1
        left = 0
        while chunk := os.read(r, 1 << 16):
            assert set(chunk) == {ord("x")}
            left += len(chunk)
        assert left == filled
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_without_the_helper_the_dump_still_reaches_the_parent(tmp_path):
    # An install without a C compiler has no framepipe._fault_echo: the dump goes to the fault
    # file only (nothing in pure Python can copy it from a signal handler), and the parent's
    # report and the child's death are as with the helper.
    shutil.copytree(
        PACKAGE,
        tmp_path / "framepipe",
        ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd", "_core.c"),
    )
    assert not [p for p in os.listdir(tmp_path / "framepipe") if p.endswith(".so")]
    python_engine = _impl.load("python")  # the copy has no compiled engine either
    err, exitcode, stderr = crash_child(python_engine, "segv", package_root=str(tmp_path))
    assert exitcode == -signal.SIGSEGV and err.exitcode == -signal.SIGSEGV
    assert err.label == "crasher"
    assert err.native_traceback is not None
    assert err.native_traceback.startswith("Fatal Python error: Segmentation fault\n")
    assert "crash_in_c_code" in err.native_traceback
    assert "Fatal Python error" not in stderr, stderr
