"""framepipe.guard: the child side of failure reporting, in real fork and spawn children."""

from __future__ import annotations

import contextlib
import copy
import ctypes
import json
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import resource
import signal
import socket
import sys
import threading
import time
import traceback
from typing import Any

import pytest
from _helpers import at_pid, frame_names, run_guarded

from framepipe._liveness import start_time
from framepipe.errors import WriterDied
from framepipe.guard import (
    ERROR_FILE_ENV,
    ProcessFailure,
    fault_path,
    guard,
    read_native_traceback,
    record,
    write_error_file,
)
from framepipe.remote import loads_exception
from framepipe.watch import Liveness

CONTEXTS = ["fork", "spawn"]
WAIT = 60.0  # upper bound on any wait; a healthy run never comes close


class ShardError(ValueError):
    def __init__(self, shard: int, reason: str) -> None:
        super().__init__(f"shard {shard}: {reason}")
        self.shard = shard


def load_shard() -> None:
    raise ShardError(3, "checksum mismatch")


def guarded_worker(conn: Any, metrics: Any, stop: Any, error_file: str, stderr_path: str) -> None:
    sys.stderr = open(stderr_path, "w")  # noqa: SIM115 (for the rest of this child's life)
    with guard(conn, label="loader", error_file=error_file, queue=metrics, stop_event=stop):
        load_shard()


@pytest.mark.parametrize("method", CONTEXTS)
def test_guard_runs_every_step_in_a_child(method: str, tmp_path: Any) -> None:
    error_file, stderr_path = tmp_path / "error.json", tmp_path / "stderr.txt"
    message, metrics, stop, pid = run_guarded(
        method, guarded_worker, str(error_file), str(stderr_path)
    )
    exc = loads_exception(message)
    assert type(exc) is ShardError and exc.shard == 3
    assert "load_shard" in frame_names(exc)
    assert f"Traceback from loader process {pid} (" in str(exc.__cause__)

    item = metrics.get(timeout=60)
    assert set(item) == {"error"}
    assert "load_shard" in item["error"] and "shard 3: checksum mismatch" in item["error"]
    assert stop.is_set()

    banner = stderr_path.read_text()
    assert "[LOADER CRASH]" in banner and f"pid {pid}" in banner
    assert "load_shard" in banner

    data = json.loads(error_file.read_text())
    message = data["message"]
    assert message["message"] == "ShardError: shard 3: checksum mismatch"
    assert "load_shard" in message["extraInfo"]["py_callstack"]
    assert int(message["extraInfo"]["timestamp"]) <= int(time.time())
    extra = data["framepipe"]
    assert extra["pid"] == pid
    assert extra["host"] == socket.gethostname()
    assert extra["label"] == "loader"
    assert extra["exit_reason"] == "exception"
    assert extra["exception_type"] == f"{__name__}.ShardError"
    assert extra["timestamp_ns"] // 1_000_000_000 == int(message["extraInfo"]["timestamp"])


def test_a_failing_step_hides_nothing_and_skips_nothing(
    tmp_path: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    writer.close()  # sending will fail
    full = queue.Queue(maxsize=1)
    full.put("occupied")  # put_nowait will fail
    stop = threading.Event()
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    with (
        pytest.raises(ShardError) as info,
        guard(writer, error_file=blocked / "error.json", queue=full, stop_event=stop),
    ):
        load_shard()
    assert info.value.shard == 3
    assert stop.is_set()
    err = capsys.readouterr().err
    assert "[WORKER CRASH]" in err
    assert "could not send the exception through conn: OSError" in err
    assert "could not write the error file" in err
    assert "could not put the error on the queue: Full" in err

    error_file = tmp_path / "error.json"
    with pytest.raises(KeyError), guard(writer, error_file=error_file, stop_event=object()):
        raise KeyError("k")
    assert "KeyError" in json.loads(error_file.read_text())["message"]["message"]
    assert "could not set the stop event: AttributeError" in capsys.readouterr().err
    reader.close()


def test_decorator_forms(tmp_path: Any) -> None:
    items: queue.Queue[Any] = queue.Queue()

    @guard
    def bare(x: int) -> int:
        return x * 2

    @guard(queue=items, label="deco")
    def failing() -> None:
        raise ShardError(1, "bad")

    assert bare(21) == 42
    with pytest.raises(ShardError):
        failing()
    assert "ShardError: shard 1: bad" in items.get_nowait()["error"]
    with pytest.raises(ShardError):
        failing()  # the same guard object works again
    assert items.qsize() == 1


def test_system_exit_zero_is_not_a_failure() -> None:
    items: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()
    with pytest.raises(SystemExit), guard(queue=items, stop_event=stop):
        sys.exit(0)
    assert items.empty() and not stop.is_set()
    with pytest.raises(SystemExit), guard(queue=items, stop_event=stop):
        sys.exit(2)
    assert "SystemExit: 2" in items.get_nowait()["error"] and stop.is_set()


def test_error_file_from_the_environment(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "nested" / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))
    with pytest.raises(KeyboardInterrupt), guard():
        raise KeyboardInterrupt
    data = json.loads(path.read_text())
    assert data["framepipe"]["exit_reason"] == "keyboard_interrupt"
    assert data["message"]["message"] == "KeyboardInterrupt: "
    assert not [p for p in path.parent.iterdir() if p.name != "error.json"]  # no temp left


