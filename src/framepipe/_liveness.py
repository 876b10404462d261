"""Process facts: who a watched writer is, whether it has died, and how.

Everything here reads the system and never reaps a process. :class:`Liveness` follows one
writer: on Linux it holds a pidfd, which pins the process's identity (a recycled pid can never
be mistaken for it) and becomes readable the moment the process exits, so a reader can put it in
the same ``poll()`` set as its data fd. The exit status is read with
``waitid(..., WNOWAIT)``, so ``subprocess.Popen.wait()`` and ``multiprocessing.Process.join()``
keep working afterwards. Where pidfds are not available, the process's start time is recorded
when the watch begins and a different start time later means the watched process is gone.

The other facts: the fields of ``/proc/<pid>/stat`` (state, start time, the exit status of a
zombie that is not our child), psutil where procfs is missing, the OOM-kill counter of the
process's memory cgroup (v1 and v2), the decoding of wait statuses, and the 8-byte status word
of a DEAD sentinel. The background thread that acts on deaths is :mod:`framepipe.watch`, one
layer up; the native traceback a guarded process leaves comes from :mod:`framepipe._faults`,
one layer down.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing.process
import os
import select
import signal
import subprocess
import threading
import time
import types
from multiprocessing.connection import wait as _mp_wait
from typing import TYPE_CHECKING, Any

from ._faults import Fault, fault_path, peek_fault, read_path, remove_fault
from .errors import WriterDied

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = [
    "DEAD_STATUS_UNKNOWN",
    "HAVE_PIDFD",
    "WATCHER_THREAD_NAME",
    "Liveness",
    "Owner",
    "Target",
    "dead_status_word",
    "exitcode_from_status_word",
    "resolve_target",
    "start_time",
]

Owner = multiprocessing.process.BaseProcess | subprocess.Popen[Any]
"""What owns a watched pid: a ``multiprocessing.Process`` or a ``subprocess.Popen`` (of any
output type, hence ``Any``)."""

Target = int | Owner
"""What can be watched: a pid, a started ``multiprocessing.Process`` or a ``subprocess.Popen``."""

HAVE_PIDFD: bool = hasattr(os, "pidfd_open") and hasattr(os, "P_PIDFD")
"""Whether this platform's Python has pidfds (Linux 5.3+ with Python 3.9+)."""

DEAD_STATUS_UNKNOWN: int = 0xFFFF_FFFF_FFFF_FFFF
"""The status word of a DEAD sentinel whose writer's exit status could not be read."""

WATCHER_THREAD_NAME = "framepipe-watcher"
"""The name of the watcher thread (:mod:`framepipe.watch`), which must never block here."""

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

_psutil_module: types.ModuleType | None = None
_psutil_tried = False


def _psutil() -> types.ModuleType | None:
    """psutil, imported on first use (only where procfs cannot answer, so ``import framepipe``
    does not pay for it); None when it is not installed."""
    global _psutil_module, _psutil_tried
    if not _psutil_tried:
        try:
            import psutil  # a third-party fallback, imported where it is needed
        except ImportError:  # pragma: no cover - psutil is a dependency; stay usable without it
            psutil = None
        _psutil_module, _psutil_tried = psutil, True
    return _psutil_module


# --------------------------------------------------------------------------------------------
# Targets and status words
# --------------------------------------------------------------------------------------------


def resolve_target(target: Target) -> tuple[int, Owner | None]:
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


def proc_stat(pid: int) -> list[str] | None:
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


def start_time(pid: int) -> float | None:
    """When the process ``pid`` started, in a unit that is stable for its lifetime; None when
    it does not exist or cannot be read. Two processes that shared a pid differ here.

    procfs first (field 22, an exact count of clock ticks since boot), then psutil's
    ``create_time`` (derived from a boot time that can shift slightly between reads on Linux,
    which is why it is not the first choice there).
    """
    fields = proc_stat(pid)
    if fields is not None and len(fields) > 19:
        return float(fields[19])
    ps = _psutil()
    if ps is not None:
        try:
            return float(ps.Process(pid).create_time())
        except ps.Error:  # NoSuchProcess, AccessDenied, ZombieProcess on some platforms
            return None
    return None


def is_zombie(pid: int) -> bool | None:
    """True when ``pid`` is a zombie, False when it runs, None when it does not exist."""
    fields = proc_stat(pid)
    if fields is not None:
        return fields[0] in ("Z", "X")
    ps = _psutil()
    if ps is not None:
        try:
            return bool(ps.Process(pid).status() == ps.STATUS_ZOMBIE)
        except ps.NoSuchProcess:
            return None
        except ps.Error:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except OSError:
        pass
    return False


