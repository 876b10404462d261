"""Writer liveness: who writes to a connection, and how its death is seen.

A :class:`Liveness` follows one writer process. On Linux it holds a pidfd, which pins the
process's identity (a recycled pid can never be mistaken for it) and becomes readable the moment
the process exits, so a reader can put it in the same ``poll()`` set as its data fd. The exit
status is read with ``waitid(..., WNOWAIT)``: the process is never reaped here, so
``subprocess.Popen.wait()`` and ``multiprocessing.Process.join()`` keep working afterwards.

Where pidfds are not available, the process's start time is recorded when the watch begins and
a different start time later means the watched process is gone.

The :class:`Watcher` is one background thread per process that calls a function when a watched
writer has died. On Linux it sleeps in ``epoll`` on the pidfds and wakes on the event; elsewhere
it polls every few milliseconds. It is created lazily by :func:`watcher`, stopped at interpreter
exit, and a forked child gets a fresh one of its own.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.process
import os
import select
import selectors
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Union

from .errors import WriterDied

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "DEAD_STATUS_UNKNOWN",
    "HAVE_PIDFD",
    "Liveness",
    "Target",
    "Watcher",
    "dead_status_word",
    "exitcode_from_status_word",
    "resolve_target",
    "watcher",
]

Target = Union[int, multiprocessing.process.BaseProcess, "subprocess.Popen[Any]"]
"""What can be watched: a pid, a started ``multiprocessing.Process`` or a ``subprocess.Popen``."""

HAVE_PIDFD: bool = hasattr(os, "pidfd_open") and hasattr(os, "P_PIDFD")
"""Whether this platform's Python has pidfds (Linux 5.3+ with Python 3.9+)."""

DEAD_STATUS_UNKNOWN: int = 0xFFFF_FFFF_FFFF_FFFF
"""The status word of a DEAD sentinel whose writer's exit status could not be read."""

_CRASH_SIGNALS = frozenset(
    int(getattr(signal, name))
    for name in ("SIGSEGV", "SIGBUS", "SIGFPE", "SIGABRT", "SIGILL")
    if hasattr(signal, name)
)
_SIGKILL: int | None = getattr(signal, "SIGKILL", None)
_WAIT_FLAGS = getattr(os, "WEXITED", 0) | getattr(os, "WNOHANG", 0) | getattr(os, "WNOWAIT", 0)
# How long status() waits for a multiprocessing parent-of-record (the forkserver) to report the
# exit status of a process that is known to be dead but is not our child.
_STATUS_GRACE = 2.0
# After the forkserver's report arrives, how long a concurrent join() may take to collect it.
_JOIN_GRACE = 0.05
_THREAD_NAME = "framepipe-watcher"
# Polling period of the watcher for writers it cannot wait on through a pidfd.
_POLL_INTERVAL = 0.005

try:
    import psutil as _psutil
except ImportError:  # pragma: no cover - psutil is a dependency; stay usable without it
    _psutil = None


# --------------------------------------------------------------------------------------------
# Targets and status words
# --------------------------------------------------------------------------------------------


def resolve_target(target: Target) -> tuple[int, Any]:
    """The pid of ``target`` and the object that owns it.

    ``target`` is a pid (``int``), a started ``multiprocessing.Process`` (any start method) or a
    ``subprocess.Popen``. Returns ``(pid, obj)`` where ``obj`` is the Process or Popen, or
    ``None`` for a bare pid.

    Raises ``ValueError`` for a Process that has not been started (it has no pid yet) or a pid
    that is not positive, and ``TypeError`` for anything else.
    """
    if isinstance(target, bool):
        raise TypeError(
            "cannot watch a bool; pass a pid (int), a multiprocessing.Process or a subprocess.Popen"
        )
    if isinstance(target, int):
        if target <= 0:
            raise ValueError(f"cannot watch pid {target}: a process id is a positive integer")
        return target, None
    if isinstance(target, multiprocessing.process.BaseProcess):
        pid = target.pid
        if pid is None:
            raise ValueError(
                f"cannot watch {target!r}: it has not been started, so it has no pid yet; "
                "call .start() first"
            )
        return pid, target
    if isinstance(target, subprocess.Popen):
        return target.pid, target
    raise TypeError(
        "cannot watch an object of type "
        f"{type(target).__module__}.{type(target).__qualname__}; pass a pid (int), a "
        "multiprocessing.Process or a subprocess.Popen"
    )