def test_error_file_shows_a_multiline_key_error_as_python_prints_it(tmp_path: Any) -> None:
    path = tmp_path / "error.json"
    try:
        raise KeyError("first line\nsecond line")
    except KeyError as exc:
        write_error_file(path, exc)
        printed = "".join(traceback.format_exception(exc))
    data = json.loads(path.read_text())
    # torchelastic's message, f"{type(e).__name__}: {e}": KeyError quotes its key
    assert data["message"]["message"] == "KeyError: 'first line\\nsecond line'"
    assert data["message"]["extraInfo"]["py_callstack"] == printed


# --- native crashes ------------------------------------------------------------------------


def crash_natively() -> None:
    ctypes.string_at(0)


def segfaulting_worker() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    with guard(label="native"):
        crash_natively()


@pytest.mark.parametrize("method", CONTEXTS)
def test_native_crash_leaves_its_traceback_for_the_parent(method: str) -> None:
    ctx = multiprocessing.get_context(method)
    process = ctx.Process(target=segfaulting_worker)
    process.start()
    process.join(120)
    assert process.exitcode == -signal.SIGSEGV
    assert process.pid is not None
    path = fault_path(process.pid)
    assert os.path.exists(path)
    text = read_native_traceback(process.pid)
    assert text is not None
    assert "Segmentation fault" in text
    assert "crash_natively" in text and "segfaulting_worker" in text
    assert not os.path.exists(path)
    assert read_native_traceback(process.pid) is None


def test_fault_file_lives_while_the_guard_is_open() -> None:
    path = fault_path(os.getpid())
    with guard():
        assert os.path.exists(path)
        with guard():
            pass
        assert os.path.exists(path)  # an inner guard does not disarm the outer one
    assert not os.path.exists(path)
    assert os.path.dirname(path).endswith(f"framepipe-faults-{os.getuid()}")
    st = os.stat(os.path.dirname(path))
    # only this user can write there (a directory made earlier with another private mode counts)
    assert st.st_uid == os.getuid() and not st.st_mode & 0o022


def _exit_inside(label: str, how: str) -> None:
    with guard(label=label):
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGKILL)


@pytest.mark.parametrize("how", ["exit", "kill"])
def test_a_death_inside_a_guard_is_named_by_its_label(how: str, no_leftover_processes: Any) -> None:
    process = multiprocessing.get_context("fork").Process(
        target=_exit_inside, args=("shard-7", how)
    )
    process.start()
    try:
        with Liveness(process) as liveness:
            process.join(WAIT)
            err = liveness.error()
            assert liveness.guard_label() == "shard-7"
    finally:
        if process.is_alive():
            process.kill()
        process.join(WAIT)
    assert process.pid is not None
    what = "exited with code 3" if how == "exit" else "was killed by signal SIGKILL"
    assert str(err).startswith(f"shard-7 {process.pid} {what}"), str(err)
    assert err.label == "shard-7" and err.native_traceback is None
    assert not os.path.exists(fault_path(process.pid))  # read once, then removed


