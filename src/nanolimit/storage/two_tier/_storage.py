"""The storage itself: the KernelStorage seam, the local decision against a
key's lease, partition mode, and the lifecycle. The sync (the remote tier)
is its base class, in ``_sync``; the package docstring has the design."""

from __future__ import annotations

import collections
import contextlib
import math
import os
import socket
import threading
import time
import uuid
import zlib
from collections.abc import Sequence
from typing import Any

from ..._clocks import MAX_TIME, FakeClock, check_now
from ..._decision_py import KernelVerdict
from ..._limiter_config import LIMITER_CLASS_NAMES, Algorithm, LimiterConfig, LimiterState
from ..._select import native_core, twin, twin_of
from ..._validation import check_int_option, check_seconds_option
from ...errors import ValidationError
from ..redis import RedisStorage, client_package, derive_client
from ..shared_memory import SharedMemoryStorage
from ._records import _REFUSED, GAPS_KEPT, MAX_WINDOW_INDEX, SUPPORTED_ALGORITHMS, _Guard, _shape, _Track
from ._sync import _FleetSync

# Until a host-level member exists (one fleet member for every worker that
# shares a zone), a zone as ``local`` only looks right: see docs/two_tier.md.
_ZONE_REFUSED = (
    "TwoTierStorage does not take a SharedMemoryStorage as local: every worker process that builds a "
    "TwoTierStorage is a fleet member of its own (its own leases and heartbeat, counted in N), so the "
    "zone would be shared only while Redis is unreachable, and then the host's workers would split one "
    "member's blind share between them (L / N for the host instead of L / N per worker). Leave local "
    "unset (each worker keeps its blind share in its own in-memory store), or share one limit across "
    "a host's workers with SharedMemoryStorage alone"
)


