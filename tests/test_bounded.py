"""Bounded memory: max_keys with on_full="evict" / "deny_new", reclaiming keys
at rest first, and the incremental idle sweep (evict_idle_after)."""

from __future__ import annotations

import types

import pytest
from _helpers import rounds

# The shared-memory zone runs this suite too (conftest.py, the zone backend).
ZONE_SUITE = True


def test_flood_stays_within_the_bound_and_active_keys_keep_their_debt(backend) -> None:
    clock = backend.FakeClock(1000.0)
    storage = backend.InMemoryStorage(stripes=8, max_keys=800)
    limiter = backend.TokenBucket(10, 3600.0, storage, clock, rule="api")
    assert limiter.allow("victim", 10).allowed
    for block in range(40):
        # time moves (LRU needs it) but far too little to refill a token
        clock.advance(0.01)
        for i in range(0, 250, 25):
            clock.advance(0.0001)
            limiter.allow_many([f"flood-{block}-{j}" for j in range(i, i + 25)])
        # the victim keeps asking; rotating other keys must not refill it
        assert not limiter.allow("victim").allowed
        assert len(storage) <= 800
    stats = storage.stats()
    assert stats["evicted_active"] >= 40 * 250 - 800
    assert stats["keys"] == len(storage)
    assert limiter.state("victim") is not None


def test_keys_at_rest_are_reclaimed_before_active_ones(backend) -> None:
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage(stripes=1, max_keys=100)
    limiter = backend.FixedWindowCounter(5, 1.0, storage, clock, rule="r")
    limiter.allow_many([f"old{i}" for i in range(100)])
    clock.advance(5.0)  # every old window has ended: all 100 keys are at rest
    limiter.allow_many([f"new{i}" for i in range(100)])
    stats = storage.stats()
    assert stats["evicted_at_rest"] == 100
    assert stats["evicted_active"] == 0
    assert len(storage) == 100


def test_deny_new_refuses_new_keys_and_serves_existing_ones(backend) -> None:
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage(stripes=1, max_keys=3, on_full="deny_new")
    limiter = backend.GCRA(10, 1.0, storage, clock, rule="r")
    for key in ("a", "b", "c"):
        assert limiter.allow(key).allowed
    refused = limiter.allow("d")
    assert not refused.allowed
    assert refused.degraded and refused.reason == "storage_full"
    assert refused.retry_after > 0
    assert limiter.allow("a").allowed and limiter.allow("b").allowed
    assert limiter.state("d") is None
    batch = limiter.allow_many(["c", "e", "b"])
    assert list(batch.allowed) == [1, 0, 1] and batch.degraded
    # only the refused request is degraded, and it says why (as allow() does)
    assert [(d.degraded, d.reason) for d in batch] == [(False, ""), (True, "storage_full"), (False, "")]
    assert batch[-2] == batch[1]
    assert storage.stats()["denied_new"] == 2
    # once a key is at rest it can be reclaimed without changing any decision
    clock.advance(10.0)
    assert limiter.allow("d").allowed
    assert storage.stats()["evicted_at_rest"] == 1


def test_peek_on_a_full_deny_new_store_answers_as_allow_would(backend) -> None:
    """A new key's peek on a full deny_new stripe is refused exactly when its
    allow would be, and counts nothing: while every key is active, and once
    one is at rest (allow would reclaim it) or idle past evict_idle_after."""
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage(stripes=1, max_keys=2, on_full="deny_new", evict_idle_after=100.0)
    limiter = backend.TokenBucket(5, 60.0, storage, clock, rule="r")  # refills one unit per 12 s
    for key in ("a", "b"):
        assert limiter.allow(key, 3).allowed
    clock.advance(20.0)
    assert limiter.allow("b").allowed  # b stays active longer than a
    stats = storage.stats()
    peeked = limiter.peek("c")
    assert (peeked.allowed, peeked.degraded, peeked.reason) == (False, True, "storage_full")
    assert storage.stats() == stats and len(storage) == 2 and limiter.state("c") is None
    assert limiter.allow("c") == peeked
    clock.advance(20.0)  # a refilled to the brim at 36 s: at rest, so allow would reclaim it
    peeked = limiter.peek("d")
    assert (peeked.allowed, peeked.degraded, peeked.remaining) == (True, False, 4)
    assert storage.stats()["evicted_at_rest"] == 0 and len(storage) == 2
    assert limiter.allow("d") == peeked
    # idle past evict_idle_after but still in debt: the sweep keeps it (forgotten,
    # x would get a fresh budget back), and peek refuses the newcomer as allow does
    slow = backend.TokenBucket(
        5,
        600.0,
        backend.InMemoryStorage(stripes=1, max_keys=1, on_full="deny_new", evict_idle_after=100.0),
        clock,
        rule="s",
    )
    assert slow.allow("x", 5).allowed  # refills one unit per 120 s
    clock.advance(110.0)  # x untouched for 110 s, 0.9 units back
    assert not slow.peek("y").allowed and not slow.allow("y").allowed
    assert slow.state("x") is not None
    clock.advance(500.0)  # 610 s: x back to the brim, at rest
    assert slow.peek("y").allowed and slow.state("x") is not None
    assert slow.allow("y").allowed and slow.state("x") is None


