"""Worker faults with real processes and real signals: random SIGKILLs in a stream of tasks,
a parent killed with workers running, Ctrl-C, and start/shutdown cycles that leak nothing."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
from _helpers import TESTS, alive, child_env, wait_dead
from _worker_tasks import add, allocate_until_killed, join_cgroup, kill_self_if

from framepipe.workers import Pool, WorkerCrashed
from framepipe.workers.errors import format_bytes

WAIT = 120  # a hang guard only


pytestmark = pytest.mark.usefixtures("no_leftover_processes")


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_random_sigkills_fail_exactly_the_killed_tasks(engine, method):
    if method == "spawn" and engine.__name__.endswith("_pycore"):
        pytest.skip("one spawn run is enough: the engine does not change how workers start")
    rng = random.Random(20261124)
    victims = frozenset(rng.sample(range(1000), 20))
    with Pool(2, start_method=method, max_restarts=None) as pool:
        futures = [pool.submit(kill_self_if, i, victims) for i in range(1000)]
        crashed, results = set(), {}
        for i, fut in enumerate(futures):
            try:
                results[i] = fut.result(WAIT)
            except WorkerCrashed as exc:
                crashed.add(i)
                assert f"task {i} is about to die" in exc.stderr_tail
                assert exc.signal_name == "SIGKILL"
        assert crashed == victims
        assert results == {i: 2 * i for i in range(1000) if i not in victims}
        assert len(pool.crashes) == 20
        assert pool.submit(add, 1, 1).result(WAIT) == 2


@contextlib.contextmanager
def _parent(*args: str):
    """``_worker_parent.py args...`` in a session of its own, its stdout and stderr piped; on
    the way out (failures included) it and anything left in its session are killed."""
    env = child_env()
    parent = subprocess.Popen(
        [sys.executable, os.path.join(TESTS, "_worker_parent.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        start_new_session=True,
    )
    try:
        yield parent
    finally:
        if parent.poll() is None:
            parent.kill()
        parent.communicate()
        if _group_alive(parent.pid):
            os.killpg(parent.pid, signal.SIGKILL)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_sigkilled_parent_leaves_no_worker(method):
    """A parent with a pool, a worker and a group running is SIGKILLed: 2 s later none of the
    five worker processes is alive."""
    with _parent("hold", method) as parent:
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 5 and all(alive(p) for p in pids)
        parent.kill()
        parent.wait(WAIT)
        assert not wait_dead(pids, 2.0), "workers outlived their SIGKILLed parent"


@pytest.mark.parametrize("mode", ["exit", "exit-nowait"])
def test_tasks_submitted_and_not_waited_for_finish_before_the_program_exits(mode, tmp_path):
    """As with concurrent.futures: a program that leaves without waiting for its pool (or after
    ``shutdown(wait=False)``) exits once every task it submitted has run, silently, with no
    worker left behind."""
    path = tmp_path / "done.txt"
    with _parent(mode, "fork", str(path)) as parent:
        out, err = parent.communicate(timeout=WAIT)
        assert parent.returncode == 0 and err == b"" and out == b"", err.decode()
        lines = path.read_text().split()
        assert sorted(int(v) for v in lines[::2]) == list(range(6))
        assert not wait_dead({int(p) for p in lines[1::2]}, 2.0)


def test_ctrl_c_stops_every_worker_with_one_traceback():
    with _parent("map", "spawn") as parent:
        pids = json.loads(parent.stdout.readline())
        time.sleep(0.5)  # the map is running
        os.killpg(parent.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
        _, err = parent.communicate(timeout=WAIT)
        text = err.decode()
        assert parent.returncode != 0
        assert text.count("Traceback (most recent call last)") == 1, text
        assert text.count("KeyboardInterrupt") == 1, text
        assert not wait_dead(pids, 2.0)


def _event_fds() -> int:
    """This process's eventfds and epoll sets (a pool's manager and its callers use them; the
    fd_count fixture leaves such anonymous fds out)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}") in (
                "anon_inode:[eventfd]",
                "anon_inode:[eventpoll]",
            )
        except OSError:
            pass
    return n


def test_start_shutdown_cycles_leak_nothing(engine, fd_count):
    def snapshot():
        return fd_count(), threading.active_count(), _event_fds()

    with Pool(2, start_method="fork") as pool:  # warm up: imports, the watcher thread
        pool.submit(add, 1, 1).result(WAIT)
    time.sleep(0.2)
    before = snapshot()
    for i in range(200):
        with Pool(2, start_method="fork") as pool:
            assert pool.submit(add, i, 1).result(WAIT) == i + 1
            assert _event_fds() > before[2]  # the pool's own are counted
    end = time.monotonic() + 10
    while snapshot() != before and time.monotonic() < end:
        time.sleep(0.05)
    assert snapshot() == before
    zombies = [p for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE]
    assert not zombies


# -- the OOM killer ---------------------------------------------------------------------------

CGROUP_LIMIT = 96 << 20


