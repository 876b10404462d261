"""The pool's futures: concurrent.futures.Future whose condition is made on first use (see NOTE
[ A future's condition, made on first use ] in framepipe.workers._tasks). Every way a thread
can wait on one, or be told of its end, against the state changes a pool makes, racing."""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time

import pytest

from framepipe.workers._tasks import _Future

ROUNDS = 2000
GUARD = 30.0  # a hang guard only: a lost wake-up would wait this long and fail


def test_it_sets_every_field_a_concurrent_futures_future_has():
    plain, ours = cf.Future(), _Future()
    assert set(vars(plain)) - {"_condition"} <= set(vars(ours))
    cond = ours._condition
    assert isinstance(cond, type(plain._condition)) and ours._condition is cond
    assert ours._state == plain._state and ours._result is None and ours._exception is None


def test_the_state_changes_refuse_what_concurrent_futures_refuses():
    fut = _Future()
    assert fut.set_running_or_notify_cancel() is True
    fut.set_result(1)
    with pytest.raises(cf.InvalidStateError):
        fut.set_result(2)
    assert fut.result() == 1 and fut.done() and not fut.cancelled()
    cancelled = _Future()
    assert cancelled.cancel() is True
    assert cancelled.set_running_or_notify_cancel() is False
    with pytest.raises(cf.InvalidStateError):
        cancelled.set_result(3)
    with pytest.raises(cf.CancelledError):
        cancelled.result(0)


def _waited_on(fut) -> bool:
    """Whether a thread now waits on ``fut`` (in result(), wait(), as_completed()) or added a
    callback to it."""
    cond = fut._made
    return cond is not None and bool(cond._waiters or fut._waiters or fut._done_callbacks)


@pytest.fixture(params=["racing", "waiting"])
def race(request):
    """Run a setter here and a waiter in a thread, ROUNDS times, each round with a new future:
    released together ("racing"), or the setter only once the waiter waits ("waiting").
    Returns what the waiter returned, round by round."""
    first = request.param == "waiting"

    def run(setter, waiter):
        out: list = []
        for i in range(ROUNDS if not first else ROUNDS // 10):
            fut = _Future()
            gate = threading.Barrier(2)

            def wait(fut=fut, gate=gate):
                gate.wait(GUARD)
                out.append(waiter(fut))

            t = threading.Thread(target=wait)
            t.start()
            gate.wait(GUARD)
            if first:
                while not _waited_on(fut) and t.is_alive():
                    time.sleep(1e-4)
            setter(fut)
            t.join(GUARD)
            assert not t.is_alive(), "a waiter was never woken"
            assert len(out) == i + 1, "the waiter raised (see the thread's exception above)"
        return out

    return run


def _run_and_set(fut):
    assert fut.set_running_or_notify_cancel()
    fut.set_result("done")


def test_a_thread_waiting_in_result_is_woken_however_the_result_races_it(race):
    got = race(_run_and_set, lambda fut: cf.Future.result(fut, GUARD))
    assert got and got == ["done"] * len(got)


def test_wait_and_as_completed_see_every_result_that_races_them(race):
    def waiter(fut):
        done, _ = cf.wait([fut, _done_future()], timeout=GUARD)
        return len(done)

    got = race(_run_and_set, waiter)
    assert got and got == [2] * len(got)
    got = race(_run_and_set, lambda f: len(list(cf.as_completed([f], GUARD))))
    assert got and got == [1] * len(got)


def test_a_callback_added_while_the_result_is_set_runs_once(race):
    calls: list = []
    rounds = len(race(_run_and_set, lambda fut: fut.add_done_callback(calls.append)))
    assert rounds and len(calls) == rounds and all(f.result() == "done" for f in calls)


def test_cancel_racing_the_start_of_a_task_has_one_winner(race):
    started: list = []
    cancelled = race(
        lambda fut: started.append(fut.set_running_or_notify_cancel()), lambda fut: fut.cancel()
    )
    assert cancelled and len(started) == len(cancelled)
    assert all(s != c for s, c in zip(started, cancelled)), "both or neither won"


def _done_future() -> _Future:
    fut = _Future()
    fut.set_running_or_notify_cancel()
    fut.set_result(None)
    return fut
