"""The worker side of :class:`~framepipe.workers.Worker` and :class:`~framepipe.workers.Pool`.

:func:`task_loop` is the child loop :mod:`._process` runs in each worker: it reads the messages
of :mod:`._protocol` from the worker's data channel, runs the calls in the order they came and
answers each (a result, an error, a stream's items), so that the parent always knows which task
a worker is running: the oldest one without an answer. A task whose message cannot be
unpickled here fails by itself; the others go on. ``worker_namespace`` is the per-worker
namespace of ``Worker.exec``, ``store`` and ``load``.
"""

from __future__ import annotations

import collections
import os
import pickle
import socket
import time
from collections.abc import Callable
from typing import Any

from .._spin import SPIN_ALONE, allow_spin
from ..remote import dumps_exception
from . import _byvalue, _process, _shm
from ._process import ChildContext
from ._protocol import (
    ALONE,
    BATCH,
    CALL,
    CLOSE,
    END,
    ERROR,
    ITEM,
    MAP,
    RECYCLE,
    RESULT,
    RETURN,
    SHM_SLOTS,
    STREAM,
)
from ._tasks import _task_name
from .errors import TaskPicklingError, WorkerCancelled, unloadable_error

_NO_KWARGS: dict[str, Any] = {}  # never changed: a call's **kwargs is a new dict
_SCALARS = frozenset({type(None), bool, int, float, complex})

_context: ChildContext | None = None


def worker_namespace() -> dict[str, Any]:
    """The per-worker namespace of :meth:`Worker.exec`, ``store`` and ``load``."""
    if _context is None:
        raise RuntimeError("worker_namespace() is only available inside a framepipe worker")
    return _context.namespace


def task_loop(ctx: ChildContext) -> None:
    """A worker's main loop: run tasks in the order they arrive, answer each."""
    global _context
    _context = ctx
    recv_bytes = ctx.conn.recv_bytes
    send = ctx.conn.send
    send_bytes = ctx.conn.send_bytes
    dumps = pickle.dumps
    max_rss = ctx.options.get("max_rss")
    wire = _wire(ctx)
    perf = time.perf_counter
    inbox: collections.deque[Any] = collections.deque()
    may_spin = ctx.options.get("spin") is not False
    alone = False  # its reads spin the longer way, after a task sent ALONE: see _spin_switch
    while True:
        if inbox:
            msg = inbox.popleft()
        else:
            try:
                msg = _receive(recv_bytes, inbox)
            except EOFError:
                return
            if msg is None:
                continue  # a frame of several tasks (or one that failed to load): in the inbox
        op = msg[0]
        if op == ALONE or alone:
            op, alone = _spin_switch(op, alone, may_spin)
        if (op == CALL or op == STREAM or op == _UNLOADABLE) and not ctx.take_turn():
            continue  # the parent took it back (see Scheduling._steal)
        if op != CALL:
            if _other(ctx, wire, msg):
                return  # CLOSE
            continue
        tid, fn, args, kwargs = msg[1], msg[2], msg[3], msg[4]
        start = perf()
        ctx.current = tid
        try:
            if tid in ctx.cancelled:
                ctx.interrupted = tid  # raised in it: no signal raises again
                raise WorkerCancelled(f"task {tid} was cancelled before it started")
            value = fn(*args, **kwargs)
            ctx.current = None
        except BaseException as exc:  # noqa: BLE001 - every failure goes to the caller
            ctx.current = None
            send((ERROR, tid, dumps_exception(exc)))
        else:
            try:
                if type(value) in _SCALARS:
                    # pickled here: a number has no out-of-band buffers to look for
                    send_bytes(dumps((RESULT, tid, value), protocol=5))
                else:
                    if wire is not None:
                        value = _to_wire(wire, value)
                    send((RESULT, tid, value))
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - an unpicklable result
                _unsent(ctx, wire, tid, fn, value, exc)
        ctx.calls += 1
        ctx.busy += perf() - start
        # answered: its objects are let go of now (an argument's __del__ may tell its owner)
        msg = fn = args = kwargs = value = None
        if max_rss is not None:
            _recycle_if_large(ctx, max_rss)


