"""docs/spec.md §3: bad input raises ValidationError with a clear message, and no
state is touched."""

from __future__ import annotations

import math

import pytest
from _helpers import SettableClock, fields
from conftest import BURST_ALGORITHMS

# The shared-memory zone runs this suite too (conftest.py, the zone backend).
ZONE_SUITE = True

T0 = 1000.0


def snapshot(limiter, keys=("k", "other")):
    """Everything a bad call could have changed, read at T0."""
    clock = limiter.clock
    saved = clock.value if isinstance(clock, SettableClock) else clock.now()
    if isinstance(clock, SettableClock):
        clock.value = T0
    else:
        clock.set(T0)
    try:
        storage = limiter.storage
        return (
            [limiter.state(k) for k in keys],
            [fields(limiter.peek(k)) for k in keys],
            len(storage),
            sorted(storage.keys()),
        )
    finally:
        if isinstance(clock, SettableClock):
            clock.value = saved
        else:
            clock.set(saved)


@pytest.fixture
def primed(limiter_cls, backend):
    """A limiter of capacity 5 whose key "k" has spent 2 at T0."""
    limiter = limiter_cls(5, 60.0, backend.InMemoryStorage(), SettableClock(T0))
    limiter.allow("k", 2)
    return limiter


def assert_rejected(backend, limiter, call, match):
    before = snapshot(limiter)
    with pytest.raises(backend.ValidationError, match=match) as info:
        call()
    assert str(info.value).strip(), "the error must say what is wrong"
    assert isinstance(info.value, ValueError)
    assert snapshot(limiter) == before


# --------------------------------------------------------------------------
# cost

BAD_COSTS = [
    pytest.param(0, "cost", id="zero"),
    pytest.param(-1, "cost", id="negative"),
    pytest.param(-(10**30), "cost", id="huge-negative"),
    pytest.param(6, "capacity", id="over-capacity"),
    pytest.param(10**30, "capacity|cost", id="huge"),
    pytest.param(2**63, "capacity|cost", id="int64-overflow"),
    pytest.param(1.0, "cost", id="float"),
    pytest.param(2.5, "cost", id="fraction"),
    pytest.param(True, "cost", id="bool"),
    pytest.param(False, "cost", id="bool-false"),
    pytest.param("1", "cost", id="str"),
    pytest.param(None, "cost", id="none"),
]


@pytest.mark.parametrize(("cost", "match"), BAD_COSTS)
def test_bad_cost_allow(backend, primed, cost, match):
    assert_rejected(backend, primed, lambda: primed.allow("k", cost), match)
    assert_rejected(backend, primed, lambda: primed.allow("fresh", cost), match)


@pytest.mark.parametrize(("cost", "match"), BAD_COSTS)
def test_bad_cost_peek(backend, primed, cost, match):
    assert_rejected(backend, primed, lambda: primed.peek("k", cost), match)


@pytest.mark.parametrize(("cost", "match"), BAD_COSTS)
def test_bad_cost_allow_many(backend, primed, cost, match):
    assert_rejected(backend, primed, lambda: primed.allow_many(["k"], [cost]), match)


def test_cost_equal_to_capacity_is_fine(limiter_cls, backend):
    limiter = limiter_cls(5, 60.0, clock=backend.FakeClock(T0))
    assert limiter.allow("k", 5).allowed
    assert not limiter.allow("k", 5).allowed


@pytest.mark.parametrize("algorithm", BURST_ALGORITHMS)
def test_cost_is_measured_against_the_burst(limiter_cls, algorithm, backend):
    limiter = limiter_cls(5, 60.0, clock=backend.FakeClock(T0), burst=3)
    with pytest.raises(backend.ValidationError, match="capacity"):
        limiter.allow("k", 4)
    assert limiter.state("k") is None


# --------------------------------------------------------------------------
# key

BAD_KEYS = [
    pytest.param(b"k", id="bytes"),
    pytest.param(1, id="int"),
    pytest.param(None, id="none"),
    pytest.param(("k",), id="tuple"),
    pytest.param("", id="empty"),
    pytest.param("\ud800", id="lone-surrogate"),
    pytest.param("k\udfff", id="trailing-surrogate"),
    pytest.param("x" * 1025, id="over-1024-bytes"),
    pytest.param("é" * 513, id="513-chars-1026-bytes"),
]


@pytest.mark.parametrize("key", BAD_KEYS)
@pytest.mark.parametrize("op", ["allow", "peek", "reset", "state"])
def test_bad_key(backend, primed, key, op):
    assert_rejected(backend, primed, lambda: getattr(primed, op)(key), "key")


@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_key_allow_many(backend, primed, key):
    assert_rejected(backend, primed, lambda: primed.allow_many([key]), "key")


@pytest.mark.not_on_zone
@pytest.mark.parametrize("key", BAD_KEYS)
def test_bad_key_apply(backend, key):
    storage = backend.InMemoryStorage()
    storage.apply("k", T0, lambda s: (1, None))
    with pytest.raises(backend.ValidationError, match="key"):
        storage.apply(key, T0, lambda s: (2, None))
    assert len(storage) == 1
    assert storage.apply("k", T0, lambda s: (s, s)) == 1


