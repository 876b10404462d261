"""Dying with the parent, for group workers; and the launcher of a command worker.

Standard library only: the same file is imported by a function worker and run by path as the
launcher of a command (``python -I -S _launch.py PARENT_PID REPORT_FD -- ARGV...``), which
needs nothing importable but the standard library.

A command cannot watch its parent itself, so the launcher stays between the group and the
command. It is the leader of the worker's process group (the group signals that), sets
``PR_SET_PDEATHSIG`` on itself and on the command, watches the group's process through a
pidfd and, when it is gone, SIGKILLs the whole process group (its own parent-death signal is
caught for the same purpose: a plain SIGKILL would leave the command's children behind). It
ignores the death signals a group sends (the command receives its own copy through the
process group), reports the command's pid (or why it could not start) on ``REPORT_FD``, and
exits the way the command did: the same exit code, or killed by the same signal.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import sys
import threading
from typing import NoReturn

__all__ = [
    "arm_parent_death",
    "set_pdeathsig",
    "die_with_group",
    "parent_gone",
    "watch_parent",
    "start_parent_watch",
]

_PR_SET_PDEATHSIG = 1
_RT = getattr(signal, "SIGRTMIN", None)
#: the signal the kernel sends a group worker when its parent dies (PR_SET_PDEATHSIG): caught,
#: so that the worker takes its whole process group down with it, not only itself
PARENT_DEATH_SIGNAL: int = _RT + 4 if _RT is not None else signal.SIGKILL
#: the signals a group sends (or forwards) to a worker's process group
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT)
_POLL_SECONDS = 0.5  # only where pidfds do not exist


_prctl = None


def set_pdeathsig(signum: int = signal.SIGKILL) -> None:
    """Ask the kernel to send ``signum`` to this process when the thread that started it
    ends (Linux only)."""
    global _prctl
    if not sys.platform.startswith("linux"):
        return
    try:
        if _prctl is None:
            import ctypes

            _prctl = ctypes.CDLL(None, use_errno=True).prctl
        _prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)
    except (OSError, AttributeError):
        pass


def arm_parent_death() -> None:
    """When the parent dies, SIGKILL this process's whole group (its own children too):
    PR_SET_PDEATHSIG with a signal whose handler does it. Call it from the main thread."""
    if PARENT_DEATH_SIGNAL != signal.SIGKILL:
        signal.signal(PARENT_DEATH_SIGNAL, lambda signum, frame: die_with_group())
    set_pdeathsig(PARENT_DEATH_SIGNAL)


def die_with_group() -> NoReturn:
    """SIGKILL this process's whole process group (this process included)."""
    with contextlib.suppress(OSError):
        os.killpg(os.getpgrp(), signal.SIGKILL)
    os._exit(128 + signal.SIGKILL)


def parent_gone(pid: int) -> bool:
    """Whether process ``pid``, which started this one, is gone: it no longer exists, or this
    process was handed over to init (so the pid may name another process by now)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return os.getppid() == 1 and pid != 1


def _open_pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (OSError, AttributeError):
        return None


def watch_parent(parent_pid: int, pidfd: int | None = None) -> None:
    """Block until process ``parent_pid`` is gone, then take this process group down.

    Event-driven on its pidfd; where pidfds do not exist, a check every half second."""
    fd = pidfd if pidfd is not None else _open_pidfd(parent_pid)
    if fd is None:
        while not parent_gone(parent_pid):
            threading.Event().wait(_POLL_SECONDS)
        die_with_group()
    if parent_gone(parent_pid):
        die_with_group()
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while not poller.poll():
        pass
    die_with_group()


def start_parent_watch(parent_pid: int) -> None:
    """Run :func:`watch_parent` in a daemon thread of this process."""
    threading.Thread(
        target=watch_parent, args=(parent_pid,), name="framepipe-parent-watch", daemon=True
    ).start()


def _ignore(signum: int, frame: object) -> None:
    """A handler that does nothing: unlike SIG_IGN it is not inherited across exec."""


def _mirror(returncode: int) -> NoReturn:
    """Exit as the command did: its exit code, or death by its signal (without a core file)."""
    if returncode >= 0:
        os._exit(returncode)
    signum = -returncode
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    except (ImportError, OSError, ValueError):
        pass
    with contextlib.suppress(OSError, ValueError):  # SIGKILL and SIGSTOP refuse this
        signal.signal(signum, signal.SIG_DFL)
    with contextlib.suppress(OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signum])
    with contextlib.suppress(OSError):
        os.kill(os.getpid(), signum)
    os._exit(128 + signum)


def _report(fd: int, text: str) -> None:
    data = text.encode("utf-8", "replace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(fd, data) :]


def launch(parent_pid: int, report_fd: int, argv: list[str]) -> NoReturn:
    """The launcher's body (see the module docstring); never returns."""
    arm_parent_death()
    parent_fd = _open_pidfd(parent_pid)
    if os.getppid() != parent_pid or parent_gone(parent_pid):
        die_with_group()  # the group died before PR_SET_PDEATHSIG was in place
    for signum in STOP_SIGNALS:
        signal.signal(signum, _ignore)
    os.set_inheritable(report_fd, False)
    import subprocess

    me = os.getpid()

    def before_exec() -> None:  # in the command's process, between fork and exec
        set_pdeathsig()
        if os.getppid() != me:
            os._exit(128 + signal.SIGKILL)

    try:
        child = subprocess.Popen(argv, preexec_fn=before_exec)
    except OSError as exc:
        _report(report_fd, f"!{exc.errno or 0} {exc.strerror or exc}\n")
        os._exit(127)
    _report(report_fd, f"{child.pid}\n")
    # report_fd stays open until this process exits: its end of file tells the group so
    # where pidfds do not exist.
    child_fd = _open_pidfd(child.pid)
    if parent_fd is None or child_fd is None:
        threading.Thread(target=watch_parent, args=(parent_pid,), daemon=True).start()
        _mirror(child.wait())
    poller = select.poll()
    poller.register(parent_fd, select.POLLIN)
    poller.register(child_fd, select.POLLIN)
    while True:
        for fd, _ in poller.poll():
            if fd == child_fd:
                _mirror(child.wait())
            if fd == parent_fd:
                die_with_group()


if __name__ == "__main__":
    if len(sys.argv) < 5 or sys.argv[3] != "--":
        sys.exit("usage: _launch.py PARENT_PID REPORT_FD -- ARGV...")
    launch(int(sys.argv[1]), int(sys.argv[2]), sys.argv[4:])
