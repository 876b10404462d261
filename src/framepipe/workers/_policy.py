"""What differs between the worker classes, asked of one object instead of tested by name.

Every supervisor of worker processes asks its policy where the classes differ: the dispatch
core under :class:`~framepipe.workers.Worker` (an actor: one process whose state the calls
build on) and :class:`~framepipe.workers.Pool` (an Executor: workers that hold no state of the
caller's), the loader's workers (:class:`~framepipe.workers.DataLoader`) and a group's ranks
(:class:`~framepipe.workers.WorkerGroup`):

===========================  =====================================  ===========================
question                     PoolPolicy                             ActorPolicy
===========================  =====================================  ===========================
what a crash fails           the running task only; it may run      every call queued, and the
                             again (``max_task_crashes``, NOTE      calls made until a caller
                             [ Crashes blamed on tasks ]); the      is handed the crash (NOTE
                             rest run on the other workers          [an actor's crash])
when a worker is replaced    at once: the pool stays at strength    when a call waits for one
whether the core may break   on a crash loop (``max_restarts``)     never by crashes
feeding (NOTE [ Feeding      nothing more behind a task that runs   one worker: nothing to
ahead and balance ])         long; idle workers take over what      balance
                             others have not started
``shutdown(cancel_futures)`` each idle worker keeps its next task   every queued call cancelled
at interpreter exit          the tasks it was given finish first    its process is stopped
errors                       as an Executor's (``PoolBroken``, a    as the call raised them
                             ``BrokenExecutor``)
===========================  =====================================  ===========================

===========================  =====================================  ===========================
question                     LoaderPolicy                           GroupPolicy
===========================  =====================================  ===========================
what a crash fails           the loader (``WorkerCrashed`` from     the group: every rank is
                             ``next()``), unless the batch may      stopped (``GroupFailed``);
                             run again (``worker_crash_retries``)   torchrun's agent may start
                                                                    the group again
when a worker is replaced    at once, in the dead one's place,      never: the group is started
                             given every batch it held              again as a whole, or not
feeding                      round robin, torch's order; never      one entry point per rank
                             moved (a seed reproduces an epoch)
at interpreter exit          batches nobody will take are dropped   its ranks are stopped
===========================  =====================================  ===========================
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from .._args import check_int, check_seconds
from .errors import PoolBroken

__all__ = ["ActorPolicy", "GroupPolicy", "LoaderPolicy", "Policy", "PoolPolicy"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """The answers the core asks for; a subclass per kind of worker class."""

    # How a refusal names the class ("a Pool", "a Worker").
    label: ClassVar[str]
    # Errors are an Executor's: a task's error revived as concurrent.futures gives it, a broken
    # core raises PoolBroken (a BrokenExecutor) with the reason as its cause.
    executor: ClassVar[bool] = False
    # A crash fails every call queued and those made until a caller is handed it, instead of
    # the running task only (see NOTE [an actor's crash]).
    crash_fails_queued: ClassVar[bool] = False
    # A worker is started when a call waits for one, not kept running at strength.
    starts_on_call: ClassVar[bool] = False
    # The balance rules of NOTE [ Feeding ahead and balance ]: nothing more is queued behind a
    # task that runs long, and idle workers take over the tasks others have not started.
    balances: ClassVar[bool] = False
    # At interpreter exit the tasks it was given are finished before its workers stop.
    finishes_at_exit: ClassVar[bool] = False
    # A crash that is not run again ends the whole: every worker is stopped and the error is
    # the caller's (a loader's epoch, a group), instead of failing the one task or call.
    crash_stops_all: ClassVar[bool] = False

    # The crash loop that breaks the core: more than max_restarts workers dying in a row within
    # restart_window seconds with no task finished between them (None: never).
    max_restarts: int | None = None
    restart_window: float = 60.0
    # The workers a task may kill before it fails (see NOTE [ Crashes blamed on tasks ]).
    max_task_crashes: int = 1

    def __post_init__(self) -> None:
        check_int("max_restarts", self.max_restarts, 0, none_ok=True)
        check_int(
            "max_task_crashes",
            self.max_task_crashes,
            why="the workers a task may kill before it fails",
        )
        check_seconds("restart_window", self.restart_window, none_ok=False)

    def crash_loop(self, crashes_in_a_row: int) -> bool:
        """Whether that many crashes in a row break the core."""
        return self.max_restarts is not None and crashes_in_a_row > self.max_restarts

    def retries(self, crashes: int) -> bool:
        """Whether a task that killed ``crashes`` workers runs again (on another worker)."""
        return crashes < self.max_task_crashes

    def replacements(self, need: int, calls_waiting: bool, any_running: bool) -> int:
        """How many workers to start when ``need`` are missing."""
        return max(0, need)

    def broken(self, name: str, exc: BaseException) -> BaseException:
        """The error the core raises from now on, broken by ``exc``."""
        return exc

    def kept_at_cancel(self, idle_workers: int) -> int:
        """How many of the queued tasks ``shutdown(cancel_futures=True)`` leaves to run."""
        return 0


@dataclasses.dataclass(frozen=True)
class PoolPolicy(Policy):
    """A pool of interchangeable workers (:class:`~framepipe.workers.Pool`)."""

    label: ClassVar[str] = "a Pool"
    executor: ClassVar[bool] = True
    balances: ClassVar[bool] = True
    finishes_at_exit: ClassVar[bool] = True

    def broken(self, name: str, exc: BaseException) -> BaseException:
        if isinstance(exc, PoolBroken):
            return exc
        # An Executor that cannot go on raises BrokenExecutor (as ProcessPoolExecutor's
        # BrokenProcessPool), the reason as its cause (its first line: the rest of it is shown
        # once, as the cause).
        broken = PoolBroken(f"{name} is broken: {str(exc).partition(chr(10))[0]}")
        broken.__cause__ = exc
        return broken

    def kept_at_cancel(self, idle_workers: int) -> int:
        # The next task of each worker with nothing in hand (still starting, or idle): it has
        # it as good as handed, as ProcessPoolExecutor's workers have the tasks of its call
        # queue, which fills before they start.
        return idle_workers


@dataclasses.dataclass(frozen=True)
class ActorPolicy(Policy):
    """One process whose state the calls build on (:class:`~framepipe.workers.Worker`)."""

    label: ClassVar[str] = "a Worker"
    crash_fails_queued: ClassVar[bool] = True
    starts_on_call: ClassVar[bool] = True

    def retries(self, crashes: int) -> bool:
        return False  # the state it ran against is gone

    def replacements(self, need: int, calls_waiting: bool, any_running: bool) -> int:
        # restarted for the next call, not at once (its old process may still be stopping)
        if not calls_waiting and any_running:
            return 0
        return max(0, need)


@dataclasses.dataclass(frozen=True)
class LoaderPolicy(Policy):
    """The workers of a :class:`~framepipe.workers.DataLoader`: a batch whose worker died runs
    again on a fresh worker in its place ``worker_crash_retries`` times
    (``max_task_crashes = worker_crash_retries + 1``), and any other crash ends the loader."""

    label: ClassVar[str] = "a DataLoader"
    crash_stops_all: ClassVar[bool] = True

    @classmethod
    def of(cls, worker_crash_retries: int) -> LoaderPolicy:
        return cls(max_task_crashes=worker_crash_retries + 1)

    @property
    def crash_retries(self) -> int:
        """``worker_crash_retries``: the fresh workers a batch whose worker died runs on."""
        return self.max_task_crashes - 1

    @property
    def replaces_crashed(self) -> bool:
        """Whether a worker that died is replaced (its batches run again) at all."""
        return self.retries(1)


@dataclasses.dataclass(frozen=True)
class GroupPolicy(Policy):
    """The ranks of a :class:`~framepipe.workers.WorkerGroup`: each runs its entry point once;
    the first that fails stops the others, as torchrun's agent does (which may then start the
    whole group again: ``max_restarts`` there)."""

    label: ClassVar[str] = "a WorkerGroup"
    crash_stops_all: ClassVar[bool] = True

    def retries(self, crashes: int) -> bool:
        return False  # a rank is one part of a whole: it is never run alone again

    def replacements(self, need: int, calls_waiting: bool, any_running: bool) -> int:
        return 0
