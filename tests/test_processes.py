"""Connections shared with child processes: multiprocessing (fork, spawn, forkserver) and
subprocess with pass_fds; and writes to a pipe whose reader is gone."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import threading

import _children
import numpy as np
import pytest
from _children import pattern
from _helpers import START_METHODS, TESTS, child_env, running

TIMEOUT = 60.0  # a hang guard only


@contextlib.contextmanager
def script_child(impl, role: str, *args, pass_fds, **popen_kwargs):
    """``python _children.py ENGINE role args...`` as a subprocess that is handed the fds
    ``pass_fds``; killed and waited for on the way out, failures included."""
    argv = [sys.executable, os.path.join(TESTS, "_children.py"), impl.ENGINE, role, *map(str, args)]
    proc = subprocess.Popen(argv, pass_fds=pass_fds, env=child_env(), **popen_kwargs)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def frames_then_eof(reader, sizes) -> None:
    """``reader`` gets ``pattern(n)`` for each n of ``sizes``, then the end of the file."""
    for n in sizes:
        assert reader.recv_bytes(timeout=TIMEOUT) == pattern(n)
    with pytest.raises(EOFError):
        reader.recv_bytes(timeout=TIMEOUT)


def test_children_module_is_importable_by_spawned_children():
    # The premise of the spawn and forkserver tests below.
    assert os.path.dirname(os.path.abspath(_children.__file__)) == TESTS
    assert TESTS in [os.path.abspath(p) for p in sys.path]


@pytest.mark.parametrize("method", START_METHODS)
def test_connection_passed_to_a_process(impl, method):
    parent, child = impl.pipe(duplex=True)
    with parent, child, running(method, _children.serve, child) as proc:
        child.close()  # the child holds its own copy now

        parent.send("module")
        assert parent.recv(timeout=TIMEOUT) == impl.ENGINE  # the same engine

        for n in (0, 1, 70_000, 3 << 20):
            parent.send(("bytes", n))
            assert parent.recv_bytes(timeout=TIMEOUT) == pattern(n)

        parent.send("echo-bytes")
        data = os.urandom(2 << 20)
        sender = threading.Thread(target=parent.send_bytes, args=(data,), daemon=True)
        sender.start()
        assert parent.recv_bytes(timeout=TIMEOUT) == data
        sender.join(TIMEOUT)

        obj = {"list": [1, 2.5, "three"], "array": np.arange(300_000, dtype=np.float64)}
        sender = threading.Thread(target=parent.send, args=(obj,), daemon=True)
        sender.start()
        back = parent.recv(timeout=TIMEOUT)
        sender.join(TIMEOUT)
        assert back["list"] == obj["list"]
        assert np.array_equal(back["array"], obj["array"])

        parent.send(("array", 1 << 20))
        arr = parent.recv(timeout=TIMEOUT)
        assert arr.dtype == np.uint8 and arr.tobytes() == pattern(1 << 20)
        assert arr.flags.writeable

        parent.send(None)  # the child returns and closes its end
        with pytest.raises(EOFError):
            parent.recv(timeout=TIMEOUT)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0


@pytest.mark.parametrize("method", START_METHODS)
def test_one_way_connection_passed_to_a_process(impl, method):
    reader, writer = impl.pipe(duplex=False)
    sizes = [5, 0, 65_537, 2 << 20, 1]
    with reader, writer, running(method, _children.send_frames_and_exit, writer, sizes) as proc:
        writer.close()
        frames_then_eof(reader, sizes)
        proc.join(TIMEOUT)
        assert proc.exitcode == 0


@pytest.mark.parametrize("transport", ["two-pipes", "socketpair"])
def test_connection_used_by_a_subprocess_child(impl, transport):
    if transport == "socketpair":
        s1, s2 = socket.socketpair()
        parent = impl.Connection(s1.detach())
        child_fds = [s2.detach()]
    else:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        parent = impl.Connection(r1, write_handle=w2)
        child_fds = [r2, w1]
    try:
        with script_child(impl, "serve", *child_fds, pass_fds=child_fds) as proc:
            for fd in child_fds:
                os.close(fd)
            child_fds = []
            talk_to_a_script_child(impl, parent)
            assert proc.wait(TIMEOUT) == 0
    finally:
        for fd in child_fds:
            os.close(fd)
        parent.close()


def talk_to_a_script_child(impl, parent) -> None:
    parent.send("module")
    assert parent.recv(timeout=TIMEOUT) == impl.ENGINE
    parent.send(("bytes", 1 << 20))
    assert parent.recv_bytes(timeout=TIMEOUT) == pattern(1 << 20)
    parent.send({"k": [1, 2]})
    assert parent.recv(timeout=TIMEOUT) == {"k": [1, 2]}
    parent.send(("array", 200_000))
    assert parent.recv(timeout=TIMEOUT).tobytes() == pattern(200_000)
    parent.send(None)
    with pytest.raises(EOFError):
        parent.recv(timeout=TIMEOUT)


def test_one_way_connection_used_by_a_subprocess_child(impl):
    reader, writer = impl.pipe(duplex=False)
    sizes = [3, 0, 100_000, 4 << 20]
    fd = writer.fileno()
    child = script_child(impl, "frames", fd, ",".join(map(str, sizes)), pass_fds=[fd])
    with reader, writer, child as proc:
        writer.close()
        frames_then_eof(reader, sizes)
        assert proc.wait(TIMEOUT) == 0


# --- a reader that is gone ------------------------------------------------------------------------


def test_write_after_the_reader_closed_raises_broken_pipe(impl):
    reader, writer = impl.pipe(duplex=False)
    reader.close()
    try:
        for send in (
            lambda: writer.send_bytes(b"x"),
            lambda: writer.send([1]),
            lambda: writer.send(np.zeros(100_000)),
        ):
            with pytest.raises(BrokenPipeError):
                send()
    finally:
        writer.close()


def test_write_to_a_duplex_peer_that_closed_raises_broken_pipe(impl):
    a, b = impl.pipe(duplex=True)
    b.close()
    try:
        with pytest.raises(BrokenPipeError):
            a.send_bytes(b"x" * 10)
    finally:
        a.close()


def test_large_write_blocked_when_the_reader_closes_raises_broken_pipe(impl):
    reader, writer = impl.pipe(duplex=False)
    errors = []

    def send() -> None:
        try:
            writer.send_bytes(bytes(16 << 20))  # far over the pipe buffer: it blocks
        except BaseException as exc:  # noqa: BLE001 - handed to the test thread
            errors.append(exc)

    t = threading.Thread(target=send, daemon=True)
    t.start()
    try:
        assert reader.poll(TIMEOUT)  # the write has begun
        reader.close()
        t.join(TIMEOUT)
        assert not t.is_alive()
        assert len(errors) == 1 and isinstance(errors[0], BrokenPipeError), errors
    finally:
        reader.close()
        writer.close()


def test_writing_to_a_child_that_exited_raises_broken_pipe(impl):
    reader, writer = impl.pipe(duplex=False)
    fd = reader.fileno()
    child = script_child(impl, "read-one", fd, pass_fds=[fd], stdout=subprocess.PIPE)
    with reader, writer, child as proc:
        reader.close()  # the child holds the only read end
        writer.send_bytes(b"one message")
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0 and out.split() == [b"11"]
        with pytest.raises(BrokenPipeError):
            writer.send_bytes(b"nobody reads this")


def test_child_writing_to_a_closed_reader_gets_broken_pipe_not_sigpipe(impl):
    reader, writer = impl.pipe(duplex=False)
    fd = writer.fileno()
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE}
    child = script_child(impl, "write-until-broken", fd, pass_fds=[fd], **pipes)
    with reader, writer, child as proc:
        writer.close()
        reader.close()  # no reader is left anywhere
        out, _ = proc.communicate(b"go\n", timeout=TIMEOUT)
        assert proc.returncode == 0, f"child ended with {proc.returncode}: {out!r}"
        assert out.split()[0] == b"BrokenPipeError"