def test_an_error_looked_at_after_close_still_names_the_guard(no_leftover_processes: Any) -> None:
    # A WriterDied reads the guard's fault file when first looked at, not when raised; a
    # Liveness closed before anyone looked reads it then (removing the file) and keeps it.
    process = multiprocessing.get_context("fork").Process(
        target=_exit_inside, args=("shard-9", "kill")
    )
    process.start()
    try:
        liveness = Liveness(process)
        process.join(WAIT)
        assert os.path.exists(fault_path(process.pid))  # nothing read it yet
        err = liveness.error(lost_bytes=5, expected_bytes=20)
        liveness.close()
        assert not os.path.exists(fault_path(process.pid))
    finally:
        if process.is_alive():
            process.kill()
        process.join(WAIT)
    assert err.label == "shard-9" and err.native_traceback is None and err.exitcode == -9
    text = f"shard-9 {process.pid} was killed by signal SIGKILL (9) while a frame was being read"
    assert str(err).startswith(text) and err.args == (str(err),)
    assert repr(err) == f"WriterDied({str(err)!r})"
    again = pickle.loads(pickle.dumps(err))
    assert str(again) == str(err) and again.label == "shard-9" and again.lost_bytes == 5


def _process_with_pid(pid: int) -> Any:
    """A sleeping child given ``pid`` (see ``at_pid``), or None where that cannot be done."""
    ctx = multiprocessing.get_context("fork")
    for _ in range(5):
        process = ctx.Process(target=time.sleep, args=(WAIT,), daemon=True)
        settable, _ = at_pid(pid, process.start)
        if not settable:
            return None
        if process.pid == pid:
            return process
        process.kill()  # another process forked in between: try again
        process.join(WAIT)
    return None


def test_a_late_look_never_removes_the_fault_file_of_a_process_that_took_the_pid(
    no_leftover_processes: Any,
) -> None:
    # The diagnostics are read on first look, maybe after the writer was reaped and its pid
    # given to another process: that process's fault file (another start time) stays.
    writer = multiprocessing.get_context("fork").Process(target=os._exit, args=(3,))
    writer.start()
    liveness = Liveness(writer)
    writer.join(WAIT)
    assert writer.pid is not None
    path = fault_path(writer.pid)
    err = liveness.error()
    time.sleep(0.05)  # start times count in clock ticks (10 ms): the heir's must be later
    heir = _process_with_pid(writer.pid)
    if heir is None:
        liveness.close()
        pytest.skip("cannot give a new process a chosen pid here (/proc/sys/kernel/ns_last_pid)")
    try:
        began = start_time(heir.pid)
        assert began is not None
        with open(path, "w", encoding="utf-8") as file:
            file.write("#framepipe " + json.dumps({"label": "heir", "start": began}) + "\n")
        assert err.label == "worker" and err.native_traceback is None
        assert os.path.exists(path)  # the heir's, left alone
    finally:
        liveness.close()
        heir.kill()
        heir.join(WAIT)
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


@pytest.mark.parametrize("when", ["later", "earlier"])
def test_a_late_look_leaves_a_later_process_s_fault_file_and_removes_a_stale_one(
    when: str, no_leftover_processes: Any
) -> None:
    # Read after the writer was reaped, with no process holding its pid: a file naming a later
    # start time is a later process's (its parent may not have looked yet) and stays; one
    # naming an earlier start time is stale, and goes.
    writer = multiprocessing.get_context("fork").Process(target=time.sleep, args=(WAIT,))
    writer.start()
    liveness = Liveness(writer)
    assert writer.pid is not None
    began = start_time(writer.pid)
    assert began is not None
    writer.kill()
    writer.join(WAIT)
    path = fault_path(writer.pid)
    try:
        err = liveness.error()
        start = began + 1000.0 if when == "later" else began - 1000.0
        with open(path, "w", encoding="utf-8") as file:
            file.write("#framepipe " + json.dumps({"label": "other", "start": start}) + "\n")
        assert start_time(writer.pid) is None  # nobody holds the pid
        assert err.label == "worker" and err.native_traceback is None
        assert os.path.exists(path) == (when == "later")
    finally:
        liveness.close()
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)


def test_a_writer_died_pickles_as_its_own_class_with_its_notes() -> None:
    from framepipe import ReadTimeout
    from framepipe.subprocess_rpc import _ExitedWhileReading

    err = _ExitedWhileReading(7, 0, label="rank 2")
    err.args = ("Exceeded timeout: 3",)
    if hasattr(err, "add_note"):
        err.add_note("while reading the reply")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is _ExitedWhileReading and isinstance(again, ReadTimeout)
    assert again.args == ("Exceeded timeout: 3",) and again.label == "rank 2"
    assert getattr(again, "__notes__", None) == getattr(err, "__notes__", None)


