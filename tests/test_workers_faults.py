"""Worker faults with real processes and real signals: random SIGKILLs in a stream of tasks,
a parent killed with workers running, Ctrl-C, and start/shutdown cycles that leak nothing."""

from __future__ import annotations

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
from _worker_tasks import add, kill_self_if

from framepipe.workers import Pool, WorkerCrashed

HERE = os.path.dirname(__file__)
WAIT = 120  # a hang guard only


@pytest.fixture(autouse=True)
def _clean(no_leftover_processes):
    yield


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


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


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_sigkilled_parent_leaves_no_worker(method):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, *sys.path]))
    parent = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "_worker_parent.py"), "hold", method],
        stdout=subprocess.PIPE, env=env, start_new_session=True,
    )
    try:
        pids = json.loads(parent.stdout.readline())
        assert len(pids) == 3 and all(_alive(p) for p in pids)
        parent.kill()
        parent.wait(WAIT)
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(_alive(p) for p in pids):
            time.sleep(0.02)
        assert not [p for p in pids if _alive(p)], "workers outlived their SIGKILLed parent"
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()
        parent.stdout.close()
        os.killpg(parent.pid, signal.SIGKILL) if _group_alive(parent.pid) else None


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def test_ctrl_c_stops_every_worker_with_one_traceback():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([HERE, *sys.path]))
    parent = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "_worker_parent.py"), "map", "spawn"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True,
    )
    try:
        pids = json.loads(parent.stdout.readline())
        time.sleep(0.5)  # the map is running
        os.killpg(parent.pid, signal.SIGINT)  # as a terminal's Ctrl-C: the whole foreground group
        _, err = parent.communicate(timeout=WAIT)
        text = err.decode()
        assert parent.returncode != 0
        assert text.count("Traceback (most recent call last)") == 1, text
        assert text.count("KeyboardInterrupt") == 1, text
        end = time.monotonic() + 2.0
        while time.monotonic() < end and any(_alive(p) for p in pids):
            time.sleep(0.02)
        assert not [p for p in pids if _alive(p)]
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def test_start_shutdown_cycles_leak_nothing(engine, fd_count):
    def snapshot():
        return fd_count(), threading.active_count()

    with Pool(2, start_method="fork") as pool:  # warm up: imports, the watcher thread
        pool.submit(add, 1, 1).result(WAIT)
    time.sleep(0.2)
    before = snapshot()
    for i in range(200):
        with Pool(2, start_method="fork") as pool:
            assert pool.submit(add, i, 1).result(WAIT) == i + 1
    end = time.monotonic() + 10
    while snapshot() != before and time.monotonic() < end:
        time.sleep(0.05)
    assert snapshot() == before
    zombies = [p for p in psutil.Process().children() if p.status() == psutil.STATUS_ZOMBIE]
    assert not zombies
