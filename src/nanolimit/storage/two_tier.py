"""Two-tier limits for fleets: local decisions, reconciled through Redis.

A gateway instance deciding 100,000 requests per second cannot spend a Redis
round trip on each. :class:`TwoTierStorage` decides every request in process,
against this instance's *lease* for the key, and a background thread
reconciles with Redis once per ``sync_interval`` (or sooner when a key runs
out of lease): one pipelined round trip writes what this instance admitted per
key and window, reads the fleet totals back and takes a new lease.

Leases: a Lua script per (key, window) writes this instance's count, then
grants it ``ceil(remaining / N)`` where ``remaining = L - all counts - the
other instances' leases``. A lease never exceeds what remains, so the counts
plus the leases of the instances that have synced in a window never pass the
limit. Before its first sync of a window, an instance spends a default share
``ceil(L / N)`` that nobody else has seen yet: that is the only overshoot.

Error bound (``L`` = the limit, ``N`` = live instances, ``I`` = sync interval,
``r_j`` = the rate instance ``j`` admits a key at)::

    admitted per key and window  <=  L + sum over all but the first instance to sync of u_j
    u_j = min(ceil(L / N), r_j * I)     (what j admits in the window before its first sync)
    so the over-admission is at most (N - 1) * min(ceil(L / N), r * I)

``sync_interval`` is the knob: shorter means fewer units admitted unseen.
See ``docs/two_tier.md``.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .._clocks import MAX_TIME, FakeClock, check_now
from .._decision_py import KernelVerdict
from .._limiter_config import LIMITER_CLASS_NAMES, Algorithm, LimiterConfig, LimiterState
from .._select import native_core, twin, twin_of
from .._validation import check_int_option, check_seconds_option
from ..errors import ValidationError
from .redis import LuaScript, RedisStorage, client_package, derive_client, is_noscript

__all__ = ["SUPPORTED_ALGORITHMS", "TwoTierStorage"]

# Counter-shaped algorithms: their state merges across instances by adding the
# units each instance consumed, so a per-instance counter in Redis is enough.
SUPPORTED_ALGORITHMS = frozenset({Algorithm.FIXED_WINDOW, Algorithm.SLIDING_COUNTER, Algorithm.TOKEN_BUCKET})

_REFUSED = (
    "TwoTierStorage supports fixed_window, sliding_counter and token_bucket only: their state merges "
    "across instances by adding consumed units. {algo} keeps per-request state (timestamps, a "
    "theoretical arrival time or a queue) that cannot be summed, so it cannot be approximated locally; "
    "use RedisStorage (one round trip per decision) for it"
)

# Register this instance and count the others, by the server's clock (one
# clock for the fleet): score = when a member's heartbeat expires, in ms. A
# member is live until then, then *silent* (partitioned or dead: nobody can
# tell) until ``partition_grace`` after its last heartbeat, then dropped.
# Returns {live, 1 if this instance was not a member, its rank among all
# members by id, all members, the silent members' ranks}: after our first
# sync, a missing member means the server restarted or was flushed (or we
# were silent past the grace), and our counts may be gone with it. A blind
# instance admits its share, L // all plus one of the remainder's units by
# rank; the others reserve that same share for each silent member, so a
# partition of some instances keeps the fleet within L.
_HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local grace = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - (grace - ttl))
local added = redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], (grace + ttl) * 2)
local flat = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local members, expiry = {}, {}
for i = 1, #flat, 2 do
  members[#members + 1] = flat[i]
  expiry[flat[i]] = tonumber(flat[i + 1])
end
table.sort(members)
local rank, silent = 0, {}
for i = 1, #members do
  if members[i] == ARGV[1] then rank = i - 1 end
  if expiry[members[i]] <= now then silent[#silent + 1] = i - 1 end
end
return {#members - #silent, added, rank, #members, table.concat(silent, ' ')}
"""

# Per (key, window), atomically, for each KEYS[i] (ARGV: id, N, and one
# string of eight words per key: count, limit, weighted previous window,
# expiry ms, current?, wanted cost, the position of the same key's previous
# window among KEYS (0: not sent) and its weight — one argument, not 8 per
# key, to keep the client's packing cheap):
# write this instance's absolute count, sum every instance's count and every
# *other* instance's lease (units it may still admit before its next sync),
# and grant this instance a lease of ceil(remaining / N), or of the wanted
# cost when that is larger (a request above ceil(L / N) would otherwise be
# refused forever). The lease never exceeds what remains, so the counts plus
# the leases of instances that have synced never pass the limit. What
# remains leaves out the silent members' blind shares (ARGV[4]: all members,
# then each silent member's rank; see _HEARTBEAT). Returns count, lease,
# count, lease, ...
_RECONCILE = r"""
local id = ARGV[1]
local lid = 'lease:' .. id
local n = tonumber(ARGV[2])
local spec = {}
for word in string.gmatch(ARGV[3], '%S+') do spec[#spec + 1] = word end
local silent = {}
for word in string.gmatch(ARGV[4], '%S+') do silent[#silent + 1] = tonumber(word) end
local function reserved(limit)  -- the silent members' blind shares of this limit
  if #silent < 2 then return 0 end
  local all, total = silent[1], 0
  for i = 2, #silent do
    total = total + math.floor(limit / all)
    if silent[i] < limit % all then total = total + 1 end
  end
  return total
end
local out = {}
local totals = {}
for i = 1, #KEYS do
  local h = KEYS[i]
  local b = (i - 1) * 8
  local mine = spec[b + 1]
  local counts, leases = tonumber(mine), 0
  local limit = tonumber(spec[b + 2])
  local prev = tonumber(spec[b + 3])
  local flat = redis.call('HGETALL', h)
  for j = 1, #flat, 2 do
    local f = flat[j]
    if f ~= id and f ~= lid then  -- ours: the count sent replaces it, the lease is re-granted
      if string.byte(f, 1) == 108 and string.sub(f, 1, 6) == 'lease:' then
        leases = leases + tonumber(flat[j + 1])
      else
        counts = counts + tonumber(flat[j + 1])
      end
    end
  end
  totals[i] = counts
  local before = tonumber(spec[b + 7])
  if before > 0 then  -- the previous window, read in this very call: its fleet total now
    local weighted = totals[before] * tonumber(spec[b + 8])
    if weighted > prev then prev = weighted end
  end
  local lease = 0
  local rem = limit - prev - counts - leases - reserved(limit)
  if spec[b + 5] == '1' and rem > 0 then
    lease = math.ceil(rem / n)
    local want = tonumber(spec[b + 6])
    if want > lease then lease = math.min(want, rem) end
  end
  redis.call('HSET', h, id, mine, lid, lease)
  redis.call('PEXPIRE', h, spec[b + 4])
  out[#out + 1] = counts
  out[#out + 1] = lease
end
return out
"""

