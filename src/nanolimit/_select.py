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
from typing import Any

from ._protocols import LockedCounter

__all__ = ["NATIVE", "NO_EXTENSIONS", "event_counter", "native_core", "twin", "twin_of"]

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


def event_counter() -> Any:
    """A counter for a hot path: atomic in C when the native twin is in use,
    a locked Python int otherwise."""
    core = native_core()
    return LockedCounter() if core is None else core.EventCounter()


def twin_of(obj: object) -> ModuleType:
    """The twin ``obj`` (a storage, a limiter) belongs to, else the live twin:
    for a storage, the twin whose limiters run on its fast path (a reference
    store accepts only reference limiters in ``allow_all``); for a limiter,
    the twin whose ``Decision`` it answers."""
    module = type(obj).__module__
    if module in ("nanolimit._core", "nanolimit.reference"):
        return sys.modules[module]
    return twin
