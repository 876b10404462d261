"""framepipe.remote: exceptions raised in real fork and spawn children, revived in the parent."""

from __future__ import annotations

import builtins
import errno
import multiprocessing
import os
import pickle
import socket
import subprocess
import sys
import textwrap
import threading
import traceback
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import frame_names

from framepipe.guard import guard
from framepipe.remote import (
    MAX_FRAMES,
    RefusedPayload,
    RemoteError,
    RemoteTraceback,
    add_note,
    dumps_exception,
    loads_exception,
    sender_label,
)

# --- exception classes the children raise ---------------------------------------------------


class TwoArgsError(ValueError):
    def __init__(self, path: str, code: int) -> None:
        super().__init__(f"{path}: error {code}")
        self.path = path
        self.code = code


class KwOnlyError(RuntimeError):
    def __init__(self, *, retries: int) -> None:
        super().__init__(f"gave up after {retries} retries")
        self.retries = retries


class LockedError(LookupError):
    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()
        self.count = 2


class DiskFullError(OSError):
    def __init__(self, path: str, *, device: str) -> None:
        super().__init__(errno.ENOSPC, "No space left on device", path)
        self.device = device


class BadReduceError(LookupError):
    def __init__(self, message: str, table: str) -> None:
        super().__init__(message)
        self.table = table

    def __reduce__(self) -> Any:
        raise RuntimeError("this exception refuses to be pickled")


class BadStrError(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception refuses to be printed")


# --- what the children do -------------------------------------------------------------------


def raise_two_args() -> None:
    raise TwoArgsError("/data/shard-3", 7)


def raise_kw_only() -> None:
    raise KwOnlyError(retries=5)


def raise_locked() -> None:
    raise LockedError("resource busy")


def _lookup_missing() -> None:
    {}["missing"]


def _convert() -> None:
    try:
        _lookup_missing()
    except KeyError as exc:
        raise ValueError("bad value") from exc


def raise_chained() -> None:
    try:
        _convert()
    except ValueError:
        raise RuntimeError("while handling the bad value")  # the ValueError is its context


def _raise_member(exc: BaseException) -> None:
    raise exc


def _caught(exc: BaseException) -> BaseException:
    try:
        _raise_member(exc)
    except BaseException as caught:
        return caught
    raise AssertionError("unreachable")


GROUP = getattr(builtins, "ExceptionGroup", None)  # Python 3.11+
needs_groups = pytest.mark.skipif(GROUP is None, reason="exception groups need Python 3.11")


def raise_groups() -> None:
    assert GROUP is not None
    inner = GROUP("inner", [_caught(TypeError("b")), _caught(KeyError("c"))])
    raise GROUP("outer", [_caught(ValueError("a")), _caught(inner)])


def raise_with_notes() -> None:
    exc = ValueError("with notes")
    exc.__notes__ = ["first note", "second note"]  # what add_note() makes on Python 3.11+
    raise exc


MULTILINE = "no worker named 'w9'\navailable: w1, w2"


def raise_multiline_key() -> None:
    raise KeyError(MULTILINE)


def open_missing_file() -> None:
    with open("/nonexistent/framepipe/shard.bin", "rb"):
        pass


def raise_disk_full() -> None:
    raise DiskFullError("/scratch/out.bin", device="/dev/sdz")


def raise_bad_reduce() -> None:
    raise BadReduceError("no such row", "users")


def raise_bad_str() -> None:
    raise BadStrError("unprintable", 42)


def recurse(n: int = 0) -> int:
    return recurse(n + 1) + 1


def raise_system_exit() -> None:
    sys.exit(3)


def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


CASES: dict[str, Callable[[], Any]] = {
    "two_args": raise_two_args,
    "kw_only": raise_kw_only,
    "locked": raise_locked,
    "chained": raise_chained,
    **({"groups": raise_groups} if GROUP is not None else {}),
    "notes": raise_with_notes,
    "multiline_key": raise_multiline_key,
    "missing_file": open_missing_file,
    "disk_full": raise_disk_full,
    "bad_reduce": raise_bad_reduce,
    "bad_str": raise_bad_str,
    "recursion": recurse,
    "system_exit": raise_system_exit,
    "keyboard_interrupt": raise_keyboard_interrupt,
}


def child_main(conn: Any) -> None:
    """Run every case under the guard, which sends each exception through ``conn``."""
    for case in CASES.values():
        try:
            with guard(conn, label="test-child"):
                case()
        except BaseException:
            pass
    conn.close()


@pytest.fixture(scope="module", params=["fork", "spawn"])
def child(request: pytest.FixtureRequest) -> dict[str, Any]:
    """Payloads of every case, sent by a real child of the given start method."""
    ctx = multiprocessing.get_context(request.param)
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=child_main, args=(writer,), name=f"remote-{request.param}")
    process.start()
    writer.close()
    payloads = {}
    try:
        for name in CASES:
            assert reader.poll(120), f"no payload for {name!r} from the {request.param} child"
            payloads[name] = reader.recv_bytes()
    finally:
        process.join(60)
        reader.close()
    return {"payloads": payloads, "pid": process.pid, "name": process.name}


