"""Every error a user may catch, in one place: the core's, the rules', a rules
file's and a storage's. Bad input is a ``ValidationError`` (a ``ValueError``),
raised before any state is touched (docs/spec.md §3).

The framework adapters' own exceptions (``RateLimitExceeded`` and the like)
stay in their adapters. This module imports nothing, so every layer, both
twins included, raises from here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "CircuitOpenError",
    "ConfigError",
    "Problem",
    "RedisKeyError",
    "RedisUnavailableError",
    "RuleAlgorithmError",
    "RuleNotFoundError",
    "RuleValidationError",
    "StorageFullError",
    "StorageUnavailableError",
    "UnenforcedLimitWarning",
    "UnknownAlgorithmError",
    "ValidationError",
]

# --------------------------------------------------------------------------
# The core


class ValidationError(ValueError):
    """Bad input: raised before any state is touched."""


class UnknownAlgorithmError(ValidationError):
    """An algorithm name that is not one of :class:`Algorithm`."""


# --------------------------------------------------------------------------
# Rules


class RuleNotFoundError(LookupError):
    """No rule matches a request and the registry has no default rule."""


class RuleValidationError(ValidationError):
    """A rule with a bad field. ``rule`` and ``field`` name the culprit, so a
    config loader can report every problem of a file at once."""

    def __init__(self, rule: str, field: str, message: str) -> None:
        self.rule = rule
        self.field = field
        self.message = message
        super().__init__(f"rule {rule!r}: {field}: {message}")


class RuleAlgorithmError(RuleValidationError, UnknownAlgorithmError):
    """A rule naming an algorithm that does not exist (an ``UnknownAlgorithmError``)."""


class UnenforcedLimitWarning(UserWarning):
    """A limit declared on a view that runs with nothing enforcing it: the
    front end that binds declarations (the ASGI middleware with
    ``limits=``, Flask's ``init_app``, Django's middleware) is missing.
    Warned once; ``warnings.simplefilter("error", UnenforcedLimitWarning)``
    makes it an error."""


# --------------------------------------------------------------------------
# Rules files


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a rules file."""

    rule: str
    field: str
    message: str

    def __str__(self) -> str:
        return f"rule {self.rule!r}: {self.field}: {self.message}"


class ConfigError(ValidationError):
    """A rules file that cannot be used; ``problems`` lists every fault."""

    def __init__(self, source: str, problems: list[Problem]) -> None:
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: {len(problems)} problem(s):\n{lines}")


# --------------------------------------------------------------------------
# Storages


class StorageUnavailableError(RuntimeError):
    """A shared store could not answer a decision (raised only under
    ``on_error="raise"``; the other policies answer a degraded decision)."""


class StorageFullError(RuntimeError):
    """A bounded store (``max_keys``) had no room for a new key of the
    ``apply`` seam and could make none: its stripe is full of keys it may not
    forget (``on_full="deny_new"``, keys in debt, other ``apply`` keys).
    ``mutate`` ran, but its new state was not stored: nothing changed."""


class RedisUnavailableError(StorageUnavailableError):
    """Redis/Valkey failed, timed out, or is behind an open circuit breaker."""


class CircuitOpenError(RedisUnavailableError):
    """The circuit breaker is open: the store was not even asked."""


class RedisKeyError(RedisUnavailableError):
    """The server answered this one call with an error about the key, not
    about itself: a value of another type at the limiter's key (``WRONGTYPE``),
    a stored state the limiter did not write (``BADSTATE``), a write refused
    for memory (``OOM``) or persistence (``MISCONF``), an ACL refusal
    (``NOPERM``), a script error. Raised only under ``on_error="raise"``,
    but for ``NOPERM`` (a wrong ACL, which would otherwise fail open or shut
    silently), raised under every policy; it never feeds the circuit breaker
    (``code`` is the reply's error code)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code
