"""One at-exit hook for every supervisor of worker processes.

Each supervisor (a pool's or actor's core, a loader's workers, a worker group) registers here
when it starts and unregisters when it is closed. At interpreter exit the hook runs in two
rounds: first every owner's ``finish_at_exit()`` (a pool finishes the tasks it was given, as
``concurrent.futures`` does), then every owner's ``stop_at_exit()`` (its processes are stopped
and reaped), so no worker process outlives the program. A Ctrl-C during the first round skips to
the second.

The hook is registered on import of this module, after ``multiprocessing.util``'s own: atexit
runs hooks last-in first-out, so ours runs first. multiprocessing's would join every
non-daemonic child and wait forever for a worker still running.

A process started by ``multiprocessing`` runs no atexit hook: when its target returns or raises,
it runs multiprocessing's finalizers, joins its own non-daemonic children, then ``os._exit``.
So the hook is also a multiprocessing finalizer, entered (again) in each process by the first
``register`` there (a child's finalizers are cleared when it starts), with an exit priority that
runs it before that join; otherwise such a child that raised while it held a loader's iterator,
say, would wait forever for that loader's workers.
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing.util  # imported first so that our hook runs before its own
import os
import threading
import weakref
from typing import Protocol

__all__ = ["Owner", "register", "unregister"]


class Owner(Protocol):
    """What the hook calls on each registered supervisor."""

    def finish_at_exit(self) -> None: ...

    def stop_at_exit(self) -> None: ...


# Re-entrant: the garbage collector may run a dropped supervisor's finalizer, which
# unregisters it, on a thread that holds the lock (in the middle of ``_owners.items()``).
_lock = threading.RLock()
# weak: a supervisor the program dropped is stopped by its own finalizer, not kept alive here
_owners: weakref.WeakValueDictionary[int, Owner] = weakref.WeakValueDictionary()
_order = 0
_finalizer_pid = -1  # the process whose multiprocessing finalizers hold the hook
_reading = False  # this module goes through _owners (under _lock)
_later: list[Owner] = []  # owners unregistered meanwhile, by a finalizer (see unregister)


def register(owner: Owner) -> None:
    """Stop ``owner``'s processes at exit unless it is unregistered first."""
    global _order, _finalizer_pid
    with _lock:
        _order += 1
        _owners[_order] = owner
        if _finalizer_pid != os.getpid():
            _finalizer_pid = os.getpid()
            multiprocessing.util.Finalize(None, _stop_all_at_exit, exitpriority=100)


def unregister(owner: Owner) -> None:
    """``owner`` has stopped its processes itself; the hook leaves it alone."""
    with _lock:
        if _reading:
            # Called by a finalizer that the garbage collector ran while this thread goes
            # through _owners: done once it has, not in the middle.
            _later.append(owner)
            return
        _forget([owner])


def _forget(owners: list[Owner]) -> None:
    """Drop ``owners`` from the registry, and those a finalizer unregistered meanwhile."""
    global _reading
    _reading = True
    try:
        owners = [*owners, *_later]
        _later.clear()
        while owners:
            gone = {id(o) for o in owners}
            for key, value in list(_owners.items()):
                if id(value) in gone:
                    del _owners[key]
            owners = _later[:]
            _later.clear()
    finally:
        _reading = False


def _registered() -> list[Owner]:
    global _reading
    with _lock:
        _reading = True  # (see unregister)
        try:
            return [o for _, o in sorted(_owners.items())]
        finally:
            _reading = False
            if _later:
                _forget([])


@atexit.register
def _stop_all_at_exit() -> None:
    owners = _registered()
    try:
        for owner in owners:
            owner.finish_at_exit()
    except BaseException:  # noqa: BLE001 - a Ctrl-C: what is left is stopped below
        pass
    for owner in reversed(owners):  # the newest first, as each would have been closed
        with contextlib.suppress(Exception):
            owner.stop_at_exit()


def _forget_in_child() -> None:
    """A forked child owns none of its parent's workers: the supervisors it inherited (copies,
    whose records name its siblings' pids) are never stopped from it."""
    global _lock, _owners, _reading, _later
    _lock = threading.RLock()  # another thread of the parent may have held it at the fork
    _owners = weakref.WeakValueDictionary()
    _reading = False
    _later = []


os.register_at_fork(after_in_child=_forget_in_child)
