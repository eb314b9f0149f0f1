"""Which twin is live: the one place that chooses.

The native twin (``nanolimit._core``) when it is built, else the pure-Python
twin (``nanolimit.reference``), which is also forced by
``NANOLIMIT_NO_EXTENSIONS`` (read once, at import). Every other module asks
here instead of choosing again, by name or by import attempt.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

__all__ = ["NATIVE", "NO_EXTENSIONS", "native_core", "twin", "twin_of"]

NO_EXTENSIONS = bool(os.environ.get("NANOLIMIT_NO_EXTENSIONS"))


def _choose() -> ModuleType:
    if not NO_EXTENSIONS:
        try:
            return importlib.import_module("nanolimit._core")
        except ImportError:  # not built (an sdist on an exotic interpreter): stay usable
            pass
    return importlib.import_module("nanolimit.reference")


twin: ModuleType = _choose()
NATIVE: bool = twin.IMPLEMENTATION == "native"


def native_core() -> ModuleType | None:
    """The compiled core when it is the live twin, for its C-only helpers
    (lock-free counters, admitted-request lanes, lease books)."""
    return twin if NATIVE else None


def twin_of(storage: object) -> ModuleType:
    """The twin whose limiters run on ``storage``'s fast path: the twin the
    storage belongs to (a reference store accepts only reference limiters in
    ``allow_all``), else the live twin."""
    module = type(storage).__module__
    if module in ("nanolimit._core", "nanolimit.reference"):
        return sys.modules[module]
    return twin
