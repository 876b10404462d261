"""The security boundary of exceptions across processes: what an error payload may construct.

An error payload comes from another process, which may be compromised or simply buggy, so
unpickling it must never run code the receiver did not choose. This module is the whole of
that decision; :mod:`framepipe.remote` builds and revives payloads on top of it and never
unpickles anything except through :func:`load_envelope` and :func:`load_value`.

The policy:

1. **The envelope names no global at all.** The outer pickle of a payload holds only builtin
   containers, strings, numbers and bytes; a pickle that names any global (a class, a
   function) there is refused with :class:`RefusedPayload`.
2. **Inside the envelope, a pickled value may name exception classes and nothing else.** Each
   global a value names goes through :meth:`Resolver.resolve`, which returns it only when it is
   a class deriving from ``BaseException``. Anything else (``os.system``, ``builtins.eval``,
   ``getattr``, a non-exception class) is refused with :class:`RefusedPayload` before it is
   called, and the whole payload with it.
3. **Only modules that are already imported are searched, and nothing is imported.** A class
   is looked up in ``sys.modules``, in the module's own namespace (a module's ``__getattr__``,
   which may import lazily, is never called); a module that is not imported yet, even a
   submodule of an imported package, is never imported, because importing it runs its code:
   the class degrades to a stand-in. A receiver that wants its classes imported opts in with
   ``imports`` (:data:`Imports`: module prefixes, or True for any module); even then a module
   named with a dunder part (``unittest.__main__``) or outside ``imports`` is not imported.
   ``__main__`` classes resolve only when the sender ran the same main script (same absolute
   path). Names must be identifiers; dunder attributes, ``<locals>`` and malformed names never
   resolve.
4. **The receiver may narrow further** with ``allow`` (:data:`Allow`): classes outside it are
   reported :class:`Unavailable`, and the caller degrades them to a stand-in instead of
   creating them.

What this admits, stated plainly: reviving calls the ``__new__``, ``__init__``,
``__setstate__`` and ``__reduce__`` machinery of exception classes that the receiving process
has already imported, with arguments taken from the payload (builtin values, or exceptions
under the same rules). A receiver that does not trust the exception classes of its own
imported modules with such arguments narrows them with ``allow`` (``["builtins"]`` revives
builtin exceptions only).
"""

from __future__ import annotations

import importlib
import io
import os
import pickle
import sys
import types
from collections.abc import Iterable
from typing import Any

from .errors import FramepipeError

__all__ = [
    "Allow",
    "Imports",
    "RefusedPayload",
    "Resolver",
    "RestrictedUnpickler",
    "Unavailable",
    "load_envelope",
    "load_value",
]

Allow = Iterable[type | str]
"""What ``allow=`` takes: exception classes (exactly those) and module prefixes (``"builtins"``
matches the module ``builtins``, ``"myapp"`` matches ``myapp`` and ``myapp.errors``)."""

Imports = bool | Iterable[str]
"""What ``imports=`` takes: False (import nothing, the default), module prefixes that may be
imported to find a class (``"myapp"`` admits ``myapp`` and ``myapp.errors``), or True (any
module). Modules named with a dunder part (``pkg.__main__``) are never imported."""