_SIGNAL_BASE = 256  # DEAD status words above this are 256 + signal number

def dead_status_word(exitcode: int | None) -> int:
    """The 8-byte status carried by a DEAD sentinel for a writer that ended with ``exitcode``.

    The exit code itself when the writer exited (``exitcode >= 0``, at most 255),
    ``256 + signum`` when it was killed by a signal (``exitcode == -signum``, as
    ``subprocess.Popen`` reports it), so the two never collide, and
    :data:`DEAD_STATUS_UNKNOWN` when the exit status could not be read (``None``).
    """
    if exitcode is None:
        return DEAD_STATUS_UNKNOWN
    if exitcode >= 0:
        return exitcode
    return _SIGNAL_BASE - exitcode


def exitcode_from_status_word(word: int) -> int | None:
    """Invert :func:`dead_status_word`: ``None`` for :data:`DEAD_STATUS_UNKNOWN`, ``-signum``
    for ``256 + signum``, otherwise the exit code. A reference writer's sentinel carries the
    exit code's absolute value, which reads back as that code."""
    if word == DEAD_STATUS_UNKNOWN:
        return None
    if _SIGNAL_BASE < word < _SIGNAL_BASE + 128:
        return _SIGNAL_BASE - word
    return word


# --------------------------------------------------------------------------------------------
# Process facts read from the system
# --------------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (index 0 is field 3, the state),
    or None where procfs does not have it."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces and parentheses.
    end = raw.rfind(")")
    if end < 0:
        return None
    return raw[end + 2 :].split()


def _start_time(pid: int) -> float | None:
    """When the process ``pid`` started, in a unit that is stable for its lifetime; None when
    it does not exist or cannot be read. Two processes that shared a pid differ here.

    procfs first (field 22, an exact count of clock ticks since boot), then psutil's
    ``create_time`` (derived from a boot time that can shift slightly between reads on Linux,
    which is why it is not the first choice there).
    """
    fields = _proc_stat(pid)
    if fields is not None and len(fields) > 19:
        return float(fields[19])
    if _psutil is not None:
        try:
            return float(_psutil.Process(pid).create_time())
        except _psutil.Error:  # NoSuchProcess, AccessDenied, ZombieProcess on some platforms
            return None
    return None


def _is_zombie(pid: int) -> bool | None:
    """True when ``pid`` is a zombie, False when it runs, None when it does not exist."""
    fields = _proc_stat(pid)
    if fields is not None:
        return fields[0] in ("Z", "X")
    if _psutil is not None:
        try:
            return bool(_psutil.Process(pid).status() == _psutil.STATUS_ZOMBIE)
        except _psutil.NoSuchProcess:
            return None
        except _psutil.Error:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass
    return False


def _zombie_status(pid: int) -> tuple[int, bool] | None:
    """The exit status of a zombie that is not our child, from field 52 of /proc/<pid>/stat
    (Linux 3.5+), as ``(exitcode, core_dumped)``; None when not available."""
    fields = _proc_stat(pid)
    if fields is None or len(fields) < 50 or fields[0] not in ("Z", "X"):
        return None
    try:
        word = int(fields[49])
    except ValueError:
        return None
    return _decode_wait_status(word)


def _decode_wait_status(word: int) -> tuple[int, bool] | None:
    if os.WIFEXITED(word):
        return os.WEXITSTATUS(word), False
    if os.WIFSIGNALED(word):
        return -os.WTERMSIG(word), bool(os.WCOREDUMP(word))
    return None


