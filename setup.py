"""Build the native core.

NANOLIMIT_NO_EXTENSIONS=1  build no extension: the pure-Python twin is used.
NANOLIMIT_DEBUG_BUILD=1    -O0 -g, asserts on, and Cython's boundscheck and
                           wraparound on (list and tuple indexing checked).
NANOLIMIT_SANITIZE=1       AddressSanitizer + UBSan (run with LD_PRELOAD of libasan).
NANOLIMIT_ANNOTATE=1       write Cython's HTML annotation next to the sources.

Floating point: -ffp-contract=off and never -ffast-math, so the C kernels and
the reference agree to the last bit (docs/spec.md §4).
"""

from __future__ import annotations

import glob
import os
import sys

from setuptools import setup


def _flag(name: str) -> bool:
    return os.environ.get(name, "").strip() not in ("", "0", "false", "no")


NO_EXTENSIONS = _flag("NANOLIMIT_NO_EXTENSIONS")
DEBUG = _flag("NANOLIMIT_DEBUG_BUILD")
SANITIZE = _flag("NANOLIMIT_SANITIZE")


def _extensions() -> list:
    from Cython.Build import cythonize
    from setuptools import Extension

    if sys.platform == "win32":
        compile_args = ["/O2", "/fp:precise"] if not DEBUG else ["/Od", "/Zi", "/fp:precise"]
        link_args: list[str] = []
    else:
        compile_args = ["-ffp-contract=off", "-fno-fast-math", "-Wall", "-Wno-unused-function"]
        compile_args += ["-O0", "-g", "-UNDEBUG"] if DEBUG else ["-O3"]
        link_args = []
        if SANITIZE:
            sanitize = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g"]
            compile_args += sanitize
            link_args += sanitize
    extension = Extension(
        "nanolimit._core",
        ["src/nanolimit/_core.pyx"],
        include_dirs=["src/nanolimit"],
        extra_compile_args=compile_args,
        extra_link_args=link_args,
        # shm_open is in librt before glibc 2.34 (the manylinux images)
        libraries=["rt"] if sys.platform.startswith("linux") else [],
        depends=[
            *sorted(glob.glob("src/nanolimit/_core_*.pxi")),
            "src/nanolimit/_native.h",
            "src/nanolimit/_decision_pool.h",
            "src/nanolimit/_types.pxd",
            "src/nanolimit/_kernels.pxd",
            "src/nanolimit/_index.pxd",
            "src/nanolimit/_evict.pxd",
            "src/nanolimit/_table.pxd",
            "src/nanolimit/_zone.pxd",
            "src/nanolimit/_zone.h",
        ],
    )
    return cythonize(
        [extension],
        # The sources leave these two to the build: unchecked in a release
        # build, checked in the debug build, where an index bug raises
        # IndexError instead of reading past a list.
        compiler_directives={"language_level": 3, "boundscheck": DEBUG, "wraparound": DEBUG},
        annotate=_flag("NANOLIMIT_ANNOTATE"),
        include_path=["src"],
    )


setup(ext_modules=[] if NO_EXTENSIONS else _extensions())
