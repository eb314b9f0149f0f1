"""What the two-tier storage keeps per key and per sync, and the constants
both tiers share (why a module of its own: the decision side and the sync
side read the same records, each in its own module)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

from ..._limiter_config import Algorithm, LimiterConfig

# Counter-shaped algorithms: their state merges across instances by adding the
# units each instance consumed, so a per-instance counter in Redis is enough.
SUPPORTED_ALGORITHMS = frozenset({Algorithm.FIXED_WINDOW, Algorithm.SLIDING_COUNTER, Algorithm.TOKEN_BUCKET})

_REFUSED = (
    "TwoTierStorage supports fixed_window, sliding_counter and token_bucket only: their state merges "
    "across instances by adding consumed units. {algo} keeps per-request state (timestamps, a "
    "theoretical arrival time or a queue) that cannot be summed, so it cannot be approximated locally; "
    "use RedisStorage (one round trip per decision) for it"
)

_Window = int

# Window indexes the C lease records hold (int64, with room to spare).
MAX_WINDOW_INDEX = 2**62

# Keys per reconcile script call, and tracks handled per lock hold in a sync.
RECONCILE_CHUNK = 128
SYNC_CHUNK = 32  # ~0.1 ms median hold on a loaded 2-core VM (bench/two_tier_sync.py)
# Slots a native plan takes per hold of the storage's lock (~10-30 µs of C).
PLAN_STEP = 256
# What the native lease records say for a window absent from a track's dict.
ABSENT = -(2**63)
# The background sync covers only keys decided since the last one, and every
# key (idle leases released, idle keys dropped) once per this many syncs.
FULL_SYNC_EVERY = 8
# ... and re-reads a past window's fleet total (the sliding estimate's previous
# window) this many times after it ends, for the other instances' last pushes.
SETTLE_READS = 3
# When the keys decided per interval are more than a sync can cover in
# SYNC_BUDGET of the interval (at the recent cost per key), a key with room
# in its lease is sent one sync in ``spread`` (a power of two, at most
# MAX_SPREAD), in its turn; the others every sync (docs/two_tier.md,
# "Keeping the interval").
SYNC_BUDGET = 0.5
MAX_SPREAD = 16
# A heartbeat expires this many of the instance's own longest recent sync
# gaps after it is sent (between 2 * sync_interval and heartbeat_ttl): a
# live instance that syncs slowly is never taken for silent, a cut one is
# within a few of its periods. The gaps remembered: the last this many.
HEARTBEAT_GAPS = 4
GAPS_KEPT = 32


def _shape(config: LimiterConfig) -> tuple[int, float, bool]:
    """(limit, window, sliding) the fleet enforces for ``config``."""
    if config.algorithm is Algorithm.TOKEN_BUCKET:
        # capacity units over the time the bucket takes to refill from empty
        return config.capacity, config.capacity / config.rate, True
    return config.limit, config.window_seconds, config.algorithm is Algorithm.SLIDING_COUNTER


@dataclass
class _Track:
    """What one instance knows about one (limit, key): per window index, its
    own cumulative admitted units, what it last pushed, and the fleet total it
    last read back."""

    config: LimiterConfig
    key: str
    base: str  # Redis key prefix for this (rule, key); the window index follows
    limit: int
    window: float
    sliding: bool
    last_now: float = 0.0
    touched: float = field(default_factory=time.monotonic)  # idle eviction: real time, any clock
    own: dict[_Window, int] = field(default_factory=dict)
    pushed: dict[_Window, int] = field(default_factory=dict)
    acked: dict[_Window, int] = field(default_factory=dict)  # the units_pushed metric: kept over partitions
    want: dict[_Window, int] = field(default_factory=dict)  # largest cost refused for want of lease
    seen_total: dict[_Window, int] = field(default_factory=dict)
    seen_own: dict[_Window, int] = field(default_factory=dict)
    lease: dict[_Window, int] = field(default_factory=dict)  # granted at our last sync of the window
    # the windows whose default share is reserved for us in Redis (claimed at a
    # sync of the window before), and the share claimed
    claimed: dict[_Window, int] = field(default_factory=dict)
    # while blind: per window, the ceiling Redis holds for us (count + lease, or
    # the claim), which is all we may admit there; other windows: the blind share
    blind_cap: dict[_Window, int] = field(default_factory=dict)
    settled: dict[_Window, int] = field(default_factory=dict)  # reads of a past window's total
    book: Any = None  # the native LeaseBook holding this key's hot window, if any
    slot: int = -1
    alive: bool = True  # False once dropped (forgotten, evicted, idle)
    phase: int = 0  # its turn among the syncs a spread sync takes turns over (_plan)


@dataclass(slots=True)
class _Work:
    """One (key, window) of a sync: what is sent, and where the answer goes."""

    track: _Track
    window: _Window
    value: int  # our cumulative units in the window
    current: bool  # the key's current window: a lease is granted
    hash_key: str
    spec: tuple[float, ...]  # count, limit, previous window, expiry ms, current?, wanted cost
    weight: float = 0.0  # a sliding current window: the weight of window - 1 in the estimate
    held: int = 0  # current: the most our count may reach before the reply lands (the ceiling in use)
    claim_key: str | None = None  # current: the next window's hash, to claim our default share in
    claim: int = 0  # ... that share


class _Guard:
    """The storage's lock, with the native gate closed while it is held: a
    native limiter's C decisions (``LeaseBook.decide``) wait for the Python
    side to finish, and resume unless Redis is unreachable or the storage
    is closed."""

    __slots__ = ("gate", "lock", "storage")

    def __init__(self, storage: Any, gate: Any) -> None:  # storage: the TwoTierStorage, for its _blind
        self.storage = storage
        self.lock = threading.Lock()
        self.gate = gate

    def __enter__(self) -> None:
        self.lock.acquire()
        if self.gate is not None:
            self.gate.close()

    def __exit__(self, *exc: object) -> None:
        if self.gate is not None and not self.storage._blind and not self.storage._closed:
            self.gate.open()
        self.lock.release()