def zombie_status(pid: int) -> tuple[int, bool] | None:
    """The exit status of a zombie that is not our child, from field 52 of /proc/<pid>/stat
    (Linux 3.5+), as ``(exitcode, core_dumped)``; None when not available."""
    fields = proc_stat(pid)
    if fields is None or len(fields) < 50 or fields[0] not in ("Z", "X"):
        return None
    try:
        word = int(fields[49])
    except ValueError:
        return None
    return decode_wait_status(word)


def decode_wait_status(word: int) -> tuple[int, bool] | None:
    if os.WIFEXITED(word):
        return os.WEXITSTATUS(word), False
    if os.WIFSIGNALED(word):
        return -os.WTERMSIG(word), bool(os.WCOREDUMP(word))
    return None


def status_from_waitid(res: os.waitid_result) -> tuple[int, bool]:
    code = res.si_code
    if code == os.CLD_EXITED:
        return res.si_status, False
    return -res.si_status, code == os.CLD_DUMPED


def owner_known_status(obj: Owner | None) -> int | None:
    """The exit code the owning Popen/Process has already collected, read without any system
    call (so without any chance of reaping)."""
    if isinstance(obj, subprocess.Popen):
        rc = obj.returncode
    elif isinstance(obj, multiprocessing.process.BaseProcess):
        rc = getattr(getattr(obj, "_popen", None), "returncode", None)
    else:
        return None
    return rc if isinstance(rc, int) else None


def owner_status(obj: Owner | None) -> int | None:
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


def cgroup_oom_file(pid: int) -> str | None:
    """The file holding the ``oom_kill`` counter of the memory cgroup of ``pid``.

    cgroup v1: ``memory.oom_control`` of the ``memory`` hierarchy; v2: ``memory.events`` of the
    unified hierarchy. The path comes from /proc/<pid>/cgroup; when the cgroup file system is
    mounted with a different root (a container without a cgroup namespace) the path is tried
    with its leading components removed, down to the mount root.
    """
    try:  # raw reads: a pool looks at each busy worker's every RSS_PERIOD
        data = read_path(f"/proc/{pid}/cgroup")
    except OSError:
        return None
    found = _OOM_FILES.get(data)
    if found is None:
        found = _oom_file_of(data.decode("utf-8", "replace").splitlines())
        if found is not None:  # (not found: looked for again next time)
            if len(_OOM_FILES) >= 256:
                _OOM_FILES.clear()
            _OOM_FILES[data] = found
    return found


# the file found for each content of /proc/<pid>/cgroup seen: where a cgroup's counter lies
# does not change while it exists
_OOM_FILES: dict[bytes, str] = {}


def _oom_file_of(lines: list[str]) -> str | None:
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


