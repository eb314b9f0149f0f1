"""The measurement cells of ``nanolimit bench``: what a cell is and how it is
timed.

The scenarios (:data:`SCENARIOS`) and their constants; :class:`Subject`, one
library's limiter reduced to the calls a scenario makes (the adapters in
:mod:`.bench_peers` build them); :func:`prepare`, which turns a scenario and a
maker into a :class:`Prepared` cell; the timing (:func:`sample`, a
:class:`Budget`); and the :class:`Results` of a run.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import itertools
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

ALGORITHMS = ("token_bucket", "leaky_bucket", "fixed_window", "sliding_log", "sliding_counter", "gcra")

#: name -> what it measures. Order is the order of the table.
SCENARIOS: dict[str, str] = {
    "hot_allowed": "allow() on one hot key, always allowed",
    "hot_denied": "allow() on one hot key whose budget is spent, always denied",
    "keys_100k": "allow() round-robin over 100,000 keys already in the store",
    "keys_1m": "allow() round-robin over 1,000,000 keys already in the store",
    "fresh_key": "allow() over 100,000 stored keys, each request a new str (hash not cached)",
    "cost_5": "allow(key, cost=5) on one hot key, always allowed",
    "peek": "peek() on one hot key (decides, spends nothing)",
    "allow_many_100k": "allow_many() over 100,000 stored keys, per decision (nanolimit only)",
}
#: The same calls against each library's Redis backend (``--redis URL``):
#: nanolimit's ``RedisStorage``, ``limits``' ``RedisStorage``, throttled-py's
#: ``RedisStore``, pyrate-limiter's ``RedisBucket``/``RedisStateStore``.
REDIS_SCENARIOS: dict[str, str] = {
    "redis_hot_allowed": "Redis: allow() on one hot key, always allowed",
    "redis_hot_denied": "Redis: allow() on one hot key whose budget is spent, always denied",
    "redis_keys_1k": "Redis: allow() round-robin over 1,000 keys already in Redis",
    "redis_cost_5": "Redis: allow(key, cost=5) on one hot key, always allowed",
    "redis_peek": "Redis: peek() on one hot key (decides, spends nothing)",
}
SCENARIOS.update(REDIS_SCENARIOS)
#: The short run leaves out the million-key scenario (filling a peer's store
#: with a million keys one Python call at a time takes minutes), and the
#: Redis ones unless a server is named.
QUICK_SCENARIOS = tuple(s for s in SCENARIOS if s != "keys_1m" and s not in REDIS_SCENARIOS)
MEMORY_SCENARIOS = tuple(s for s in SCENARIOS if s not in REDIS_SCENARIOS)

#: Allowed-path scenarios need a budget no run can exhaust: 16M per second.
HIGH_LIMIT = 1 << 24
HIGH_WINDOW = 1.0
#: Denied-path scenarios: one unit per hour, spent before timing starts.
DENIED_LIMIT = 1
DENIED_WINDOW = 3600.0
COST = 5
BATCH = 1000
#: a Redis decision is a round trip (tens of µs): fewer calls per timed repeat
REDIS_BATCH = 100
REDIS_KEYS = 1000
KEYS_100K = 100_000
KEYS_1M = 1_000_000
HOT_KEY = "user:42"

OURS = "nanolimit"
#: nanolimit on a :class:`~nanolimit._core.SharedMemoryStorage`: the same
#: limiters, their state in a named shared-memory segment (a row next to
#: the in-memory one; its ratio is its time over the in-memory time)
ZONE = "nanolimit-zone"
#: a zone's capacity is fixed at creation and split evenly over its stripes,
#: so it is made this much larger than the keys a cell stores: a stripe that
#: hashing fills a little above its share must not evict (the fill of a zone
#: with ``max_keys`` equal to its keys leaves ~0.3-1 % of them out)
ZONE_HEADROOM = 1.25
#: the sliding log's rings live in the zone's arena: a hot key at 16M per
#: second logs every request of a run (a ``--full`` ``cost_5`` cell ~10M
#: entries), which the default arena (1 MiB) would refuse
ZONE_LOG_ARENA = 256 << 20


def _nothing() -> None:
    return None


@dataclass
class Subject:
    """One library's limiter for one algorithm, as a handful of callables.

    The callables are the library's own bound methods wherever its signature
    allows (``allow(key)``, ``allow(key, cost)``), so the loop calls straight
    into the library. Where a peer needs its arguments reordered (``limits``
    takes the rate item first and ``cost=`` by keyword, ``pyrate-limiter``
    needs ``blocking=False``) a ``functools.partial`` or one lambda sits in
    between; that costs the peer ~30-60 ns, under 2 % of any peer's figure.
    """

    allow: Callable[[str], Any]
    allow_cost: Callable[[str, int], Any]
    allowed: Callable[[Any], bool]
    peek: Callable[[str], Any] | None = None
    peek_allowed: Callable[[Any], bool] | None = None
    allow_many: Callable[[list[str]], Any] | None = None
    close: Callable[[], None] = _nothing


#: (limit, window_seconds) -> Subject
Maker = Callable[[int, float], Subject]


def _sized(make: Maker, keys: int) -> Maker:
    """The maker for a store of ``keys`` keys: a maker with a fixed capacity
    (the zone) offers ``make.for_keys(keys)``; any other is its own answer."""
    for_keys = getattr(make, "for_keys", None)
    return make if for_keys is None else for_keys(keys)


def key_list(n: int, start: int = 0) -> list[str]:
    """``n`` keys ``user:<i>``: new str objects whose hash nobody computed yet."""
    return [f"user:{i}" for i in range(start, start + n)]


# ---------------------------------------------------------------------------
# Scenarios
# ---------------------------------------------------------------------------


class WrongPath(RuntimeError):
    """A cell would have timed the wrong decisions (denied instead of allowed)."""


def _expect(ok: bool, what: str) -> None:
    if not ok:
        raise WrongPath(what)


def _run(call: Callable[[str], Any], keys: list[str]) -> None:
    for k in keys:
        call(k)


def _run_cost(call: Callable[[str, int], Any], keys: list[str], cost: int) -> None:
    for k in keys:
        call(k, cost)


@dataclass
class Prepared:
    """A scenario ready to time: ``body(*setup())`` decides ``decisions`` requests.

    ``setup`` runs before every timed call and is never timed: it slices the
    next round-robin chunk, or builds the fresh key strings. ``check`` runs
    after timing and raises :class:`WrongPath` if the decisions changed
    nature (a hot key that started being denied, say). The pytest suite
    hands the same three callables to ``benchmark.pedantic``.
    """

    body: Callable[..., Any]
    setup: Callable[[], tuple[Any, ...]]
    decisions: int
    check: Callable[[], None] = _nothing
    close: Callable[[], None] = _nothing


def _hot(call: Callable[[str], Any], batch: int) -> tuple[Callable[..., Any], Callable[[], tuple[Any, ...]]]:
    keys = [HOT_KEY] * batch
    return _run, lambda: (call, keys)


def _prefill(subject: Subject, keys: list[str]) -> None:
    if subject.allow_many is not None:
        for i in range(0, len(keys), KEYS_100K):
            subject.allow_many(keys[i : i + KEYS_100K])
    else:
        allow = subject.allow
        for k in keys:
            allow(k)


def _round_robin(
    subject: Subject, keys: list[str], close: Callable[[], None], batch: int = BATCH
) -> Prepared:
    _expect(subject.allowed(subject.allow(keys[0])), "a stored key was denied")
    cursor = 0
    allow = subject.allow

    def setup() -> tuple[Any, ...]:
        nonlocal cursor
        chunk = keys[cursor : cursor + batch]
        cursor = (cursor + batch) % len(keys)
        return allow, chunk

    def check() -> None:
        _expect(subject.allowed(allow(keys[cursor])), "a stored key was denied")

    return Prepared(_run, setup, batch, check, close)


def _fresh(subject: Subject, population: int) -> Prepared:
    cursor = 0
    allow = subject.allow

    def setup() -> tuple[Any, ...]:
        nonlocal cursor
        fresh = key_list(BATCH, cursor)  # new str objects, hash not computed, never reused
        cursor = (cursor + BATCH) % population
        return allow, fresh

    def check() -> None:
        _expect(subject.allowed(allow(f"user:{cursor}")), "a fresh key string was denied")

    return Prepared(_run, setup, BATCH, check)


class Shared:
    """The 100,000-key store, filled once and used by three scenarios.

    Filling a peer's store takes a second or more, so ``keys_100k``,
    ``fresh_key`` and ``allow_many_100k`` of one library and algorithm share
    it; asking for another maker's store closes the previous one first, so
    only one is alive at a time.
    """

    def __init__(self) -> None:
        self._owner: Maker | None = None
        self._subject: Subject | None = None
        self.keys = key_list(KEYS_100K)

    def subject(self, make: Maker) -> Subject:
        if self._owner is not make or self._subject is None:
            self.close()
            subject = _sized(make, KEYS_100K)(HIGH_LIMIT, HIGH_WINDOW)
            _prefill(subject, self.keys)
            self._owner, self._subject = make, subject
        return self._subject

    def close(self) -> None:
        if self._subject is not None:
            self._subject.close()
        self._owner = self._subject = None


def prepare(name: str, make: Maker, shared: Shared) -> Prepared:
    """Build the limiter (and its stored keys) for scenario ``name``.

    Raises ``NotImplementedError`` when the library has no API for it (no
    ``peek``, no batch call), and :class:`WrongPath` when its first answers
    are not the ones the scenario is about. A ``redis_`` scenario takes a
    maker of the library's Redis backend.
    """
    if name in REDIS_SCENARIOS:
        name = name.removeprefix("redis_")
        if name == "keys_1k":
            s = make(HIGH_LIMIT, HIGH_WINDOW)
            keys = key_list(REDIS_KEYS)
            for k in keys:
                s.allow(k)
            return _round_robin(s, keys, s.close, REDIS_BATCH)
        return _hot_cell(name, make, REDIS_BATCH)
    if name in ("hot_allowed", "hot_denied", "cost_5", "peek"):
        return _hot_cell(name, make, BATCH)
    if name == "keys_1m":
        keys = key_list(KEYS_1M)
        s = _sized(make, KEYS_1M)(HIGH_LIMIT, HIGH_WINDOW)
        try:
            _prefill(s, keys)
            return _round_robin(s, keys, s.close)
        except BaseException:
            s.close()
            raise
    if name == "keys_100k":
        return _round_robin(shared.subject(make), shared.keys, _nothing)
    if name == "fresh_key":
        return _fresh(shared.subject(make), KEYS_100K)
    if name == "allow_many_100k":
        subject = shared.subject(make)
        many = subject.allow_many
        if many is None:
            raise NotImplementedError("no batch API")
        keys = shared.keys
        return Prepared(
            many,
            lambda: (keys,),
            KEYS_100K,
            lambda: _expect(bool(many([HOT_KEY]).allowed[0]), "allow_many denied"),
        )
    raise ValueError(f"unknown scenario {name!r}")


def _hot_cell(name: str, make: Maker, batch: int) -> Prepared:
    """The one-key scenarios: ``batch`` calls on ``HOT_KEY`` per timed repeat.
    A subject whose first answers are wrong is closed before the error
    leaves (a zone's segment must not outlive its cell)."""
    if name == "hot_denied":
        s = make(DENIED_LIMIT, DENIED_WINDOW)
        try:
            return _denied_cell(s, batch)
        except BaseException:
            s.close()
            raise
    s = make(HIGH_LIMIT, HIGH_WINDOW)
    try:
        return _allowed_cell(name, s, batch)
    except BaseException:
        s.close()
        raise


def _denied_cell(s: Subject, batch: int) -> Prepared:
    _expect(s.allowed(s.allow(HOT_KEY)), "the first request was denied")
    _expect(not s.allowed(s.allow(HOT_KEY)), "the second request passed")
    body, setup = _hot(s.allow, batch)
    return Prepared(
        body,
        setup,
        batch,
        lambda: _expect(not s.allowed(s.allow(HOT_KEY)), "a spent key passed"),
        s.close,
    )


def _allowed_cell(name: str, s: Subject, batch: int) -> Prepared:
    if name == "hot_allowed":
        body, setup = _hot(s.allow, batch)
        return Prepared(
            body,
            setup,
            batch,
            lambda: _expect(s.allowed(s.allow(HOT_KEY)), "the hot key was denied"),
            s.close,
        )
    if name == "cost_5":
        keys = [HOT_KEY] * batch
        return Prepared(
            _run_cost,
            lambda: (s.allow_cost, keys, COST),
            batch,
            lambda: _expect(s.allowed(s.allow_cost(HOT_KEY, COST)), "cost 5 was denied"),
            s.close,
        )
    peek, peek_allowed = s.peek, s.peek_allowed
    if name != "peek" or peek is None or peek_allowed is None:
        if name != "peek":
            raise ValueError(f"unknown scenario {name!r}")
        raise NotImplementedError("no peek")
    s.allow(HOT_KEY)
    body, setup = _hot(peek, batch)
    return Prepared(body, setup, batch, lambda: _expect(peek_allowed(peek(HOT_KEY)), "peek said no"), s.close)


# ---------------------------------------------------------------------------
# The shared-memory zone
# ---------------------------------------------------------------------------

_zone_serial = itertools.count()
#: segments this process made and has not unlinked yet; whatever a crash
#: between a cell's start and its close leaves is unlinked at exit
_zone_names: set[str] = set()


def zone_available() -> bool:
    """Whether this build has :class:`~nanolimit._core.SharedMemoryStorage`
    (the native extension of a version that has it)."""
    try:
        core = importlib.import_module("nanolimit._core")
    except ImportError:
        return False
    return hasattr(core, "SharedMemoryStorage")


def _unlink_zone(name: str) -> None:
    core = importlib.import_module("nanolimit._core")
    with contextlib.suppress(Exception):  # gone already, or never made: nothing left to remove
        core.SharedMemoryStorage.unlink_segment(name)
    _zone_names.discard(name)


@atexit.register
def _unlink_leftover_zones() -> None:
    for name in sorted(_zone_names):
        _unlink_zone(name)


def zone_makers(keys: int = KEYS_100K) -> dict[str, Maker]:
    """One maker per algorithm: nanolimit's native limiter on a zone of its
    own (a fresh segment ``nlbench-<pid>-<n>``, unlinked when the subject
    closes), sized for ``keys`` keys; ``make.for_keys(n)`` is the maker of a
    zone sized for ``n``."""
    from .._limiter_config import LIMITER_CLASS_NAMES

    core = importlib.import_module("nanolimit._core")
    clock_type = importlib.import_module("nanolimit").SystemClock

    def maker(alg: str, capacity: int) -> Maker:
        cls = getattr(core, LIMITER_CLASS_NAMES[alg])
        arena = ZONE_LOG_ARENA if alg == "sliding_log" else None

        def make(limit: int, window: float) -> Subject:
            name = f"nlbench-{os.getpid()}-{next(_zone_serial)}"
            zone = core.SharedMemoryStorage(name, max_keys=int(capacity * ZONE_HEADROOM), arena_bytes=arena)
            _zone_names.add(name)
            try:
                limiter = cls(limit, window, storage=zone, rule="bench", clock=clock_type())
            except BaseException:
                zone.close()
                _unlink_zone(name)
                raise

            def close() -> None:
                zone.close()
                _unlink_zone(name)

            return nanolimit_subject(limiter, close)

        make.for_keys = lambda n: maker(alg, n)  # type: ignore[attr-defined]
        return make

    return {alg: maker(alg, keys) for alg in ALGORITHMS}


def nanolimit_subject(limiter: Any, close: Callable[[], None] = _nothing) -> Subject:
    """A nanolimit limiter of either twin, on any storage: its own bound methods."""
    return Subject(
        allow=limiter.allow,
        allow_cost=limiter.allow,
        allowed=_decision_allowed,
        peek=limiter.peek,
        peek_allowed=_decision_allowed,
        allow_many=limiter.allow_many,
        close=close,
    )


def _decision_allowed(decision: Any) -> bool:
    return bool(decision.allowed)


# ---------------------------------------------------------------------------
# Timing
# ---------------------------------------------------------------------------


@dataclass
class Budget:
    """How long each cell times: enough repeats for a median, never minutes."""

    seconds: float
    min_repeats: int
    max_repeats: int

    def repeats(self, first_ns: int) -> int:
        wanted = int(self.seconds * 1e9 / max(first_ns, 1))
        return max(self.min_repeats, min(self.max_repeats, wanted))


QUICK_BUDGET = Budget(0.05, 5, 200)
FULL_BUDGET = Budget(0.4, 9, 2000)


def _timed(p: Prepared) -> int:
    args = p.setup()
    body = p.body
    t0 = time.perf_counter_ns()
    body(*args)
    return time.perf_counter_ns() - t0


def sample(p: Prepared, budget: Budget) -> list[float]:
    """ns per decision of each repeat. The first call is a warm-up (caches,
    lazily built state) and sizes the run; ``check`` runs at the end."""
    first = _timed(p)
    samples = [_timed(p) / p.decisions for _ in range(budget.repeats(first))]
    p.check()
    return samples


def loop_overhead_ns(budget: Budget = QUICK_BUDGET) -> float:
    """Median ns per call of the driving loop itself, around ``len`` (a ~10 ns C call)."""
    keys = key_list(BATCH)
    return statistics.median(sample(Prepared(_run, lambda: (len, keys), BATCH), budget))


# ---------------------------------------------------------------------------
# Results
# ---------------------------------------------------------------------------


@dataclass
class Cell:
    """One library × algorithm × scenario: ns per decision over the repeats."""

    library: str
    algorithm: str
    scenario: str
    median_ns: float | None = None
    min_ns: float | None = None
    max_ns: float | None = None
    #: quartiles: the plot's whiskers, since a busy machine's max is one stray spike
    q1_ns: float | None = None
    q3_ns: float | None = None
    repeats: int = 0
    error: str | None = None

    @classmethod
    def of(cls, library: str, algorithm: str, scenario: str, samples: Sequence[float]) -> Cell:
        q1, _, q3 = statistics.quantiles(samples, n=4) if len(samples) > 1 else (samples[0],) * 3
        return cls(
            library,
            algorithm,
            scenario,
            median_ns=round(statistics.median(samples), 1),
            min_ns=round(min(samples), 1),
            max_ns=round(max(samples), 1),
            q1_ns=round(q1, 1),
            q3_ns=round(q3, 1),
            repeats=len(samples),
        )


@dataclass
class Results:
    """A whole run: the machine it ran on, every cell, and the ratios."""

    meta: dict[str, Any]
    cells: list[Cell] = field(default_factory=list)

    def cell(self, library: str, algorithm: str, scenario: str) -> Cell | None:
        for c in self.cells:
            if (c.library, c.algorithm, c.scenario) == (library, algorithm, scenario):
                return c
        return None

    def ratio(self, peer: Cell) -> float | None:
        """How many times faster we are than ``peer`` (peer median / our median)."""
        ours = self.cell(OURS, peer.algorithm, peer.scenario)
        if peer.library == OURS or ours is None or not ours.median_ns or peer.median_ns is None:
            return None
        return round(peer.median_ns / ours.median_ns, 2)

    def as_dict(self) -> dict[str, Any]:
        cells = []
        for c in self.cells:
            row = asdict(c)
            row["ours_faster_x"] = self.ratio(c)
            cells.append(row)
        return {"meta": self.meta, "cells": cells}
