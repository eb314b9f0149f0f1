"""The pure-Python twin: the oracle for the native core, and the fallback when
the extension is not built.

Every kernel here is docs/spec.md §4 written literally, in the same order of floating
point operations as ``_kernels.pxd``; the equivalence tests hold the two to
1e-9 s and to identical ``allowed``/``remaining``. Readability beats speed in
this module: change a formula here and in the C kernel together, or not at all.
"""

from __future__ import annotations

import math
import sys
import threading
from array import array
from collections import deque
from collections.abc import Callable, Container, Coroutine, Sequence
from itertools import islice
from typing import Any, ClassVar

from ._clocks import MAX_CLOCK_LEAD, Clock, FakeClock, SystemClock, check_now
from ._decision_py import BatchResult, CompoundDecision, Decision, KernelVerdict, decision_from_verdict
from ._limiter_config import Algorithm, LimiterConfig, LimiterState, storage_key
from ._protocols import (
    KernelStorage,
    RateLimiter,
    Storage,
    check_at,
    decide_async,
    refund_async,
    refund_kernel_of,
)
from ._validation import (
    DUPLICATE_COMPOUND,
    MAX_KEY_BYTES,
    batch_keys,
    check_batch,
    check_cost,
    check_cutoff,
    check_key,
    check_storage_options,
    compound_items,
)
from .errors import StorageFullError, UnknownAlgorithmError, ValidationError

__all__ = [
    "GCRA",
    "Algorithm",
    "BatchResult",
    "Clock",
    "CompoundDecision",
    "Decision",
    "FakeClock",
    "FixedWindowCounter",
    "InMemoryStorage",
    "KernelStorage",
    "LeakyBucket",
    "LimiterState",
    "RateLimiter",
    "SlidingWindowCounter",
    "SlidingWindowLog",
    "Storage",
    "SystemClock",
    "TokenBucket",
    "UnknownAlgorithmError",
    "ValidationError",
]

IMPLEMENTATION = "reference"
# Keys a full table looks at to make room, as the native table's scan (16)
# plus sample (8) do.
EVICTION_LOOK = 24
EVICTION_COUNTERS = ("evicted_at_rest", "evicted_active", "evicted_idle", "denied_new")


class _KeyState:
    """One key's state: each algorithm uses its own fields (the native
    entry's union, ``_types.pxd``, holds the same numbers)."""

    __slots__ = ("count", "level", "log", "previous", "tat", "updated_at", "window_index")

    def __init__(
        self,
        updated_at: float,
        *,
        level: float = 0.0,
        tat: int = 0,
        window_index: int = 0,
        count: int = 0,
        previous: int = 0,
    ) -> None:
        self.updated_at = updated_at
        self.level = level  # token and leaky bucket
        self.tat = tat  # GCRA: theoretical arrival time, integer µs
        self.window_index = window_index  # fixed window and sliding counter
        self.count = count
        self.previous = previous  # sliding counter: the previous window's count
        self.log: deque[float] | None = None  # sliding log: stamps, oldest first

    def copy(self) -> _KeyState:
        twin = _KeyState(
            self.updated_at,
            level=self.level,
            tat=self.tat,
            window_index=self.window_index,
            count=self.count,
            previous=self.previous,
        )
        if self.log is not None:
            twin.log = deque(self.log)
        return twin

    def __reduce__(self) -> Any:
        fields = (self.level, self.tat, self.window_index, self.count, self.previous)
        return (_restore_fields, (self.updated_at, fields, self.log))


def _restore_fields(updated_at: float, fields: tuple[Any, ...], log: Any) -> _KeyState:
    level, tat, window_index, count, previous = fields
    state = _KeyState(
        updated_at, level=level, tat=tat, window_index=window_index, count=count, previous=previous
    )
    state.log = None if log is None else deque(log)
    return state


def _restore_state(updated_at: float, a: Any, b: int, c: int, log: Any) -> _KeyState:
    """Pickles made before the fields had names stored (a, b, c): a was the
    level, the TAT or the window index, whichever the algorithm kept."""
    state = _KeyState(updated_at, level=float(a), tat=int(a), window_index=int(a), count=b, previous=c)
    state.log = None if log is None else deque(log)
    return state


def _exact_key(key: object, max_key_bytes: int) -> str:
    """A checked key (``check_key``) as an exact ``str`` of its characters.

    The native table names a key by its UTF-8 bytes; the dicts here would
    use a ``str`` subclass's own ``__hash__``/``__eq__`` (and ``storage_key``
    its ``__format__``), letting one key read another's state or a
    duplicate slip past a compound's check. ``str.__str__`` copies the
    characters and calls no override."""
    check_key(key, max_key_bytes)
    assert isinstance(key, str)
    return key if type(key) is str else str.__str__(key)


# (allowed, remaining before floor, retry_after, reset_after, delay[, degraded,
# reason[, at]]): a kernel answers the first five; ``_decide`` adds the rest.
Verdict = tuple[Any, ...]

# What a bounded table answers for a new key it has no room for.
STORAGE_FULL: Verdict = (False, 0.0, 1.0, 0.0, 0.0, True, "storage_full")


def _new_state(cfg: LimiterConfig, now: float) -> _KeyState:
    algo = cfg.algorithm
    if algo is Algorithm.TOKEN_BUCKET:
        return _KeyState(now, level=float(cfg.capacity))
    if algo is Algorithm.LEAKY_BUCKET:
        return _KeyState(now, level=0.0)
    if algo is Algorithm.GCRA:
        return _KeyState(now, tat=math.floor(now * 1000000.0))
    if algo is Algorithm.SLIDING_LOG:
        state = _KeyState(now)
        state.log = deque()
        return state
    # fixed window and sliding counter: window index, count, previous
    return _KeyState(now, window_index=math.floor(now / cfg.window_seconds))


