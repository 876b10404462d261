"""The states of one worker process, and the moves between them, written once.

Every supervisor keeps one record per worker process (a pool's or actor's slot, a loader's
worker, a group's rank) whose ``state`` is a :class:`State`. A record changes state only
through :meth:`Lifecycle.to`, which refuses a move the table below does not allow: a worker
that is ``DEAD`` never becomes ``READY`` again (its replacement is a new record).

::

    STARTING ──> READY <──> BUSY
        │          │          │
        │          └─> RETIRING (takes no new work, finishes what it holds)
        │                 │
        └────────> STOPPING (asked to exit: a signal or a stop message)
                          │
    any state ──────────> DEAD (its process exited; reaped by the manager)
"""

from __future__ import annotations

import enum

__all__ = ["IllegalMove", "Lifecycle", "State"]


class State(enum.Enum):
    STARTING = "starting"  # launched; not yet said it is ready
    READY = "ready"  # running and idle: may be given work
    BUSY = "busy"  # running work
    RETIRING = "retiring"  # finishes what it holds, then is stopped and replaced
    STOPPING = "stopping"  # asked to exit; waited for, then killed after the grace period
    DEAD = "dead"  # the process exited


_MOVES: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.READY, State.BUSY, State.STOPPING, State.DEAD}),
    State.READY: frozenset({State.BUSY, State.RETIRING, State.STOPPING, State.DEAD}),
    State.BUSY: frozenset({State.READY, State.RETIRING, State.STOPPING, State.DEAD}),
    State.RETIRING: frozenset({State.STOPPING, State.DEAD}),
    State.STOPPING: frozenset({State.DEAD}),
    State.DEAD: frozenset(),
}

RUNNING = frozenset({State.READY, State.BUSY})


class IllegalMove(RuntimeError):
    """A supervisor tried a move the lifecycle does not allow (a bug in framepipe)."""


class Lifecycle:
    """A worker record's state; subclasses hold the rest of the record."""

    __slots__ = ("state",)

    def __init__(self) -> None:
        self.state = State.STARTING

    def to(self, new: State) -> None:
        """Move to ``new``; staying put is allowed, a move the table forbids raises."""
        if new is self.state:
            return
        if new not in _MOVES[self.state]:
            raise IllegalMove(
                f"{type(self).__name__}: a worker cannot go from {self.state.value} to {new.value}"
            )
        self.state = new

    @property
    def alive(self) -> bool:
        return self.state is not State.DEAD

    @property
    def running(self) -> bool:
        """Ready or busy: it may be handed work."""
        return self.state in RUNNING
