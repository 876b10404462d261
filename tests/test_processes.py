"""Connections shared with child processes: multiprocessing (fork, spawn, forkserver) and
subprocess with pass_fds; and writes to a pipe whose reader is gone."""

from __future__ import annotations

import multiprocessing
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest
from _helpers import child_env

import framepipe

HERE = os.path.dirname(os.path.abspath(__file__))
# The children import _children by name: pytest's default import mode already puts tests/ on
# sys.path; make sure of it under any mode, since spawned children inherit this sys.path.
if HERE not in [os.path.abspath(p) for p in sys.path]:
    sys.path.insert(0, HERE)

import _children  # noqa: E402 - needs the sys.path entry above
from _children import pattern  # noqa: E402

TIMEOUT = 60.0  # a hang guard only
SRC = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))

METHODS = [
    m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()
]


def stop_process(proc) -> None:
    """Join a multiprocessing child, killing it if it is still there."""
    proc.join(TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join(TIMEOUT)


def stop_popen(proc: subprocess.Popen) -> None:
    try:
        proc.wait(TIMEOUT)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(TIMEOUT)


def test_children_module_is_importable_by_spawned_children():
    # The premise of the spawn and forkserver tests below.
    assert os.path.dirname(os.path.abspath(_children.__file__)) == HERE
    assert HERE in [os.path.abspath(p) for p in sys.path]


@pytest.mark.parametrize("method", METHODS)
def test_connection_passed_to_a_process(impl, method):
    ctx = multiprocessing.get_context(method)
    parent, child = impl.pipe(duplex=True)
    proc = ctx.Process(target=_children.serve, args=(child,))
    try:
        proc.start()
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
        stop_process(proc)
        assert proc.exitcode == 0
    finally:
        child.close()
        parent.close()
        if proc.pid is not None:
            stop_process(proc)


@pytest.mark.parametrize("method", METHODS)
def test_one_way_connection_passed_to_a_process(impl, method):
    ctx = multiprocessing.get_context(method)
    reader, writer = impl.pipe(duplex=False)
    sizes = [5, 0, 65_537, 2 << 20, 1]
    proc = ctx.Process(target=_children.send_frames_and_exit, args=(writer, sizes))
    try:
        proc.start()
        writer.close()
        for n in sizes:
            assert reader.recv_bytes(timeout=TIMEOUT) == pattern(n)
        with pytest.raises(EOFError):
            reader.recv_bytes(timeout=TIMEOUT)
        stop_process(proc)
        assert proc.exitcode == 0
    finally:
        writer.close()
        reader.close()
        if proc.pid is not None:
            stop_process(proc)


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
    argv = [
        sys.executable,
        os.path.join(HERE, "_children.py"),
        impl.ENGINE,
        "serve",
        *map(str, child_fds),
    ]
    proc = subprocess.Popen(argv, pass_fds=child_fds, env=child_env())
    try:
        for fd in child_fds:
            os.close(fd)
        child_fds = []
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
        stop_popen(proc)
        assert proc.returncode == 0
    finally:
        for fd in child_fds:
            os.close(fd)
        parent.close()
        proc.kill()
        stop_popen(proc)


def test_one_way_connection_used_by_a_subprocess_child(impl):
    reader, writer = impl.pipe(duplex=False)
    sizes = [3, 0, 100_000, 4 << 20]
    fd = writer.fileno()
    argv = [
        sys.executable,
        os.path.join(HERE, "_children.py"),
        impl.ENGINE,
        "frames",
        str(fd),
        ",".join(map(str, sizes)),
    ]
    proc = subprocess.Popen(argv, pass_fds=[fd], env=child_env())
    try:
        writer.close()
        for n in sizes:
            assert reader.recv_bytes(timeout=TIMEOUT) == pattern(n)
        with pytest.raises(EOFError):
            reader.recv_bytes(timeout=TIMEOUT)
        stop_popen(proc)
        assert proc.returncode == 0
    finally:
        writer.close()
        reader.close()
        proc.kill()
        stop_popen(proc)


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
    argv = [
        sys.executable,
        os.path.join(HERE, "_children.py"),
        impl.ENGINE,
        "read-one",
        str(fd),
    ]
    proc = subprocess.Popen(argv, pass_fds=[fd], env=child_env(), stdout=subprocess.PIPE)
    try:
        reader.close()  # the child holds the only read end
        writer.send_bytes(b"one message")
        out, _ = proc.communicate(timeout=TIMEOUT)
        assert proc.returncode == 0 and out.split() == [b"11"]
        with pytest.raises(BrokenPipeError):
            writer.send_bytes(b"nobody reads this")
    finally:
        writer.close()
        reader.close()
        proc.kill()
        stop_popen(proc)


def test_child_writing_to_a_closed_reader_gets_broken_pipe_not_sigpipe(impl):
    reader, writer = impl.pipe(duplex=False)
    fd = writer.fileno()
    argv = [
        sys.executable,
        os.path.join(HERE, "_children.py"),
        impl.ENGINE,
        "write-until-broken",
        str(fd),
    ]
    proc = subprocess.Popen(
        argv, pass_fds=[fd], env=child_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        writer.close()
        reader.close()  # no reader is left anywhere
        out, _ = proc.communicate(b"go\n", timeout=TIMEOUT)
        assert proc.returncode == 0, f"child ended with {proc.returncode}: {out!r}"
        assert out.split()[0] == b"BrokenPipeError"
    finally:
        writer.close()
        reader.close()
        proc.kill()
        stop_popen(proc)