def test_key_at_max_bytes_is_fine(limiter_cls, backend):
    limiter = limiter_cls(5, 60.0, clock=backend.FakeClock(T0))
    assert backend.MAX_KEY_BYTES == 1024
    assert limiter.allow("x" * 1024).allowed
    assert limiter.allow("é" * 512).allowed  # 1024 bytes of UTF-8


def test_max_key_bytes_of_the_storage(limiter_cls, backend):
    storage = backend.InMemoryStorage(max_key_bytes=8)
    limiter = limiter_cls(5, 60.0, storage, SettableClock(T0))
    assert limiter.allow("12345678").allowed
    assert limiter.allow("ключ").allowed  # 8 bytes
    limiter.allow("k", 2)
    for key in ("123456789", "ключx"):
        assert_rejected(backend, limiter, lambda: limiter.allow(key), "key")
        with pytest.raises(backend.ValidationError, match="key"):
            storage.apply(key, T0, lambda s: (1, None))


# --------------------------------------------------------------------------
# limiter configuration


@pytest.mark.parametrize(
    "limit",
    [
        pytest.param(0, id="zero"),
        pytest.param(-5, id="negative"),
        pytest.param(5.0, id="float"),
        pytest.param(True, id="bool"),
        pytest.param("5", id="str"),
        pytest.param(None, id="none"),
        pytest.param(10**30, id="huge"),
    ],
)
def test_bad_limit(limiter_cls, backend, limit):
    with pytest.raises(backend.ValidationError, match="limit"):
        limiter_cls(limit, 60.0, clock=backend.FakeClock(T0))


@pytest.mark.parametrize(
    "window",
    [
        pytest.param(0, id="zero"),
        pytest.param(0.0, id="zero-float"),
        pytest.param(-1.0, id="negative"),
        pytest.param(math.nan, id="nan"),
        pytest.param(math.inf, id="inf"),
        pytest.param(-math.inf, id="-inf"),
        pytest.param(10**400, id="int-past-float"),  # float() of it raises OverflowError
        pytest.param(-(10**400), id="-int-past-float"),
        pytest.param("60", id="str"),
        pytest.param(None, id="none"),
        pytest.param(True, id="bool"),
    ],
)
def test_bad_window(limiter_cls, backend, window):
    with pytest.raises(backend.ValidationError, match="window"):
        limiter_cls(5, window, clock=backend.FakeClock(T0))


def test_int_window_is_fine(limiter_cls, backend):
    limiter = limiter_cls(5, 60, clock=backend.FakeClock(T0))
    assert limiter.window_seconds == 60.0


@pytest.mark.parametrize("algorithm", BURST_ALGORITHMS)
@pytest.mark.parametrize(
    "burst",
    [
        pytest.param(0, id="zero"),
        pytest.param(-1, id="negative"),
        pytest.param(2.5, id="float"),
        pytest.param(True, id="bool"),
        pytest.param(10**30, id="huge"),
    ],
)
def test_bad_burst(limiter_cls, algorithm, backend, burst):
    with pytest.raises(backend.ValidationError, match="burst"):
        limiter_cls(5, 60.0, clock=backend.FakeClock(T0), burst=burst)


@pytest.mark.parametrize("algorithm", ["leaky_bucket", "fixed_window", "sliding_log", "sliding_counter"])
def test_burst_only_for_token_bucket_and_gcra(limiter_cls, algorithm, backend):
    with pytest.raises(backend.ValidationError, match="burst"):
        limiter_cls(5, 60.0, clock=backend.FakeClock(T0), burst=5)


@pytest.mark.parametrize("rule", [None, b"api", 1])
def test_bad_rule(limiter_cls, backend, rule):
    with pytest.raises(backend.ValidationError, match="rule"):
        limiter_cls(5, 60.0, clock=backend.FakeClock(T0), rule=rule)


def test_bad_storage_and_clock_objects(limiter_cls, backend):
    with pytest.raises(backend.ValidationError, match="storage"):
        limiter_cls(5, 60.0, storage=object())
    with pytest.raises(backend.ValidationError, match="clock"):
        limiter_cls(5, 60.0, clock=object())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"stripes": 0}, "stripes"),
        ({"stripes": -1}, "stripes"),
        ({"stripes": 1.5}, "stripes"),
        ({"max_key_bytes": 0}, "max_key_bytes"),
    ],
)
def test_bad_storage_config(backend, kwargs, match):
    with pytest.raises(backend.ValidationError, match=match):
        backend.InMemoryStorage(**kwargs)