class TwoTierStorage(_FleetSync):
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

    Bound: per key and window the fleet admits at most ``L``, plus, in a
    key's first window on an instance (one that did not admit the key in the
    window before, so did not claim its default share there), what that
    instance admits before its first sync: ``min(share, r * I)`` (package
    docstring).

    Partitions: when a sync fails, the instance admits per window what Redis
    holds for it there (its count plus its lease, or its claim), in a
    window it admitted in unsynced or that began before its heartbeat
    lapsed nothing more (the others leased it around no share of ours),
    and elsewhere its blind share (``L // M`` plus the remainder by rank,
    ``M`` the members last seen) with the native kernel, on top of the fleet total
    it last saw; it keeps counting what it admits, and the first successful
    sync re-writes its cumulative per-window counts (``HSET`` of an absolute
    value per instance field: idempotent, so a retried or lost reply never
    counts a unit twice, and a restarted empty server gets the fleet's
    counts back). For ``heartbeat_ttl`` after an outage it reserves every
    member's blind share wherever that member has not written its count
    back, so the first instances back do not lease the others' blind units.

    Instances register in a sorted set scored by heartbeat expiry (server
    clock), refreshed each sync; a heartbeat lasts ``HEARTBEAT_GAPS`` of the
    instance's own longest recent sync gaps, within ``[2 * sync_interval,
    heartbeat_ttl]``. An instance that stops syncing stops counting toward
    the live ``N`` then, but stays a *silent* member for ``partition_grace``
    seconds (default 30) after: it may be cut off from Redis and admitting
    its blind share, so the others keep that share out of their leases. A
    partition of some instances then keeps the fleet within ``L`` for as
    long as the grace; a dead instance's share is idle for as long.
    ``close()`` leaves at once. Its admitted units still count. A
    ``SharedMemoryStorage`` as ``local`` is refused: every process is a
    member of its own (docs/two_tier.md).
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
        if isinstance(local, SharedMemoryStorage):
            raise ValidationError(_ZONE_REFUSED)
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
        if instance_id is not None and not isinstance(instance_id, str):
            raise ValidationError(
                f"instance_id must be a str (this instance's field name in Redis), got {instance_id!r}"
            )
        self.instance_id = instance_id or f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        if self.instance_id.startswith("lease:"):
            raise ValidationError("instance_id must not start with 'lease:' (the lease fields' prefix)")
        if not self.instance_id.isprintable() or len(self.instance_id.encode("utf-8", "replace")) > 256:
            raise ValidationError(
                f"instance_id must be printable UTF-8 of at most 256 bytes, got {self.instance_id!r}"
            )
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
        self._member_ids: tuple[str, ...] = ()  # every member at the last sync, by id (rank = index)
        self._expiries: tuple[int, ...] = ()
        self._beat_clock: tuple[int, float] = (0, 0.0)
        self._lapses_at = 0.0  # never registered: nobody leases around us, nobody reserves for us
        # after an outage, for heartbeat_ttl: the members, our rank and the ids
        # we knew before it, and until when (see _reserve)
        self._recovery: tuple[int, int, tuple[str, ...], float] | None = None
        self._gaps: collections.deque[float] = collections.deque(maxlen=GAPS_KEPT)  # between our syncs
        self._periods: collections.deque[float] = collections.deque(maxlen=GAPS_KEPT)  # background starts
        self._keys_per_sync: collections.deque[int] = collections.deque(maxlen=GAPS_KEPT)
        self._last_beat: float | None = None  # perf_counter when our last answered sync was sent
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
        self._cost_per_key = 0.0  # recent syncs' seconds per key sent, past the floor (_spread)
        self._sync_floor = 0.0  # the shortest recent sync: what one costs whatever it sends
        self._durations: collections.deque[float] = collections.deque(maxlen=GAPS_KEPT)
        self._turn = 0  # counts the background syncs: whose turn it is in a spread sync
        self._plan_spread, self._plan_turn = 1, 0  # the sync being planned
        self._leaving = False  # close(): the last sync asks for no lease
        self._closed = False  # close(): no decision after it (the gate stays shut, _Guard)
        self._slot_of: Any = None  # a cluster's key -> slot, to group a script's keys
        if getattr(self.remote, "cluster", False):
            self._slot_of = client_package(self.remote.user_client).crc.key_slot
        # The sync plans and applies a native limiter's keys in C and sends
        # their calls as RESP it wrote (LeaseBook.plan_step) over one of the
        # client's pooled connections; a cluster (calls grouped by slot) or a
        # client without a connection pool takes the Python plan.
        pool: Any = getattr(self.client, "connection_pool", None)
        self._native_sync = self._native is not None and self._slot_of is None and pool is not None
        self._encode: Any = pool.get_encoder().encode if self._native_sync else None
        self._response_error: type[BaseException] = client_package(self.client).exceptions.ResponseError
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
            "keys_deferred_last": 0,
            "sync_spread": 1,
            "heartbeat_ttl_last": 0.0,
            "sync_period_last": 0.0,
            "sync_duration_last": 0.0,
            "sync_behind": 0.0,
        }
        self._thread: threading.Thread | None = None
        if start:
            self.sync_now()
            self._thread = threading.Thread(target=self._run, name="nanolimit-two-tier", daemon=True)
            self._thread.start()

    def _wake_sync(self) -> None:
        self._wake.set()

    def _key_base(self, track: _Track) -> bytes:
        """The key's hash prefix as the client sends it, for the native plan."""
        return self._encode(track.base) if self._native_sync else b""

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
                        track.book, track.slot = book, book.attach(key, track, self._key_base(track))
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
        sync of the key (a spread sync's, in its turn) writes the lower
        absolute count, which is how a unit reaches
        the fleet here (the fleet's counts are these per-instance hash
        fields, not the Redis store's kernel keys, so the store's own
        ``refund_kernel`` would find nothing to credit). Until that sync the
        others still see the unit spent, and this instance may spend it
        again within its lease: never more than a decision would admit. A
        charge whose window has passed, or a key not tracked, gives nothing.
        While Redis is unreachable the blind share keeps the unit spent."""
        with self._lock:
            if self._closed:
                raise self._closed_error()
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
        """Forget ``key`` here and delete its window hashes in Redis, the next
        window's too, where the instances that admit the key claim their
        default shares (the others re-write their own counts at their next
        sync, and claim again).

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
                k = math.floor(track.last_now / track.window)
                windows = {*track.own, *track.seen_total, *track.claimed, k + 1}
                with contextlib.suppress(*self._errors):  # unreachable: the keys expire
                    self.client.delete(*[self._hash_key(track, w) for w in windows])

    def snapshot(self, config: LimiterConfig, key: str, now: float | None) -> LimiterState | None:
        """The fleet view of ``key``: window index, fleet count, previous window count."""
        t = time.time() if now is None else check_now(now)
        with self._lock:
            track = self._tracks.get((config, key))
            if track is None:
                return None
            self._pull(track, writing=False)
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
                self._pull(tr, writing=False)
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
            track.phase = zlib.crc32(base.encode("utf-8", "surrogatepass")) >> 24
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
                    track.claimed = dict(earlier.claimed)
            book = self._books.get(config)
            if book is not None:
                track.book, track.slot = book, book.attach(key, track, self._key_base(track))
            self._tracks[(config, key)] = track
            self._by_base[base] = track
        else:
            self._pull(track)
        return track

    def _decide(self, config: LimiterConfig, key: str, cost: int, now: float, commit: bool) -> KernelVerdict:
        if self._closed:
            raise self._closed_error()
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
        # sync granted (before any: our share of the limit, see _share).
        since = track.own.get(k, 0) - track.pushed.get(k, 0)
        share = track.lease.get(k)
        if share is None:
            share = self._unleased(track, k)
        fits = estimate + cost <= limit
        degraded = False
        if self._blind:
            degraded = True
            cap = track.blind_cap.get(k)
            if cap is None and not self._reserved_for_us(now, start):
                cap = track.blind_cap[k] = track.own.get(k, 0)  # what we admitted there: no more
            if cap is not None:  # a window Redis holds a ceiling for us in: that ceiling
                ok = fits and track.own.get(k, 0) + cost <= cap
            else:
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

    def _reserved_for_us(self, now: float, start: float) -> bool:
        """Whether the others keep our blind share out of every lease of the
        window that began at ``start`` (the key's clock, now ``now``): it
        began after our heartbeat lapsed, so no lease there was granted
        while we still counted as live, with no share reserved for us and
        no field of ours to stand in for it. ``timeout`` covers the fleet's
        clocks disagreeing on when a window begins. A window of an injected
        clock is placed on ours by how far into it the key is."""
        if self._alone:
            return True
        began = time.monotonic() - (now - start)
        return began >= self._lapses_at + self.timeout

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
            self._pull(track, writing=False)
            return {k: self._fleet(track, k) for k in sorted(set(track.own) | set(track.seen_total))}

    def metrics(self) -> dict[str, Any]:
        """Counters: syncs (``full_syncs`` of them covering every key,
        ``keys_synced_last`` keys in the latest, ``keys_deferred_last`` left
        for their turn in a later one, one sync of ``sync_spread``;
        ``sync_failures`` when Redis
        did not answer, ``sync_errors`` when a sync raised anything else),
        sync latency (s), keys
        tracked, units pushed and reconciled after a partition, partition
        mode, live instances, ``silent_instances`` (members whose heartbeat
        lapsed less than ``partition_grace`` ago: their blind shares are
        reserved), decisions (``decisions_native`` of them, peeks included,
        answered in C on the lease). How far behind the background syncs
        are, over the last 32: ``sync_period_last`` and
        ``sync_period_p50`` (seconds start to start), ``sync_duration_last``,
        ``sync_behind`` (how late the last one started), ``keys_per_sync``
        (median) and ``sync_interval_effective``, the longest recent period
        (at least ``sync_interval``): the ``I`` of the ``r · I`` bound term."""
        with self._lock:
            for track in self._tracks.values():
                self._pull(track, writing=False)
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
            periods = sorted(self._periods)
            out["sync_period_p50"] = periods[len(periods) // 2] if periods else 0.0
            out["sync_interval_effective"] = max(self.sync_interval, periods[-1] if periods else 0.0)
            keys = sorted(self._keys_per_sync)
            out["keys_per_sync"] = keys[len(keys) // 2] if keys else 0
        return out

    def close(self, *, deregister: bool = True) -> None:
        """Stop the sync thread, push what is left and (``deregister``) leave
        the fleet at once rather than after ``heartbeat_ttl``, handing back
        every lease (the others may then spend it at their next sync).

        Decisions end first: one admitted during the last round trip would
        spend a lease that sync hands back, and one after it a share nobody
        reserves, neither ever pushed. So a decision or refund on a closed
        storage raises ``ValidationError``."""
        with self._lock:
            self._closed = True  # the gate closes with the lock and stays shut
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

    def _closed_error(self) -> ValidationError:
        return ValidationError(
            f"TwoTierStorage {self.instance_id!r} is closed: it syncs no more and has handed its leases "
            "back, so it decides nothing"
        )

    def __enter__(self) -> TwoTierStorage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"<TwoTierStorage {self.instance_id!r} keys={len(self._tracks)} "
            f"instances={self._instances} partition={self._blind}>"
        )