def revived(child: dict[str, Any], name: str) -> BaseException:
    return loads_exception(child["payloads"][name])


def remote_trace(exc: BaseException) -> RemoteTraceback:
    seen = set()
    while id(exc) not in seen:
        seen.add(id(exc))
        nxt = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
        if nxt is None:
            break
        exc = nxt
    assert isinstance(exc, RemoteTraceback), f"chain ends in {exc!r}"
    return exc


# --- the cases ------------------------------------------------------------------------------


# A custom exception of the child's, its base, the args and the attributes it comes back with.
REVIVED = {
    "two_args": (
        TwoArgsError,
        ValueError,
        ("/data/shard-3: error 7",),
        {"path": "/data/shard-3", "code": 7},
    ),
    "kw_only": (KwOnlyError, RuntimeError, ("gave up after 5 retries",), {"retries": 5}),
    "locked": (LockedError, LookupError, ("resource busy",), {"count": 2}),
}


@pytest.mark.parametrize("name", REVIVED)
def test_custom_exceptions_keep_their_class_args_and_attributes(
    child: dict[str, Any], name: str
) -> None:
    # two required args, keyword-only args, and an attribute that cannot be pickled
    cls, base, args, attrs = REVIVED[name]
    exc = revived(child, name)
    assert type(exc) is cls
    assert isinstance(exc, base)
    assert exc.args == args
    assert {k: getattr(exc, k) for k in attrs} == attrs
    assert f"raise_{name}" in frame_names(exc)


def test_unpicklable_attribute_becomes_its_repr(child: dict[str, Any]) -> None:
    exc = revived(child, "locked")
    assert isinstance(exc.lock, str) and exc.lock.startswith("<unlocked _thread.lock")


def test_cause_and_context_are_kept(child: dict[str, Any]) -> None:
    exc = revived(child, "chained")
    assert type(exc) is RuntimeError
    assert exc.args == ("while handling the bad value",)
    assert "raise_chained" in frame_names(exc)
    context = exc.__context__
    assert type(context) is ValueError and context.args == ("bad value",)
    assert not exc.__suppress_context__
    assert "_convert" in frame_names(context)
    cause = context.__cause__
    assert type(cause) is KeyError and cause.args == ("missing",)
    assert context.__suppress_context__
    assert "_lookup_missing" in frame_names(cause)
    assert cause.__context__ is None
    assert isinstance(cause.__cause__, RemoteTraceback)  # where the displayed chain ends


@needs_groups
def test_nested_exception_groups(child: dict[str, Any]) -> None:
    exc = revived(child, "groups")
    assert type(exc) is GROUP
    assert isinstance(exc, Exception)
    assert exc.message == "outer"
    assert "raise_groups" in frame_names(exc)
    first, inner = exc.exceptions
    assert type(first) is ValueError and first.args == ("a",)
    assert type(inner) is GROUP and inner.message == "inner"
    assert [type(e) for e in inner.exceptions] == [TypeError, KeyError]
    assert [e.args for e in inner.exceptions] == [("b",), ("c",)]
    for member in (first, *inner.exceptions):
        assert "_raise_member" in frame_names(member)
    matched, rest = exc.split(TypeError)
    assert matched is not None and rest is not None


def test_notes(child: dict[str, Any]) -> None:
    exc = revived(child, "notes")
    assert type(exc) is ValueError
    assert exc.args == ("with notes",)
    assert exc.__notes__ == ["first note", "second note"]
    assert "raise_with_notes" in frame_names(exc)


class _WithoutAddNote(ValueError):
    """An exception as Python 3.10 makes them: no add_note method."""

    @property
    def add_note(self) -> Any:
        raise AttributeError("add_note")


