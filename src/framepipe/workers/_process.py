"""One worker process and its channels: the layer every worker class stands on.

Parent side, :class:`WorkerProcess` starts a ``multiprocessing`` process (fork, spawn or
forkserver) with four private channels:

- data: a duplex framepipe connection (read-ahead on both ends), watched for the worker's
  death, which a reader sees as :class:`framepipe.WriterDied` after every frame written before
  it;
- health: a second duplex connection served by its own thread in the worker (ping, stats,
  cancel, stream credit), so a long call never starves it;
- stderr: the worker's fd 2 is a pipe the parent drains (C-level writes and crash dumps
  included) into a tail kept for crash reports, a log file and/or the console
  (:mod:`framepipe.workers._stderr`);
- stack: faulthandler in the worker is registered on a real-time signal and writes every
  thread's stack into a pipe the parent reads, even while the worker is stuck in C code.

Child side, the process starts in :func:`~framepipe.workers._child.child_main` (the start-up
every worker shares: its own process group, death with its parent, no descriptor inherited
from the parent after a fork but the ones it needs); :class:`WorkerBoot` then starts the
health thread (which also takes the whole worker down the moment the parent is gone) and runs
the loop it was given with a :class:`ChildContext`.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .. import connection as _connection
from .._faults import read_path
from .._liveness import cgroup_oom_file as _cgroup_oom_file
from .._liveness import read_oom_kills as _read_oom_kills
from .._spin import allow_spin
from ..errors import WriterDied
from ..remote import dumps_exception
from ._child import (
    CANCEL_SIGNAL,
    STACK_SIGNAL,
    Boot,
    FdHandle,
    child_main,
    forget_parent_side,
    main_without_pseudo_file,
    new_process,
    register_parent_side,
)
from ._launch import die_with_group as _die_with_group
from ._launch import parent_gone
from ._options import ProcessOptions
from ._stderr import STDERR_DRAIN, TAIL_BYTES, TAIL_LINES, OutputPipe, open_output, read_available
from .errors import WorkerCancelled, WorkerCrashed

__all__ = [
    "CANCEL_SIGNAL",
    "STACK_SIGNAL",
    "TAIL_BYTES",
    "TAIL_LINES",
    "ChildContext",
    "WorkerBoot",
    "WorkerProcess",
    "child_main",
    "current_rss",
    "peak_rss",
    "register_parent_side",
    "stack_text",
]


@dataclass
class WorkerBoot(Boot):
    """A task worker's :class:`~framepipe.workers._child.Boot`: its data and health channels,
    the loop it runs and the loop's own ``options``."""

    conn: Any = None
    health: Any = None
    loop: Callable[[ChildContext], None] | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def channels(self) -> list[Any]:
        return [self.conn, self.health, *self.options.values()]

    def setup(self) -> None:
        if self.options.get("spin") is False:
            allow_spin(False)
        ctx = self.ctx = ChildContext(self)

        def on_cancel(signum: int, frame: Any) -> None:
            tid = ctx.cancel_due()
            if tid is not None:
                ctx.interrupted = tid  # once: see NOTE [ A cancel signal sent again ]
                raise WorkerCancelled(f"task {tid} was cancelled")

        signal.signal(CANCEL_SIGNAL, on_cancel)
        threading.Thread(
            target=_serve_health, args=(ctx, self.parent_pid), name="framepipe-health", daemon=True
        ).start()

    def init_failed(self, exc: BaseException) -> None:
        self.conn.send(("init-failed", os.getpid(), dumps_exception(exc)))

    def run(self) -> None:
        try:
            self.conn.send(("ready", os.getpid()))
        except OSError:
            return  # the parent let go of this worker before it was ready: nothing to do
        assert self.loop is not None
        self.loop(self.ctx)


