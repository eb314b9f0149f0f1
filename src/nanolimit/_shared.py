"""Pieces both twins share: errors, the algorithm names, clocks, protocols,
validation and header rendering.

Nothing here is on the per-decision hot path of the native twin; the native
core re-implements the checks it needs in C and uses these only to build
error messages and to configure itself.
"""

from __future__ import annotations

import enum
import math
import operator
import threading
import time
from array import array
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, SupportsIndex, cast, runtime_checkable

if TYPE_CHECKING:
    from ._decision_py import Decision

__all__ = [
    "LIMITER_CLASS_NAMES",
    "MAX_COST",
    "MAX_KEY_BYTES",
    "MAX_LIMIT",
    "MAX_LOG_CAPACITY",
    "MAX_TIME",
    "MAX_WINDOW",
    "MIN_WINDOW",
    "Algorithm",
    "BatchResult",
    "Clock",
    "CompoundDecision",
    "FakeClock",
    "KernelStorage",
    "KernelVerdict",
    "LimiterConfig",
    "LimiterState",
    "RateLimiter",
    "Storage",
    "SystemClock",
    "UnknownAlgorithmError",
    "ValidationError",
    "check_bounds",
    "check_cutoff",
    "check_now",
    "compound_items",
    "decide_async",
    "render_headers",
    "storage_key",
]

# Bounds keep every value the kernels compute exact in IEEE double and int64,
# which is what lets the C kernels, this reference and Lua agree bit for bit.
MAX_LIMIT = (1 << 32) - 1  # window counts are uint32 in the native entry
MAX_COST = MAX_LIMIT
MIN_WINDOW = 1e-6
MAX_WINDOW = 1e9
# GCRA counts integer microseconds; they must stay below 2**53.
MAX_TIME = float(1 << 53) / 1_000_000.0 / 2.0
MAX_KEY_BYTES = 1024
# The sliding log stores one double per unit: 16M units is 128 MiB per key.
MAX_LOG_CAPACITY = 1 << 24
# How far a key's stamp may run ahead of the clock before the excess is taken
# as the clock's error (a bad NTP step forward and back): within it, per-key
# time stands still; beyond it, the key's state moves back to the clock with
# its debt kept (docs/algorithms.md, "Clock faults").
MAX_CLOCK_LEAD = 60.0


class ValidationError(ValueError):
    """Bad input: raised before any state is touched."""


class UnknownAlgorithmError(ValidationError):
    """An algorithm name that is not one of :class:`Algorithm`."""


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
        """Accept an :class:`Algorithm` or its string name; anything else is an error."""
        if isinstance(name, Algorithm):
            return name
        try:
            return cls(name)
        except ValueError:
            known = ", ".join(a.value for a in cls)
            raise UnknownAlgorithmError(f"unknown algorithm {name!r}; expected one of: {known}") from None


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


# --------------------------------------------------------------------------
# Clocks


@runtime_checkable
class Clock(Protocol):
    """Anything with ``now() -> float`` seconds."""

    def now(self) -> float: ...