def test_idle_sweep_runs_without_a_timer(backend) -> None:
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage(stripes=1, evict_idle_after=30.0)
    limiter = backend.SlidingWindowLog(3, 10.0, storage, clock, rule="r")
    limiter.allow_many([f"early{i}" for i in range(200)])
    clock.advance(60.0)
    for i in range(400):  # every insert sweeps a few entries
        limiter.allow(f"late{i}")
    assert storage.stats()["evicted_idle"] == 200
    assert len(storage) == 400
    assert all(limiter.state(f"early{i}") is None for i in range(200))


def test_compound_on_a_full_storage_is_still_all_or_nothing(backend) -> None:
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage(stripes=1, max_keys=2, on_full="deny_new")
    a = backend.TokenBucket(5, 60.0, storage, clock, rule="a")
    b = backend.TokenBucket(5, 60.0, storage, clock, rule="b")
    assert storage.allow_all([(a, "k"), (b, "k")]).allowed
    result = storage.allow_all([(a, "k"), (b, "other")])
    assert not result.allowed
    assert result.decisions[1].reason == "storage_full"
    assert a.peek("k").remaining == 3  # a was not charged for the refused request


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_keys": 0},
        {"max_keys": -5},
        {"max_keys": 1.5},
        {"max_keys": True},
        {"on_full": "drop"},
        {"evict_idle_after": 0},
        {"evict_idle_after": float("inf")},
        {"evict_idle_after": "1m"},
    ],
)
def test_bad_bounds_are_rejected(backend: types.SimpleNamespace, kwargs) -> None:
    with pytest.raises(backend.ValidationError):
        backend.InMemoryStorage(**kwargs)


@pytest.mark.native
def test_native_memory_is_bounded_under_a_key_flood(native) -> None:
    storage = native.InMemoryStorage(max_keys=10_000)
    limiter = native.TokenBucket(5, 1.0, storage, rule="flood")
    limiter.allow_many([f"warm{i}" for i in range(10_000)])
    plateau = storage.memory_bytes()
    for block in range(rounds(100, 10)):
        limiter.allow_many([f"k{block}-{i:06d}" for i in range(10_000)])
        assert len(storage) <= 10_000
    assert storage.memory_bytes() <= plateau * 1.5


@pytest.mark.parametrize("max_keys", [1, 3, 10, 63])
def test_max_keys_below_the_stripe_count_still_bounds_the_keys(backend, max_keys: int) -> None:
    """Each stripe holds at least one key: with 64 stripes, max_keys=10 held
    64 keys. A bounded storage uses at most max_keys stripes."""
    storage = backend.InMemoryStorage(max_keys=max_keys)
    assert storage.stripes <= max_keys and storage.stripes & (storage.stripes - 1) == 0
    limiter = backend.TokenBucket(5, 60.0, storage, backend.FakeClock(1000.0))
    for i in range(500):
        limiter.allow(f"k{i}")
        assert len(storage) <= max_keys
    # 16 keys a stripe at least, so that a full stripe has victims to choose among
    assert backend.InMemoryStorage(max_keys=1000).stripes == 32
    assert backend.InMemoryStorage(max_keys=1024).stripes == 64  # room enough: unchanged


def test_a_compound_never_leaves_a_stripe_over_its_cap(backend) -> None:
    """An all-or-nothing compound makes room for its new keys of a stripe
    together, never forgetting one of its own keys for another: it fits
    within max_keys or is refused (storage_full), adding nothing. (It used
    to add its new keys together and leave the stripe over its cap until
    the next new key.)"""
    storage = backend.InMemoryStorage(stripes=1, max_keys=2)
    clock = backend.FakeClock(0.0)
    limiters = [backend.TokenBucket(5, 60.0, storage, clock, f"r{i}") for i in range(6)]
    refused = storage.allow_all([(limiter, "u") for limiter in limiters])
    assert not refused.allowed  # six new keys cannot fit in two
    assert [d.reason == "storage_full" for d in refused.decisions] == [False, False] + [True] * 4
    assert len(storage) == 0 and storage.stats()["denied_new"] == 4
    assert storage.allow_all([(limiters[0], "u"), (limiters[1], "u")]).allowed
    assert len(storage) == 2
    # room for two at once: both "u" keys go (not in debt), neither new key stays out
    assert storage.allow_all([(limiters[0], "v"), (limiters[1], "v")]).allowed
    assert len(storage) == 2
    assert limiters[0].state("u") is None and limiters[1].state("u") is None
    limiters[0].allow("next")
    assert len(storage) <= 2
    for i in range(20):
        limiters[0].allow(f"x{i}")
        assert len(storage) <= 2


