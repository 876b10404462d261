"""Small helpers shared by the test modules (tests are not a package: pytest puts this
directory on sys.path)."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import multiprocessing
import os
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback

import psutil

TIMEOUT = 30.0  # a hang guard only: a correct core never waits this long
TESTS = os.path.dirname(os.path.abspath(__file__))  # this directory: the test modules
# the start methods this platform has, in multiprocessing's order of preference on Linux
START_METHODS = [
    m for m in ("fork", "spawn", "forkserver") if m in multiprocessing.get_all_start_methods()
]
LEN = struct.Struct("Q")  # a frame's length field: native u64
CHECK = b"\x00\x00"  # a data frame's check bytes

# fcntl's command to resize a pipe. Python has named it since 3.10 on Linux; the fallback is
# Linux's own number (F_LINUX_SPECIFIC_BASE + 7, from <linux/fcntl.h>), for a build of Python
# whose fcntl module lacks the name. The tests that resize pipes run on Linux only.
F_SETPIPE_SZ: int = getattr(fcntl, "F_SETPIPE_SZ", 1031)


def header(length: int, check: bytes = CHECK, second: bytes | None = None) -> bytes:
    """A data frame's header, written by hand: check bytes, native u64 length, check bytes
    (``second`` when given, to write a header whose two checks differ)."""
    return check + LEN.pack(length) + (check if second is None else second)


def frame(data: bytes, check: bytes = CHECK) -> bytes:
    """A whole data frame, written by hand: its header, then ``data``."""
    return header(len(data), check) + data


def payload(n: int, seed: int = 0) -> bytes:
    """``n`` reproducible bytes, different for different ``n`` and ``seed``, cheap to make."""
    block = hashlib.sha256(f"{n}:{seed}".encode()).digest()
    return (block * (n // len(block) + 1))[:n]


def read_exactly(fd: int, n: int, timeout: float = TIMEOUT) -> bytes:
    """Read exactly ``n`` bytes from ``fd``; fail if ``timeout`` seconds pass with nothing to
    read or the end of the file comes first."""
    out = bytearray()
    while len(out) < n:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"only {len(out)} of {n} bytes arrived"
        chunk = os.read(fd, min(n - len(out), 1 << 20))
        assert chunk, f"end of file after {len(out)} of {n} bytes"
        out += chunk
    return bytes(out)


def nothing_left(fd: int) -> bool:
    """Whether ``fd`` has nothing to read right now."""
    ready, _, _ = select.select([fd], [], [], 0)
    return not ready


def frame_names(exc: BaseException) -> list[str]:
    """The function names of ``exc``'s traceback, outermost first."""
    return [f.name for f in traceback.extract_tb(exc.__traceback__)]


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process: neither gone nor a zombie."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def fork(child) -> int:
    """Fork; return the child's pid. The child runs ``child()`` and never returns into the
    test: it ends with ``os._exit`` of what ``child()`` returned (0 for None), or of 70 when
    it raised (its traceback printed to stderr)."""
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = child() or 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    return pid


def exit_code(pid: int, timeout: float = TIMEOUT) -> int:
    """Reap the child ``pid`` and return its exit code (negative: the signal that killed it);
    if it has not ended within ``timeout`` seconds, kill it, reap it and fail the test."""
    end = time.monotonic() + timeout
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > end:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"child {pid} was still running after {timeout:g} s")
        time.sleep(0.01)
    return os.waitstatus_to_exitcode(done[1])


@contextlib.contextmanager
def started(proc):
    """Start the process object ``proc`` (multiprocessing's or framepipe's); on the way out,
    failures included, kill it if it is still running (SIGKILL also ends a stopped process)
    and join it."""
    proc.start()
    with reaped(proc):
        yield proc


@contextlib.contextmanager
def reaped(proc):
    """On the way out, failures included, kill the started process object ``proc`` if it is
    still running and join it."""
    try:
        yield proc
    finally:
        if proc.exitcode is None:
            try:
                proc.kill()
            except (OSError, ValueError):
                pass
        proc.join(60.0)


LAST_PID = "/proc/sys/kernel/ns_last_pid"


def at_pid(pid: int, start):
    """Call ``start()``, which starts one process, with the pid counter wound back so that the
    process gets ``pid`` if it is free (through ns_last_pid), and then put the counter back:
    the tests running beside this one go on getting fresh pids, not the pids of processes that
    just died (a test that checks that a replacement worker's pid is not its dead
    predecessor's would see the same). ``(True, start())``; ``(False, None)``, ``start`` not
    called, where the counter cannot be set. Whether the process got ``pid`` is the caller's
    to check: another process may start in between."""
    try:
        with open(LAST_PID, encoding="ascii") as file:
            last = int(file.read())
        with open(LAST_PID, "w", encoding="ascii") as file:
            file.write(str(pid - 1))
    except (OSError, ValueError):
        return False, None
    try:
        return True, start()
    finally:
        with contextlib.suppress(OSError, ValueError):
            with open(LAST_PID, encoding="ascii") as file:
                now = int(file.read())
            if now < last:  # (unless other processes went past it meanwhile)
                with open(LAST_PID, "w", encoding="ascii") as file:
                    file.write(str(last))


def running(method: str, target, *args):
    """Context manager: ``target(*args)`` in a started daemon ``multiprocessing`` process of
    start method ``method``, killed if still running and joined on the way out."""
    return started(
        multiprocessing.get_context(method).Process(target=target, args=args, daemon=True)
    )