# --------------------------------------------------------------------------
# Kernels: docs/spec.md §4, literally. ``now`` is already max(clock, updated_at).


def _token_bucket(s: _KeyState, now: float, cost: int, cfg: LimiterConfig) -> Verdict:
    capacity = float(cfg.capacity)
    rate = cfg.rate
    elapsed = now - s.updated_at
    level = s.level + elapsed * rate
    if level > capacity:
        level = capacity
    retry_after = 0.0
    allowed = level >= cost
    if allowed:
        level = level - cost
    else:
        retry_after = (cost - level) / rate
    s.level = level
    return allowed, level, retry_after, (capacity - level) / rate, 0.0


def _leaky_bucket(s: _KeyState, now: float, cost: int, cfg: LimiterConfig) -> Verdict:
    capacity = float(cfg.capacity)
    rate = cfg.rate
    elapsed = now - s.updated_at
    level = s.level - elapsed * rate
    if level < 0.0:
        level = 0.0
    room = capacity - level
    delay = 0.0
    retry_after = 0.0
    allowed = cost <= room
    if allowed:
        delay = level / rate
        level = level + cost
        remaining = capacity - level
    else:
        remaining = room
        retry_after = (cost - room) / rate
    s.level = level
    return allowed, remaining, retry_after, level / rate, delay


def _fixed_window(s: _KeyState, now: float, cost: int, cfg: LimiterConfig) -> Verdict:
    window = cfg.window_seconds
    capacity = cfg.capacity
    index = math.floor(now / window)
    if index != s.window_index:
        s.window_index = index
        s.count = 0
    start = float(s.window_index) * window
    retry_after = 0.0
    allowed = s.count + cost <= capacity
    if allowed:
        s.count += cost
    else:
        retry_after = start + window - now
    reset_after = start + window - now if s.count > 0 else 0.0
    return allowed, float(capacity - s.count), retry_after, reset_after, 0.0


def _sliding_log(s: _KeyState, now: float, cost: int, cfg: LimiterConfig) -> Verdict:
    window = cfg.window_seconds
    capacity = cfg.capacity
    log = s.log
    assert log is not None
    while len(log) > capacity:  # capacity lowered by a hot reload: keep the newest
        log.popleft()
    cutoff = now - window
    while log and log[0] <= cutoff:
        log.popleft()
    retry_after = 0.0
    allowed = len(log) + cost <= capacity
    if allowed:
        log.extend([now] * cost)
        remaining = float(capacity - len(log))
    else:
        remaining = 0.0
        retry_after = log[len(log) + cost - capacity - 1] + window - now
    reset_after = log[-1] + window - now if log else 0.0
    return allowed, remaining, retry_after, reset_after, 0.0


def _sliding_counter(s: _KeyState, now: float, cost: int, cfg: LimiterConfig) -> Verdict:
    window = cfg.window_seconds
    capacity = cfg.capacity
    index = math.floor(now / window)
    if index != s.window_index:
        s.previous = s.count if index == s.window_index + 1 else 0
        s.count = 0
        s.window_index = index
    count = s.count
    previous = s.previous
    start = float(s.window_index) * window
    weight = 1.0 - (now - start) / window
    estimate = float(previous) * weight + float(count)
    retry_after = 0.0
    allowed = estimate + float(cost) <= float(capacity)
    if allowed:
        count += cost
        s.count = count
        remaining = float(capacity) - estimate - float(cost)
    else:
        remaining = float(capacity) - estimate
        room = capacity - count - cost
        if previous <= 0 or room < 0:
            retry_after = start + window - now
        else:
            retry_after = start + window * (1.0 - float(room) / float(previous)) - now
    if count > 0:
        reset_after = start + 2.0 * window - now
    elif previous > 0:
        reset_after = start + window - now
    else:
        reset_after = 0.0
    return allowed, remaining, retry_after, reset_after, 0.0


def _gcra(s: _KeyState, now: float, cost: int, cfg: LimiterConfig) -> Verdict:
    interval = cfg.gcra_interval_us
    tolerance = cfg.gcra_tolerance_us
    now_us = math.floor(now * 1000000.0)
    backlog = max(0, s.tat - now_us)
    retry_after = 0.0
    allowed = backlog + interval * cost <= tolerance
    if allowed:
        backlog = backlog + interval * cost
        s.tat = now_us + backlog
    else:
        retry_after = (backlog + interval * cost - tolerance) / 1000000.0
    remaining = (tolerance - backlog) // interval
    return allowed, float(remaining), retry_after, backlog / 1000000.0, 0.0


_KERNELS: dict[Algorithm, Callable[[_KeyState, float, int, LimiterConfig], Verdict]] = {
    Algorithm.TOKEN_BUCKET: _token_bucket,
    Algorithm.LEAKY_BUCKET: _leaky_bucket,
    Algorithm.FIXED_WINDOW: _fixed_window,
    Algorithm.SLIDING_LOG: _sliding_log,
    Algorithm.SLIDING_COUNTER: _sliding_counter,
    Algorithm.GCRA: _gcra,
}


def _rebase(s: _KeyState, clock_now: float, cfg: LimiterConfig) -> None:
    """The key's stamp is more than ``MAX_CLOCK_LEAD`` ahead of the clock:
    take the lead as the clock's error and move the state back by it, debt
    kept (matches ``_kernels.clock_rebase``)."""
    lead = s.updated_at - clock_now
    algo = cfg.algorithm
    if algo is Algorithm.GCRA:
        s.tat = s.tat - (math.floor(s.updated_at * 1000000.0) - math.floor(clock_now * 1000000.0))
    elif algo is Algorithm.FIXED_WINDOW or algo is Algorithm.SLIDING_COUNTER:
        window = cfg.window_seconds
        s.window_index = s.window_index - (math.floor(s.updated_at / window) - math.floor(clock_now / window))
    elif algo is Algorithm.SLIDING_LOG and s.log:
        s.log = deque(stamp - lead for stamp in s.log)
    s.updated_at = clock_now


