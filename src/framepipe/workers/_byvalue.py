"""Functions by value, where by reference cannot work.

Plain pickle sends a function as its module and qualified name, which the worker imports. That
fails for a lambda, a closure, a nested function, and a function of ``__main__`` that the
worker cannot import (a notebook, ``python -c``, or a function defined under
``if __name__ == "__main__":`` of a spawned program). Such a function is sent with cloudpickle
(an optional dependency, the ``framepipe[cloudpickle]`` extra), and only then: the plain pickle
of a task is tried first, so an importable function costs what it always did.

Once per worker, not once per task (tasks):

- In the parent, a core's :class:`Registry` pickles each such function once (cached by
  identity, then by the content of its pickle, so a lambda written again in a loop is the same
  definition) and gives it a key; the task's pickle carries only ``_ref(key)``.
- Before a task is written to a worker, :meth:`Registry.define` writes the definitions that
  worker has not had yet, in one frame of its own, unpickled ahead of the task (a pipe keeps
  its order): a ``BATCH`` of no task, whose unpickling stores the definitions in the worker's
  table (:func:`_define`). Storing never fails; a definition is loaded on its first use, so a
  definition the worker cannot load fails the tasks that use it, not the worker.
- A core keeps at most :data:`MAX_DEFS` definitions; beyond them a function travels inside
  each task that uses it (:class:`_Inline`).

Arguments and results follow the same rule: by value only when plain pickle fails. Objects a
worker receives when it starts (a DataLoader's dataset and ``collate_fn``, a WorkerGroup's
entry point, a Pool's initializer) are wrapped by :func:`portable`, which pickles them the same
way when the process is spawned (a forked worker has them already).
"""

from __future__ import annotations

import ast
import contextlib
import functools
import hashlib
import io
import itertools
import os
import pickle
import sys
import threading
import types
import weakref
from typing import Any

EXTRA = "framepipe[cloudpickle]"
MAX_DEFS = 1024  # definitions a core keeps for its workers; more travel with each task
BATCH = 3  # _protocol.BATCH: a frame of tasks, here with none (see the module docstring)

_keys = itertools.count(1)


# cloudpickle is imported under this lock, which a fork waits for: a worker forked while
# another thread imports it would find it half imported, its module lock held forever.
_import_lock = threading.Lock()
os.register_at_fork(
    before=_import_lock.acquire,
    after_in_parent=_import_lock.release,
    after_in_child=_import_lock.release,
)


def _import_cloudpickle() -> Any:
    with _import_lock:
        import cloudpickle
    return cloudpickle


def _cloudpickle(what: str, exc: BaseException | None = None) -> Any:
    """The cloudpickle module, or a TypeError that names the extra to install."""
    try:
        cloudpickle = _import_cloudpickle()
    except ImportError:
        reason = f": {type(exc).__name__}: {exc}" if exc is not None else ""
        err = TypeError(
            f"cannot send {what} to a worker process{reason}. A function the worker cannot "
            "import (a lambda, a closure, a nested function, one of a notebook's __main__) is "
            f"sent by value, which needs cloudpickle: pip install '{EXTRA}'; anything else "
            "must be picklable"
        )
        if exc is not None:
            err.__cause__ = exc
        raise err from exc
    return cloudpickle


def have_cloudpickle() -> bool:
    try:
        _import_cloudpickle()
    except ImportError:
        return False
    return True


def _describe(obj: Any) -> str:
    name = getattr(obj, "__qualname__", None) or type(obj).__qualname__
    return f"{getattr(obj, '__module__', None) or '?'}.{name}"


# -- which objects a worker can import -------------------------------------------------------


def by_reference(obj: Any, spawned: bool = True) -> bool:
    """Whether a worker can import ``obj`` (a function or class) by its module and qualified
    name. ``spawned``: the worker was spawned (or comes from a fork server), so of ``__main__``
    it has only what runs when its file is imported."""
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str) or "<" in qualname:
        return False
    mod = sys.modules.get(module)
    if mod is None:
        return False
    target: Any = mod
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is not obj:
        return False
    return module != "__main__" or not spawned or qualname in _main_top_names()


def _main_top_names() -> frozenset[str]:
    """The names a spawned worker's copy of ``__main__`` defines: the functions and classes
    of its file, outside ``if __name__ == "__main__":``. None without a file (a notebook,
    ``python -c``, an interactive session)."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py"):
        return frozenset()
    return _top_names(path)


@functools.lru_cache(maxsize=4)
def _top_names(path: str) -> frozenset[str]:
    try:
        with open(path, "rb") as f:
            tree = ast.parse(f.read(), path)
    except (OSError, SyntaxError, ValueError):
        return frozenset()
    names: set[str] = set()

    def walk(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.If) and not _is_main_guard(node.test):
                walk(node.body)
                walk(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody):
                    walk(part)
                for handler in node.handlers:
                    walk(handler.body)
            elif isinstance(node, ast.With):
                walk(node.body)

    walk(tree.body)
    return frozenset(names)


def _is_main_guard(test: ast.expr) -> bool:
    return (
        isinstance(test, ast.Compare)
        and isinstance(test.left, ast.Name)
        and test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators)
    )


def main_by_value(mp_context: Any) -> bool:
    """Whether the workers of ``mp_context`` lack what ``__main__`` defines at run time."""
    try:
        return bool(mp_context.get_start_method() != "fork")
    except (AttributeError, ValueError):
        return True


# -- the parent's definitions ----------------------------------------------------------------


class Ref:
    """What a task's pickle carries for a function sent by value: its key."""

    __slots__ = ("key", "name", "__weakref__")

    def __init__(self, key: int, name: str) -> None:
        self.key = key
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return _ref, (self.key,)

    def __repr__(self) -> str:
        return f"<function {self.name} sent by value>"


