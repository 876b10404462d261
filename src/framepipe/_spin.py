"""How a read waits: the grace for a watched writer's death after end of file, and the spin
policy (when a read that finds nothing tries again without sleeping before it sleeps in the
kernel). Both engines read these settings; the compiled one keeps ``allow_spin``'s answer in C
(see ``on_allow_spin``), and a worker pool turns spinning off in workers that would crowd the
CPUs (see ``workers_may_spin`` and ``spinners``)."""

from __future__ import annotations

import os
from collections.abc import Callable

# At end of file on a watched connection, the writer's fds have closed; whether it died (so
# the error is WriterDied) shows a little later, when the kernel or the interpreter finishes
# the exit. Both engines wait for that up to DEATH_GRACE seconds, looking first without
# sleeping for DEATH_SPIN seconds: the death usually shows within microseconds of the end of
# file, and one more sleep and wake-up would cost more than that on a busy machine. The look
# stays short: a reader that keeps a CPU busy looking can keep the dying writer from finishing
# its exit on that CPU (measured on 2 CPUs: a 0.5 ms spin made the median death seen 1.3x
# later in one run of three, 50 us never did).
DEATH_GRACE = 1.0
DEATH_SPIN = 50e-6


def _spin_seconds() -> float:
    try:
        us = float(os.environ.get("FRAMEPIPE_SPIN_US", "50"))
    except ValueError:
        return 50e-6
    return max(us, 0.0) * 1e-6 if us == us else 50e-6


# A read that finds nothing to read tries again without sleeping for up to SPIN seconds before
# it sleeps in the kernel, when this process may run on more than one CPU and the reads of
# this connection have lately waited, on average, less than SPIN but not less than SPIN_FLOOR
# (the writer answers within microseconds, from another CPU): the bytes then arrive with no
# wake-up on either side, which on a VM costs several microseconds a hop. Reads whose writer
# takes longer, and processes pinned to one CPU (where spinning would only delay the writer),
# sleep at once. The environment variable FRAMEPIPE_SPIN_US sets SPIN in microseconds (0: never
# spin); it is read at import.
SPIN = _spin_seconds()
# The average is a moving one (each wait weighs SPIN_WEIGHT) of waits counted at most
# SPIN_LONGEST_SAMPLE: after a long sleep a few quick answers bring the spin back.
SPIN_WEIGHT = 0.125
SPIN_LONGEST_SAMPLE = 1e-3
# An average under SPIN_AVERAGE_ZERO is 0. A reader that never waits counts waits of 0, and the
# average would shrink into subnormal numbers and stay there (the smallest one times 7/8 rounds
# back to itself), where each arithmetic operation takes the CPU a hundred cycles or more: in
# the compiled engine that was most of a streaming read's own time.
SPIN_AVERAGE_ZERO = 1e-9
# Nor does a read spin while the average is under SPIN_FLOOR: then the writer is streaming
# faster than the reader needs to wait, and a reader that sleeps a little lets several messages
# pile up for it instead of contending with the writer for the pipe at every message (measured:
# a one-way stream of 64 B messages ran about 9% slower with a spin and no floor).
SPIN_FLOOR = 2e-6
# How often (in spin decisions) the CPUs this process may use are looked up again.
SPIN_CPU_CHECKS = 4096
# A pool's worker that was given a task ALONE (a caller's round trip on an idle pool: see
# NOTE [ Spinning while the pool is idle ] in workers/_submitting) spins for up to SPIN_ALONE
# instead, and while its reads have waited less than that on average: what it waits for is the
# caller's own Python between two round trips (reading the answer, pickling the next call),
# which on a slow CPU comes near SPIN. There a worker that stopped spinning made each round
# trip longer by its wake-up, so its waits grew and it never spun again: one process ran its
# round trips at 41-48 us, the next at 56-78 us. Measured on a 2-CPU VM, six processes with
# each window in turn (the workers' spin set from the environment; round trip medians of 2,000):
# 43-74 us (median 52) with SPIN, 32-43 us (median 40) with SPIN_ALONE. Set by a task in one
# pool, alternating, the two were alike in a fast phase (28-33 us) and beside 3 CPU hogs.
SPIN_ALONE = 4.0 * SPIN


def next_average(average: float, waited: float) -> float:
    """The moving average of a reader's waits (see SPIN_WEIGHT) after one of ``waited``
    seconds, counted up to SPIN_LONGEST_SAMPLE, and 0 under SPIN_AVERAGE_ZERO."""
    average += (min(waited, SPIN_LONGEST_SAMPLE) - average) * SPIN_WEIGHT
    return average if average >= SPIN_AVERAGE_ZERO else 0.0


def usable_cpus() -> int:
    """How many CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def several_cpus() -> bool:
    """Whether this process may run on more than one CPU (spinning can pay)."""
    return usable_cpus() > 1


_spin_cpus = False
_spin_checks = 0  # decisions left before the next look-up
_spin_allowed = True
_spin_window = SPIN  # the longest spin now (see SPIN_ALONE)


_spin_listeners: list[Callable[[bool, float], None]] = []


def on_allow_spin(listener: Callable[[bool, float], None]) -> None:
    """Call ``listener(allowed, window)`` now and on every allow_spin() (the compiled engine
    keeps the answer where its reads look it up without a call into Python)."""
    _spin_listeners.append(listener)
    listener(_spin_allowed, _spin_window)


def allow_spin(allowed: bool, window: float | None = None) -> None:
    """Let this process's reads spin (the default), or not. A worker pool turns it off in its
    workers when they and the parent would need more CPUs than there are: a worker spinning for
    its next task takes a CPU the parent, or a dying worker's teardown, is waiting for.
    ``window`` is the longest spin from now on (SPIN when not given; see SPIN_ALONE)."""
    global _spin_allowed, _spin_window
    _spin_allowed = allowed
    _spin_window = SPIN if window is None else window
    for listener in _spin_listeners:
        listener(allowed, _spin_window)


def spin_window() -> float:
    """The longest spin of a read now, in seconds: SPIN, or what allow_spin() set."""
    return _spin_window


def workers_may_spin(workers: int) -> bool:
    """Whether ``workers`` worker processes and this one fit on this process's CPUs: a loader
    lets its workers spin (see allow_spin) only then."""
    return workers <= spinners()


def spinners() -> int:
    """How many of a pool's workers may spin: as many as leave this process a CPU. A pool of
    more workers lets its first ones spin (a replacement takes the place of one that died), and
    its dispatch, which gives a task to the first idle worker, hands most small tasks to them."""
    return usable_cpus() - 1


def may_spin() -> bool:
    """Whether a read of either engine may spin: SPIN is on, the process allows it (see
    allow_spin) and may run on more than one CPU (looked up again every SPIN_CPU_CHECKS calls,
    and first thing after a fork)."""
    global _spin_cpus, _spin_checks
    if SPIN <= 0.0 or not _spin_allowed:
        return False
    _spin_checks -= 1
    if _spin_checks < 0:
        _spin_checks = SPIN_CPU_CHECKS
        _spin_cpus = several_cpus()
    return _spin_cpus


def _look_again_after_fork() -> None:
    global _spin_checks
    _spin_checks = 0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_look_again_after_fork)
