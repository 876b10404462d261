"""The native crash hand-off between a guarded process and whoever watches it.

While a :func:`framepipe.guard` is open, faulthandler is armed (all threads) to a file named
for the process's pid in a directory only this user can write (:func:`fault_path`). The file
starts with one header line, written when the guard arms it::

    #framepipe {"label": "loader", "start": 123456.0}

naming the outermost guard's label and the process's start time (so a file left by an earlier
process that had the same pid is never taken for this one's). faulthandler appends its dump
below the header when the process dies of SIGSEGV, SIGBUS, SIGFPE, SIGABRT or SIGILL, and the
same dump is copied to the process's own stderr (fd 2), as a plain ``faulthandler.enable()``
would show it, by the small C extension :mod:`framepipe._fault_echo` (see its source,
``csrc/fault_echo/fault_echo.c``). The watcher of the process
(:class:`framepipe.watch.Liveness`) reads the file once the process is dead (:func:`read_fault`)
and removes it; the guard removes it itself when the outermost guard exits and nothing was
dumped.

Why a C helper: faulthandler writes to one descriptor per ``enable()``, and whatever copies
its dump elsewhere runs inside the dying process's signal handler, where no Python code can run
(nor anything that allocates). The helper is a signal handler installed before faulthandler is
enabled, so faulthandler chains to it after dumping: it reads the dump back from the fault file
(``pread``), writes it to fd 2, then gives the signal its earlier action and raises it again, so
the process dies by the same signal as before (exit status and core dump included). It is a
module of its own, not part of the compiled engine, so the guard behaves the same with either
engine. Where it is not built (an install without a C compiler, or built with
``FRAMEPIPE_NO_EXTENSIONS=1``), the dump goes to the fault file only: nothing in pure Python can
write it twice from a signal handler, and the parent's report comes first.

This module sits below both the guard (which arms) and the watch layer (which reads): it
imports nothing from framepipe but that helper.
"""

from __future__ import annotations

import contextlib
import faulthandler
import functools
import json
import math
import os
import stat
import sys
import tempfile
import threading
from typing import IO, NamedTuple

try:
    from . import _fault_echo
except ImportError:  # not built: the dump reaches the fault file only (see above)
    _fault_echo = None  # type: ignore[assignment]

__all__ = [
    "Fault",
    "FaultHandler",
    "fault_path",
    "peek_fault",
    "read_all",
    "read_fault",
    "read_native_traceback",
    "remove_fault",
    "warn",
]

_HEADER = "#framepipe "


class Fault(NamedTuple):
    """What a guarded process left in its fault file."""

    label: str | None
    """The label of the outermost guard that was open (None when the file has no header)."""
    start: float | None
    """The process's start time as :func:`framepipe._liveness.start_time` read it, or None."""
    traceback: str | None
    """faulthandler's dump, or None when the process did not crash in native code."""


def warn(message: str) -> None:
    """Print one line to stderr (or the original stderr); never raises."""
    stream = sys.stderr if sys.stderr is not None else sys.__stderr__
    try:
        if stream is not None:
            print(message, file=stream, flush=True)
    except Exception:  # noqa: BLE001 - a warning must never become the error
        pass


# Where the fault files live: memory (a tmpfs), where there is one, rather than the temp
# directory's disk. Every WriterDied looks for a file there, and a look-up on a disk whose
# cache a busy machine has evicted can take a millisecond; a crash dump never waits on a disk
# either. Every process of this user on this machine agrees on it, whatever its TMPDIR.
_SHM = "/dev/shm"


@functools.cache
def _fault_base() -> str:
    """Looked for once per process."""
    if os.path.isdir(_SHM) and os.access(_SHM, os.W_OK | os.X_OK):
        return _SHM
    return tempfile.gettempdir()


def _fault_dir() -> str:
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return os.path.join(_fault_base(), f"framepipe-faults-{uid}")


def fault_path(pid: int) -> str:
    """The file a guarded process with this pid dumps its native traceback into."""
    return os.path.join(_fault_dir(), f"{int(pid)}.txt")


def _private_dir(create: bool) -> bool:
    """Whether the fault directory exists (created if asked) as a real directory that only
    this user can write: a directory planted by someone else is never trusted."""
    path = _fault_dir()
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except OSError:
            return False
    try:
        st = os.lstat(path)
    except OSError:
        return False
    owner_ok = not hasattr(os, "getuid") or st.st_uid == os.getuid()
    return stat.S_ISDIR(st.st_mode) and owner_ok and not st.st_mode & 0o022


def _header(label: str, start: float | None) -> str:
    return _HEADER + json.dumps({"label": label, "start": start}) + "\n"


def _parse(text: str) -> Fault:
    label: str | None = None
    start: float | None = None
    if text.startswith(_HEADER):
        first, _, text = text.partition("\n")
        try:
            data = json.loads(first[len(_HEADER) :])
        except ValueError:
            data = None
        if isinstance(data, dict):
            if isinstance(data.get("label"), str):
                label = data["label"]
            value = data.get("start")
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                start = float(value) if math.isfinite(value) else None
    return Fault(label, start, text if text.strip() else None)


