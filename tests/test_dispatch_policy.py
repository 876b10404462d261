"""The dispatch core's policy objects, its workers' lifecycle states and its at-exit registration,
seen through real pools and actors (real processes, both engines)."""

from __future__ import annotations

import time

import pytest
from _helpers import gone, run_python
from _worker_tasks import getpid, identity, kill_self_if

from framepipe.workers import Pool, Worker, WorkerCrashed, _atexit
from framepipe.workers._lifecycle import IllegalMove, State
from framepipe.workers._options import ProcessOptions
from framepipe.workers._policy import ActorPolicy, GroupPolicy, LoaderPolicy, PoolPolicy

WAIT = 60  # a hang guard only


@pytest.fixture(autouse=True)
def _clean(no_leftover_processes):
    yield


def _wait_until(cond, timeout=WAIT):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_a_pool_and_a_worker_hand_their_arguments_to_options_and_policy(engine, tmp_path):
    with Pool(
        2,
        start_method="fork",
        max_restarts=3,
        restart_window=7.5,
        max_task_crashes=2,
        kill_grace=0.25,
        env={"FP_POLICY_TEST": "1"},
        cwd=tmp_path,
        name="ptest",
    ) as pool:
        core = pool._core
        assert isinstance(core.policy, PoolPolicy)
        assert (core.policy.max_restarts, core.policy.restart_window) == (3, 7.5)
        assert core.policy.max_task_crashes == 2
        assert isinstance(core.options, ProcessOptions)
        assert core.options.name == "ptest" and core.options.cwd == str(tmp_path)
        assert core.kill_grace == 0.25
        assert pool.submit(identity, 5).result(WAIT) == 5
    with Worker(start_method="fork", name="atest") as w:
        assert isinstance(w._core.policy, ActorPolicy)
        assert w._core.options.name == "atest"
        assert w.call(identity, 6) == 6


def test_what_the_policies_answer_differs_where_an_actor_and_a_pool_differ():
    pool, actor = PoolPolicy(max_restarts=2, max_task_crashes=3), ActorPolicy()
    # a crash: a pool runs the task again until it killed max_task_crashes workers
    assert [pool.retries(n) for n in (1, 2, 3)] == [True, True, False]
    assert not actor.retries(1)
    assert actor.crash_fails_queued and not pool.crash_fails_queued
    # a crash loop breaks a pool past max_restarts, an actor never
    assert not pool.crash_loop(2) and pool.crash_loop(3)
    assert not actor.crash_loop(10**6)
    # an actor starts its process when a call waits for one; a pool stays at strength
    assert actor.replacements(1, calls_waiting=False, any_running=True) == 0
    assert actor.replacements(1, calls_waiting=True, any_running=True) == 1
    assert pool.replacements(2, calls_waiting=False, any_running=True) == 2
    # a pool's broken error is an Executor's, its reason as the cause
    reason = ValueError("first line\nsecond line")
    broken = pool.broken("p", reason)
    assert type(broken).__name__ == "PoolBroken" and broken.__cause__ is reason
    assert "first line" in str(broken) and "second line" not in str(broken)
    assert actor.broken("w", reason) is reason
    assert pool.finishes_at_exit and not actor.finishes_at_exit
    assert pool.kept_at_cancel(3) == 3 and actor.kept_at_cancel(3) == 0


def test_a_loader_and_a_group_answer_the_same_questions():
    pool, actor = PoolPolicy(), ActorPolicy()
    never, twice = LoaderPolicy.of(0), LoaderPolicy.of(2)
    group = GroupPolicy()
    # a loader's batch runs again on worker_crash_retries fresh workers, then the loader fails
    assert not never.replaces_crashed and not never.retries(1)
    assert twice.replaces_crashed and [twice.retries(n) for n in (1, 2, 3)] == [True, True, False]
    # a rank is never run alone again, nor replaced: the group is one whole
    assert not group.retries(1) and group.replacements(2, True, True) == 0
    # an unretried crash stops every worker of a loader or a group, one task or call of the rest
    assert never.crash_stops_all and group.crash_stops_all
    assert not pool.crash_stops_all and not actor.crash_stops_all
    # round robin (a seed reproduces an epoch) and one entry point per rank: nothing balances
    assert pool.balances and not (never.balances or group.balances or actor.balances)
    assert not (never.finishes_at_exit or group.finishes_at_exit)
    assert [p.label for p in (pool, actor, never, group)] == [
        "a Pool",
        "a Worker",
        "a DataLoader",
        "a WorkerGroup",
    ]


