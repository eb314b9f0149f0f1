"""The engine behind ``nanolimit bench``: nanolimit and its peers, side by side.

Why it exists: our reason to exist is speed with full answers, and a claim
about speed is only worth a ratio measured in one process, on one machine, in
one run. This module runs the same scenarios through nanolimit and through the
in-memory API of every installed peer (``limits``, ``throttled-py``,
``pyrate-limiter``, ``token-bucket``) and reports nanoseconds per decision and
our ratio to each peer.

It times plain ``time.perf_counter_ns`` loops rather than pytest-benchmark, so
a user can run it from an installed wheel without pytest. The pytest suite in
``bench/`` imports the same adapters (:data:`LIBRARIES`), so the CLI and the
suite always measure the same calls.

Every figure includes the cost of the Python ``for`` loop that drives the
calls (the same loop for every library, reported as ``loop_overhead_ns``),
and each cell checks that the decisions it times really are the ones the
scenario means (allowed, or denied), so nothing is measured on the wrong path.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from functools import partial
from typing import Any

from .._shared import LIMITER_CLASS_NAMES

__all__ = [
    "ALGORITHMS",
    "LIBRARIES",
    "SCENARIOS",
    "Cell",
    "Library",
    "Results",
    "Subject",
    "format_markdown",
    "format_table",
    "main",
    "plot",
    "run",
]

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


# ---------------------------------------------------------------------------
# Adapters: each library reduced to the calls a scenario makes
# ---------------------------------------------------------------------------


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


@dataclass(frozen=True)
class Library:
    """A library under test: the module that must import, and its algorithms.

    ``makers`` is called only when the module imports, so a missing peer is
    reported as missing instead of failing the run.
    """

    name: str
    module: str
    makers: Callable[[], dict[str, Maker]]
    #: what ``makers()`` will offer, known without importing the library
    algorithms: tuple[str, ...]
    note: str = ""
    #: the same for the library's Redis backend, if it has one
    redis_makers: Callable[[RedisTarget], dict[str, Maker]] | None = None

    def available(self) -> bool:
        return _importable(self.module)


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent that is not a package; a module set to None
        return False


def _nanolimit_makers(module_name: str) -> Callable[[], dict[str, Maker]]:
    names = LIMITER_CLASS_NAMES

    def makers() -> dict[str, Maker]:
        module = importlib.import_module(module_name)
        clock_type = importlib.import_module("nanolimit").SystemClock

        def maker(cls_name: str) -> Maker:
            def make(limit: int, window: float) -> Subject:
                return _nanolimit_subject(getattr(module, cls_name)(limit, window, clock=clock_type()))

            return make

        return {alg: maker(cls) for alg, cls in names.items()}

    return makers


def _nanolimit_subject(limiter: Any, close: Callable[[], None] = _nothing) -> Subject:
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


def _limits_subject(
    storage: Any, strategy_type: Any, item: Any, ns: str, close: Callable[[], None]
) -> Subject:
    """One ``limits`` strategy over ``storage``; ``ns`` prefixes each key
    (Redis: a namespace per limiter), and none means the bound methods
    themselves."""
    strategy = strategy_type(storage)
    hit, test = strategy.hit, strategy.test
    if not ns:
        return Subject(
            allow=partial(hit, item),
            allow_cost=lambda key, cost: hit(item, key, cost=cost),
            allowed=bool,
            peek=partial(test, item),
            peek_allowed=bool,
            close=close,
        )
    return Subject(
        allow=lambda key: hit(item, ns + key),
        allow_cost=lambda key, cost: hit(item, ns + key, cost=cost),
        allowed=bool,
        peek=lambda key: test(item, ns + key),
        peek_allowed=bool,
        close=close,
    )


def _limits_strategies(limits: Any) -> dict[str, Any]:
    """Its moving window is an exact log (our sliding log), its sliding
    window counter the same approximation as ours."""
    strategies = limits.strategies
    return {
        "fixed_window": strategies.FixedWindowRateLimiter,
        "sliding_log": strategies.MovingWindowRateLimiter,
        "sliding_counter": strategies.SlidingWindowCounterRateLimiter,
    }


def _limits_makers() -> dict[str, Maker]:
    """``limits``: the three strategies over ``MemoryStorage``."""
    limits: Any = importlib.import_module("limits")  # Any: peers are optional, and untyped to mypy here

    def maker(strategy_type: Any) -> Maker:
        def make(limit: int, window: float) -> Subject:
            storage = limits.storage.MemoryStorage()

            def close() -> None:
                storage.timer.cancel()  # its expiry sweep would run on in the next cell
                storage.reset()

            item = limits.RateLimitItemPerSecond(limit, int(window))
            return _limits_subject(storage, strategy_type, item, "", close)

        return make

    return {alg: maker(strategy) for alg, strategy in _limits_strategies(limits).items()}


#: throttled-py's MemoryStore is an LRU of 1,024 keys by default; a smaller
#: store than the key set would measure evictions, not decisions.
THROTTLED_MAX_SIZE = 4 * KEYS_1M


#: ours -> throttled-py's name for it
THROTTLED_ALGORITHMS = {
    "token_bucket": "token_bucket",
    "leaky_bucket": "leaking_bucket",
    "fixed_window": "fixed_window",
    "sliding_counter": "sliding_window",
    "gcra": "gcra",
}


def _throttled_subject(throttled: Any, store: Any, using: str, limit: int, window: float, ns: str) -> Subject:
    """One ``Throttled`` over ``store``; ``ns`` prefixes each key (Redis), and
    none means the bound methods themselves."""
    quota = throttled.per_duration(datetime.timedelta(seconds=window), limit)
    throttle = throttled.Throttled(using=using, quota=quota, store=store)
    limit_call, peek = throttle.limit, throttle.peek
    if not ns:
        return Subject(
            allow=limit_call,
            allow_cost=limit_call,
            allowed=_throttled_allowed,
            peek=peek,
            # peek answers a state, not a verdict: a unit left means a pass
            peek_allowed=_throttled_peek_allowed,
        )
    return Subject(
        allow=lambda key: limit_call(ns + key),
        allow_cost=lambda key, cost: limit_call(ns + key, cost),
        allowed=_throttled_allowed,
        peek=lambda key: peek(ns + key),
        peek_allowed=_throttled_peek_allowed,
    )


def _throttled_makers() -> dict[str, Maker]:
    """``throttled-py``: ``Throttled(using=..., store=MemoryStore)``, non-blocking."""
    throttled: Any = importlib.import_module("throttled")

    def maker(using: str) -> Maker:
        def make(limit: int, window: float) -> Subject:
            store = throttled.MemoryStore(options={"MAX_SIZE": THROTTLED_MAX_SIZE})
            return _throttled_subject(throttled, store, using, limit, window, "")

        return make

    return {alg: maker(using) for alg, using in THROTTLED_ALGORITHMS.items()}


def _throttled_allowed(result: Any) -> bool:
    return not result.limited


def _throttled_peek_allowed(state: Any) -> bool:
    return bool(state.remaining >= 1)


def _pyrate_per_key(pl: Any, build: Callable[[str], Any], clock: Any, leak: bool) -> Any:
    """pyrate-limiter's per-key limits: a ``BucketFactory`` that builds one
    bucket per name (what its README documents); ``leak`` schedules the
    in-memory buckets' leak task, as ``BucketFactory.create`` does."""

    class PerKeyFactory(pl.BucketFactory):  # type: ignore[misc]
        def __init__(self) -> None:
            self.clock = clock
            self.buckets: dict[str, Any] = {}

        def wrap_item(self, name: str, weight: int = 1) -> Any:
            return pl.RateItem(name, self.clock.now(), weight=weight)

        def get(self, item: Any) -> Any:
            bucket = self.buckets.get(item.name)
            if bucket is None:
                bucket = self.buckets[item.name] = build(item.name)
                if leak:
                    self.schedule_leak(bucket)
            return bucket

    return PerKeyFactory()