class ChildContext:
    """The worker side of the channels, handed to the worker's loop.

    ``conn`` is the data connection; ``name``; ``options`` (the loop's own settings);
    ``namespace`` (a dict kept for the worker's lifetime). The loop sets ``current`` to the
    task it runs, so that a cancel request interrupts that task only; stream producers wait
    for credit with :meth:`wait_credit`.
    """

    def __init__(self, boot: WorkerBoot) -> None:
        self.name = boot.name
        self.conn = boot.conn
        self.health = boot.health
        self.options = boot.options
        self.namespace: dict[str, Any] = {"__name__": "__worker__"}
        self.current: int | None = None
        self.cancelled: set[int] = set()
        self.interrupted: int | None = None  # the cancelled task WorkerCancelled was raised in
        self.again_at: float | None = None  # when to signal the main thread again, if so
        self._again_every = CANCEL_AGAIN
        # Tasks are numbered in the order they were sent (0, 1, ...): ``started`` of them were
        # taken to run; ``revoked`` ranges [lo, hi) are the parent's to run elsewhere.
        self.started = 0
        self.revoked: list[tuple[int, int]] = []
        self._turns = threading.Lock()
        self.calls = 0
        self.busy = 0.0
        self._cond = threading.Condition()
        self._credit: dict[int, int] = {}
        self._stopped: set[int] = set()
        self._main = threading.main_thread().ident

    # -- called from the main thread --

    def take_turn(self) -> bool:
        """The loop takes the next task: False when the parent took it back (``revoke``)."""
        with self._turns:
            seq = self.started
            self.started = seq + 1
            revoked = self.revoked
            if not revoked:
                return True
            while revoked and revoked[0][1] <= seq:
                revoked.pop(0)  # passed
            return not any(lo <= seq < hi for lo, hi in revoked)

    def open_stream(self, tid: int, window: int) -> None:
        with self._cond:
            self._credit[tid] = window

    def wait_credit(self, tid: int) -> bool:
        """Take one credit for stream ``tid``, waiting for the consumer; False once the
        consumer stopped the stream."""
        with self._cond:
            while True:
                if tid in self._stopped or tid in self.cancelled:
                    return False
                if self._credit.get(tid, 0) > 0:
                    self._credit[tid] -= 1
                    return True
                self._cond.wait()

    def close_stream(self, tid: int) -> None:
        with self._cond:
            self._credit.pop(tid, None)
            self._stopped.discard(tid)

    def retire(self) -> int:
        """Run no task from the next one on (they are the parent's to run elsewhere): the
        number of the first task not run."""
        with self._turns:
            self.revoked.append((self.started, 1 << 62))
            return self.started

    def cancel_due(self) -> int | None:
        """The task the main thread runs, if it is cancelled and WorkerCancelled has not been
        raised in it yet; else None."""
        tid = self.current
        if tid is None or tid not in self.cancelled or self.interrupted == tid:
            return None
        return tid

    # -- called from the health thread --

    def interrupt(self) -> None:
        """Signal the main thread if a cancel is due (:meth:`cancel_due`), and say when to do
        it again (``again_at``): see NOTE [ A cancel signal sent again ]."""
        if self.cancel_due() is None:
            self.again_at = None
            return
        signal.pthread_kill(self._main, CANCEL_SIGNAL)  # type: ignore[arg-type]
        if self.again_at is None:
            self._again_every = CANCEL_AGAIN
        else:
            self._again_every = min(self._again_every * 2, 1.0)
        self.again_at = time.monotonic() + self._again_every

    def _on_health(self, msg: Any) -> Any:
        """One request ``(op, token, *args)``; the reply is ``(op, token, value)`` or None."""
        op, token, args = msg[0], msg[1], msg[2:]
        if op == "ping":
            return (op, token, None)
        if op == "stats":
            return (op, token, self.stats())
        if op == "cancel":
            with self._cond:
                self.cancelled.update(args[0])
                self._cond.notify_all()
            self.interrupt()
            return None
        if op == "revoke":
            # Tasks [lo, hi) that are not taken yet are not run here: the reply says from
            # which one on, and the parent sends those to other workers.
            lo, hi = args
            with self._turns:
                first = max(lo, self.started)
                if first < hi:
                    self.revoked.append((first, hi))
            return (op, token, first)
        if op == "credit":
            with self._cond:
                if args[0] in self._credit:
                    self._credit[args[0]] += args[1]
                    self._cond.notify_all()
            return None
        if op == "stop":
            with self._cond:
                self._stopped.add(args[0])
                self._cond.notify_all()
            return None
        raise ValueError(f"unknown health request {op!r}")

    def stats(self) -> dict[str, Any]:
        import resource

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        if sys.platform != "darwin":
            peak *= 1024
        return {
            "calls": self.calls,
            "busy_seconds": self.busy,
            "peak_rss": peak,
            "rss": current_rss(os.getpid()),
        }


