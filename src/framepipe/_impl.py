"""The one switch between the compiled engine and its pure-Python twin.

``FRAMEPIPE_NO_EXTENSIONS=1`` forces the twin; a missing or broken extension falls back to it;
``FRAMEPIPE_REQUIRE_EXTENSIONS=1`` turns a missing extension into an ImportError (CI and wheels).
:data:`core` is the selected engine with the API written once over it (its ``Connection``,
``pipe`` and ``Pipe``); ``core.ENGINE`` (also :data:`implementation`) says which one runs. No
other module picks an engine: they use :data:`core`, or :func:`load` to compare the two.
"""

from __future__ import annotations

import os

from ._connection import ENGINE_MODULES, Core, engine_core

NO_EXTENSIONS = bool(os.environ.get("FRAMEPIPE_NO_EXTENSIONS"))
REQUIRE_EXTENSIONS = bool(os.environ.get("FRAMEPIPE_REQUIRE_EXTENSIONS"))


def load(name: str) -> Core:
    """One engine, ``"c"`` or ``"python"``, with its Connection, ``pipe`` and ``Pipe`` (for
    tests and benchmarks that compare the two in one process). Raises ImportError when it is
    not available, ValueError for another name."""
    return engine_core(name)


def available() -> list[str]:
    """The engines that import here, compiled first."""
    names = []
    for name in ENGINE_MODULES:
        try:
            load(name)
        except ImportError:
            continue
        names.append(name)
    return names


def _select() -> Core:
    if NO_EXTENSIONS:
        if REQUIRE_EXTENSIONS:
            raise ImportError(
                "FRAMEPIPE_NO_EXTENSIONS and FRAMEPIPE_REQUIRE_EXTENSIONS are both set; unset one"
            )
        return load("python")
    try:
        return load("c")
    except ImportError as exc:
        if REQUIRE_EXTENSIONS:
            raise ImportError(
                "FRAMEPIPE_REQUIRE_EXTENSIONS=1 but the compiled core framepipe._core does not "
                f"import ({exc}); rebuild with a C compiler and Cython: pip install ."
            ) from exc
        return load("python")


core = _select()
implementation = core.ENGINE
"""``"c"`` (compiled) or ``"python"`` (the twin): the engine :data:`core` runs on."""
