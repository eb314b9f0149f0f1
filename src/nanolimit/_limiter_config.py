"""A limiter's configuration (the algorithm names, ``LimiterConfig`` with the
numbers the kernels need computed once) and ``LimiterState``, the snapshot of
one key's state.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from ._validation import MAX_LIMIT, MAX_LOG_CAPACITY, MAX_WINDOW, MIN_WINDOW, _shown, as_float
from .errors import UnknownAlgorithmError, ValidationError

__all__ = [
    "BURST_ALGORITHMS",
    "LIMITER_CLASS_NAMES",
    "Algorithm",
    "LimiterConfig",
    "LimiterState",
    "storage_key",
]


class Algorithm(str, enum.Enum):
    """The six decision kernels, by the names rules and config files use."""

    TOKEN_BUCKET = "token_bucket"
    LEAKY_BUCKET = "leaky_bucket"
    FIXED_WINDOW = "fixed_window"
    SLIDING_LOG = "sliding_log"
    SLIDING_COUNTER = "sliding_counter"
    GCRA = "gcra"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, name: Algorithm | str) -> Algorithm:
        """Accept an :class:`Algorithm` or its name as people write it:
        ``"token_bucket"``, ``"Token Bucket"``, ``"TOKEN-BUCKET"`` (case, and
        ``-``, ``_`` or spaces between words, are not what users mean to
        choose), and the ``limits`` library's names (``fixed-window``,
        ``moving-window``, ``sliding-window-counter``), so a rule ported from
        flask-limiter or slowapi keeps its algorithm. ``"sliding-window"``
        alone is refused: it means either of two kernels that differ in
        exactness and memory, and guessing would change what is enforced.
        Every refusal lists what is accepted."""
        if isinstance(name, Algorithm):
            return name
        try:
            return cls(name)
        except ValueError:
            pass
        if isinstance(name, str):
            words = _words(name)
            spelled = _ALIASES.get(words)
            if spelled is not None:
                return cls(spelled)
            if words == "sliding window":
                raise UnknownAlgorithmError(
                    f"ambiguous algorithm {name!r}: say sliding_log (every admitted unit's timestamp "
                    "over the trailing window: exact; limits' moving-window) or sliding_counter (this "
                    "window's and the last window's counts, weighted: approximate, two counters; "
                    f"limits' sliding-window-counter); {_ACCEPTED}"
                )
        raise UnknownAlgorithmError(f"unknown algorithm {name!r}; {_ACCEPTED}")


def _words(name: str) -> str:
    """A name with case, ``-``, ``_`` and runs of spaces taken out of it."""
    return " ".join(name.lower().replace("-", " ").replace("_", " ").split())


# Every spelling Algorithm.parse accepts, by its words: our names, and the
# names the ``limits`` library (flask-limiter, slowapi) gives its strategies.
_ALIASES: dict[str, str] = {_words(a.value): a.value for a in Algorithm}
_ALIASES.update(
    {
        "moving window": Algorithm.SLIDING_LOG.value,  # limits' exact trailing window
        "sliding window counter": Algorithm.SLIDING_COUNTER.value,  # limits' weighted two counters
    }
)
_ACCEPTED = (
    f"expected one of: {', '.join(a.value for a in Algorithm)} (any case; '-', '_' or ' ' between words), "
    "or the limits library's fixed-window, moving-window (= sliding_log), "
    "sliding-window-counter (= sliding_counter)"
)


# The limiter class of each algorithm, by name: both twins export these.
LIMITER_CLASS_NAMES: dict[str, str] = {
    "token_bucket": "TokenBucket",
    "leaky_bucket": "LeakyBucket",
    "fixed_window": "FixedWindowCounter",
    "sliding_log": "SlidingWindowLog",
    "sliding_counter": "SlidingWindowCounter",
    "gcra": "GCRA",
}


# Algorithms whose capacity is the burst rather than the limit (docs/spec.md §1).
BURST_ALGORITHMS = frozenset({Algorithm.TOKEN_BUCKET, Algorithm.GCRA})


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{name} must be an int, got {type(value).__name__}")
    if value <= 0:
        raise ValidationError(f"{name} must be >= 1, got {value}")
    if value > MAX_LIMIT:
        raise ValidationError(f"{name} must be <= {MAX_LIMIT}, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class LimiterConfig:
    """A validated limiter configuration, with every derived constant the
    kernels need computed once, in the order docs/spec.md §4 writes them."""

    algorithm: Algorithm
    limit: int
    window_seconds: float
    burst: int | None
    rule: str
    capacity: int
    rate: float
    gcra_interval_us: int
    gcra_tolerance_us: int

    @classmethod
    def build(
        cls,
        algorithm: Algorithm | str,
        limit: object,
        window_seconds: object,
        burst: object = None,
        rule: object = "",
    ) -> LimiterConfig:
        algo = Algorithm.parse(algorithm)
        lim = _check_count("limit", limit)
        if isinstance(window_seconds, bool) or not isinstance(window_seconds, (int, float)):
            raise ValidationError(f"window_seconds must be a number, got {type(window_seconds).__name__}")
        window = as_float(window_seconds)
        if not math.isfinite(window) or window <= 0:
            raise ValidationError(f"window_seconds must be finite and > 0, got {_shown(window_seconds)}")
        if not MIN_WINDOW <= window <= MAX_WINDOW:
            raise ValidationError(
                f"window_seconds must be within [{MIN_WINDOW}, {MAX_WINDOW:.0f}], got {window!r}"
            )
        if burst is not None:
            burst = _check_count("burst", burst)
            if algo not in BURST_ALGORITHMS:
                raise ValidationError(f"burst applies to token_bucket and gcra only, not {algo.value}")
        if not isinstance(rule, str):
            raise ValidationError(f"rule must be a str, got {type(rule).__name__}")
        if type(rule) is not str:
            # its characters: a subclass's __eq__/__hash__/__format__ would pick the state
            # namespace (the reference shared another rule's), and the native core refused it
            rule = str.__str__(rule)
        capacity = burst if (burst is not None and algo in BURST_ALGORITHMS) else lim
        assert isinstance(capacity, int)
        rate = lim / window
        interval = max(1, math.floor(window * 1000000.0 / lim + 0.5))
        tolerance = interval * capacity
        if algo is Algorithm.SLIDING_LOG and capacity > MAX_LOG_CAPACITY:
            raise ValidationError(
                f"sliding_log keeps one timestamp per unit; limit {capacity} is over {MAX_LOG_CAPACITY}"
            )
        if algo is Algorithm.GCRA and tolerance >= 1 << 53:
            raise ValidationError(
                "gcra burst tolerance exceeds 2**53 microseconds; shorten the window or the burst"
            )
        return cls(algo, lim, window, burst, rule, capacity, rate, interval, tolerance)


def storage_key(algorithm: Algorithm, rule: str, key: str) -> str:
    """The name a limiter's state has in a storage: algorithm and rule are part
    of it, so two rules never share state and an algorithm change never reads
    another algorithm's state. The rule's length makes the split unambiguous."""
    return f"{algorithm.value}:{len(rule)}:{rule}:{key}"


@dataclass(frozen=True, slots=True)
class LimiterState:
    """A snapshot of one key's state, for debugging, tests and migrations.

    Only the fields of its algorithm are set; ``updated_at`` is the key's own
    monotonic time (docs/spec.md §4).
    """

    algorithm: Algorithm
    updated_at: float
    level: float | None = None
    window_index: int | None = None
    count: int | None = None
    previous: int | None = None
    tat: int | None = None
    log: tuple[float, ...] | None = None