def run_guarded(method: str, target, *args) -> tuple[bytes, object, object, int]:
    """Run ``target(writer, metrics, stop, *args)`` in a ``method`` child (a worker under a
    guard that fails): ``writer`` is the end of a one-way pipe, ``metrics`` a queue and
    ``stop`` an event, all of that start method's context. Once the child has exited with
    code 1 (it re-raised), return (the first message on the pipe, as bytes, ``metrics``,
    ``stop``, the child's pid)."""
    ctx = multiprocessing.get_context(method)
    reader, writer = ctx.Pipe(duplex=False)
    metrics, stop = ctx.Queue(), ctx.Event()
    with reader, started(ctx.Process(target=target, args=(writer, metrics, stop, *args))) as proc:
        writer.close()
        assert reader.poll(120), "the child sent nothing"
        message = reader.recv_bytes()
        proc.join(120)
        assert proc.exitcode == 1  # the exception was re-raised
    return message, metrics, stop, proc.pid


def wait_dead(pids, within: float = 5.0) -> list[int]:
    """Wait up to ``within`` seconds for every process of ``pids`` (None entries skipped) to
    end (to be gone or a zombie); return those still running, empty as soon as none is."""
    end = time.monotonic() + within
    while True:
        left = [p for p in pids if p is not None and alive(p)]
        if not left or time.monotonic() > end:
            return left
        time.sleep(0.02)


def gone(pid: int, within: float = 5.0) -> bool:
    """Whether process ``pid`` ends (is gone or a zombie) within ``within`` seconds."""
    return not wait_dead([pid], within)


def eventually(predicate, timeout: float = 10.0) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` seconds have passed; its last value."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return bool(predicate())


def wait_until(predicate, what: str, timeout: float = 60.0) -> None:
    """Poll ``predicate`` until it is true; fail the test after ``timeout`` seconds."""
    if not eventually(predicate, timeout):
        raise AssertionError(f"gave up after {timeout} s waiting for {what}")


def pipe_works(r: int, w: int) -> None:
    """Check that bytes written to fd ``w`` come out of fd ``r``: the pair is open and is the
    same pipe (a test's own, not closed or taken by someone else)."""
    os.write(w, b"still a pipe")
    assert os.read(r, 100) == b"still a pipe"


def child_env(**extra: str) -> dict[str, str]:
    """The environment of a ``python`` subprocess that imports what this process imports: the
    framepipe this process runs and the test modules come first on its PYTHONPATH. ``extra``
    variables are added."""
    path = os.pathsep.join(filter(None, [src_dir(), TESTS, os.environ.get("PYTHONPATH")]))
    return dict(os.environ, PYTHONPATH=path, **extra)


def src_dir() -> str:
    """The directory that holds the framepipe under test (installed, or src/ in a checkout)."""
    import framepipe

    return os.path.dirname(os.path.dirname(os.path.abspath(framepipe.__file__)))


def run_python(
    *args: str, env: dict[str, str] | None = None, timeout: float = 120.0, **run_kwargs
) -> subprocess.CompletedProcess[str]:
    """``python ARGS...`` with this interpreter, its output captured as text, its exit code not
    checked; in the environment ``env`` (by default ``child_env()``). ``run_kwargs`` go to
    subprocess.run (``cwd``, ``input``)."""
    return subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=child_env() if env is None else env,
        check=False,
        **run_kwargs,
    )


def write_all(fd: int, data: bytes) -> None:
    """Write every byte of ``data`` to ``fd`` with plain os.write calls."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


class Background:
    """Run ``fn(*args)`` in a daemon thread; ``join()`` returns its result or re-raises what
    it raised, and fails if the thread is still blocked after TIMEOUT seconds."""

    def __init__(self, fn, *args) -> None:
        self.error: BaseException | None = None
        self.result = None

        def run() -> None:
            try:
                self.result = fn(*args)
            except BaseException as exc:  # handed to the test thread
                self.error = exc

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def join(self):
        self.thread.join(TIMEOUT)
        assert not self.thread.is_alive(), "background thread still blocked"
        if self.error is not None:
            raise self.error
        return self.result


def _is_open(fd: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_GETFD)
    except OSError:
        return False
    return True


def reuse_fd(fd: int, avoid: tuple[int, ...] = (), wait: float = 30.0) -> tuple[int, int]:
    """Put the read end of a new pipe at number ``fd``: (fd, the new write end). The write
    end is placed above ``fd`` and every number in ``avoid``. Tests use it to check that a
    closed Connection never closes an fd number that has been reused.

    A program can only be given a number that is free, so this first waits (up to ``wait``
    seconds) until ``fd`` is: a Connection closed while another thread is inside a call keeps
    its fds until that call has left, and taking the number before then (dup2 over an open
    fd) would race with that thread's own close of it."""
    end = time.monotonic() + wait
    while _is_open(fd):
        if time.monotonic() > end:
            raise AssertionError(f"fd {fd} was still open {wait:g} s after its close")
        time.sleep(0.001)
    nr, nw = os.pipe()
    floor = max((fd, *avoid)) + 1
    high_r = fcntl.fcntl(nr, fcntl.F_DUPFD_CLOEXEC, floor)
    high_w = fcntl.fcntl(nw, fcntl.F_DUPFD_CLOEXEC, floor)
    os.close(nr)
    os.close(nw)
    os.dup2(high_r, fd, inheritable=False)
    os.close(high_r)
    return fd, high_w
