"""Pool behaves as ProcessPoolExecutor where code written for it can tell: its errors are also
the stdlib's, it keeps no reference to a task's objects, ``cancel_futures`` cancels what no
worker was handed, and a forked worker holds no descriptor of the parent's (so a
``subprocess.Popen`` started next to a pool never waits for it)."""

from __future__ import annotations

import concurrent.futures as cf
import gc
import os
import pickle
import select
import socket
import subprocess
import sys
import threading
import time
import weakref
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import _compat_tasks
import pytest
from _compat_tasks import (
    ExitsOnLoad,
    LoadsBadly,
    NeedsAMissingModule,
    Payload,
    exit_hard,
    exit_with,
    fail_init,
    make_bad_result,
    make_exit_on_result,
    make_lock,
    make_payload,
    nap,
    nap_and_mark,
    open_fds,
    read_shared,
    size_of,
)

from framepipe.workers import (
    Pool,
    PoolBroken,
    TaskExit,
    TaskPicklingError,
    TaskUnpicklingError,
    Worker,
    WorkerCrashed,
    WorkerError,
)

WAIT = 60  # a hang guard only


pytestmark = pytest.mark.usefixtures("no_leftover_processes")


def _collected(ref: weakref.ref[object]) -> bool:
    gc.collect()
    return ref() is None


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_crash_is_a_broken_process_pool_and_the_pool_goes_on(engine, method):
    with Pool(2, start_method=method) as pool:
        with pytest.raises(BrokenProcessPool) as info:
            pool.submit(exit_hard, 3).result(WAIT)
        assert isinstance(info.value, WorkerCrashed) and info.value.exitcode == 3
        assert isinstance(info.value, cf.BrokenExecutor)
        assert pool.submit(size_of, Payload(5)).result(WAIT) == 5  # not broken
    with Pool(1, start_method=method, initializer=fail_init) as pool:
        with pytest.raises(BrokenProcessPool) as broken:
            pool.submit(size_of, Payload(1)).result(WAIT)
        assert isinstance(broken.value, PoolBroken)
        with pytest.raises(BrokenProcessPool):
            pool.submit(size_of, Payload(1))


def test_what_cannot_be_pickled_is_a_pickling_error(engine):
    lock = threading.Lock()
    with Pool(2, start_method="fork") as pool:
        for fut in (pool.submit(size_of, lock), pool.submit(make_lock)):
            with pytest.raises(pickle.PicklingError) as info:
                fut.result(WAIT)
            assert isinstance(info.value, TaskPicklingError)
            assert isinstance(info.value, TypeError)  # as before: what cannot be sent
            assert info.value.__cause__ is not None
        items = pool.map(size_of, [Payload(1), lock, Payload(3)])
        assert next(items) == 1
        with pytest.raises(pickle.PicklingError):
            next(items)
        assert pool.submit(size_of, Payload(7)).result(WAIT) == 7


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_what_cannot_be_unpickled_fails_its_task_as_a_broken_pool(engine, method):
    with Pool(2, start_method=method) as pool:
        with pytest.raises(BrokenProcessPool) as info:  # in the worker
            pool.submit(size_of, LoadsBadly()).result(WAIT)
        assert isinstance(info.value, TaskUnpicklingError)
        assert isinstance(info.value.__cause__, KeyError)
        # raised as the argument was rebuilt: said so, not blamed on an import
        assert "KeyError" in str(info.value) and "__reduce__" in str(info.value)
        assert "importable" not in str(info.value)
        with pytest.raises(TaskUnpicklingError, match="must be importable in the worker"):
            pool.submit(size_of, NeedsAMissingModule()).result(WAIT)
        with pytest.raises(BrokenProcessPool) as back:  # in this process
            pool.submit(make_bad_result).result(WAIT)
        assert isinstance(back.value, TaskUnpicklingError)
        with pytest.raises(BrokenProcessPool) as died:  # the worker exits as it unpickles
            pool.submit(size_of, ExitsOnLoad()).result(WAIT)
        assert isinstance(died.value, WorkerCrashed) and died.value.exitcode == 1
        assert pool.submit(size_of, Payload(2)).result(WAIT) == 2  # the pool goes on


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_task_sys_exit_is_a_system_exit_of_the_pool_only(engine, method):
    with Pool(1, start_method=method) as pool:
        with pytest.raises(SystemExit) as info:
            pool.submit(exit_with, 3).result(WAIT)
        assert info.value.code == 3
        assert isinstance(info.value, TaskExit) and isinstance(info.value, Exception)
        assert isinstance(info.value.__cause__, SystemExit)
        with pytest.raises(SystemExit) as again:
            pool.submit(make_exit_on_result).result(WAIT)  # raised while its result pickles
        assert again.value.code == 1
        pid = pool.submit(os.getpid).result(WAIT)
        assert pool.submit(os.getpid).result(WAIT) == pid  # the worker went on
    with Worker(start_method=method) as w:  # an actor's call never ends its caller
        with pytest.raises(WorkerError) as err:
            w.call(exit_with, 3)
        assert not isinstance(err.value, SystemExit)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_no_reference_kept_to_a_task_callable_arguments_or_results(engine, method):
    with Pool(2, start_method=method) as pool:
        # a bound method (its instance), submitted and its future dropped
        obj = Payload(4)
        ref = weakref.ref(obj)
        pool.submit(obj.method).result(WAIT)
        del obj
        assert _collected(ref)
        # the arguments, while the done future is still held
        arg = Payload(9)
        ref = weakref.ref(arg)
        fut = pool.submit(size_of, arg)
        assert fut.result(WAIT) == 9
        del arg
        assert _collected(ref)
        # each result handed out by the iterators: not held by them
        for it in (
            pool.map(make_payload, range(6)),
            pool.map(make_payload, range(6), chunksize=4),
            pool.map(make_payload, range(6), buffersize=2),
            pool.imap(make_payload, range(6)),
            pool.imap_unordered(make_payload, range(6)),
        ):
            for out in it:
                ref = weakref.ref(out)
                del out
                assert _collected(ref)
        # the items a lazy map took: let go of once sent
        refs = []

        def items():
            for n in (1, 2, 3):
                item = Payload(n)
                refs.append(weakref.ref(item))
                yield item

        lazy = pool.imap(size_of, items(), buffersize=3)
        assert next(lazy) == 1
        assert _collected(refs[0])
        assert list(lazy) == [2, 3]
        assert all(_collected(r) for r in refs)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_cancel_futures_cancels_exactly_what_no_worker_was_handed(engine, method, tmp_path):
    for warm in (False, True):
        ran = tmp_path / f"ran-{warm}.txt"
        pool = Pool(2, start_method=method)
        try:
            if warm:
                pool.submit(nap, 0).result(WAIT)
            fs = [pool.submit(nap_and_mark, str(ran), i, 0.2) for i in range(50)]
            pool.shutdown(wait=True, cancel_futures=True)
            kept = [i for i, f in enumerate(fs) if not f.cancelled()]
            # what a worker had (or, still starting, was sure to run next) ran, once each;
            # nothing cancelled ran
            assert all(fs[i].result(0) == i for i in kept)
            runs = sorted(int(line) for line in ran.read_text().split()) if kept else []
            assert runs == kept
            assert kept and len(kept) < 50  # some ran, the rest was cancelled
            assert kept == list(range(len(kept)))  # in the order they came
        finally:
            pool.shutdown(wait=True)


