"""``allow_many(..., times=...)``: one clock reading per request (replays)."""

from __future__ import annotations

import random
from array import array

import pytest

# The shared-memory zone runs this suite too (conftest.py, the zone backend).
ZONE_SUITE = True


def test_times_match_sequential_allows(backend, limiter_cls) -> None:
    rng = random.Random(5)
    keys = [rng.choice("abcd") for _ in range(300)]
    times = []
    t = 1.8e9
    for _ in keys:
        t += rng.choice([0.0, 0.01, 0.2, 1.5, -0.5])  # backward steps included
        times.append(t)
    costs = [rng.randint(1, 3) for _ in keys]
    batch_limiter = limiter_cls(5, 2.0, clock=backend.FakeClock(0.0))
    clock = backend.FakeClock(0.0)
    step_limiter = limiter_cls(5, 2.0, clock=clock)
    result = batch_limiter.allow_many(keys, costs, times=array("d", times))
    for i, (key, cost, now) in enumerate(zip(keys, costs, times)):
        clock.set(now)
        expected = step_limiter.allow(key, cost)
        got = result[i]
        assert (got.allowed, got.remaining) == (expected.allowed, expected.remaining), i
        assert got.retry_after == pytest.approx(expected.retry_after, abs=1e-9)
        assert got.reset_after == pytest.approx(expected.reset_after, abs=1e-9)
    for key in "abcd":
        assert batch_limiter.state(key) == step_limiter.state(key)


def test_bad_times_change_nothing(backend) -> None:
    limiter = backend.TokenBucket(5, 1.0, clock=backend.FakeClock(10.0))
    limiter.allow("a")
    before = limiter.state("a")
    with pytest.raises(backend.ValidationError):
        limiter.allow_many(["a", "a"], times=[11.0, float("nan")])
    with pytest.raises(backend.ValidationError):
        limiter.allow_many(["a", "a"], times=[11.0])
    with pytest.raises(backend.ValidationError):
        limiter.allow_many(["a"], times=["noon"])
    assert limiter.state("a") == before


class EmptyingClock:
    """A clock whose reading empties the caller's key list and refills the
    freed memory with other strings: Python code that runs after a batch has
    taken its keys' bytes must not be able to pull them out from under it."""

    def __init__(self, keys: list[str]) -> None:
        self.keys = keys
        self.junk: list[str] = []

    def now(self) -> float:
        n = len(self.keys)
        self.keys.clear()
        self.junk = [f"zzzz:{i:06d}" for i in range(n)]
        return 1000.0


def test_a_batch_keeps_its_keys_while_python_code_runs(backend) -> None:
    keys = [f"user:{i:06d}" for i in range(2_000)]
    wanted = [f"user:{i:06d}" for i in range(2_000)]  # equal strings, other objects: the batch's own die
    limiter = backend.TokenBucket(5, 60.0, backend.InMemoryStorage(), EmptyingClock(keys))
    result = limiter.allow_many(keys)
    assert keys == [] and len(result) == len(wanted) and all(result.allowed)
    for key in wanted[:50]:
        state = limiter.state(key)
        assert state is not None and state.level == 4.0, key  # the key itself was charged
    assert limiter.state("zzzz:000000") is None
