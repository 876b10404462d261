"""Writer liveness (framepipe.watch) against real processes: every multiprocessing start method
and subprocess.Popen, real signals, real reaping. No timing assertions: waits are generous and
only bound how long a broken build takes to fail."""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import multiprocessing
import os
import resource
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
from _fault_children import die
from _helpers import at_pid, exit_code, fork, run_python

from framepipe.errors import WriterDied
from framepipe.watch import (
    DEAD_STATUS_UNKNOWN,
    HAVE_PIDFD,
    Liveness,
    Watcher,
    dead_status_word,
    exitcode_from_status_word,
    resolve_target,
    watcher,
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX processes")

WAIT = 60.0  # upper bound on any wait; a healthy run never comes close
MODES = [pytest.param(True, id="pidfd"), pytest.param(False, id="portable")]
if not HAVE_PIDFD:
    MODES[0] = pytest.param(True, id="pidfd", marks=pytest.mark.skip("no pidfds here"))
LAUNCHERS = ["fork", "spawn", "forkserver", "popen"]
WNOWAIT = os.WEXITED | os.WNOHANG | os.WNOWAIT


# -- children --------------------------------------------------------------------------------


def _mp_child(go: Any, action: tuple[str, int]) -> None:
    go.wait(WAIT)
    die(action)


def _sleeper() -> None:
    time.sleep(WAIT)


class Child:
    """A real child that waits for `go()` and then does `action`: ("exit", code) or
    ("signal", signum)."""

    def __init__(self, launcher: str, action: tuple[str, int]) -> None:
        self.launcher = launcher
        action = (action[0], int(action[1]))
        self.action = action
        if launcher == "popen":
            code = (
                "import sys, time, os\n"
                "sys.stdin.read()\n"
                f"kind, value = {action!r}\n"
                "if kind == 'exit': os._exit(value)\n"
                "os.kill(os.getpid(), value); time.sleep(60); os._exit(99)\n"
            )
            self.obj: Any = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)
        else:
            ctx: Any = multiprocessing.get_context(launcher)
            self._go = ctx.Event()
            self.obj = ctx.Process(target=_mp_child, args=(self._go, action), daemon=True)
            self.obj.start()
        self.pid: int = self.obj.pid

    def go(self) -> None:
        if self.launcher == "popen":
            self.obj.stdin.close()
        else:
            self._go.set()

    def is_our_child(self) -> bool:
        return self.launcher != "forkserver"

    def reap(self) -> int:
        """The owner's own way of collecting the exit code."""
        if self.launcher == "popen":
            return int(self.obj.wait(WAIT))
        self.obj.join(WAIT)
        return int(self.obj.exitcode)

    def cleanup(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        with contextlib.suppress(OSError, TypeError, subprocess.TimeoutExpired):
            self.reap()


@pytest.fixture
def children() -> Any:
    made: list[Child] = []

    def make(launcher: str, action: tuple[str, int] = ("signal", signal.SIGKILL)) -> Child:
        c = Child(launcher, action)
        made.append(c)
        return c

    yield make
    for c in made:
        c.cleanup()


def wait_seen_dead(lv: Liveness) -> None:
    deadline = time.monotonic() + WAIT
    while not lv.poll_dead():
        if time.monotonic() > deadline:
            pytest.fail(f"{lv!r} not seen dead within {WAIT} s")
        if lv.fd is not None:
            select.select([lv.fd], [], [], 0.5)
        else:
            time.sleep(0.005)


def still_waitable(pid: int) -> bool:
    """True when `pid` is our child and still waits to be reaped (a zombie nobody collected)."""
    try:
        return os.waitid(os.P_PID, pid, WNOWAIT) is not None
    except ChildProcessError:
        return False


def fork_sleeper() -> int:
    return fork(lambda: time.sleep(WAIT))


def kill_and_reap(pid: int) -> int:
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    return status


# -- resolve_target --------------------------------------------------------------------------


def test_resolve_target_kinds() -> None:
    assert resolve_target(1234) == (1234, None)
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        assert resolve_target(p) == (p.pid, p)
    finally:
        p.wait()
    proc = multiprocessing.get_context("fork").Process(target=_sleeper, daemon=True)
    with pytest.raises(ValueError, match=r"start\(\) first"):
        resolve_target(proc)
    with pytest.raises(ValueError, match="start"):
        Liveness(proc)
    proc.start()
    try:
        assert resolve_target(proc) == (proc.pid, proc)
    finally:
        proc.kill()
        proc.join()


@pytest.mark.parametrize("bad", ["1234", 12.0, None, True, object(), [1]])
def test_resolve_target_rejects_other_types(bad: Any) -> None:
    with pytest.raises(TypeError, match="pid"):
        resolve_target(bad)


@pytest.mark.parametrize("bad", [0, -1])
def test_resolve_target_rejects_non_positive_pid(bad: int) -> None:
    with pytest.raises(ValueError, match="positive"):
        resolve_target(bad)


# -- exit status, never reaped ---------------------------------------------------------------


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize(
    "action, expected",
    [
        pytest.param(("exit", 0), 0, id="exit0"),
        pytest.param(("exit", 3), 3, id="exit3"),
        pytest.param(("signal", signal.SIGKILL), -signal.SIGKILL, id="sigkill"),
    ],
)
@pytest.mark.parametrize("use_pidfd", MODES)
def test_death_status_then_owner_still_reaps(
    children: Callable[..., Child],
    launcher: str,
    action: tuple[str, int],
    expected: int,
    use_pidfd: bool,
) -> None:
    c = children(launcher, action)
    lv = Liveness(c.obj, use_pidfd=use_pidfd)
    try:
        assert (lv.fd is not None) == (use_pidfd and HAVE_PIDFD)
        assert not lv.poll_dead()
        assert lv.status() == (None, False)
        assert lv.oom_killed() is None
        c.go()
        wait_seen_dead(lv)
        assert lv.status() == (expected, False)
        if c.is_our_child():
            assert still_waitable(c.pid), "the watch must not reap the writer"
        err = lv.error(lost_bytes=5, expected_bytes=42, label="loader")
        assert isinstance(err, WriterDied)
        assert isinstance(err, EOFError) and isinstance(err, OSError)
        assert (err.pid, err.exitcode, err.lost_bytes, err.expected_bytes) == (
            c.pid,
            expected,
            5,
            42,
        )
        assert err.core_dumped is False
        assert err.native_traceback is None
        assert f"loader {c.pid}" in str(err)
        if expected < 0:
            assert err.signal_name == "SIGKILL"
            assert "SIGKILL" in str(err)
        else:
            assert err.signal_name is None
            assert f"exited with code {expected}" in str(err)
        # The owner still collects the very same status.
        assert c.reap() == expected
        assert lv.poll_dead()
        assert lv.status() == (expected, False)
    finally:
        lv.close()


@pytest.mark.parametrize("allow_core", [False, True], ids=["rlimit0", "core-allowed"])
@pytest.mark.parametrize("use_pidfd", MODES)
def test_sigsegv_core_dump_as_the_kernel_reports(
    tmp_path: Any, allow_core: bool, use_pidfd: bool
) -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_CORE)
    if allow_core and hard == 0:
        pytest.skip("core dumps are forbidden by the hard RLIMIT_CORE")
    r, w = os.pipe()

    def crash() -> int:
        os.close(w)
        os.chdir(tmp_path)
        resource.setrlimit(resource.RLIMIT_CORE, (hard if allow_core else 0, hard))
        faulthandler.disable()
        os.read(r, 1)
        ctypes.string_at(0)  # a real invalid read
        return 97  # not reached

    pid = fork(crash)
    os.close(r)
    lv = Liveness(pid, use_pidfd=use_pidfd)
    try:
        assert not lv.poll_dead()
        os.close(w)
        wait_seen_dead(lv)
        exitcode, core_dumped = lv.status()
        assert still_waitable(pid)
        _, raw = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(raw) and os.WTERMSIG(raw) == signal.SIGSEGV
        assert exitcode == -signal.SIGSEGV
        assert core_dumped == os.WCOREDUMP(raw)
        if not allow_core:
            assert core_dumped is False
        err = lv.error()
        assert err.signal_name == "SIGSEGV"
        assert err.core_dumped == core_dumped
        assert err.oom_killed is False
        # Collected by someone else afterwards: the status stays known.
        assert lv.status() == (exitcode, core_dumped)
    finally:
        lv.close()