_Window = int

# Window indexes the C lease records hold (int64, with room to spare).
MAX_WINDOW_INDEX = 2**62

_log = logging.getLogger("nanolimit.two_tier")

# Keys per reconcile script call, and tracks handled per lock hold in a sync.
RECONCILE_CHUNK = 128
SYNC_CHUNK = 256
# The background sync covers only keys decided since the last one, and every
# key (idle leases released, idle keys dropped) once per this many syncs.
FULL_SYNC_EVERY = 8
# ... and re-reads a past window's fleet total (the sliding estimate's previous
# window) this many times after it ends, for the other instances' last pushes.
SETTLE_READS = 3


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
    settled: dict[_Window, int] = field(default_factory=dict)  # reads of a past window's total
    book: Any = None  # the native LeaseBook holding this key's hot window, if any
    slot: int = -1
    alive: bool = True  # False once dropped (forgotten, evicted, idle)


@dataclass(slots=True)
class _Work:
    """One (key, window) of a sync: what is sent, and where the answer goes."""

    track: _Track
    window: _Window
    value: int  # our cumulative units in the window
    current: bool  # the key's current window: a lease is granted
    hash_key: str
    spec: str  # the script's six words: count, limit, previous window, expiry ms, current?, wanted cost
    weight: float = 0.0  # a sliding current window: the weight of window - 1 in the estimate


class _Guard:
    """The storage's lock, with the native gate closed while it is held: a
    native limiter's C decisions (``LeaseBook.decide``) wait for the Python
    side to finish, and resume unless Redis is unreachable."""

    __slots__ = ("gate", "lock", "storage")

    def __init__(self, storage: TwoTierStorage, gate: Any) -> None:
        self.storage = storage
        self.lock = threading.Lock()
        self.gate = gate

    def __enter__(self) -> None:
        self.lock.acquire()
        if self.gate is not None:
            self.gate.close()

    def __exit__(self, *exc: object) -> None:
        if self.gate is not None and not self.storage._blind:
            self.gate.open()
        self.lock.release()