def current_rss(pid: int) -> int | None:
    """The resident size of ``pid`` in bytes (Linux /proc; psutil elsewhere), None if gone."""
    try:
        with open(f"/proc/{pid}/statm", "rb") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except Exception:  # noqa: BLE001 - gone, or no permission
        return None


def peak_rss(pid: int) -> int | None:
    """The high-water resident size of a live ``pid`` in bytes (VmHWM), None if unknown."""
    try:  # raw reads: a pool samples each busy worker's every RSS_PERIOD
        data = read_path(f"/proc/{pid}/status")
        at = data.find(b"\nVmHWM:")
        if at < 0:
            return None
        return int(data[at + 7 : data.index(b"\n", at + 7)].split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return None


# NOTE [ A cancel signal sent again ]
#
# ``Worker.cancel`` interrupts the running task with a signal from the worker's health thread
# to its main thread, whose handler raises WorkerCancelled there. A signal can be lost for
# that purpose: one that lands after the main thread released the GIL to block (time.sleep,
# a read) but before the blocking call itself began runs the C handler at once, and the call
# then blocks all the same; Python runs the handler only once it returns. The health thread
# gets the GIL exactly when the main thread lets it go to block, so that window is where its
# signal tends to land: beside two busy CPUs, a cancelled 30 s sleep ran to its end in 5 of 60
# runs. So the health thread sends the signal again, CANCEL_AGAIN later and then at doubling
# intervals (at most a second apart), until the handler raised in that task or the task ended;
# the handler raises once a task (``ChildContext.interrupted``), so a signal that comes again
# while WorkerCancelled unwinds the task cannot raise a second one in the loop's handler.
CANCEL_AGAIN = 0.01


def _serve_health(ctx: ChildContext, parent_pid: int) -> None:
    """The worker's health thread: answers the parent at once, and takes the whole worker
    down (its process group) the moment the parent is gone."""
    # Stack requests go to the main thread, one at a time: two dumps written at once by two
    # threads would interleave in the pipe.
    with contextlib.suppress(AttributeError, OSError, ValueError):
        signal.pthread_sigmask(signal.SIG_BLOCK, {STACK_SIGNAL})
    pidfd = None
    with contextlib.suppress(OSError, AttributeError):
        pidfd = os.pidfd_open(parent_pid)
    if pidfd is None and not _alive(parent_pid):
        _die_with_group()
    watched: list[Any] = [ctx.health] + ([pidfd] if pidfd is not None else [])
    while True:
        try:
            timeout = None if pidfd is not None else 1.0
            if ctx.again_at is not None:  # see NOTE [ A cancel signal sent again ]
                left = max(0.0, ctx.again_at - time.monotonic())
                timeout = left if timeout is None else min(timeout, left)
            ready = _connection.wait(watched, timeout)
            if ctx.again_at is not None and time.monotonic() >= ctx.again_at:
                ctx.interrupt()
            if pidfd is not None and pidfd in ready:
                _die_with_group()
            if pidfd is None and not _alive(parent_pid):
                _die_with_group()
            if ctx.health in ready:
                reply = ctx._on_health(ctx.health.recv())
                if reply is not None:
                    ctx.health.send(reply)
        except (EOFError, OSError):
            _die_with_group()  # the parent closed the channel or died: so do we


def _alive(pid: int) -> bool:
    return not parent_gone(pid)


_PF_EXITING = 0x4  # the kernel's task flag, set as a process begins to exit


def _exiting(pid: int) -> bool:
    """Whether ``pid`` has begun to exit (or is gone). The kernel moves an exiting process to
    the root cgroup before it becomes a zombie: a cgroup read after this is not the one it
    lived in."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return fields[0] in (b"Z", b"X") or bool(int(fields[6]) & _PF_EXITING)
    except (OSError, IndexError, ValueError):
        return True


def cgroup_memory_limit(oom_file: str | None) -> int | None:
    """The memory limit in bytes of the cgroup whose OOM counter is ``oom_file`` (v1
    ``memory.limit_in_bytes``, v2 ``memory.max``), None when unlimited or unknown."""
    if oom_file is None:
        return None
    d = os.path.dirname(oom_file)
    for name in ("memory.limit_in_bytes", "memory.max"):
        try:
            with open(os.path.join(d, name), encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        if text == "max":
            return None
        try:
            value = int(text)
        except ValueError:
            return None
        return value if value < (1 << 62) else None  # v1 writes "unlimited" as ~2**63
    return None


# --------------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------------

_QUIET = 0.1  # no repeat (a thread started between the two dumps): a pause this long ends it
_FIRST_LINE = re.compile(rb"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.M)


def stack_text(data: bytes, quiet: float | None, expired: bool) -> str | None:
    """The first complete dump in ``data`` (two were asked for: the second one's first line
    ends the first); the data so far once ``quiet`` seconds passed without more, or at
    ``expired`` ("" when nothing came); None while the dump is still coming."""
    m = _FIRST_LINE.search(data)
    if m:
        for later in _FIRST_LINE.finditer(data, m.end()):
            if later.group(1) == m.group(1):  # the second dump has begun
                return data[: later.start()].decode("utf-8", "replace").rstrip()
    if expired or (quiet is not None and quiet > _QUIET):
        return data.decode("utf-8", "replace").rstrip()
    return None


class WorkerProcess:
    """The parent's handle on one worker process (see the module docstring).

    ``start()`` launches it; ``conn`` and ``health`` are the parent's ends of the channels;
    ``pump_stderr()`` moves its output; ``stack()`` takes its threads' stacks;
    ``signal_group()`` signals its process group; ``crash_error()`` turns a
    :class:`~framepipe.WriterDied` into a :class:`WorkerCrashed`; ``close()`` releases
    everything (the process must be dead or stopped first: see :meth:`stop`).
    """

    def __init__(
        self,
        ctx: Any,
        name: str,
        loop: Callable[[ChildContext], None],
        process: ProcessOptions | None = None,
        *,
        options: dict[str, Any] | None = None,
    ) -> None:
        self.name = name
        self._ctx = ctx
        self._loop = loop
        # how it starts (initializer, env, cwd, output); ``options``: what its loop reads
        self._how = process if process is not None else ProcessOptions(name=name)
        self._options = dict(options or {})
        self.process: Any = None
        self.conn: Any = None
        self.health: Any = None
        self.stderr: OutputPipe | None = None
        self._stack_r: int | None = None
        self.pid: int | None = None
        self.peak_rss: int | None = None
        # the memory cgroup the worker was last seen in and its OOM-kill count then
        self._oom_file: str | None = None
        self._oom_before: int | None = None
        self.started_at = 0.0
        self._health_lock = threading.Lock()
        self._closed = False
        self._exitcode: int | None = None
        register_parent_side(self)

    def __repr__(self) -> str:
        return f"<WorkerProcess {self.name!r} pid={self.pid}>"

    # -- start --

    def start(self) -> None:
        conn, child_conn = _connection.Pipe(True, read_ahead=True, pipes=True)
        health, child_health = _connection.Pipe(True)
        stack_r, stack_w = os.pipe()
        self.conn, self.health, self._stack_r = conn, health, stack_r
        log_path = stdout_path = None
        log_dir = self._how.log_dir
        if log_dir:
            d = os.path.join(log_dir, self.name)
            os.makedirs(d, exist_ok=True)
            log_path = os.path.join(d, "stderr.log")
            stdout_path = os.path.join(d, "stdout.log")
        console = "prefix" if self._how.tee else (None if log_dir else "raw")
        self.stderr, err_w = open_output(self.name, log_path, console)
        boot = WorkerBoot(
            name=self.name,
            parent_pid=os.getpid(),
            conn=child_conn,
            health=child_health,
            stack=FdHandle(stack_w),
            stderr=FdHandle(err_w),
            loop=self._loop,
            initializer=self._how.initializer,
            initargs=self._how.initargs,
            env=dict(self._how.env) if self._how.env else None,
            cwd=self._how.cwd,
            stdout_path=stdout_path,
            options=self._options,
        )
        try:
            self.process = new_process(self._ctx, boot, self.name)
            with main_without_pseudo_file():
                self.process.start()
        finally:
            child_conn.close()
            child_health.close()
            os.close(stack_w)
            os.close(err_w)
        self.pid = self.process.pid
        self.started_at = time.monotonic()
        with contextlib.suppress(OSError):
            os.setpgid(self.pid, self.pid)  # before the child does it too (fork)
        os.set_blocking(stack_r, False)
        conn.watch(self.process)
        # The health channel is not watched: its end of file is only a hint (the data channel
        # and the pidfd tell how the worker died, once). Watched, its reader would wait for
        # the death and build a WriterDied of its own, holding the GIL the caller that waits
        # on the worker's data channel needs to report the same death.

    def _close_in_child(self) -> None:
        for c in (self.conn, self.health):
            if c is not None:
                c.close()
        for fd in (self._stack_r, self.stderr.fd if self.stderr else None):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)

    # -- facts --

    @property
    def alive(self) -> bool:
        return not self._closed and self.process is not None and self.process.is_alive()

    @property
    def exitcode(self) -> int | None:
        if self._closed or self.process is None:
            return self._exitcode
        return self.process.exitcode  # type: ignore[no-any-return]

    def sample_rss(self) -> None:
        """Note the worker's peak resident size so far, and the memory cgroup it is in."""
        if self.pid is not None:
            peak = peak_rss(self.pid)
            if peak is not None and (self.peak_rss is None or peak > self.peak_rss):
                self.peak_rss = peak
            self.track_memory_cgroup()

    def track_memory_cgroup(self) -> None:
        """Note the memory cgroup the worker is in now, and its OOM-kill count, when that
        changed since the last look. A worker may be moved into a cgroup of its own (by an
        initializer, or a task); cgroup v1 counts an OOM kill in that cgroup only, not in its
        parents, and a dead process's cgroup can no longer be read: it has to be known
        before."""
        pid = self.pid
        if pid is None:
            return
        file = _cgroup_oom_file(pid)
        if file is None or file == self._oom_file or _exiting(pid):
            return  # (an exiting process reads as in the root cgroup: not believed)
        self._oom_file, self._oom_before = file, _read_oom_kills(file)

    def _oom_killed(self, died: WriterDied | None, exitcode: int | None) -> bool | None:
        """Whether the OOM killer killed the worker: its cgroup's OOM-kill count rose since
        it was last seen (or the watcher saw its first cgroup's count rise)."""
        seen = died.oom_killed if died is not None else None
        if seen or exitcode != -signal.SIGKILL or self._oom_before is None:
            return seen
        now = _read_oom_kills(self._oom_file)
        if now is None:
            return seen
        return now > self._oom_before or bool(seen)

    def pump_stderr(self) -> bool:
        return self.stderr.pump() if self.stderr is not None else True

    def stderr_fd(self) -> int | None:
        return None if self.stderr is None else self.stderr.fd

    # -- health requests (caller threads) --

    def request(self, msg: Any, timeout: float | None) -> Any:
        """Send ``msg`` on the health channel and return the reply."""
        with self._health_lock:
            self.health.send(msg)
            return self.health.recv(timeout=timeout)

    def notify(self, msg: Any) -> None:
        """Send ``msg`` on the health channel; no reply."""
        self.health.send(msg)

    # -- stacks and signals --

    def request_stack(self) -> int | None:
        """Ask the worker for its stacks; returns the fd the dump arrives on (None when the
        worker is gone). Read it with :func:`stack_text` until that returns the text."""
        fd = self._stack_r
        if fd is None or self.pid is None:
            return None
        read_available(fd)  # anything left from an earlier request
        try:
            os.kill(self.pid, STACK_SIGNAL)
            os.kill(self.pid, STACK_SIGNAL)  # queued: its dump starts where the first ends
        except ProcessLookupError:
            return None
        return fd

    def stack(self, timeout: float = 1.0) -> str | None:
        """Every thread's stack in the worker (faulthandler's text), or None when no dump came
        within ``timeout`` seconds (the process is stopped, gone, or blocks the signal)."""
        fd = self.request_stack()
        if fd is None:
            return None
        deadline = time.monotonic() + timeout
        data = b""
        last = time.monotonic()
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        while True:
            now = time.monotonic()
            text = stack_text(data, now - last if data else None, now >= deadline)
            if text is not None:
                return text or None
            try:
                events = poller.poll(min(deadline - now, _QUIET) * 1000)
            except InterruptedError:
                continue
            if events:
                chunk, eof = read_available(fd)
                data += chunk
                last = time.monotonic()
                if eof:
                    return stack_text(data, None, True) or None

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the worker's process group (and to the worker itself, in case it
        has not made its group yet)."""
        if self.pid is None or self.process is None or self.process.exitcode is not None:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, sig)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, sig)

    def stop(self, timeout: float = 5.0, grace: float = 2.0) -> None:
        """Make sure the worker is gone and reaped: wait up to ``timeout`` for it to exit,
        then SIGTERM its group, wait ``grace``, SIGKILL its group."""
        proc = self.process
        if proc is None:
            return
        proc.join(timeout)
        if proc.exitcode is None:
            self.signal_group(signal.SIGTERM)
            proc.join(grace)
        if proc.exitcode is None:
            self.signal_group(signal.SIGKILL)
            proc.join(5.0)
        # its group may still hold children of its own
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)  # type: ignore[arg-type]

    def kill(self) -> None:
        self.signal_group(signal.SIGKILL)

    # -- reports --

    def crash_error(
        self,
        died: WriterDied | None,
        task_name: str | None = None,
        task_id: int | None = None,
        reason: str | None = None,
        *,
        starting: bool = False,
    ) -> WorkerCrashed:
        """The report of this worker's death, with what it held."""
        if self.stderr is not None:
            with contextlib.suppress(OSError):
                self.stderr.drain(STDERR_DRAIN)
        exitcode = died.exitcode if died is not None else self.exitcode
        oom_killed = self._oom_killed(died, exitcode)
        native = (died.native_traceback if died is not None else None) or (
            self.stderr.native_traceback() if self.stderr is not None else None
        )
        tail = self.stderr.tail_text() if self.stderr is not None else ""
        if native and tail:
            # the dump is shown once, as the native traceback
            tail = "\n".join(line for line in tail.split("\n") if line not in native) or ""
        return WorkerCrashed(
            self.name,
            self.pid,
            exitcode,
            core_dumped=bool(died.core_dumped) if died is not None else False,
            task_name=task_name,
            task_id=task_id,
            peak_rss=self.peak_rss,
            oom_killed=oom_killed,
            memory_limit=cgroup_memory_limit(self._oom_file) if oom_killed else None,
            native_traceback=native,
            stderr_tail=tail,
            log_path=self.stderr.log_path if self.stderr is not None else None,
            reason=reason,
            starting=starting,
        )

    # -- end --

    def close(self) -> None:
        """Release every descriptor (idempotent). Call :meth:`stop` first."""
        if self._closed:
            return
        for c in (self.conn, self.health):
            if c is not None:
                c.close()
        if self._stack_r is not None:
            fd, self._stack_r = self._stack_r, None
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.stderr is not None:
            self.stderr.close()
        if self.process is not None:
            self._exitcode = self.process.exitcode
            if self._exitcode is not None:
                with contextlib.suppress(ValueError, AttributeError):
                    self.process.close()
        self._closed = True
        forget_parent_side(self)
