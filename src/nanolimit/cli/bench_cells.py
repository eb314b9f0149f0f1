"""The measurement cells of ``nanolimit bench``: what a cell is and how it is
timed.

The scenarios (:data:`SCENARIOS`) and their constants; :class:`Subject`, one
library's limiter reduced to the calls a scenario makes (the adapters in
:mod:`.bench_peers` build them); :func:`prepare`, which turns a scenario and a
maker into a :class:`Prepared` cell; the timing (:func:`sample`, a
:class:`Budget`); and the :class:`Results` of a run.
"""

from __future__ import annotations

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
            subject = make(HIGH_LIMIT, HIGH_WINDOW)
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
        s = make(HIGH_LIMIT, HIGH_WINDOW)
        _prefill(s, keys)
        return _round_robin(s, keys, s.close)
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
    """The one-key scenarios: ``batch`` calls on ``HOT_KEY`` per timed repeat."""
    if name == "hot_denied":
        s = make(DENIED_LIMIT, DENIED_WINDOW)
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
    s = make(HIGH_LIMIT, HIGH_WINDOW)
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
        s.close()
        if name != "peek":
            raise ValueError(f"unknown scenario {name!r}")
        raise NotImplementedError("no peek")
    s.allow(HOT_KEY)
    body, setup = _hot(peek, batch)
    return Prepared(body, setup, batch, lambda: _expect(peek_allowed(peek(HOT_KEY)), "peek said no"), s.close)


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