class TwoTierStorage:
    """A :class:`~nanolimit.KernelStorage` deciding locally, reconciled through Redis.

    ``remote`` is a :class:`~nanolimit.storage.redis.RedisStorage` (its key
    layout is reused; the sync talks through a client derived from its client
    with ``timeout`` seconds — default ``max(0.25, 2 * sync_interval)`` — and
    no retries) or a redis-py client (wrapped in one). ``local`` is the in-memory
    storage used while Redis is unreachable (default: ``InMemoryStorage()`` of
    the native twin when built).

    Algorithms: fixed window and sliding window counter exactly as docs/spec.md §4
    but with fleet-wide counts; the token bucket is enforced as a sliding
    window counter of ``capacity`` units over ``capacity / rate`` seconds (the
    same long-run rate and burst; a bucket's cap is not a sum of consumed
    units). Sliding log, GCRA and leaky bucket raise :class:`ValidationError`
    on first use.

    Bound: per key and window the fleet admits at most
    ``L + (N - 1) * min(ceil(L / N), r * I)``: only what instances admit
    before their first sync of a window goes unseen (module docstring).

    Partitions: when a sync fails, every instance enforces ``limit // N``
    locally with the native kernel (``N`` = members last seen), on top
    of the fleet total it last saw; it keeps counting what it admits, and the
    first successful sync re-writes its cumulative per-window counts (``HSET``
    of an absolute value per instance field: idempotent, so a retried or lost
    reply never counts a unit twice, and a restarted empty server gets the
    fleet's counts back). The window in which Redis returns can hold the
    blind units on top of the limit (at most ``2 * L``): the first instances
    back lease before the others' blind counts arrive.

    Instances register in a sorted set scored by heartbeat expiry (server
    clock), refreshed each sync; an instance that stops syncing stops counting
    toward the live ``N`` ``heartbeat_ttl`` seconds later, but stays a
    *silent* member until ``partition_grace`` seconds (default 30) after its
    last heartbeat: it may be cut off from Redis and admitting its blind
    share, so the others keep that share out of their leases. A partition of
    some instances then keeps the fleet within ``L`` for as long as the
    grace; a dead instance's share is idle for as long. ``close()`` leaves at
    once. Its admitted units still count.
    ``instances`` is the ``N`` assumed until the first sync answers (an
    instance started while Redis is down has nothing better to divide by).
    """

    def __init__(
        self,
        local: Any = None,
        remote: Any = None,
        *,
        sync_interval: float = 0.05,
        instance_id: str | None = None,
        instances: int = 1,
        heartbeat_ttl: float = 2.0,
        partition_grace: float = 30.0,
        prefix: str = "tt:",
        timeout: float | None = None,
        start: bool = True,
    ) -> None:
        if remote is None:
            raise ValidationError("TwoTierStorage needs a remote: a RedisStorage or a redis client")
        # every option is checked here, where it is given (a bool is no number
        # of seconds, NaN and inf none either), never at the first sync
        sync_interval = check_seconds_option("sync_interval", sync_interval, 0, 60)
        heartbeat_ttl = check_seconds_option("heartbeat_ttl", heartbeat_ttl, 0, 86_400)
        if heartbeat_ttl < 2 * sync_interval:
            raise ValidationError("heartbeat_ttl must be seconds >= 2 * sync_interval")
        partition_grace = check_seconds_option("partition_grace", partition_grace, 0, 86_400)
        if partition_grace < heartbeat_ttl:
            raise ValidationError(
                f"partition_grace must be seconds in [heartbeat_ttl, 86400], got {partition_grace!r}"
            )
        if timeout is not None:
            timeout = check_seconds_option("timeout", timeout, 0, 60)
        instances = check_int_option("instances", instances, 1, (1 << 31) - 1)
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ValidationError("prefix must be a str without '{' or '}'")
        if local is None:
            local = twin.InMemoryStorage()
        self.local = local
        self.remote: RedisStorage = remote if isinstance(remote, RedisStorage) else RedisStorage(remote)
        self.sync_interval = float(sync_interval)
        # The sync is off the request path: it may wait longer than a decision
        # call would, but never retries (a pipeline is not replayed blindly).
        self.timeout = float(timeout) if timeout is not None else max(0.25, 2 * self.sync_interval)
        self.client = derive_client(self.remote.user_client, self.timeout)
        self.heartbeat_ttl = float(heartbeat_ttl)
        self.partition_grace = float(partition_grace)
        self.instance_id = instance_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        if self.instance_id.startswith("lease:"):
            raise ValidationError("instance_id must not start with 'lease:' (the lease fields' prefix)")
        self.prefix = prefix
        self._id_bytes = self.instance_id.encode()
        # the client package's own error base and OSError, as RedisStorage catches them
        self._errors: tuple[type[BaseException], ...] = self.remote._errors
        self.max_key_bytes: int = getattr(self.remote, "max_key_bytes", 1024)
        self._members_key = f"{self.remote.prefix}{prefix}instances"
        self._twin = twin_of(local)
        self._tracks: dict[tuple[LimiterConfig, str], _Track] = {}
        self._by_base: dict[str, _Track] = {}  # the track writing each Redis key prefix
        # Native limiters decide in C against each key's lease (LeaseBook);
        # the reference twin, or a build without the extension, uses _decide.
        self._native: Any = native_core()  # None with NANOLIMIT_NO_EXTENSIONS
        self._gate: Any = None if self._native is None else self._native.LeaseGate(self._wake_sync)
        self._books: dict[LimiterConfig, Any] = {}
        self._lock = _Guard(self, self._gate)
        # N until the first sync answers: an instance born during a partition has
        # no live count to divide by, so the operator's estimate stands in
        self._instances = instances
        self._n_floor: tuple[int, float] = (1, 0.0)
        self._joined = False  # a first sync succeeded: a missing membership after it is a server reset
        self._rank = 0  # this instance's rank among all members, by id (the blind share's remainder)
        self._members = 0  # live and silent members at the last sync: the blind shares' N (0: none yet)
        self._silent: tuple[int, ...] = ()  # the silent members' ranks, whose blind shares are reserved
        self._blind = False
        self._blind_clock = FakeClock()
        self._blind_limiters: dict[tuple[LimiterConfig, int, int], Any] = {}
        self._blind_keys: dict[tuple[LimiterConfig, str], Any] = {}  # -> the limiter that holds it
        self._blind_units = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._sync_lock = threading.RLock()  # forget() takes it too, also from inside a sync
        self._dirty: dict[int, _Track] = {}  # id -> track decided in Python since the last sync
        self._since_full = 0
        self._need_full = False
        self._leaving = False  # close(): the last sync asks for no lease
        self._slot_of: Any = None  # a cluster's key -> slot, to group a script's keys
        if getattr(self.remote, "cluster", False):
            self._slot_of = client_package(self.remote.user_client).crc.key_slot
        self._script_loaded = False
        self._stats: dict[str, Any] = {
            "syncs": 0,
            "sync_failures": 0,
            "sync_errors": 0,
            "early_syncs": 0,
            "sync_latency_last": 0.0,
            "sync_latency_max": 0.0,
            "sync_latency_total": 0.0,
            "units_pushed": 0,
            "units_reconciled": 0,
            "partitions": 0,
            "rejoins": 0,
            "decisions": 0,
            "full_syncs": 0,
            "keys_synced_last": 0,
        }
        self._thread: threading.Thread | None = None
        if start:
            self.sync_now()
            self._thread = threading.Thread(target=self._run, name="nanolimit-two-tier", daemon=True)
            self._thread.start()

    def _wake_sync(self) -> None:
        self._wake.set()

    # -- the KernelStorage protocol ------------------------------------------------
    def lease_book(self, config: LimiterConfig) -> Any:
        """The native lease records a native limiter of ``config`` decides
        against in C (None when the extension is not built or the algorithm
        is not supported, and the limiter calls ``run_kernel``)."""
        if self._native is None or config.algorithm not in SUPPORTED_ALGORITHMS:
            return None
        limit, window, sliding = _shape(config)
        if MAX_TIME / window >= MAX_WINDOW_INDEX:
            return None  # window indexes past int64 (a token bucket refilling in < 1 ns): Python only
        with self._lock:
            book = self._books.get(config)
            if book is None:
                book = self._native.LeaseBook(self._gate, limit, window, sliding, self.sync_interval)
                self._books[config] = book
                for (cfg, key), track in self._tracks.items():
                    if cfg == config:
                        track.book, track.slot = book, book.attach(key, track)
                        self._load(track)
        return book

    def run_kernel(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict:
        """Decide locally: never waits for Redis."""
        t = time.time() if now is None else now
        with self._lock:
            return self._decide(config, key, cost, t, commit)

    def run_kernel_many(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> list[KernelVerdict]:
        t = time.time() if now is None else now
        with self._lock:
            return [self._decide(config, k, c, t, True) for k, c in zip(keys, costs)]

    def run_kernel_all(
        self, items: Sequence[tuple[LimiterConfig, str, int]], now: float | None
    ) -> list[KernelVerdict]:
        """All-or-nothing: every item is checked first, and charged only if all pass."""
        t = time.time() if now is None else now
        with self._lock:
            probe = [self._decide(cfg, k, c, t, False) for cfg, k, c in items]
            if not all(v[0] for v in probe):
                return probe
            return [self._decide(cfg, k, c, t, True) for cfg, k, c in items]

    def refund_kernel(
        self, config: LimiterConfig, key: str, cost: int, at: float | None, now: float | None
    ) -> None:
        """Give back what a decision made at ``at`` (None: the key's latest)
        charged, from this instance's own count of that window: the next
        sync writes the lower absolute count, which is how a unit reaches
        the fleet here (the fleet's counts are these per-instance hash
        fields, not the Redis store's kernel keys, so the store's own
        ``refund_kernel`` would find nothing to credit). Until that sync the
        others still see the unit spent, and this instance may spend it
        again within its lease: never more than a decision would admit. A
        charge whose window has passed, or a key not tracked, gives nothing.
        While Redis is unreachable the blind share keeps the unit spent."""
        with self._lock:
            track = self._tracks.get((config, key if type(key) is str else str.__str__(key)))
            if track is None:
                return
            self._pull(track)
            t = max(time.time() if now is None else now, track.last_now)
            live = math.floor(t / track.window)  # the key's window now, as a decision rolls to it
            k = math.floor((track.last_now if at is None else at) / track.window)
            if k != live and not (track.sliding and k == live - 1):
                return  # expired with its window: a past window's count is history
            spent = track.own.get(k, 0)
            if spent <= 0:
                return
            track.own[k] = spent - min(cost, spent)
            self._dirty[id(track)] = track
            self._load(track)

    async def refund_kernel_async(
        self, config: LimiterConfig, key: str, cost: int, at: float | None, now: float | None
    ) -> None:
        """``refund_kernel`` for ``refund_async``: local, so at once."""
        self.refund_kernel(config, key, cost, at, now)

    def forget(self, config: LimiterConfig, key: str) -> None:
        """Forget ``key`` here and delete its window hashes in Redis (the other
        instances re-write their own counts at their next sync).

        Waits for a sync in flight: that sync may carry this key's counts,
        and a delete sent before them would let them re-create the hash."""
        with self._sync_lock:
            with self._lock:
                track = self._tracks.get((config, key))
                if track is not None:
                    self._pull(track)  # the window C rolled into has a hash too
                    self._drop((config, key))
                blind = self._blind_keys.pop((config, key), None)
                if blind is not None:
                    blind.reset(key)  # the share it spent while Redis was unreachable
            if track is not None:
                names = [self._hash_key(track, k) for k in (*track.own, *track.seen_total)]
                if names:
                    with contextlib.suppress(*self._errors):  # unreachable: the keys expire
                        self.client.delete(*set(names))

    def snapshot(self, config: LimiterConfig, key: str, now: float | None) -> LimiterState | None:
        """The fleet view of ``key``: window index, fleet count, previous window count."""
        t = time.time() if now is None else check_now(now)
        with self._lock:
            track = self._tracks.get((config, key))
            if track is None:
                return None
            self._pull(track)
            k = math.floor(t / track.window)
            return LimiterState(
                config.algorithm,
                track.last_now,
                window_index=k,
                count=self._fleet(track, k),
                previous=self._fleet(track, k - 1) if track.sliding else None,
            )

    def apply(self, key: str, now: float, mutate: Any) -> Any:
        raise ValidationError("TwoTierStorage runs the built-in kernels only (it has no generic apply())")

    def evict_idle(self, cutoff: float) -> int:
        """Drop keys not decided since ``cutoff`` whose counts are all pushed
        and whose windows ended by ``cutoff`` (at rest): a key dropped inside
        its window would come back with no units and hand them out again."""
        with self._lock:
            for tr in self._tracks.values():
                self._pull(tr)
            idle = [
                ident
                for ident, tr in self._tracks.items()
                if tr.last_now < cutoff
                and (math.floor(tr.last_now / tr.window) + (2 if tr.sliding else 1)) * tr.window <= cutoff
                and all(tr.pushed.get(k) == v for k, v in tr.own.items())
            ]
            for ident in idle:
                self._drop(ident)
        return len(idle)

    def __len__(self) -> int:
        return len(self._tracks)

    # -- the local decision ------------------------------------------------------
    def _track(self, config: LimiterConfig, key: str, now: float) -> _Track:
        if type(key) is not str:
            # a str subclass may compare in Python: never let it into the
            # C lease index, whose lookups hold the gate's spinlock
            key = str.__str__(key)
        track = self._tracks.get((config, key))
        if track is None:
            algo = config.algorithm
            if algo not in SUPPORTED_ALGORITHMS:
                raise ValidationError(_REFUSED.format(algo=algo.value))
            limit, window, sliding = _shape(config)
            base = f"{self.remote.redis_key(config, key)}:{self.prefix}"
            track = _Track(config, key, base, limit, window, sliding, now)
            earlier = self._by_base.get(base)
            if earlier is not None:
                # the same Redis hashes under another config (a hot reload that
                # kept the rule's name and algorithm): one writer per hash field,
                # and the units it counted stay spent (docs/spec.md §6)
                self._pull(earlier)
                self._drop((earlier.config, earlier.key))
                if (earlier.window, earlier.sliding) == (window, sliding):
                    track.last_now = max(now, earlier.last_now)
                    for name in ("own", "pushed", "acked", "seen_total", "seen_own", "lease", "settled"):
                        setattr(track, name, dict(getattr(earlier, name)))
            book = self._books.get(config)
            if book is not None:
                track.book, track.slot = book, book.attach(key, track)
            self._tracks[(config, key)] = track
            self._by_base[base] = track
        else:
            self._pull(track)
        return track

    def _drop(self, ident: tuple[LimiterConfig, str]) -> None:
        track = self._tracks.pop(ident)
        track.alive = False
        if self._by_base.get(track.base) is track:
            del self._by_base[track.base]
        if track.book is not None:
            track.book.detach(track.key)

    def _pull(self, track: _Track) -> None:
        """Fold what native decisions did to the key's hot window into the track."""
        if track.book is None:
            return
        k, own, last_now, decided, left, left_own, want = track.book.pull(track.slot)
        if want and k is not None and want > track.want.get(k, 0):
            track.want[k] = want
        if left is not None and left_own != track.own.get(left, 0):
            track.own[left] = left_own  # the window C rolled away from
        if k is not None and own != track.own.get(k, 0):
            track.own[k] = own
        if last_now > track.last_now:
            track.last_now = last_now
        if decided:
            track.touched = time.monotonic()
            self._stats["decisions"] += decided

    def _load(self, track: _Track) -> None:
        """Hand the key's current window to native decisions: exactly what
        ``_decide`` would read for a request in that window."""
        if track.book is None:
            return
        k = math.floor(track.last_now / track.window)
        default = self._first_share(track.limit)
        share = track.lease.get(k)
        if share is None:
            share = default
        track.book.load(
            track.slot,
            k,
            track.own.get(k, 0),
            track.pushed.get(k, 0) + share,
            track.seen_total.get(k, 0) - track.seen_own.get(k, 0),
            self._fleet(track, k - 1) if track.sliding else 0,
            track.last_now,
            default,  # a later window's ceiling, when C rolls the key over before a sync
        )

    def _reserved(self, limit: int) -> int:
        """The silent members' blind shares of ``limit`` (as _RECONCILE reserves them)."""
        members = max(1, self._members)
        return sum(limit // members + (1 if rank < limit % members else 0) for rank in self._silent)

    def _first_share(self, limit: int) -> int:
        """What we may admit in a window before its first lease: an even
        share of what the silent members' blind shares leave."""
        return math.ceil(max(0, limit - self._reserved(limit)) / self._instances)

    def _fleet(self, track: _Track, k: int) -> int:
        """Fleet units in window ``k``: the others as last read, plus our own now."""
        others = track.seen_total.get(k, 0) - track.seen_own.get(k, 0)
        return others + track.own.get(k, 0)

    def _decide(self, config: LimiterConfig, key: str, cost: int, now: float, commit: bool) -> KernelVerdict:
        track = self._track(config, key, now)
        verdict = self._judge(track, cost, now, commit)
        if commit:
            self._dirty[id(track)] = track
        self._load(track)
        return verdict

    def _judge(self, track: _Track, cost: int, now: float, commit: bool) -> KernelVerdict:
        now = max(now, track.last_now)  # per key, time never runs backwards (docs/spec.md §4)
        if commit:
            track.last_now = now
            track.touched = time.monotonic()
            self._stats["decisions"] += 1
        limit, window = track.limit, track.window
        k = math.floor(now / window)
        start = k * window
        current = self._fleet(track, k)
        previous = self._fleet(track, k - 1) if track.sliding else 0
        weight = 1.0 - (now - start) / window
        estimate = previous * weight + current
        # Our units since our last sync of this window, against the lease that
        # sync granted (before any: an even share of the whole limit).
        since = track.own.get(k, 0) - track.pushed.get(k, 0)
        share = track.lease.get(k)
        if share is None:
            share = self._first_share(limit)
        fits = estimate + cost <= limit
        degraded = False
        if self._blind:
            degraded = True
            ok = fits and self._blind_allow(track, cost, now, commit)
        else:
            ok = fits and since + cost <= share
            if fits and not ok:
                if commit and cost > track.want.get(k, 0):
                    track.want[k] = cost  # the early sync asks a lease this big
                self._stats["early_syncs"] += 1
                self._wake.set()
        reset_after = start + window - now if current > 0 or previous > 0 else 0.0
        if current > 0 and track.sliding:
            reset_after = start + 2 * window - now
        if ok:
            if commit:
                track.own[k] = track.own.get(k, 0) + cost
                if self._blind:
                    self._blind_units += cost
            return (
                True,
                limit - estimate - cost,
                0.0,
                max(reset_after, start + window - now),
                0.0,
                degraded,
                "",
                0.0 if degraded else now,  # Decision.at: the key's time, as LeaseBook.decide says it
            )
        retry_after = start + window - now
        if fits:  # out of allowance, not of budget: the next sync resizes it
            retry_after = min(retry_after, self.sync_interval)
        elif track.sliding and previous > 0:
            room = limit - current - cost
            if room >= 0:
                retry_after = start + window * (1 - room / previous) - now
        return (
            False,
            limit - estimate,
            max(0.0, retry_after),
            reset_after,
            0.0,
            degraded,
            "",
            0.0 if degraded else now,
        )

    def _previous_weighted(self, track: _Track, k: int) -> float:
        """The sliding estimate's share of window ``k - 1``, at our key's time."""
        if not track.sliding:
            return 0.0
        weight = 1.0 - (track.last_now - k * track.window) / track.window
        return self._fleet(track, k - 1) * min(1.0, max(0.0, weight))

    def _blind_allow(self, track: _Track, cost: int, now: float, commit: bool) -> bool:
        """While Redis is unreachable: the native kernel with this instance's
        share of the limit, ``L // N`` plus one of the remainder's units for
        the lowest ranks, so the shares add up to ``L`` (and an instance whose
        share is 0, when ``L < N``, admits nothing). ``N`` counts every member
        the last heartbeat saw, silent ones included: the instances still
        reaching Redis reserve this same share for us while we are silent."""
        n = max(1, self._members or self._instances)
        rank = self._rank
        config = track.config
        limiter: Any = self._blind_limiters.get((config, n, rank))
        if limiter is None:
            limit = config.limit // n + (1 if rank < config.limit % n else 0)
            burst = None
            if config.burst is not None:
                burst = config.burst // n + (1 if rank < config.burst % n else 0)
            if limit == 0 or burst == 0:
                return False
            cls = getattr(self._twin, LIMITER_CLASS_NAMES[config.algorithm.value])
            self._blind_clock.set(now)
            limiter = cls(
                limit, config.window_seconds, self.local, self._blind_clock, config.rule, burst=burst
            )
            self._blind_limiters[(config, n, rank)] = limiter
        if cost > limiter.capacity:
            return False
        self._blind_clock.set(now)
        ident = (config, track.key)
        if self._blind_keys.get(ident) is not limiter:  # a fresh share each blind episode
            limiter.reset(track.key)
            self._blind_keys[ident] = limiter
            # what we admitted in this window before the cut is part of our
            # share (the others see it in our count and leave it out), and a
            # sliding counter's estimate weighs the window before it too
            k = math.floor(now / track.window)
            if config.algorithm is Algorithm.SLIDING_COUNTER:
                before = min(track.own.get(k - 1, 0), limiter.capacity)
                if before > 0:
                    self._blind_clock.set((k - 0.5) * track.window)  # inside window k - 1
                    limiter.allow(track.key, before)
                    self._blind_clock.set(now)
            spent = min(track.own.get(k, 0), limiter.capacity)
            if spent > 0:
                limiter.allow(track.key, spent)
        decision = limiter.allow(track.key, cost) if commit else limiter.peek(track.key, cost)
        return bool(decision.allowed)

    # -- the sync ------------------------------------------------------------------
    def _hash_key(self, track: _Track, k: int) -> str:
        return f"{track.base}{k}"

    def _run(self) -> None:
        gap = self.sync_interval / 4  # early syncs, at most this often
        while not self._stop.is_set():
            self._wake.wait(self.sync_interval)
            self._wake.clear()
            if self._stop.is_set():
                break
            with self._sync_lock:
                self._since_full += 1
                try:
                    self._sync(full=self._since_full >= FULL_SYNC_EVERY)
                except Exception:  # noqa: BLE001 -- logged; a bug must not end the syncs for good
                    self._stats["sync_errors"] += 1
                    _log.exception("TwoTierStorage sync failed")
            self._stop.wait(gap)

    def sync_now(self) -> bool:
        """One full sync: heartbeat, push our per-window counts of every key
        and read the fleet totals back. True if Redis answered. (The
        background thread syncs only the keys decided since its last sync,
        and every key once per ``FULL_SYNC_EVERY`` syncs.)"""
        with self._sync_lock:
            return self._sync(full=True)

    def _candidates(self, full: bool) -> list[_Track]:
        """The tracks a sync covers: all of them, or those decided since the
        last sync (Python path and C path alike)."""
        if full:
            self._dirty.clear()
            for book in self._books.values():
                book.take_dirty()
            return list(self._tracks.values())
        picked = dict(self._dirty)
        self._dirty.clear()
        for book in self._books.values():
            for track in book.take_dirty():
                picked[id(track)] = track
        return list(picked.values())

    def _sync(self, full: bool) -> bool:
        with self._lock:
            # after a partition every count is re-written and every record reloaded
            full = full or self._need_full or self._blind
            if self._gate is not None:
                self._gate.rearm()
            if full:
                self._since_full = 0
                self._need_full = False
            candidates = self._candidates(full)
            n = self._instances
            # the silent members as the last heartbeat saw them, for the reconcile
            reserve = " ".join(map(str, (self._members, *self._silent))) if self._silent else ""
            load = not self._script_loaded
        # Built in chunks, the lock (and the gate) released in between: native
        # decisions wait at most one chunk, not a whole sync of many keys.
        work: list[_Work] = []
        wall = time.time()
        for c in range(0, len(candidates), SYNC_CHUNK):
            with self._lock:
                for track in candidates[c : c + SYNC_CHUNK]:
                    if track.alive:
                        self._plan(track, full, wall, work)
        ttl_ms = max(1, math.ceil(self.heartbeat_ttl * 1000))
        grace_ms = max(ttl_ms, math.ceil(self.partition_grace * 1000))
        began = time.perf_counter()
        try:
            try:
                replies = self._exchange(work, n, ttl_ms, grace_ms, reserve, load)
            except self._errors as exc:
                # a node that restarted or failed over lost the script: the
                # reconcile writes absolute values, so sending again is safe
                if not is_noscript(exc):
                    raise
                replies = self._exchange(work, n, ttl_ms, grace_ms, reserve, True)
        except self._errors:
            self._script_loaded = False
            self._failed()
            return False
        latency = time.perf_counter() - began
        pushed_units = 0
        with self._lock:
            beat = replies[0]
            live = max(1, int(beat[0]))
            self._rank = int(beat[2])
            members = max(live, int(beat[3]))
            words = beat[4].decode() if isinstance(beat[4], bytes) else str(beat[4])
            silent = tuple(int(r) for r in words.split())
            rejoined = bool(int(replies[0][1])) and self._joined and not self._blind
            self._joined = True
            if rejoined:
                # the server lost our membership between two syncs (a restart or a
                # flush redis-py reconnected through): re-write every count we hold
                # at the next sync, as after a partition; the counts of this sync
                # were just written whole
                self._stats["rejoins"] += 1
                self._need_full = True
                for track in self._tracks.values():
                    track.pushed.clear()
            if self._blind or rejoined:
                # a restarted server knows only the instances that synced since: keep
                # the N we knew until every live instance has had time to heartbeat
                self._n_floor = (self._instances, time.monotonic() + self.heartbeat_ttl)
            floor, until = self._n_floor
            instances = max(live, floor) if time.monotonic() < until else live
            self._script_loaded = True
        answered = list(zip(work, replies[1:]))
        for c in range(0, len(answered), SYNC_CHUNK):
            with self._lock:
                touched: dict[int, _Track] = {}
                for item, (total, lease) in answered[c : c + SYNC_CHUNK]:
                    track, w, value = item.track, item.window, item.value
                    if not track.alive:
                        continue  # forgotten or evicted during the round trip: its slot may be another key's
                    # pushed is cleared by a partition (every count is re-written),
                    # acked is not: a re-write is not a unit pushed again
                    pushed_units += max(0, value - track.acked.get(w, 0))
                    track.pushed[w] = track.acked[w] = value
                    track.seen_total[w] = int(total)
                    track.seen_own[w] = value
                    if item.current:
                        track.lease[w] = int(lease)
                        track.want.pop(w, None)  # asked for with this sync
                    else:
                        track.settled[w] = track.settled.get(w, 0) + 1
                    touched[id(track)] = track
                for track in touched.values():
                    self._pull(track)  # what native decisions admitted during the round trip
                    self._load(track)  # its new lease and totals
        with self._lock:
            # N and the silent members change here, with every record reloaded
            # in the same hold, so the C path and the Python path never divide
            # by different Ns or reserve different shares
            self._members = members
            if instances != self._instances or silent != self._silent:
                self._instances = instances
                self._silent = silent
                for track in self._tracks.values():
                    self._pull(track)
                    self._load(track)
            if self._blind:
                self._blind = False
                for (_, key), limiter in self._blind_keys.items():
                    limiter.reset(key)  # the local share state is not needed until the next partition
                self._blind_keys.clear()
                # every unit admitted blind: those admitted during this round trip
                # are in our counts and go with the next sync
                self._stats["units_reconciled"] += self._blind_units
                self._blind_units = 0
            stats = self._stats
            stats["syncs"] += 1
            stats["full_syncs"] += full
            stats["keys_synced_last"] = len({id(item.track) for item in work})
            stats["units_pushed"] += pushed_units
            stats["sync_latency_last"] = latency
            stats["sync_latency_max"] = max(stats["sync_latency_max"], latency)
            stats["sync_latency_total"] += latency
        return True

    def _plan(self, track: _Track, full: bool, wall: float, work: list[_Work]) -> None:
        """Add ``track``'s windows to a sync (or drop it when idle and pushed)."""
        self._pull(track)
        own, pushed = track.own, track.pushed
        if (
            full
            and time.monotonic() - track.touched > max(3 * track.window, 10.0)
            and all(pushed.get(w) == v for w, v in own.items())
        ):
            self._drop((track.config, track.key))  # idle and fully pushed: nothing left to reconcile
            return
        window = track.window
        k = math.floor(track.last_now / window)
        # the limiter reads the wall clock (SystemClock) when its time is the
        # wall's; a day's slack covers a client clock that is off
        wall_clock = abs(track.last_now - wall) < 86_400.0
        if len(own) > 1:
            # keep the previous window for the sliding estimate; drop older ones once pushed
            for old in [w for w in own if w < k - 1 and pushed.get(w) == own[w]]:
                for table in (
                    own,
                    pushed,
                    track.acked,
                    track.want,
                    track.seen_total,
                    track.seen_own,
                    track.lease,
                    track.settled,
                ):
                    table.pop(old, None)
        if not own or (len(own) == 1 and k in own):
            windows: Any = (k - 1, k) if track.sliding else (k,)
        else:
            windows = sorted({k, k - 1} | own.keys() if track.sliding else {k} | own.keys())
        for w in windows:
            if (
                not full
                and w != k
                and own.get(w, 0) == pushed.get(w, 0)
                and track.settled.get(w, 0) >= SETTLE_READS
            ):
                continue  # a past window, pushed, its total read often enough for late pushes to land
            # alive until the window can no longer matter, by the wall clock; a window
            # of an injected clock cannot be placed on it, so it lives two windows
            # with an hour's floor, as RedisStorage does
            if wall_clock:
                ms = math.ceil(max((w + 2) * window - wall, 0.0) * 1000) + 1000
            else:
                ms = max(3_600_000, math.ceil(2 * window * 1000) + 1000)
            current = w == k
            value = own.get(w, 0)
            weight = 0.0
            if current and not self._leaving:
                previous = repr(self._previous_weighted(track, w)) if track.sliding else "0.0"
                spec = f"{value} {track.limit} {previous} {ms} 1 {track.want.get(w, 0)}"
                if track.sliding:
                    weight = min(1.0, max(0.0, 1.0 - (track.last_now - w * window) / window))
            else:
                spec = f"{value} {track.limit} 0.0 {ms} 0 0"
            work.append(_Work(track, w, value, current, self._hash_key(track, w), spec, weight))

    def _exchange(
        self, work: list[_Work], n: int, ttl_ms: int, grace_ms: int, reserve: str, load: bool
    ) -> list[Any]:
        """The sync's round trip: the heartbeat and the reconcile script over
        chunks of (key, window) — per slot on a cluster — in one pipeline.
        ``reserve`` is the silent members as the last heartbeat saw them.
        Returns the heartbeat's reply, then ``(total, lease)`` per work item."""
        if load:  # first sync, or a server lost it; SCRIPT LOAD reaches every primary of a cluster
            self.client.script_load(_RECONCILE_SCRIPT.source)
        pipe = self.client.pipeline(transaction=False)
        # execute_command: a cluster pipeline routes EVAL/EVALSHA by key but has no eval()
        pipe.execute_command("EVAL", _HEARTBEAT, 1, self._members_key, self.instance_id, ttl_ms, grace_ms)
        groups: dict[int, list[int]] = {}
        if self._slot_of is not None:
            for i, item in enumerate(work):
                groups.setdefault(self._slot_of(item.hash_key.encode()), []).append(i)
        else:
            groups[0] = list(range(len(work)))
        order: list[int] = []
        for members in groups.values():
            for c in range(0, len(members), RECONCILE_CHUNK):
                part = members[c : c + RECONCILE_CHUNK]
                # two more words per key: where in this call the same key's
                # previous window is (0: not here) and its weight, so the
                # script weighs that window's fresh total, not our last read
                at: dict[tuple[int, int], int] = {}
                words = []
                for pos, i in enumerate(part, 1):
                    item = work[i]
                    before = at.get((id(item.track), item.window - 1), 0) if item.weight > 0.0 else 0
                    at[(id(item.track), item.window)] = pos
                    words.append(f"{item.spec} {before} {item.weight!r}")
                spec = " ".join(words)
                pipe.execute_command(
                    "EVALSHA",
                    _RECONCILE_SCRIPT.sha,
                    len(part),
                    *[work[i].hash_key for i in part],
                    self.instance_id,
                    n,
                    spec,
                    reserve,
                )
                order += part
        raw = pipe.execute()
        flat = [pair for reply in raw[1:] for pair in zip(reply[::2], reply[1::2])]
        replies: list[Any] = [None] * len(work)
        for i, pair in zip(order, flat):
            replies[i] = pair
        return [raw[0], *replies]

    def _failed(self) -> None:
        """Redis unreachable: enforce our share locally until it answers again."""
        with self._lock:
            self._stats["sync_failures"] += 1
            self._need_full = True  # every count is re-written once Redis answers
            if not self._blind:
                self._blind = True
                self._stats["partitions"] += 1
                # the server may come back empty: re-write every count we hold
                for track in self._tracks.values():
                    track.pushed.clear()
                    track.lease.clear()

    # -- introspection and lifecycle -----------------------------------------------
    @property
    def instances(self) -> int:
        """Live instances at the last sync (the ``N`` of the shares)."""
        return self._instances

    @property
    def partitioned(self) -> bool:
        return self._blind

    def fleet_counts(self, config: LimiterConfig, key: str) -> dict[int, int]:
        """This instance's view of the fleet's units for ``key``, per window
        index it still holds: the others as last read, plus its own now."""
        with self._lock:
            track = self._tracks.get((config, key))
            if track is None:
                return {}
            self._pull(track)
            return {k: self._fleet(track, k) for k in sorted(set(track.own) | set(track.seen_total))}

    def metrics(self) -> dict[str, Any]:
        """Counters: syncs (``full_syncs`` of them covering every key,
        ``keys_synced_last`` keys in the latest; ``sync_failures`` when Redis
        did not answer, ``sync_errors`` when a sync raised anything else),
        sync latency (s), keys
        tracked, units pushed and reconciled after a partition, partition
        mode, live instances, ``silent_instances`` (members whose heartbeat
        lapsed less than ``partition_grace`` ago: their blind shares are
        reserved), decisions (``decisions_native`` of them, peeks included,
        answered in C on the lease)."""
        with self._lock:
            for track in self._tracks.values():
                self._pull(track)
            out = dict(self._stats)
            out["decisions_native"] = 0
            if self._gate is not None:
                out["early_syncs"] += self._gate.early_syncs
                out["decisions_native"] = self._gate.decided
            out["keys_tracked"] = len(self._tracks)
            out["partition"] = self._blind
            out["instances"] = self._instances
            out["silent_instances"] = len(self._silent)
            out["sync_latency_avg"] = out["sync_latency_total"] / out["syncs"] if out["syncs"] else 0.0
        return out

    def close(self, *, deregister: bool = True) -> None:
        """Stop the sync thread, push what is left and (``deregister``) leave
        the fleet at once rather than after ``heartbeat_ttl``, handing back
        every lease (the others may then spend it at their next sync)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if not deregister:
            return
        self._leaving = True
        self.sync_now()
        with contextlib.suppress(*self._errors):  # unreachable: our heartbeat simply expires
            self.client.zrem(self._members_key, self.instance_id)

    def __enter__(self) -> TwoTierStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<TwoTierStorage {self.instance_id!r} keys={len(self._tracks)} "
            f"instances={self._instances} partition={self._blind}>"
        )


_RECONCILE_SCRIPT = LuaScript(_RECONCILE)