@pytest.mark.parametrize("on_full", ["evict", "deny_new"])
def test_a_compound_never_forgets_its_own_key_to_make_room(backend, on_full: str) -> None:
    """Making room for a compound's new key never forgets another key of the
    same compound, even one at rest: the commit would write it back, one key
    over the cap. With nothing else to forget, the compound is refused."""
    storage = backend.InMemoryStorage(stripes=1, max_keys=2, on_full=on_full)
    clock = backend.FakeClock(0.0)
    limiter = backend.FixedWindowCounter(5, 1.0, storage, clock, rule="r")
    assert limiter.allow("a").allowed
    clock.advance(1.0)  # "a" is at rest: forgetting it would change no decision
    assert limiter.allow("c").allowed
    a_before = limiter.peek("a").remaining
    decision = storage.allow_all([(limiter, "a"), (limiter, "b")])
    assert len(storage) <= 2
    if on_full == "evict":
        assert decision.allowed  # "c" (not in debt) went, not "a"
        assert limiter.state("c") is None
        assert limiter.state("a") is not None and limiter.state("b") is not None
    else:
        assert not decision.allowed  # "c" is not at rest: nothing may go
        assert decision.decisions[1].reason == "storage_full"
        assert limiter.state("b") is None and limiter.state("c") is not None
        assert limiter.peek("a").remaining == a_before  # the refused compound charged nothing


@pytest.mark.not_on_zone
@pytest.mark.parametrize("on_full", ["evict", "deny_new"])
def test_apply_keys_hold_the_bound_too(backend, on_full: str) -> None:
    """A flood of new ``apply`` keys (a Python algorithm's callers) stops at
    ``max_keys`` with a clear error that stores nothing; the keys already
    held are still served."""
    storage = backend.InMemoryStorage(stripes=4, max_keys=64, on_full=on_full)
    refused = 0
    for i in range(1000):
        try:
            assert storage.apply(f"k{i}", 1.0, lambda s: (1, "stored")) == "stored"
        except backend.StorageFullError as error:
            assert f"'k{i}'" in str(error) and "max_keys=64" in str(error)
            refused += 1
    assert len(storage) == 64
    assert refused == 1000 - 64
    assert storage.stats()["denied_new"] == refused
    # a refused key was not stored; a held one still takes a new state
    held = [k for k in storage.keys() if storage.apply(k, 2.0, lambda s: (s, s)) == 1]
    assert len(held) == 64
    assert storage.apply(held[0], 3.0, lambda s: (s + 1, s + 1)) == 2
    assert storage.apply("k999", 3.0, lambda s: (s, s)) is None or "k999" in held


@pytest.mark.not_on_zone
def test_a_new_apply_key_takes_the_place_of_a_limiter_key_at_rest(backend) -> None:
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage(stripes=1, max_keys=16, on_full="deny_new")
    limiter = backend.FixedWindowCounter(5, 1.0, storage, clock, rule="r")
    limiter.allow_many([f"old{i}" for i in range(16)])
    with pytest.raises(backend.StorageFullError):
        storage.apply("fresh", 0.5, lambda s: (1, None))  # every window is open: nothing at rest
    assert len(storage) == 16 and storage.apply("fresh", 0.5, lambda s: (s, s)) is None
    clock.advance(5.0)
    storage.apply("fresh", 5.0, lambda s: (1, None))  # a key at rest makes room
    assert storage.stats()["evicted_at_rest"] == 1 and len(storage) == 16
    assert storage.apply("fresh", 5.0, lambda s: (s, s)) == 1


@pytest.mark.not_on_zone
def test_forgetting_or_reading_a_missing_key_never_needs_room(backend) -> None:
    storage = backend.InMemoryStorage(stripes=1, max_keys=16, on_full="deny_new")
    for i in range(16):
        storage.apply(f"k{i}", 1.0, lambda s: (1, None))
    assert storage.apply("absent", 1.0, lambda s: (None, "forgotten")) == "forgotten"
    assert storage.apply("absent", 1.0, lambda s: (s, s)) is None
    assert storage.stats()["denied_new"] == 0


def test_eviction_counters_lose_no_count_under_threads(backend) -> None:
    """Refusals on many stripes at once: ``stats()`` counts every one."""
    import threading

    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage(stripes=8, max_keys=64, on_full="deny_new")
    limiter = backend.FixedWindowCounter(5, 3600.0, storage, clock, rule="r")
    limiter.allow_many([f"held{i}" for i in range(2000)])
    base = storage.stats()["denied_new"]
    refused = [0] * 8

    def flood(t: int) -> None:
        for i in range(3000):
            if limiter.allow(f"t{t}-{i}").reason == "storage_full":
                refused[t] += 1

    threads = [threading.Thread(target=flood, args=(t,)) for t in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sum(refused) == 8 * 3000
    assert storage.stats()["denied_new"] - base == sum(refused)