class _Inline:
    """A function sent by value inside each task (past :data:`MAX_DEFS` definitions)."""

    __slots__ = ("blob", "name", "__weakref__")

    def __init__(self, blob: bytes, name: str) -> None:
        self.blob = blob
        self.name = name

    def __reduce__(self) -> tuple[Any, ...]:
        return _loads, (self.blob,)


class _Defs:
    __slots__ = ("entries",)

    def __init__(self, entries: list[tuple[int, bytes]]) -> None:
        self.entries = entries

    def __reduce__(self) -> tuple[Any, ...]:
        return _define, (self.entries,)


class Registry:
    """A core's functions sent by value, and the number each worker was sent."""

    def __init__(self) -> None:
        self.defs: list[tuple[int, bytes]] = []  # (key, pickle); only ever appended to
        self._by_obj: weakref.WeakKeyDictionary[Any, Ref | _Inline] = weakref.WeakKeyDictionary()
        self._by_digest: dict[bytes, Ref] = {}
        self._lock = threading.Lock()
        self.pickled = 0  # functions pickled by value here (for tests)

    def ref(self, fn: Any) -> Ref | _Inline:
        """The stand-in of ``fn`` in a task's pickle (``fn`` pickled once)."""
        try:
            return self._by_obj[fn]
        except (KeyError, TypeError):
            pass
        name = _describe(fn)
        blob = _cloudpickle(name).dumps(fn, protocol=5)
        digest = hashlib.blake2b(blob, digest_size=16).digest()
        with self._lock:
            self.pickled += 1
            stand_in: Ref | _Inline | None = self._by_digest.get(digest)
            if stand_in is None:
                if len(self.defs) >= MAX_DEFS:
                    stand_in = _Inline(blob, name)
                else:
                    stand_in = Ref(next(_keys), name)
                    self.defs.append((stand_in.key, blob))
                    self._by_digest[digest] = stand_in
            try:
                self._by_obj[fn] = stand_in
            except TypeError:
                pass  # not weakly referable: found again by its content
        return stand_in

    def define(self, slot: Any) -> None:
        """Write to ``slot``'s worker the definitions it has not had (the dispatch lock is
        held: nothing else writes to it meanwhile)."""
        sent = getattr(slot, "byvalue_sent", 0)
        new = self.defs[sent:]
        if new:
            slot.byvalue_sent = sent + len(new)
            slot.proc.conn.send_bytes(pickle.dumps((BATCH, [], _Defs(new)), protocol=5))


def registry(core: Any) -> Registry:
    reg: Registry | None = core.byvalue
    if reg is None:
        with _registry_lock:
            reg = core.byvalue
            if reg is None:
                reg = core.byvalue = Registry()
    return reg


_registry_lock = threading.Lock()


def _pickler_class() -> Any:
    cloudpickle = _cloudpickle("a function")

    class _Pickler(cloudpickle.Pickler):  # type: ignore[misc, name-defined]
        """cloudpickle, with the functions it would send by value replaced by their key."""

        def __init__(self, file: Any, reg: Registry, spawned: bool) -> None:
            super().__init__(file, protocol=5)
            self._reg = reg
            self._spawned = spawned

        def reducer_override(self, obj: Any) -> Any:
            if type(obj) is types.FunctionType and not by_reference(obj, self._spawned):
                return self._reg.ref(obj).__reduce__()
            return super().reducer_override(obj)

    return _Pickler


_pickler: Any = None


def dumps(core: Any, obj: Any, what: Any, exc: BaseException) -> bytes:
    """The pickle of ``obj`` (a task, or a map item) whose plain pickle raised ``exc``: its
    functions that cannot go by reference go by value. ``what``: the task's function, named
    in errors. Raises TypeError when even that fails."""
    global _pickler
    name = _describe(what)
    if _pickler is None:
        _cloudpickle(name, exc)
        _pickler = _pickler_class()
    f = io.BytesIO()
    try:
        _pickler(f, registry(core), main_by_value(core._mp)).dump(obj)
    except Exception as exc2:  # noqa: BLE001 - said as what cannot be sent
        err = TypeError(
            f"cannot send {name} and its arguments to a worker process, by reference "
            f"({type(exc).__name__}: {exc}) or by value ({type(exc2).__name__}: {exc2})"
        )
        err.__cause__ = exc2
        raise err from exc2
    return f.getvalue()


