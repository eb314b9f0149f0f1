"""nanolimit: rate-limit decisions made in native code.

``import nanolimit`` gives the native twin (Cython, ``nanolimit._core``) when
it is built, and the pure-Python twin (``nanolimit.reference``) otherwise or
when ``NANOLIMIT_NO_EXTENSIONS`` is set. Both export the same names; type
checkers always see the reference.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from ._shared import (
    Algorithm,
    BatchResult,
    Clock,
    CompoundDecision,
    FakeClock,
    KernelStorage,
    LimiterState,
    RateLimiter,
    Storage,
    SystemClock,
    UnknownAlgorithmError,
    ValidationError,
)
from ._version import __version__

NO_EXTENSIONS = bool(os.environ.get("NANOLIMIT_NO_EXTENSIONS"))

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
elif NO_EXTENSIONS:
    from .reference import (
        GCRA,
        IMPLEMENTATION,
        Decision,
        FixedWindowCounter,
        InMemoryStorage,
        LeakyBucket,
        SlidingWindowCounter,
        SlidingWindowLog,
        TokenBucket,
    )
else:
    try:
        from ._core import (
            GCRA,
            IMPLEMENTATION,
            Decision,
            FixedWindowCounter,
            InMemoryStorage,
            LeakyBucket,
            SlidingWindowCounter,
            SlidingWindowLog,
            TokenBucket,
        )
    except ImportError:  # not built (sdist on an exotic interpreter): stay usable
        from .reference import (
            GCRA,
            IMPLEMENTATION,
            Decision,
            FixedWindowCounter,
            InMemoryStorage,
            LeakyBucket,
            SlidingWindowCounter,
            SlidingWindowLog,
            TokenBucket,
        )

# The gateway layer: pure Python over whichever twin is live.
from .gateway.config import ConfigError, ConfigWatcher, load_rules  # noqa: E402
from .gateway.factory import LimiterFactory  # noqa: E402
from .gateway.keys import ClientKey, DefaultKeyExtractor, KeyExtractor  # noqa: E402
from .gateway.metrics import Metrics  # noqa: E402
from .gateway.middleware import Outcome, RateLimitMiddleware, Request, Response  # noqa: E402
from .gateway.rules import (  # noqa: E402
    KeyScope,
    Rate,
    RateLimitRule,
    RuleNotFoundError,
    RuleRegistry,
    RuleValidationError,
    parse_rate,
)
from .storage.redis import (  # noqa: E402
    AsyncRedisStorage,
    CircuitOpenError,
    RedisStorage,
    RedisUnavailableError,
    StorageUnavailableError,
)
from .storage.two_tier import TwoTierStorage  # noqa: E402

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
    "RateLimitMiddleware",
    "RateLimitRule",
    "RateLimiter",
    "RedisStorage",
    "RedisUnavailableError",
    "Request",
    "Response",
    "RuleNotFoundError",
    "RuleRegistry",
    "RuleValidationError",
    "SlidingWindowCounter",
    "SlidingWindowLog",
    "Storage",
    "StorageUnavailableError",
    "SystemClock",
    "TokenBucket",
    "TwoTierStorage",
    "UnknownAlgorithmError",
    "ValidationError",
    "__version__",
    "load_rules",
    "parse_rate",
]