def read_oom_kills(file: str | None) -> int | None:
    if file is None:
        return None
    try:  # raw reads: this runs on the way to every WriterDied of a SIGKILLed writer
        for line in read_path(file).split(b"\n"):
            key, _, value = line.partition(b" ")
            if key == b"oom_kill":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def pidfd_readable(fd: int) -> bool:
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
    obj: Owner | None
    fd: int | None
    oom_before: int | None

    def __init__(self, target: Target, *, use_pidfd: bool | None = None) -> None:
        self.pid, self.obj = resolve_target(target)
        self.fd = None
        self._gone = False
        self._dead = False
        self._status: tuple[int, bool] | None = None
        self._fault: Fault | None = None
        self._fault_read = False
        self._fault_lock = threading.Lock()
        self._home = os.getpid()  # the process whose Liveness this is (a fork copies it)
        if use_pidfd is None:
            use_pidfd = HAVE_PIDFD
        if owner_known_status(self.obj) is not None:
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
        self._start = None if self._gone else start_time(self.pid)
        if self._start is None and self.fd is None:
            # Not even procfs/psutil can see it: it no longer exists.
            self._gone = self._gone or is_zombie(self.pid) is None
        self._oom_file = None if self._gone else cgroup_oom_file(self.pid)
        self.oom_before = read_oom_kills(self._oom_file)
        fault_path(self.pid)  # the fault directory is found now, before any death
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
        :class:`Watcher` keeps its own duplicate, so a registered Liveness may be closed. A dead
        writer's guard fault file is read now if nothing read it yet (and removed), and kept
        for a :class:`~framepipe.errors.WriterDied` that is looked at later."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
        if self._dead and os.getpid() == self._home:
            # Kept for a WriterDied not yet looked at; its file removed. Not in a forked
            # child's copy: the fault is its parent's to read, and a parent thread reading it
            # at the fork left the lock held in the child for good.
            self._read_fault()

    # -- death ----------------------------------------------------------------------------------

    def _mark_dead(self) -> None:
        self._dead = True
        if self._status is None:
            rc = owner_known_status(self.obj)
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
        self._status = status_from_waitid(res)
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
        if owner_known_status(self.obj) is not None:
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
            if owner_known_status(self.obj) is not None or pidfd_readable(fd):
                self._grab_zombie_status()  # first: its owner may reap it any moment
                self._mark_dead()
                return True
            return False
        # Portable path: first make sure the pid still names the process we started watching.
        if self._start is not None:
            now = start_time(self.pid)
            if now is not None and now != self._start:
                self._mark_dead()  # the pid was recycled: ours is long gone
                return True
        answered, dead = self._waitid(None)
        if answered:
            if dead:
                self._mark_dead()
            return dead
        if owner_known_status(self.obj) is not None:
            self._mark_dead()
            return True
        zombie = is_zombie(self.pid)
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
        st = zombie_status(self.pid)
        if st is None:
            return
        if self._start is not None and start_time(self.pid) != self._start:
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
        rc = owner_known_status(self.obj)
        if rc is not None or not isinstance(self.obj, multiprocessing.process.BaseProcess):
            return rc if rc is not None else owner_status(self.obj)
        if threading.current_thread().name == WATCHER_THREAD_NAME:
            return None
        try:
            _mp_wait([self.obj.sentinel], _STATUS_GRACE)
        except (OSError, ValueError):
            return None
        end = time.monotonic() + _JOIN_GRACE
        while time.monotonic() < end:
            rc = owner_known_status(self.obj)
            if rc is not None:
                return rc
            time.sleep(0.001)
        return owner_status(self.obj)

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
        now = read_oom_kills(self._oom_file)
        if now is None or self.oom_before is None:
            return None
        return now > self.oom_before

    def _read_fault(self) -> Fault | None:
        """What the dead writer left in its guard's fault file (read once, then kept)."""
        with self._fault_lock:
            if not self._fault_read:
                if not self.poll_dead():
                    return None
                self._fault_read = True
                try:
                    fault = self._take_fault()
                except Exception:  # noqa: BLE001 - a missing dump must never hide the death
                    fault = None
                self._fault = fault
            return self._fault

    def _take_fault(self) -> Fault | None:
        """The fault file at the writer's pid, if it is the writer's (then removed). Read
        maybe long after the death, it may be another process's that had the pid: one started
        earlier (stale: removed), or later, maybe running now (left alone). When a start time
        is unknown, the file counts as the writer's only while no other process holds the pid."""
        fault = peek_fault(self.pid)
        if fault is None:
            return None
        mine, theirs = self._start, fault.start
        if mine is not None and theirs is not None:
            if theirs == mine:
                remove_fault(self.pid)
                return fault
            if theirs < mine:
                remove_fault(self.pid)  # stale: its process ended before ours began
            return None
        if start_time(self.pid) not in (None, mine):
            return None
        remove_fault(self.pid)
        return fault

    def native_traceback(self) -> str | None:
        """The faulthandler dump of a writer that crashed with SIGSEGV, SIGBUS, SIGFPE, SIGABRT
        or SIGILL under :func:`framepipe.guard`, or None. Read once and kept."""
        exitcode, _ = self.status()
        if exitcode is None or -exitcode not in _CRASH_SIGNALS:
            return None
        fault = self._read_fault()
        return fault.traceback if fault is not None else None

    def guard_label(self) -> str | None:
        """The label of the :func:`framepipe.guard` that was open in the writer when it died
        (its crash, a signal or ``os._exit`` inside the guard), or None: no guard was open, or
        the writer still lives."""
        fault = self._read_fault()
        return fault.label if fault is not None else None

    def error(
        self, lost_bytes: int = 0, expected_bytes: int | None = None, label: str | None = None
    ) -> WriterDied:
        """A :class:`~framepipe.errors.WriterDied` describing the writer's death: pid, exit code
        or signal, core dump, the ``lost_bytes`` of a partial frame (of ``expected_bytes``
        when known), whether the OOM killer did it, and the native traceback of a crash.

        The message names the writer by ``label``; when it is None, by the label of the guard
        that was open in the writer as it died (see :meth:`guard_label`), else ``"worker"``.
        Only the exit status is read now: the rest (a file look-up, a cgroup counter) when the
        error is first looked at, so that a reader raises as soon as it knows."""
        exitcode, core_dumped = self.status()
        return WriterDied(
            self.pid,
            exitcode,
            core_dumped=core_dumped,
            lost_bytes=lost_bytes,
            expected_bytes=expected_bytes,
            label=label or "worker",  # what it says if the details cannot be read
            details=functools.partial(self._details, label),
        )

    def _details(self, label: str | None) -> tuple[str, bool | None, str | None]:
        """What a WriterDied reads on first use: its label, OOM kill and native traceback."""
        if label is None:
            label = self.guard_label() or "worker"
        return label, self.oom_killed(), self.native_traceback()