def _status_from_waitid(res: Any) -> tuple[int, bool]:
    code = res.si_code
    if code == getattr(os, "CLD_EXITED", 1):
        return res.si_status, False
    return -res.si_status, code == getattr(os, "CLD_DUMPED", 3)


def _owner_known_status(obj: Any) -> int | None:
    """The exit code the owning Popen/Process has already collected, read without any system
    call (so without any chance of reaping)."""
    if isinstance(obj, subprocess.Popen):
        rc = obj.returncode
    elif isinstance(obj, multiprocessing.process.BaseProcess):
        rc = getattr(getattr(obj, "_popen", None), "returncode", None)
    else:
        return None
    return rc if isinstance(rc, int) else None


def _owner_status(obj: Any) -> int | None:
    """The exit code the owning Popen/Process already knows, without reaping anything.

    Only called once ``waitid`` said the pid is not a waitable child of ours (reaped already, or
    the child of a forkserver), so the Process's own ``poll()`` cannot reap either.
    """
    if obj is None:
        return None
    if isinstance(obj, subprocess.Popen):
        # Not poll(): on ECHILD it invents a return code of 0.
        rc = obj.returncode
        return rc if isinstance(rc, int) else None
    if isinstance(obj, multiprocessing.process.BaseProcess):
        try:
            rc = obj.exitcode
        except (OSError, ValueError):
            return None
        return rc if isinstance(rc, int) else None
    return None


def _cgroup_oom_file(pid: int) -> str | None:
    """The file holding the ``oom_kill`` counter of the memory cgroup of ``pid``.

    cgroup v1: ``memory.oom_control`` of the ``memory`` hierarchy; v2: ``memory.events`` of the
    unified hierarchy. The path comes from /proc/<pid>/cgroup; when the cgroup file system is
    mounted with a different root (a container without a cgroup namespace) the path is tried
    with its leading components removed, down to the mount root.
    """
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    v1_path = v2_path = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hier, controllers, path = parts
        if "memory" in controllers.split(","):
            v1_path = path
        elif hier == "0" and controllers == "":
            v2_path = path
    candidates: list[tuple[str, str, str]] = []
    if v1_path is not None:
        candidates.append(("/sys/fs/cgroup/memory", v1_path, "memory.oom_control"))
    if v2_path is not None:
        candidates.append(("/sys/fs/cgroup", v2_path, "memory.events"))
        candidates.append(("/sys/fs/cgroup/unified", v2_path, "memory.events"))
    for root, path, name in candidates:
        parts = [p for p in path.split("/") if p]
        for skip in range(len(parts) + 1):
            file = os.path.join(root, *parts[skip:], name)
            if os.path.isfile(file):
                return file
    return None


def _read_oom_kills(file: str | None) -> int | None:
    if file is None:
        return None
    try:
        with open(file, encoding="ascii", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
    except (OSError, ValueError):
        return None
    return None


def _pidfd_readable(fd: int) -> bool:
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(0))


# --------------------------------------------------------------------------------------------
# Liveness
# --------------------------------------------------------------------------------------------