def test_native_traceback_from_the_guard(tmp_path: Any) -> None:
    guard = pytest.importorskip("framepipe.guard")
    p = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    )
    lv = Liveness(p)
    try:
        path = guard.fault_path(p.pid)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write('Fatal Python error: Segmentation fault\n  File "x.py", line 1 in f\n')
        os.kill(p.pid, signal.SIGSEGV)
        wait_seen_dead(lv)
        err = lv.error()
        assert err.native_traceback is not None and "Segmentation fault" in err.native_traceback
        assert "Segmentation fault" in str(err)
        assert p.wait() == -signal.SIGSEGV
    finally:
        p.stdin.close()  # type: ignore[union-attr]
        lv.close()
        if p.poll() is None:
            p.kill()
            p.wait()


# -- not our child; reaped by others; recycled pids ------------------------------------------


@pytest.mark.parametrize("use_pidfd", MODES)
def test_grandchild_zombie_status_is_read(use_pidfd: bool) -> None:
    """A writer that is not our child: dead once it exits, with the status its own parent has
    not yet collected."""
    to_mid_r, to_mid_w = os.pipe()
    from_mid_r, from_mid_w = os.pipe()

    def middle() -> None:
        os.close(to_mid_w)
        os.close(from_mid_r)
        g = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
        )
        os.write(from_mid_w, str(g.pid).encode() + b"\n")
        os.read(to_mid_r, 1)  # keep the grandchild a zombie until the test is done
        g.wait()

    mid = fork(middle)
    os.close(to_mid_r)
    os.close(from_mid_w)
    gpid = int(os.read(from_mid_r, 64))
    os.close(from_mid_r)
    lv = Liveness(gpid, use_pidfd=use_pidfd)
    try:
        assert not lv.poll_dead()
        os.kill(gpid, signal.SIGKILL)
        wait_seen_dead(lv)
        assert lv.status() == (-signal.SIGKILL, False)
        assert lv.error().signal_name == "SIGKILL"
    finally:
        os.close(to_mid_w)
        _, st = os.waitpid(mid, 0)
        lv.close()
    assert os.waitstatus_to_exitcode(st) == 0
    assert lv.poll_dead()
    assert lv.status() == (-signal.SIGKILL, False)