def _add_lead(verdict: Verdict, lead: float) -> Verdict:
    """Durations are measured from the key's time, which stands ``lead``
    ahead of the clock: a truthful answer adds it (``_kernels.add_clock_lead``)."""
    allowed, remaining, retry_after, reset_after, delay = verdict
    return (
        allowed,
        remaining,
        retry_after + lead if retry_after > 0.0 else retry_after,
        reset_after + lead if reset_after > 0.0 else reset_after,
        delay + lead if delay > 0.0 else delay,
    )


def _decide(
    state: _KeyState | None, clock_now: float, cost: int, cfg: LimiterConfig
) -> tuple[_KeyState, Verdict]:
    """Bring the key to ``now`` (never backwards, and never more than
    ``MAX_CLOCK_LEAD`` ahead of the clock), run the kernel, stamp it."""
    if state is None:
        state = _new_state(cfg, clock_now)
    elif state.updated_at - clock_now > MAX_CLOCK_LEAD:
        _rebase(state, clock_now, cfg)
    now = max(clock_now, state.updated_at)
    verdict = _KERNELS[cfg.algorithm](state, now, cost, cfg)
    state.updated_at = now
    if now > clock_now:
        verdict = _add_lead(verdict, now - clock_now)
    return state, (*verdict, False, "", now)


# --------------------------------------------------------------------------
# Refunds: give back what an admitted decision made at ``at`` charged
# (docs/algorithms.md, Refunds). ``now`` is max(clock, updated_at), as for a
# decision; the caller stamps ``updated_at = now`` afterwards. The native
# twin's ``refund_kernel`` (``_kernels.pxd``) is this, operation for operation.


def _refund_token_bucket(s: _KeyState, now: float, cost: int, at: float, cfg: LimiterConfig) -> None:
    capacity = float(cfg.capacity)
    level = s.level + (now - s.updated_at) * cfg.rate
    if level > capacity:
        level = capacity
    level = level + cost
    if level > capacity:
        level = capacity
    s.level = level


def _refund_leaky_bucket(s: _KeyState, now: float, cost: int, at: float, cfg: LimiterConfig) -> None:
    level = s.level - (now - s.updated_at) * cfg.rate
    if level < 0.0:
        level = 0.0
    level = level - cost
    if level < 0.0:
        level = 0.0
    s.level = level


def _refund_gcra(s: _KeyState, now: float, cost: int, at: float, cfg: LimiterConfig) -> None:
    tat = s.tat - cfg.gcra_interval_us * cost
    now_us = math.floor(now * 1000000.0)
    s.tat = max(tat, now_us)  # never more room than a fresh key's


def _refund_fixed_window(s: _KeyState, now: float, cost: int, at: float, cfg: LimiterConfig) -> None:
    window = cfg.window_seconds
    index = math.floor(now / window)
    if index != s.window_index:
        s.window_index = index
        s.count = 0
    if math.floor(at / window) == s.window_index:  # else it expired with its window
        s.count -= min(cost, s.count)


def _refund_sliding_counter(s: _KeyState, now: float, cost: int, at: float, cfg: LimiterConfig) -> None:
    window = cfg.window_seconds
    index = math.floor(now / window)
    if index != s.window_index:
        s.previous = s.count if index == s.window_index + 1 else 0
        s.count = 0
        s.window_index = index
    charged = math.floor(at / window)
    if charged == s.window_index:
        s.count -= min(cost, s.count)
    elif charged == s.window_index - 1:
        s.previous -= min(cost, s.previous)


def _refund_sliding_log(s: _KeyState, now: float, cost: int, at: float, cfg: LimiterConfig) -> None:
    log = s.log
    assert log is not None
    while len(log) > cfg.capacity:  # as the kernel trims after a lowered capacity
        log.popleft()
    cutoff = now - cfg.window_seconds
    while log and log[0] <= cutoff:
        log.popleft()
    stamps = list(log)
    # the oldest first, so the stamps equal to ``at`` are one run
    first = next((i for i, stamp in enumerate(stamps) if stamp == at), len(stamps))
    run = 0
    while run < cost and first + run < len(stamps) and stamps[first + run] == at:
        run += 1
    if run:
        del stamps[first : first + run]
        s.log = deque(stamps)


_REFUNDS: dict[Algorithm, Callable[[_KeyState, float, int, float, LimiterConfig], None]] = {
    Algorithm.TOKEN_BUCKET: _refund_token_bucket,
    Algorithm.LEAKY_BUCKET: _refund_leaky_bucket,
    Algorithm.FIXED_WINDOW: _refund_fixed_window,
    Algorithm.SLIDING_LOG: _refund_sliding_log,
    Algorithm.SLIDING_COUNTER: _refund_sliding_counter,
    Algorithm.GCRA: _refund_gcra,
}


def _refund(state: _KeyState, clock_now: float, cost: int, at: float | None, cfg: LimiterConfig) -> None:
    """Refund a key that exists. No clock rebase: a refund corrects no clock
    (the next decision does), and ``at`` names a time of the key as it is."""
    now = max(clock_now, state.updated_at)
    _REFUNDS[cfg.algorithm](state, now, cost, state.updated_at if at is None else at, cfg)
    state.updated_at = now


