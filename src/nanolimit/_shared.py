"""The names both twins and the layers above them import, in one place.

What used to live here now lives in modules by what it holds: ``_errors``,
``_clocks``, ``_validation``, ``_limiter_config``, ``_protocols`` and the
pure-Python twin's answers in ``_decision_py``. This module re-exports them,
so the native core, the layers above and pickles that name
``nanolimit._shared`` keep working.
"""

from __future__ import annotations

from ._clocks import (
    MAX_CLOCK_LEAD as MAX_CLOCK_LEAD,
)
from ._clocks import (
    MAX_TIME as MAX_TIME,
)
from ._clocks import (
    Clock as Clock,
)
from ._clocks import (
    FakeClock as FakeClock,
)
from ._clocks import (
    SystemClock as SystemClock,
)
from ._clocks import (
    check_now as check_now,
)
from ._decision_py import (
    REASON_STORE_ERROR as REASON_STORE_ERROR,
)
from ._decision_py import (
    REASON_STORE_UNAVAILABLE as REASON_STORE_UNAVAILABLE,
)
from ._decision_py import (
    BatchResult as BatchResult,
)
from ._decision_py import (
    CompoundDecision as CompoundDecision,
)
from ._decision_py import (
    KernelVerdict as KernelVerdict,
)
from ._decision_py import (
    decision_from_verdict as decision_from_verdict,
)
from ._decision_py import (
    render_headers as render_headers,
)
from ._limiter_config import (
    BURST_ALGORITHMS as BURST_ALGORITHMS,
)
from ._limiter_config import (
    LIMITER_CLASS_NAMES as LIMITER_CLASS_NAMES,
)
from ._limiter_config import (
    Algorithm as Algorithm,
)
from ._limiter_config import (
    LimiterConfig as LimiterConfig,
)
from ._limiter_config import (
    LimiterState as LimiterState,
)
from ._limiter_config import (
    _check_count as _check_count,
)
from ._limiter_config import (
    storage_key as storage_key,
)
from ._protocols import (
    KernelStorage as KernelStorage,
)
from ._protocols import (
    LockedCounter as LockedCounter,
)
from ._protocols import (
    RateLimiter as RateLimiter,
)
from ._protocols import (
    Storage as Storage,
)
from ._protocols import (
    decide_async as decide_async,
)
from ._protocols import (
    event_counter as event_counter,
)
from ._validation import (
    DUPLICATE_COMPOUND as DUPLICATE_COMPOUND,
)
from ._validation import (
    MAX_COST as MAX_COST,
)
from ._validation import (
    MAX_KEY_BYTES as MAX_KEY_BYTES,
)
from ._validation import (
    MAX_LIMIT as MAX_LIMIT,
)
from ._validation import (
    MAX_LOG_CAPACITY as MAX_LOG_CAPACITY,
)
from ._validation import (
    MAX_STRIPES as MAX_STRIPES,
)
from ._validation import (
    MAX_WINDOW as MAX_WINDOW,
)
from ._validation import (
    MIN_KEYS_PER_STRIPE as MIN_KEYS_PER_STRIPE,
)
from ._validation import (
    MIN_WINDOW as MIN_WINDOW,
)
from ._validation import (
    ON_FULL_POLICIES as ON_FULL_POLICIES,
)
from ._validation import (
    check_batch as check_batch,
)
from ._validation import (
    check_bounds as check_bounds,
)
from ._validation import (
    check_cost as check_cost,
)
from ._validation import (
    check_cutoff as check_cutoff,
)
from ._validation import (
    check_key as check_key,
)
from ._validation import (
    check_storage_options as check_storage_options,
)
from ._validation import (
    compound_items as compound_items,
)
from ._validation import (
    stripes_within as stripes_within,
)
from .errors import UnknownAlgorithmError as UnknownAlgorithmError
from .errors import ValidationError as ValidationError