def test_an_explicit_label_stays_when_the_diagnostics_fail(no_leftover_processes: Any) -> None:
    process = multiprocessing.get_context("fork").Process(target=os._exit, args=(3,))
    process.start()
    with Liveness(process) as liveness:
        process.join(WAIT)
        err = liveness.error(label="rank 3")

    def fail() -> tuple[str, bool | None, str | None]:
        raise RuntimeError("no cgroup here")

    err._details = fail  # what a failing file system would do
    assert err.label == "rank 3"
    assert str(err) == f"rank 3 {process.pid} exited with code 3 before writing another frame"


def test_a_writer_died_keeps_args_it_is_given() -> None:
    err = WriterDied(7, -9, label="w")
    assert err.args == (str(err),) and str(err).startswith("w 7 was killed by signal SIGKILL")
    err.args = ("custom", 2)
    assert err.args == ("custom", 2) and str(err) == "('custom', 2)"
    assert repr(err) == "WriterDied('custom', 2)"
    assert pickle.loads(pickle.dumps(err)).args == ("custom", 2)
    assert copy.copy(err).args == ("custom", 2)


def test_an_explicit_label_wins_and_no_guard_means_worker(no_leftover_processes: Any) -> None:
    for target, label, expected in [
        (_exit_inside, "rank 3", "rank 3"),  # the reader's own name for it
        (os._exit, None, "worker"),  # never guarded
    ]:
        args = ("shard-7", "exit") if target is _exit_inside else (3,)
        process = multiprocessing.get_context("fork").Process(target=target, args=args)
        process.start()
        with Liveness(process) as liveness:
            process.join(WAIT)
            err = liveness.error(label=label)
        assert err.label == expected
        assert str(err).startswith(f"{expected} {process.pid} exited with code 3")


def _wait_for_kill(ready: Any) -> None:
    ready.set()
    time.sleep(WAIT)


@pytest.mark.parametrize("start", ["same process", "earlier process"])
def test_a_fault_file_of_an_earlier_process_with_the_pid_is_ignored(
    start: str, no_leftover_processes: Any
) -> None:
    # The fault file names the start time of the process that wrote it: a file left by an
    # earlier process that had the same pid (killed before it could clean up) is not read as
    # the new one's crash.
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    process = ctx.Process(target=_wait_for_kill, args=(ready,))
    process.start()
    try:
        assert ready.wait(WAIT) and process.pid is not None
        with Liveness(process) as liveness:
            began = start_time(process.pid)
            assert began is not None
            written = began if start == "same process" else began - 1000.0
            header = json.dumps({"label": "old-loader", "start": written})
            with open(fault_path(process.pid), "w", encoding="utf-8") as file:
                file.write(f"#framepipe {header}\nFatal Python error: Segmentation fault\n")
            os.kill(process.pid, signal.SIGSEGV)
            process.join(WAIT)
            err = liveness.error()
        if start == "same process":
            assert err.label == "old-loader"
            assert err.native_traceback == "Fatal Python error: Segmentation fault\n"
        else:
            assert err.label == "worker" and err.native_traceback is None
        assert not os.path.exists(fault_path(process.pid))
    finally:
        if process.is_alive():
            process.kill()
        process.join(WAIT)


def test_guard_label_must_be_a_string() -> None:
    with pytest.raises(TypeError, match="label must be a str"):
        guard(label=7)  # type: ignore[call-overload]


# --- the framepipe Connection path: an error frame -----------------------------------------


def framepipe_worker(conn: Any) -> None:
    with guard(conn):
        load_shard()


@pytest.mark.parametrize("method", ["recv", "recv_bytes"])
def test_guard_sends_an_error_frame_the_reader_raises(impl: Any, method: str) -> None:
    read_fd, write_fd = os.pipe()
    reader = impl.Connection(read_fd, writable=False)
    writer = impl.Connection(write_fd, readable=False)
    process = multiprocessing.get_context("fork").Process(target=framepipe_worker, args=(writer,))
    process.start()
    writer.close()
    with pytest.raises(ShardError) as info:
        getattr(reader, method)(timeout=120)
    process.join(120)
    assert process.exitcode == 1
    assert info.value.shard == 3
    names = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert names[0] == "test_guard_sends_an_error_frame_the_reader_raises"
    assert "load_shard" in names
    reader.close()