class SystemClock:
    """Wall-clock seconds (``time.time()``).

    Wall time rather than a monotonic clock, because the reset header is a Unix
    time and a shared store compares instances by it; a backward step never
    hands out budget because every key keeps its own monotonic time. The native
    twin recognises this class and reads the same clock in C.
    """

    __slots__ = ()

    def now(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "SystemClock()"


class FakeClock:
    """A clock that moves only when told to: for tests, replays and demos."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def set(self, t: float) -> None:
        self._now = float(t)

    def advance(self, dt: float) -> None:
        self._now += float(dt)

    def __repr__(self) -> str:
        return f"FakeClock({self._now!r})"


def check_now(now: object) -> float:
    """Return ``now`` as a float, or raise if a clock produced nonsense.

    A non-finite time would turn into NaN budgets; an absurdly large one would
    overflow the integer window index and GCRA's microseconds.
    """
    if isinstance(now, bool) or not isinstance(now, (int, float)):
        raise ValidationError(f"clock returned {type(now).__name__}, expected float seconds")
    value = float(now)
    if not math.isfinite(value):
        raise ValidationError(f"clock returned a non-finite time: {value!r}")
    if not -MAX_TIME < value < MAX_TIME:
        raise ValidationError(f"clock returned {value!r}, outside ±{MAX_TIME:.0f} s")
    return value


ON_FULL_POLICIES = ("evict", "deny_new")


def check_bounds(
    max_keys: object, on_full: object, evict_idle_after: object
) -> tuple[int | None, str, float | None]:
    """Validate the bounded-memory options of an InMemoryStorage."""
    if max_keys is not None and (isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1):
        raise ValidationError(f"max_keys must be an int >= 1 or None, got {max_keys!r}")
    if on_full not in ON_FULL_POLICIES:
        raise ValidationError(f"on_full must be one of {ON_FULL_POLICIES}, got {on_full!r}")
    idle: float | None = None
    if evict_idle_after is not None:
        if isinstance(evict_idle_after, bool) or not isinstance(evict_idle_after, (int, float)):
            raise ValidationError(f"evict_idle_after must be seconds or None, got {evict_idle_after!r}")
        idle = float(evict_idle_after)
        if not math.isfinite(idle) or idle <= 0:
            raise ValidationError(f"evict_idle_after must be finite and > 0, got {evict_idle_after!r}")
    assert isinstance(on_full, str)
    return max_keys, on_full, idle


def check_batch(keys: Sequence[Any], costs: Sequence[Any], capacity: int, max_key_bytes: int) -> list[int]:
    """Every key and cost of a batch, checked before any is spent; returns
    the costs as converted (see ``check_cost``): use those, not ``costs``."""
    if len(costs) != len(keys):
        raise ValidationError(f"{len(keys)} keys but {len(costs)} costs")
    units = []
    for key, cost in zip(keys, costs):
        check_key(key, max_key_bytes)
        units.append(check_cost(cost, capacity))
    return units


# A bounded stripe holds at least this many keys (or all of max_keys): a full
# stripe then has keys to choose a victim among, and a partly spent key is not
# forgotten just because it is alone in its stripe when a newcomer lands there.
MIN_KEYS_PER_STRIPE = 16


def stripes_within(stripes: int, max_keys: int | None) -> int:
    """The stripe count a bounded storage uses: at most one stripe per
    ``MIN_KEYS_PER_STRIPE`` keys of ``max_keys`` (so never more stripes than
    keys), the largest power of two not above that when ``stripes`` is more."""
    if max_keys is not None:
        most = max(1, max_keys // MIN_KEYS_PER_STRIPE)
        if most < stripes:
            return 1 << (most.bit_length() - 1)
    return stripes


def check_cutoff(cutoff: object) -> float:
    """An eviction cutoff: any number but NaN (``inf`` forgets every key)."""
    if isinstance(cutoff, bool) or not isinstance(cutoff, (int, float)):
        raise ValidationError(f"cutoff must be a number of seconds, got {type(cutoff).__name__}")
    value = float(cutoff)
    if math.isnan(value):
        raise ValidationError("cutoff must not be NaN")
    return value


# --------------------------------------------------------------------------
# Configuration


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
        window = float(window_seconds)
        if not math.isfinite(window) or window <= 0:
            raise ValidationError(f"window_seconds must be finite and > 0, got {window!r}")
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


def check_cost(cost: object, capacity: int) -> int:
    """docs/spec.md §3: an int in [1, capacity], returned as an exact ``int``.

    The value is converted exactly once, by ``operator.index`` (which copies
    an ``int`` subclass's value without calling its ``__int__``), and the
    converted value is what is checked and what every caller must use: an
    ``int`` subclass whose ``__int__`` lies cannot pass as 1 and be charged
    as -5. ``bool`` is refused; numpy integers and ``__index__`` objects are
    accepted by their index."""
    if isinstance(cost, bool):
        raise ValidationError(f"cost must be an int, got {type(cost).__name__}")
    try:
        units = operator.index(cast(SupportsIndex, cost))
    except TypeError:
        raise ValidationError(f"cost must be an int, got {type(cost).__name__}") from None
    if units <= 0:
        raise ValidationError(f"cost must be >= 1, got {units}")
    if units > capacity:
        raise ValidationError(f"cost {units} exceeds the capacity {capacity}: it could never pass")
    return units


def check_key(key: object, max_key_bytes: int) -> bytes:
    """docs/spec.md §3 plus hostile-key hygiene: a non-empty str that encodes to UTF-8
    within ``max_key_bytes``. Returns the encoded bytes."""
    if not isinstance(key, str):
        raise ValidationError(f"key must be a str, got {type(key).__name__}")
    try:
        raw = key.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError("key is not valid Unicode (lone surrogate)") from None
    if not raw:
        raise ValidationError("key must not be empty")
    if len(raw) > max_key_bytes:
        raise ValidationError(f"key is {len(raw)} bytes of UTF-8, over the limit of {max_key_bytes}")
    return raw


# --------------------------------------------------------------------------
# State snapshots and batch results


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


class BatchResult(Sequence["Decision"]):
    """The answer to ``allow_many``: flat arrays, one slot per request.

    Keeping arrays instead of N Decision objects is what makes a batch cheap;
    ``result[i]`` builds the full Decision only when someone asks for it.
    ``degraded`` says whether any request was answered by a policy;
    ``reasons`` maps each such request's index to its reason (sparse: a
    policy answers rarely), so ``result[i]`` is degraded only if it was
    (``None``: no per-request detail, every request shares ``degraded``).
    """

    __slots__ = (
        "_decision",
        "allowed",
        "degraded",
        "delay",
        "limit",
        "reasons",
        "remaining",
        "reset_after",
        "retry_after",
        "rule",
        "window",
    )

    allowed: array[int]
    remaining: array[int]
    retry_after: array[float]
    reset_after: array[float]
    delay: array[float]

    def __init__(
        self,
        decision_type: Callable[..., Decision],
        limit: int,
        rule: str,
        window: float,
        allowed: array[int],
        remaining: array[int],
        retry_after: array[float],
        reset_after: array[float],
        delay: array[float],
        degraded: bool = False,
        reasons: dict[int, str] | None = None,
    ) -> None:
        self._decision = decision_type
        self.degraded = degraded or bool(reasons)
        # without per-request reasons, a degraded batch marks every request
        self.reasons: dict[int, str] | None = reasons
        self.limit = limit
        self.rule = rule
        self.window = window
        self.allowed = allowed
        self.remaining = remaining
        self.retry_after = retry_after
        self.reset_after = reset_after
        self.delay = delay

    def __len__(self) -> int:
        return len(self.allowed)

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = range(len(self))[index.__index__()]  # negative indexes, IndexError
        if self.reasons is None:
            degraded, reason = self.degraded, ""
        else:
            degraded, reason = i in self.reasons, self.reasons.get(i, "")
        return self._decision(
            bool(self.allowed[i]),
            self.limit,
            self.remaining[i],
            self.retry_after[i],
            self.reset_after[i],
            self.rule,
            self.window,
            self.delay[i],
            degraded,
            reason,
        )

    def __iter__(self) -> Iterator[Decision]:
        for i in range(len(self)):
            yield self[i]

    @property
    def allowed_count(self) -> int:
        """How many requests of the batch were admitted."""
        return sum(self.allowed)

    def __repr__(self) -> str:
        return f"<BatchResult n={len(self)} allowed={self.allowed_count} rule={self.rule!r}>"


# --------------------------------------------------------------------------
# Headers


def render_headers(
    allowed: bool,
    limit: int,
    remaining: int,
    retry_after: float,
    reset_after: float,
    rule: str,
    window: float,
    wall_now: float | None = None,
) -> dict[str, str]:
    """docs/spec.md §2: the GitHub-style trio, the IETF draft-10 pair, and Retry-After."""
    if wall_now is None:
        wall_now = time.time()
    left = max(0, remaining)
    headers = {
        "X-RateLimit-Limit": str(limit),
        "X-RateLimit-Remaining": str(left),
        "X-RateLimit-Reset": str(math.ceil(wall_now + reset_after)),
        "RateLimit-Policy": f'"{rule}";q={limit};w={max(1, math.ceil(window))}',
        "RateLimit": f'"{rule}";r={left};t={math.ceil(reset_after)}',
    }
    if not allowed:
        headers["Retry-After"] = str(max(1, math.ceil(retry_after)))
    return headers


# --------------------------------------------------------------------------
# Protocols


@runtime_checkable
class Storage(Protocol):
    """Per-key state with one contract: read, decide and write are one atomic
    step per key (docs/spec.md §5)."""

    def apply(self, key: str, now: float, mutate: Callable[[Any], tuple[Any, Any]]) -> Any: ...

    def evict_idle(self, cutoff: float) -> int: ...

    def __len__(self) -> int: ...


# What a kernel answers: (allowed, remaining before floor, retry_after,
# reset_after, delay, degraded), and, when a policy answered, its reason
# ("store_unavailable", "storage_full") seventh.
KernelVerdict = (
    tuple[bool, float, float, float, float, bool] | tuple[bool, float, float, float, float, bool, str]
)

# Decision.reason when a failure policy answered for a store that could not
# decide (docs/spec.md §2 degraded decisions).
REASON_STORE_UNAVAILABLE = "store_unavailable"


def decision_from_verdict(decision_type: Callable[..., Any], cfg: LimiterConfig, v: Sequence[Any]) -> Any:
    """A ``decision_type`` (either twin's Decision) from a kernel verdict:
    remaining floored and never below 0 (docs/spec.md §2), and the degraded flag and
    reason when a policy answered."""
    return decision_type(
        v[0],
        cfg.capacity,
        max(0, math.floor(v[1])),
        v[2],
        v[3],
        cfg.rule,
        cfg.window_seconds,
        v[4],
        len(v) > 5 and bool(v[5]),
        v[6] if len(v) > 6 else "",
    )


@runtime_checkable
class KernelStorage(Storage, Protocol):
    """A storage that runs the built-in kernels itself, next to its data (a
    Lua script in Redis), so limiters never hand it a Python closure.

    ``now`` is the limiter's clock reading, or ``None`` when the limiter uses
    the default :class:`SystemClock` and the storage should use its own clock
    (Redis: the server's ``TIME``, one clock for every gateway instance).
    """

    def run_kernel(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict: ...

    def run_kernel_many(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> list[KernelVerdict]: ...

    def run_kernel_all(
        self, items: Sequence[tuple[LimiterConfig, str, int]], now: float | None
    ) -> list[KernelVerdict]:
        """All-or-nothing: every item is committed only if every item allows."""
        ...

    def forget(self, config: LimiterConfig, key: str) -> None: ...

    def snapshot(self, config: LimiterConfig, key: str, now: float | None) -> LimiterState | None: ...


class CompoundDecision:
    """The answer to a request bound by several limits at once.

    It passed only if every limit allowed, and then every limit was charged;
    if any denied, none was (``decisions`` then hold what each would have
    answered). ``limit``, ``remaining``, ``rule``, ``window`` and the
    headers describe one limit, the binding one, so a client never reads one
    rule's name with another's quota: when denied, the denial with the
    longest ``retry_after`` (``denied_by``); when allowed, the limit with the
    smallest remaining. ``retry_after``, ``reset_after`` and ``delay`` are
    the longest over all limits.
    """

    __slots__ = ("_binding", "allowed", "decisions", "denied_by")

    def __init__(self, decisions: Sequence[Decision]) -> None:
        if not decisions:
            raise ValidationError("a compound decision needs at least one decision")
        self.decisions = tuple(decisions)
        self.allowed = all(d.allowed for d in self.decisions)
        denied = [d for d in self.decisions if not d.allowed]
        self.denied_by: str | None = None
        if denied:
            self._binding = max(denied, key=lambda d: d.retry_after)
            self.denied_by = self._binding.rule
        else:
            self._binding = min(self.decisions, key=lambda d: d.remaining)

    @property
    def limit(self) -> int:
        return self._binding.limit

    @property
    def remaining(self) -> int:
        return self._binding.remaining

    @property
    def rule(self) -> str:
        return self._binding.rule

    @property
    def window(self) -> float:
        return self._binding.window

    @property
    def retry_after(self) -> float:
        return max(d.retry_after for d in self.decisions)

    @property
    def reset_after(self) -> float:
        return max(d.reset_after for d in self.decisions)

    @property
    def delay(self) -> float:
        return max(d.delay for d in self.decisions)

    @property
    def degraded(self) -> bool:
        return any(d.degraded for d in self.decisions)

    def headers(self, wall_now: float | None = None) -> dict[str, str]:
        """docs/spec.md §2 headers of the binding limit (its own reset; Retry-After
        is the longest wait, which is the binding denial's)."""
        b = self._binding
        return render_headers(
            self.allowed, b.limit, b.remaining, self.retry_after, b.reset_after, b.rule, b.window, wall_now
        )

    def __repr__(self) -> str:
        return (
            f"<CompoundDecision allowed={self.allowed} denied_by={self.denied_by!r} "
            f"remaining={self.remaining} retry_after={self.retry_after!r}>"
        )


def compound_items(requests: Any) -> list[tuple[Any, str, int]]:
    """Normalise ``[(limiter, key), (limiter, key, cost), ...]``."""
    items: list[tuple[Any, str, int]] = []
    for request in requests:
        if not isinstance(request, tuple) or len(request) not in (2, 3):
            raise ValidationError("each compound request is (limiter, key) or (limiter, key, cost)")
        limiter, key = request[0], request[1]
        cost = request[2] if len(request) == 3 else 1
        items.append((limiter, key, cost))
    if not items:
        raise ValidationError("a compound request needs at least one limiter")
    return items


DUPLICATE_COMPOUND = "the same rule and key appear twice in one compound request"


async def decide_async(limiter: Any, key: str, cost: int, commit: bool) -> Any:
    """``allow_async`` / ``peek_async`` of either twin.

    A storage with ``run_kernel_async`` (``AsyncRedisStorage``) is awaited;
    any other answers at once through the synchronous path (the in-memory
    store decides in well under a microsecond and does no I/O, so it never
    blocks the event loop).
    """
    storage = limiter.storage
    run = getattr(storage, "run_kernel_async", None)
    if run is None:
        return limiter.allow(key, cost) if commit else limiter.peek(key, cost)
    check_key(key, getattr(storage, "max_key_bytes", MAX_KEY_BYTES))
    cost = check_cost(cost, limiter.capacity)
    clock = limiter.clock
    now = None if type(clock) is SystemClock else check_now(clock.now())
    verdict = await run(limiter.config, key, cost, now, commit)
    return limiter._decision(verdict)


@runtime_checkable
class RateLimiter(Protocol):
    """What every limiter answers, whichever twin and algorithm."""

    @property
    def limit(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def window_seconds(self) -> float: ...

    @property
    def rule(self) -> str: ...

    def allow(self, key: str, cost: int = 1) -> Any: ...

    def peek(self, key: str, cost: int = 1) -> Any: ...

    def reset(self, key: str) -> None: ...

    def allow_many(self, keys: Sequence[str], costs: Sequence[int] | None = None) -> BatchResult: ...


class LockedCounter:
    """The pure-Python stand-in for ``nanolimit._core.EventCounter``."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, amount: int = 1) -> None:
        with self._lock:
            self.value += amount


def event_counter() -> Any:
    """A counter for a hot path: atomic in C when the native twin is in use,
    a locked Python int otherwise."""
    from ._select import native_core  # late: the twins import this module

    core = native_core()
    return LockedCounter() if core is None else core.EventCounter()
