"""nanolimit: rate-limit decisions made in native code.

``import nanolimit`` gives the native twin (Cython, ``nanolimit._core``) when
it is built, and the pure-Python twin (``nanolimit.reference``) otherwise or
when ``NANOLIMIT_NO_EXTENSIONS`` is set. Both export the same names; type
checkers always see the reference.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from ._clocks import Clock, FakeClock, SystemClock
from ._decision_py import BatchResult, CompoundDecision
from ._limiter_config import Algorithm, LimiterState
from ._protocols import KernelStorage, RateLimiter, Storage
from ._select import NO_EXTENSIONS as NO_EXTENSIONS
from ._select import twin as _twin
from ._version import __version__
from .errors import (
    CircuitOpenError,
    ConfigError,
    RedisUnavailableError,
    RuleNotFoundError,
    RuleValidationError,
    StorageFullError,
    StorageUnavailableError,
    UnknownAlgorithmError,
    ValidationError,
)

if TYPE_CHECKING:
    from .reference import (
        GCRA,
        Decision,
        FixedWindowCounter,
        InMemoryStorage,
        LeakyBucket,
        SlidingWindowCounter,
        SlidingWindowLog,
        TokenBucket,
    )

    IMPLEMENTATION: str
else:
    GCRA = _twin.GCRA
    IMPLEMENTATION = _twin.IMPLEMENTATION
    Decision = _twin.Decision
    FixedWindowCounter = _twin.FixedWindowCounter
    InMemoryStorage = _twin.InMemoryStorage
    LeakyBucket = _twin.LeakyBucket
    SlidingWindowCounter = _twin.SlidingWindowCounter
    SlidingWindowLog = _twin.SlidingWindowLog
    TokenBucket = _twin.TokenBucket

# The gateway layer: pure Python over whichever twin is live.
from .gateway.factory import LimiterFactory
from .gateway.keys import ClientKey, DefaultKeyExtractor, KeyExtractor
from .gateway.metrics import Metrics
from .gateway.middleware import Outcome, RateLimitPipeline, Request, Response
from .gateway.rates import parse_rates
from .gateway.registry import RuleRegistry
from .gateway.routes import RouteLimits
from .gateway.rules import KeyScope, Rate, RateLimitRule, parse_rate

# Optional layers (Redis, the two-tier store, rules files) load on first use:
# they cost most of ``import nanolimit``'s time and are not needed in memory.
_LAZY = {
    "AsyncRedisStorage": "storage.redis",
    "RedisStorage": "storage.redis",
    "SharedMemoryStorage": "storage.shared_memory",
    "storage_from_uri": "storage.uri",
    "TwoTierStorage": "storage.two_tier",
    "ConfigWatcher": "gateway.config",
    "load_rules": "gateway.config",
}

if TYPE_CHECKING:
    from .gateway.config import ConfigWatcher, load_rules
    from .gateway.middleware import RateLimitMiddleware as RateLimitMiddleware  # deprecated
    from .storage.redis import AsyncRedisStorage, RedisStorage
    from .storage.shared_memory import SharedMemoryStorage
    from .storage.two_tier import TwoTierStorage
    from .storage.uri import storage_from_uri


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        if name == "RateLimitMiddleware":
            from .gateway.middleware import RateLimitPipeline, _renamed

            if sys._getframe(1).f_globals.get("__name__") == "importlib._bootstrap":
                return RateLimitPipeline  # `from nanolimit import` asks twice: warn once, below
            return _renamed()  # warned on every use, so never cached
        raise AttributeError(f"module 'nanolimit' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "GCRA",
    "IMPLEMENTATION",
    "Algorithm",
    "AsyncRedisStorage",
    "BatchResult",
    "CircuitOpenError",
    "ClientKey",
    "Clock",
    "CompoundDecision",
    "ConfigError",
    "ConfigWatcher",
    "Decision",
    "DefaultKeyExtractor",
    "FakeClock",
    "FixedWindowCounter",
    "InMemoryStorage",
    "KernelStorage",
    "KeyExtractor",
    "KeyScope",
    "LeakyBucket",
    "LimiterFactory",
    "LimiterState",
    "Metrics",
    "Outcome",
    "Rate",
    "RateLimitPipeline",
    "RateLimitRule",
    "RateLimiter",
    "RedisStorage",
    "RedisUnavailableError",
    "Request",
    "Response",
    "RouteLimits",
    "RuleNotFoundError",
    "RuleRegistry",
    "RuleValidationError",
    "SharedMemoryStorage",
    "SlidingWindowCounter",
    "SlidingWindowLog",
    "Storage",
    "StorageFullError",
    "StorageUnavailableError",
    "SystemClock",
    "TokenBucket",
    "TwoTierStorage",
    "UnknownAlgorithmError",
    "ValidationError",
    "__version__",
    "load_rules",
    "parse_rate",
    "parse_rates",
    "storage_from_uri",
]