def _at_rest(s: _KeyState, cfg: LimiterConfig, now: float) -> bool:
    """True when the state is back to that of a key never seen: forgetting
    it changes no decision (matches ``_table.entry_at_rest``)."""
    now = max(now, s.updated_at)
    elapsed = now - s.updated_at
    algo = cfg.algorithm
    if algo is Algorithm.TOKEN_BUCKET:
        return bool(s.level + elapsed * cfg.rate >= float(cfg.capacity))
    if algo is Algorithm.LEAKY_BUCKET:
        return bool(s.level - elapsed * cfg.rate <= 0.0)
    if algo is Algorithm.GCRA:
        return bool(s.tat <= math.floor(now * 1000000.0))
    if algo is Algorithm.SLIDING_LOG:
        return not s.log or s.log[-1] <= now - cfg.window_seconds
    index = math.floor(now / cfg.window_seconds)
    if algo is Algorithm.FIXED_WINDOW:
        return s.count == 0 or index != s.window_index
    if s.count == 0 and s.previous == 0:
        return True
    return bool(index >= s.window_index + 2 or (index == s.window_index + 1 and s.count == 0))


def _given_back(s: _KeyState, cfg: LimiterConfig, now: float) -> tuple[float, bool]:
    """Units that forgetting the key would hand back at ``now``, and whether
    it is in debt (could not pass a request of cost 1 now); matches
    ``_table.entry_given_back``."""
    now = max(now, s.updated_at)
    elapsed = now - s.updated_at
    algo = cfg.algorithm
    capacity = float(cfg.capacity)
    if algo is Algorithm.TOKEN_BUCKET:
        level = min(capacity, s.level + elapsed * cfg.rate)
        return capacity - level, level < 1.0
    if algo is Algorithm.LEAKY_BUCKET:
        level = max(0.0, s.level - elapsed * cfg.rate)
        return level, capacity - level < 1.0
    if algo is Algorithm.GCRA:
        backlog = max(0, s.tat - math.floor(now * 1000000.0))
        return backlog / cfg.gcra_interval_us, backlog + cfg.gcra_interval_us > cfg.gcra_tolerance_us
    if algo is Algorithm.SLIDING_LOG:
        cutoff = now - cfg.window_seconds
        live = sum(1 for stamp in s.log or () if stamp > cutoff)
        return float(live), live + 1 > cfg.capacity
    window = cfg.window_seconds
    index = math.floor(now / window)
    if algo is Algorithm.FIXED_WINDOW:
        count = s.count if index == s.window_index else 0
        return float(count), count + 1 > cfg.capacity
    count, previous = 0, 0  # the counts after rolling to ``now``'s window
    if index == s.window_index:
        count, previous = s.count, s.previous
    elif index == s.window_index + 1:
        previous = s.count
    spent = float(previous) * (1.0 - (now - float(index) * window) / window) + float(count)
    return spent, spent + 1.0 > capacity


def _snapshot(cfg: LimiterConfig, s: _KeyState) -> LimiterState:
    algo = cfg.algorithm
    if algo in (Algorithm.TOKEN_BUCKET, Algorithm.LEAKY_BUCKET):
        return LimiterState(algo, s.updated_at, level=float(s.level))
    if algo is Algorithm.GCRA:
        return LimiterState(algo, s.updated_at, tat=int(s.tat))
    if algo is Algorithm.SLIDING_LOG:
        return LimiterState(algo, s.updated_at, log=tuple(s.log or ()))
    if algo is Algorithm.FIXED_WINDOW:
        return LimiterState(algo, s.updated_at, window_index=int(s.window_index), count=s.count)
    return LimiterState(
        algo, s.updated_at, window_index=int(s.window_index), count=s.count, previous=s.previous
    )


# --------------------------------------------------------------------------
# Storage


