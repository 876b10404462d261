"""The one switch between the compiled engine and its pure-Python twin.

``FRAMEPIPE_NO_EXTENSIONS=1`` forces the twin; a missing or broken extension falls back to it
with one RuntimeWarning (an install without a C compiler); ``FRAMEPIPE_REQUIRE_EXTENSIONS=1``
turns a missing extension into an ImportError (CI and wheels).
:data:`core` is the selected engine's Connection module (``framepipe._connection_c`` or
``framepipe._connection_py``: its ``Connection``, ``pipe`` and ``Pipe``); ``core.ENGINE`` (also
:data:`implementation`) says which one runs. No other module picks an engine: they use
:data:`core`, or :func:`load` to compare the two.
"""

from __future__ import annotations

import os
import sys
import warnings

from ._connection import ENGINE_MODULES, EngineConnections, load_engine

NO_EXTENSIONS = bool(os.environ.get("FRAMEPIPE_NO_EXTENSIONS"))
REQUIRE_EXTENSIONS = bool(os.environ.get("FRAMEPIPE_REQUIRE_EXTENSIONS"))

# Set in the environment once the fallback has been warned about, so that the processes this
# one starts (spawned workers import framepipe again) do not repeat the warning.
FALLBACK_WARNED = "FRAMEPIPE_FALLBACK_WARNED"

_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def load(name: str) -> EngineConnections:
    """One engine, ``"c"`` or ``"python"``: the module of its Connection, ``pipe`` and ``Pipe``
    (for tests and benchmarks that compare the two in one process). Raises ImportError when it
    is not available, ValueError for another name."""
    return load_engine(name)


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


def _select() -> EngineConnections:
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
        _warn_fallback(exc)
        return load("python")


def _is_import_machinery(filename: str) -> bool:
    # As the warnings module decides which frames to leave out when it counts a stacklevel.
    return "importlib" in filename and "_bootstrap" in filename


def _importer_stacklevel() -> int:
    """The stacklevel that makes a warning raised by this function's caller name the first
    frame outside framepipe: the line that imported framepipe. The warnings module skips the
    import machinery's frames when it counts, so they are not counted here either."""
    level = 1
    frame = sys._getframe(1)
    while frame.f_back is not None:
        if not os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
            break
        frame = frame.f_back
        while frame.f_back is not None and _is_import_machinery(frame.f_code.co_filename):
            frame = frame.f_back
        level += 1
    return level


def _warn_fallback(exc: ImportError) -> None:
    """Say once that the compiled core was expected and is missing, and how to get it."""
    if os.environ.get(FALLBACK_WARNED):
        return
    warnings.warn(
        f"framepipe's compiled core (framepipe._core) is missing ({exc}), so framepipe runs "
        "on its pure-Python core, which behaves the same but is slower. To get the compiled "
        "core, install a C compiler and the Python headers (Debian and Ubuntu: apt-get install "
        "gcc python3-dev) and reinstall framepipe without pip's cache (pip install "
        "--force-reinstall --no-deps --no-cache-dir framepipe, or pip install . in a "
        "checkout); or set FRAMEPIPE_NO_EXTENSIONS=1 to choose the pure-Python core and "
        "silence this warning.",
        RuntimeWarning,
        stacklevel=_importer_stacklevel(),
    )
    os.environ[FALLBACK_WARNED] = "1"


core = _select()
implementation = core.ENGINE
"""``"c"`` (compiled) or ``"python"`` (the twin): the engine :data:`core` runs on."""
