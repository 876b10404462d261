"""Code that runs in the child processes of the fault, signal and asyncio tests.

The functions are module level so a ``spawn`` or ``forkserver`` child can import them: pytest
puts the tests directory on ``sys.path`` (the tests are not a package) and multiprocessing
hands the parent's ``sys.path`` to its children. Every blocking call in a child is bounded, so
a broken parent can never leave one behind.
"""

from __future__ import annotations

import hashlib
import os
import signal
import struct
import time

from _helpers import header, payload, wait_until, write_all

WAIT = 60.0  # upper bound on any wait in a child; a healthy run never comes close
MIB = 1 << 20


def die(how: tuple[str, int]) -> None:
    """``("exit", code)``: exit with ``code`` at once; ``("signal", signum)``: be killed by it."""
    kind, value = how
    if kind == "exit":
        os._exit(value)
    os.kill(os.getpid(), value)
    time.sleep(WAIT)
    os._exit(99)


def send_then_die(conn, sizes, how) -> None:
    """Send ``payload(n)`` for each n in ``sizes``, then die as ``how`` says."""
    for n in sizes:
        conn.send_bytes(payload(n))
    die(how)


def do_nothing(conn) -> None:
    """Hold the connection and return: the process exits with code 0 without writing."""


def small_then_big(conn, small: int, big: int) -> None:
    """Send ``small`` small frames, then one frame of ``big`` bytes, which blocks in the pipe
    (the parent does not drain it) until the parent kills this process."""
    for i in range(small):
        conn.send_bytes(payload(10 + i, i))
    conn.send_bytes(payload(big))
    time.sleep(WAIT)  # the parent was supposed to kill us before this


