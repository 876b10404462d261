"""framepipe.compat: the reference names, driven the way the reference's users drive them."""

from __future__ import annotations

import dataclasses
import marshal
import multiprocessing
import os
import pickle
import queue
import subprocess
import sys
import textwrap
import threading
from typing import Any

import pytest
from _helpers import frame_names, run_guarded

from framepipe.compat import (
    ChildTraceException,
    ExceptionWrapper,
    SerializedException,
    UnserializableException,
    collector_error_guard,
    create_error_pipe,
)
from framepipe.remote import RemoteError, RemoteTraceback

CONTEXTS = ["fork", "spawn"]


class BatchError(RuntimeError):
    def __init__(self, batch: int, *, worker: str) -> None:
        super().__init__(f"batch {batch} failed on {worker}")
        self.batch = batch
        self.worker = worker


def run_batch() -> None:
    raise BatchError(12, worker="w3")


def chain_end(exc: BaseException) -> BaseException:
    while exc.__cause__ is not None:
        exc = exc.__cause__
    return exc


# --- SerializedException, as the reference worker loop uses it ------------------------------


def snippet_worker(conn: Any) -> None:
    try:
        run_batch()
    except Exception as e:
        serialized = SerializedException.from_exception(e, sys.exc_info()[2])
        conn.send_bytes(marshal.dumps(dataclasses.asdict(serialized)))


@pytest.mark.parametrize("method", CONTEXTS)
def test_serialized_exception_revives_custom_classes(method: str) -> None:
    ctx = multiprocessing.get_context(method)
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=snippet_worker, args=(writer,))
    process.start()
    writer.close()
    assert reader.poll(120)
    serialized = SerializedException(**marshal.loads(reader.recv_bytes()))
    process.join(120)

    with pytest.raises(BatchError) as info:
        SerializedException.raise_from(serialized, extra_context="while running snippet 7")
    exc = info.value
    assert isinstance(exc, RuntimeError)
    assert exc.args == ("batch 12 failed on w3",)
    assert (exc.batch, exc.worker) == (12, "w3")
    assert "run_batch" in frame_names(exc)
    trace = chain_end(exc)
    assert isinstance(trace, ChildTraceException) and isinstance(trace, RemoteTraceback)
    assert "run_batch" in trace.text and trace.text.endswith("while running snippet 7")
    assert trace.pid == process.pid
    assert "BatchError" in serialized._type_repr
    assert "batch 12" in serialized._args_repr and "run_batch" in serialized._traceback_print


MAIN_SCRIPT = """
import dataclasses
import marshal
import sys

from framepipe.compat import SerializedException


class QuotaError(KeyError):
    def __init__(self, user, *, limit):
        super().__init__(user)
        self.limit = limit


def check_quota():
    raise QuotaError("alice", limit=10)


try:
    check_quota()
except Exception as e:
    se = SerializedException.from_exception(e, sys.exc_info()[2])
    sys.stdout.buffer.write(marshal.dumps(dataclasses.asdict(se)))
"""


def test_class_only_the_child_has_is_unserializable_and_its_base(tmp_path: Any) -> None:
    script = tmp_path / "quota.py"
    script.write_text(textwrap.dedent(MAIN_SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, check=True)
    serialized = SerializedException(**marshal.loads(out.stdout))
    with pytest.raises(UnserializableException) as info:
        SerializedException.raise_from(serialized)
    exc = info.value
    assert isinstance(exc, KeyError) and isinstance(exc, RemoteError)
    assert exc.type_repr == "<class '__main__.QuotaError'>"
    assert exc.args_repr == "('alice',)"
    assert exc.args == ("alice",) and exc.limit == 10
    assert "check_quota" in frame_names(exc)
    assert isinstance(chain_end(exc), ChildTraceException)


def test_unserializable_exception_keeps_its_constructor() -> None:
    exc = UnserializableException("<class 'x.Y'>", "(1,)")
    assert (exc.type_repr, exc.args_repr) == ("<class 'x.Y'>", "(1,)")
    assert isinstance(exc, Exception)


# --- ExceptionWrapper and collector_error_guard ----------------------------------------------


def collector(conn: Any, metrics: Any, stop: Any, stderr_path: str) -> None:
    sys.stderr = open(stderr_path, "w")  # noqa: SIM115 (for the rest of this child's life)
    with collector_error_guard(conn, metrics, stop, label="collector"):
        run_batch()


@pytest.mark.parametrize("method", CONTEXTS)
def test_collector_guard_sends_a_wrapper(method: str, tmp_path: Any) -> None:
    stderr_path = tmp_path / "stderr.txt"
    message, metrics, stop, _ = run_guarded(method, collector, str(stderr_path))
    wrapper = pickle.loads(message)
    assert isinstance(wrapper, ExceptionWrapper)
    assert wrapper.where == "in collector"
    assert wrapper.exc_type is BatchError
    assert "run_batch" in wrapper.exc_msg and "batch 12 failed on w3" in wrapper.exc_msg
    with pytest.raises(BatchError) as info:
        wrapper.reraise()
    assert info.value.worker == "w3"
    assert info.value.__notes__ == [f"Caught {__name__}.BatchError in collector."]
    assert "run_batch" in frame_names(info.value)
    assert "run_batch" in metrics.get(timeout=60)["error"]
    assert stop.is_set()
    assert "[COLLECTOR CRASH]" in stderr_path.read_text()


def test_collector_guard_reports_exceptions_only() -> None:
    items: queue.Queue[Any] = queue.Queue()
    stop = threading.Event()
    with (
        pytest.raises(KeyboardInterrupt),
        collector_error_guard(metrics_queue=items, stop_event=stop),
    ):
        raise KeyboardInterrupt
    assert items.empty() and not stop.is_set()


def test_wrapper_in_process_and_pickled() -> None:
    try:
        raise KeyError("no such key\nlooked in: a, b")
    except KeyError:
        wrapper = ExceptionWrapper(where="in loader")
    again = pickle.loads(pickle.dumps(wrapper))
    assert again.exc_type is KeyError
    with pytest.raises(KeyError) as info:
        again.reraise()
    assert str(info.value) == str(KeyError("no such key\nlooked in: a, b"))
    assert info.value.__notes__ == ["Caught KeyError in loader."]


def test_wrapper_without_an_exception() -> None:
    wrapper = ExceptionWrapper()
    assert wrapper.exc_type is None
    with pytest.raises(RuntimeError, match="Unknown exception in collector"):
        wrapper.reraise()


def test_create_error_pipe_is_a_framepipe_pipe() -> None:
    connection = pytest.importorskip("framepipe.connection")
    recv_conn, send_conn = create_error_pipe()
    assert isinstance(recv_conn, connection.Connection)
    try:
        raise BatchError(1, worker="w0")
    except BatchError:
        send_conn.send(ExceptionWrapper())
    with pytest.raises(BatchError):
        recv_conn.recv().reraise()
    recv_conn.close()
    send_conn.close()
