"""The sync: what the background thread does once per ``sync_interval``.

Why a module of its own: the sync is the remote tier, the half of the
storage that talks to Redis (heartbeat, what each sync sends, the replies
applied back into the records), while ``_storage`` is the local tier that
decides requests. Both work on the same per-key records, so the records'
helpers (pull from C, load into C, the fleet view) live here, in the base
class the storage builds on.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any

from ..._limiter_config import LimiterConfig
from ..redis import is_noscript
from ._records import FULL_SYNC_EVERY, RECONCILE_CHUNK, SETTLE_READS, SYNC_CHUNK, _Guard, _Track, _Work
from ._scripts import HEARTBEAT, RECONCILE

_log = logging.getLogger("nanolimit.two_tier")


class _FleetSync:
    """The records and the sync of a :class:`TwoTierStorage` (its base class;
    the storage's ``__init__`` sets every attribute declared here)."""

    sync_interval: float
    heartbeat_ttl: float
    partition_grace: float
    instance_id: str
    client: Any
    _errors: tuple[type[BaseException], ...]
    _members_key: str
    _slot_of: Any
    _lock: _Guard
    _sync_lock: threading.RLock
    _wake: threading.Event
    _stop: threading.Event
    _gate: Any
    _books: dict[LimiterConfig, Any]
    _tracks: dict[tuple[LimiterConfig, str], _Track]
    _by_base: dict[str, _Track]
    _dirty: dict[int, _Track]
    _since_full: int
    _need_full: bool
    _leaving: bool
    _script_loaded: bool
    _joined: bool
    _instances: int
    _n_floor: tuple[int, float]
    _rank: int
    _members: int
    _silent: tuple[int, ...]
    _blind: bool
    _blind_keys: dict[tuple[LimiterConfig, str], Any]
    _blind_units: int
    _stats: dict[str, Any]

    # -- the records ---------------------------------------------------------------
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
        """The silent members' blind shares of ``limit`` (as lua/reconcile.lua reserves them)."""
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

    def _previous_weighted(self, track: _Track, k: int) -> float:
        """The sliding estimate's share of window ``k - 1``, at our key's time."""
        if not track.sliding:
            return 0.0
        weight = 1.0 - (track.last_now - k * track.window) / track.window
        return self._fleet(track, k - 1) * min(1.0, max(0.0, weight))

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
            self.client.script_load(RECONCILE.source)
        pipe = self.client.pipeline(transaction=False)
        # execute_command: a cluster pipeline routes EVAL/EVALSHA by key but has no eval()
        pipe.execute_command("EVAL", HEARTBEAT, 1, self._members_key, self.instance_id, ttl_ms, grace_ms)
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
                    RECONCILE.sha,
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
