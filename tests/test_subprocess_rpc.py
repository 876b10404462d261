"""framepipe.subprocess_rpc: the reference worker protocol end to end, both cores.

A parent drives a real worker process the way the reference's SubprocessWorker does: three
Pipes (input, output, load), a bootstrap through the worker's ``run_loop``, snippets, results
marshal'd back, exceptions revived with ``SerializedException.raise_from``.
"""

from __future__ import annotations

import dataclasses
import marshal
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from _helpers import TIMEOUT, alive, gone

import framepipe.compat as compat
from framepipe import ReadTimeout, WriterDied
from framepipe import subprocess_rpc as rpc

BOOT = """
from framepipe import subprocess_rpc
out = subprocess_rpc.Pipe(write_handle={out})
out.write(subprocess_rpc.BOOTSTRAP_IMPORT_SUCCESS)
subprocess_rpc.run_loop(input_handle={inp}, output_pipe=out, load_handle={load})
"""


def _engine_env(impl):
    """The environment of a child that must run on ``impl``: the pure-Python core is forced
    with FRAMEPIPE_NO_EXTENSIONS, which cannot stand beside FRAMEPIPE_REQUIRE_EXTENSIONS (set in
    CI for this process only)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("FRAMEPIPE_NO_EXTENSIONS", None)
    if impl.ENGINE == "python":
        env.pop("FRAMEPIPE_REQUIRE_EXTENSIONS", None)
        env["FRAMEPIPE_NO_EXTENSIONS"] = "1"
    return env


class Worker:
    """A minimal SubprocessWorker: the reference protocol, run by a parent of our own."""

    def __init__(self, impl, timeout: float | None = None) -> None:
        pipe = rpc._pipe_for(impl)
        self.killed = 0
        self.input = pipe()
        self.output = pipe(timeout=timeout, timeout_callback=self.kill)
        self.load_pipe = pipe(timeout=timeout, timeout_callback=self.kill)
        env = _engine_env(impl)
        fds = [self.input.read_fd, self.output.write_fd, self.load_pipe.write_fd]
        code = BOOT.format(inp=fds[0], out=fds[1], load=fds[2])
        self.proc = subprocess.Popen(
            [sys.executable, "-c", code],
            pass_fds=fds,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.output.set_writer_pid(self.proc.pid)
        self.load_pipe.set_writer_pid(self.proc.pid)
        assert self.output.read(TIMEOUT) == rpc.BOOTSTRAP_IMPORT_SUCCESS
        assert self.output.read(TIMEOUT) == rpc.BOOTSTRAP_INPUT_LOOP_SUCCESS

    def run(self, snippet: str) -> None:
        self.input.write(textwrap.dedent(snippet).encode(rpc.ENCODING))
        result = marshal.loads(self.output.read())
        if isinstance(result, str):
            assert result == rpc.SUCCESS
            return
        rpc.SerializedException.raise_from(
            rpc.SerializedException(**result), extra_context="    working_dir: /nowhere"
        )

    def load(self, name: str) -> object:
        ns = rpc.WORKER_IMPL_NAMESPACE
        self.run(f'{ns}["load_pipe"].write({ns}["marshal"].dumps({name}))')
        return marshal.loads(self.load_pipe.read())

    def kill(self) -> None:
        self.killed += 1
        self.proc.kill()
        self.proc.wait(TIMEOUT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(TIMEOUT)
        for p in (self.input, self.output, self.load_pipe):
            p.close()


@pytest.fixture
def worker(impl):
    w = Worker(impl, timeout=None)
    try:
        yield w
    finally:
        w.close()


@pytest.fixture
def timed_worker(impl):
    w = Worker(impl, timeout=1.0)
    try:
        yield w
    finally:
        w.close()


def test_snippets_share_their_globals_and_values_come_back(worker):
    worker.run("x = 6 * 7")
    worker.run("y = [x, 'text', b'bytes', {'k': 1.5}]")
    assert worker.load("y") == [42, "text", b"bytes", {"k": 1.5}]


def test_builtin_exceptions_revive_with_the_child_traceback(worker):
    with pytest.raises(KeyError) as info:
        worker.run("{}['missing']")
    assert info.value.args == ("missing",)
    trace = info.value.__cause__
    while trace.__cause__ is not None:
        trace = trace.__cause__
    assert isinstance(trace, rpc.ChildTraceException)
    # the worker loop's frame names this module's file, as callers of the reference match on
    assert "subprocess_rpc" in trace.text and "<subprocess-worker>" in trace.text
    assert trace.text.rstrip().endswith("working_dir: /nowhere")
    worker.run("z = 1")  # the worker survives its snippet's exception


@pytest.mark.parametrize(
    "snippet, name",
    [
        ("raise SystemExit(3)", "SystemExit"),
        ("raise KeyboardInterrupt", "KeyboardInterrupt"),
    ],
)
def test_system_exit_and_keyboard_interrupt_never_cross_as_themselves(worker, snippet, name):
    with pytest.raises(rpc.UnserializableException) as info:
        worker.run(snippet)
    assert not isinstance(info.value, (SystemExit, KeyboardInterrupt))
    assert name in info.value.type_repr
    worker.run("still = 'alive'")
    assert worker.load("still") == "alive"


def test_exceptions_the_parent_cannot_import_are_unserializable(worker):
    worker.run("class OnlyHere(ValueError):\n    pass")
    with pytest.raises(rpc.UnserializableException) as info:
        worker.run("raise OnlyHere('local')")
    assert "OnlyHere" in info.value.type_repr and "local" in info.value.args_repr


def test_from_exception_of_none_is_unserializable():
    se = rpc.SerializedException.from_exception(None, None)
    again = rpc.SerializedException(**marshal.loads(marshal.dumps(dataclasses.asdict(se))))
    with pytest.raises(rpc.UnserializableException) as info:
        rpc.raise_from(again)
    assert info.value.type_repr == "<class 'NoneType'>"
    assert isinstance(info.value.__cause__, rpc.ChildTraceException)


def test_a_reference_made_dict_is_accepted():
    # What the reference's worker sends: no _payload, a builtin class pickled, marshal'd args.
    reference = {
        "_is_serializable": True,
        "_type_bytes": __import__("pickle").dumps(ZeroDivisionError),
        "_args_bytes": marshal.dumps(("division by zero",)),
        "_type_repr": "<class 'ZeroDivisionError'>",
        "_args_repr": "('division by zero',)",
        "_traceback_print": "Traceback (most recent call last):\n...",
    }
    with pytest.raises(ZeroDivisionError, match="division by zero"):
        rpc.raise_from(rpc.SerializedException(**reference))
    with pytest.raises(__import__("pickle").UnpicklingError):
        rpc.ExceptionUnpickler.load_bytes(__import__("pickle").dumps(os.stat_result))


def test_a_snippet_over_its_timeout_runs_the_callback_and_says_exceeded(timed_worker):
    start = time.monotonic()
    with pytest.raises(OSError, match=r"^Exceeded timeout: 1.0$") as info:
        timed_worker.run("import time\ntime.sleep(60)")
    assert isinstance(info.value, ReadTimeout)
    assert timed_worker.killed == 1
    assert time.monotonic() - start < 10


@pytest.mark.parametrize("how, code", [("exit", 3), ("kill", 9)])
def test_a_dying_worker_is_seen_at_once_with_the_reference_message(worker, how, code):
    snippet = (
        "import os\nos._exit(3)"
        if how == "exit"
        else "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)"
    )
    start = time.monotonic()
    with pytest.raises(OSError, match=rf"^Subprocess terminates with code {code}$") as info:
        worker.run(snippet)
    assert isinstance(info.value, WriterDied)
    assert info.value.pid == worker.proc.pid
    assert info.value.exitcode == (3 if how == "exit" else -signal.SIGKILL)
    assert time.monotonic() - start < 10


def test_a_worker_exiting_0_is_reported_through_the_timeout_path(worker):
    with pytest.raises(OSError, match=r"^Exceeded timeout: None$") as info:
        worker.run(rpc.HARD_EXIT.decode())
    assert isinstance(info.value, ReadTimeout) and isinstance(info.value, WriterDied)
    assert info.value.exitcode == 0 and worker.killed == 1


def test_64_mib_each_way_without_deadlock(worker):
    big = 64 << 20
    # 64 MiB down (a snippet padded with a comment), and a 64 MiB value up the load pipe,
    # which the worker writes before its result while the parent waits for that result.
    snippet = "# " + "p" * big + f"\nvalue = bytes(range(256)) * ({big} // 256)\n"
    worker.run(snippet)
    value = worker.load("value")
    assert len(value) == big and value[:256] == bytes(range(256))


@pytest.mark.parametrize("when", ["idle", "mid-snippet"])
def test_a_dead_parent_ends_the_worker_loop(impl, tmp_path, when):
    # The parent of the worker is an intermediate process killed by SIGKILL: the worker must
    # notice at once even though nobody closes anything for it; killed while a snippet runs,
    # the worker returns from run_loop once the snippet ends, with no traceback.
    script = tmp_path / "parent.py"
    errors = tmp_path / "worker.err"
    busy = when == "mid-snippet"
    script.write_text(
        textwrap.dedent(f"""
        import os, subprocess, sys, time
        from framepipe import subprocess_rpc as rpc
        inp, out, load = rpc.Pipe(), rpc.Pipe(), rpc.Pipe()
        code = {BOOT!r}.format(inp=inp.read_fd, out=out.write_fd, load=load.write_fd)
        proc = subprocess.Popen([sys.executable, "-c", code],
                                pass_fds=[inp.read_fd, out.write_fd, load.write_fd],
                                stdout=subprocess.DEVNULL, stderr=open({str(errors)!r}, "w"))
        assert out.read(30) == rpc.BOOTSTRAP_IMPORT_SUCCESS
        assert out.read(30) == rpc.BOOTSTRAP_INPUT_LOOP_SUCCESS
        if {busy!r}:
            inp.write(b"import time; time.sleep(0.5)")
        print(proc.pid, flush=True)
        time.sleep(60)
    """)
    )
    env = _engine_env(impl)
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env)
    child = None
    try:
        child = int(parent.stdout.readline())
        parent.kill()
        parent.wait(TIMEOUT)
        assert gone(child, TIMEOUT)
        assert "Traceback" not in errors.read_text(), errors.read_text()
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.wait(TIMEOUT)
        parent.stdout.close()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)


def test_owned_fds_close_through_close_fds_once_and_given_fds_stay_open(impl):
    pipe = rpc._pipe_for(impl)
    calls = []

    class Tracked(pipe):
        def _close_fds(self):
            calls.append((self.read_fd, self.write_fd))
            super()._close_fds()

    p = Tracked()
    r, w = p.read_fd, p.write_fd
    p.close()
    p.close()
    del p
    assert calls == [(r, w)]
    r2, w2 = os.pipe()
    try:
        borrowed = Tracked(read_handle=r2, write_handle=w2)
        borrowed.write(b"x" * 50_000)
        assert borrowed.read(TIMEOUT) == b"x" * 50_000
        borrowed.close()
        assert calls == [(r, w)]
        os.fstat(r2)
        os.fstat(w2)
    finally:
        os.close(r2)
        os.close(w2)


def test_compat_exports_every_reference_name():
    names = [
        "Pipe",
        "SerializedException",
        "UnserializableException",
        "ChildTraceException",
        "ExceptionUnpickler",
        "run_loop",
        "_run_block",
        "_log_progress",
        "hardened_repr",
        "raise_from",
        "to_handle",
        "from_handle",
        "BOOTSTRAP_IMPORT_SUCCESS",
        "BOOTSTRAP_INPUT_LOOP_SUCCESS",
        "WORKER_IMPL_NAMESPACE",
        "ENCODING",
        "SUCCESS",
        "HARD_EXIT",
        "EMPTY_RESULT",
        "SUCCESS_BYTES",
        "IS_WINDOWS",
    ]
    star: dict = {}
    exec("from framepipe.compat import *", star)
    for name in names:
        assert star[name] is getattr(rpc, name), name
    assert "Pipe" in compat.__all__ and callable(rpc.Pipe._close_fds)
    assert rpc.hardened_repr(type("Bad", (), {"__repr__": lambda self: 1 / 0})()) == "< Unknown >"
    assert rpc.to_handle(5) == 5 and rpc.from_handle(5, os.O_RDONLY) == 5


def test_a_pipe_whose_writer_is_this_process_times_out_as_the_reference(impl):
    # pytorch/benchmark's worker tests make such pipes: a writer pid of their own, a timeout
    # and a callback that must run before the reference's error.
    calls = []
    pipe = rpc._pipe_for(impl)(
        writer_pid=os.getpid(), timeout=0.05, timeout_callback=lambda: calls.append("cb")
    )
    try:
        assert pipe.get_writer_pid() == os.getpid()
        with pytest.raises(OSError, match=r"^Exceeded timeout: 0.05$") as info:
            pipe.read()
        assert isinstance(info.value, ReadTimeout) and calls == ["cb"]
        pipe.write(b"ping")
        assert pipe.read() == b"ping" and calls == ["cb"]
    finally:
        pipe.close()
