"""Reads that spin before they sleep (framepipe._spin.SPIN): with a writer that answers
within microseconds they take every message in order on every path (blocking, timed, watched,
poll() first, bulk), and a reader whose writer is slow burns almost no CPU while it waits."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import sys
import time

import pytest
from _helpers import child_env, run_python, wait_until

from framepipe import _spin

TIMEOUT = 60.0  # a hang guard only
FORK = multiprocessing.get_context("fork")
SIZES = [0, 1, 64, 4095, 4096, 20_000, 70_000]  # 20 kB and up: the bulk channel of a pipe


def _echo(conn, rounds: int) -> None:
    for _ in range(rounds):
        conn.send_bytes(conn.recv_bytes())


def _send_late(conn, delays: list[float]) -> None:
    for d in delays:
        time.sleep(d)
        conn.send_bytes(b"late")


def _stop(proc) -> None:
    proc.join(TIMEOUT)
    if proc.is_alive():
        proc.kill()
        proc.join(TIMEOUT)


def _receive(conn, read: str) -> bytes:
    """The next message, read the way ``read`` names: a plain read, a timed one (also a
    watched one), or poll() with a timeout first, as stdlib code does."""
    if read == "blocking":
        return conn.recv_bytes()
    if read == "poll":
        assert conn.poll(TIMEOUT), "poll() timed out"
        return conn.recv_bytes()
    return conn.recv_bytes(timeout=TIMEOUT)


def _payload(i: int) -> bytes:
    n = SIZES[i % len(SIZES)]
    return (i.to_bytes(4, "little") * (n // 4 + 1))[:n]


@pytest.mark.parametrize("read", ["blocking", "timed", "watched", "poll"])
@pytest.mark.parametrize("duplex", [True, False], ids=["socketpair", "pipes"])
def test_quick_answers_arrive_whole_and_in_order(impl, no_leftover_processes, read, duplex):
    rounds = 3000
    if duplex:
        mine, theirs = impl.pipe(duplex=True)
        inbox, outbox = mine, mine
        child_args = (theirs, rounds)
        to_close = [theirs]
    else:
        inbox, their_out = impl.pipe(duplex=False)
        their_in, outbox = impl.pipe(duplex=False)
        # the child echoes from its inbox to its outbox: one duplex-like object over two pipes
        child_args = (_Joined(their_in, their_out), rounds)
        to_close = [their_in, their_out]
    proc = FORK.Process(target=_echo, args=child_args, daemon=True)
    proc.start()
    try:
        for c in to_close:
            c.close()
        if read == "watched":
            inbox.watch(proc)
        for i in range(rounds):
            sent = _payload(i)
            outbox.send_bytes(sent)
            got = _receive(inbox, read)
            assert got == sent, f"round {i}: {len(got)} bytes back for {len(sent)}"
    finally:
        _stop(proc)
        for c in {id(inbox): inbox, id(outbox): outbox}.values():
            c.close()
    assert proc.exitcode == 0


class _Joined:
    """A reader and a writer seen as one connection by _echo."""

    def __init__(self, reader, writer) -> None:
        self.recv_bytes = reader.recv_bytes
        self.send_bytes = writer.send_bytes


@pytest.mark.parametrize("read", ["blocking", "timed", "watched", "poll"])
@pytest.mark.parametrize("duplex", [True, False], ids=["socketpair", "pipe"])
def test_a_reader_waiting_for_a_slow_writer_burns_little_cpu(
    impl, no_leftover_processes, read, duplex
):
    # Quick answers first (the reader learns to spin), then five waits of 0.2 s: a spin is
    # bounded (50 us by default), so the waits cost the reader's thread almost no CPU time.
    # A reader that kept spinning would burn the whole second.
    r, w = impl.pipe(duplex=duplex)
    delays = [0.0] * 200 + [0.2] * 5
    proc = FORK.Process(target=_send_late, args=(w, delays), daemon=True)
    proc.start()
    try:
        w.close()
        if read == "watched":
            r.watch(proc)
        for _ in range(200):
            assert _receive(r, read) == b"late"
        cpu0, t0 = time.thread_time(), time.monotonic()
        for _ in range(5):
            assert _receive(r, read) == b"late"
        cpu, waited = time.thread_time() - cpu0, time.monotonic() - t0
    finally:
        _stop(proc)
        r.close()
    assert waited >= 0.9, f"the reads waited {waited:.3f} s, not the writer's 1 s"
    assert cpu < 0.1, f"{cpu * 1000:.1f} ms of CPU time in 1 s of waiting for a slow writer"


def _spin_setting(value: str | None) -> float:
    env = child_env()
    env.pop("FRAMEPIPE_SPIN_US", None)
    if value is not None:
        env["FRAMEPIPE_SPIN_US"] = value
    out = run_python("-c", "from framepipe._spin import SPIN; print(repr(SPIN))", env=env)
    assert out.returncode == 0, out.stderr
    return float(out.stdout)


@pytest.mark.parametrize(
    "value, seconds",
    [
        (None, 50e-6),
        ("0", 0.0),
        ("20", 20e-6),
        ("2.5", 2.5e-6),
        ("-3", 0.0),
        ("junk", 50e-6),
        ("nan", 50e-6),
    ],
)
def test_spin_is_set_by_the_environment(value, seconds):
    assert _spin_setting(value) == pytest.approx(seconds)


def _report_cpus(conn, cpu: int | None) -> None:
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    conn.send(_spin.several_cpus())


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity here")
def test_a_process_pinned_to_one_cpu_never_spins(no_leftover_processes):
    cpus = sorted(os.sched_getaffinity(0))
    answers = {}
    for pin in (None, cpus[0]):
        r, w = multiprocessing.Pipe(duplex=False)
        proc = FORK.Process(target=_report_cpus, args=(w, pin), daemon=True)
        proc.start()
        try:
            w.close()
            assert r.poll(TIMEOUT)
            answers[pin] = r.recv()
        finally:
            _stop(proc)
            r.close()
    assert answers[cpus[0]] is False
    assert answers[None] is (len(cpus) > 1)


def test_a_process_can_turn_the_spin_off():
    from framepipe._spin import allow_spin, may_spin, several_cpus

    try:
        allow_spin(False)
        assert may_spin() is False
        allow_spin(True)
        assert may_spin() is (several_cpus() and _spin.SPIN > 0)
    finally:
        allow_spin(True)


def test_each_engine_hears_allow_spin_at_once(impl):
    # The compiled engine keeps the decision's state in C: allow_spin() must reach it at once.
    import importlib

    from framepipe._spin import allow_spin, several_cpus

    engine = importlib.import_module(impl.Engine.__module__)
    try:
        allow_spin(False)
        assert engine._may_spin() is False
        allow_spin(True)
        assert engine._may_spin() is (several_cpus() and _spin.SPIN > 0)
        assert engine._spin_window_now() == _spin.SPIN
        allow_spin(True, 3e-3)
        assert engine._spin_window_now() == 3e-3
        allow_spin(True)
        assert engine._spin_window_now() == _spin.SPIN
    finally:
        allow_spin(True)


@pytest.mark.skipif(
    not (_spin.several_cpus() and _spin.SPIN > 0), reason="reads spin only with 2+ CPUs"
)
def test_a_longer_spin_window_keeps_a_reader_awake_for_a_writer_slower_than_spin(
    impl, no_leftover_processes
):
    # A writer that answers every millisecond: far longer than SPIN (50 us), so a reader with
    # the usual window sleeps in the kernel for nearly every message (a voluntary context switch
    # each; fewer only when the reader itself was kept off its CPU that long); with a window of
    # 20 ms (what SPIN_ALONE is for: a pool's worker waiting for its caller's next round trip)
    # the reader spins through them, sleeping only when the writer was kept off its CPU for
    # 20 ms. Counted, not timed: a reader that spins does not block, so its thread's voluntary
    # switches stay few.
    import resource

    from framepipe._spin import allow_spin

    def switches_over(rounds: int) -> int:
        r, w = impl.pipe(duplex=False)
        proc = FORK.Process(target=_send_late, args=(w, [1e-3] * rounds), daemon=True)
        proc.start()
        try:
            w.close()
            for _ in range(20):
                assert r.recv_bytes() == b"late"  # the average wait settles
            before = resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw
            for _ in range(rounds - 20):
                assert r.recv_bytes() == b"late"
            return resource.getrusage(resource.RUSAGE_THREAD).ru_nvcsw - before
        finally:
            _stop(proc)
            r.close()

    rounds = 120
    try:
        allow_spin(True)
        usual = switches_over(rounds)
        allow_spin(True, 20e-3)
        longer = switches_over(rounds)
    finally:
        allow_spin(True)
    assert usual >= (rounds - 20) * 0.6, f"{usual} sleeps in {rounds - 20} reads with SPIN"
    assert longer <= (rounds - 20) * 0.2, f"{longer} sleeps in {rounds - 20} reads, 20 ms window"


def test_a_reader_that_never_waits_keeps_its_average_wait_out_of_subnormal_numbers(impl):
    # Reads that find their message there count waits of 0. Without a floor the average
    # would shrink into subnormal numbers within a few thousand reads and stay there, where
    # every operation on it costs the CPU a hundred cycles or more.
    r, w = impl.pipe(False)
    try:
        for _ in range(100):
            for _ in range(200):
                w.send_bytes(b"x")
            for _ in range(200):
                assert r.recv_bytes() == b"x"
        assert r._waited == 0.0 or r._waited >= sys.float_info.min, r._waited
    finally:
        r.close()
        w.close()


def test_pool_workers_spin_only_when_they_leave_no_cpu_short(
    engine, no_leftover_processes, tmp_path, monkeypatch
):
    # A worker spinning for its next task would take a CPU that the parent, or a dying
    # worker's teardown, waits for: a pool whose workers and parent need more CPUs than there
    # are lets only as many of them spin as leave the parent a CPU (NOTE [ Which workers spin
    # ]), and the others only in round trips on an idle pool (NOTE [ Spinning while the pool is
    # idle ]): a task submitted while no worker has one in hand, after the caller read the last
    # answer itself, lets its worker spin, longer than a read usually does; a task submitted
    # while another is in hand sets every worker it reaches back.
    from _worker_tasks import may_spin, spin_state, spin_state_after, wait_for_file

    from framepipe.workers import Pool, WorkerCrashed, _slot

    # A worker whose task has run SLOW_HEAD is given nothing more: on a loaded machine the
    # worker holding the task that the others' wait behind would be passed over by them all.
    monkeypatch.setattr(_slot, "SLOW_HEAD", 3600.0)
    cpus = _spin.usable_cpus()
    spins = cpus >= 2 and _spin.SPIN > 0
    workers = cpus + 1
    with Pool(max_workers=workers) as pool:
        deadline = time.monotonic() + TIMEOUT
        while len(pool.pids) < workers:  # started as the first task comes
            assert time.monotonic() < deadline, pool.pids
            pool.submit(may_spin).result(TIMEOUT)
        slots = pool._core._slots
        assert [s.spins for s in slots] == [i < cpus - 1 for i in range(workers)]
        # spawned workers take a while to start: tasks held behind another reach them all
        # once they are ready (until then, only those that are)
        wait_until(lambda: all(s.usable for s in slots), "every worker ready", TIMEOUT)
        spinners = {s.proc.pid for s in slots if s.spins}

        def answers_behind(rounds: int) -> dict[int, set[tuple[bool, float]]]:
            """(may spin, window) as each worker reports it, from tasks submitted while
            another task is in hand: never sent ALONE. They are held too, so that they reach
            every worker (quick ones may all go to the same one, each answered before the next
            is sent, on a loaded machine)."""
            seen: dict[int, set[tuple[bool, float]]] = {}
            for k in range(rounds):
                release = tmp_path / f"release-{k}"
                held = pool.submit(wait_for_file, str(release))
                behind = [pool.submit(spin_state_after, str(release)) for _ in range(3 * workers)]
                release.touch()
                assert held.result(TIMEOUT) is True
                for pid, allowed, window in (f.result(TIMEOUT) for f in behind):
                    seen.setdefault(pid, set()).add((allowed, window))
                if len(seen) == workers:
                    break
            return seen

        seen = answers_behind(5)
        assert set(seen) == set(pool.pids), seen  # the spinners' answers and the others'
        for pid, states in seen.items():
            assert states == {(spins and pid in spinners, _spin.SPIN)}, (pid, states)
        # round trips on the idle pool go to its first worker, which spins, and longer
        trips = [pool.submit(spin_state).result(TIMEOUT) for _ in range(200)]
        if spins:
            assert any(allowed and window == _spin.SPIN_ALONE for _, allowed, window in trips)
            assert {pid for pid, _, _ in trips} & spinners, trips
        # tasks submitted a little apart, their answers waited for only at the end: the
        # manager reads them, so every task but the first goes with another in hand or after
        # the manager read the last answer, an idle pool or not
        spaced = []
        for _ in range(10):
            spaced.append(pool.submit(spin_state))
            time.sleep(0.005)
        for pid, allowed, _ in [f.result(TIMEOUT) for f in spaced][1:]:
            assert allowed is (spins and pid in spinners), (pid, allowed)

        # A spinner that dies is replaced by one that spins: the count stays.
        if spinners:
            victim = next(iter(spinners))
            os.kill(victim, signal.SIGKILL)
            deadline = time.monotonic() + TIMEOUT
            while victim in pool.pids or len(pool.pids) < workers:
                assert time.monotonic() < deadline, pool.pids
                with contextlib.suppress(WorkerCrashed):  # sent to the victim as it died
                    pool.submit(may_spin).result(TIMEOUT)
                time.sleep(0.01)
            live = [s for s in pool._core._slots if not s.dead]
            assert sum(s.spins for s in live) == cpus - 1
            assert live[-1].spins  # the replacement, last in the dispatch's order
            spinners = {s.proc.pid for s in live if s.spins}
            seen = answers_behind(5)
            for pid, states in seen.items():
                assert states == {(spins and pid in spinners, _spin.SPIN)}, (pid, states)
            # round trips now go first to a worker that does not spin otherwise: it spins in
            # them, the longer way
            trips = [pool.submit(spin_state).result(TIMEOUT) for _ in range(200)]
            assert any(
                allowed and window == _spin.SPIN_ALONE and pid not in spinners
                for pid, allowed, window in trips
            ), trips
    if spins:
        release = tmp_path / "release"
        release.touch()
        with Pool(max_workers=cpus - 1) as pool:
            held = pool.submit(wait_for_file, str(release))  # there already: returns at once
            behind = [pool.submit(may_spin) for _ in range(2 * cpus)]
            assert held.result(TIMEOUT) is True
            assert [f.result(TIMEOUT) for f in behind] == [True] * len(behind)
            # workers that fit spin as any reader does, round trips or not
            windows = {pool.submit(spin_state).result(TIMEOUT)[2] for _ in range(100)}
            assert windows == {_spin.SPIN}, windows


def test_loader_workers_spin_only_when_they_leave_no_cpu_short(engine, no_leftover_processes):
    from _worker_tasks import SpinDataset

    from framepipe.workers import DataLoader

    cpus = _spin.usable_cpus()
    loader = DataLoader(SpinDataset(), batch_size=None, num_workers=cpus)
    assert list(loader) == [False, False]
    if cpus >= 2 and _spin.SPIN > 0:
        loader = DataLoader(SpinDataset(), batch_size=None, num_workers=cpus - 1)
        assert list(loader) == [True, True]
