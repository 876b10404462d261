"""The child side every worker process shares: its start-up, whatever it then runs.

A pool's or actor's worker, a loader's worker and a group's function rank all start in
:func:`child_main` with a :class:`Boot` the parent built (pickled for spawn and forkserver).
It makes the process a good citizen before the worker's own body runs:

- its own process group (Ctrl-C at the terminal reaches the parent only, and the parent
  signals the worker and everything it started at once);
- death with its parent: ``PR_SET_PDEATHSIG`` (SIGKILL, or for a group rank a signal whose
  handler takes its whole process group down), and a thread of the worker that watches the
  parent's pidfd (:meth:`Boot.setup`);
- no descriptor of the parent's other workers after a fork (:func:`register_parent_side`), and
  under :func:`new_process`'s fork no inherited pipe or socket but the ones it needs;
- fd-level output: fd 2 (and fd 1 when asked) is the pipe or file the parent gave, so C code's
  writes and a crash dump are captured; ``sys.stdout``/``sys.stderr`` write there too;
- ``env`` set in ``os.environ``, ``cwd``, faulthandler on fd 2 (and on a signal, into the stack
  pipe the parent reads), then the ``initializer``.

Then :meth:`Boot.setup` starts what the kind of worker needs beside its main thread and
:meth:`Boot.run` runs its body (the task loop, the loader loop, the rank's function).
A command rank of a group execs a program instead: it shares the output setup
(:mod:`framepipe.workers._stderr`) and the death with the group (:mod:`framepipe.workers._launch`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing.context as _mp_context
import multiprocessing.popen_fork as _popen_fork
import multiprocessing.util as _mp_util
import os
import signal
import stat
import sys
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from ._launch import arm_parent_death, set_pdeathsig

__all__ = [
    "CANCEL_SIGNAL",
    "STACK_SIGNAL",
    "Boot",
    "FdHandle",
    "child_main",
    "forget_parent_side",
    "main_without_pseudo_file",
    "new_process",
    "rebind_stream",
    "register_parent_side",
]

_RT = getattr(signal, "SIGRTMIN", None)
#: faulthandler dumps every thread's stack to the stack pipe on this signal (queued, so two
#: sent in a row give two dumps: the second one's start marks the end of the first).
STACK_SIGNAL: int = _RT + 6 if _RT is not None else signal.SIGUSR2
#: a task worker's health thread raises WorkerCancelled in its main thread with this signal.
CANCEL_SIGNAL: int = _RT + 7 if _RT is not None else signal.SIGUSR1

# Parent-side objects alive in this process: a forked worker closes them at once, so it never
# holds another worker's channel (which would hide that worker's death from a reader).
_parent_side: weakref.WeakSet[Any] = weakref.WeakSet()


def register_parent_side(obj: Any) -> None:
    """``obj._close_in_child()`` will run in every worker forked from this process."""
    _parent_side.add(obj)


def forget_parent_side(obj: Any) -> None:
    """``obj`` holds no descriptor any more: a worker forked from now on leaves it alone."""
    _parent_side.discard(obj)


def _close_parent_side() -> None:
    for obj in list(_parent_side):
        with contextlib.suppress(Exception):
            obj._close_in_child()
    _parent_side.clear()


class FdHandle:
    """An fd that travels to a multiprocessing child (dup'd for spawn and forkserver)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> Any:
        from multiprocessing import reduction

        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> FdHandle:
    return FdHandle(dup.detach())


@dataclass
class Boot:
    """What a worker process needs to start: built by the parent, pickled for spawn.

    ``stderr`` is the write end of the pipe the parent drains; ``stdout`` a descriptor for fd 1
    (or ``stdout_path``, a file opened for append; neither: fd 1 is left as it is);
    ``stack`` the stack pipe's write end (None: no stack dumps on request). Subclasses add
    what their body needs and say what it is in :meth:`setup`, :meth:`run` and
    :meth:`init_failed`.
    """

    name: str
    parent_pid: int
    stderr: FdHandle
    stdout: FdHandle | None = None
    stdout_path: str | None = None
    stack: FdHandle | None = None
    initializer: Callable[..., Any] | None = None
    initargs: tuple[Any, ...] = ()
    env: dict[str, str] | None = None
    cwd: str | None = None
    line_buffered_stdout: bool = False

    #: the parent's death kills the worker's whole process group from a signal handler
    #: (a group rank), rather than the worker alone by SIGKILL (its watch thread does the rest)
    kill_group_on_parent_death: ClassVar[bool] = False
    #: ``sys.stdout`` is rebound to fd 1 even when fd 1 is not redirected
    rebind_stdout: ClassVar[bool] = False

    def needed_fds(self) -> set[int]:
        """The descriptors a forked worker keeps: stdin, stdout, stderr, its own channels, and
        multiprocessing's resource tracker (which a child that makes a semaphore writes to)."""
        keep = {0, 1, 2}
        for obj in (self.stdout, self.stderr, self.stack, *self.channels()):
            if isinstance(obj, FdHandle):
                keep.add(obj.fd)
            elif hasattr(obj, "_handles"):  # a connection
                keep.update(fd for fd in obj._handles() if fd >= 0)
        from multiprocessing import resource_tracker

        tracker_fd = getattr(resource_tracker._resource_tracker, "_fd", None)
        if isinstance(tracker_fd, int):
            keep.add(tracker_fd)
        return keep

    def channels(self) -> list[Any]:
        """The connections and :class:`FdHandle` s of the body (kept open after a fork)."""
        return []

    def setup(self) -> None:
        """After the common start-up, before the initializer: the body's own threads and
        signal handlers."""

    def init_failed(self, exc: BaseException) -> None:
        """Tell the parent that the initializer raised ``exc`` (the process then exits 1)."""

    def run(self) -> None:
        """The worker's body."""
        raise NotImplementedError


def child_main(boot: Boot) -> None:
    """Every worker process's body: hygiene, redirects, the body's setup, the initializer,
    then the body (see the module docstring)."""
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)
    if boot.kill_group_on_parent_death:
        arm_parent_death()
    else:
        set_pdeathsig()
    _close_parent_side()
    _redirect(boot)
    if boot.env:
        os.environ.update(boot.env)
    if boot.cwd:
        os.chdir(boot.cwd)
    faulthandler.enable(file=2, all_threads=True)
    if boot.stack is not None:
        faulthandler.register(STACK_SIGNAL, file=boot.stack.fd, all_threads=True, chain=False)
    boot.setup()
    if boot.initializer is not None:
        try:
            boot.initializer(*boot.initargs)
        except BaseException as exc:  # noqa: BLE001 - reported to the parent, then we exit
            boot.init_failed(exc)
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os._exit(1)
    boot.run()