# A function of __main__: whether a spawned worker lacks it (decided once per function).
_main_needs_value: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def stand_in(core: Any, fn: Any, exc: BaseException | None = None) -> Any:
    """``fn``, or its stand-in when it must go by value (``exc``: its plain pickle failed;
    None: ``fn`` is of ``__main__`` and may go by value). Raises TypeError, naming the extra,
    when it must and cloudpickle is missing."""
    if exc is None:
        try:
            lacked = _main_needs_value[fn]
        except (KeyError, TypeError):
            lacked = type(fn) is types.FunctionType and not by_reference(fn) and have_cloudpickle()
            with contextlib.suppress(TypeError):
                _main_needs_value[fn] = lacked
        if not lacked or not main_by_value(core._mp):
            return fn  # as before: a spawned worker that lacks it says so
    else:
        _cloudpickle(_describe(fn), exc)
    try:
        return registry(core).ref(fn)
    except Exception as exc2:  # noqa: BLE001 - said as what cannot be sent
        if exc is None:
            return fn  # by reference after all: a worker that lacks it says so
        err = TypeError(f"cannot send {_describe(fn)} to a worker process by value: {exc2}")
        raise err from exc2


def prepare(core: Any, fn: Any) -> Any:
    """``fn`` as items of a map carry it (``map(..., chunksize=n)``): its stand-in when it
    must go by value, else ``fn`` itself. Raises what its plain pickle raised when it can go
    neither way (the caller names ``fn`` in the error every item fails with)."""
    try:
        if getattr(fn, "__module__", None) == "__main__":
            fn = stand_in(core, fn)
        if type(fn) is not Ref:
            pickle.dumps(fn, protocol=5)
    except Exception as exc:  # noqa: BLE001 - by value
        try:
            return stand_in(core, fn, exc)
        except Exception:  # noqa: BLE001 - not by value either
            raise exc from None
    return fn


# -- results ---------------------------------------------------------------------------------


def dumps_result(msg: Any) -> bytes | None:
    """A worker's reply whose plain pickle failed, by value; None when it cannot be."""
    try:
        cloudpickle = _import_cloudpickle()
    except ImportError:
        return None
    try:
        return bytes(cloudpickle.dumps(msg, protocol=5))
    except Exception:  # noqa: BLE001 - the caller reports the first failure
        return None


# -- objects a worker receives when it starts ------------------------------------------------


class _Portable:
    """An object pickled when a worker is spawned: by reference when the worker can import
    what it refers to, else by value."""

    __slots__ = ("obj", "what")

    def __init__(self, obj: Any, what: str | None = None) -> None:
        self.obj = obj
        self.what = what  # what the object is to the user, said when it cannot be sent

    def __reduce__(self) -> tuple[Any, ...]:
        from multiprocessing.reduction import ForkingPickler

        obj = self.obj
        kind = obj if isinstance(obj, type | types.FunctionType) else type(obj)
        exc: BaseException | None = None
        if by_reference(kind) or getattr(kind, "__module__", None) != "__main__":
            try:
                return _loads, (bytes(ForkingPickler.dumps(obj, protocol=5)),)
            except Exception as e:  # noqa: BLE001 - by value, next
                exc = e
        cloudpickle = _cloudpickle(_describe(obj), exc)
        try:
            return _loads, (cloudpickle.dumps(obj, protocol=5),)
        except Exception as exc2:
            what = self.what or _describe(obj)
            raise TypeError(
                f"cannot send {what} to a spawned worker: it cannot be pickled, by reference "
                f"({type(exc).__name__}: {exc}) or by value ({type(exc2).__name__}: {exc2}); "
                "pass something picklable (a path, a number, a module-level function) and "
                "build the object in the worker, or start workers with fork"
            ) from exc2


def portable(mp_context: Any, obj: Any, what: str | None = None) -> Any:
    """``obj`` as a spawned worker will receive it (see :class:`_Portable`); ``obj`` itself
    where nothing is pickled (fork). ``what``: its name in an error (default: its type)."""
    if obj is None or not main_by_value(mp_context):
        return obj
    return _Portable(obj, what)


# -- the worker's table ----------------------------------------------------------------------

_table: dict[int, Any] = {}  # key -> its pickle, then the function once loaded
loads_count = 0  # definitions loaded in this process (for tests)


def _define(entries: list[tuple[int, bytes]]) -> None:
    for key, blob in entries:
        _table.setdefault(key, blob)


def _ref(key: int) -> Any:
    global loads_count
    try:
        value = _table[key]
    except KeyError:
        raise LookupError(
            f"function {key} sent by value was never defined in this worker"
        ) from None
    if type(value) is bytes:
        value = _loads(value)
        _table[key] = value
        loads_count += 1
    return value


def _loads(blob: bytes) -> Any:
    try:
        return pickle.loads(blob)
    except Exception as exc:
        raise RuntimeError(
            f"a function or object sent by value could not be loaded in the worker: "
            f"{type(exc).__name__}: {exc} (the modules it uses must be importable there, "
            f"and cloudpickle installed: pip install '{EXTRA}')"
        ) from exc
