"""The striped table: growth, eviction, reset, probing after deletions, and
keys that collide.

The collision tests use the native storage's ``_hash_mask`` hook, which ANDs
every hash with a mask so that keys share home slots (and, with a mask of 0,
whole hashes): the probe, backward-shift deletion and the swap-remove of the
dense entry array then run on long collision chains instead of one slot.
"""

from __future__ import annotations

import random
import types

import pytest

from nanolimit import FakeClock

ONE_MILLION = 1_000_000


def test_growth_past_one_million_keys(backend: types.SimpleNamespace) -> None:
    """The native table doubles its index 20 times on the way to a million
    keys, each a rehash that must lose nothing. The reference's stripes are
    dicts, which Python grows: a tenth of the keys shows the same answers in
    a tenth of the time (24 s of CI on the million)."""
    clock = backend.FakeClock(1000.0)
    storage = backend.InMemoryStorage()
    limiter = backend.FixedWindowCounter(3, 60.0, storage=storage, clock=clock, rule="grow")
    total = ONE_MILLION if backend.name == "native" else ONE_MILLION // 10
    keys = [f"k{i}" for i in range(total + 17)]
    first = limiter.allow_many(keys)
    assert len(storage) == len(keys)
    assert first.allowed_count == len(keys)
    assert set(first.remaining) == {2}
    # Every key still finds its own entry after all the rehashing.
    second = limiter.allow_many(keys)
    assert second.allowed_count == len(keys)
    assert set(second.remaining) == {1}
    for key in random.Random(7).sample(keys, 200):
        state = limiter.state(key)
        assert state is not None and state.count == 2


def test_memory_bytes_counts_the_table(backend: types.SimpleNamespace) -> None:
    storage = backend.InMemoryStorage()
    empty = storage.memory_bytes()
    limiter = backend.GCRA(10, 1.0, storage=storage, clock=backend.FakeClock(5.0))
    limiter.allow_many([f"user:{i}" for i in range(10_000)])
    grown = storage.memory_bytes()
    assert grown > empty
    assert grown - empty >= 10_000 * 16  # at least the keys themselves
    storage.evict_idle(float("inf"))
    assert len(storage) == 0
    assert storage.memory_bytes() < grown


def test_evict_idle_keeps_the_rest_reachable(backend: types.SimpleNamespace) -> None:
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage(stripes=4)
    limiter = backend.TokenBucket(5, 10.0, storage=storage, clock=clock)
    old = [f"old{i}" for i in range(3000)]
    new = [f"new{i}" for i in range(3000)]
    limiter.allow_many(old)
    clock.set(100.0)
    limiter.allow_many(new, [2] * len(new))
    assert storage.evict_idle(50.0) == len(old)
    assert len(storage) == len(new)
    for key in old[:50]:
        assert limiter.state(key) is None
    for key in new:
        state = limiter.state(key)
        assert state is not None and state.level == pytest.approx(3.0)
    # an evicted key starts over with a full bucket
    assert limiter.allow(old[0]).remaining == 4


def test_evict_idle_cutoff_validation(backend: types.SimpleNamespace) -> None:
    storage = backend.InMemoryStorage()
    with pytest.raises(backend.ValidationError):
        storage.evict_idle(float("nan"))
    with pytest.raises(backend.ValidationError):
        storage.evict_idle("soon")
    assert storage.evict_idle(float("inf")) == 0


def test_reset_forgets_only_that_key(backend: types.SimpleNamespace) -> None:
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage()
    limiter = backend.SlidingWindowLog(3, 10.0, storage=storage, clock=clock)
    for key in ("a", "b", "c"):
        limiter.allow(key, 3)
    limiter.reset("b")
    assert len(storage) == 2
    assert limiter.state("b") is None
    assert limiter.allow("b", 3).allowed
    assert not limiter.allow("a").allowed
    assert not limiter.allow("c").allowed
    limiter.reset("never-seen")  # forgetting an unknown key is not an error
    assert len(storage) == 3


def test_keys_lists_storage_keys(backend: types.SimpleNamespace) -> None:
    storage = backend.InMemoryStorage()
    clock = backend.FakeClock(0.0)
    backend.GCRA(5, 1.0, storage=storage, clock=clock, rule="api").allow("ü-user")
    backend.TokenBucket(5, 1.0, storage=storage, clock=clock, rule="a:b").allow("k" * 40)
    storage.apply("raw", 0.0, lambda s: (1, None))
    assert sorted(storage.keys()) == sorted(
        [
            backend.storage_key(backend.Algorithm.GCRA, "api", "ü-user"),
            backend.storage_key(backend.Algorithm.TOKEN_BUCKET, "a:b", "k" * 40),
            "raw",
        ]
    )


# --------------------------------------------------------------------------
# Native only: forced collisions through the ``_hash_mask`` test hook.

COLLISION_MASKS = {
    # home slots collide: low 20 bits zero, stripe and fingerprint bits kept
    "low-bits": 0xFFFF_FFFF_FFF0_0000,
    # everything collides: one stripe, one home slot, one fingerprint
    "all-bits": 0,
}


@pytest.fixture(params=list(COLLISION_MASKS), ids=list(COLLISION_MASKS))
def colliding_storage(request: pytest.FixtureRequest, native: types.ModuleType):
    return native.InMemoryStorage(stripes=2, _hash_mask=COLLISION_MASKS[request.param])


