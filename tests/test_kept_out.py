"""A worker's channel kept out of the manager's fd set between round trips (see NOTE [ A
channel kept out ] in framepipe.workers._lending): every way of waiting for a task sent to
such a worker still gets its answer, on both engines, with real worker processes.

``no_net`` stops the manager's periodic look (it wakes every RSS_PERIOD while a worker holds
a task, and puts back a channel kept out that holds one): with it, a way of waiting that
forgot to ask for the channel back hangs, and the test fails at its guard."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf
import os
import select
import signal
import threading

import pytest
from _helpers import Background, eventually
from _worker_tasks import add, getpid, sleep_for, sleep_then_die, square

from framepipe.workers import (
    Pool,
    Worker,
    WorkerCancelled,
    WorkerCrashed,
    _dispatch,
    _scheduling,
)

GUARD = 20.0  # a hang guard only


@pytest.fixture
def no_net(monkeypatch):
    monkeypatch.setattr(_dispatch, "RSS_PERIOD", 3600.0)  # its periodic look
    monkeypatch.setattr(_scheduling, "RSS_PERIOD", 3600.0)  # and the wake-up for a new one


def _in_set(pool, slot) -> bool:
    """Whether ``slot``'s data fd is in the manager's epoll set (a modify to the same mask
    changes nothing, and fails for an fd that is not there)."""
    core = pool._core
    with core._ep_lock:
        try:
            core._poller._ep.modify(slot.proc.conn.fileno(), select.EPOLLIN | select.EPOLLPRI)
        except FileNotFoundError:
            return False
    return True


def _kept_out_after_calls(w):
    assert w.call(add, 0, 0) == 0  # its worker is up
    (slot,) = w._core.slots()
    for i in range(500):
        assert w.call(add, i, 1) == i + 1
        if slot.kept_out:
            break
    assert slot.kept_out


def _kept_out_after_round_trips(pool):
    """Round trips on a one-worker pool until its channel is kept out after one (it is not
    when the manager read that answer first, which it may while it is awake)."""
    assert pool.submit(add, 0, 0).result(GUARD) == 0  # its worker is up
    (slot,) = pool._core.slots()
    for i in range(500):
        assert pool.submit(add, i, 1).result(GUARD) == i + 1
        if slot.kept_out:
            break
    assert slot.kept_out and not slot.lent
    assert not _in_set(pool, slot)
    return slot


def test_a_round_trip_keeps_the_channel_out_and_a_queued_batch_puts_it_back(engine):
    with Pool(1, start_method="fork") as pool:
        slot = _kept_out_after_round_trips(pool)
        assert pool.submit(add, 5, 5).result(GUARD) == 10  # lent again (no fd to take out)
        # tasks sent from the queue are read by the manager: the channel goes back
        assert list(pool.map(square, range(200))) == [x * x for x in range(200)]
        assert not slot.kept_out and _in_set(pool, slot)
        assert _kept_out_after_round_trips(pool) is slot


def test_tasks_queued_behind_a_kept_out_channel_go_out_without_the_periodic_look(engine, no_net):
    # Sent directly while nothing is queued, tasks go to the worker whose channel stays out;
    # once it holds LOW_WATER of them the rest are queued, to be handed out as its answers
    # are read: the manager must read them, though nobody waits for the tasks it holds.
    with Pool(1, start_method="fork") as pool:
        _kept_out_after_round_trips(pool)
        futures = [pool.submit(add, i, 1) for i in range(_scheduling.LOW_WATER + 4)]
        assert futures[-1].result(GUARD) == len(futures)
        assert [f.result(GUARD) for f in futures] == [i + 1 for i in range(len(futures))]


WAYS = [
    "wait",
    "as_completed",
    "callback",
    "asyncio",
    "done",
    "exception",
    "another_thread",
    "acall",
]


@pytest.mark.parametrize("how", WAYS)
def test_every_way_of_waiting_gets_the_answer_of_a_kept_out_channel(engine, no_net, how):
    with Pool(1, start_method="fork") as pool:
        slot = _kept_out_after_round_trips(pool)
        if how == "acall":

            async def call():
                return await asyncio.wait_for(pool.acall(add, 2, 3), GUARD)

            assert asyncio.run(call()) == 5
            return
        for _ in range(20):
            fut = pool.submit(add, 2, 3)
            if fut._slot is slot and slot.kept_out:
                break  # sent to it, and nothing read it yet
            # the manager took the channel back between the two (its timers may run then):
            # the case is not made; make it again
            assert fut.result(GUARD) == 5
            slot = _kept_out_after_round_trips(pool)
        else:
            pytest.fail("a task never went to a kept-out channel in 20 tries")
        if how == "wait":
            done, _ = cf.wait([fut], GUARD)
            assert fut in done
        elif how == "as_completed":
            assert list(cf.as_completed([fut], GUARD)) == [fut]
        elif how == "callback":
            called = threading.Event()
            fut.add_done_callback(lambda f: called.set())
            assert called.wait(GUARD)
        elif how == "asyncio":

            async def main():
                return await asyncio.wait_for(asyncio.wrap_future(fut), GUARD)

            assert asyncio.run(main()) == 5
        elif how == "done":
            assert eventually(fut.done, GUARD)
        elif how == "exception":
            assert fut.exception(GUARD) is None
        else:
            assert Background(fut.result, GUARD).join() == 5
        assert fut.result(0) == 5


def test_a_map_and_imap_unordered_after_round_trips(engine, no_net):
    with Pool(1, start_method="fork") as pool:
        _kept_out_after_round_trips(pool)
        assert sorted(pool.imap_unordered(square, range(50))) == [x * x for x in range(50)]
        _kept_out_after_round_trips(pool)
        assert list(pool.imap(square, range(50))) == [x * x for x in range(50)]


def test_a_worker_past_max_rss_is_replaced_while_the_pool_is_idle(engine, no_net):
    # its RECYCLE comes after its answer: that channel is never kept out, so the manager
    # reads it without a caller or a new task, and replaces the worker at once
    from _worker_tasks import hold_memory

    with Pool(1, start_method="fork", max_rss=200 << 20) as pool:
        for i in range(20):
            assert pool.submit(add, i, 1).result(GUARD) == i + 1
            assert not any(s.kept_out for s in pool._core.slots())
        first = pool.submit(hold_memory, 300 << 20).result(GUARD)
        assert eventually(lambda: pool.pids and first not in pool.pids, GUARD)
        assert pool.submit(getpid).result(GUARD) != first


def test_a_future_nobody_looks_at_completes_all_the_same(engine):
    # no caller reads it and nothing asks for the channel back: the manager's periodic look
    # puts it back (only its state is read here, which asks nothing)
    with Pool(1, start_method="fork") as pool:
        slot = _kept_out_after_round_trips(pool)
        fut = pool.submit(add, 1, 2)
        assert eventually(lambda: fut._state == "FINISHED", GUARD)
        # Mostly put back, but not always: an event the manager took for this channel before
        # the last caller was lent it may be acted on only now, and the manager then reads the
        # new answer without putting the channel back (which may stay out: its worker holds
        # nothing). Either way the manager's set agrees with the slot.
        assert slot.kept_out != _in_set(pool, slot)
        assert fut.result(0) == 3


def test_shutdown_reads_the_answers_of_a_kept_out_channel(engine, no_net):
    pool = Pool(1, start_method="fork")
    try:
        _kept_out_after_round_trips(pool)
        fut = pool.submit(sleep_for, 0.05)
        Background(pool.shutdown, True).join()
        assert fut._state == "FINISHED" and fut.result(0) == 0.05
    finally:
        pool.terminate()


def test_a_task_with_a_deadline_puts_the_channel_back_as_it_is_sent(engine, no_net):
    with Pool(1, start_method="fork") as pool:
        slot = _kept_out_after_round_trips(pool)
        pool._core.task_timeout = GUARD  # (what task_timeout= sets)
        fut = pool.submit(sleep_for, 0.05)
        assert not slot.kept_out and _in_set(pool, slot)  # its deadline is the manager's
        done, _ = cf.wait([fut], GUARD)
        assert fut in done and fut.result(0) == 0.05


def test_a_stream_after_round_trips(engine, no_net):
    from _worker_tasks import count_up

    with Worker(start_method="fork") as w:
        _kept_out_after_calls(w)
        assert list(w.stream(count_up, 20)) == list(range(20))
        assert w.call(add, 1, 1) == 2


def test_a_cancel_reads_the_answer_of_a_kept_out_channel(engine, no_net):
    with Worker(start_method="fork") as w:
        _kept_out_after_calls(w)
        running = w.submit(sleep_for, 30)
        assert w.cancel() == 1
        # nothing here looks at the future: the cancel asked for the channel back
        assert eventually(lambda: running._state == "FINISHED", GUARD)
        with pytest.raises(WorkerCancelled):
            running.result(0)
        assert w.call(add, 2, 2) == 4


def test_the_death_of_a_worker_whose_channel_is_kept_out(engine, no_net):
    with Pool(1, start_method="fork", max_restarts=None) as pool:
        _kept_out_after_round_trips(pool)
        (first,) = pool.pids
        os.kill(first, signal.SIGKILL)  # idle: its pidfd tells the manager
        assert eventually(lambda: pool.pids and pool.pids != [first], GUARD)
        slot = _kept_out_after_round_trips(pool)
        (second,) = pool.pids
        fut = pool.submit(sleep_then_die, 0.05)  # dies with a task, waited on by cf.wait
        done, _ = cf.wait([fut], GUARD)
        assert fut in done
        with pytest.raises(WorkerCrashed) as info:
            fut.result(0)
        assert info.value.pid == second and slot.dead
        assert pool.submit(add, 1, 1).result(GUARD) == 2
