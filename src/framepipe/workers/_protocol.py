"""The messages between the manager and a worker's task loop: what each first item means.

Parent to worker, a pickled tuple whose first item is an operation: ``(CALL, tid, fn, args,
kwargs)``, ``(STREAM, tid, fn, args, kwargs, window)``, ``(CLOSE,)``, ``(BATCH, [pickles])``,
``(RETURN, [memfd slots])``, ``(MAP, fn, [pickles of (tid, args)])``, ``(ALONE, tid, fn, args,
kwargs)`` (a CALL after which the worker may spin). Worker to parent, a reply: ``(RESULT, tid,
value)``, ``(ERROR, tid, pickled exception)``, ``(ITEM, tid, item)``, ``(END, tid)``,
``(RECYCLE, rss, first task not run)``, and the bootstrap's ``("ready",)`` and
``("init-failed", ...)``.
"""

from __future__ import annotations

__all__ = [
    "ALONE",
    "BATCH",
    "CALL",
    "CLOSE",
    "END",
    "ERROR",
    "ITEM",
    "MAP",
    "RECYCLE",
    "RESULT",
    "RETURN",
    "SHM_SLOTS",
    "STREAM",
]

# Operations, parent to worker (first item of the pickled tuple). BATCH carries the pickles of
# several tasks in one frame: one write for many small tasks. MAP carries a function once and
# the pickles of (task id, args) of several calls of it (map's items).
CALL, STREAM, CLOSE, BATCH, RETURN, MAP = 0, 1, 2, 3, 4, 5
# ALONE is a CALL submitted while no worker had a task in hand: its worker may spin for the
# next message (see NOTE [ Spinning while the pool is idle ] in _submitting).
ALONE = 6
# Replies, worker to parent.
RESULT, ERROR, ITEM, END, RECYCLE = 0, 1, 2, 3, 4
SHM_SLOTS = 16  # memfds per worker for large arrays in results (more use the bulk channel)
