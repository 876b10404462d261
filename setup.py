"""Build the compiled core: Cython glue (src/framepipe/_core.pyx) over plain C (csrc/*.c).

Set FRAMEPIPE_NO_EXTENSIONS=1 to install the pure-Python implementation only.
"""
import glob
import os

from setuptools import Extension, setup

ext_modules = []
if not os.environ.get("FRAMEPIPE_NO_EXTENSIONS"):
    from Cython.Build import cythonize

    ext_modules = cythonize(
        [
            Extension(
                "framepipe._core",
                sources=["src/framepipe/_core.pyx", *sorted(glob.glob("csrc/*.c"))],
                include_dirs=["csrc"],
                extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
            )
        ],
        compiler_directives={"language_level": "3", "embedsignature": True},
    )

setup(ext_modules=ext_modules)