def _pyrate_subject(limiter: Any, close: Callable[[], None]) -> Subject:
    acquire = limiter.try_acquire
    return Subject(
        allow=partial(acquire, blocking=False),
        allow_cost=lambda key, cost: acquire(key, cost, False),
        allowed=bool,
        close=close,
    )


#: ours -> (pyrate-limiter's algorithm, whether it keeps constant state)
def _pyrate_algorithms(pl: Any) -> dict[str, tuple[Any, bool]]:
    return {
        "token_bucket": (pl.TokenBucket, True),
        "fixed_window": (pl.FixedWindow, False),
        "sliding_log": (pl.SlidingWindowLog, False),
        "gcra": (pl.GCRA, True),
    }


def _pyrate_makers() -> dict[str, Maker]:
    """``pyrate-limiter`` 4: one bucket per key through a ``BucketFactory``.

    A bare ``InMemoryBucket`` is one bucket for every name, so per-key limits
    need the factory its README documents (``PerNameFactory``): the log
    algorithms in an ``InMemoryBucket``, the constant-state ones in a
    ``StateBucket`` over its in-memory state store. ``blocking=False`` makes a
    denial an answer rather than a sleep.
    """
    pl: Any = importlib.import_module("pyrate_limiter")

    def maker(algorithm: Callable[[], Any], state: bool) -> Maker:
        def make(limit: int, window: float) -> Subject:
            rates = [pl.Rate(limit, int(window * 1000))]
            algo = algorithm()

            def build(_name: str) -> Any:
                if state:
                    return pl.StateBucket(rates, algorithm=algo)
                return pl.InMemoryBucket(rates, algorithm=algo)

            limiter = pl.Limiter(_pyrate_per_key(pl, build, pl.MonotonicClock(), leak=True))
            return _pyrate_subject(limiter, limiter.close)

        return make

    return {alg: maker(algorithm, state) for alg, (algorithm, state) in _pyrate_algorithms(pl).items()}