def _matches(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(
        module == p or module.startswith(p if p.endswith(".") else p + ".") for p in prefixes
    )


def import_prefixes(imports: Imports | None) -> tuple[str, ...] | bool:
    """``imports`` checked and normalised: False, True, or a tuple of module prefixes."""
    if imports is None or imports is False:
        return False
    if imports is True:
        return True
    entries = [imports] if isinstance(imports, str) else list(imports)
    for entry in entries:
        if not isinstance(entry, str) or not all(p.isidentifier() for p in entry.split(".")):
            raise TypeError(
                f"imports= takes True, False or module names such as 'myapp'; got {entry!r}"
            )
    return tuple(entries) or False


class RefusedPayload(FramepipeError, pickle.UnpicklingError):
    """An error payload was refused: it names a global that is not an exception class (a
    function such as ``os.system``), or it is not an error payload at all. Nothing it names
    was called."""


RefusedPayload.__module__ = "framepipe.remote"  # its public home, where users import it from


class Unavailable(Exception):
    """A class is not importable here or not allowed: the caller revives at a lower layer."""


class Resolver:
    """Finds exception classes by name, under the rules above and ``allow``.

    ``main_file`` is the absolute path of the sender's main script (``__main__`` classes
    resolve only when it is also this process's), or None.
    """

    def __init__(
        self, allow: Allow | None, main_file: str | None, imports: Imports | None = False
    ) -> None:
        self._imports = import_prefixes(imports)
        self._classes: set[type] | None = None
        self._prefixes: tuple[str, ...] = ()
        if allow is not None:
            entries = [allow] if isinstance(allow, (str, type)) else list(allow)
            self._classes = {e for e in entries if isinstance(e, type)}
            self._prefixes = tuple(e for e in entries if isinstance(e, str))
        self.main_file = main_file

    def allows(self, cls: type) -> bool:
        """Whether ``allow`` admits ``cls`` (always, without ``allow``)."""
        if self._classes is None or cls in self._classes:
            return True
        module = getattr(cls, "__module__", "") or ""
        return _matches(module, self._prefixes)

    def _may_import(self, name: str) -> bool:
        imports = self._imports
        if imports is False or any(p.startswith("__") for p in name.split(".")):
            return False
        return imports is True or _matches(name, imports)

    def _module(self, name: str) -> types.ModuleType:
        if name in ("__main__", "__mp_main__"):
            for candidate in ("__mp_main__", "__main__"):
                module = sys.modules.get(candidate)
                path = getattr(module, "__file__", None)
                if (
                    module is not None
                    and isinstance(path, str)
                    and os.path.abspath(path) == self.main_file
                ):
                    return module
            raise Unavailable(name)
        module = sys.modules.get(name)
        if isinstance(module, types.ModuleType):
            return module
        if module is None and self._may_import(name):
            try:
                return importlib.import_module(name)
            except Exception:  # noqa: BLE001 - a module that fails to import is unavailable
                pass
        raise Unavailable(name)

    def resolve(self, module: object, qualname: object) -> type[BaseException]:
        """The exception class ``module.qualname``.

        Raises :class:`Unavailable` when it cannot be found here or ``allow`` excludes it (the
        caller degrades), :class:`RefusedPayload` when the name is malformed or names anything
        but an exception class (the caller refuses the payload).
        """
        if not isinstance(module, str) or not isinstance(qualname, str):
            raise RefusedPayload(f"malformed class reference {module!r}.{qualname!r}")
        parts = qualname.split(".")
        if "<locals>" in parts:
            raise Unavailable(qualname)
        if not all(p.isidentifier() for p in module.split(".")) or not all(
            p.isidentifier() and not p.startswith("__") for p in parts
        ):
            raise RefusedPayload(f"refused to resolve {module}.{qualname}: not a class name")
        obj: object = self._module(module)
        for part in parts:
            obj = _static_attribute(obj, part, qualname)
        if not (isinstance(obj, type) and issubclass(obj, BaseException)):
            raise RefusedPayload(
                f"refused to load {module}.{qualname}: an error payload may only name exception "
                "classes, and this is not one (nothing was called)"
            )
        if not self.allows(obj):
            raise Unavailable(qualname)
        return obj


def _static_attribute(obj: object, name: str, qualname: str) -> object:
    """``obj.name`` read from the namespaces themselves: a module's ``__dict__``, or a class's
    and its bases' ``__dict__``. Nothing is called (no module ``__getattr__``, which may import
    a module, no metaclass ``__getattr__``, no descriptor)."""
    if isinstance(obj, types.ModuleType):
        # not obj.__dict__: a lazily loaded module (importlib.util.LazyLoader) would run its
        # code on that attribute access
        namespace = object.__getattribute__(obj, "__dict__")
        if isinstance(namespace, dict) and name in namespace:
            return namespace[name]
    elif isinstance(obj, type):
        for cls in obj.__mro__:
            namespace = cls.__dict__
            if name in namespace:
                return namespace[name]
    raise Unavailable(qualname)


class RestrictedUnpickler(pickle.Unpickler):
    """Resolves every global through ``resolver``, or refuses every global without one."""

    def __init__(self, data: bytes, resolver: Resolver | None) -> None:
        super().__init__(io.BytesIO(data))
        self._resolver = resolver

    def find_class(self, module: str, name: str) -> type[BaseException]:
        if self._resolver is not None:
            return self._resolver.resolve(module, name)
        raise RefusedPayload(f"refused to load {module}.{name}: not part of an error payload")


def load_value(blob: object, resolver: Resolver) -> Any:
    """Unpickle one value of a payload (its globals resolved by ``resolver``)."""
    if not isinstance(blob, bytes):
        raise RefusedPayload("malformed error payload: a pickled value is not bytes")
    return RestrictedUnpickler(blob, resolver).load()


def load_envelope(data: object, expected_format: str) -> dict[str, Any]:
    """The outer dict of a payload, unpickled with no global allowed; checks its format tag
    and that it records at least one exception. Raises :class:`RefusedPayload` otherwise."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise RefusedPayload(f"an error payload is bytes, not {type(data).__name__}")
    try:
        envelope = RestrictedUnpickler(bytes(data), None).load()
    except RefusedPayload:
        raise
    except Exception as err:  # noqa: BLE001 - any failure to unpickle refuses the payload
        raise RefusedPayload(f"not a framepipe error payload: {type(err).__name__}: {err}") from err
    if not (isinstance(envelope, dict) and envelope.get("format") == expected_format):
        raise RefusedPayload("not a framepipe error payload (unknown format)")
    if not isinstance(envelope.get("nodes"), list) or not envelope["nodes"]:
        raise RefusedPayload("malformed framepipe error payload: no exception recorded")
    return envelope