def stop_mid_frame(conn, n: int) -> None:
    """Write a frame's header and half its payload by hand, stop ourselves with SIGSTOP, and
    after SIGCONT write the rest; then wait for the parent to close its end."""
    data = payload(n)
    fd = conn.fileno()
    os.write(fd, header(n) + data[: n // 2])
    os.kill(os.getpid(), signal.SIGSTOP)
    view = memoryview(data)[n // 2 :]
    while view:
        view = view[os.write(fd, view) :]


def echo(conn) -> None:
    """Send back every message received (bytes), until end of file or ``b"bye"``."""
    while True:
        try:
            data = conn.recv_bytes(timeout=WAIT)
        except EOFError:
            return
        if data == b"bye":
            return
        conn.send_bytes(data)


def block_until_killed(conn) -> None:
    """Hold the connection and sleep until killed."""
    time.sleep(WAIT)


def flood(conn, total: int, sizes, interval: float) -> None:
    """Send ``total`` bytes in frames cycling through ``sizes`` while a timer interrupts this
    process every ``interval`` seconds, then send ``(sha256 hex, frame count, handler calls)``
    of what was sent (each frame hashed as its length then its bytes)."""
    calls = [0]

    def on_alarm(signum, frame):
        calls[0] += 1

    signal.signal(signal.SIGALRM, on_alarm)
    base = os.urandom(8 * MIB)
    digest = hashlib.sha256()
    sent = frames = 0
    signal.setitimer(signal.ITIMER_REAL, interval, interval)
    try:
        while sent < total:
            n = min(sizes[frames % len(sizes)], total - sent)
            start = (frames * 7919) % (len(base) - n + 1)
            chunk = memoryview(base)[start : start + n]
            digest.update(struct.pack("Q", n))
            digest.update(chunk)
            if frames % 3 == 2:
                conn.send(bytes(chunk))  # an object frame (out of band when large)
            else:
                conn.send_bytes(chunk)
            sent += n
            frames += 1
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0, 0)
    conn.send(("done", digest.hexdigest(), frames, calls[0]))


# -- helpers for the parent side (they run in the test process) --------------------------------


def proc_stat(pid: int, field: int) -> str | None:
    """Field ``field`` of /proc/<pid>/stat counted from 3 (the state), None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    return raw[raw.rfind(")") + 2 :].split()[field - 3]


def proc_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, T, Z...), None when it is gone."""
    return proc_stat(pid, 3)


def kill_and_wait_dead(pid: int, signum: int = signal.SIGKILL) -> None:
    """Send ``signum`` to ``pid`` and wait until it is dead (a zombie, or gone), without
    reaping it.

    A writer blocked on a full pipe or socket handles even SIGKILL only when its write has to
    wait again: if the reader drains the buffer first, the kernel goes on copying the rest of
    the write and the frame arrives whole. A test that needs a frame cut short by the death
    must therefore not read before the writer is dead.
    """
    os.kill(pid, signum)
    wait_until(lambda: proc_state(pid) in ("Z", None), f"the death of process {pid}")


def unread(fd: int) -> int:
    """Bytes sitting in the pipe of ``fd`` (either end), not yet read by anyone."""
    import array
    import fcntl
    import termios

    buf = array.array("i", [0])
    fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    return buf[0]


def write_in_thread(fd: int, data: bytes):
    """Start a thread writing ``data`` to ``fd``; returns it (join it)."""
    import threading

    thread = threading.Thread(target=write_all, args=(fd, data), daemon=True)
    thread.start()
    return thread


def wire(core, obj=None, *, data=None) -> bytes:
    """The exact bytes a writer of ``core`` puts on the wire for ``send(obj)`` (or for
    ``send_bytes(data)``), captured through a real pipe."""
    import threading

    r, w = os.pipe()
    chunks: list[bytes] = []

    def drain() -> None:
        while True:
            chunk = os.read(r, 1 << 16)
            if not chunk:
                return
            chunks.append(chunk)

    thread = threading.Thread(target=drain, daemon=True)
    thread.start()
    conn = core.Connection(w, readable=False)
    try:
        if data is not None:
            conn.send_bytes(data)
        else:
            conn.send(obj)
    finally:
        conn.close()
        thread.join(WAIT)
        os.close(r)
    return b"".join(chunks)


class LineReader:
    """Lines from a child's stdout (a binary pipe), each read with a deadline."""

    def __init__(self, stream) -> None:
        self.fd = stream.fileno()
        self.buf = b""

    def readline(self, timeout: float = WAIT) -> str:
        import select

        end = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = end - time.monotonic()
            if left <= 0 or not select.select([self.fd], [], [], left)[0]:
                raise AssertionError(f"no line from the child within {timeout} s: {self.buf!r}")
            chunk = os.read(self.fd, 4096)
            if not chunk:
                raise AssertionError(f"the child closed stdout; got {self.buf!r}")
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return line.decode()


def guarded_crash(conn) -> None:
    """Under framepipe.guard: send one frame, then die of SIGSEGV in C code."""
    import framepipe

    with framepipe.guard(conn, label="crasher"):
        conn.send_bytes(b"before the crash")
        crash_in_c_code()


def crash_in_c_code(how: str = "segv") -> None:
    """A frame with a recognisable name on the crashing thread's Python stack; dies of SIGSEGV
    in C code (``how="segv"``), of SIGABRT from ``abort()`` (``"abort"``), or of SIGBUS,
    SIGFPE or SIGILL raised (``"bus"``, ``"fpe"``, ``"ill"``)."""
    import ctypes

    if how == "abort":
        os.abort()
    raised = {"bus": signal.SIGBUS, "fpe": signal.SIGFPE, "ill": signal.SIGILL}
    if how in raised:
        signal.raise_signal(raised[how])
    ctypes.string_at(0)


def guarded_raise(conn) -> None:
    """Under framepipe.guard: raise an exception whose constructor takes two arguments."""
    import framepipe

    with framepipe.guard(conn, label="raiser"):
        raise TwoArgError("bad batch", 7)


class TwoArgError(Exception):
    """An exception with two required constructor arguments."""

    def __init__(self, what: str, index: int) -> None:
        super().__init__(what, index)
        self.what = what
        self.index = index


def crash_writer(fd: int, how: str, before: str = "none", core: bool = False) -> None:
    """Run by ``python -c`` (see tests/test_native_crash.py): send the engine's name through a
    framepipe connection on ``fd``, then die under framepipe.guard as ``crash_in_c_code(how)``
    says. ``before="faulthandler"`` enables faulthandler on stderr before the guard, as a
    worker process does; ``before="guard exited"`` opens and closes a guard first and dies
    outside it (faulthandler on stderr again); ``before="unguarded"`` dies with faulthandler on
    stderr and no guard at all. Core files are off unless ``core`` (then as the hard limit
    allows)."""
    import faulthandler
    import resource

    import framepipe

    hard = resource.getrlimit(resource.RLIMIT_CORE)[1]
    resource.setrlimit(resource.RLIMIT_CORE, (hard if core else 0, hard))
    conn = framepipe.Connection(fd, readable=False)
    if before in ("faulthandler", "guard exited", "unguarded"):
        faulthandler.enable(all_threads=True)
    conn.send_bytes(f"engine {framepipe.implementation}".encode())
    if before == "guard exited":
        with framepipe.guard(conn, label="crasher"):
            pass
    if before in ("guard exited", "unguarded"):
        crash_in_c_code(how)
    with framepipe.guard(conn, label="crasher"):
        crash_in_c_code(how)
