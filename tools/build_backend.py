"""framepipe's build backend: setuptools' own, asking for Cython only when the build needs it.

A checkout carries the Cython source (``src/framepipe/_core.pyx``) and no generated C, so its
builds need Cython. An sdist carries the generated C (``src/framepipe/_core.c``) and builds with
a C compiler alone: no Cython is fetched. With ``FRAMEPIPE_NO_EXTENSIONS=1`` a wheel needs
neither. ``setup.py`` chooses what to compile from what is installed; this module only makes
sure the build environment has it.
"""

from __future__ import annotations

import os

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F403 - every hook not redefined here is setuptools'

CYTHON = "Cython>=3.0"


def _is_sdist_with_generated_c() -> bool:
    # PKG-INFO at the top is what an unpacked sdist has and a checkout does not.
    generated = os.path.join("src", "framepipe", "_core.c")
    return os.path.exists("PKG-INFO") and os.path.exists(generated)


def _cython_for_wheel() -> list[str]:
    if os.environ.get("FRAMEPIPE_NO_EXTENSIONS") or _is_sdist_with_generated_c():
        return []
    return [CYTHON]


def get_requires_for_build_wheel(config_settings=None):
    return _setuptools.get_requires_for_build_wheel(config_settings) + _cython_for_wheel()


def get_requires_for_build_editable(config_settings=None):
    return _setuptools.get_requires_for_build_editable(config_settings) + _cython_for_wheel()


def get_requires_for_build_sdist(config_settings=None):
    # The sdist carries the C generated from the .pyx, so making one always needs Cython.
    extra = [] if _is_sdist_with_generated_c() else [CYTHON]
    return _setuptools.get_requires_for_build_sdist(config_settings) + extra
