"""Exceptions across processes: serialize in the worker, revive in the parent, never fail.

:func:`dumps_exception` turns any exception into bytes and never raises. Each exception it
reaches (the exception itself, its ``__cause__`` and ``__context__`` chains and the members of
exception groups, each once, whatever cycles they form) is recorded in three layers, from the
most faithful to the one that always works:

1. the object itself, pickled, when it survives a pickle round trip on the sender under the
   same rules the receiver applies;
2. what rebuilds it without calling ``__init__``: its class, its args and its attributes
   (``__dict__`` and slot or C-level members such as ``errno``), each kept as a pickle when it
   round-trips and as its ``repr`` otherwise (a lock becomes ``'<unlocked _thread.lock ...>'``);
3. the names of its class and of every exception class it derives from, so a receiver that
   cannot import the class builds a stand-in that is still an instance of the nearest base it
   can import (``except KeyError`` keeps matching), and is a :class:`RemoteError`.

Each exception also carries its traceback frames (revived as real traceback objects with
tblib, so the parent's traceback shows the child's frames; tracebacks over
:data:`MAX_FRAMES` frames keep both ends and a marker frame naming how many were dropped),
``__suppress_context__`` and ``__notes__``. The payload also holds the whole traceback as text
and where it came from; :func:`loads_exception` ends the revived exception's cause chain in a
:class:`RemoteTraceback` that shows it, as :mod:`concurrent.futures` does.

Reviving is safe by default: the unpickler resolves exception classes and nothing else. A
payload that names any other global (``os.system``, ``builtins.eval``, ...) is refused with
:class:`RefusedPayload` before anything it names is called. Classes are looked up in modules
the receiver has already imported, and nothing is imported to find one (unless the receiver
opts in with ``imports=``): an error payload never makes the receiver run a module's code.
``__main__`` classes revive only when both processes run the same main script. ``allow=``
narrows revival further. Revival is bounded in exceptions, group depth and time; past the
bounds, exceptions degrade to stand-ins and the traceback text keeps the whole story. That
policy, and the only unpickler that reads a payload, are :mod:`framepipe._unpickle`: the
security boundary, audited on its own. ``docs/reviving.md`` writes the policy down.
"""

from __future__ import annotations

import builtins
import collections
import contextlib
import multiprocessing
import os
import pickle
import socket
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any, TypedDict

from ._rebuild import new_without_init, standin_class, traceback_of
from ._unpickle import (
    Allow,
    Imports,
    RefusedPayload,
    Resolver,
    Unavailable,
    load_envelope,
    load_value,
)

__all__ = [
    "MAX_FRAMES",
    "MAX_REVIVE_DEPTH",
    "MAX_REVIVE_NODES",
    "MAX_REVIVE_SECONDS",
    "Allow",
    "Imports",
    "Origin",
    "RefusedPayload",
    "RemoteError",
    "RemoteTraceback",
    "dumps_exception",
    "loads_exception",
    "sender_label",
]

#: Frames kept per traceback; a deeper one keeps its first and last frames around a marker.
MAX_FRAMES = 100
#: Exceptions recorded from one root (causes, contexts and group members); links past it drop.
MAX_EXCEPTIONS = 256
#: Characters of formatted traceback text kept; a longer text keeps both ends.
MAX_TEXT = 1 << 20
#: Exceptions revived from one payload; links to exceptions past it are left out (the
#: traceback text at the end of the cause chain still shows them).
MAX_REVIVE_NODES = MAX_EXCEPTIONS
#: Groups nested in groups revived; a group whose members lie deeper is a stand-in.
MAX_REVIVE_DEPTH = 32
#: Seconds one revival may take: past them, what is still to build is a stand-in at once.
MAX_REVIVE_SECONDS = 1.0

_GROUP_ARGS_REPR = 1000  # characters of a group's args repr kept
_FORMAT = "framepipe.remote/1"
_PROTOCOL = 5
_BaseExceptionGroup: type[BaseException] | None = getattr(builtins, "BaseExceptionGroup", None)
_SKIPPED_MEMBERS = frozenset({"__dict__", "__weakref__"})