def _own_memory_cgroup() -> tuple[str, int]:
    """The directory of this process's memory cgroup and the cgroup version, or a skip."""
    if os.geteuid() != 0:
        pytest.skip("making a memory cgroup needs root")
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    v1 = v2 = None
    for line in lines:
        hier, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):
            v1 = path
        elif hier == "0" and controllers == "":
            v2 = path
    found = [("/sys/fs/cgroup/memory", v1, 1)] if v1 is not None else []
    if v2 is not None:
        found.append(("/sys/fs/cgroup", v2, 2))
    for root, path, version in found:
        parts = [p for p in path.split("/") if p]
        for skip in range(len(parts) + 1):  # a container may see its cgroup as the root
            d = os.path.join(root, *parts[skip:])
            marker = "memory.oom_control" if version == 1 else "memory.events"
            if os.path.isfile(os.path.join(d, marker)) or (
                version == 2 and os.path.isfile(os.path.join(d, "cgroup.subtree_control"))
            ):
                if not os.access(d, os.W_OK):
                    pytest.skip(f"the memory cgroup {d} is not writable")
                return d, version
    pytest.skip("no memory cgroup controller mounted (cgroup v1 memory or v2 with memory)")


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


@pytest.fixture
def memory_cgroup():
    """A memory cgroup of its own with a small limit (and no swap), removed afterwards."""
    parent, version = _own_memory_cgroup()
    path = os.path.join(parent, f"framepipe-oom-test-{os.getpid()}")
    try:
        os.mkdir(path)
    except OSError as exc:
        pytest.skip(f"cannot create a memory cgroup in {parent}: {exc}")
    try:
        try:
            if version == 1:
                _write(os.path.join(path, "memory.limit_in_bytes"), str(CGROUP_LIMIT))
                if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(CGROUP_LIMIT))
                _write(os.path.join(path, "memory.swappiness"), "0")
            else:
                # cgroup v2: the memory controller must be delegated to this subtree
                if not os.path.exists(os.path.join(path, "memory.max")):
                    pytest.skip(f"cgroup v2 without the memory controller delegated to {parent}")
                _write(os.path.join(path, "memory.max"), str(CGROUP_LIMIT))
                if os.path.exists(os.path.join(path, "memory.swap.max")):
                    _write(os.path.join(path, "memory.swap.max"), "0")
        except OSError as exc:
            pytest.skip(f"cannot set a memory limit on {path}: {exc}")
        yield path
    finally:
        end = time.monotonic() + 10  # the workers have exited; their cgroup may lag a moment
        while True:
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > end:
                    raise
                time.sleep(0.05)


def pool_in(cgroup: str, start_method: str) -> Pool:
    """A one-worker pool whose workers move themselves into ``cgroup`` as they start (as a
    worker started by a job system would be in one of its own)."""
    return Pool(
        1,
        start_method=start_method,
        initializer=join_cgroup,
        initargs=(cgroup,),
        max_restarts=None,
    )


def test_a_worker_the_oom_killer_takes_is_reported_as_such(engine, memory_cgroup):
    # Each worker moves itself into the cgroup, then a task grows until the kernel's OOM
    # killer ends it.
    with pool_in(memory_cgroup, "spawn") as pool:
        first = pool.submit(os.getpid).result(WAIT)
        with open(os.path.join(memory_cgroup, "cgroup.procs")) as f:
            assert str(first) in f.read().split()
        fut = pool.submit(allocate_until_killed, 4 << 20, 0.02)
        with pytest.raises(WorkerCrashed) as info:
            fut.result(WAIT)
        err = info.value
        assert err.pid == first and err.signal_name == "SIGKILL"
        assert err.task_name.endswith("allocate_until_killed")
        assert err.oom_killed is True
        # its resident size was read while it grew: the peak is most of the limit
        assert err.peak_rss is not None and err.peak_rss >= CGROUP_LIMIT // 2
        assert err.memory_limit == CGROUP_LIMIT
        text = str(err)
        assert f"likely the OOM killer: peak RSS {format_bytes(err.peak_rss)}" in text
        assert f"its memory cgroup's limit is {format_bytes(CGROUP_LIMIT)}" in text
        # the pool goes on with a new worker (in the cgroup too)
        assert pool.submit(add, 2, 3).result(WAIT) == 5
        assert pool.submit(os.getpid).result(WAIT) != first


def test_a_sigkill_by_hand_is_not_called_the_oom_killer(engine, memory_cgroup):
    with pool_in(memory_cgroup, "fork") as pool:
        fut = pool.submit(kill_self_if, 1, {1})
        with pytest.raises(WorkerCrashed) as info:
            fut.result(WAIT)
        assert info.value.signal_name == "SIGKILL"
        assert info.value.oom_killed is False
        assert "OOM" not in str(info.value)


def test_a_worker_dying_during_shutdown_is_replaced_for_the_tasks_that_wait(engine):
    # One worker, whose first task kills it once shutdown() has begun: the pool accepted the
    # tasks behind it, so shutdown() starts a replacement, runs them, then returns.
    pool = Pool(1, start_method="fork", max_restarts=None)
    try:
        assert pool.submit(add, 0, 0).result(WAIT) == 0  # the worker runs
        victim = pool.submit(kill_self_if, 0, frozenset({0}))
        behind = [pool.submit(add, i, i) for i in range(1, 6)]
        closer = threading.Thread(target=pool.shutdown, daemon=True)
        closer.start()
        closer.join(WAIT)
        assert not closer.is_alive(), "shutdown() hung after a worker died while closing"
        with pytest.raises(WorkerCrashed):
            victim.result(0)
        assert [f.result(0) for f in behind] == [2 * i for i in range(1, 6)]
    finally:
        pool.terminate()