def peek_fault(pid: int) -> Fault | None:
    """What the guarded process ``pid`` left in its fault file, or None when there is none;
    the file stays (see :func:`remove_fault`)."""
    path = fault_path(pid)
    # Raw reads: this runs on the way to many WriterDied, and most writers left no file (one
    # failed open(2), no io stack). The file's content is used only from a trusted directory.
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return None
    try:
        if not _private_dir(create=False):
            return None
        data = read_all(fd)
    except OSError:
        return None
    finally:
        os.close(fd)
    return _parse(data.decode("utf-8", "replace"))


def read_fault(pid: int) -> Fault | None:
    """What the guarded process ``pid`` left in its fault file, or None when it left none.

    Removes the file: call it once the process is dead (a live one is still writing to it).
    """
    fault = peek_fault(pid)
    if fault is not None:
        remove_fault(pid)
    return fault


def read_path(path: str) -> bytes:
    """Every byte of the file at ``path``, in raw reads (no io stack: for /proc and cgroup
    files read often). Raises OSError."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return read_all(fd)
    finally:
        os.close(fd)


def read_all(fd: int) -> bytes:
    """Every byte from ``fd`` to its end of file."""
    chunks: list[bytes] = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)


def remove_fault(pid: int) -> None:
    """Remove the fault file of ``pid``, if there is one."""
    with contextlib.suppress(OSError):
        os.remove(fault_path(pid))


def read_native_traceback(pid: int) -> str | None:
    """The native traceback a guarded process wrote as it crashed, or None.

    Returns faulthandler's dump when the process's fault file holds one, and removes the file
    either way. Call it for a process that died of a fatal signal.
    """
    fault = read_fault(pid)
    return fault.traceback if fault is not None else None


class FaultHandler:
    """Process-wide: faulthandler armed to this process's fault file while any guard is open.

    :meth:`arm` and :meth:`disarm` nest; the outermost arm writes the header with its label,
    installs the helper that copies the dump to stderr (when it is built) and enables
    faulthandler, the matching disarm disables both (re-enabling faulthandler on stderr when it
    was enabled there before) and removes the file when nothing was dumped into it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._depth = 0
        self._file: IO[str] | None = None
        self._header_size = 0
        self._was_enabled = False
        self._echo = False

    def arm(self, label: str, start: float | None) -> None:
        """Enter one guard labelled ``label`` in a process that started at ``start``."""
        with self._lock:
            pid = os.getpid()
            if self._pid != pid:  # a fresh process, or a fork child: the file is not ours
                self._pid, self._depth, self._file = pid, 0, None
            self._depth += 1
            if self._depth > 1 or not _private_dir(create=True):
                return
            try:
                # Kept open while armed: faulthandler writes to its descriptor at a crash, and
                # the helper reads the dump back from it (hence "w+", readable too).
                self._file = open(fault_path(pid), "w+", encoding="utf-8")  # noqa: SIM115
                header = _header(label, start)
                self._file.write(header)
                self._file.flush()
                self._header_size = len(header.encode("utf-8"))
                self._was_enabled = faulthandler.is_enabled()
                if self._was_enabled:
                    # enable() on an enabled faulthandler only changes its file: disabled
                    # first, it installs its handlers again, over the helper's.
                    faulthandler.disable()
                self._install_echo(self._file.fileno())
                faulthandler.enable(file=self._file, all_threads=True)
            except Exception as err:  # noqa: BLE001 - arming is best effort
                self._uninstall_echo()
                warn(f"framepipe.guard: could not arm faulthandler: {type(err).__name__}: {err}")

    def _install_echo(self, fd: int) -> None:
        """Install the helper that copies the dump to stderr; it must be in place before
        faulthandler is enabled, which then chains to it (see the module docstring)."""
        if _fault_echo is None:
            return
        try:
            _fault_echo.install(fd, self._header_size)
        except OSError as err:  # the dump still reaches the fault file
            warn(
                "framepipe.guard: a native crash's traceback will reach the parent but not this "
                f"process's stderr: could not install the signal handler that copies it ({err})"
            )
            return
        self._echo = True

    def _uninstall_echo(self) -> None:
        if self._echo and _fault_echo is not None:
            self._echo = False
            _fault_echo.uninstall()

    def disarm(self) -> None:
        """Leave one guard."""
        with self._lock:
            if self._pid != os.getpid() or self._depth == 0:
                return
            self._depth -= 1
            if self._depth or self._file is None:
                return
            file, self._file = self._file, None
            try:
                faulthandler.disable()  # gives the signals back to the helper, which
                self._uninstall_echo()  # gives them back their actions from before the guard
                if self._was_enabled and sys.__stderr__ is not None:
                    faulthandler.enable(file=sys.__stderr__, all_threads=True)
            except Exception:  # noqa: BLE001 - disarming is best effort
                pass
            with contextlib.suppress(OSError):
                empty = os.fstat(file.fileno()).st_size <= self._header_size
                file.close()
                if empty:
                    os.remove(fault_path(os.getpid()))
