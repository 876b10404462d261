"""What the parent does when a loader's worker fails: the report of a crash or a timeout, and
(``worker_crash_retries``) a fresh worker in a dead one's place, given what it held."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

from ...errors import WriterDied
from ..errors import MAIN_GUARD_EXIT, start_error
from .errors import LoaderTimeout, WorkerCrashWarning
from .wire import STACK_WAIT, _short


def batch_text(workers: Any, bid: int, indices: Any) -> str:
    """Batch ``bid`` (of ``indices``) in words, for a report."""
    if bid < workers.floor:
        return f"a batch of an abandoned epoch (indices {_short(indices)})"
    if indices is None:
        return f"batch {bid - workers.floor}"
    return f"batch {bid - workers.floor} (indices {_short(indices)})"


def crashed(
    workers: Any, slot: Any, died: WriterDied | None, reason: str | None = None
) -> BaseException:
    """``slot``'s worker died (or its channel failed): the loader is broken, and this is the
    WorkerCrashed to raise."""
    # The worker was loading the oldest batch it held if it had a credit for it; any
    # later ones it held with credit were still to come, and the rest were queued.
    held = list(slot.held)
    loading = held[: max(0, slot.credit)]
    why = f"DataLoader worker {slot.id}"
    if len(loading) > 1:
        shown = ", ".join(batch_text(workers, b, i) for b, i in loading[1:5])
        more = len(loading) - 5
        why += f"; it also held {shown}" + (f" and {more} more" if more > 0 else "")
    queued = len(held) - len(loading)
    if queued > 0:
        why += f"; {queued} more batch{'es' if queued > 1 else ''} were queued for it"
    if reason:
        why += f"; {reason}"
    task = batch_text(workers, *loading[0]) if loading else None
    err = slot.proc.crash_error(died, task, None, why)
    if err.exitcode == MAIN_GUARD_EXIT:  # it never started: see _mainguard
        return _fail(workers, start_error("a DataLoader", err))
    err.worker_id = slot.id
    err.batches = dict(loading)
    err.queued = dict(held[len(loading) :])
    return _fail(workers, err)


def retry(workers: Any, slot: Any, died: WriterDied) -> None:
    """``slot``'s worker died: the batch it was loading is blamed (its beacon says which:
    the oldest it held when it was loading none of them), and unless that batch has now
    crashed ``worker_crash_retries + 1`` workers (WorkerCrashed, naming it), a fresh
    worker takes the slot's place with every batch the dead one held, in the same order
    and with the same credit, so the epoch goes on as if nothing happened. The report of
    the death goes to ``on_worker_crash`` (a warning without one) and to
    ``crash_reports``. An iterable dataset's part starts again where the dead worker's
    last delivered batch left it (see NOTE [ Resuming an epoch ])."""
    held = list(slot.held)
    if not held:  # nothing lost: a new worker takes its place
        replace(workers, slot, None)
        return
    loading = slot.loading()
    bid: int = held[0][0]
    if loading is not None and any(b == loading for b, _ in held):
        bid = loading
    indices = dict(held)[bid]
    count = workers.crashes[bid] = workers.crashes.get(bid, 0) + 1
    again = workers.policy.retries(count)
    retries = workers.policy.crash_retries
    text = batch_text(workers, bid, indices)
    why = f"DataLoader worker {slot.id}; it died loading {text}"
    if not again:
        why += (
            f", which has now crashed {count} workers (worker_crash_retries="
            f"{retries}); the reports of the earlier crashes are in err.crashes"
        )
    else:
        why += f"; the batch goes to a fresh worker (retry {count} of {retries})"
    err = slot.proc.crash_error(died, text, None, why)
    err.worker_id = slot.id
    err.batches = {bid: indices}
    err.queued = {b: i for b, i in held if b != bid}
    if not again:
        err.crashes = list(workers.reports)
        raise workers.fail(err)
    resume = None
    if workers.common["iterable"]:
        if workers.common["stateful"] and slot.wstate is not None:
            resume = {"state": slot.wstate}
        elif slot.answered:
            resume = {"skip": slot.answered}
    replace(workers, slot, resume)
    workers.reports.append(err)
    if workers.on_crash is not None:
        workers.on_crash(err)
    else:
        warnings.warn(str(err), WorkerCrashWarning, stacklevel=4)


def replace(workers: Any, slot: Any, resume: dict[str, Any] | None) -> None:
    """A fresh worker in ``slot``'s place, given what the dead one held."""
    old = slot.proc
    held, credit = list(slot.held), slot.credit
    slot.rebind(*workers.spawn(slot.id, resume))
    with contextlib.suppress(Exception):
        old.stop(timeout=0.0, grace=workers.process.kill_grace)
        old.close()
    slot.held.clear()
    slot.credit = 0
    workers.pace(slot, slow=False, small=False, grant=False)  # as the new worker starts
    if held:
        workers.assign(slot, [b for b, _ in held], [i for _, i in held])
    if credit > 0:
        workers.grant(slot, credit)


def timed_out(workers: Any, slot: Any, timeout: float) -> BaseException:
    """``slot``'s worker took longer than ``timeout``: the LoaderTimeout to raise, with the
    worker's stack."""
    stack = slot.proc.stack(STACK_WAIT)
    task = batch_text(workers, *slot.held[0]) if slot.held else "a batch"
    err = LoaderTimeout(slot.proc.name, slot.proc.pid, timeout, task_name=task, stack=stack)
    err.worker_id = slot.id  # type: ignore[attr-defined]
    return _fail(workers, err)


def _fail(workers: Any, exc: BaseException) -> BaseException:
    """``workers.fail(exc)``: the loader is broken, its workers are stopped; ``exc`` to raise."""
    workers.fail(exc)
    return exc