def _token_bucket_makers() -> dict[str, Maker]:
    """``token-bucket``: ``Limiter(rate, capacity, MemoryStorage())``; no peek."""
    tb: Any = importlib.import_module("token_bucket")

    def make(limit: int, window: float) -> Subject:
        limiter = tb.Limiter(limit / window, limit, tb.MemoryStorage())
        return Subject(allow=limiter.consume, allow_cost=limiter.consume, allowed=bool)

    return {"token_bucket": make}


# ---------------------------------------------------------------------------
# The Redis backends
# ---------------------------------------------------------------------------


class RedisTarget:
    """The server ``--redis URL`` names, and this run's mark on it.

    Every key any library writes there carries ``marker`` (nanolimit through
    its storage's prefix, a peer through a prefix on the key it is asked
    about: one string concatenation, ~0.1 µs against a round trip of tens),
    and each limiter gets a namespace of its own, so a cell never sees
    another's state. :meth:`cleanup` deletes exactly those keys: nothing
    else on the server is touched.
    """

    def __init__(self, url: str) -> None:
        import os

        self.url = url
        self.marker = f"nlbench-{os.urandom(6).hex()}"
        self._made = 0

    def client(self) -> Any:
        redis: Any = importlib.import_module("redis")
        return redis.Redis.from_url(self.url)

    def namespace(self) -> str:
        self._made += 1
        return f"{self.marker}-{self._made}:"

    def check(self) -> None:
        """Fail early, with the URL, if the server does not answer."""
        client = self.client()
        try:
            client.ping()
        finally:
            client.close()

    def cleanup(self) -> int:
        client = self.client()
        try:
            removed = 0
            batch: list[Any] = []
            for key in client.scan_iter(match=f"*{self.marker}*", count=1000):
                batch.append(key)
                if len(batch) == 500:
                    removed += int(client.delete(*batch))
                    batch = []
            if batch:
                removed += int(client.delete(*batch))
            return removed
        finally:
            client.close()


def _nanolimit_redis_makers(module_name: str) -> Callable[[RedisTarget], dict[str, Maker]]:
    """nanolimit's ``RedisStorage`` (one ``EVALSHA`` per decision, the
    server's clock), failing loudly: a degraded answer must never be timed."""

    def makers(target: RedisTarget) -> dict[str, Maker]:
        module = importlib.import_module(module_name)
        storage_type = importlib.import_module("nanolimit.storage.redis").RedisStorage
        clock_type = importlib.import_module("nanolimit").SystemClock

        def maker(cls_name: str) -> Maker:
            def make(limit: int, window: float) -> Subject:
                client = target.client()
                storage = storage_type(client, prefix=target.namespace(), on_error="raise")
                storage.load_scripts()
                limiter = getattr(module, cls_name)(limit, window, storage, clock=clock_type())

                def close() -> None:
                    storage.close()
                    client.close()

                return _nanolimit_subject(limiter, close)

            return make

        return {alg: maker(cls) for alg, cls in LIMITER_CLASS_NAMES.items()}

    return makers