def test_add_note_without_add_note_keeps_notes_as_3_11_does() -> None:
    exc = _WithoutAddNote("no add_note here")
    assert not hasattr(exc, "add_note")
    add_note(exc, "first note")
    add_note(exc, "second note")
    assert exc.__notes__ == ["first note", "second note"]
    again = loads_exception(dumps_exception(exc), allow=[_WithoutAddNote])
    assert type(again) is _WithoutAddNote and again.__notes__ == ["first note", "second note"]
    plain = KeyError("k")  # where add_note exists, it is the one used
    add_note(plain, "a note")
    assert plain.__notes__ == ["a note"]


def test_multiline_key_error_prints_as_the_original(child: dict[str, Any]) -> None:
    exc = revived(child, "multiline_key")
    original = KeyError(MULTILINE)
    assert type(exc) is KeyError
    assert exc.args == (MULTILINE,)
    assert str(exc) == str(original) == repr(MULTILINE)
    assert repr(exc) == repr(original)
    assert "raise_multiline_key" in frame_names(exc)
    # the child's own traceback text ends as Python printed it there
    assert remote_trace(exc).text.rstrip().endswith(f"KeyError: {original}")


def test_oserror_keeps_errno_and_filename(child: dict[str, Any]) -> None:
    exc = revived(child, "missing_file")
    assert type(exc) is FileNotFoundError
    assert isinstance(exc, OSError)
    assert exc.errno == errno.ENOENT
    assert exc.filename == "/nonexistent/framepipe/shard.bin"
    assert exc.args == (errno.ENOENT, os.strerror(errno.ENOENT))
    assert "open_missing_file" in frame_names(exc)


def test_oserror_subclass_rebuilt_without_init(child: dict[str, Any]) -> None:
    exc = revived(child, "disk_full")
    assert type(exc) is DiskFullError
    assert isinstance(exc, OSError)
    assert (exc.errno, exc.strerror, exc.filename) == (
        errno.ENOSPC,
        "No space left on device",
        "/scratch/out.bin",
    )
    assert exc.device == "/dev/sdz"
    assert exc.args == (errno.ENOSPC, "No space left on device")
    assert "raise_disk_full" in frame_names(exc)


def test_reduce_that_raises(child: dict[str, Any]) -> None:
    exc = revived(child, "bad_reduce")
    assert type(exc) is BadReduceError
    assert isinstance(exc, LookupError)
    assert exc.args == ("no such row",)
    assert exc.table == "users"
    assert "raise_bad_reduce" in frame_names(exc)


def test_str_that_raises(child: dict[str, Any]) -> None:
    exc = revived(child, "bad_str")
    assert type(exc) is BadStrError
    assert isinstance(exc, Exception)
    assert exc.args == ("unprintable", 42)
    assert "raise_bad_str" in frame_names(exc)
    assert "BadStrError" in remote_trace(exc).text


def test_recursion_error_is_capped(child: dict[str, Any]) -> None:
    exc = revived(child, "recursion")
    assert type(exc) is RecursionError
    assert isinstance(exc, RuntimeError)
    assert "recursion" in exc.args[0]
    names = frame_names(exc)
    assert len(names) == MAX_FRAMES + 1
    assert names.count("recurse") == MAX_FRAMES - 1  # the guard's own frame comes first
    dropped = [n for n in names if "frames dropped" in n]
    assert len(dropped) == 1
    assert int(dropped[0].strip("<>").split()[0]) > 0


def test_system_exit(child: dict[str, Any]) -> None:
    exc = revived(child, "system_exit")
    assert type(exc) is SystemExit
    assert not isinstance(exc, Exception)
    assert exc.code == 3 and exc.args == (3,)
    assert "raise_system_exit" in frame_names(exc)


def test_keyboard_interrupt(child: dict[str, Any]) -> None:
    exc = revived(child, "keyboard_interrupt")
    assert type(exc) is KeyboardInterrupt
    assert not isinstance(exc, Exception)
    assert exc.args == ()
    assert "raise_keyboard_interrupt" in frame_names(exc)


def test_cause_chain_ends_in_remote_traceback(child: dict[str, Any]) -> None:
    exc = revived(child, "two_args")
    trace = remote_trace(exc)
    assert trace.pid == child["pid"]
    assert trace.process_name == child["name"]
    assert trace.host == socket.gethostname()
    assert "raise_two_args" in trace.text
    shown = str(trace)
    assert f"process {child['pid']}" in shown and child["name"] in shown