def _popen_waits_for_a_fork_pool() -> bool:
    """Start a fork pool, then at once a Popen in this thread: whether the Popen waited for
    the pool (it reads its exec-error pipe to the end, which a process holding a copy of the
    pipe delays until that process ends; the pool is ended after 20 s to let it go on)."""
    pool = Pool(2, start_method="fork")
    ended = threading.Event()

    def end() -> None:
        ended.set()
        pool.terminate()

    timer = threading.Timer(20, end)
    timer.start()
    try:
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        returned = not ended.is_set()
        assert proc.wait(WAIT) == 0
        return not returned
    finally:
        timer.cancel()
        pool.terminate()


def test_a_popen_next_to_a_fork_pool_never_waits_for_it(engine):
    waited = sum(_popen_waits_for_a_fork_pool() for _ in range(20))
    assert waited == 0, f"{waited} of 20 Popen calls waited for the pool"


def test_a_forked_worker_holds_no_pipe_or_socket_of_the_parent(engine, tmp_path):
    path = tmp_path / "shared.txt"
    path.write_text("read in the worker")
    r, w = os.pipe()
    a, b = socket.socketpair()
    _compat_tasks.SHARED = open(path)  # noqa: SIM115 - closed below
    try:
        with Pool(2, start_method="fork") as pool:
            pool.submit(os.getpid).result(WAIT)  # both workers forked by now (or soon)
            seen = pool.submit(open_fds).result(WAIT)
            # the program's regular file is still there: a task may read it
            assert pool.submit(read_shared).result(WAIT) == "read in the worker"
            assert str(path) in seen
            # its pipe and socket are not held: closed here, their other ends see the end
            os.close(w)
            w = -1
            b.close()
            assert _both_ready(r, a)
            assert os.read(r, 1) == b"" and a.recv(1) == b""
    finally:
        _compat_tasks.SHARED.close()
        _compat_tasks.SHARED = None
        os.close(r)
        if w >= 0:
            os.close(w)
        a.close()
        b.close()


def _both_ready(r: int, a: socket.socket) -> bool:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        if len(select.select([r, a], [], [], 0.1)[0]) == 2:
            return True
    return False


def test_a_replacement_worker_forked_later_holds_no_pipe_opened_meanwhile(engine):
    # a replacement worker is forked from the pool's own thread, after this thread opened
    # the pipe: it does not hold it either
    with Pool(1, start_method="fork", max_tasks_per_worker=1) as pool:
        first = pool.submit(os.getpid).result(WAIT)
        r, w = os.pipe()
        try:
            assert pool.submit(os.getpid).result(WAIT) != first  # a new worker
            os.close(w)
            w = -1
            ready, _, _ = select.select([r], [], [], WAIT)
            assert ready == [r] and os.read(r, 1) == b""
        finally:
            os.close(r)
            if w >= 0:
                os.close(w)


def test_cpython_executor_suite_runs_against_pool():
    """A few of CPython's own executor tests, through the tool CI runs them all with (fork and
    spawn): the adapter still builds a Pool the tests accept."""
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the adapted suite is CPython 3.11's")
    tool = Path(__file__).resolve().parents[1] / "tools" / "cpython_executor_suite.py"
    proc = subprocess.run(
        [sys.executable, str(tool), "-k", "ProcessPoolExecutorTest.test_submit"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if "is not installed" in proc.stdout:
        pytest.skip("test_concurrent_futures.py is not installed (libpython3.11-testsuite)")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "framepipe: 4 passed, 0 failed, 0 skipped of 4" in proc.stdout, proc.stdout