def _limits_redis_makers(target: RedisTarget) -> dict[str, Maker]:
    """``limits``' ``RedisStorage`` under the same three strategies."""
    limits: Any = importlib.import_module("limits")

    def maker(strategy_type: Any) -> Maker:
        def make(limit: int, window: float) -> Subject:
            storage = limits.storage.RedisStorage(target.url)
            item = limits.RateLimitItemPerSecond(limit, int(window))
            return _limits_subject(storage, strategy_type, item, target.namespace(), _nothing)

        return make

    return {alg: maker(strategy) for alg, strategy in _limits_strategies(limits).items()}


def _throttled_redis_makers(target: RedisTarget) -> dict[str, Maker]:
    """throttled-py's ``RedisStore``."""
    throttled: Any = importlib.import_module("throttled")

    def maker(using: str) -> Maker:
        def make(limit: int, window: float) -> Subject:
            store = throttled.RedisStore(server=target.url)
            return _throttled_subject(throttled, store, using, limit, window, target.namespace())

        return make

    return {alg: maker(using) for alg, using in THROTTLED_ALGORITHMS.items()}


def _pyrate_redis_makers(target: RedisTarget) -> dict[str, Maker]:
    """pyrate-limiter's Redis buckets, one per key through the same factory:
    a ``RedisBucket`` (a sorted-set log) for the log algorithms, a
    ``StateBucket`` over a ``RedisStateStore`` for the constant-state ones.
    Both judge by the wall clock, in milliseconds."""
    pl: Any = importlib.import_module("pyrate_limiter")

    def maker(algorithm: Callable[[], Any], state: bool) -> Maker:
        def make(limit: int, window: float) -> Subject:
            client = target.client()
            rates = [pl.Rate(limit, int(window * 1000))]
            ns = target.namespace()

            def build(name: str) -> Any:
                if state:
                    store = pl.RedisStateStore(client, ns + name)
                    return pl.StateBucket(rates, algorithm=algorithm(), store=store)
                return pl.RedisBucket.init(rates, client, ns + name, algorithm=algorithm())

            limiter = pl.Limiter(_pyrate_per_key(pl, build, pl.WallClock(), leak=False))

            def close() -> None:
                limiter.close()
                client.close()

            return _pyrate_subject(limiter, close)

        return make

    return {alg: maker(algorithm, state) for alg, (algorithm, state) in _pyrate_algorithms(pl).items()}


#: Every library the engine knows, ours first.
LIBRARIES: dict[str, Library] = {
    lib.name: lib
    for lib in (
        Library(
            "nanolimit",
            "nanolimit",
            _nanolimit_makers("nanolimit"),
            ALGORITHMS,
            "the default twin",
            _nanolimit_redis_makers("nanolimit"),
        ),
        Library(
            "limits",
            "limits",
            _limits_makers,
            ("fixed_window", "sliding_log", "sliding_counter"),
            "MemoryStorage; moving window = sliding log",
            _limits_redis_makers,
        ),
        Library(
            "throttled",
            "throttled",
            _throttled_makers,
            ("token_bucket", "leaky_bucket", "fixed_window", "sliding_counter", "gcra"),
            "throttled-py, MemoryStore",
            _throttled_redis_makers,
        ),
        Library(
            "pyrate",
            "pyrate_limiter",
            _pyrate_makers,
            ("token_bucket", "fixed_window", "sliding_log", "gcra"),
            "pyrate-limiter, a bucket per key",
            _pyrate_redis_makers,
        ),
        Library("token_bucket", "token_bucket", _token_bucket_makers, ("token_bucket",), "token-bucket"),
        Library(
            "nanolimit-reference",
            "nanolimit.reference",
            _nanolimit_makers("nanolimit.reference"),
            ALGORITHMS,
            "the pure-Python twin (only when asked for)",
            _nanolimit_redis_makers("nanolimit.reference"),
        ),
    )
}
DEFAULT_LIBRARIES = ("nanolimit", "limits", "throttled", "pyrate", "token_bucket")
OURS = "nanolimit"


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


