"""The one switch between the compiled core and its pure-Python twin.

``FRAMEPIPE_NO_EXTENSIONS=1`` forces the twin; a missing or broken extension falls back to it;
``FRAMEPIPE_REQUIRE_EXTENSIONS=1`` turns a missing extension into an ImportError (CI and wheels).
No other module imports ``framepipe._core`` directly: they ask :func:`load` or use :data:`core`.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

NO_EXTENSIONS = bool(os.environ.get("FRAMEPIPE_NO_EXTENSIONS"))
REQUIRE_EXTENSIONS = bool(os.environ.get("FRAMEPIPE_REQUIRE_EXTENSIONS"))

_MODULES = {"c": "framepipe._core", "python": "framepipe._pycore"}


def load(name: str) -> ModuleType:
    """The core module of one implementation, ``"c"`` or ``"python"`` (for tests and benchmarks
    that compare the two in one process). Raises ImportError when it is not available."""
    try:
        return importlib.import_module(_MODULES[name])
    except KeyError:
        raise ValueError(f"unknown implementation {name!r}; expected 'c' or 'python'") from None


def available() -> list[str]:
    """The implementations that import here, compiled first."""
    names = []
    for name in _MODULES:
        try:
            load(name)
        except ImportError:
            continue
        names.append(name)
    return names


def _select() -> tuple[ModuleType, str]:
    if NO_EXTENSIONS:
        if REQUIRE_EXTENSIONS:
            raise ImportError(
                "FRAMEPIPE_NO_EXTENSIONS and FRAMEPIPE_REQUIRE_EXTENSIONS are both set; unset one"
            )
        return load("python"), "python"
    try:
        return load("c"), "c"
    except ImportError as exc:
        if REQUIRE_EXTENSIONS:
            raise ImportError(
                "FRAMEPIPE_REQUIRE_EXTENSIONS=1 but the compiled core framepipe._core does not "
                f"import ({exc}); rebuild with a C compiler and Cython: pip install ."
            ) from exc
        return load("python"), "python"


core, implementation = _select()
