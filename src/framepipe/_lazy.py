"""Standard library modules imported on first use: ``asyncio`` and ``hmac``.

asyncio (with ssl, which it imports) is about 8 MB of memory and 30 ms of import, and only the
async methods need it; hmac (OpenSSL's libcrypto, 3.7 MB) only the authkey handshake. A worker
process imports the classes that have those methods but may never run one, and every megabyte
it carries makes it slower to start and slower to die: the kernel frees its pages before anyone
can see the death. So the modules that use them import them from here (``from ._lazy import
asyncio``), and the real module is imported when one of its attributes is first read.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__all__ = ["asyncio", "hmac", "lazy_module"]


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


if TYPE_CHECKING:
    import asyncio as asyncio
    import hmac as hmac
else:
    asyncio = lazy_module("asyncio")
    hmac = lazy_module("hmac")
