"""Build the compiled core: Cython glue (src/framepipe/_core.pyx) over plain C (csrc/*.c).

Where the C comes from:
- Cython installed (a checkout: the build backend in tools/ asks for it): the .pyx is compiled
  to C here, which is also how the sdist gets its src/framepipe/_core.c;
- no Cython (an sdist, which carries that generated C): the generated C is compiled as it is.

Beside the engine, one small extension in plain C (no Cython): framepipe._fault_echo
(csrc/fault_echo/), which copies a guarded process's native crash dump to its stderr; the guard
uses it with either engine, and without it the dump reaches the parent only.

When the C cannot be compiled (no compiler, no Python headers), the pure-Python core is installed
instead, with one warning saying so and how to get the compiled one. Environment:
- FRAMEPIPE_NO_EXTENSIONS=1: build no extension at all (the pure-Python core only);
- FRAMEPIPE_REQUIRE_EXTENSIONS=1: a compiled core that cannot be built is an error (CI, wheels).
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext
from setuptools.errors import CCompilerError, ExecError, PlatformError

HERE = os.path.dirname(os.path.abspath(__file__))
PYX = "src/framepipe/_core.pyx"
# Not part of the engine: the guard uses it with either engine (see csrc/fault_echo/).
FAULT_ECHO = "csrc/fault_echo/fault_echo.c"
GENERATED_C = "src/framepipe/_core.c"
NO_EXTENSIONS = bool(os.environ.get("FRAMEPIPE_NO_EXTENSIONS"))
REQUIRE_EXTENSIONS = bool(os.environ.get("FRAMEPIPE_REQUIRE_EXTENSIONS"))
MAKING_SDIST = "sdist" in sys.argv[1:]
# Metadata steps (egg_info, dist_info) run this file too: only a build may warn or fail.
BUILDING = bool(
    {"build", "build_ext", "bdist_wheel", "install", "develop", "editable_wheel"}
    & set(sys.argv[1:])
)
# `python setup.py build_ext --inplace` (a developer's build) fails loudly instead of falling back.
STRICT = REQUIRE_EXTENSIONS or "build_ext" in sys.argv[1:]

HOW_TO_FIX = (
    "For the compiled core, install a C compiler and the Python headers (Debian and Ubuntu: "
    "apt-get install gcc python3-dev; Fedora: dnf install gcc python3-devel), then reinstall "
    "without pip's cache: pip install --no-cache-dir --force-reinstall framepipe"
)


class BuildError(RuntimeError):
    """The compiled core was required (FRAMEPIPE_REQUIRE_EXTENSIONS=1) and could not be built."""


def _cython():
    """Cython's ``cythonize``, or None when Cython 3 is not installed."""
    try:
        import Cython
        from Cython.Build import cythonize
    except ImportError:
        return None
    if int(Cython.__version__.split(".")[0]) < 3:
        return None
    return cythonize


def _extensions() -> list[Extension]:
    if NO_EXTENSIONS and not MAKING_SDIST:
        return []
    os.chdir(HERE)  # the paths below are relative to the project, as setuptools requires
    csources = sorted(glob.glob("csrc/*.c"))
    options = dict(
        include_dirs=["csrc"], extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"]
    )
    # Plain C against the Python API: built wherever the compiler is, with or without Cython.
    fault_echo = Extension("framepipe._fault_echo", sources=[FAULT_ECHO], **options)
    cythonize = _cython()
    if cythonize is not None and os.path.exists(PYX):
        return [
            *cythonize(
                [Extension("framepipe._core", sources=[PYX, *csources], **options)],
                compiler_directives={"language_level": "3", "embedsignature": True},
            ),
            fault_echo,
        ]
    if MAKING_SDIST:
        raise BuildError(
            "an sdist must carry the C generated from src/framepipe/_core.pyx, and Cython 3 is "
            "not installed here: pip install 'Cython>=3.0' (or build with python -m build, "
            "which installs it)"
        )
    if os.path.exists(GENERATED_C):
        return [
            Extension("framepipe._core", sources=[GENERATED_C, *csources], **options),
            fault_echo,
        ]
    message = (
        f"neither Cython 3 nor the generated {GENERATED_C} is here, so the compiled core "
        "cannot be built: pip install 'Cython>=3.0', or build from the sdist"
    )
    if not BUILDING:
        return []  # a metadata step: the build proper runs this file again, with Cython if asked
    if STRICT:
        raise BuildError(f"{_who()} but {message}")
    _warn(message)
    return [fault_echo]


def _who() -> str:
    if REQUIRE_EXTENSIONS:
        return "FRAMEPIPE_REQUIRE_EXTENSIONS=1"
    return "setup.py build_ext was run"


def _warn(reason: str) -> None:
    line = "=" * 78
    sys.stderr.write(
        f"\n{line}\nWARNING: framepipe installs its pure-Python core: {reason}.\n"
        'It behaves the same and is slower (framepipe.implementation says "python").\n'
        f"{HOW_TO_FIX}\nSet FRAMEPIPE_REQUIRE_EXTENSIONS=1 to make this an error.\n{line}\n\n"
    )


class build_ext(_build_ext):
    """Builds the compiled core, or falls back to the pure-Python one with one warning."""

    def run(self) -> None:
        try:
            super().run()
        except (CCompilerError, ExecError, PlatformError) as exc:
            self._give_up(exc)

    def build_extension(self, ext: Extension) -> None:
        if getattr(self, "_gave_up", False):
            return  # one warning, not one per extension
        try:
            super().build_extension(ext)
        except (CCompilerError, ExecError, PlatformError) as exc:
            self._give_up(exc)

    def _give_up(self, exc: Exception) -> None:
        reason = f"the C compiler failed ({exc})"
        if STRICT:
            raise BuildError(
                f"{_who()} but the compiled core cannot be built: {reason}. {HOW_TO_FIX}"
            ) from exc
        _warn(reason)
        # Nothing else to build: the package is complete without the extensions.
        self._gave_up = True
        self.extensions = []


setup(ext_modules=_extensions(), cmdclass={"build_ext": build_ext})