@pytest.mark.parametrize("use_pidfd", MODES)
def test_pid_reaped_before_the_watch_is_dead(use_pidfd: bool) -> None:
    p = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    assert p.wait() == 4
    with Liveness(p.pid, use_pidfd=use_pidfd) as by_pid:
        assert by_pid.fd is None
        assert by_pid.poll_dead()
        assert by_pid.status() == (None, False)
        assert by_pid.error().exitcode is None
    with Liveness(p, use_pidfd=use_pidfd) as by_popen:
        assert by_popen.poll_dead()
        assert by_popen.status() == (4, False)


@pytest.mark.parametrize("use_pidfd", MODES)
def test_pid_reaped_by_someone_else_during_the_watch(use_pidfd: bool) -> None:
    pid = fork_sleeper()
    lv = Liveness(pid, use_pidfd=use_pidfd)
    try:
        assert not lv.poll_dead()
        kill_and_reap(pid)  # reaped behind the watch's back, status never seen by it
        assert lv.poll_dead()
        assert lv.status() == (None, False)
    finally:
        lv.close()


def _force_pid(pid: int) -> int | None:
    """Fork a sleeping child with exactly `pid` (see ``at_pid``), or None when the system does
    not allow it."""
    for _ in range(50):
        settable, new = at_pid(pid, fork_sleeper)
        if not settable:
            return None
        if new == pid:
            return new
        kill_and_reap(new)
    return None


@pytest.mark.parametrize("use_pidfd", MODES)
def test_recycled_pid_does_not_resurrect_the_writer(use_pidfd: bool) -> None:
    if not os.path.exists("/proc/sys/kernel/ns_last_pid"):
        pytest.skip("needs Linux ns_last_pid to recycle a pid on purpose")
    old = fork_sleeper()
    lv = Liveness(old, use_pidfd=use_pidfd)
    new = None
    try:
        assert not lv.poll_dead()
        kill_and_reap(old)
        # Start times are counted in clock ticks: make sure the newcomer starts in a later one.
        time.sleep(0.05)
        new = _force_pid(old)
        if new is None:
            pytest.skip("this system does not let the test recycle a pid")
        with Liveness(new, use_pidfd=use_pidfd) as newcomer:
            assert not newcomer.poll_dead()
        assert lv.poll_dead(), "a new process with the same pid was taken for the old writer"
        assert lv.status() == (None, False)
    finally:
        lv.close()
        if new is not None:
            kill_and_reap(new)