class InMemoryStorage:
    """A dict per stripe, a lock per stripe: the reference for the native table.

    Limiter state lives under ``(algorithm, rule, key)``; ``apply`` state under
    the bare key, so a user's own algorithm never reads a built-in's state.
    """

    def __init__(
        self,
        *,
        stripes: int = 64,
        max_key_bytes: int = MAX_KEY_BYTES,
        max_keys: int | None = None,
        on_full: str = "evict",
        evict_idle_after: float | None = None,
    ) -> None:
        stripes, self.max_key_bytes, self.max_keys, self.on_full, self.evict_idle_after = (
            check_storage_options(stripes, max_key_bytes, max_keys, on_full, evict_idle_after)
        )
        self._locks = [threading.Lock() for _ in range(stripes)]
        self._maps: list[dict[tuple[Any, ...], list[Any]]] = [{} for _ in range(stripes)]
        # max_keys split over the stripes (never below one key a stripe)
        self._caps = [
            0 if max_keys is None else max(1, max_keys // stripes + (1 if i < max_keys % stripes else 0))
            for i in range(stripes)
        ]
        self._bounded = max_keys is not None or self.evict_idle_after is not None
        self._params: dict[tuple[str, str], LimiterConfig] = {}
        # per stripe, each changed under its stripe's lock (as the native
        # table's): one shared dict would lose increments between stripes
        self._counters = [dict.fromkeys(EVICTION_COUNTERS, 0) for _ in range(stripes)]

    def _register(self, ns: tuple[str, str], cfg: LimiterConfig) -> None:
        """Remember the latest parameters of a namespace (for "at rest")."""
        self._params[ns] = cfg

    def _room_for_new_key(
        self, stripe: int, now: float, keep: Container[tuple[Any, ...]] = (), pending: int = 0
    ) -> bool:
        """The bounded-table policy of the native twin, done exhaustively:
        idle sweep, then an entry at rest, then (``evict``) the least
        recently used one. Built-in limiter entries only. In a compound's
        first phase, ``pending`` counts its new keys of this stripe already
        given room (not in yet) and no key of ``keep`` (the compound's) is
        forgotten: committed, the stripe holds at most its cap."""
        counters = self._counters[stripe]
        table = self._maps[stripe]
        if self.evict_idle_after is not None:
            cutoff = now - self.evict_idle_after
            idle = [k for k, e in table.items() if k not in keep and self._idle_at_rest(k, e, cutoff, now)]
            for k in idle:
                del table[k]
            counters["evicted_idle"] += len(idle)
        cap = self._caps[stripe]
        # a loop: a compound's second new key of the stripe wants room for two,
        # recounted after each forget (native twin alike)
        while cap and len(table) + pending >= cap:
            if not self._make_room(stripe, now, keep):
                counters["denied_new"] += 1
                return False
        return True

    def _peek_finds_room(self, stripe: int, now: float) -> bool:
        """``_room_for_new_key`` for ``peek``: the same answer, nothing
        changed. Only a full ``deny_new`` stripe can refuse."""
        table = self._maps[stripe]
        cap = self._caps[stripe]
        if not cap or self.on_full != "deny_new" or len(table) < cap:
            return True
        if self.evict_idle_after is not None:
            cutoff = now - self.evict_idle_after
            if any(self._idle_at_rest(k, entry, cutoff, now) for k, entry in table.items()):
                return True
        return self._first_at_rest(table, now) is not None

    def _idle_at_rest(self, k: tuple[Any, ...], entry: list[Any], cutoff: float, now: float) -> bool:
        """Whether the idle sweep may forget a limiter's key: untouched since
        ``cutoff`` and at rest at ``now``. Idle but in debt, it stays
        (forgotten, it would get a fresh budget)."""
        if k[0] is None or not entry[0] < cutoff:
            return False
        cfg = self._params.get(k[0])
        return cfg is not None and _at_rest(entry[1], cfg, now)

    def _first_at_rest(
        self, table: dict[tuple[Any, ...], list[Any]], now: float, keep: Container[tuple[Any, ...]] = ()
    ) -> tuple[Any, ...] | None:
        """A limiter's key whose state is at rest at ``now`` (forgetting it
        changes no decision), or None; never a key of ``keep``. Like the
        native table it looks at a bounded number of keys (the longest
        held), so a full table costs O(1) per new key here too."""
        for k, entry in islice(table.items(), EVICTION_LOOK):
            if k[0] is not None and k not in keep:
                cfg = self._params.get(k[0])
                if cfg is not None and _at_rest(entry[1], cfg, now):
                    return k
        return None

    def _make_room(self, stripe: int, now: float, keep: Container[tuple[Any, ...]] = ()) -> bool:
        """Forget one entry: one at rest, else (``evict``) of the keys not in
        debt the one whose forgetting hands back the fewest units, the least
        recently used among equals. A key in debt is never forgotten to make
        room, nor a key of ``keep`` (the compound being decided). False when
        nothing can go (the new key is refused)."""
        counters = self._counters[stripe]
        table = self._maps[stripe]
        resting = self._first_at_rest(table, now, keep)
        if resting is not None:
            del table[resting]
            counters["evicted_at_rest"] += 1
            return True
        if self.on_full != "evict":
            return False
        victim: tuple[Any, ...] | None = None
        best: tuple[float, float] = (0.0, 0.0)
        for full_key, entry in islice(table.items(), EVICTION_LOOK):
            cfg = None if full_key[0] is None or full_key in keep else self._params.get(full_key[0])
            if cfg is None:
                continue
            given, in_debt = _given_back(entry[1], cfg, now)
            if not in_debt and (victim is None or (given, entry[0]) < best):
                victim, best = full_key, (given, entry[0])
        if victim is None:
            return False
        del table[victim]
        counters["evicted_active"] += 1
        return True

    def stats(self) -> dict[str, int]:
        """Keys held and why keys were forgotten or refused."""
        totals = dict.fromkeys(("keys", *EVICTION_COUNTERS), 0)
        for lock, table, counters in zip(self._locks, self._maps, self._counters):
            with lock:
                totals["keys"] += len(table)
                for name, value in counters.items():
                    totals[name] += value
        return totals

    def _room_for_apply(self, full_key: tuple[Any, ...], now: float) -> bool:
        """A new ``apply`` key's room, made as a limiter key's (the caller holds its stripe's lock)."""
        return not self._bounded or self._room_for_new_key(hash(full_key) % len(self._maps), now)

    def _slot(self, full_key: tuple[Any, ...]) -> tuple[threading.Lock, dict[tuple[Any, ...], list[Any]]]:
        i = hash(full_key) % len(self._maps)
        return self._locks[i], self._maps[i]

    def apply(self, key: str, now: float, mutate: Callable[[Any], tuple[Any, Any]]) -> Any:
        """Run ``mutate(state | None) -> (state, result)`` atomically for ``key``.

        A returned state of ``None`` forgets the key. ``updated_at`` (used by
        ``evict_idle``) never moves backwards.
        """
        key = _exact_key(key, self.max_key_bytes)
        now = check_now(now)
        full_key = (None, key)
        lock, table = self._slot(full_key)
        with lock:
            entry = table.get(full_key)
            new_state, result = mutate(None if entry is None else entry[1])
            if new_state is None:
                table.pop(full_key, None)
            elif entry is None and not self._room_for_apply(full_key, now):
                raise StorageFullError(
                    f"apply: no room for the new key {key!r}: max_keys={self.max_keys} holds keys it may not "
                    f"forget (on_full={self.on_full!r}); its state was not stored"
                )
            else:
                stamp = now if entry is None else max(now, entry[0])
                table[full_key] = [stamp, new_state]
        return result

    def _run(
        self, ns: tuple[str, str], key: str, now: float, cost: int, cfg: LimiterConfig, commit: bool
    ) -> Verdict:
        full_key = (ns, key)
        lock, table = self._slot(full_key)
        with lock:
            entry = table.get(full_key)
            state = None if entry is None else entry[1]
            if not commit and state is not None:
                state = state.copy()
            stripe = hash(full_key) % len(self._maps)
            if entry is None and self._bounded:
                if commit and not self._room_for_new_key(stripe, now):
                    return STORAGE_FULL
                if not commit and not self._peek_finds_room(stripe, now):
                    return STORAGE_FULL  # what allow would answer, counting nothing
            state, verdict = _decide(state, now, cost, cfg)
            if commit:
                table[full_key] = [state.updated_at, state]
        return verdict

    def allow_all(self, requests: Sequence[tuple[Any, ...]]) -> CompoundDecision:
        """Decide a request bound by several limiters of this storage at once:
        all-or-nothing (docs/spec.md §5, compound requests). Every involved stripe is
        locked, in index order, for the whole decision."""
        items = compound_items(requests)
        plan = []
        for limiter, key, cost in items:
            if not isinstance(limiter, _Limiter) or limiter._storage is not self:
                raise ValidationError("every limiter of a compound request must use this storage")
            key = _exact_key(key, self.max_key_bytes)
            cost = check_cost(cost, limiter._cfg.capacity)
            plan.append((limiter, (limiter._ns, key), cost))
        if len({full_key for _, full_key, _ in plan}) != len(plan):
            raise ValidationError(DUPLICATE_COMPOUND)
        nows = [check_now(limiter._clock.now()) for limiter, _, _ in plan]
        stripes = sorted({hash(full_key) % len(self._maps) for _, full_key, _ in plan})
        for i in stripes:
            self._locks[i].acquire()
        try:
            verdicts = []
            bounded = self._bounded
            keep = {full_key for _, full_key, _ in plan}
            pending = [0] * len(self._maps)  # new keys given room, by stripe, not in yet
            for (limiter, full_key, cost), now in zip(plan, nows):
                stripe = hash(full_key) % len(self._maps)
                entry = self._maps[stripe].get(full_key)
                # make room now, so that committing below never refuses and
                # leaves no stripe over its cap; else refuse as a lone new key
                if entry is None and bounded:
                    if not self._room_for_new_key(stripe, now, keep, pending[stripe]):
                        verdicts.append(STORAGE_FULL)
                        continue
                    pending[stripe] += 1
                state = None if entry is None else entry[1].copy()
                verdicts.append(_decide(state, now, cost, limiter._cfg)[1])
            if not all(v[0] for v in verdicts):
                # Denied, nothing charged; but a key stamped over MAX_CLOCK_LEAD
                # ahead is stored moved back (decided at cost 0), or every
                # compound would move it back again and it would never refill.
                for (limiter, full_key, _), now in zip(plan, nows):
                    table = self._maps[hash(full_key) % len(self._maps)]
                    entry = table.get(full_key)
                    if entry is not None and entry[1].updated_at - now > MAX_CLOCK_LEAD:
                        state, _ = _decide(entry[1], now, 0, limiter._cfg)
                        table[full_key] = [state.updated_at, state]
            else:
                verdicts = []
                for (limiter, full_key, cost), now in zip(plan, nows):
                    table = self._maps[hash(full_key) % len(self._maps)]
                    entry = table.get(full_key)
                    state, verdict = _decide(None if entry is None else entry[1], now, cost, limiter._cfg)
                    table[full_key] = [state.updated_at, state]
                    verdicts.append(verdict)
        finally:
            for i in reversed(stripes):
                self._locks[i].release()
        return CompoundDecision([limiter._decision(v) for (limiter, _, _), v in zip(plan, verdicts)])

    def _refund(
        self, ns: tuple[str, str], key: str, now: float, cost: int, at: float | None, cfg: LimiterConfig
    ) -> None:
        """Refund a held key in place; a key not held is left unmade."""
        full_key = (ns, key)
        lock, table = self._slot(full_key)
        with lock:
            entry = table.get(full_key)
            if entry is not None:
                _refund(entry[1], now, cost, at, cfg)
                entry[0] = entry[1].updated_at

    def _forget(self, ns: tuple[str, str], key: str) -> None:
        full_key = (ns, key)
        lock, table = self._slot(full_key)
        with lock:
            table.pop(full_key, None)

    def _state(self, ns: tuple[str, str], key: str) -> _KeyState | None:
        full_key = (ns, key)
        lock, table = self._slot(full_key)
        with lock:
            entry = table.get(full_key)
            return None if entry is None else entry[1].copy()

    def evict_idle(self, cutoff: float) -> int:
        """Forget keys whose last decision was before ``cutoff``; returns how many."""
        cutoff = check_cutoff(cutoff)
        removed = 0
        for lock, table in zip(self._locks, self._maps):
            with lock:
                stale = [k for k, entry in table.items() if entry[0] < cutoff]
                for k in stale:
                    del table[k]
                removed += len(stale)
        return removed

    def keys(self) -> list[str]:
        """Every key held, as storage keys (see :func:`storage_key`)."""
        out: list[str] = []
        for lock, table in zip(self._locks, self._maps):
            with lock:
                names = list(table)
            for ns, key in names:
                out.append(key if ns is None else storage_key(Algorithm(ns[0]), ns[1], key))
        return out

    def memory_bytes(self) -> int:
        """Bytes held for state, as far as ``sys.getsizeof`` can tell."""
        total = 0
        for lock, table in zip(self._locks, self._maps):
            with lock:
                total += sys.getsizeof(table)
                for full_key, entry in table.items():
                    total += sys.getsizeof(full_key) + sys.getsizeof(full_key[1]) + sys.getsizeof(entry)
                    state = entry[1]
                    total += sys.getsizeof(state)
                    if isinstance(state, _KeyState) and state.log is not None:
                        total += sys.getsizeof(state.log)
        return total

    @property
    def stripes(self) -> int:
        return len(self._maps)

    def __len__(self) -> int:
        total = 0
        for lock, table in zip(self._locks, self._maps):
            with lock:
                total += len(table)
        return total

    def __repr__(self) -> str:
        return f"<reference InMemoryStorage keys={len(self)} stripes={len(self._maps)}>"


# --------------------------------------------------------------------------
# Limiters


class _Limiter:
    algorithm: ClassVar[Algorithm]

    def __init__(
        self,
        limit: int,
        window_seconds: float,
        storage: Storage | None = None,
        clock: Clock | None = None,
        rule: str = "",
        *,
        burst: int | None = None,
    ) -> None:
        self._cfg = LimiterConfig.build(self.algorithm, limit, window_seconds, burst, rule)
        if clock is None:
            clock = SystemClock()
        elif not callable(getattr(clock, "now", None)):
            raise ValidationError(f"clock must have a now() method, got {type(clock).__name__}")
        if storage is None:
            storage = InMemoryStorage()
        elif not isinstance(storage, Storage):
            raise ValidationError(f"storage must implement Storage, got {type(storage).__name__}")
        self._storage = storage
        self._clock = clock
        self._ns = (self.algorithm.value, self._cfg.rule)
        # The storage's kind is fixed: decide it once (a runtime Protocol
        # check costs ~10 µs, more than a whole near-cache answer).
        self._memory_store: InMemoryStorage | None = None
        self._kernel_store: KernelStorage | None = None
        if isinstance(storage, InMemoryStorage):
            self._memory_store = storage
            storage._register(self._ns, self._cfg)
        elif isinstance(storage, KernelStorage):
            self._kernel_store = storage
        self._max_key_bytes: int = getattr(storage, "max_key_bytes", MAX_KEY_BYTES)

    # -- properties --------------------------------------------------------
    @property
    def limit(self) -> int:
        return self._cfg.limit

    @property
    def capacity(self) -> int:
        return self._cfg.capacity

    @property
    def window_seconds(self) -> float:
        return self._cfg.window_seconds

    @property
    def burst(self) -> int | None:
        return self._cfg.burst

    @property
    def rule(self) -> str:
        return self._cfg.rule

    @property
    def config(self) -> LimiterConfig:
        """The validated configuration (what a KernelStorage is given)."""
        return self._cfg

    @property
    def storage(self) -> Storage:
        return self._storage

    @property
    def clock(self) -> Clock:
        return self._clock

    # -- decisions -----------------------------------------------------------
    def allow(self, key: str, cost: int = 1) -> Decision:
        """Decide one request and spend its cost if it passes."""
        return self._decision(self._verdict(key, cost, True))

    def peek(self, key: str, cost: int = 1) -> Decision:
        """What ``allow`` would answer now, spending nothing and storing nothing."""
        return self._decision(self._verdict(key, cost, False))

    def allow_async(self, key: str, cost: int = 1) -> Coroutine[Any, Any, Decision]:
        """``await limiter.allow_async(key)``: awaits an async storage
        (``AsyncRedisStorage``); on any other it answers at once."""
        return decide_async(self, key, cost, True)

    def peek_async(self, key: str, cost: int = 1) -> Coroutine[Any, Any, Decision]:
        """``await limiter.peek_async(key)``: ``peek`` for async code."""
        return decide_async(self, key, cost, False)

    def allow_many(
        self, keys: Sequence[str], costs: Sequence[int] | None = None, *, times: Sequence[float] | None = None
    ) -> BatchResult:
        """Decide a batch in order; every key and cost is checked before any is spent.

        ``times`` (replays) gives each request its own clock reading instead
        of one reading for the batch; per key, time still never runs backwards.

        A batch is a sequence of decisions, not one (``allow_all`` is): if
        memory for a new key's state runs out part-way, ``MemoryError`` is
        raised and the requests before that one stay decided and charged.
        """
        keys = batch_keys(keys)
        costs = [1] * len(keys) if costs is None else list(costs)
        costs = check_batch(keys, costs, self._cfg.capacity, self._max_key_bytes)
        keys = [key if type(key) is str else str.__str__(key) for key in keys]
        stamps: list[float] | None = None
        if times is not None:
            stamps = [check_now(t) for t in times]
            if len(stamps) != len(keys):
                raise ValidationError(f"{len(keys)} keys but {len(stamps)} times")
        n = len(keys)
        kernel_store = self._kernel_store
        if kernel_store is not None:
            if stamps is None:
                verdicts = kernel_store.run_kernel_many(self._cfg, keys, costs, self._kernel_now())
            else:
                verdicts = [
                    kernel_store.run_kernel(self._cfg, k, c, t, True) for k, c, t in zip(keys, costs, stamps)
                ]
        elif stamps is None:
            now = check_now(self._clock.now())
            verdicts = [self._verdict(key, cost, True, now) for key, cost in zip(keys, costs)]
        else:
            verdicts = [self._verdict(key, cost, True, t) for key, cost, t in zip(keys, costs, stamps)]
        allowed = array("B", bytes(n))
        remaining = array("q", bytes(8 * n))
        retry = array("d", bytes(8 * n))
        reset = array("d", bytes(8 * n))
        delay = array("d", bytes(8 * n))
        reasons: dict[int, str] = {}
        for i, verdict in enumerate(verdicts):
            ok, left, retry_after, reset_after, wait = verdict[:5]
            if len(verdict) > 5 and verdict[5]:
                reasons[i] = verdict[6] if len(verdict) > 6 else ""
            allowed[i] = ok
            remaining[i] = max(0, math.floor(left))
            retry[i] = retry_after
            reset[i] = reset_after
            delay[i] = wait
        cfg = self._cfg
        return BatchResult(
            Decision,
            cfg.capacity,
            cfg.rule,
            cfg.window_seconds,
            allowed,
            remaining,
            retry,
            reset,
            delay,
            reasons=reasons or None,
        )

    def refund(self, key: str, cost: int = 1, *, at: float | None = None) -> None:
        """Give back ``cost`` units that an admitted decision made at ``at``
        (its ``Decision.at``; None: the key's latest decision) charged to
        ``key``: counting by response charges on entry, atomically, and
        refunds what the response says should not have counted.

        The log and the windows end exactly as if the charge was never made
        (a charge whose window has passed expired with it, and nothing is
        given back); the buckets and GCRA get the units back, which is exact
        unless the key refilled to full (went idle) in between. Never more
        than a fresh key's budget; a key the storage does not hold is left
        alone, not created.
        """
        key = _exact_key(key, self._max_key_bytes)
        cost = check_cost(cost, self._cfg.capacity)
        stamp = check_at(at)
        cfg = self._cfg
        if self._memory_store is not None:
            self._memory_store._refund(self._ns, key, check_now(self._clock.now()), cost, stamp, cfg)
        elif self._kernel_store is not None:
            refund_kernel_of(self._kernel_store)(cfg, key, cost, stamp, self._kernel_now())
        else:
            now = check_now(self._clock.now())

            def give_back(state: Any) -> tuple[Any, None]:
                if state is not None:
                    _refund(state, now, cost, stamp, cfg)
                return state, None

            self._storage.apply(self._storage_key(key), now, give_back)

    def refund_async(self, key: str, cost: int = 1, *, at: float | None = None) -> Coroutine[Any, Any, None]:
        """``await limiter.refund_async(key)``: awaits an async storage
        (``AsyncRedisStorage``); on any other it refunds at once."""
        return refund_async(self, key, cost, at)

    def reset(self, key: str) -> None:
        """Forget ``key``: its next request sees a full budget."""
        key = _exact_key(key, self._max_key_bytes)
        storage = self._storage
        if self._memory_store is not None:
            self._memory_store._forget(self._ns, key)
        elif self._kernel_store is not None:
            self._kernel_store.forget(self._cfg, key)
        else:
            storage.apply(self._storage_key(key), check_now(self._clock.now()), lambda _s: (None, None))

    def state(self, key: str) -> LimiterState | None:
        """A snapshot of ``key``'s state, or ``None`` if the storage holds none."""
        key = _exact_key(key, self._max_key_bytes)
        storage = self._storage
        if self._memory_store is not None:
            raw = self._memory_store._state(self._ns, key)
        elif self._kernel_store is not None:
            return self._kernel_store.snapshot(self._cfg, key, self._kernel_now())
        else:
            found: list[_KeyState | None] = [None]

            def look(s: Any) -> tuple[Any, None]:
                found[0] = None if s is None else s.copy()
                return s, None

            storage.apply(self._storage_key(key), check_now(self._clock.now()), look)
            raw = found[0]
        return None if raw is None else _snapshot(self._cfg, raw)

    # -- internals -------------------------------------------------------------
    def _storage_key(self, key: str) -> str:
        return storage_key(self.algorithm, self._cfg.rule, key)

    def _kernel_now(self) -> float | None:
        """The time a KernelStorage is given: ``None`` means 'use your own
        clock' (the default SystemClock), anything else is an injected clock."""
        if type(self._clock) is SystemClock:
            return None
        return check_now(self._clock.now())

    def _verdict(self, key: str, cost: int, commit: bool, now: float | None = None) -> Verdict:
        """One decision; ``now`` is a clock reading already taken (batches)."""
        key = _exact_key(key, self._max_key_bytes)
        cost = check_cost(cost, self._cfg.capacity)
        storage = self._storage
        cfg = self._cfg
        if self._memory_store is not None:
            clock_now = check_now(self._clock.now()) if now is None else now
            return self._memory_store._run(self._ns, key, clock_now, cost, cfg, commit)
        if self._kernel_store is not None:
            kernel_now = self._kernel_now() if now is None else now
            return self._kernel_store.run_kernel(cfg, key, cost, kernel_now, commit)
        if now is None:
            now = check_now(self._clock.now())
        # Any other Storage: the generic (slow) seam of docs/spec.md §5.
        verdict: list[Verdict] = []

        def mutate(state: Any) -> tuple[Any, None]:
            work = state if (commit or state is None) else state.copy()
            work, v = _decide(work, now, cost, cfg)
            verdict.append(v)
            return (work if commit else state), None

        storage.apply(self._storage_key(key), now, mutate)
        return verdict[0]

    def _decision(self, v: Verdict | KernelVerdict) -> Decision:
        decision: Decision = decision_from_verdict(Decision, self._cfg, v)
        return decision

    def __repr__(self) -> str:
        cfg = self._cfg
        burst = "" if cfg.burst is None else f", burst={cfg.burst}"
        return f"{type(self).__name__}({cfg.limit}, {cfg.window_seconds!r}, rule={cfg.rule!r}{burst})"


class TokenBucket(_Limiter):
    """Refills ``limit`` tokens per window up to ``burst`` (default ``limit``)."""

    algorithm = Algorithm.TOKEN_BUCKET


class LeakyBucket(_Limiter):
    """A shaper: admitted work queues and drains at the rate; ``delay`` says how long to wait."""

    algorithm = Algorithm.LEAKY_BUCKET


class FixedWindowCounter(_Limiter):
    """``limit`` per aligned window; cheap, but lets 2× through across a boundary."""

    algorithm = Algorithm.FIXED_WINDOW


class SlidingWindowLog(_Limiter):
    """Exact: at most ``limit`` units in any trailing window, O(limit) memory per key."""

    algorithm = Algorithm.SLIDING_LOG


class SlidingWindowCounter(_Limiter):
    """Approximates the sliding log with two counters per key."""

    algorithm = Algorithm.SLIDING_COUNTER


class GCRA(_Limiter):
    """Generic cell rate algorithm: one integer per key, smooth spacing, burst tolerance."""

    algorithm = Algorithm.GCRA


LIMITERS: dict[Algorithm, type[_Limiter]] = {
    cls.algorithm: cls
    for cls in (TokenBucket, LeakyBucket, FixedWindowCounter, SlidingWindowLog, SlidingWindowCounter, GCRA)
}
