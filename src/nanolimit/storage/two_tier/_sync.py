"""The sync: what the background thread does once per ``sync_interval``.

Why a module of its own: the sync is the remote tier, the half of the
storage that talks to Redis (heartbeat, what each sync sends, the replies
applied back into the records), while ``_storage`` is the local tier that
decides requests. Both work on the same per-key records, so the records'
helpers (pull from C, load into C, the fleet view) live here, in the base
class the storage builds on.
"""

from __future__ import annotations

import collections
import logging
import math
import struct
import threading
import time
from typing import Any, Final

from ..._limiter_config import LimiterConfig
from ..redis import is_noscript
from ._records import (
    ABSENT,
    FULL_SYNC_EVERY,
    HEARTBEAT_GAPS,
    MAX_SPREAD,
    PLAN_STEP,
    RECONCILE_CHUNK,
    SETTLE_READS,
    SYNC_BUDGET,
    SYNC_CHUNK,
    _Guard,
    _Track,
    _Work,
)
from ._scripts import HEARTBEAT, RECONCILE

_log = logging.getLogger("nanolimit.two_tier")


#: A key's reconcile spec: eleven little-endian doubles (the script's
#: ``struct.unpack``), every integer in them exact (below 2**53).
_SPEC: Final = struct.Struct("<11d")


def _expiry_ms(window_index: int, window: float, wall: float, wall_clock: bool) -> int:
    """A window's hash lives until the window can no longer matter, by the
    wall clock: set once, when the hash is made. A window of an injected
    clock cannot be placed on the wall's, so it lives two windows with an
    hour's floor, as RedisStorage does, refreshed on every sync: negative."""
    if wall_clock:
        return math.ceil(max((window_index + 2) * window - wall, 0.0) * 1000) + 1000
    return -max(3_600_000, math.ceil(2 * window * 1000) + 1000)