def test_close_is_idempotent_and_keeps_status() -> None:
    pid = fork_sleeper()
    lv = Liveness(pid)
    fd = lv.fd
    os.kill(pid, signal.SIGKILL)
    wait_seen_dead(lv)
    assert lv.status() == (-signal.SIGKILL, False)
    lv.close()
    lv.close()
    assert lv.fd is None
    if fd is not None:
        with pytest.raises(OSError):
            os.fstat(fd)
    os.waitpid(pid, 0)
    assert lv.poll_dead()
    assert lv.status() == (-signal.SIGKILL, False)


# -- OOM ---------------------------------------------------------------------------------------


def test_oom_killed_false_for_other_deaths(children: Callable[..., Child]) -> None:
    killed = children("popen")
    exited = children("popen", ("exit", 3))
    with Liveness(killed.obj) as a, Liveness(exited.obj) as b:
        killed.go()
        exited.go()
        wait_seen_dead(a)
        wait_seen_dead(b)
        assert a.oom_killed() is (None if a.oom_before is None else False)
        assert b.oom_killed() is False
        assert a.error().oom_killed == a.oom_killed()


def _memory_cgroup_dir() -> str | None:
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                if "memory" in ctrls.split(","):
                    d = "/sys/fs/cgroup/memory" + path
                    return d if os.path.isdir(d) else None
    except OSError:
        return None
    return None


def test_oom_kill_is_recognised(tmp_path: Any) -> None:
    parent = _memory_cgroup_dir()
    if parent is None:
        pytest.skip("needs a cgroup v1 memory hierarchy")
    cg = os.path.join(parent, f"framepipe-test-{os.getpid()}")
    try:
        os.mkdir(cg)
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup: {exc}")
    p = None
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(64 << 20))
        memsw = os.path.join(cg, "memory.memsw.limit_in_bytes")
        if os.path.exists(memsw):
            with open(memsw, "w") as f:
                f.write(str(64 << 20))
        p = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stdin.read(); b = b'x' * (1 << 30)"],
            stdin=subprocess.PIPE,
        )
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(p.pid))
        with Liveness(p) as lv:
            assert lv.oom_before == 0
            p.stdin.close()  # type: ignore[union-attr]
            wait_seen_dead(lv)
            assert lv.status() == (-signal.SIGKILL, False)
            assert lv.oom_killed() is True
            err = lv.error()
            assert err.oom_killed is True and "OOM" in str(err)
        assert p.wait() == -signal.SIGKILL
    finally:
        if p is not None and p.poll() is None:
            p.kill()
            p.wait()
        os.rmdir(cg)


# -- status words --------------------------------------------------------------------------------


def test_dead_status_word() -> None:
    assert dead_status_word(0) == 0
    assert dead_status_word(3) == 3
    assert dead_status_word(255) == 255
    assert dead_status_word(-signal.SIGKILL) == 256 + signal.SIGKILL
    assert dead_status_word(-signal.SIGSEGV) == 256 + signal.SIGSEGV
    assert dead_status_word(None) == DEAD_STATUS_UNKNOWN == 2**64 - 1
    assert exitcode_from_status_word(DEAD_STATUS_UNKNOWN) is None
    for code in (0, 3, 137, 255, -signal.SIGKILL, -signal.SIGSEGV):
        assert exitcode_from_status_word(dead_status_word(code)) == code


# -- Watcher -----------------------------------------------------------------------------------