def test_a_workers_record_moves_through_the_lifecycle_states(engine):
    with Pool(1, start_method="fork", max_tasks_per_worker=2) as pool:
        first = pool.submit(getpid).result(WAIT)
        (slot,) = [s for s in pool._core.slots() if s.proc.pid == first]
        assert slot.state is State.READY and slot.said_ready
        # its second task is its last: it retires (takes no more work); a new one takes over
        assert pool.submit(getpid).result(WAIT) == first
        assert slot.state in (State.RETIRING, State.STOPPING, State.DEAD)
        assert slot.retiring or slot.stop_reason == "retired"
        with pytest.raises(IllegalMove, match="to ready"):
            slot.to(State.READY)  # a retired worker never works again
        assert pool.submit(getpid).result(WAIT) != first
    # stopped (retired, or at the shutdown) and reaped with the pool
    assert slot.state is State.DEAD and slot.died_in is State.STOPPING
    assert slot.stop_reason in ("retired", "shutdown")


def test_a_retired_worker_exits_once_it_answered_its_last_task(engine):
    # nothing else happens in the pool after the last answer: that answer alone must get the
    # retired process closed (it was left running until the pool's next event)
    with Pool(1, start_method="fork", max_tasks_per_worker=2) as pool:
        first = pool.submit(getpid).result(WAIT)
        assert pool.submit(getpid).result(WAIT) == first
        assert gone(first, 10.0), "the retired worker is still running"
        assert pool.submit(getpid).result(WAIT) != first


def test_a_crashed_workers_record_says_it_died_unasked(engine):
    with Pool(1, start_method="fork") as pool:
        pid = pool.submit(getpid).result(WAIT)
        (slot,) = [s for s in pool._core.slots() if s.proc.pid == pid]
        with pytest.raises(WorkerCrashed):
            pool.submit(kill_self_if, 1, {1}).result(WAIT)
        assert slot.state is State.DEAD and slot.died_in is State.READY
        assert slot.stop_reason is None  # no one asked it to stop: a crash
        assert pool.submit(identity, 3).result(WAIT) == 3


def test_a_core_is_registered_for_the_exit_hook_until_it_is_shut_down(engine):
    pool = Pool(1, start_method="fork")
    try:
        assert pool._core in _atexit._registered()
        assert pool.submit(identity, 1).result(WAIT) == 1
    finally:
        pool.shutdown()
    assert pool._core not in _atexit._registered()
    with Worker(start_method="fork") as w:
        assert w._core in _atexit._registered()
    assert w._core not in _atexit._registered()


def test_a_finalizer_that_unregisters_while_the_registry_is_read_does_not_deadlock():
    # The garbage collector may run a dropped supervisor's finalizer (which unregisters it) on
    # a thread that is in the middle of going through the registry. Made to happen here: a
    # collection at every allocation, whose callback unregisters an owner. In a child process
    # with a deadline: a lock taken twice by one thread would hang it.
    code = """
import gc
from framepipe.workers import _atexit

class Owner:
    def finish_at_exit(self): pass
    def stop_at_exit(self): pass

owners = [Owner() for _ in range(6)]
for o in owners:
    _atexit.register(o)
victims = owners[3:]
def unregister_one(phase, info):
    if phase == "start" and victims:
        _atexit.unregister(victims.pop())
gc.callbacks.append(unregister_one)
gc.set_threshold(1)
_atexit.unregister(owners[0])
left = _atexit._registered()
gc.set_threshold(700)
gc.callbacks.remove(unregister_one)
print(sorted(owners.index(o) for o in left), len(victims))
"""
    out = run_python("-c", code, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] == "[1, 2] 0", out.stdout