class Liveness:
    """The liveness of one writer process.

    ``Liveness(target)`` starts watching ``target`` (see :func:`resolve_target`). Attributes:

    ``pid``
        The writer's pid.
    ``obj``
        The ``multiprocessing.Process`` or ``subprocess.Popen`` given, or None for a bare pid.
    ``fd``
        A pidfd for the writer (readable once it has exited, usable in ``poll()``/``select()``),
        or None where pidfds are unavailable, the process was already gone, or after
        :meth:`close`.
    ``oom_before``
        The OOM-kill counter of the writer's memory cgroup when the watch began, or None when it
        cannot be read.

    ``use_pidfd=False`` selects the portable path (start-time identity, ``waitid`` by pid,
    psutil) even where pidfds exist.

    Nothing here reaps the process. A Liveness holds a file descriptor: :meth:`close` it (or
    use it as a context manager) when done.
    """

    pid: int
    obj: Any
    fd: int | None
    oom_before: int | None

    def __init__(self, target: Target, *, use_pidfd: bool | None = None) -> None:
        self.pid, self.obj = resolve_target(target)
        self.fd = None
        self._gone = False
        self._dead = False
        self._status: tuple[int, bool] | None = None
        self._native_tb: str | None = None
        self._native_tb_read = False
        if use_pidfd is None:
            use_pidfd = HAVE_PIDFD
        if _owner_known_status(self.obj) is not None:
            # Its owner reaped it already; the pid may name another process by now.
            self._gone = True
        elif use_pidfd and HAVE_PIDFD:
            try:
                self.fd = os.pidfd_open(self.pid)
            except ProcessLookupError:
                # Gone and reaped before we looked: dead, and any process that now holds the
                # pid is not the one we were given.
                self._gone = True
            except OSError:
                pass  # ENOSYS (old kernel), EMFILE...: the portable path below still works
        self._start = None if self._gone else _start_time(self.pid)
        if self._start is None and self.fd is None:
            # Not even procfs/psutil can see it: it no longer exists.
            self._gone = self._gone or _is_zombie(self.pid) is None
        self._oom_file = None if self._gone else _cgroup_oom_file(self.pid)
        self.oom_before = _read_oom_kills(self._oom_file)
        if self._gone:
            self._mark_dead()

    def __repr__(self) -> str:
        state = "dead" if self._dead else "watching"
        return f"<{type(self).__name__} pid={self.pid} fd={self.fd} {state}>"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.close()

    def close(self) -> None:
        """Close the pidfd (once; later calls do nothing). The exit status already read stays
        available through :meth:`status`. Close only once nothing polls ``fd`` any more; the
        :class:`Watcher` keeps its own duplicate, so a registered Liveness may be closed."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)

    # -- death ----------------------------------------------------------------------------------

    def _mark_dead(self) -> None:
        self._dead = True
        if self._status is None:
            rc = _owner_known_status(self.obj)
            if rc is not None:
                self._status = (rc, False)

    def _waitid(self, fd: int | None) -> tuple[bool, bool]:
        """(answered, dead) from waitid on our child; answered=False when waitid cannot tell
        (not our child, reaped already, or waitid unavailable)."""
        if not hasattr(os, "waitid"):
            return False, False
        try:
            if fd is not None:
                res = os.waitid(os.P_PIDFD, fd, _WAIT_FLAGS)
            else:
                res = os.waitid(os.P_PID, self.pid, _WAIT_FLAGS)
        except ChildProcessError:
            return False, False
        except OSError:
            return False, False
        if res is None:
            return True, False
        # WNOWAIT left the zombie in place; keep its status in case its owner reaps it next.
        self._status = _status_from_waitid(res)
        return True, True

    def poll_dead(self) -> bool:
        """Whether the writer has died, without blocking and without reaping it.

        Our own child is asked with ``waitid(WEXITED | WNOHANG | WNOWAIT)``. A child already
        reaped by its owner is dead (its Popen/Process knows the code). A process that is not
        our child (a forkserver's child, any pid) is dead once its pidfd is readable, or, without
        a pidfd, once it is a zombie, gone, or its pid belongs to a process started at another
        time.
        """
        if self._dead:
            return True
        if _owner_known_status(self.obj) is not None:
            # Reaped by its owner: never ask the kernel about a pid that may be recycled.
            self._mark_dead()
            return True
        fd = self.fd  # one read: close() may run in another thread
        if fd is not None:
            answered, dead = self._waitid(fd)
            if answered:
                if dead:
                    self._mark_dead()
                return dead
            if _owner_known_status(self.obj) is not None or _pidfd_readable(fd):
                self._grab_zombie_status()  # first: its owner may reap it any moment
                self._mark_dead()
                return True
            return False
        # Portable path: first make sure the pid still names the process we started watching.
        if self._start is not None:
            now = _start_time(self.pid)
            if now is not None and now != self._start:
                self._mark_dead()  # the pid was recycled: ours is long gone
                return True
        answered, dead = self._waitid(None)
        if answered:
            if dead:
                self._mark_dead()
            return dead
        if _owner_known_status(self.obj) is not None:
            self._mark_dead()
            return True
        zombie = _is_zombie(self.pid)
        if zombie is None or zombie:
            self._mark_dead()
            if zombie:
                self._grab_zombie_status()
            return True
        return False

    def _grab_zombie_status(self) -> None:
        """For a dead process that is not our child: read its status while it is a zombie,
        checking that the pid still names it."""
        if self._status is not None or self._gone:
            return
        st = _zombie_status(self.pid)
        if st is None:
            return
        if self._start is not None and _start_time(self.pid) != self._start:
            return
        self._status = st

    def status(self) -> tuple[int | None, bool]:
        """``(exitcode, core_dumped)`` of the dead writer.

        ``exitcode`` is the exit code, or ``-signum`` when a signal killed it (as
        ``subprocess.Popen`` reports it), or None while it lives or when the status cannot be
        read (a process that is neither our child nor a zombie). ``core_dumped`` is what the
        kernel reported (False when unknown). The process is never reaped.
        """
        if not self.poll_dead():
            return None, False
        if self._status is None:
            self._grab_zombie_status()
        if self._status is None:
            rc = self._owner_status_when_reaped()
            if rc is not None:
                self._status = (rc, False)
        if self._status is None:
            return None, False
        return self._status

    def _owner_status_when_reaped(self) -> int | None:
        """The exit code of a dead writer that its owner (a forkserver) reaped before we saw
        the zombie: the server reports it once, through the Process's sentinel pipe.

        Reading that pipe consumes the report, and two readers racing for it leave the loser
        (and the Process) with a made-up code of 255. So the watcher thread never reads it; a
        reading thread first waits for the report to arrive and lets a concurrent
        ``join()`` collect it, and reads it itself only if nobody does.
        """
        rc = _owner_known_status(self.obj)
        if rc is not None or not isinstance(self.obj, multiprocessing.process.BaseProcess):
            return rc if rc is not None else _owner_status(self.obj)
        if threading.current_thread().name == _THREAD_NAME:
            return None
        from multiprocessing.connection import wait

        try:
            wait([self.obj.sentinel], _STATUS_GRACE)
        except (OSError, ValueError):
            return None
        end = time.monotonic() + _JOIN_GRACE
        while time.monotonic() < end:
            rc = _owner_known_status(self.obj)
            if rc is not None:
                return rc
            time.sleep(0.001)
        return _owner_status(self.obj)

    def oom_killed(self) -> bool | None:
        """Whether the out-of-memory killer killed the writer.

        For a writer killed by SIGKILL: True when the OOM-kill counter of its memory cgroup rose
        since this Liveness was created, False when it did not, None when the counter cannot be
        read. False for a writer that died otherwise; None while it lives or its status is
        unknown. (The counter is per cgroup: another process of the same cgroup killed by the
        OOM killer in the meantime also raises it.)
        """
        exitcode, _ = self.status()
        if exitcode is None:
            return None
        if _SIGKILL is None or exitcode != -_SIGKILL:
            return False
        now = _read_oom_kills(self._oom_file)
        if now is None or self.oom_before is None:
            return None
        return now > self.oom_before

    def native_traceback(self) -> str | None:
        """The faulthandler dump of a writer that crashed with SIGSEGV, SIGBUS, SIGFPE, SIGABRT
        or SIGILL under :mod:`framepipe.guard`, or None. Read once and kept."""
        if self._native_tb_read:
            return self._native_tb
        exitcode, _ = self.status()
        if exitcode is None or -exitcode not in _CRASH_SIGNALS:
            return None
        self._native_tb_read = True
        try:
            from .guard import read_native_traceback
        except ImportError:
            return None
        try:
            self._native_tb = read_native_traceback(self.pid)
        except Exception:  # noqa: BLE001 - a missing dump must never hide the death itself
            self._native_tb = None
        return self._native_tb

    def error(
        self, lost_bytes: int = 0, expected_bytes: int | None = None, label: str = "worker"
    ) -> WriterDied:
        """A :class:`~framepipe.errors.WriterDied` describing the writer's death: pid, exit code
        or signal, core dump, the ``lost_bytes`` of a partial frame (of ``expected_bytes``
        when known), whether the OOM killer did it, and the native traceback of a crash."""
        exitcode, core_dumped = self.status()
        return WriterDied(
            self.pid,
            exitcode,
            core_dumped=core_dumped,
            lost_bytes=lost_bytes,
            expected_bytes=expected_bytes,
            oom_killed=self.oom_killed(),
            native_traceback=self.native_traceback(),
            label=label,
        )


# --------------------------------------------------------------------------------------------
# Watcher
# --------------------------------------------------------------------------------------------

OnDeath = Callable[[Liveness], object]


class _Registration:
    __slots__ = ("fd", "liveness", "on_death")

    def __init__(self, liveness: Liveness, on_death: OnDeath, fd: int | None) -> None:
        self.liveness = liveness
        self.on_death = on_death
        self.fd = fd  # the watcher's own duplicate of the pidfd, or None: polled


class Watcher:
    """A background thread that calls ``on_death(liveness)`` once a watched writer has died.

    Use the per-process instance from :func:`watcher`. The thread (a daemon named
    ``framepipe-watcher``) waits in ``epoll``/``poll`` on the registered pidfds and a wake-up
    pipe, so a death is seen when it happens, with no periodic wake-ups; writers without a pidfd
    are polled every 5 ms. A callback runs on the watcher thread only after
    :meth:`Liveness.poll_dead` has confirmed the death, and runs once. Callbacks should be
    short; an exception in one is printed to stderr and does not stop the watcher.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regs: dict[int, _Registration] = {}
        self._next_handle = 1
        self._polled: set[int] = set()  # handles without a selector entry
        self._to_add: list[int] = []
        self._to_close: list[int] = []  # duplicate pidfds to drop from the selector and close
        self._stopping = False
        self._closed = False
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._pid = os.getpid()
        self._thread = threading.Thread(target=self._run, name=_THREAD_NAME, daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"<{type(self).__name__} pid={self._pid} watching={len(self._regs)}>"

    @property
    def running(self) -> bool:
        """Whether the watcher thread is alive."""
        return self._thread.is_alive()

    def register(self, liveness: Liveness, on_death: OnDeath) -> int:
        """Call ``on_death(liveness)`` from the watcher thread once the writer is dead (at once
        if it already is). Returns a handle for :meth:`unregister`. The Liveness must stay open
        while registered only for the portable path; the watcher keeps its own copy of the
        pidfd."""
        fd = None
        if liveness.fd is not None:
            fd = os.dup(liveness.fd)
        with self._lock:
            if self._stopping:
                if fd is not None:
                    os.close(fd)
                raise RuntimeError("the framepipe watcher has been stopped")
            handle = self._next_handle
            self._next_handle += 1
            self._regs[handle] = _Registration(liveness, on_death, fd)
            if fd is None:
                self._polled.add(handle)
            else:
                self._to_add.append(handle)
            self._wake_locked()
        return handle

    def unregister(self, handle: int) -> bool:
        """Stop watching. True when the callback had not been called and now never will be;
        False when it has already been called (or is being called) or the handle is unknown."""
        with self._lock:
            reg = self._regs.pop(handle, None)
            if reg is None:
                return False
            self._polled.discard(handle)
            if reg.fd is not None:
                self._to_close.append(reg.fd)
                reg.fd = None
            self._wake_locked()
        return True

    def stop(self, timeout: float | None = 5.0) -> None:
        """Stop the thread and release its file descriptors; pending callbacks are dropped.
        Called at interpreter exit for the per-process watcher."""
        with self._lock:
            if not self._stopping:
                self._stopping = True
                self._wake_locked()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    # -- thread ---------------------------------------------------------------------------------

    def _wake_locked(self) -> None:
        # Under the lock, so the thread cannot close the pipe between the check and the write.
        if self._closed:
            return
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is already pending

    def _sync_locked(self) -> None:
        """Apply registrations made by other threads to the selector (watcher thread only)."""
        for fd in self._to_close:
            try:
                self._selector.unregister(fd)
            except (KeyError, ValueError, OSError):
                pass
            os.close(fd)
        self._to_close.clear()
        for handle in self._to_add:
            reg = self._regs.get(handle)
            if reg is None or reg.fd is None:
                continue
            try:
                self._selector.register(reg.fd, selectors.EVENT_READ, handle)
            except (KeyError, ValueError, OSError):
                self._polled.add(handle)
        self._to_add.clear()

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    if self._stopping:
                        break
                    self._sync_locked()
                    polling = list(self._polled)
                events = self._selector.select(_POLL_INTERVAL if polling else None)
                ready: list[int] = []
                for key, _ in events:
                    if key.fd == self._wake_r:
                        try:
                            while os.read(self._wake_r, 4096):
                                pass
                        except BlockingIOError:
                            pass
                    else:
                        ready.append(key.data)
                for handle in ready:
                    self._check(handle, from_event=True)
                for handle in polling:
                    self._check(handle, from_event=False)
        finally:
            with self._lock:
                self._stopping = True
                self._close_fds()

    def _check(self, handle: int, *, from_event: bool) -> None:
        with self._lock:
            reg = self._regs.get(handle)
        if reg is None:
            return
        try:
            dead = reg.liveness.poll_dead()
        except Exception:  # noqa: BLE001 - the watcher thread must outlive any one writer
            _report("checking a watched writer", reg)
            dead = False
        with self._lock:
            if self._regs.get(handle) is not reg:
                return  # unregistered meanwhile
            if not dead:
                if from_event and reg.fd is not None:
                    # Readable but not confirmed dead: poll it instead of spinning on epoll.
                    self._to_close.append(reg.fd)
                    reg.fd = None
                    self._polled.add(handle)
                return
            del self._regs[handle]
            self._polled.discard(handle)
            if reg.fd is not None:
                self._to_close.append(reg.fd)
                reg.fd = None
        try:
            reg.on_death(reg.liveness)
        except Exception:  # noqa: BLE001 - a failing callback must not stop the others
            _report("in a framepipe watcher callback", reg)

    def _close_fds(self) -> None:
        """Release everything (the thread's exit path, or a forked child's copies)."""
        self._closed = True
        fds = list(self._to_close) + [r.fd for r in self._regs.values() if r.fd is not None]
        self._to_close = []
        self._regs = {}
        self._polled = set()
        self._to_add = []
        with contextlib.suppress(OSError):
            self._selector.close()
        for fd in fds + [self._wake_r, self._wake_w]:
            try:
                os.close(fd)
            except OSError:
                pass

    def _abandon_after_fork(self) -> None:
        # In a forked child: the thread does not exist here and the lock may have been held by
        # another thread of the parent at fork time. Only drop the inherited descriptors.
        self._stopping = True
        self._close_fds()


def _report(what: str, reg: _Registration) -> None:
    try:
        print(
            f"Exception {what} (pid {reg.liveness.pid}, callback {reg.on_death!r}):",
            file=sys.stderr,
        )
        traceback.print_exc()
    except (OSError, ValueError):
        pass  # stderr closed or gone: nothing left to tell


_watcher: Watcher | None = None
_watcher_lock = threading.Lock()


def watcher() -> Watcher:
    """The watcher of this process, started on first use."""
    global _watcher
    w = _watcher
    if w is not None:
        return w
    with _watcher_lock:
        if _watcher is None:
            _watcher = Watcher()
        return _watcher


def _stop_at_exit() -> None:
    w = _watcher
    if w is not None and w._pid == os.getpid():
        w.stop(timeout=1.0)


def _after_fork_in_child() -> None:
    global _watcher, _watcher_lock
    _watcher_lock = threading.Lock()
    w, _watcher = _watcher, None
    if w is not None:
        w._abandon_after_fork()


atexit.register(_stop_at_exit)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