class Seen:
    """Records what a watcher callback saw, from the watcher thread."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.thread = ""
        self.status: tuple[int | None, bool] | None = None
        self.zombie_pending: bool | None = None
        self.calls = 0

    def __call__(self, lv: Liveness) -> None:
        self.calls += 1
        self.thread = threading.current_thread().name
        self.status = lv.status()
        self.zombie_pending = still_waitable(lv.pid)
        self.event.set()


@pytest.mark.parametrize("launchers", [("fork", "popen"), ("spawn", "forkserver")])
def test_watcher_reports_several_deaths(
    children: Callable[..., Child], launchers: tuple[str, str]
) -> None:
    kids = [children(name) for name in launchers]
    lives = [Liveness(k.obj) for k in kids]
    seen = [Seen() for _ in kids]
    w = watcher()
    for lv, s in zip(lives, seen):
        w.register(lv, s)
    try:
        assert not any(s.event.is_set() for s in seen)
        for k in kids:
            k.go()
        for k, s in zip(kids, seen):
            assert s.event.wait(WAIT), f"no callback for {k.launcher} child"
            assert s.thread == "framepipe-watcher"
            if k.launcher == "forkserver":
                # The forkserver reaps its child itself and reports the code once, through the
                # Process's sentinel; the watcher thread never takes that report (it would
                # leave the user's Process with a made-up 255), so unless it caught the zombie
                # first it does not know the code yet.
                assert s.status in ((-signal.SIGKILL, False), (None, False))
            else:
                assert s.status == (-signal.SIGKILL, False)
            assert s.calls == 1
            if k.is_our_child():
                assert s.zombie_pending, "callback ran before the death was confirmed"
        for k, lv in zip(kids, lives):
            assert lv.status() == (-signal.SIGKILL, False)  # this thread may ask the owner
            assert k.reap() == -signal.SIGKILL
    finally:
        for lv in lives:
            lv.close()
    assert all(s.calls == 1 for s in seen)


def test_watcher_singleton_thread() -> None:
    w = watcher()
    assert watcher() is w
    assert w.running
    names = [t for t in threading.enumerate() if t.name == "framepipe-watcher"]
    assert any(t.daemon for t in names)


def test_watcher_fires_for_an_already_dead_writer() -> None:
    pid = fork_sleeper()
    os.kill(pid, signal.SIGKILL)
    with Liveness(pid) as lv:
        wait_seen_dead(lv)
        s = Seen()
        watcher().register(lv, s)
        assert s.event.wait(WAIT)
        assert s.status == (-signal.SIGKILL, False)
    os.waitpid(pid, 0)


def test_watcher_unregister(children: Callable[..., Child]) -> None:
    a, b = children("popen"), children("popen")
    with Liveness(a.obj) as la, Liveness(b.obj) as lb:
        sa, sb = Seen(), Seen()
        w = watcher()
        ha = w.register(la, sa)
        hb = w.register(lb, sb)
        assert w.unregister(ha) is True
        assert w.unregister(ha) is False
        a.go()
        assert a.reap() == -signal.SIGKILL
        b.go()
        assert sb.event.wait(WAIT)
        assert w.unregister(hb) is False  # already called
    assert sa.calls == 0


def test_watcher_survives_a_failing_callback(children: Callable[..., Child], capfd: Any) -> None:
    a, b = children("fork"), children("fork")
    with Liveness(a.obj) as la, Liveness(b.obj) as lb:
        failed = threading.Event()

        def boom(lv: Liveness) -> None:
            failed.set()
            raise RuntimeError("callback failure on purpose")

        w = watcher()
        w.register(la, boom)
        a.go()
        assert failed.wait(WAIT)
        sb = Seen()
        w.register(lb, sb)
        b.go()
        assert sb.event.wait(WAIT)
        assert w.running
    assert "callback failure on purpose" in capfd.readouterr().err


def test_watcher_portable_path_and_stop(children: Callable[..., Child]) -> None:
    kids = [children("fork"), children("popen")]
    lives = [Liveness(k.obj, use_pidfd=False) for k in kids]
    w = Watcher()
    try:
        seen = [Seen() for _ in kids]
        for lv, s in zip(lives, seen):
            assert lv.fd is None
            w.register(lv, s)
        for k in kids:
            k.go()
        for s in seen:
            assert s.event.wait(WAIT)
            assert s.status == (-signal.SIGKILL, False)
            assert s.zombie_pending
    finally:
        w.stop()
    assert not w.running
    with pytest.raises(RuntimeError, match="stopped"):
        w.register(lives[0], Seen())
    for lv in lives:
        lv.close()


def test_watcher_in_a_forked_child() -> None:
    parent_watcher = watcher()
    assert parent_watcher.running

    def child() -> int:
        w = watcher()
        if w is parent_watcher or not w.running or parent_watcher.running:
            return 2
        gpid = fork_sleeper()
        with Liveness(gpid) as lv:
            s = Seen()
            w.register(lv, s)
            os.kill(gpid, signal.SIGKILL)
            ok = s.event.wait(WAIT)
            code = 0 if ok and s.status == (-signal.SIGKILL, False) else 3
            code = code or (0 if s.thread == "framepipe-watcher" else 4)
        os.waitpid(gpid, 0)
        return code

    assert exit_code(fork(child), WAIT) == 0
    # The parent's watcher is unaffected.
    assert watcher() is parent_watcher and parent_watcher.running
    other = fork_sleeper()
    with Liveness(other) as lv:
        s = Seen()
        parent_watcher.register(lv, s)
        os.kill(other, signal.SIGKILL)
        assert s.event.wait(WAIT)
    os.waitpid(other, 0)


@pytest.mark.skipif(not HAVE_PIDFD, reason="the watcher holds descriptors only with pidfds")
def test_fork_while_the_watcher_closes_never_closes_a_reused_number(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A process forked while the watcher thread is in close(2) (which lets go of the GIL)
    must not close that number again: by then another thread may have reused it (a worker's
    channel, whose child then died with EBADF)."""
    w = watcher()
    real_close = os.close
    closed: list[int] = []
    in_window = threading.Event()
    resume = threading.Event()

    def close_then_hold(fd: int) -> None:
        real_close(fd)
        if threading.current_thread() is w._thread and not closed:
            closed.append(fd)
            in_window.set()
            resume.wait(WAIT)  # the watcher thread stays just after close(2)

    monkeypatch.setattr(os, "close", close_then_hold)
    pid = fork_sleeper()
    child = -1
    try:
        with Liveness(pid) as lv:
            s = Seen()
            w.register(lv, s)
            os.kill(pid, signal.SIGKILL)
            assert s.event.wait(WAIT)
            w._wake_locked()  # the thread closes its duplicate of the pidfd on its next turn
            assert in_window.wait(WAIT)
        r, wr = os.pipe()  # takes the lowest free number: the one just closed, or lower
        try:
            assert closed[0] in (r, wr) or min(r, wr) < closed[0]
            reused = closed[0] if closed[0] in (r, wr) else None

            def child_sees_both() -> int:
                try:
                    for fd in (r, wr):
                        os.fstat(fd)
                except OSError:
                    return 1
                return 0

            child = fork(child_sees_both)
            code = exit_code(child)
            child = -1
            assert code == 0, (
                f"the forked child lost fd {reused}, which the parent reused after the "
                "watcher closed it"
            )
        finally:
            real_close(r)
            real_close(wr)
    finally:
        resume.set()
        monkeypatch.undo()
        if child > 0:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(child, 0)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def test_watcher_stops_at_interpreter_exit() -> None:
    code = (
        "import atexit, os, signal, threading, time\n"
        "box = []\n"
        # Registered before framepipe.watch is imported, so it runs after the watcher's own
        # exit handler (atexit runs the last registered first).
        "atexit.register(lambda: print('running at the end:', box[0].running, flush=True))\n"
        "from framepipe.watch import Liveness, watcher\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(60); os._exit(0)\n"
        "lv = Liveness(pid)\n"
        "ev = threading.Event()\n"
        "box.append(watcher())\n"
        "box[0].register(lv, lambda l: ev.set())\n"
        "os.kill(pid, signal.SIGKILL)\n"
        "assert ev.wait(60)\n"
        "os.waitpid(pid, 0)\n"
    )
    out = run_python("-c", code, timeout=WAIT)
    assert out.returncode == 0, out.stderr
    assert "running at the end: False" in out.stdout
    assert out.stderr == ""


def test_a_forked_copy_of_a_dead_writers_liveness_closes_without_its_lock():
    """A child forked while a parent thread reads a dead writer's fault (its lock held) closes
    its copy of that Liveness at once: the fault is the parent's to read."""
    writer = subprocess.Popen([sys.executable, "-c", "pass"])
    writer.wait()
    lv = Liveness(writer.pid)
    lv._mark_dead()
    with lv._fault_lock:  # as a parent thread inside _read_fault at the fork
        pid = fork(lv.close)
    try:
        # a hang: the child's close() waited for a lock its parent's thread held
        assert exit_code(pid, 10) == 0
    finally:
        lv.close()