class _FleetSync:
    """The records and the sync of a :class:`TwoTierStorage` (its base class;
    the storage's ``__init__`` sets every attribute declared here)."""

    sync_interval: float
    timeout: float
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
    _native_sync: bool
    _encode: Any
    _response_error: type[BaseException]
    _since_full: int
    _cost_per_key: float
    _sync_floor: float
    _durations: collections.deque[float]
    _turn: int
    _plan_spread: int
    _plan_turn: int
    _need_full: bool
    _leaving: bool
    _closed: bool
    _script_loaded: bool
    _joined: bool
    _instances: int
    _n_floor: tuple[int, float]
    _rank: int
    _members: int
    _silent: tuple[int, ...]
    _member_ids: tuple[str, ...]
    _expiries: tuple[int, ...]  # each member's heartbeat expiry (server ms), as our last heartbeat saw it
    _beat_clock: tuple[int, float]  # (the server's clock in ms, our monotonic) at that heartbeat's reply
    _lapses_at: float  # when our heartbeat expires, on our monotonic clock
    _recovery: tuple[int, int, tuple[str, ...], float] | None
    _gaps: collections.deque[float]
    _periods: collections.deque[float]
    _keys_per_sync: collections.deque[int]
    _last_beat: float | None
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

    def _pull(self, track: _Track, writing: bool = True) -> None:
        """Fold what native decisions did to the key's hot window into the
        track, and, for a record the sync keeps in C (fast), its window's
        sync state: the dicts hold it from here on when ``writing`` (the
        caller may change them; ``_load`` hands the record back to C)."""
        if track.book is None:
            return
        k, own, last_now, decided, left, left_own, want, sync = track.book.pull(track.slot, writing)
        if sync is not None:
            self._fold(track, sync)
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

    @staticmethod
    def _fold(track: _Track, sync: tuple[Any, ...]) -> None:
        w, pushed, acked, total, seen_own, lease, claimed, want, touched, past = sync
        if past is not None:  # C rolled into window w, or synced the window before again
            p, units, *state = past
            tables = (
                track.own,
                track.pushed,
                track.acked,
                track.seen_total,
                track.seen_own,
                track.lease,
                track.claimed,
                track.settled,
            )
            for table, at, value in zip(
                tables, (p, p, p, p, p, p, p + 1, p), (units or ABSENT, *state[:-1], state[-1] or ABSENT)
            ):
                if value == ABSENT:
                    table.pop(at, None)
                else:
                    table[at] = value
            # what C rolled past, pushed and settled there (the dicts hold it as loaded)
            _FleetSync._drop_windows(track, [x for x in track.own if x < p])
            _FleetSync._prune(track, w)
        for table, at, value in (
            (track.pushed, w, pushed),
            (track.acked, w, acked),
            (track.seen_total, w, total),
            (track.seen_own, w, seen_own),
            (track.lease, w, lease),
            (track.claimed, w + 1, claimed),
            (track.want, w, want or ABSENT),
        ):
            if value == ABSENT:
                table.pop(at, None)
            else:
                table[at] = value
        if touched > track.touched:
            track.touched = touched

    @staticmethod
    def _prune(track: _Track, k: int) -> None:
        """Drop the windows before ``k - 1`` (``k``: the key's current
        window) with nothing of ours left to push: no decision reads them. A
        sync's plan does it, a partition or a rejoin before it forgets what
        was pushed, and a fold of what C rolled past. (A window only read,
        none of our units in it, goes too: a key refused every request
        would otherwise keep one more each window.)"""
        own, pushed = track.own, track.pushed
        old = {w for w in own if w < k - 1 and pushed.get(w) == own[w]}
        for table in _FleetSync._window_tables(track)[1:]:
            old.update(w for w in table if w < k - 1 and w not in own)
        _FleetSync._drop_windows(track, old)

    @staticmethod
    def _window_tables(track: _Track) -> tuple[dict[int, int], ...]:
        """Every per-window dict of a track, ``own`` first."""
        return (
            track.own,
            track.pushed,
            track.acked,
            track.want,
            track.seen_total,
            track.seen_own,
            track.lease,
            track.settled,
            track.claimed,
        )

    @staticmethod
    def _drop_windows(track: _Track, windows: Any) -> None:
        tables = _FleetSync._window_tables(track)
        for old in windows:
            for table in tables:
                table.pop(old, None)

    def _load(self, track: _Track) -> None:
        """Hand the key's current window to native decisions: exactly what
        ``_decide`` would read for a request in that window."""
        if track.book is None:
            return
        k = math.floor(track.last_now / track.window)
        share = track.lease.get(k)
        if share is None:
            share = self._unleased(track, k)
        track.book.load(
            track.slot,
            k,
            track.own.get(k, 0),
            track.pushed.get(k, 0) + share,
            track.seen_total.get(k, 0) - track.seen_own.get(k, 0),
            self._fleet(track, k - 1) if track.sliding else 0,
            track.last_now,
            self._unleased(track, k + 1),  # the next window's ceiling, when C rolls into it before a sync
            self._fast_state(track, k),
        )

    def _fast_state(self, track: _Track, k: int) -> tuple[Any, ...] | None:
        """Window ``k``'s sync state for C, and window ``k - 1``'s, when the
        sync can plan and apply the key there (LeaseBook.plan_step): a key
        whose only other window is ``k - 1``. C sends that one as _plan
        would (until settled, and in full syncs), and moves the key on once
        it is pushed (LeaseBook: fast_rolls). None: Python."""
        if not self._native_sync or self._blind:
            return None
        if any(w != k and w != k - 1 for w in track.own):
            return None
        p = k - 1
        return (
            track.pushed.get(k, ABSENT),
            track.acked.get(k, ABSENT),
            track.seen_total.get(k, ABSENT),
            track.seen_own.get(k, ABSENT),
            track.lease.get(k, ABSENT),
            track.claimed.get(k + 1, ABSENT),
            track.want.get(k, 0),
            track.touched,
            (
                track.own.get(p, 0),
                track.pushed.get(p, ABSENT),
                track.acked.get(p, ABSENT),
                track.seen_total.get(p, ABSENT),
                track.seen_own.get(p, ABSENT),
                track.lease.get(p, ABSENT),
                track.claimed.get(k, ABSENT),
                track.settled.get(p, 0),
            ),
        )

    def _share(self, limit: int) -> int:
        """Our share of ``limit``: ``L // M`` plus one of the remainder's
        units for the ``L mod M`` lowest ranks by id, ``M`` every member the
        last heartbeat saw (silent ones too), so the shares add up to ``L``.
        It is what we admit in a window before its first lease there (the
        default share, which the others keep out of their leases once we
        claimed it) and, while Redis is unreachable, in a window we hold no
        ceiling for (the blind share, which the others reserve for us once
        we are silent)."""
        members = max(1, self._members or self._instances)
        return limit // members + (1 if self._rank < limit % members else 0)

    def _unleased(self, track: _Track, k: int) -> int:
        """What we may admit in window ``k`` before its first lease: our
        default share, but never more than the claim Redis holds for us
        there. A claim made before the fleet shrank is the smaller one, and
        the others lease around it, not around our larger share now."""
        share = self._share(track.limit)
        claimed = track.claimed.get(k)
        return share if claimed is None or claimed >= share else claimed

    def _ceiling(self, track: _Track, k: int, share: int) -> int:
        """The most our count in window ``k`` may reach before the reply of
        a sync sent now lands (``share``: ours, see _share): Redis holds that
        much for us meanwhile."""
        if self._blind:
            cap = track.blind_cap.get(k)
            return max(track.own.get(k, 0), share) if cap is None else cap
        # acked: pushed is cleared to re-write every count after a rejoin, and C may
        # still hold the ceiling loaded before that
        return track.acked.get(k, 0) + track.lease.get(k, share)

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
        """Syncs start every ``sync_interval``, start to start: one that
        overruns starts the next at once (the next is due one interval after
        it started, never a backlog). A wake-up (a lease ran out) starts one
        early, at most one per ``sync_interval / 4`` after the last start."""
        interval = self.sync_interval
        gap = interval / 4
        due = time.monotonic() + interval
        last: float | None = None
        while not self._stop.is_set():
            self._wake.wait(max(0.0, due - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                break
            start = time.monotonic()
            with self._sync_lock:
                self._since_full += 1
                try:
                    self._sync(full=self._since_full >= FULL_SYNC_EVERY, background=True)
                except Exception:  # noqa: BLE001 -- logged; a bug must not end the syncs for good
                    self._stats["sync_errors"] += 1
                    _log.exception("TwoTierStorage sync failed")
            ended = time.monotonic()
            with self._lock:  # metrics() reads these under it
                stats = self._stats
                stats["sync_behind"] = max(0.0, start - due)
                stats["sync_duration_last"] = ended - start
                if last is not None:
                    stats["sync_period_last"] = start - last
                    self._periods.append(start - last)
                self._keys_per_sync.append(stats["keys_synced_last"])
            last = start
            due = start + interval
            floor = start + gap - time.monotonic()
            if floor > 0 and not self._need_full:  # a rejoin's re-write goes at once
                self._stop.wait(floor)

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

    @property
    def _alone(self) -> bool:
        """The only member the last heartbeat saw (or none yet): nobody leases
        around us while we are cut off, so every window is ours to share."""
        return self._members <= 1

    def _heartbeat_ttl(self) -> float:
        """How long our heartbeat keeps us live: ``HEARTBEAT_GAPS`` of our own
        longest recent gaps between syncs (before any, a sync interval plus
        the timeout), within [2 * sync_interval, heartbeat_ttl]. So a cut
        instance is silent to the others a few of its periods after its last
        sync, and one that syncs slowly (many keys, a busy host) is not."""
        gap = max(self._gaps) if self._gaps else self.sync_interval + self.timeout
        return min(self.heartbeat_ttl, max(2 * self.sync_interval, HEARTBEAT_GAPS * gap))

    def _reserve(self) -> list[str]:
        """The members whose shares the reconcile keeps out of leases where
        they have no field: "members rank expiry ...", then their ids. Each
        other member whose heartbeat, as our last one saw it, may have
        lapsed by the time this sync's reconcile runs: the script reserves
        it once the server's clock is past that expiry (a later heartbeat
        only extends it), so a member cut off since our last heartbeat is
        reserved from its lapse on. For ``heartbeat_ttl`` after an outage
        (our partition, or a server that came back empty), every other
        member we knew before it, at once (expiry 0): each may have admitted
        its blind share in this window, which a restarted server has not seen."""
        recovery = self._recovery
        if self._blind and self._member_ids:  # this sync may be the first one back
            recovery = (self._members, self._rank, self._member_ids, math.inf)
        if recovery is not None and time.monotonic() < recovery[3]:
            members, _, ids, _ = recovery
            chosen = [(r, 0) for r, member in enumerate(ids) if member != self.instance_id]
        else:
            members, ids = self._members, self._member_ids
            server_ms, at = self._beat_clock
            # the latest the reconcile can run on the server's clock: now, plus
            # the round trip's timeout
            latest = server_ms + (time.monotonic() - at + self.timeout) * 1000.0
            chosen = [
                (r, expiry)
                for r, (member, expiry) in enumerate(zip(ids, self._expiries))
                if member != self.instance_id and expiry <= latest
            ]
        if not chosen:
            return []
        shape = " ".join(f"{r} {expiry}" for r, expiry in chosen)
        return [f"{members} {shape}", *(ids[r] for r, _ in chosen)]

    def _spread(self, pending: int) -> int:
        """How many syncs a key with room in its lease waits for its turn
        (1: none): the least power of two, up to ``MAX_SPREAD``, that brings
        the keys decided since the last sync within what one sync covers in
        ``SYNC_BUDGET`` of the interval, less what any sync costs (the
        shortest recent one), at the recent cost per key sent. So a
        sync keeps its interval at many keys, and a key that may run short
        (half its lease spent, a larger cost refused, the next window not
        yet claimed) still goes with every sync."""
        cost = self._cost_per_key
        budget = SYNC_BUDGET * self.sync_interval - self._sync_floor
        if budget <= 0.0:  # a round trip longer than the budget: spread only what keys add
            budget = SYNC_BUDGET * self.sync_interval
        if cost <= 0.0 or pending * cost <= budget:
            return 1
        fits = max(1.0, budget / cost)
        spread = 1
        while spread < MAX_SPREAD and pending > fits * spread:
            spread *= 2
        return spread

    def _waits_its_turn(self, track: _Track, k: int) -> bool:
        """``LeaseBook.waits_its_turn`` for a key of the Python plan, window
        ``k`` its only one to send: Redis holds its count and whole ceiling,
        so what waits is only the fleet's view of its count."""
        spread = self._plan_spread
        share = self._share(track.limit)
        acked, lease = track.acked.get(k), track.lease.get(k)
        if spread <= 1 or acked is None or lease is None or not share or track.want.get(k, 0):
            return False
        own = track.own.get(k, 0)
        if own and track.claimed.get(k + 1) != share:
            return False
        return 2 * (own - acked) <= lease and (track.phase & (spread - 1)) != self._plan_turn

    def _sync(self, full: bool, background: bool = False) -> bool:
        began = time.monotonic()
        synced = self._sync_once(full, background)
        if synced:
            took = time.monotonic() - began
            durations = self._durations
            durations.append(took)
            # what a sync costs whatever it sends (the heartbeat's round trip):
            # the shortest of the recent ones; the rest is per key sent
            self._sync_floor = floor = min(durations)
            sent = self._stats["keys_synced_last"]
            if sent:
                cost = max(0.0, took - floor) / sent
                self._cost_per_key = cost if not self._cost_per_key else (self._cost_per_key + cost) / 2
        return synced

    def _sync_once(self, full: bool, background: bool) -> bool:
        with self._lock:
            # a spread sync: only the background's, never one that must re-write every count
            spreading = background and not (self._need_full or self._blind or self._leaving)
            # after a partition every count is re-written and every record reloaded
            full = full or self._need_full or self._blind
            if self._gate is not None:
                self._gate.rearm()
            if full:
                self._since_full = 0
                self._need_full = False
            n = self._instances
            reserve = self._reserve()
            load = not self._script_loaded
            wall = time.time()
            # the fast records are planned in C; cluster slots, a partition and
            # close() take the Python plan for every key
            books = (
                [] if self._blind or self._leaving or not self._native_sync else list(self._books.values())
            )
            spread = 1
            if spreading:
                pending = len(self._tracks) if full else len(self._dirty) + sum(b.pending for b in books)
                spread = self._spread(pending)
                self._turn += 1
            self._plan_spread, self._plan_turn = spread, self._turn & (spread - 1)
            if books:
                candidates = self._begin_native(books, full, wall, n, reserve)
            else:
                candidates = self._candidates(full)
        # The native plan: a few hundred slots per hold of the storage's lock
        # (not the gate: a C decision waits on the spinlock for microseconds);
        # the C loops run without the GIL.
        for book in books:
            while book.planning:
                with self._lock.lock:
                    candidates += book.plan_step(PLAN_STEP)
        native = [(book, book.take_commands()) for book in books]
        deferred = sum(book.deferred for book in books)
        if books:
            with self._lock:
                self._stats["decisions"] += sum(book.folded for book in books)
        # Built in chunks, the lock (and the gate) released in between and the
        # GIL handed over: a decision waits at most one chunk (~0.1-0.3 ms), not
        # a whole sync of many keys, nor the sync thread retaking the lock.
        work: list[_Work] = []
        for c in range(0, len(candidates), SYNC_CHUNK):
            with self._lock:
                for track in candidates[c : c + SYNC_CHUNK]:
                    if track.alive:
                        deferred += self._plan(track, full, wall, work)
            time.sleep(0)  # hand the GIL over: a decision waiting on the lock goes first
        ttl = self._heartbeat_ttl()
        ttl_ms = max(1, math.ceil(ttl * 1000))
        grace_ms = max(1, math.ceil(self.partition_grace * 1000))
        began = time.perf_counter()
        try:
            try:
                replies, answers = self._exchange(work, n, ttl_ms, grace_ms, reserve, load, native)
            except self._errors as exc:
                # a node that restarted or failed over lost the script: the
                # reconcile writes absolute values, so sending again is safe
                if not is_noscript(exc):
                    raise
                replies, answers = self._exchange(work, n, ttl_ms, grace_ms, reserve, True, native)
        except self._errors:
            if not self._blind:
                # the heartbeat of the sync that failed first may have run all
                # the same (a lost reply): we may count as live one more ttl.
                # The retries of the outage do not move it: each would, and no
                # window would ever be ours again while Redis stays away
                self._lapses_at = max(self._lapses_at, time.monotonic() + ttl)
            self._script_loaded = False
            self._last_beat = None  # the gap across an outage is no sync period
            self._failed()
            return False
        latency = time.perf_counter() - began
        if self._last_beat is not None:
            self._gaps.append(began - self._last_beat)
        # a sync that loaded the script (the first, or one after the server lost
        # it) also set up a connection: the gap to the next one is no period
        self._last_beat = None if load else began
        pushed_units = 0
        with self._lock:
            beat = replies[0]
            live = max(1, int(beat[0]))
            rank = int(beat[2])
            members = max(live, int(beat[3]))
            words = beat[4].decode() if isinstance(beat[4], bytes) else str(beat[4])
            silent = tuple(int(r) for r in words.split())
            ids = tuple(i.decode() if isinstance(i, bytes) else str(i) for i in beat[5])
            expiries = tuple(int(e) for e in beat[6])
            # the server's clock against ours, as of this reply (which came after
            # the heartbeat ran: later expiries on our clock, never earlier)
            beat_clock = (int(beat[7]), time.monotonic())
            rejoined = bool(int(replies[0][1])) and self._joined and not self._blind
            self._joined = True
            if rejoined:
                # the server lost our membership between two syncs (a restart or a
                # flush redis-py reconnected through): re-write every count we hold
                # at the next sync, as after a partition, and claim again; the
                # counts of this sync were just written whole
                self._stats["rejoins"] += 1
                self._need_full = True
                for track in self._tracks.values():
                    self._pull(track)
                    self._prune(track, math.floor(track.last_now / track.window))  # not re-written
                    track.pushed.clear()
                    track.claimed.clear()
                    # the leases Redis held for us are gone with it (a key this sync
                    # did not send, or left for its turn): nothing more on them
                    # until the next sync re-writes our counts and grants again
                    for w in track.lease:
                        track.lease[w] = 0
                    self._load(track)
                self._wake.set()  # that sync: at once, not an interval on
            now = time.monotonic()
            if self._blind or rejoined:
                # a restarted server knows only the instances that synced since: keep
                # the N we knew until every live instance has had time to heartbeat,
                # and the members and our rank (so our shares are the ones the
                # others compute for us), reserving each member's share (_reserve)
                self._n_floor = (self._instances, now + self.heartbeat_ttl)
                if self._member_ids and (self._recovery is None or self._recovery[3] <= now):
                    self._recovery = (self._members, self._rank, self._member_ids, now + self.heartbeat_ttl)
            floor, until = self._n_floor
            instances = max(live, floor) if now < until else live
            if self._recovery is not None and self._recovery[3] <= now:
                self._recovery = None
            if self._recovery is not None and self._recovery[0] >= members:
                members, rank = self._recovery[0], self._recovery[1]
            self._script_loaded = True
        # the native plan's answers, one reconcile call per hold (C, no GIL)
        native_keys = 0
        for (book, _), calls in zip(native, answers):
            native_keys += book.planned_keys
            for c, reply in enumerate(calls):
                with self._lock.lock:
                    units, rest = book.apply(c, reply, rejoined)
                pushed_units += units
                if rest:  # keys the Python side took over during the round trip
                    with self._lock:
                        taken: dict[int, _Track] = {}
                        for track, w, value, total, lease, claimed, claim, current in rest:
                            pushed_units += self._settle(
                                track, w, value, total, current, lease, claimed, claim, rejoined
                            )
                            taken[id(track)] = track
                        for track in taken.values():  # after all its windows (a sliding key's two)
                            self._pull(track)
                            self._load(track)
        answered = list(zip(work, replies[1:]))
        c = 0
        while c < len(answered):
            # a key's windows are settled in one hold: its record is reloaded
            # after its last answer, never made fast by the first (then the
            # next one's settled state would be overwritten from C's record)
            end = min(c + SYNC_CHUNK, len(answered))
            while end < len(answered) and answered[end][0].track is answered[end - 1][0].track:
                end += 1
            with self._lock:
                touched: dict[int, _Track] = {}
                for item, (total, lease, claimed) in answered[c:end]:
                    track = item.track
                    if not track.alive:
                        continue  # forgotten or evicted during the round trip: its slot may be another key's
                    claim = item.claim if item.claim_key is not None else 0
                    pushed_units += self._settle(
                        track, item.window, item.value, total, item.current, lease, claimed, claim, rejoined
                    )
                    touched[id(track)] = track
                for track in touched.values():
                    self._pull(track)  # what native decisions admitted during the round trip
                    self._load(track)  # its new lease and totals
            c = end
            time.sleep(0)
        with self._lock:
            # N, the members and our rank change here, with every record
            # reloaded in the same hold, so the C path and the Python path never
            # divide by different Ns or use different shares
            self._silent, self._member_ids, self._expiries = silent, ids, expiries
            self._beat_clock = beat_clock
            if self.instance_id in ids:
                # when every other member reserves our blind share where we hold
                # no field: our heartbeat's expiry, on our clock
                ours = expiries[ids.index(self.instance_id)]
                self._lapses_at = beat_clock[1] + (ours - beat_clock[0]) / 1000.0
            shape = (instances, members, rank)
            if shape != (self._instances, self._members, self._rank):
                self._instances, self._members, self._rank = shape
                for track in self._tracks.values():
                    self._pull(track)
                    self._load(track)
            if self._blind:
                self._blind = False
                for (_, key), limiter in self._blind_keys.items():
                    limiter.reset(key)  # the local share state is not needed until the next partition
                self._blind_keys.clear()
                for track in self._tracks.values():
                    track.blind_cap.clear()
                # every unit admitted blind: those admitted during this round trip
                # are in our counts and go with the next sync
                self._stats["units_reconciled"] += self._blind_units
                self._blind_units = 0
            stats = self._stats
            stats["syncs"] += 1
            stats["full_syncs"] += full
            stats["keys_synced_last"] = len({id(item.track) for item in work}) + native_keys
            stats["keys_deferred_last"] = deferred
            stats["sync_spread"] = spread
            stats["units_pushed"] += pushed_units
            stats["sync_latency_last"] = latency
            stats["sync_latency_max"] = max(stats["sync_latency_max"], latency)
            stats["sync_latency_total"] += latency
            stats["heartbeat_ttl_last"] = ttl
        return True

    @staticmethod
    def _settle(
        track: _Track,
        w: int,
        value: int,
        total: Any,
        current: bool,
        lease: Any,
        claimed: Any,
        claim: int,
        rejoined: bool,
    ) -> int:
        """One (key, window) answer into the track; the units it pushed."""
        # pushed is cleared by a partition (every count is re-written),
        # acked is not: a re-write is not a unit pushed again
        units = max(0, value - track.acked.get(w, 0))
        track.pushed[w] = track.acked[w] = value
        track.seen_total[w] = int(total)
        track.seen_own[w] = value
        if current:
            # a server that lost our membership granted this lease without
            # reserving the others' shares (we did not know to send them):
            # none is used, and the next sync, which sends them, grants it
            track.lease[w] = 0 if rejoined else int(lease)
            track.want.pop(w, None)  # asked for with this sync
            if claim and int(claimed):
                track.claimed[w + 1] = claim
        else:
            track.settled[w] = track.settled.get(w, 0) + 1
        return units

    def _begin_native(
        self, books: list[Any], full: bool, wall: float, n: int, reserve: list[str]
    ) -> list[_Track]:
        """Start the native plan of every book (under the lock); the tracks
        left to the Python plan: those of no book (reference limiters)."""
        enc = self._encode

        def bulk(value: str) -> bytes:
            data = enc(value)
            return b"$%d\r\n%b\r\n" % (len(data), data)

        head = bulk("EVALSHA") + bulk(RECONCILE.sha)
        mid = bulk(self.instance_id) + bulk(str(n))
        words = reserve or [""]
        tail = b"".join(bulk(word) for word in words)
        if full:
            python = [track for track in self._tracks.values() if track.book is None]
        else:
            python = []
            for track in self._dirty.values():
                if track.book is None:
                    python.append(track)
                elif track.alive:
                    track.book.mark_dirty(track.slot)  # decided in Python: the book covers it
        self._dirty.clear()
        mono = time.monotonic()
        for book in books:
            # a full sync leaves a key that may be idle to _plan, which drops it
            idle = max(3 * book.window, 10.0) - 1.0
            book.plan_begin(
                full,
                self._share(book.limit),
                wall,
                mono,
                idle,
                head,
                mid,
                tail,
                len(words),
                self._plan_spread,
                self._plan_turn,
            )
        return python

    def _plan(self, track: _Track, full: bool, wall: float, work: list[_Work]) -> int:
        """Add ``track``'s windows to a sync (or drop it when idle and pushed);
        1 when it waits its turn (see _spread) instead, still dirty."""
        self._pull(track)
        own, pushed = track.own, track.pushed
        if (
            full
            and time.monotonic() - track.touched > max(3 * track.window, 10.0)
            and all(pushed.get(w) == v for w, v in own.items())
        ):
            self._drop((track.config, track.key))  # idle and fully pushed: nothing left to reconcile
            return 0
        window = track.window
        k = math.floor(track.last_now / window)
        # the limiter reads the wall clock (SystemClock) when its time is the
        # wall's; a day's slack covers a client clock that is off
        wall_clock = abs(track.last_now - wall) < 86_400.0
        self._prune(track, k)  # the previous window stays: the sliding estimate reads it
        if not own or (len(own) == 1 and k in own):
            windows: Any = (k - 1, k) if track.sliding else (k,)
        else:
            windows = sorted({k, k - 1} | own.keys() if track.sliding else {k} | own.keys())
        if not full:
            # a past window goes until our units there are pushed, and a sliding
            # key's until its total (the estimate's previous window) has been
            # read often enough for the others' late pushes to land
            settled = track.settled
            windows = [
                w
                for w in windows
                if w == k
                or own.get(w, 0) != pushed.get(w, 0)
                or (track.sliding and settled.get(w, 0) < SETTLE_READS)
            ]
        # one window left to send (a sliding key's past one settled too), or a
        # full sync's re-read of a sliding key's settled past window: it may
        # wait its turn (the past window is read again in a later one's)
        again = (
            full
            and track.sliding
            and list(windows) == [k - 1, k]
            and own.get(k - 1, 0) == pushed.get(k - 1, 0)
            and track.settled.get(k - 1, 0) >= SETTLE_READS
        )
        if (len(windows) == 1 or again) and not self._leaving and self._waits_its_turn(track, k):
            self._dirty[id(track)] = track  # its units go with a later sync
            self._load(track)  # _pull took its sync state out of C: hand it back
            return 1
        for w in windows:
            ms = _expiry_ms(w, window, wall, wall_clock)
            current = w == k
            value = own.get(w, 0)
            if current and not self._leaving:
                previous = self._previous_weighted(track, w) if track.sliding else 0.0
                spec: tuple[float, ...] = (value, track.limit, previous, ms, 1, track.want.get(w, 0))
                weight = 0.0
                if track.sliding:
                    weight = min(1.0, max(0.0, 1.0 - (track.last_now - w * window) / window))
                share = self._share(track.limit)
                if self._blind:
                    held = self._ceiling(track, w, share)
                else:  # _ceiling, inline: once per key and sync
                    lease = track.lease.get(w)
                    held = track.acked.get(w, 0) + (self._unleased(track, w) if lease is None else lease)
                item = _Work(track, w, value, True, self._hash_key(track, w), spec, weight, held)
                if value and track.claimed.get(w + 1) != share and share:
                    # we admit this key now: reserve our default share of the next
                    # window, so what we admit there before our first sync of it is
                    # never unseen by the others' leases. Blind too: the first sync
                    # back makes us live again, and what we admit in the next window
                    # (blind while its reply is in flight) would have no field there
                    item.claim_key, item.claim = self._hash_key(track, w + 1), share
            else:
                spec = (value, track.limit, 0.0, ms, 0, 0)
                item = _Work(track, w, value, current, self._hash_key(track, w), spec)
            work.append(item)
        if self._leaving:
            # close(): the claims on later windows go back too (a count of 0, no lease)
            for w in [w for w in track.claimed if w > k and w not in own]:
                spec = (0, track.limit, 0.0, _expiry_ms(w, window, wall, wall_clock), 0, 0)
                work.append(_Work(track, w, 0, False, self._hash_key(track, w), spec))
        return 0

    def _exchange(
        self,
        work: list[_Work],
        n: int,
        ttl_ms: int,
        grace_ms: int,
        reserve: list[str],
        load: bool,
        native: list[tuple[Any, list[bytes]]],
    ) -> tuple[list[Any], list[list[Any]]]:
        """The sync's round trip: the heartbeat and the reconcile script over
        chunks of (key, window) — per slot on a cluster — in one pipeline,
        then the native plan's calls (RESP already) on the same connection.
        ``reserve`` is the silent members as the last heartbeat saw them.
        Returns the heartbeat's reply, then ``(total, lease, claimed)`` per
        work item; and per book, each native call's flat answer."""
        if load:  # first sync, or a server lost it; SCRIPT LOAD reaches every primary of a cluster
            self.client.script_load(RECONCILE.source)
        # execute_command: a cluster pipeline routes EVAL/EVALSHA by key but has no eval()
        calls: list[tuple[Any, ...]] = [
            ("EVAL", HEARTBEAT, 1, self._members_key, self.instance_id, ttl_ms, grace_ms)
        ]
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
                # five more fields per key: where in this call the same key's
                # previous window is (0: not here) and its weight, so the
                # script weighs that window's fresh total, not our last read;
                # the ceiling in use; where the next window's hash is among
                # KEYS (0: no claim) and the share claimed there
                at: dict[tuple[int, int], int] = {}
                keys = [work[i].hash_key for i in part]
                fields = []
                pack = _SPEC.pack
                for pos, i in enumerate(part, 1):
                    item = work[i]
                    before = at.get((id(item.track), item.window - 1), 0) if item.weight > 0.0 else 0
                    at[(id(item.track), item.window)] = pos
                    claim_at = 0
                    if item.claim_key is not None:
                        keys.append(item.claim_key)
                        claim_at = len(keys)
                    fields.append(pack(*item.spec, before, item.weight, item.held, claim_at, item.claim))
                calls.append(
                    (
                        "EVALSHA",
                        RECONCILE.sha,
                        len(keys),
                        *keys,
                        self.instance_id,
                        n,
                        b"".join(fields),
                        *(reserve or [""]),
                    )
                )
                order += part
        packed = [cmd for _, cmds in native for cmd in cmds]
        if packed:
            raw = self._send_raw(calls, packed)
        else:
            pipe = self.client.pipeline(transaction=False)
            for call in calls:
                pipe.execute_command(*call)
            raw = pipe.execute()
        flat = [
            triple for reply in raw[1 : len(calls)] for triple in zip(reply[::3], reply[1::3], reply[2::3])
        ]
        replies: list[Any] = [None] * len(work)
        for i, triple in zip(order, flat):
            replies[i] = triple
        answers: list[list[Any]] = []
        at_reply = len(calls)
        for _, cmds in native:
            answers.append(raw[at_reply : at_reply + len(cmds)])
            at_reply += len(cmds)
        return [raw[0], *replies], answers

    def _send_raw(self, calls: list[tuple[Any, ...]], packed: list[bytes]) -> list[Any]:
        """One pipeline on one pooled connection: ``calls`` packed by the
        client, then ``packed`` as they are. A reply that is an error is
        raised after every reply is read (as a pipeline does); anything
        else drops the connection."""
        pool = self.client.connection_pool
        try:
            conn = pool.get_connection()
        except TypeError:  # redis-py before 5.3 and valkey-py want a command name
            conn = pool.get_connection("EVALSHA")
        try:
            conn.send_packed_command([*conn.pack_commands(calls), *packed])
            out: list[Any] = []
            error: BaseException | None = None
            for _ in range(len(calls) + len(packed)):
                try:
                    out.append(conn.read_response())
                except self._response_error as exc:
                    out.append(None)
                    error = error or exc
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
        if error is not None:
            raise error
        return out

    def _failed(self) -> None:
        """Redis unreachable: enforce our share locally until it answers again."""
        with self._lock:
            self._stats["sync_failures"] += 1
            self._need_full = True  # every count is re-written once Redis answers
            if not self._blind:
                self._blind = True
                self._stats["partitions"] += 1
                for track in self._tracks.values():
                    self._pull(track)  # a fast record's sync state: the dicts hold it from here
                    self._prune(track, math.floor(track.last_now / track.window))  # not re-written
                    # what Redis holds for us per window (count + lease, or the
                    # claim) is what we may admit there while blind: the others
                    # keep exactly that out of their leases
                    cap = {w: track.acked.get(w, 0) + lease for w, lease in track.lease.items()}
                    for w, share in track.claimed.items():
                        cap.setdefault(w, share)
                    if not self._alone:
                        # a window we admitted in unsynced (a new key's default
                        # share): the others lease it around no field of ours
                        for w, units in track.own.items():
                            cap.setdefault(w, units)
                    track.blind_cap = cap
                    # the server may come back empty: re-write every count we hold
                    track.pushed.clear()
                    track.lease.clear()
                    track.claimed.clear()