Frame = tuple[str, str, int, str]  # filename, function name, line number, module name

_label: ContextVar[str | None] = ContextVar("framepipe_remote_label", default=None)


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (PEP 678), also on Python 3.10, which has no ``add_note``: there
    the note is appended to ``exc.__notes__`` by hand, as 3.11 does. The notes cross processes
    with the exception either way; 3.10's own tracebacks do not print them."""
    if hasattr(exc, "add_note"):
        exc.add_note(note)
        return
    notes = getattr(exc, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        exc.__notes__ = notes  # type: ignore[attr-defined,unused-ignore]  # 3.10
    notes.append(note)


class Origin(TypedDict):
    """Where a payload was made: :func:`origin`'s answer, carried in every payload."""

    pid: int
    name: str
    host: str
    main: str | None
    """The main script's absolute path (``__main__`` classes revive only under the same one)."""
    label: str | None
    """The label of the guard reporting the exception (see :func:`sender_label`), or None."""


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process.

    :func:`loads_exception` puts it at the end of the revived exception's cause chain, so an
    uncaught revived exception prints the child's own traceback (with its source lines and
    exception groups), headed by the pid, process name and host it came from.
    """

    def __init__(
        self,
        text: str,
        pid: int | None = None,
        process_name: str | None = None,
        host: str | None = None,
        *,
        label: str | None = None,
    ) -> None:
        super().__init__(text, pid, process_name, host)
        self.text = text
        self.pid = pid
        self.process_name = process_name
        self.host = host
        self.label = label

    def __str__(self) -> str:
        label = getattr(self, "label", None)
        where = f"the {label}" if label else "another process"
        if self.pid is not None:
            where = f"{label} process {self.pid}" if label else f"process {self.pid}"
            if self.process_name:
                where += f" ({self.process_name})"
            if self.host:
                where += f" on host {self.host}"
        return f'\n"""\nTraceback from {where}:\n{self.text.rstrip()}\n"""'


class RemoteError(BaseException):
    """Marks a stand-in for an exception whose class could not be revived in this process.

    A stand-in's class derives from ``RemoteError`` *and* from the nearest base class of the
    remote type that could be revived here, so ``except KeyError`` (or ``except OSError``)
    still catches it, while ``except Exception`` catches it exactly when it caught the original
    (so ``RemoteError`` itself derives from ``BaseException``; it is never raised alone). The
    stand-in class has the remote type's name. Attributes: ``remote_type`` (the qualified name,
    ``"module.QualName"``), ``remote_args`` (the ``repr`` of its args), ``remote_attrs``
    (each attribute's ``repr``) and ``remote_message`` (its ``str()``); the args and the
    attributes that could be revived are also set as usual.
    """

    remote_type: str = "?"
    remote_args: str = "()"
    remote_attrs: dict[str, str]
    # set on each stand-in class: the remote names, the marker class and the base it combines
    _remote_mro: tuple[tuple[str, str], ...] = ()
    _remote_parts: tuple[type[RemoteError], type[BaseException]] | None = None

    def __str__(self) -> str:
        message = self.__dict__.get("remote_message")
        return message if isinstance(message, str) else super().__str__()

    def __reduce__(self) -> str | tuple[Any, ...]:
        parts = type(self)._remote_parts
        if parts is None:
            return super().__reduce__()
        return (_rebuild_standin, (*parts, type(self)._remote_mro, self.args), self.__dict__)


# --- shared helpers -------------------------------------------------------------------------


def _safe(fn: Callable[[Any], str], obj: Any) -> str:
    try:
        return fn(obj)
    except Exception as err:
        return f"<{fn.__name__}() of {type(obj).__qualname__} object failed: {type(err).__name__}>"


def exception_message(exc: BaseException) -> str:
    """``str(exc)`` that never raises."""
    return _safe(str, exc)


def qualified_name(cls: type) -> str:
    """``module.QualName``, with builtins unprefixed (``KeyError``); a stand-in's remote name."""
    return _dotted(*_type_names(cls)[0]) if issubclass(cls, BaseException) else cls.__qualname__


def format_exception_text(exc: BaseException) -> str:
    """The whole traceback of ``exc`` (chains and groups included) as text; never raises.

    The text is what ``traceback.print_exception`` prints; one over :data:`MAX_TEXT`
    characters keeps both ends around a marker."""
    try:
        text = "".join(traceback.TracebackException.from_exception(exc).format())
    except Exception as err:
        text = (
            f"{qualified_name(type(exc))}: {exception_message(exc)}\n"
            f"(its traceback could not be formatted: {type(err).__name__})\n"
        )
    if len(text) > MAX_TEXT:
        half = MAX_TEXT // 2
        text = (
            f"{text[:half]}\n... [{len(text) - 2 * half:,} characters dropped] ...\n{text[-half:]}"
        )
    return text


def _main_file() -> str | None:
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    return os.path.abspath(path) if isinstance(path, str) else None


def origin(label: str | None = None) -> Origin:
    """Who this process is: pid, process name, host, the main script's absolute path, and
    ``label`` (by default the one :func:`sender_label` set in this context, if any)."""
    try:
        host = socket.gethostname()
    except OSError:
        host = "?"
    return {
        "pid": os.getpid(),
        "name": multiprocessing.current_process().name,
        "host": host,
        "main": _main_file(),
        "label": label if label is not None else _label.get(),
    }


@contextlib.contextmanager
def sender_label(label: str) -> Iterator[None]:
    """While the block runs, every payload :func:`dumps_exception` makes in this context (a
    ``Connection.send_exception`` included) carries ``label``, and the receiver's
    :class:`RemoteTraceback` names the sender by it (``Traceback from loader process 4242``).
    :func:`framepipe.guard` reports under its own label this way."""
    token = _label.set(label)
    try:
        yield
    finally:
        _label.reset(token)


# --- the sender -----------------------------------------------------------------------------

_own_resolver: Resolver | None = None


def _sender_resolver() -> Resolver:
    global _own_resolver
    main = _main_file()
    if _own_resolver is None or _own_resolver.main_file != main:
        _own_resolver = Resolver(None, main)
    return _own_resolver


def _round_trip(obj: Any, resolver: Resolver, same_type: bool = False) -> bytes | None:
    """``obj`` pickled, when the receiver's rules can load it back; else None."""
    try:
        data = pickle.dumps(obj, protocol=_PROTOCOL)
        back = load_value(data, resolver)
    except Exception:
        return None
    if same_type and type(back) is not type(obj):
        return None
    return data


def _value(obj: Any, resolver: Resolver) -> tuple[bytes | None, str]:
    return _round_trip(obj, resolver), _safe(repr, obj)


def _type_names(cls: type) -> list[tuple[str, str]]:
    """The names of ``cls`` and of the exception classes it derives from; for a stand-in,
    those of the remote class it stands for."""
    remote = getattr(cls, "_remote_mro", None)
    if remote:
        return list(remote)
    return [(c.__module__, c.__qualname__) for c in cls.__mro__ if issubclass(c, BaseException)]


def _state(exc: BaseException) -> Iterator[tuple[str, Any]]:
    """Attributes a rebuild restores: ``__dict__`` items, then slot and C-level members."""
    seen = {"__notes__"}
    for name, value in list(getattr(exc, "__dict__", {}).items()):
        if isinstance(name, str) and name not in seen:
            seen.add(name)
            yield name, value
    skipped = {BaseException, object}
    if _BaseExceptionGroup is not None:
        skipped.add(_BaseExceptionGroup)
    for cls in type(exc).__mro__:
        if cls in skipped:
            continue
        for name, descriptor in vars(cls).items():
            if (
                name in seen
                or name in _SKIPPED_MEMBERS
                or not isinstance(
                    descriptor, (types.MemberDescriptorType, types.GetSetDescriptorType)
                )
            ):
                continue
            seen.add(name)
            try:
                value = getattr(exc, name)
            except Exception:
                continue
            yield name, value


def _frames(tb: types.TracebackType | None) -> list[Frame]:
    frames: list[Frame] = []
    while tb is not None:
        code = tb.tb_frame.f_code
        module = tb.tb_frame.f_globals.get("__name__")
        frames.append(
            (
                str(code.co_filename),
                str(code.co_name),
                int(tb.tb_lineno or 0),
                module if isinstance(module, str) else "?",
            )
        )
        tb = tb.tb_next
    if len(frames) > MAX_FRAMES:
        head = MAX_FRAMES // 2
        tail = MAX_FRAMES - head
        dropped = len(frames) - MAX_FRAMES
        marker = ("<framepipe>", f"<{dropped} frames dropped>", 1, "framepipe")
        frames = frames[:head] + [marker] + frames[-tail:]
    return frames


class _Encoder:
    """Numbers every exception reachable from the root, then records each."""

    def __init__(self, root: BaseException) -> None:
        self._resolver = _sender_resolver()
        self._ids: dict[int, int] = {}
        self._order: list[BaseException] = []
        self._ref(root)
        position = 0
        while position < len(self._order):
            self._links(self._order[position])
            position += 1

    def _ref(self, exc: Any) -> int | None:
        if not isinstance(exc, BaseException):
            return None
        index = self._ids.get(id(exc))
        if index is None:
            if len(self._order) >= MAX_EXCEPTIONS:
                return None
            index = self._ids[id(exc)] = len(self._order)
            self._order.append(exc)
        return index

    def _links(self, exc: BaseException) -> None:
        for member in _members(exc) or ():
            self._ref(member)
        self._ref(exc.__cause__)
        self._ref(exc.__context__)

    def nodes(self) -> list[dict[str, Any]]:
        return [self._node(exc) for exc in self._order]

    def _node(self, exc: BaseException) -> dict[str, Any]:
        resolver = self._resolver
        node: dict[str, Any] = {
            "mro": _type_names(type(exc)),
            "str": exception_message(exc),
            "args_repr": _safe(repr, getattr(exc, "args", ())),
            "object": None if _too_deep(exc) else _round_trip(exc, resolver, same_type=True),
            "state": [(name, *_value(value, resolver)) for name, value in _state(exc)],
            "traceback": _frames(exc.__traceback__),
            "cause": self._ids.get(id(exc.__cause__)) if exc.__cause__ is not None else None,
            "context": self._ids.get(id(exc.__context__)) if exc.__context__ is not None else None,
            "suppress": bool(exc.__suppress_context__),
        }
        members = _members(exc)
        if members is not None:
            # a group's args repr holds its members' (each group nesting all below it)
            if len(node["args_repr"]) > _GROUP_ARGS_REPR:
                node["args_repr"] = node["args_repr"][:_GROUP_ARGS_REPR] + "...]"
            node["message"] = _safe(str, getattr(exc, "message", ""))
            node["members"] = [self._ids.get(id(m)) for m in members]
        else:
            node["args"] = [_value(arg, resolver) for arg in exc.args]
        notes = getattr(exc, "__notes__", None)
        if isinstance(notes, (list, tuple)):
            node["notes"] = [n if isinstance(n, str) else _safe(repr, n) for n in notes]
        return node


def _too_deep(exc: BaseException) -> bool:
    """Whether ``exc`` is a group holding groups nested past MAX_REVIVE_DEPTH: a receiver
    never revives its pickle whole (and it would grow with the square of the depth)."""
    level = [exc]
    for _ in range(MAX_REVIVE_DEPTH + 1):
        level = [m for e in level for m in _members(e) or ()]
        if not level:
            return False
        del level[MAX_EXCEPTIONS:]
    return True


def _members(exc: BaseException) -> tuple[BaseException, ...] | None:
    if _BaseExceptionGroup is not None and isinstance(exc, _BaseExceptionGroup):
        return tuple(getattr(exc, "exceptions", ()))
    return None


def _last_resort(exc: BaseException, err: BaseException, label: str | None) -> bytes:
    """A payload built from names and text only, for when recording failed."""
    try:
        node = {
            "mro": _type_names(type(exc)),
            "str": exception_message(exc),
            "args_repr": _safe(repr, getattr(exc, "args", ())),
            "args": [(None, a if isinstance(a, str) else _safe(repr, a)) for a in exc.args],
        }
        text = f"{qualified_name(type(exc))}: {node['str']}\n(recording it failed: {err!r})\n"
        envelope = {
            "format": _FORMAT,
            "root": 0,
            "nodes": [node],
            "text": text,
            "origin": origin(label),
        }
        return pickle.dumps(envelope, protocol=_PROTOCOL)
    except Exception:
        return _UNKNOWN_PAYLOAD


_UNKNOWN_PAYLOAD = pickle.dumps(
    {
        "format": _FORMAT,
        "root": 0,
        "nodes": [
            {"mro": [("builtins", "Exception")], "str": "an exception that could not be recorded"}
        ],
        "text": "(an exception that could not be recorded)\n",
        "origin": {},
    },
    protocol=_PROTOCOL,
)


def dumps_exception(exc: BaseException, *, label: str | None = None) -> bytes:
    """Serialize ``exc`` with its traceback, causes, context, notes and group members.

    Never raises (short of an interrupt): whatever cannot be recorded faithfully degrades to
    a lower layer (see the module documentation). The bytes are what
    ``Connection.send_exception`` writes in an error frame; :func:`loads_exception` revives
    them. ``label`` names the sender in the receiver's :class:`RemoteTraceback` (by default,
    the label :func:`sender_label` set in this context, if any).
    """
    try:
        encoder = _Encoder(exc)
        envelope = {
            "format": _FORMAT,
            "root": 0,
            "nodes": encoder.nodes(),
            "text": format_exception_text(exc),
            "origin": origin(label),
        }
        return pickle.dumps(envelope, protocol=_PROTOCOL)
    except Exception as err:
        return _last_resort(exc, err, label)


# --- the receiver ---------------------------------------------------------------------------


def _rebuild_standin(
    marker: type[RemoteError],
    base: type[BaseException],
    mro: tuple[tuple[str, str], ...],
    args: tuple[Any, ...],
) -> BaseException:
    return new_without_init(standin_class(marker, base, mro), args)


class _Reviver:
    """Builds the recorded exceptions within the revival bounds, then links causes, contexts
    and tracebacks. Nothing here recurses: a payload's nesting costs no Python stack.

    The plan: from the root, breadth first over members, causes and contexts, at most
    :data:`MAX_REVIVE_NODES` exceptions, and group members only :data:`MAX_REVIVE_DEPTH`
    groups deep; a group whose members lie past the depth is *cut* (a stand-in holding its own
    text). Members are built before their group (an iterative post-order); a group whose whole
    member tree is in the plan is first tried from its own pickle. Past
    :data:`MAX_REVIVE_SECONDS`, what is still to build becomes a stand-in at once."""

    def __init__(self, nodes: list[Any], resolver: Resolver, marker: type[RemoteError]) -> None:
        self._nodes = nodes
        self._resolver = resolver
        self._marker = marker
        self._objects: dict[int, BaseException] = {}
        self._planned: dict[int, int] = {}  # node -> its group depth
        self._cut: set[int] = set()  # groups whose members lie past MAX_REVIVE_DEPTH
        self._whole: dict[int, bool] = {}  # node -> its member tree is all in the plan
        self._member_lists: dict[int, list[int]] = {}
        self._deadline = time.monotonic() + MAX_REVIVE_SECONDS

    def revive(self, root: int) -> BaseException:
        if self._node(root) is None:
            raise RefusedPayload("malformed framepipe error payload: no root exception")
        self._plan(root)
        for index in self._planned:
            self._whole_tree(index)
        for index in self._planned:
            self._construct(index)
        for index, obj in list(self._objects.items()):
            self._link(index, obj)
        return self._objects[root]

    def _node(self, index: Any) -> dict[str, Any] | None:
        if isinstance(index, int) and 0 <= index < len(self._nodes):
            node = self._nodes[index]
            if isinstance(node, dict):
                return node
        return None

    def _members(self, index: int) -> list[int]:
        """The members of group ``index`` that are recorded (no more than could be revived)."""
        members = self._member_lists.get(index)
        if members is None:
            ids = self._nodes[index].get("members")
            members = [] if not isinstance(ids, list) else ids[:MAX_REVIVE_NODES]
            members = self._member_lists[index] = [i for i in members if self._node(i) is not None]
        return members

    def _plan(self, root: int) -> None:
        planned = self._planned
        planned[root] = 0
        queue = collections.deque([root])
        while queue:
            index = queue.popleft()
            depth = planned[index]
            node = self._nodes[index]
            links = [(i, depth + 1) for i in self._members(index)]
            if links and depth >= MAX_REVIVE_DEPTH:
                self._cut.add(index)
                links = []
            links += [(node.get("cause"), depth), (node.get("context"), depth)]
            for link, level in links:
                if link in planned or self._node(link) is None:
                    continue
                if len(planned) >= MAX_REVIVE_NODES:
                    return
                planned[link] = level
                queue.append(link)

    def _post_order(
        self,
        start: int,
        visit: Callable[[int], None],
        done: dict[int, Any],
        expand: Callable[[int], bool],
    ) -> None:
        """``visit`` every node of the member tree under ``start`` (in the plan, not
        ``done``), members first, going into the members of those ``expand`` says; a member
        cycle is broken where it closes."""
        on_path: set[int] = set()
        stack = [(start, False)]
        while stack:
            index, expanded = stack.pop()
            if index in done:
                continue
            if expanded:
                on_path.discard(index)
                visit(index)
                continue
            if index in on_path:
                continue
            on_path.add(index)
            stack.append((index, True))
            if expand(index):
                for member in reversed(self._members(index)):
                    if member in self._planned and member not in done and member not in on_path:
                        stack.append((member, False))

    def _whole_tree(self, start: int) -> None:
        def visit(index: int) -> None:
            self._whole[index] = index not in self._cut and all(
                self._whole.get(m, False) for m in self._members(index)
            )

        self._post_order(start, visit, self._whole, lambda index: index not in self._cut)

    def _construct(self, start: int) -> None:
        def visit(index: int) -> None:
            if index not in self._objects:
                self._objects[index] = self._build(index)

        self._post_order(start, visit, self._objects, self._open)

    def _open(self, index: int) -> bool:
        """Whether the members of ``index`` are to be built before it: not when it is cut, nor
        when it is a group revived whole from its own pickle (its members then are its own)."""
        if index in self._cut:
            return False
        if self._members(index) and self._whole.get(index) and index not in self._objects:
            self._from_pickle(index)
        return index not in self._objects

    def _from_pickle(self, index: int) -> None:
        node = self._nodes[index]
        try:
            cls = self._resolver.resolve(*self._mro(node)[0])
        except Unavailable:
            return
        obj = self._load(node, cls)
        if obj is not None:
            self._objects[index] = obj
            self._claim_members(index, obj)

    def _load(self, node: dict[str, Any], cls: type[BaseException]) -> BaseException | None:
        blob = node.get("object")
        if blob is None or time.monotonic() > self._deadline:
            return None
        try:
            obj = load_value(blob, self._resolver)
        except RefusedPayload:
            raise
        except Exception:
            return None
        return obj if type(obj) is cls else None

    def _mro(self, node: dict[str, Any]) -> tuple[tuple[str, str], ...]:
        mro = node.get("mro")
        names = (
            [e for e in mro if isinstance(e, tuple) and len(e) == 2]
            if isinstance(mro, list)
            else []
        )
        return tuple(names) or (("builtins", "Exception"),)

    def _build(self, index: int) -> BaseException:
        node = self._nodes[index]
        mro = self._mro(node)
        if index in self._cut or time.monotonic() > self._deadline:
            return self._standin(index, mro)
        try:
            cls: type[BaseException] | None = self._resolver.resolve(*mro[0])
        except Unavailable:
            cls = None
        if cls is not None:
            obj = None if self._members(index) else self._load(node, cls)
            if obj is not None:
                return obj
            try:
                obj = new_without_init(cls, self._args(index))
            except RefusedPayload:
                raise
            except Exception:
                pass
            else:
                self._restore(obj, node)
                return obj
        return self._standin(index, mro)

    def _claim_members(self, index: int, group: BaseException) -> None:
        """Give the members of an unpickled group the node numbers they were recorded under."""
        pending = [(index, group)]
        while pending:
            parent, obj = pending.pop()
            for member_index, member in zip(self._members(parent), getattr(obj, "exceptions", ())):
                if member_index in self._planned and member_index not in self._objects:
                    self._objects[member_index] = member
                    pending.append((member_index, member))

    def _value(self, value: Any) -> Any:
        if not (isinstance(value, tuple) and len(value) == 2):
            return None
        blob, text = value
        if blob is not None:
            try:
                return load_value(blob, self._resolver)
            except RefusedPayload:
                raise
            except Exception:
                pass
        return text

    def _args(self, index: int) -> tuple[Any, ...]:
        node = self._nodes[index]
        if isinstance(node.get("members"), list):
            members = [] if index in self._cut else self._members(index)
            revived = [self._objects[m] for m in members if m in self._objects]
            return (str(node.get("message", "")), revived)
        args = node.get("args")
        return tuple(self._value(a) for a in args) if isinstance(args, list) else ()

    def _restore(self, obj: BaseException, node: dict[str, Any]) -> dict[str, str]:
        """Set the recorded attributes that revive; returns every attribute's repr."""
        texts: dict[str, str] = {}
        state = node.get("state")
        for entry in state if isinstance(state, list) else ():
            if not (isinstance(entry, tuple) and len(entry) == 3 and isinstance(entry[0], str)):
                continue
            name, blob, text = entry
            texts[name] = str(text)
            try:
                setattr(obj, name, self._value((blob, text)))
            except RefusedPayload:
                raise
            except Exception:
                pass
        return texts

    def _bases(self, mro: tuple[tuple[str, str], ...]) -> Iterator[type[BaseException]]:
        for module, qualname in mro[1:]:
            try:
                yield self._resolver.resolve(module, qualname)
            except Unavailable:
                continue
        if ("builtins", "Exception") in mro:
            yield Exception
        yield BaseException

    def _standin(self, index: int, mro: tuple[tuple[str, str], ...]) -> BaseException:
        node = self._nodes[index]
        args = self._args(index)
        obj: BaseException | None = None
        for base in self._bases(mro):
            for attempt in (args, tuple(_safe(repr, a) for a in args)):
                try:
                    obj = new_without_init(standin_class(self._marker, base, mro), attempt)
                    break
                except Exception:
                    continue
            if obj is not None:
                break
        assert obj is not None  # BaseException always takes string args
        texts = self._restore(obj, node)
        obj.remote_type = _dotted(*mro[0])  # type: ignore[attr-defined]
        obj.remote_args = str(node.get("args_repr", "()"))  # type: ignore[attr-defined]
        obj.remote_attrs = texts  # type: ignore[attr-defined]
        obj.remote_message = str(node.get("str", ""))  # type: ignore[attr-defined]
        return obj

    def _link(self, index: int, obj: BaseException) -> None:
        node = self._nodes[index]
        try:
            notes = node.get("notes")
            kept = [n for n in notes if isinstance(n, str)] if isinstance(notes, list) else None
            if index in self._cut:
                kept = [*(kept or ()), _CUT_NOTE]
            if kept is not None:
                obj.__notes__ = kept  # type: ignore[attr-defined,unused-ignore]  # 3.10
            if time.monotonic() <= self._deadline:
                tb = traceback_of(node.get("traceback"))
                if tb is not None:
                    obj.__traceback__ = tb
            cause = self._objects.get(node.get("cause"))  # type: ignore[arg-type,unused-ignore]
            context = self._objects.get(node.get("context"))  # type: ignore[arg-type,unused-ignore]
            if cause is not None:
                obj.__cause__ = cause
            if context is not None:
                obj.__context__ = context
            obj.__suppress_context__ = bool(node.get("suppress", False))
        except Exception:
            pass


_CUT_NOTE = (
    "(framepipe: the exceptions nested in this group lie past the revival bounds and were not "
    "revived; the whole traceback text is in the RemoteTraceback at the end of the cause chain)"
)


def _dotted(module: str, qualname: str) -> str:
    return qualname if module == "builtins" else f"{module}.{qualname}"


def _chain_end(exc: BaseException) -> BaseException:
    """The last exception of the chain a traceback printout follows from ``exc``."""
    seen = {id(exc)}
    while True:
        nxt = exc.__cause__
        if nxt is None and not exc.__suppress_context__:
            nxt = exc.__context__
        if nxt is None or id(nxt) in seen:
            return exc
        seen.add(id(nxt))
        exc = nxt


def revive(
    data: bytes | bytearray | memoryview,
    *,
    allow: Allow | None = None,
    imports: Imports | None = False,
    marker: type[RemoteError] = RemoteError,
    trace: Callable[[str, int | None, str | None, str | None], BaseException] = RemoteTraceback,
) -> BaseException:
    """:func:`loads_exception` with the stand-in marker class and the type ending the cause
    chain chosen by the caller (``framepipe.compat`` uses its reference names)."""
    envelope = load_envelope(data, _FORMAT)
    place = envelope.get("origin")
    place = place if isinstance(place, dict) else {}
    main = place.get("main")
    resolver = Resolver(allow, main if isinstance(main, str) else None, imports)
    root = envelope.get("root", 0)
    exc = _Reviver(envelope["nodes"], resolver, marker).revive(root if isinstance(root, int) else 0)
    pid, name, host = place.get("pid"), place.get("name"), place.get("host")
    label = place.get("label")
    try:
        end = trace(
            str(envelope.get("text", "")),
            pid if isinstance(pid, int) else None,
            name if isinstance(name, str) else None,
            host if isinstance(host, str) else None,
        )
        if isinstance(end, RemoteTraceback) and isinstance(label, str):
            end.label = label
        _chain_end(exc).__cause__ = end
    except Exception:
        pass
    return exc


def loads_exception(
    data: bytes | bytearray | memoryview,
    *,
    allow: Allow | None = None,
    imports: Imports | None = False,
) -> BaseException:
    """Revive an exception serialized by :func:`dumps_exception`; returns it (raise it).

    The result is the original class when it can be revived here (unpickled, else rebuilt
    without ``__init__``), else a :class:`RemoteError` stand-in that is an instance of the
    nearest base class that can; its traceback shows the sender's frames, and its cause chain
    ends in a :class:`RemoteTraceback` naming the sender's pid, process name and host (and
    the label of the guard that reported it).

    ``allow`` narrows which classes revive (an iterable of classes and module prefixes;
    ``["builtins"]`` revives builtin exceptions only); others become stand-ins whose base is
    allowed. Raises :class:`RefusedPayload` when the payload names anything but exception
    classes, or is not an error payload; nothing it names is called.

    Nothing is imported to find a class: a class whose module this process has not imported
    becomes a stand-in (importing it would run that module's code, chosen by the sender).
    ``imports`` opts in: module prefixes that may be imported (``["myapp"]``), or True for any
    module; modules named with a dunder part (``pkg.__main__``) are never imported. Revival is
    bounded (:data:`MAX_REVIVE_NODES` exceptions, groups :data:`MAX_REVIVE_DEPTH` deep,
    :data:`MAX_REVIVE_SECONDS` seconds): what lies past the bounds degrades to stand-ins, and
    the whole traceback text stays in the :class:`RemoteTraceback`.
    """
    return revive(data, allow=allow, imports=imports)
