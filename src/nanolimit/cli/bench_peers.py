"""The peer adapters of ``nanolimit bench``: each library reduced to the calls
a scenario makes.

A :class:`Library` names the module that must import and builds one
:class:`~.bench_cells.Subject` per algorithm: nanolimit (either twin),
``limits``, ``throttled-py``, ``pyrate-limiter`` and ``token-bucket``, in
memory and, where the library has one, on its Redis backend
(:class:`RedisTarget`). :data:`LIBRARIES` is every library the engine knows.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from .._limiter_config import LIMITER_CLASS_NAMES
from .bench_cells import ALGORITHMS, KEYS_1M, Maker, Subject, _nothing, nanolimit_subject


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
                return nanolimit_subject(getattr(module, cls_name)(limit, window, clock=clock_type()))

            return make

        return {alg: maker(cls) for alg, cls in names.items()}

    return makers


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

                return nanolimit_subject(limiter, close)

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
