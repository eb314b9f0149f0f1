"""The errors of the core: bad input is a ``ValidationError`` (a ``ValueError``),
raised before any state is touched (docs/spec.md §3).
"""

from __future__ import annotations

__all__ = ["UnknownAlgorithmError", "ValidationError"]


class ValidationError(ValueError):
    """Bad input: raised before any state is touched."""


class UnknownAlgorithmError(ValidationError):
    """An algorithm name that is not one of :class:`Algorithm`."""
