"""A standard library module imported on first use.

asyncio (with ssl, which it imports) is about 8 MB of memory and 30 ms of import, and only the
async methods need it. A worker process imports the classes that have those methods but never
runs one, and every megabyte it carries makes it slower to start and slower to die: the kernel
frees its pages before anyone can see the death. So the modules that use asyncio name it
through :func:`lazy_module`, and import it only when an async method first runs.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["lazy_module"]


class _LazyModule:
    """Stands for a module until an attribute is first read: then imports it and keeps each
    attribute read, so later reads are plain attribute look-ups."""

    def __init__(self, name: str) -> None:
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr: str) -> Any:
        value = getattr(importlib.import_module(self.__dict__["_lazy_name"]), attr)
        self.__dict__[attr] = value
        return value

    def __repr__(self) -> str:
        return f"<module {self.__dict__['_lazy_name']!r}, imported on first use>"


def lazy_module(name: str) -> Any:
    """``name``, imported when one of its attributes is first read."""
    return _LazyModule(name)