def test_unknown_algorithm(backend):
    assert issubclass(backend.UnknownAlgorithmError, backend.ValidationError)
    with pytest.raises(backend.UnknownAlgorithmError, match="token-bucket-ish") as info:
        backend.Algorithm.parse("token-bucket-ish")
    assert "token_bucket" in str(info.value)  # the message lists the known names
    assert backend.Algorithm.parse("token-bucket") is backend.Algorithm.TOKEN_BUCKET  # a spelling, not a typo
    with pytest.raises(backend.UnknownAlgorithmError, match="nope"):
        backend.LimiterConfig.build("nope", 5, 60.0)
    assert backend.Algorithm.parse("gcra") is backend.Algorithm.GCRA
    assert backend.Algorithm.parse(backend.Algorithm.GCRA) is backend.Algorithm.GCRA


def test_limiter_config_build_validates(backend):
    with pytest.raises(backend.ValidationError, match="limit"):
        backend.LimiterConfig.build("gcra", 0, 60.0)
    with pytest.raises(backend.ValidationError, match="window"):
        backend.LimiterConfig.build("gcra", 5, math.nan)
    with pytest.raises(backend.ValidationError, match="burst"):
        backend.LimiterConfig.build("fixed_window", 5, 60.0, burst=5)
    cfg = backend.LimiterConfig.build("gcra", 5, 1.0, burst=10)
    assert (cfg.capacity, cfg.rate, cfg.gcra_interval_us, cfg.gcra_tolerance_us) == (
        10,
        5.0,
        200_000,
        2_000_000,
    )


# --------------------------------------------------------------------------
# clock

BAD_NOW = [
    pytest.param(math.nan, id="nan"),
    pytest.param(math.inf, id="inf"),
    pytest.param(-math.inf, id="-inf"),
    pytest.param("1000.0", id="str"),
    pytest.param(None, id="none"),
    pytest.param(1e300, id="absurd"),
    pytest.param(10**400, id="int-past-float"),
]


@pytest.mark.parametrize("now", BAD_NOW)
@pytest.mark.parametrize("op", ["allow", "peek", "allow_many"])
def test_bad_clock(backend, primed, now, op):
    def call():
        primed.clock.value = now
        if op == "allow_many":
            return primed.allow_many(["k", "fresh"])
        return getattr(primed, op)("k")

    assert_rejected(backend, primed, call, "clock")


@pytest.mark.not_on_zone
@pytest.mark.parametrize("now", [math.nan, math.inf, -math.inf, "1000.0", None, 10**400])
def test_bad_now_in_storage_apply(backend, now):
    storage = backend.InMemoryStorage()
    storage.apply("k", T0, lambda s: (1, None))
    with pytest.raises(backend.ValidationError):
        storage.apply("k", now, lambda s: (2, None))
    assert len(storage) == 1
    assert storage.apply("k", T0, lambda s: (s, s)) == 1


@pytest.mark.not_on_zone
@pytest.mark.parametrize("cutoff", [math.nan, "1000.0", None])
def test_bad_eviction_cutoff(backend, cutoff):
    storage = backend.InMemoryStorage()
    storage.apply("k", T0, lambda s: (1, None))
    with pytest.raises(backend.ValidationError, match="cutoff"):
        storage.evict_idle(cutoff)
    assert len(storage) == 1


@pytest.mark.not_on_zone
def test_infinite_eviction_cutoffs(backend):
    # Not a clock reading: -inf forgets nothing and inf forgets every key.
    storage = backend.InMemoryStorage()
    storage.apply("k", T0, lambda s: (1, None))
    assert storage.evict_idle(-math.inf) == 0
    assert len(storage) == 1
    assert storage.evict_idle(math.inf) == 1
    assert len(storage) == 0
    # an int past a float is its infinity, not an OverflowError
    storage.apply("k", T0, lambda s: (1, None))
    assert storage.evict_idle(-(10**400)) == 0
    assert storage.evict_idle(10**400) == 1


# --------------------------------------------------------------------------
# batches: checked whole before anything is spent


@pytest.mark.parametrize(
    ("keys", "costs", "match"),
    [
        pytest.param(["k", "other", b"bad", "fresh"], None, "key", id="bad-key"),
        pytest.param(["k", "other", "", "fresh"], None, "key", id="empty-key"),
        pytest.param(["k", "other", "x", "fresh"], [1, 1, 0, 1], "cost", id="zero-cost"),
        pytest.param(["k", "other", "x", "fresh"], [1, 1, 6, 1], "capacity", id="over-capacity"),
        pytest.param(["k", "other", "x", "fresh"], [1, 1, 1.0, 1], "cost", id="float-cost"),
        pytest.param(["k", "other", "x"], [1, 1], None, id="fewer-costs"),
        pytest.param(["k", "other"], [1, 1, 1], None, id="more-costs"),
    ],
)
def test_bad_batch_changes_nothing(backend, primed, keys, costs, match):
    before = snapshot(primed, keys=("k", "other", "x", "fresh"))
    with pytest.raises(backend.ValidationError, match=match):
        primed.allow_many(keys, costs)
    assert snapshot(primed, keys=("k", "other", "x", "fresh")) == before
    assert primed.state("fresh") is None