def _spin_switch(op: int, alone: bool, may_spin: bool) -> tuple[int, bool]:
    """A worker's spin for its next message (see NOTE [ Spinning while the pool is idle ] in
    _submitting): the longer one, SPIN_ALONE (see there), after a task sent ALONE; back to
    ``may_spin`` (what the pool allowed at start) after any other message but a RETURN. The op
    to run (CALL for ALONE) and whether its reads spin the longer way now."""
    if op == ALONE:
        if not alone:
            allow_spin(True, SPIN_ALONE)
        return CALL, True
    if op == RETURN:
        return op, alone
    allow_spin(may_spin)
    return op, False


def _recycle_if_large(ctx: ChildContext, max_rss: int) -> None:
    """Ask to be replaced (RECYCLE) once this worker's RSS is over ``max_rss`` bytes."""
    rss = _process.current_rss(os.getpid())
    if rss is not None and rss > max_rss:
        ctx.conn.send((RECYCLE, rss, ctx.retire()))


def _wire(ctx: ChildContext) -> _shm.Wire | None:
    """Where large arrays in results go (memfds passed over a socket), if the parent has it."""
    fdsock = ctx.options.get("fdsock")
    if fdsock is None:
        return None
    return _shm.Wire(socket.socket(fileno=fdsock.fd), ctx.options.get("shm_slots", SHM_SLOTS))


def _to_wire(wire: _shm.Wire, value: Any) -> Any:
    """``value`` with its large arrays moved to memfds, sent (their handles) ahead of it."""
    wire.used = []
    value = _shm.convert_result(wire, value)
    if wire.new:
        wire.flush()
    return value


def _other(ctx: ChildContext, wire: _shm.Wire | None, msg: Any) -> bool:
    """Act on a message that is no call; True when it says to stop (CLOSE)."""
    op = msg[0]
    if op == _UNLOADABLE:
        ctx.conn.send((ERROR, msg[1], dumps_exception(msg[2])))
    elif op == RETURN:
        if wire is not None:
            wire.give_back(msg[1])
    elif op == STREAM:
        _run_stream(ctx, msg[1], msg[2], msg[3], msg[4], msg[5])
    return bool(op == CLOSE)


def _receive(recv_bytes: Callable[[], bytes], inbox: collections.deque[Any]) -> Any:
    """The next message read from the channel, or None when what came went to ``inbox``: the
    tasks of a BATCH or MAP frame, or the failure of one that could not be unpickled. Raises
    EOFError when the parent closed the channel."""
    blob = recv_bytes()
    loads = pickle.loads
    try:
        msg = loads(blob)
    except Exception as exc:  # noqa: BLE001 - the arguments of one task: it fails
        inbox.extend(_unloadable(blob, exc, 2))
        return None
    if msg[0] == BATCH:
        for blob in msg[1]:
            try:
                inbox.append(loads(blob))
            except Exception as exc:  # noqa: BLE001 - as above
                inbox.extend(_unloadable(blob, exc, 2))
        return None
    if msg[0] == MAP:
        fn = msg[1]
        for blob in msg[2]:
            try:
                tid, args = loads(blob)
            except Exception as exc:  # noqa: BLE001 - as above
                inbox.extend(_unloadable(blob, exc, 1))
            else:
                inbox.append((CALL, tid, fn, args, _NO_KWARGS))
        return None
    return msg