def test_raised_revived_traceback_shows_both_processes(child: dict[str, Any]) -> None:
    exc = revived(child, "two_args")
    with pytest.raises(TwoArgsError) as info:
        raise exc
    names = frame_names(info.value)
    assert names[0] == "test_raised_revived_traceback_shows_both_processes"
    assert "raise_two_args" in names
    printed = "".join(traceback.format_exception(info.value))
    assert "The above exception was the direct cause" in printed
    assert 'raise TwoArgsError("/data/shard-3", 7)' in printed


# --- a class only the child has ---------------------------------------------------------------

CHILD_SCRIPT = """
import multiprocessing.connection
import sys

from framepipe.guard import guard


class QuotaError(KeyError):
    def __init__(self, user, *, limit):
        super().__init__(user)
        self.limit = limit
        self.user = user


def check_quota():
    raise QuotaError("alice", limit=10)


conn = multiprocessing.connection.Connection(int(sys.argv[1]), readable=False)
with guard(conn, label="script"):
    check_quota()
"""


def test_class_from_the_childs_main_becomes_a_stand_in(tmp_path: Any) -> None:
    script = tmp_path / "quota_worker.py"
    script.write_text(textwrap.dedent(CHILD_SCRIPT))
    read_fd, write_fd = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    with subprocess.Popen(
        [sys.executable, str(script), str(write_fd)],
        pass_fds=(write_fd,),
        env=env,
        stderr=subprocess.PIPE,
    ) as proc:
        os.close(write_fd)
        reader = multiprocessing.connection.Connection(read_fd, writable=False)
        assert reader.poll(120)
        payload = reader.recv_bytes()
        reader.close()
        _, stderr = proc.communicate()
    assert proc.returncode == 1
    assert b"[SCRIPT CRASH]" in stderr

    exc = loads_exception(payload)
    assert isinstance(exc, KeyError)
    assert isinstance(exc, RemoteError)
    assert type(exc).__name__ == "QuotaError"
    assert exc.remote_type == "__main__.QuotaError"
    assert exc.args == ("alice",)
    assert exc.remote_args == "('alice',)"
    assert exc.limit == 10 and exc.user == "alice"
    assert exc.remote_attrs == {"limit": "10", "user": "'alice'"}
    assert "check_quota" in frame_names(exc)
    with pytest.raises(KeyError):
        raise exc
    assert remote_trace(exc).pid == proc.pid


SPAWNING_SCRIPT = """
import multiprocessing

from framepipe.guard import guard
from framepipe.remote import RemoteError, loads_exception


class AppError(Exception):
    def __init__(self, code):
        super().__init__(f"code {code}")
        self.code = code


def work(conn):
    with guard(conn, label="spawned"):
        raise AppError(4)


if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    reader, writer = ctx.Pipe(duplex=False)
    process = ctx.Process(target=work, args=(writer,))
    process.start()
    writer.close()
    exc = loads_exception(reader.recv_bytes())
    process.join()
    print(type(exc) is AppError, exc.code, isinstance(exc, RemoteError))
"""


def test_main_class_revives_when_both_run_the_same_script(tmp_path: Any) -> None:
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent(SPAWNING_SCRIPT))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    out = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, check=True)
    assert out.stdout.split() == [b"True", b"4", b"False"]


# --- in-process properties ------------------------------------------------------------------


def _payload_of(exc: BaseException) -> bytes:
    try:
        raise exc
    except BaseException as caught:
        return dumps_exception(caught)


def test_allow_builtins_only_degrades_custom_classes() -> None:
    payload = _payload_of(TwoArgsError("/x", 1))
    exc = loads_exception(payload, allow=["builtins"])
    assert type(exc) is not TwoArgsError
    assert isinstance(exc, ValueError) and isinstance(exc, RemoteError)
    assert exc.remote_type == f"{__name__}.TwoArgsError"
    assert exc.args == ("/x: error 1",)
    assert exc.path == "/x"
    assert str(exc) == "/x: error 1"
    assert type(loads_exception(payload, allow=[TwoArgsError])) is TwoArgsError
    assert type(loads_exception(payload, allow=[__name__])) is TwoArgsError


