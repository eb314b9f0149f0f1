"""docs/spec.md §7 reference scenarios and per-algorithm behaviour, for both twins.

Numbers are docs/spec.md §7's or derived by hand from the docs/spec.md §4 formulas; each
derivation is in a comment next to its assertion.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
from _helpers import FIELDS, DictStorage, batch_fields, fields
from conftest import BURST_ALGORITHMS

# The shared-memory zone runs this suite too (conftest.py, the zone backend).
ZONE_SUITE = True

WALL = 1_700_000_000.0

# docs/spec.md §7: retry_after of the 6th of 7 requests, limit 5 per second, t = 0.
SIXTH_RETRY = {
    "token_bucket": 0.2,
    "leaky_bucket": 0.2,
    "gcra": 0.2,
    "fixed_window": 1.0,
    "sliding_log": 1.0,
    "sliding_counter": 1.0,
}


def spend(limiter, key: str, n: int, cost: int = 1) -> list:
    return [limiter.allow(key, cost) for _ in range(n)]


# --------------------------------------------------------------------------
# docs/spec.md §7


def test_token_bucket_five_per_minute_429(backend):
    clock = backend.FakeClock(WALL)
    limiter = backend.TokenBucket(5, 60, clock=clock)
    decisions = spend(limiter, "client", 7)
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 2
    denied = decisions[5]
    # (cost - level) / rate = 1 / (5 / 60) = 12 s
    assert denied.retry_after == pytest.approx(12.0, abs=1e-9)
    headers = denied.headers(wall_now=WALL)
    assert headers["Retry-After"] == "12"
    assert headers["X-RateLimit-Remaining"] == "0"
    assert headers["X-RateLimit-Limit"] == "5"
    assert "Retry-After" not in decisions[4].headers(wall_now=WALL)


def test_five_per_second_seven_at_once(limiter_cls, algorithm, backend):
    limiter = limiter_cls(5, 1.0, clock=backend.FakeClock(0.0))
    decisions = spend(limiter, "k", 7)
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 2
    assert [d.remaining for d in decisions] == [4, 3, 2, 1, 0, 0, 0]
    assert decisions[5].retry_after == pytest.approx(SIXTH_RETRY[algorithm], abs=1e-9)
    assert decisions[6].retry_after == pytest.approx(SIXTH_RETRY[algorithm], abs=1e-9)
    for d in decisions[:5]:
        assert d.retry_after == 0.0
        assert d.limit == 5
        assert d.window == 1.0
        assert d.rule == ""


# Fixed window lets 2 x limit across the boundary (docs/spec.md §7). The others were
# derived by hand: 0.1 s after a full spend a token bucket, leaky bucket and
# GCRA have regained 0.5 units, the log still holds all 5 entries, and the
# counter's estimate is 5 * 1.0 + 0.
SECOND_HALF_ALLOWED = {
    "fixed_window": 5,
    "sliding_counter": 0,
    "sliding_log": 0,
    "token_bucket": 0,
    "leaky_bucket": 0,
    "gcra": 0,
}


def test_boundary_burst(limiter_cls, algorithm, backend):
    clock = backend.FakeClock(1_000_000.9)
    limiter = limiter_cls(5, 1.0, clock=clock)
    first = spend(limiter, "k", 5)
    clock.set(1_000_001.0)
    second = spend(limiter, "k", 5)
    assert all(d.allowed for d in first)
    assert sum(d.allowed for d in second) == SECOND_HALF_ALLOWED[algorithm]


# --------------------------------------------------------------------------
# Time: refill, drain, windows


def test_token_bucket_refills_at_rate(backend):
    clock = backend.FakeClock(1000.0)
    limiter = backend.TokenBucket(5, 1.0, clock=clock)
    spend(limiter, "k", 5)
    assert not limiter.allow("k").allowed
    clock.set(1000.5)  # 0.5 s * 5/s = 2.5 tokens
    got = spend(limiter, "k", 3)
    assert [d.allowed for d in got] == [True, True, False]
    assert [d.remaining for d in got] == [1, 0, 0]
    # the denied one: (1 - 0.5) / 5 = 0.1 s
    assert got[2].retry_after == pytest.approx(0.1, abs=1e-9)
    clock.set(1100.0)  # long idle: capped at capacity, not 100 * 5 tokens
    assert [d.allowed for d in spend(limiter, "k", 6)] == [True] * 5 + [False]


def test_leaky_bucket_delay(backend):
    clock = backend.FakeClock(1000.0)
    limiter = backend.LeakyBucket(5, 1.0, clock=clock)
    got = spend(limiter, "k", 6)
    assert [d.allowed for d in got] == [True] * 5 + [False]
    # delay = level / rate with level 0, 1, 2, 3, 4 before each admission
    assert [d.delay for d in got[:5]] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8], abs=1e-9)
    assert got[5].delay == 0.0
    # reset_after = level / rate = 5 / 5
    assert got[4].reset_after == pytest.approx(1.0, abs=1e-9)
    clock.set(1000.5)  # drained 2.5: level 2.5
    d = limiter.allow("k")
    assert d.allowed
    assert d.delay == pytest.approx(0.5, abs=1e-9)
    assert d.remaining == 1  # floor(5 - 3.5)


def test_only_leaky_bucket_delays(limiter_cls, algorithm, backend):
    limiter = limiter_cls(5, 1.0, clock=backend.FakeClock(1000.0))
    delays = [d.delay for d in spend(limiter, "k", 5)]
    if algorithm == "leaky_bucket":
        assert delays[-1] > 0
    else:
        assert delays == [0.0] * 5


def test_gcra_spaces_requests_evenly(backend):
    # limit 4 per second, burst 1: emission interval 250 000 us, tolerance the same.
    clock = backend.FakeClock(1000.0)
    limiter = backend.GCRA(4, 1.0, clock=clock, burst=1)
    pattern = []
    for i in range(16):  # every 0.125 s, exact binary fractions
        clock.set(1000.0 + i * 0.125)
        pattern.append(limiter.allow("k").allowed)
    assert pattern == [True, False] * 8


def test_gcra_after_burst_one_per_interval(backend):
    clock = backend.FakeClock(1000.0)
    limiter = backend.GCRA(4, 1.0, clock=clock)
    assert [d.allowed for d in spend(limiter, "k", 5)] == [True] * 4 + [False]
    pattern = []
    for i in range(1, 17):
        clock.set(1000.0 + i * 0.125)
        pattern.append(limiter.allow("k").allowed)
    # backlog 1 s drains 125 000 us per step; one more fits every 250 000 us
    assert pattern == [False, True] * 8


def test_gcra_full_burst_with_awkward_interval(backend):
    # docs/spec.md §4: T = 0.6 s as a float sum overshoots; in integer us 100 fit exactly.
    clock = backend.FakeClock(1_800_000_000.0)
    limiter = backend.GCRA(100, 60.0, clock=clock)
    got = spend(limiter, "k", 101)
    assert sum(d.allowed for d in got) == 100
    assert not got[100].allowed
    assert got[99].remaining == 0
    assert got[99].reset_after == pytest.approx(60.0, abs=1e-9)
    assert got[100].retry_after == pytest.approx(0.6, abs=1e-9)


@pytest.mark.parametrize("algorithm", BURST_ALGORITHMS)
def test_burst_changes_capacity_not_rate(limiter_cls, algorithm, backend):
    clock = backend.FakeClock(1000.0)
    limiter = limiter_cls(5, 1.0, clock=clock, burst=10)
    assert (limiter.limit, limiter.capacity, limiter.burst) == (5, 10, 10)
    got = spend(limiter, "k", 11)
    assert [d.allowed for d in got] == [True] * 10 + [False]
    assert got[0].limit == 10  # measured against the burst
    assert got[10].retry_after == pytest.approx(0.2, abs=1e-9)  # rate 5/s, not 10/s
    clock.set(1001.0)  # one second at 5/s
    assert [d.allowed for d in spend(limiter, "k", 6)] == [True] * 5 + [False]
    with pytest.raises(backend.ValidationError):
        limiter.allow("k", 11)
    assert limiter.allow("other", 10).allowed  # a cost up to the burst passes


@pytest.mark.parametrize("algorithm", BURST_ALGORITHMS)
def test_burst_below_limit(limiter_cls, algorithm, backend):
    clock = backend.FakeClock(1000.0)
    limiter = limiter_cls(10, 1.0, clock=clock, burst=2)
    got = spend(limiter, "k", 3)
    assert [d.allowed for d in got] == [True, True, False]
    assert got[2].retry_after == pytest.approx(0.1, abs=1e-9)  # 1 / (10/s)
    with pytest.raises(backend.ValidationError):
        limiter.allow("k", 3)


def test_sliding_log_is_exact(backend):
    clock = backend.FakeClock(1000.0)
    limiter = backend.SlidingWindowLog(3, 1.0, clock=clock)
    for t in (1000.0, 1000.25, 1000.5):
        clock.set(t)
        assert limiter.allow("k").allowed
    clock.set(1000.75)
    d = limiter.allow("k")
    assert not d.allowed
    assert d.retry_after == pytest.approx(0.25, abs=1e-9)  # log[0] + 1 - now
    assert d.reset_after == pytest.approx(0.75, abs=1e-9)  # newest + 1 - now
    clock.set(1001.0)  # the entry at 1000.0 is <= now - window: gone
    assert limiter.allow("k").allowed
    assert not limiter.allow("k").allowed
    state = limiter.state("k")
    assert state.log == (1000.25, 1000.5, 1001.0)


def test_sliding_log_retry_for_a_bigger_cost(backend):
    clock = backend.FakeClock(1000.0)
    limiter = backend.SlidingWindowLog(4, 1.0, clock=clock)
    for t in (1000.0, 1000.25, 1000.5, 1000.75):
        clock.set(t)
        limiter.allow("k")
    d = limiter.allow("k", 3)
    # log[len + cost - capacity - 1] = log[2] = 1000.5; + 1 - 1000.75
    assert d.retry_after == pytest.approx(0.75, abs=1e-9)


def test_sliding_counter_weights_previous_window(backend):
    clock = backend.FakeClock(1000.0)
    limiter = backend.SlidingWindowCounter(10, 1.0, clock=clock)
    assert all(d.allowed for d in spend(limiter, "k", 10))
    clock.set(1001.25)  # weight 0.75: estimate 7.5
    got = spend(limiter, "k", 3)
    assert [d.allowed for d in got] == [True, True, False]
    # remaining = floor(10 - 7.5 - 1) = 1, floor(10 - 8.5 - 1) = 0, denied floor(10 - 9.5) = 0
    assert [d.remaining for d in got] == [1, 0, 0]
    # denied: count 2, room = 10 - 2 - 1 = 7: start + 1 * (1 - 7/10) - now = 0.05
    assert got[2].retry_after == pytest.approx(0.05, abs=1e-9)
    assert got[2].reset_after == pytest.approx(0.75 + 1.0, abs=1e-9)
    clock.set(1003.0)  # skipped a whole window: previous is 0
    assert all(d.allowed for d in spend(limiter, "k", 10))


def test_sliding_counter_retry_is_the_window_end_when_count_alone_blocks(backend):
    # docs/spec.md §4: room < 0 -> start + window - now, a lower bound: at that moment
    # the full window becomes `previous` with weight 1 and still blocks.
    clock = backend.FakeClock(1000.0)
    limiter = backend.SlidingWindowCounter(5, 1.0, clock=clock)
    spend(limiter, "k", 5)
    d = limiter.allow("k")
    assert d.retry_after == pytest.approx(1.0, abs=1e-9)
    clock.advance(d.retry_after)
    again = limiter.allow("k")
    assert not again.allowed
    # now previous = 5, count = 0, room = 4: 1 * (1 - 4/5) = 0.2
    assert again.retry_after == pytest.approx(0.2, abs=1e-9)
    clock.advance(again.retry_after + 1e-9)
    assert limiter.allow("k").allowed


# retry_after is honest: after waiting it (plus float slack) a request of the
# same cost passes, and at half of it the request is still denied. The counter
# is exact only once `previous` carries the load (see the test above).
@pytest.mark.parametrize("cost", [1, 2])
@pytest.mark.parametrize("window", [1.0, 0.1, 60.0])
def test_retry_after_is_honest(limiter_cls, algorithm, backend, window, cost):
    clock = backend.FakeClock(1000.0)
    limiter = limiter_cls(5, window, clock=clock)
    if algorithm == "sliding_counter":
        spend(limiter, "k", 5)
        clock.set((math.floor(1000.0 / window) + 1) * window + window / 4)
        spend(limiter, "k", 1)
    else:
        spend(limiter, "k", 3)
        clock.advance(window / 8)
        spend(limiter, "k", 2)
    d = limiter.allow("k", cost)
    assert not d.allowed
    assert d.retry_after > 0
    start = clock.now()
    clock.set(start + d.retry_after / 2)
    assert not limiter.peek("k", cost).allowed
    clock.set(start + d.retry_after + 1e-9)
    assert limiter.peek("k", cost).allowed


def test_reset_after_means_full_budget(limiter_cls, backend):
    clock = backend.FakeClock(100.0)
    limiter = limiter_cls(5, 1.0, clock=clock)
    last = spend(limiter, "k", 5)[-1]
    assert last.reset_after > 0
    start = clock.now()
    clock.set(start + last.reset_after / 2)
    assert not limiter.peek("k", 5).allowed
    clock.set(start + last.reset_after)
    assert limiter.peek("k", 5).allowed
    full = spend(limiter, "k", 6)
    assert [d.allowed for d in full] == [True] * 5 + [False]


# reset_after of a first request of cost 1 at t = 100, limit 5 per second:
# buckets and GCRA 1 / 5; fixed window and log the window end; the counter
# two windows (its count becomes `previous` for one more window).
FIRST_RESET_AFTER = {
    "token_bucket": 0.2,
    "leaky_bucket": 0.2,
    "gcra": 0.2,
    "fixed_window": 1.0,
    "sliding_log": 1.0,
    "sliding_counter": 2.0,
}


def test_first_request_of_a_key(limiter_cls, algorithm, backend):
    limiter = limiter_cls(5, 1.0, clock=backend.FakeClock(100.0))
    for d in (limiter.peek("k"), limiter.allow("k")):
        assert d.allowed
        assert d.remaining == 4
        assert d.retry_after == 0.0
        assert d.reset_after == pytest.approx(FIRST_RESET_AFTER[algorithm], abs=1e-9)


# --------------------------------------------------------------------------
# Budget bookkeeping


def test_reset_restores_full_budget(limiter_cls, backend):
    clock = backend.FakeClock(1000.0)
    limiter = limiter_cls(5, 60.0, clock=clock)
    spend(limiter, "k", 5)
    spend(limiter, "other", 2)
    assert not limiter.allow("k").allowed
    assert limiter.reset("k") is None
    assert limiter.state("k") is None
    assert limiter.peek("k", 5).allowed
    assert [d.allowed for d in spend(limiter, "k", 6)] == [True] * 5 + [False]
    assert limiter.peek("other").remaining == 2  # another key is left alone
    limiter.reset("never-seen")  # no error


def test_peek_consumes_nothing(limiter_cls, backend, storage):
    clock = backend.FakeClock(1000.0)
    limiter = limiter_cls(5, 60.0, storage, clock)
    first = limiter.peek("k", 2)
    assert limiter.state("k") is None  # a peek stores nothing
    assert len(storage) == 0
    spend(limiter, "k", 2)
    before = limiter.state("k")
    peeks = [fields(limiter.peek("k", 2)) for _ in range(5)]
    assert len(set(peeks)) == 1
    assert limiter.state("k") == before
    assert fields(limiter.allow("k", 2)) == peeks[0]  # the answer allow then gives
    assert first.allowed and first.remaining == 3


def test_denied_requests_consume_nothing(limiter_cls, backend):
    limiter = limiter_cls(5, 1.0, clock=backend.FakeClock(1000.0))
    assert limiter.allow("k", 3).allowed
    before = limiter.state("k")
    assert not limiter.allow("k", 3).allowed
    assert not limiter.allow("k", 3).allowed
    assert limiter.state("k") == before
    assert limiter.allow("k", 2).allowed  # the denied 3 + 3 were not spent
    assert not limiter.allow("k", 1).allowed


def test_two_keys_never_share_budget(limiter_cls, backend):
    limiter = limiter_cls(3, 60.0, clock=backend.FakeClock(1000.0))
    # Keys a C string would confuse, and a non-ASCII one.
    keys = ["a", "a\x00", "a\x00b", "ключ", "ключ\x00", "A"]
    for key in keys:
        got = spend(limiter, key, 4)
        assert [d.allowed for d in got] == [True, True, True, False], key


def test_two_rules_on_one_storage_never_share_state(limiter_cls, backend, storage):
    clock = backend.FakeClock(1000.0)
    # A naive "rule:key" join would map both of these to "a:b:c".
    first = limiter_cls(3, 60.0, storage, clock, rule="a:b")
    second = limiter_cls(3, 60.0, storage, clock, rule="a")
    assert all(d.allowed for d in spend(first, "c", 3))
    assert not first.allow("c").allowed
    got = spend(second, "b:c", 3)
    assert all(d.allowed for d in got)
    assert got[0].rule == "a"
    assert second.peek("c").remaining == 2  # same key, other rule: untouched
    assert len(storage) == 2


def test_same_rule_on_one_storage_shares_state(limiter_cls, backend, storage):
    clock = backend.FakeClock(1000.0)
    one = limiter_cls(3, 60.0, storage, clock, rule="api")
    two = limiter_cls(3, 60.0, storage, clock, rule="api")
    one.allow("k", 2)
    assert two.peek("k").remaining == 0
    assert two.allow("k").allowed
    assert not one.allow("k").allowed


def test_algorithms_on_one_storage_do_not_read_each_other(backend, storage):
    clock = backend.FakeClock(1000.0)
    limiters = [cls(2, 60.0, storage, clock, rule="api") for cls in backend.limiters.values()]
    for limiter in limiters:
        assert [d.allowed for d in spend(limiter, "k", 3)] == [True, True, False]
    assert len(storage) == len(limiters)


@pytest.mark.parametrize("window", [1.0, 0.1])
def test_backwards_clock_never_gives_budget_back(limiter_cls, backend, window):
    # Two limiters with one history; then one sees the clock step back several
    # windows. It must answer as if time had stood still at its latest time,
    # its durations told against the real clock (the lead added).
    clocks = [backend.FakeClock(1000.0), backend.FakeClock(1000.0)]
    limiters = [limiter_cls(5, window, clock=c) for c in clocks]
    for limiter, clock in zip(limiters, clocks):
        spend(limiter, "k", 3)
        clock.advance(window / 2)
        spend(limiter, "k", 1)
    latest = clocks[0].now()
    clocks[0].set(latest - 5 * window)
    lead = latest - clocks[0].now()  # as the storage computes it
    stepped, steady = limiters

    def told_from_the_clock(decision: Any) -> tuple[Any, ...]:
        return tuple(
            value + lead if name in ("retry_after", "reset_after", "delay") and value > 0 else value
            for name, value in zip(FIELDS, fields(decision))
        )

    assert fields(stepped.peek("k")) == told_from_the_clock(steady.peek("k"))
    for _ in range(6):
        assert fields(stepped.allow("k")) == told_from_the_clock(steady.allow("k"))
    assert stepped.state("k") == steady.state("k")
    assert stepped.state("k").updated_at == latest
    clocks[0].set(latest - 1000.0)
    assert not stepped.allow("k").allowed


def test_backward_step_after_exhaustion(limiter_cls, backend):
    clock = backend.FakeClock(1000.0)
    limiter = limiter_cls(5, 1.0, clock=clock)
    spend(limiter, "k", 5)
    for back in (0.5, 1.0, 3.0, 999.0):
        clock.set(1000.0 - back)
        assert not limiter.allow("k").allowed


# --------------------------------------------------------------------------
# Batches


def run_batches(limiter, clock, batches):
    out = []
    for t, keys, costs in batches:
        clock.set(t)
        out.extend(batch_fields(limiter.allow_many(keys, costs)))
    return out


def run_sequential(limiter, clock, batches):
    out = []
    for t, keys, costs in batches:
        clock.set(t)
        costs = [1] * len(keys) if costs is None else costs
        out.extend(fields(limiter.allow(k, c)) for k, c in zip(keys, costs))
    return out


BATCHES = [
    (1000.0, ["a", "b", "a", "a", "c", "a", "b", "a"], [1, 2, 1, 3, 1, 1, 2, 1]),
    (1000.0, ["a", "a"], None),
    (1000.3, ["b", "a", "b", "c"], [3, 1, 1, 5]),
    (1002.7, ["a", "a", "a", "a", "a", "a"], None),
    (1002.7, [], []),
]


def test_allow_many_equals_sequential_allow(limiter_cls, backend):
    clocks = [backend.FakeClock(0.0), backend.FakeClock(0.0)]
    batched = limiter_cls(5, 1.0, clock=clocks[0], rule="r")
    single = limiter_cls(5, 1.0, clock=clocks[1], rule="r")
    assert run_batches(batched, clocks[0], BATCHES) == run_sequential(single, clocks[1], BATCHES)
    for key in ("a", "b", "c"):
        assert batched.state(key) == single.state(key)


def test_allow_many_arrays(limiter_cls, backend):
    limiter = limiter_cls(3, 1.0, clock=backend.FakeClock(1000.0))
    result = limiter.allow_many(["k"] * 5, [1, 1, 1, 1, 2])
    assert len(result) == 5
    assert [bool(x) for x in result.allowed] == [True, True, True, False, False]
    assert list(result.remaining) == [2, 1, 0, 0, 0]
    assert list(result.retry_after)[:3] == [0.0, 0.0, 0.0]
    assert all(x > 0 for x in list(result.retry_after)[3:])
    assert list(result.reset_after) == [d.reset_after for d in result]
    assert list(result.delay) == [d.delay for d in result]
    assert result.allowed_count == 3


# --------------------------------------------------------------------------
# Storage


def test_storage_keys_len_and_evict_idle(backend, storage):
    clock = backend.FakeClock(10.0)
    limiter = backend.TokenBucket(5, 60.0, storage, clock, rule="api")
    limiter.allow("alice")
    clock.set(20.0)
    limiter.allow("bob")
    expected = {backend.storage_key(backend.Algorithm.TOKEN_BUCKET, "api", k) for k in ("alice", "bob")}
    assert len(storage) == 2
    assert sorted(storage.keys()) == sorted(expected)
    assert storage.evict_idle(15.0) == 1
    assert len(storage) == 1
    assert storage.keys() == [backend.storage_key(backend.Algorithm.TOKEN_BUCKET, "api", "bob")]
    assert limiter.state("alice") is None
    assert limiter.peek("alice").remaining == 4  # an evicted key starts afresh
    assert storage.evict_idle(20.0) == 0  # "untouched since": strictly before
    assert storage.evict_idle(20.5) == 1
    assert len(storage) == 0
    assert storage.keys() == []


def test_evict_idle_uses_monotonic_key_time(limiter_cls, backend, storage):
    clock = backend.FakeClock(100.0)
    limiter = limiter_cls(5, 1.0, storage, clock)
    limiter.allow("k")
    clock.set(50.0)  # a backward step: the key's time stays at 100
    limiter.allow("k")
    assert storage.evict_idle(75.0) == 0
    assert limiter.state("k").updated_at == 100.0
    assert storage.evict_idle(100.5) == 1


@pytest.mark.not_on_zone
def test_apply_runs_a_user_algorithm(backend, storage):
    seen = []

    def incr(state):
        seen.append(state)
        n = (state or 0) + 1
        return n, n

    assert storage.apply("hits", 1.0, incr) == 1
    assert storage.apply("hits", 2.0, incr) == 2
    assert seen == [None, 1]
    assert storage.apply("other", 2.0, incr) == 1
    assert len(storage) == 2
    assert sorted(storage.keys()) == ["hits", "other"]

    def boom(state):
        raise RuntimeError("mutate failed")

    with pytest.raises(RuntimeError, match="mutate failed"):
        storage.apply("hits", 3.0, boom)
    with pytest.raises(RuntimeError, match="mutate failed"):
        storage.apply("fresh", 3.0, boom)
    assert len(storage) == 2  # "fresh" was not created
    assert storage.apply("hits", 4.0, incr) == 3  # "hits" unchanged by the failure

    assert storage.apply("hits", 5.0, lambda s: (None, s)) == 3  # None forgets
    assert len(storage) == 1
    assert storage.apply("hits", 6.0, incr) == 1


@pytest.mark.not_on_zone
def test_apply_keys_are_apart_from_limiter_keys(backend, storage):
    limiter = backend.TokenBucket(5, 60.0, storage, backend.FakeClock(10.0))
    limiter.allow("hits")
    assert storage.apply("hits", 10.0, lambda s: (s, s)) is None
    assert limiter.peek("hits").remaining == 3


@pytest.mark.not_on_zone
def test_apply_eviction_and_backward_time(backend, storage):
    storage.apply("k", 10.0, lambda s: (1, None))
    storage.apply("k", 5.0, lambda s: (2, None))  # stamp stays at 10
    assert storage.evict_idle(8.0) == 0
    assert storage.evict_idle(10.5) == 1
    assert len(storage) == 0


def test_storage_satisfies_protocol(backend, storage):
    assert isinstance(storage, backend.Storage)
    assert isinstance(DictStorage(), backend.Storage)


OPS = [
    ("allow", "a", 1),
    ("allow", "a", 2),
    ("peek", "a", 2),
    ("allow", "b", 1),
    ("tick", None, 0.4),
    ("allow", "a", 3),
    ("allow", "a", 1),
    ("many", ("a", "b"), (1, 1)),
    ("reset", "b", None),
    ("peek", "b", 1),
    ("tick", None, 0.35),
    ("allow", "b", 2),
    ("allow", "a", 1),
]


def drive(limiter, clock, ops):
    out = []
    for op, key, arg in ops:
        if op == "tick":
            clock.advance(arg)
        elif op == "allow":
            out.append(fields(limiter.allow(key, arg)))
        elif op == "peek":
            out.append(fields(limiter.peek(key, arg)))
        elif op == "reset":
            out.append(limiter.reset(key))
        else:
            out.append(batch_fields(limiter.allow_many(list(key), list(arg))))
        out.append((limiter.state("a"), limiter.state("b")))
    return out


def test_limiter_on_a_user_storage(limiter_cls, backend):
    custom = DictStorage()
    clocks = [backend.FakeClock(1000.0), backend.FakeClock(1000.0)]
    on_custom = limiter_cls(4, 1.0, custom, clocks[0], rule="r")
    on_memory = limiter_cls(4, 1.0, backend.InMemoryStorage(), clocks[1], rule="r")
    assert on_custom.storage is custom
    assert drive(on_custom, clocks[0], OPS) == drive(on_memory, clocks[1], OPS)
    assert custom.calls > 0  # it really went through apply
    assert len(custom) == 2
    assert custom.evict_idle(clocks[0].now() + 1) == 2
    assert on_custom.state("a") is None
    assert on_custom.peek("a", 4).allowed


def test_rules_stay_apart_on_a_user_storage(limiter_cls, backend):
    custom = DictStorage()
    clock = backend.FakeClock(1000.0)
    first = limiter_cls(2, 60.0, custom, clock, rule="a:b")
    second = limiter_cls(2, 60.0, custom, clock, rule="a")
    spend(first, "c", 2)
    assert second.allow("b:c", 2).allowed
    assert len(custom) == 2


# --------------------------------------------------------------------------
# The limiter object


def test_limiter_properties(limiter_cls, algorithm, backend, storage, clock):
    limiter = limiter_cls(7, 30, storage, clock, rule="api")
    assert limiter.limit == 7
    assert limiter.capacity == 7
    assert limiter.window_seconds == 30.0
    assert isinstance(limiter.window_seconds, float)
    assert limiter.burst is None
    assert limiter.rule == "api"
    assert limiter.storage is storage
    assert limiter.clock is clock
    assert isinstance(limiter, backend.RateLimiter)
    for name in ("limit", "capacity", "window_seconds", "burst", "rule", "storage", "clock"):
        with pytest.raises(AttributeError):
            setattr(limiter, name, None)
    d = limiter.allow("k")
    assert isinstance(d, backend.Decision)
    assert (d.limit, d.rule, d.window) == (7, "api", 30.0)


@pytest.mark.not_on_zone
def test_limiter_defaults(limiter_cls, backend):
    limiter = limiter_cls(5, 60)
    assert isinstance(limiter.clock, backend.SystemClock)
    assert isinstance(limiter.storage, backend.InMemoryStorage)
    assert limiter.rule == ""
    assert limiter.allow("k").allowed
    assert limiter.state("k") is not None


def test_limiters_do_not_share_a_default_storage(limiter_cls, backend):
    clock = backend.FakeClock(1000.0)
    one = limiter_cls(1, 60.0, clock=clock)
    two = limiter_cls(1, 60.0, clock=clock)
    assert one.storage is not two.storage
    assert one.allow("k").allowed
    assert two.allow("k").allowed


def test_state_snapshot(limiter_cls, algorithm, backend):
    clock = backend.FakeClock(1000.0)
    limiter = limiter_cls(5, 1.0, clock=clock)
    assert limiter.state("k") is None
    limiter.allow("k", 2)
    state = limiter.state("k")
    assert isinstance(state, backend.LimiterState)
    assert state.algorithm == backend.Algorithm(algorithm)
    assert state.updated_at == 1000.0
    # Hand-derived per docs/spec.md §4 after one request of cost 2 at t = 1000.
    expected = {
        "token_bucket": {"level": 3.0},
        "leaky_bucket": {"level": 2.0},
        "fixed_window": {"window_index": 1000, "count": 2},
        "sliding_log": {"log": (1000.0, 1000.0)},
        "sliding_counter": {"window_index": 1000, "count": 2, "previous": 0},
        "gcra": {"tat": 1_000_000_000 + 2 * 200_000},
    }[algorithm]
    for name in ("level", "window_index", "count", "previous", "tat", "log"):
        assert getattr(state, name) == expected.get(name), name


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_counter"])
def test_window_index_is_an_integer_floor(limiter_cls, algorithm, backend):
    # 1.0 // 0.1 is 9.0 in float; the index is floor(1.0 / 0.1) = 10 (docs/spec.md §4, STYLE).
    limiter = limiter_cls(5, 0.1, clock=backend.FakeClock(1.0))
    limiter.allow("k")
    assert limiter.state("k").window_index == math.floor(1.0 / 0.1) == 10