@pytest.mark.parametrize("method", CONTEXTS)
def test_parent_recv_raises_the_revived_exception(method: str) -> None:
    connection = pytest.importorskip("framepipe.connection")
    ctx = multiprocessing.get_context(method)
    reader, writer = connection.Pipe(duplex=False)
    process = ctx.Process(target=framepipe_worker, args=(writer,))
    process.start()
    writer.close()
    with pytest.raises(ShardError) as info:
        reader.recv()
    process.join(120)
    assert info.value.shard == 3
    assert "load_shard" in [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    reader.close()


# --- record and ProcessFailure ---------------------------------------------------------------


def test_record_writes_the_error_file(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "error.json"
    monkeypatch.setenv(ERROR_FILE_ENV, str(path))

    @record
    def main() -> None:
        load_shard()

    with pytest.raises(ShardError):
        main()
    failure = ProcessFailure(local_rank=0, pid=os.getpid(), exitcode=1, error_file=str(path))
    assert failure.error_file == str(path)
    assert isinstance(failure.message, dict)
    assert failure.message["message"] == "ShardError: shard 3: checksum mismatch"
    assert failure.py_callstack is not None and "load_shard" in failure.py_callstack
    assert failure.timestamp == int(failure.message["extraInfo"]["timestamp"])
    assert failure.host == socket.gethostname()
    assert failure.exit_reason == "exception"
    assert failure.timestamp_ns is not None
    assert failure.timestamp_ns // 1_000_000_000 == failure.timestamp
    assert failure.signal_name() == "<N/A>"
    assert failure.timestamp_isoformat().count("_") == 1


def test_record_exit_semantics(tmp_path: Any) -> None:
    path = tmp_path / "error.json"

    @record(error_file=str(path))
    def exits(code: Any) -> str:
        sys.exit(code)

    assert exits(0) is None
    with pytest.raises(SystemExit):
        exits(2)
    assert not path.exists()

    @record(error_file=str(path))
    def interrupted() -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert not path.exists()

    @record(error_file=str(path))
    def returns() -> int:
        return 5

    assert returns() == 5


class ChildFailed(Exception):
    """Shaped like torchelastic's ChildFailedError."""

    def __init__(self, failure: ProcessFailure) -> None:
        super().__init__("child failed")
        self.failure = failure

    def get_first_failure(self) -> tuple[int, ProcessFailure]:
        return 0, self.failure


def test_record_propagates_the_childs_error_file(tmp_path: Any) -> None:
    child_file = tmp_path / "child.json"
    try:
        load_shard()
    except ShardError as exc:
        write_error_file(child_file, exc)
    failure = ProcessFailure(
        local_rank=1, pid=1234, exitcode=-signal.SIGSEGV, error_file=str(child_file)
    )
    parent_file = tmp_path / "parent.json"

    @record(error_file=str(parent_file))
    def agent() -> None:
        raise ChildFailed(failure)

    with pytest.raises(ChildFailed):
        agent()
    data = json.loads(parent_file.read_text())
    assert data["message"]["errorCode"] == -signal.SIGSEGV
    assert data["message"]["message"] == "ShardError: shard 3: checksum mismatch"
    again = ProcessFailure(0, 1234, -signal.SIGSEGV, str(parent_file))
    assert again.error_code == -signal.SIGSEGV


def test_process_failure_without_or_with_a_bad_file(tmp_path: Any) -> None:
    failure = ProcessFailure(0, 4321, -signal.SIGSEGV, str(tmp_path / "absent.json"))
    assert failure.error_file == "<N/A>"
    assert failure.signal_name() == "SIGSEGV"
    assert "SIGSEGV" in failure.message and "4321" in failure.message
    assert failure.py_callstack is None and failure.host is None

    exited = ProcessFailure(0, 4321, 3, "")
    assert "exited with code 3" in exited.message

    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    broken = ProcessFailure(0, 4321, 1, str(bad))
    assert "could not be read" in broken.message

    plain = tmp_path / "plain.json"
    plain.write_text(json.dumps({"message": "simple failure", "timestamp": 1700000000}))
    simple = ProcessFailure(0, 4321, 1, str(plain))
    assert simple.message == "simple failure" and simple.timestamp == 1700000000