def _unsent(
    ctx: ChildContext,
    wire: _shm.Wire | None,
    tid: int,
    fn: Any,
    value: Any,
    exc: BaseException,
) -> None:
    """A call's result could not be sent (``exc``): send it by value if that can, else the
    error that says why."""
    conn = ctx.conn
    blob = None
    if isinstance(exc, Exception):  # by value, if it can
        blob = _byvalue.dumps_result((RESULT, tid, value))
    if blob is not None:
        conn.send_bytes(blob)
        return
    if wire is not None:
        wire.give_back(wire.used)  # the parent never saw these arrays
    err: BaseException = exc  # a SystemExit in a __reduce__: as itself
    if isinstance(exc, Exception):
        err = TaskPicklingError(
            f"the result of {_task_name(fn)} could not be sent back: {type(exc).__name__}: {exc}"
        )
        err.__cause__ = exc
    conn.send((ERROR, tid, dumps_exception(err)))


_UNLOADABLE = -1  # in a worker's inbox only: a task whose message could not be unpickled
_INT_OPS = frozenset({"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4"})


def _leading_ints(blob: bytes, n: int) -> list[int]:
    """The first ``n`` integers at the head of a pickle, read without running it (fewer when
    something else comes first)."""
    import pickletools

    ints: list[int] = []
    try:
        for op, arg, _ in pickletools.genops(blob):
            if op.name in _INT_OPS:
                ints.append(arg)  # type: ignore[arg-type]
                if len(ints) == n:
                    break
            elif op.name not in ("PROTO", "FRAME", "MARK"):
                break
    except Exception:  # noqa: BLE001 - not even the head reads
        pass
    return ints


def _unloadable(blob: bytes, exc: BaseException, at: int) -> list[tuple[Any, ...]]:
    """The inbox entries for the tasks of a pickle (a message when ``at`` is 2, a map item
    when it is 1) that raised ``exc`` in the worker: those tasks fail with it, each in its
    turn, and the worker goes on. A task's id is the ``at``-th integer at the head of its
    pickle; the items of a MAP message are the pickles inside it. A message of no task ends
    the worker with ``exc``."""
    import pickletools

    ints = _leading_ints(blob, at)
    tids: list[int] = []
    if len(ints) == at and (at == 1 or ints[0] in (CALL, STREAM, ALONE)):
        tids = [ints[-1]]
    elif at == 2 and ints[:1] == [MAP]:  # the function: every item fails
        for _, arg, _ in pickletools.genops(blob):
            if isinstance(arg, bytes) and arg[:1] == b"\x80":
                tids += _leading_ints(arg, 1)[:1]
    if not tids:
        raise exc
    entries = []
    for tid in tids:
        entries.append((_UNLOADABLE, tid, unloadable_error(tid, exc)))
    return entries


def _run_stream(ctx: ChildContext, tid: int, fn: Any, args: Any, kwargs: Any, window: int) -> None:
    send = ctx.conn.send
    start = time.perf_counter()
    ctx.open_stream(tid, window)
    gen: Any = None
    try:
        ctx.current = tid
        try:
            gen = fn(*args, **kwargs)
            it = iter(gen)
        finally:
            ctx.current = None
        while ctx.wait_credit(tid):
            ctx.current = tid
            try:
                item = next(it)
            except StopIteration:
                break
            finally:
                ctx.current = None
            send((ITEM, tid, item))
        if gen is not None and hasattr(gen, "close"):
            ctx.current = tid
            try:
                gen.close()
            finally:
                ctx.current = None
        send((END, tid))
    except BaseException as exc:  # noqa: BLE001 - every failure goes to the consumer
        ctx.current = None
        send((ERROR, tid, dumps_exception(exc)))
    finally:
        ctx.close_stream(tid)
        ctx.calls += 1
        ctx.busy += time.perf_counter() - start


def _exec(code: str) -> None:
    exec(compile(code, "<worker exec>", "exec"), worker_namespace())  # noqa: S102


def _store(name: str, value: Any) -> None:
    worker_namespace()[name] = value


def _load(name: str) -> Any:
    ns = worker_namespace()
    if name not in ns:
        raise KeyError(f"{name!r} is not in the worker's namespace; store() or exec() it first")
    return ns[name]
