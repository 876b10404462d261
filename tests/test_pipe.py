"""framepipe's Pipe: the reference ``subprocess_rpc.Pipe`` interface, without its defects."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time

import pytest
from _helpers import TIMEOUT, Background, frame, pipe_works
from _helpers import reuse_fd as _reuse

import framepipe

HERE = os.path.dirname(os.path.abspath(__file__))


def fd_is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.fixture
def pipe(impl):
    p = impl.Pipe(timeout=TIMEOUT)
    yield p
    p.close()


def test_owns_a_new_os_pipe(pipe):
    assert isinstance(pipe.read_fd, int) and isinstance(pipe.write_fd, int)
    assert pipe.read_handle == pipe.read_fd
    assert pipe.write_handle == pipe.write_fd
    os.write(pipe.write_fd, b"raw")
    assert os.read(pipe.read_fd, 3) == b"raw"  # the two ends of one pipe


@pytest.mark.parametrize("n", [0, 1, 100, 65_537, 1 << 20, 5 << 20], ids=lambda n: f"{n}B")
def test_write_then_read_any_size(pipe, n):
    data = os.urandom(n)
    writer = Background(pipe.write, data)
    got = pipe.read()
    writer.join()
    assert type(got) is bytes
    assert got == data


def test_messages_keep_their_order_and_boundaries(pipe):
    msgs = [b"", b"a", os.urandom(70_000), b"bc", os.urandom(300_000), b""]

    def write_all() -> None:
        for m in msgs:
            pipe.write(m)

    writer = Background(write_all)
    got = [pipe.read() for _ in msgs]
    writer.join()
    assert got == msgs


def test_write_accepts_bytes_like(pipe):
    pipe.write(bytearray(b"ba"))
    pipe.write(memoryview(b"mv"))
    assert pipe.read() == b"ba"
    assert pipe.read() == b"mv"


def test_write_produces_the_reference_frame(pipe):
    pipe.write(b"hello")
    assert os.read(pipe.read_fd, 100) == frame(b"hello")


def test_reads_a_reference_frame_written_by_hand(pipe):
    os.write(pipe.write_fd, frame(b"from the reference") + frame(b""))
    assert pipe.read() == b"from the reference"
    assert pipe.read() == b""


# --- timeouts ---------------------------------------------------------------------------------


def test_timeout_attribute_raises_read_timeout_after_the_callback(impl):
    calls = []
    p = impl.Pipe(timeout=0.01, timeout_callback=lambda: calls.append("called"))
    try:
        assert p.timeout == 0.01
        with pytest.raises(framepipe.ReadTimeout) as info:
            p.read()
        assert isinstance(info.value, TimeoutError)
        assert calls == ["called"]
        p.write(b"then")
        assert p.read() == b"then"
        assert calls == ["called"]  # not called on a successful read
    finally:
        p.close()


def test_timeout_attribute_can_be_changed(impl):
    calls = []
    p = impl.Pipe(timeout_callback=lambda: calls.append(1))
    try:
        assert p.timeout is None
        p.timeout = 0.01
        with pytest.raises(framepipe.ReadTimeout):
            p.read()
        assert calls == [1]
    finally:
        p.close()


def test_read_timeout_per_call(impl):
    calls = []
    p = impl.Pipe(timeout_callback=lambda: calls.append(1))  # no default timeout
    try:
        with pytest.raises(framepipe.ReadTimeout):
            p.read(timeout=0.01)
        with pytest.raises(framepipe.ReadTimeout):
            p.read(0)
        assert calls == [1, 1]
        p.write(b"x")
        assert p.read(timeout=TIMEOUT) == b"x"
    finally:
        p.close()


def test_callback_exception_replaces_the_timeout(impl):
    # The reference's callback is typed NoReturn: it may raise its own error.
    class Stop(Exception):
        pass

    def callback() -> None:
        raise Stop

    p = impl.Pipe(timeout=0.01, timeout_callback=callback)
    try:
        with pytest.raises(Stop):
            p.read()
    finally:
        p.close()


def test_timeout_sentinel_runs_the_callback(impl):
    calls = []
    p = impl.Pipe(timeout=TIMEOUT, timeout_callback=lambda: calls.append(1))
    try:
        os.write(p.write_fd, b"\x01\x01" + frame(b"after"))
        with pytest.raises(framepipe.ReadTimeout):
            p.read()
        assert calls == [1]
        assert p.read() == b"after"
    finally:
        p.close()


def test_partial_frame_survives_a_timeout(impl):
    p = impl.Pipe(timeout=0.02)
    try:
        whole = frame(b"0123456789" * 10)
        os.write(p.write_fd, whole[:30])
        with pytest.raises(framepipe.ReadTimeout):
            p.read()
        os.write(p.write_fd, whole[30:])
        assert p.read(timeout=TIMEOUT) == b"0123456789" * 10
    finally:
        p.close()


# --- writer pid -------------------------------------------------------------------------------


@pytest.fixture
def sleeper():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
        proc.stdin.close()


def test_writer_pid(impl, sleeper):
    p = impl.Pipe()
    try:
        with pytest.raises(ValueError):
            p.get_writer_pid()
        p.set_writer_pid(sleeper.pid)
        assert p.get_writer_pid() == sleeper.pid
    finally:
        p.close()
    q = impl.Pipe(writer_pid=sleeper.pid)
    try:
        assert q.get_writer_pid() == sleeper.pid
    finally:
        q.close()


def test_writer_death_ends_a_read_that_would_hang(impl):
    # This process keeps the write end open, so end of file never comes: only the writer pid
    # can end the read.
    p = impl.Pipe(timeout=TIMEOUT)
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from framepipe import _impl;"
        "pipe = _impl.load(sys.argv[2]).Pipe(write_handle=int(sys.argv[3]));"
        "pipe.write(b'one frame'); sys.exit(3)"
    )
    src = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))
    name = impl.ENGINE
    proc = subprocess.Popen(
        [sys.executable, "-c", code, src, name, str(p.write_fd)], pass_fds=[p.write_fd]
    )
    try:
        p.set_writer_pid(proc.pid)
        assert p.read() == b"one frame"
        with pytest.raises(framepipe.WriterDied) as info:
            p.read()
        assert info.value.pid == proc.pid
        assert info.value.exitcode == 3
        assert isinstance(info.value, OSError)  # what the reference raised (IOError)
    finally:
        proc.kill()
        proc.wait(TIMEOUT)
        p.close()


# --- handles and closing ----------------------------------------------------------------------


def test_given_handles_are_used_and_not_closed(impl):
    r, w = os.pipe()
    try:
        p = impl.Pipe(read_handle=r, write_handle=w, timeout=TIMEOUT)
        assert (p.read_fd, p.write_fd) == (r, w)
        assert (p.read_handle, p.write_handle) == (r, w)
        p.write(b"given")
        assert p.read() == b"given"
        p.close()
        p.close()
        del p
        assert fd_is_open(r) and fd_is_open(w)
        pipe_works(r, w)
    finally:
        os.close(r)
        os.close(w)


def test_read_only_and_write_only_pipes(impl):
    r, w = os.pipe()
    try:
        reader = impl.Pipe(read_handle=r, timeout=TIMEOUT)
        writer = impl.Pipe(write_handle=w)
        assert reader.write_fd is None and writer.read_fd is None
        writer.write(b"one way")
        assert reader.read() == b"one way"
        with pytest.raises(OSError):
            reader.write(b"x")
        with pytest.raises(OSError):
            writer.read(timeout=TIMEOUT)
        reader.close()
        writer.close()
        assert fd_is_open(r) and fd_is_open(w)
    finally:
        os.close(r)
        os.close(w)


def test_close_closes_owned_fds_exactly_once(impl, fd_count):
    gc.collect()  # fds of earlier tests' garbage must not close during the count
    before = fd_count()
    p = impl.Pipe()
    assert fd_count() == before + 2
    r, w = p.read_fd, p.write_fd
    p.close()
    assert fd_count() == before
    assert not fd_is_open(r) and not fd_is_open(w)
    # Reuse both numbers, then close the Pipe again (and let it be collected): the new fds
    # must survive.
    r, w1 = _reuse(r, avoid=(w,))
    w, w2 = _reuse(w, avoid=(r, w1))
    try:
        p.close()
        del p
        gc.collect()
        for fd, other in ((r, w1), (w, w2)):
            pipe_works(fd, other)
    finally:
        for fd in (r, w, w1, w2):
            os.close(fd)
    assert fd_count() == before


def test_context_manager(impl, fd_count):
    gc.collect()
    before = fd_count()
    with impl.Pipe(timeout=TIMEOUT) as p:
        assert isinstance(p, impl.Pipe)
        p.write(b"ctx")
        assert p.read() == b"ctx"
    assert fd_count() == before


# --- this process as the writer (the reference accepts it) -------------------------------------


def test_writer_pid_of_this_process_is_accepted_with_timeouts_and_the_callback(impl):
    calls = []
    p = impl.Pipe(writer_pid=os.getpid(), timeout=0.02, timeout_callback=lambda: calls.append(1))
    try:
        assert p.get_writer_pid() == os.getpid()
        with pytest.raises(framepipe.ReadTimeout):
            p.read()
        assert calls == [1]
        p.write(b"mine")
        assert p.read() == b"mine"
        with pytest.raises(framepipe.ReadTimeout):
            p.read(timeout=0.01)
        assert calls == [1, 1]
        p.set_writer_pid(os.getpid())  # again, later: still accepted
        assert p.get_writer_pid() == os.getpid()
    finally:
        p.close()


def test_a_forked_reader_watches_the_pid_recorded_as_this_processes(impl, tmp_path):
    # Process A makes a Pipe with itself as the writer and forks B, which reads; A exits
    # without writing. B holds a write end too, so end of file never comes: only a watch of
    # A, made in B, can end B's read.
    src = os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))
    name = "c" if impl.__name__.endswith("._core") else "python"
    out = tmp_path / "reader.txt"
    code = f"""
import os, sys, time
sys.path.insert(0, {src!r})
from framepipe import _impl, WriterDied
core = _impl.load({name!r})
p = core.Pipe(writer_pid=os.getpid(), timeout=60)
p.write(b"before")
pid = os.fork()
if pid == 0:
    try:
        first = p.read()
        try:
            p.read()
            result = "read returned"
        except WriterDied as exc:
            result = f"WriterDied {{exc.pid}} {{exc.exitcode}}"
        except Exception as exc:
            result = f"{{type(exc).__name__}}: {{exc}}"
        open({str(out)!r}, "w").write(first.decode() + " " + result + " " + str(os.getppid()))
    finally:
        os._exit(0)
time.sleep(1.0)
os._exit(5)
"""
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        assert proc.wait(TIMEOUT) == 5
        deadline = time.monotonic() + TIMEOUT
        while not out.exists() or not out.read_text():
            assert time.monotonic() < deadline, "the forked reader never ended its read"
            time.sleep(0.02)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(TIMEOUT)
    first, kind, pid, code_ = out.read_text().split()[:4]
    assert (first, kind, int(pid)) == ("before", "WriterDied", proc.pid)
    assert code_ in ("5", "None")  # A is not B's child: its status may not be readable