def test_module_the_receiver_lacks_degrades_to_base() -> None:
    class Missing(ConnectionError):
        pass

    Missing.__module__ = "framepipe_tests_absent_package.errors"
    Missing.__qualname__ = "Missing"
    exc = loads_exception(_payload_of(Missing(errno.ECONNRESET, "reset by peer")))
    assert isinstance(exc, ConnectionError) and isinstance(exc, RemoteError)
    assert exc.remote_type == "framepipe_tests_absent_package.errors.Missing"
    assert exc.errno == errno.ECONNRESET
    assert exc.args == (errno.ECONNRESET, "reset by peer")


def test_stand_in_pickles_with_the_stdlib() -> None:
    class Missing(KeyError):
        pass

    Missing.__module__ = "framepipe_tests_absent_package"
    exc = loads_exception(_payload_of(Missing("k")))
    again = pickle.loads(pickle.dumps(exc))
    assert isinstance(again, KeyError) and isinstance(again, RemoteError)
    assert again.args == ("k",) and again.remote_type == exc.remote_type
    twice = loads_exception(dumps_exception(exc))
    assert isinstance(twice, KeyError) and twice.remote_type == exc.remote_type


class _Shell:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (os.system, (f"touch {self.marker}",))


def test_payload_calling_os_system_is_refused(tmp_path: Any) -> None:
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Shell(str(marker)))
    with pytest.raises(RefusedPayload, match="system"):
        loads_exception(payload)
    assert not marker.exists()


def test_nested_payload_calling_os_system_is_refused(tmp_path: Any) -> None:
    marker = tmp_path / "ran"
    envelope = pickle.loads(_payload_of(ValueError("innocent")))
    envelope["nodes"][0]["object"] = pickle.dumps(_Shell(str(marker)))
    with pytest.raises(RefusedPayload, match="system"):
        loads_exception(pickle.dumps(envelope))
    envelope["nodes"][0]["object"] = None
    envelope["nodes"][0]["args"] = [(pickle.dumps(_Shell(str(marker))), "'x'")]
    with pytest.raises(RefusedPayload, match="system"):
        loads_exception(pickle.dumps(envelope))
    assert not marker.exists()
    assert isinstance(RefusedPayload("x"), pickle.UnpicklingError)


def test_garbage_is_refused() -> None:
    with pytest.raises(RefusedPayload):
        loads_exception(b"\x00\x01 not a pickle")
    with pytest.raises(RefusedPayload):
        loads_exception(pickle.dumps({"some": "dict"}))


def test_dumps_never_fails_on_hostile_exceptions() -> None:
    class Hostile(Exception):
        def __reduce__(self) -> Any:
            raise RuntimeError("no pickling")

        def __str__(self) -> str:
            raise RuntimeError("no str")

    class Unreprable:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

    exc = Hostile(Unreprable())
    exc.thing = Unreprable()
    revived_exc = loads_exception(_payload_of(exc))
    assert isinstance(revived_exc, Exception) and isinstance(revived_exc, RemoteError)
    assert revived_exc.remote_type.endswith("<locals>.Hostile")
    assert "Unreprable object failed" in revived_exc.thing
    assert "Unreprable object failed" in revived_exc.args[0]


def test_cycles_are_cut() -> None:
    first, second = ValueError("first"), TypeError("second")
    first.__context__, second.__context__ = second, first
    exc = loads_exception(dumps_exception(first))
    assert type(exc) is ValueError and type(exc.__context__) is TypeError
    assert exc.__context__.__context__ is exc


# --- the sender's label ---------------------------------------------------------------------


def _end(exc: BaseException) -> RemoteTraceback:
    end = exc.__cause__
    assert isinstance(end, RemoteTraceback)
    return end


def test_a_label_names_the_sender_in_the_remote_traceback() -> None:
    plain = loads_exception(dumps_exception(ValueError("x")))
    assert _end(plain).label is None
    assert f"Traceback from process {os.getpid()} (" in str(_end(plain))

    named = loads_exception(dumps_exception(ValueError("x"), label="loader"))
    assert _end(named).label == "loader"
    assert f"Traceback from loader process {os.getpid()} (" in str(_end(named))

    with sender_label("collector"):
        inside = loads_exception(dumps_exception(ValueError("x")))
        explicit = loads_exception(dumps_exception(ValueError("x"), label="rank 2"))
    after = loads_exception(dumps_exception(ValueError("x")))
    assert _end(inside).label == "collector"
    assert _end(explicit).label == "rank 2"
    assert _end(after).label is None  # the context ended with the block

    again = pickle.loads(pickle.dumps(_end(named)))
    assert again.label == "loader" and str(again) == str(_end(named))