def _redirect(boot: Boot) -> None:
    """fd 2 (and fd 1) to what the parent gave, and the ``sys`` streams with them."""
    os.dup2(boot.stderr.fd, 2)
    os.close(boot.stderr.fd)
    stdout = boot.stdout.fd if boot.stdout is not None else None
    if stdout is None and boot.stdout_path:
        stdout = os.open(boot.stdout_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    if stdout is not None:
        os.dup2(stdout, 1)
        os.close(stdout)
    if stdout is not None or boot.rebind_stdout:
        rebind_stream("stdout", 1)  # a forked child's sys.stdout may write elsewhere
    rebind_stream("stderr", 2)
    if boot.line_buffered_stdout:
        with contextlib.suppress(AttributeError, ValueError):
            sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]


def rebind_stream(name: str, fd: int) -> None:
    """Make ``sys.<name>`` write to ``fd`` (a forked child may have inherited a stream on
    another descriptor, e.g. a test runner's capture file), so its output is captured too."""
    stream = getattr(sys, name, None)
    try:
        if stream is not None and stream.fileno() == fd:
            return
    except (AttributeError, OSError, ValueError):
        pass
    with contextlib.suppress(OSError, ValueError):
        if stream is not None:
            stream.flush()
    setattr(
        sys,
        name,
        open(
            fd,
            "w",
            buffering=1,
            errors="backslashreplace",  # noqa: SIM115
            closefd=False,
        ),
    )


