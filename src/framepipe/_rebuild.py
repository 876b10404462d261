"""Exception objects and tracebacks rebuilt without running their code, for the receiver of
:mod:`framepipe.remote`: an instance made without ``__init__``, the stand-in class of an
exception that cannot be revived (still an instance of the nearest base the receiver has),
and real traceback objects from recorded frames (tblib)."""

from __future__ import annotations

import types
from typing import Any

import tblib

__all__ = ["new_without_init", "standin_class", "traceback_of"]


def new_without_init(cls: type[BaseException], args: tuple[Any, ...]) -> BaseException:
    """An instance of ``cls`` holding ``args``, made without calling ``__init__``."""
    try:
        obj = cls.__new__(cls, *args)
    except Exception:  # noqa: BLE001 - a class's own __new__ may refuse anything
        solid = next(c for c in cls.__mro__ if c.__module__ == "builtins")
        try:
            obj = solid.__new__(cls, *args)
        except Exception:  # noqa: BLE001 - then without the args
            obj = solid.__new__(cls)  # type: ignore[call-overload]
    if not isinstance(obj, cls):
        raise TypeError(f"{cls.__qualname__}.__new__ returned {type(obj).__qualname__}")
    obj.args = args
    return obj


_standin_classes: dict[tuple[Any, ...], type[BaseException]] = {}


def standin_class(
    marker: type[BaseException], base: type[BaseException], mro: tuple[tuple[str, str], ...]
) -> type[BaseException]:
    key = (marker, base, mro)
    cls = _standin_classes.get(key)
    if cls is None:
        module, qualname = mro[0]
        namespace = {
            "__module__": module,
            "__qualname__": qualname,
            "_remote_mro": mro,
            "_remote_parts": (marker, base),
            "__doc__": f"Stand-in for {module}.{qualname}, which could not be revived here.",
        }
        cls = types.new_class(
            qualname.rpartition(".")[2], (marker, base), exec_body=lambda ns: ns.update(namespace)
        )
        if len(_standin_classes) > 1024:
            _standin_classes.clear()
        _standin_classes[key] = cls
    return cls


def traceback_of(frames: Any) -> types.TracebackType | None:
    """Real traceback objects for the recorded frames (tblib)."""
    if not isinstance(frames, list):
        return None
    chain: dict[str, Any] | None = None
    for frame in reversed(frames):
        if not (isinstance(frame, tuple) and len(frame) == 4):
            continue
        filename, name, lineno, module = frame
        if not (isinstance(filename, str) and isinstance(name, str) and isinstance(module, str)):
            continue
        line = lineno if isinstance(lineno, int) and lineno > 0 else 1
        chain = {
            "tb_frame": {
                "f_globals": {"__name__": module, "__file__": filename},
                "f_locals": {},
                "f_code": {"co_filename": filename, "co_name": name},
                "f_lineno": line,
            },
            "tb_lineno": line,
            "tb_next": chain,
        }
    if chain is None:
        return None
    try:
        tb: types.TracebackType | None = tblib.Traceback.from_dict(chain).as_traceback()
    except Exception:  # noqa: BLE001 - frames that make no traceback: the text still has them
        return None
    return tb