@pytest.mark.native
def test_colliding_keys_keep_their_own_state(native, colliding_storage) -> None:
    clock = FakeClock(0.0)
    limiter = native.FixedWindowCounter(1000, 60.0, storage=colliding_storage, clock=clock)
    keys = [f"c{i}" for i in range(1500)]
    for i, key in enumerate(keys):
        limiter.allow(key, 1 + i % 7)
    for i, key in enumerate(keys):
        assert limiter.state(key).count == 1 + i % 7


@pytest.mark.native
def test_probing_after_deletions_matches_a_model(native, colliding_storage) -> None:
    """Random inserts, resets and evictions on colliding keys, checked against
    a dict after every step: backward-shift deletion must never strand a key."""
    rng = random.Random(20261130)
    clock = FakeClock(0.0)
    limiter = native.FixedWindowCounter(10**6, 1e6, storage=colliding_storage, clock=clock)
    model: dict[str, tuple[int, float]] = {}  # key -> (count, last touched)
    pool = [f"p{i}" for i in range(400)]
    for step in range(6000):
        clock.advance(0.25)
        key = rng.choice(pool)
        op = rng.random()
        if op < 0.6:
            limiter.allow(key)
            count = model.get(key, (0, 0.0))[0]
            model[key] = (count + 1, clock.now())
        elif op < 0.95:
            limiter.reset(key)
            model.pop(key, None)
        else:
            cutoff = clock.now() - rng.uniform(0, 200)
            removed = colliding_storage.evict_idle(cutoff)
            stale = [k for k, (_, t) in model.items() if t < cutoff]
            for k in stale:
                del model[k]
            assert removed == len(stale)
        if step % 97 == 0 or op >= 0.95:
            assert len(colliding_storage) == len(model)
            for k in pool:
                state = limiter.state(k)
                if k in model:
                    assert state is not None and state.count == model[k][0], k
                else:
                    assert state is None, k


def test_unseeded_collisions_do_not_exist(backend: types.SimpleNamespace) -> None:
    """Keys that differ only where a weak hash would ignore them still land on
    their own entries (and each namespace hashes differently)."""
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage()
    a = backend.TokenBucket(2, 60.0, storage=storage, clock=clock, rule="a")
    b = backend.TokenBucket(2, 60.0, storage=storage, clock=clock, rule="b")
    keys = ["\x00" * n for n in range(1, 40)] + ["x" * n for n in range(1, 40)]
    for key in keys:
        assert a.allow(key, 2).allowed
        assert b.allow(key, 2).allowed
    for key in keys:
        assert not a.allow(key).allowed
        assert not b.allow(key).allowed
    assert len(storage) == 2 * len(keys)


# --------------------------------------------------------------------------
# Native only: apply's mutate runs unlocked; what it may and may not call.


@pytest.mark.native
def test_apply_inside_a_mutate_is_refused(native) -> None:
    storage = native.InMemoryStorage(stripes=1)
    storage.apply("outer", 1.0, lambda s: (1, None))

    def nested(state):
        storage.apply("inner", 1.0, lambda s: (2, None))
        return 3, None

    with pytest.raises(RuntimeError, match="inside a mutate"):
        storage.apply("outer", 2.0, nested)
    # nothing changed, and nothing is left locked or pinned
    assert storage.apply("outer", 3.0, lambda s: (s, s)) == 1
    assert storage.apply("inner", 3.0, lambda s: (s, s)) is None
    other = native.InMemoryStorage(stripes=1)  # another storage is not this one
    assert storage.apply("outer", 4.0, lambda s: (s, other.apply("x", 4.0, lambda t: (7, 7)))) == 7


@pytest.mark.native
def test_a_mutate_may_decide_on_its_storage(native) -> None:
    """No stripe lock is held while a mutate runs, so it can call a limiter
    of its own storage on the same stripe (this used to be refused)."""
    storage = native.InMemoryStorage(stripes=1)
    limiter = native.FixedWindowCounter(3, 60.0, storage, FakeClock(0.0))
    assert storage.apply("k", 1.0, lambda s: (1, limiter.allow("user").remaining)) == 2
    assert limiter.state("user").count == 1
    assert storage.apply("k", 1.0, lambda s: (s, s)) == 1


@pytest.mark.native
def test_evict_idle_leaves_the_key_whose_mutate_runs(native) -> None:
    storage = native.InMemoryStorage(stripes=1)
    for key in ("busy", "idle1", "idle2"):
        storage.apply(key, 1.0, lambda s: ("old", None))
    evicted: list[int] = []

    def evicting(state):
        evicted.append(storage.evict_idle(float("inf")))
        return state + "+new", None

    storage.apply("busy", 2.0, evicting)
    assert evicted == [2]  # the idle ones; "busy" is being touched
    assert storage.keys() == ["busy"]
    assert storage.apply("busy", 3.0, lambda s: (s, s)) == "old+new"


@pytest.mark.native
def test_a_failing_mutate_unpins_its_key(native) -> None:
    storage = native.InMemoryStorage(stripes=1)
    storage.apply("k", 1.0, lambda s: (1, None))

    def boom(state):
        raise KeyError("boom")

    with pytest.raises(KeyError):
        storage.apply("k", 2.0, boom)
    with pytest.raises(ValueError):  # not a (state, result) pair
        storage.apply("k", 2.0, lambda s: (1, 2, 3))
    assert storage.evict_idle(float("inf")) == 1
    assert len(storage) == 0