def _meta(quick: bool) -> dict[str, Any]:
    import nanolimit

    versions: dict[str, str] = {"nanolimit": f"{nanolimit.__version__} ({nanolimit.IMPLEMENTATION})"}
    for dist in ("limits", "throttled-py", "pyrate-limiter", "token-bucket"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except Exception:  # noqa: BLE001 - not installed, or no metadata: the table says so
            versions[dist] = "not installed"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "platform": platform.platform(),
        "versions": versions,
        "quick": quick,
        "clock": "SystemClock (nanolimit); each peer its own default clock",
        "batch": BATCH,
    }


def run(
    quick: bool = True,
    libraries: Iterable[str] | None = None,
    algorithms: Iterable[str] | None = None,
    scenarios: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
    redis_url: str | None = None,
) -> Results:
    """Measure every library × algorithm × scenario asked for, in this process.

    Unknown names raise ``ValueError``; a library that is not installed, or
    lacks an algorithm or a scenario's API, simply has no cell (or an
    ``error`` cell saying why), so the run always completes. ``redis_url``
    adds the ``redis_`` scenarios (they need it); the keys they write there
    are deleted at the end.
    """
    libs = list(libraries or DEFAULT_LIBRARIES)
    algs = list(algorithms or ALGORITHMS)
    default = list(QUICK_SCENARIOS if quick else MEMORY_SCENARIOS)
    if redis_url:
        default += list(REDIS_SCENARIOS)
    scens = list(scenarios or default)
    for name, known in ((libs, LIBRARIES), (algs, ALGORITHMS), (scens, SCENARIOS)):
        unknown = [n for n in name if n not in known]
        if unknown:
            raise ValueError(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
    wants_redis = [scen for scen in scens if scen in REDIS_SCENARIOS]
    if wants_redis and not redis_url:
        raise ValueError(f"{', '.join(wants_redis)} need a server: --redis redis://HOST:PORT/DB")
    target = RedisTarget(redis_url) if redis_url and wants_redis else None
    if target is not None:
        try:
            target.check()
        except Exception as exc:  # any client error: say which server, and why
            raise ValueError(f"no Redis answering at {_public_url(target.url)}: {exc}") from exc
    budget = QUICK_BUDGET if quick else FULL_BUDGET
    results = Results(_meta(quick))
    results.meta["loop_overhead_ns"] = round(loop_overhead_ns(budget), 1)
    if target is not None:
        results.meta["redis"] = _public_url(target.url)
    say = progress or (lambda _msg: None)
    missing = [lib for lib in libs if not LIBRARIES[lib].available()]
    results.meta["missing"] = missing
    shared = Shared()
    for lib_name in missing:
        say(f"{lib_name}: not installed, skipped (pip install 'nanolimit[bench]')")
    present = [lib for lib in libs if lib not in missing]
    makers = {lib: LIBRARIES[lib].makers() for lib in present}
    redis_makers: dict[str, dict[str, Maker]] = {}
    if target is not None:
        for lib in present:
            found = LIBRARIES[lib].redis_makers
            if found is not None:
                redis_makers[lib] = found(target)
    try:
        _run_cells(results, algs, makers, redis_makers, scens, shared, budget, say)
    finally:
        if target is not None:
            results.meta["redis_keys_removed"] = target.cleanup()
    return results


def _public_url(url: str) -> str:
    """``url`` without its password, for a report."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    if parts.port is not None:
        host += f":{parts.port}"
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


def _run_cells(
    results: Results,
    algs: list[str],
    makers: dict[str, dict[str, Maker]],
    redis_makers: dict[str, dict[str, Maker]],
    scens: list[str],
    shared: Shared,
    budget: Budget,
    say: Callable[[str], None],
) -> None:
    # algorithm outermost: ours and each peer's figures for one algorithm are
    # taken seconds apart, so a change in the machine's load skews no ratio
    for alg in algs:
        for lib_name, lib_makers in makers.items():
            try:
                for scen in scens:
                    source = redis_makers.get(lib_name, {}) if scen in REDIS_SCENARIOS else lib_makers
                    make = source.get(alg)
                    if make is None:
                        continue
                    if scen == "allow_many_100k" and not lib_name.startswith(OURS):
                        continue
                    say(f"{alg} {lib_name} {scen}")
                    gc.collect()
                    try:
                        prepared = prepare(scen, make, shared)
                    except NotImplementedError:
                        continue  # the library has no such API (peek): no cell
                    except Exception as exc:  # noqa: BLE001 - one broken peer must not sink the run
                        results.cells.append(Cell(lib_name, alg, scen, error=f"{type(exc).__name__}: {exc}"))
                        continue
                    try:
                        results.cells.append(Cell.of(lib_name, alg, scen, sample(prepared, budget)))
                    except Exception as exc:  # noqa: BLE001 - the same, while timing
                        results.cells.append(Cell(lib_name, alg, scen, error=f"{type(exc).__name__}: {exc}"))
                    finally:
                        prepared.close()
            finally:
                shared.close()
                gc.collect()


# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _ns(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def format_table(results: Results) -> str:
    """The human table: one row per cell, grouped by scenario and algorithm."""
    meta = results.meta
    lines = [
        f"nanolimit bench ({'quick' if meta.get('quick') else 'full'}) - {meta['date']}",
        f"{meta['python']} on {meta['platform']}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"ns per decision, median (min-max) over repeats of {BATCH} calls ({REDIS_BATCH} on Redis); "
        f"every figure includes the driving loop, {meta['loop_overhead_ns']} ns",
        "",
    ]
    w = max(len(c.scenario) for c in results.cells) if results.cells else 16
    header = f"{'scenario':<{w}} {'algorithm':<16} {'library':<20} {'median':>9} {'min-max':>19}"
    header += "  nanolimit is"
    lines += [header, "-" * len(header)]
    order = {s: i for i, s in enumerate(SCENARIOS)}
    alg_order = {a: i for i, a in enumerate(ALGORITHMS)}
    lib_order = {name: i for i, name in enumerate(LIBRARIES)}
    cells = sorted(
        results.cells, key=lambda c: (order[c.scenario], alg_order[c.algorithm], lib_order[c.library])
    )
    previous: tuple[str, str] | None = None
    for c in cells:
        group = (c.scenario, c.algorithm)
        if previous is not None and group != previous and c.scenario != previous[0]:
            lines.append("")
        scen = c.scenario if group != previous else ""
        alg = c.algorithm if group != previous else ""
        previous = group
        if c.error:
            lines.append(f"{scen:<{w}} {alg:<16} {c.library:<20} error: {c.error}")
            continue
        ratio = results.ratio(c)
        spread = f"{_ns(c.min_ns)}-{_ns(c.max_ns)}"
        verdict = ""
        if ratio is not None:
            verdict = f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x SLOWER"
        lines.append(f"{scen:<{w}} {alg:<16} {c.library:<20} {_ns(c.median_ns):>9} {spread:>19}  {verdict}")
    if meta.get("missing"):
        lines += ["", "not installed: " + ", ".join(meta["missing"]) + " (pip install 'nanolimit[bench]')"]
    return "\n".join(lines)


def format_markdown(results: Results) -> str:
    """The README's form: one table per scenario, a row per algorithm, a column
    per library; each peer cell reads ``median ns (our ratio)``."""
    meta = results.meta
    libs = [lib for lib in LIBRARIES if any(c.library == lib for c in results.cells)]
    out = [
        f"{meta['python']}, {meta['platform']}, {meta['date']}; "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
        f"ns per decision, median of repeats of {BATCH} calls ({REDIS_BATCH} on Redis) "
        f"(loop included: {meta['loop_overhead_ns']} ns); in brackets, how many times faster nanolimit is.",
    ]
    for scen, title in SCENARIOS.items():
        rows = [
            alg for alg in ALGORITHMS if any(c.scenario == scen and c.algorithm == alg for c in results.cells)
        ]
        if not rows:
            continue
        out += ["", f"**{scen}**: {title}", "", "| algorithm | " + " | ".join(libs) + " |"]
        out.append("| --- |" + " ---: |" * len(libs))
        for alg in rows:
            cells = []
            for lib in libs:
                c = results.cell(lib, alg, scen)
                if c is None:
                    cells.append("")
                elif c.error:
                    cells.append("error")
                else:
                    ratio = results.ratio(c)
                    cells.append(_ns(c.median_ns) + (f" ({ratio:.1f}x)" if ratio is not None else ""))
            out.append(f"| {alg} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(results: Results, path: str) -> None:
    """A grouped bar chart, one panel per scenario, log scale: faster reads lower.
    Whiskers span the quartiles: on a busy machine the max is one stray spike.

    matplotlib is optional: without it this raises ``SystemExit`` with the
    command that installs it, rather than a traceback.
    """
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install matplotlib  (or pip install 'nanolimit[bench]')"
        ) from None
    scenarios = [s for s in SCENARIOS if any(c.scenario == s and c.median_ns for c in results.cells)]
    libraries = [lib for lib in LIBRARIES if any(c.library == lib and c.median_ns for c in results.cells)]
    cols = 2
    rows = max(1, (len(scenarios) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.6 * rows), squeeze=False)
    width = 0.8 / max(1, len(libraries))
    for ax, scen in zip(axes.flat, scenarios):
        algs = [a for a in ALGORITHMS if any(c.scenario == scen and c.algorithm == a for c in results.cells)]
        for j, lib in enumerate(libraries):
            xs, ys, lo, hi = [], [], [], []
            for i, alg in enumerate(algs):
                c = results.cell(lib, alg, scen)
                if c is None or c.median_ns is None or c.q1_ns is None or c.q3_ns is None:
                    continue
                xs.append(i + (j - (len(libraries) - 1) / 2) * width)
                ys.append(c.median_ns)
                lo.append(max(0.0, c.median_ns - c.q1_ns))
                hi.append(max(0.0, c.q3_ns - c.median_ns))
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=lib)
        ax.set_yscale("log")
        ax.set_ylim(bottom=10)  # one floor for every panel: bar heights compare across panels
        ax.set_title(SCENARIOS[scen], fontsize=9)
        ax.set_xticks(range(len(algs)))
        ax.set_xticklabels(algs, fontsize=8)
        ax.set_ylabel("ns per decision (log)")
        ax.grid(axis="y", which="both", alpha=0.3)
    for ax in list(axes.flat)[len(scenarios) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    meta = results.meta
    fig.suptitle(
        f"ns per decision, median and quartiles (lower is faster) - {meta['python']}, {meta['date']}",
        y=0.995,
        fontsize=10,
    )
    fig.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.975), ncol=len(labels), frameon=False
    )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def main(argv: Sequence[str] | None = None) -> int:
    """``nanolimit bench [--full] [--json] [--plot PATH] [--redis URL] [--libraries a,b] ...``"""
    parser = argparse.ArgumentParser(
        prog="nanolimit bench",
        description="nanolimit and its peers side by side: ns per decision, measured in this process.",
    )
    parser.add_argument("--full", action="store_true", help="longer runs, and the 1,000,000-key scenario")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables (for the README)")
    parser.add_argument("--plot", metavar="PATH", help="also draw a bar chart (needs matplotlib)")
    parser.add_argument("--libraries", help=f"comma-separated, from: {', '.join(LIBRARIES)}")
    parser.add_argument("--algorithms", help=f"comma-separated, from: {', '.join(ALGORITHMS)}")
    parser.add_argument("--scenarios", help=f"comma-separated, from: {', '.join(SCENARIOS)}")
    parser.add_argument(
        "--redis",
        metavar="URL",
        help="also run the redis_ scenarios against this server (redis://HOST:PORT/DB); "
        "the keys written there are deleted at the end",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    if args.plot and not _importable("matplotlib"):  # fail now, not after minutes
        parser.exit(2, "nanolimit bench: --plot needs matplotlib: pip install matplotlib\n")

    def progress(msg: str) -> None:
        print(f"  {msg}", file=sys.stderr, flush=True)

    try:
        results = run(
            quick=not args.full,
            libraries=_csv(args.libraries),
            algorithms=_csv(args.algorithms),
            scenarios=_csv(args.scenarios),
            progress=None if args.quiet else progress,
            redis_url=args.redis,
        )
    except ValueError as exc:
        parser.exit(2, f"nanolimit bench: {exc}\n")
    if args.json:
        print(json.dumps(results.as_dict(), indent=2))
    elif args.markdown:
        print(format_markdown(results))
    else:
        print(format_table(results))
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