def _close_inherited(keep: set[int]) -> None:
    """Release the pipes and sockets a freshly forked worker inherited, but those in ``keep``,
    whichever thread of the parent opened them. Held here, another thread's
    ``subprocess.Popen`` exec-error pipe would make that Popen wait for this worker to end; a
    pipe or socket the program closes would not reach end of file, nor a listening port be
    freed, while a worker lives. Each is replaced by /dev/null rather than closed, so that a
    Python object the worker inherited never writes into a descriptor the worker opens later
    with the same number. Regular files, directories and devices stay open (holding them
    changes nothing another process sees), as a task may read a file the program opened."""
    try:
        fds = [int(name) for name in os.listdir("/proc/self/fd")]
    except OSError:  # no /proc
        fds = list(range(3, min(os.sysconf("SC_OPEN_MAX"), 65536)))
    null = -1
    try:
        for fd in fds:
            if fd in keep:
                continue
            try:
                mode = os.fstat(fd).st_mode  # (the listing's own descriptor is closed by now)
            except OSError:
                continue
            if not (stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)):
                continue
            if null < 0:
                null = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
            os.dup2(null, fd, inheritable=False)
    finally:
        if null >= 0:
            os.close(null)


def _forget_unfinished_imports() -> None:
    """In a freshly forked worker: drop the modules another thread of the parent was still
    importing when it forked (half run, their import locks held by a thread that does not
    exist here: the worker's own import of one would wait forever), so that the worker
    imports them afresh."""
    import importlib._bootstrap as bootstrap

    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if spec is not None and getattr(spec, "_initializing", False):
            del sys.modules[name]
    bootstrap._module_locks.clear()  # type: ignore[attr-defined]
    bootstrap._blocking_on.clear()  # type: ignore[attr-defined]


class _ForkPopen(_popen_fork.Popen):
    """multiprocessing's fork start, the child releasing the descriptors it does not need
    (see :func:`_close_inherited`) before anything else runs in it."""

    def _launch(self, process_obj: Any) -> None:
        code = 1
        parent_r, child_w = os.pipe()
        child_r, parent_w = os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            try:
                os.close(parent_r)
                os.close(parent_w)
                _forget_unfinished_imports()
                _close_inherited(process_obj._args[0].needed_fds() | {child_r, child_w})
                code = process_obj._bootstrap(parent_sentinel=child_r)
            finally:
                os._exit(code)
        else:
            os.close(child_w)
            os.close(child_r)
            close = _mp_util.close_fds  # type: ignore[attr-defined]
            self.finalizer = _mp_util.Finalize(self, close, (parent_r, parent_w))
            self.sentinel = parent_r


class _ForkProcess(_mp_context.ForkProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> Any:
        return _ForkPopen(process_obj)


def new_process(ctx: Any, boot: Boot, name: str, *, close_inherited: bool = True) -> Any:
    """A ``multiprocessing`` process of context ``ctx`` that runs :func:`child_main`
    with ``boot`` (not started: start it under :func:`main_without_pseudo_file`). Under fork
    with ``close_inherited`` the child first releases the pipes and sockets it inherited but
    the ones it needs (see :func:`_close_inherited`)."""
    fork = close_inherited and ctx.get_start_method() == "fork"
    return (_ForkProcess if fork else ctx.Process)(
        target=child_main, args=(boot,), name=name, daemon=False
    )


_main_file_lock = threading.Lock()


@contextlib.contextmanager
def main_without_pseudo_file() -> Any:
    """While a worker starts, hide a main module ``__file__`` that names no file (``<stdin>``
    in a program piped to ``python -``): spawn would re-run it by that path in the worker and
    fail; without it the worker does not re-import the main module, as under ``python -c``."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if (
        main is None
        or not isinstance(path, str)
        or getattr(main, "__spec__", None) is not None
        or not (path.startswith("<") and path.endswith(">"))
    ):
        yield
        return
    with _main_file_lock:
        try:
            del main.__file__
        except AttributeError:
            yield
            return
        try:
            yield
        finally:
            main.__file__ = path
