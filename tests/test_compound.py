"""Compound limits on the in-memory store: all-or-nothing across limiters
(docs/spec.md §6), for both twins."""

from __future__ import annotations

import math
import threading
import types

import pytest
from _helpers import rounds
from hypothesis import given, settings
from hypothesis import strategies as st

# The shared-memory zone runs this suite too (conftest.py, the zone backend).
ZONE_SUITE = True


def _three(backend: types.SimpleNamespace, clock):
    storage = backend.InMemoryStorage()
    per_user = backend.TokenBucket(5, 60.0, storage, clock, rule="orders-user")
    per_ip = backend.FixedWindowCounter(3, 60.0, storage, clock, rule="all-ip")
    ceiling = backend.GCRA(100, 60.0, storage, clock, rule="global")
    return storage, per_user, per_ip, ceiling


def test_denial_by_the_last_rule_charges_nobody(backend) -> None:
    clock = backend.FakeClock(0.0)
    storage, per_user, per_ip, ceiling = _three(backend, clock)
    for _ in range(3):
        result = storage.allow_all([(per_user, "u1"), (ceiling, "*"), (per_ip, "10.0.0.1")])
        assert result.allowed
    before = [per_user.state("u1"), ceiling.state("*"), per_ip.state("10.0.0.1")]
    denied = storage.allow_all([(per_user, "u1"), (ceiling, "*"), (per_ip, "10.0.0.1")])
    assert not denied.allowed
    assert denied.denied_by == "all-ip"
    assert denied.rule == "all-ip"
    assert denied.retry_after == pytest.approx(60.0)
    assert [d.allowed for d in denied.decisions] == [True, True, False]
    # nothing was spent by the denied request (time did not move either)
    assert [per_user.state("u1"), ceiling.state("*"), per_ip.state("10.0.0.1")] == before
    assert per_user.peek("u1").remaining == 1  # 2 tokens left, peek spends 1


def test_allowed_compound_charges_every_rule_with_its_cost(backend) -> None:
    clock = backend.FakeClock(10.0)
    storage, per_user, per_ip, ceiling = _three(backend, clock)
    result = storage.allow_all([(per_user, "u1", 2), (per_ip, "ip", 1), (ceiling, "*", 3)])
    assert result.allowed and result.denied_by is None
    assert [d.remaining for d in result.decisions] == [3, 2, 97]
    assert result.remaining == 2 and result.limit == 3 and result.rule == "all-ip"
    headers = result.headers(wall_now=1000.0)
    assert headers["X-RateLimit-Remaining"] == "2"
    assert headers["X-RateLimit-Limit"] == "3"
    assert "Retry-After" not in headers


def test_denied_headers_use_the_longest_retry(backend) -> None:
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage()
    fast = backend.TokenBucket(1, 1.0, storage, clock, rule="fast")
    slow = backend.TokenBucket(1, 30.0, storage, clock, rule="slow")
    assert storage.allow_all([(fast, "k"), (slow, "k")]).allowed
    denied = storage.allow_all([(fast, "k"), (slow, "k")])
    assert not denied.allowed
    assert denied.denied_by == "slow"
    assert denied.retry_after == pytest.approx(30.0)
    assert denied.headers(wall_now=0.0)["Retry-After"] == "30"


def test_denied_headers_describe_one_rule(backend) -> None:
    # Both spent: "fast" (10 per 1 s) comes first, "slow" (2 per 100 s) has
    # the longer wait. The headers must name one rule with that rule's own
    # quota, window and reset, never a mix.
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage()
    fast = backend.TokenBucket(10, 1.0, storage, clock, rule="fast")
    slow = backend.TokenBucket(2, 100.0, storage, clock, rule="slow")
    for _ in range(2):
        assert storage.allow_all([(fast, "k", 5), (slow, "k")]).allowed
    denied = storage.allow_all([(fast, "k", 3), (slow, "k")])  # both at 0 remaining
    assert not denied.allowed and denied.denied_by == "slow"
    by_rule = {d.rule: d for d in denied.decisions}
    assert (denied.rule, denied.limit, denied.window) == ("slow", 2, 100.0)
    assert denied.remaining == by_rule["slow"].remaining
    headers = denied.headers(wall_now=1000.0)
    assert headers["RateLimit-Policy"] == '"slow";q=2;w=100'
    assert headers["X-RateLimit-Limit"] == "2"
    assert headers["X-RateLimit-Remaining"] == str(by_rule["slow"].remaining)
    slow_left, slow_reset = by_rule["slow"].remaining, math.ceil(by_rule["slow"].reset_after)
    assert headers["RateLimit"] == f'"slow";r={slow_left};t={slow_reset}'
    assert headers["Retry-After"] == "50"


def test_compound_input_validation_changes_nothing(backend) -> None:
    clock = backend.FakeClock(0.0)
    storage, per_user, per_ip, _ = _three(backend, clock)
    other = backend.TokenBucket(5, 60.0, backend.InMemoryStorage(), clock, rule="elsewhere")
    with pytest.raises(backend.ValidationError):
        storage.allow_all([])
    with pytest.raises(backend.ValidationError):
        storage.allow_all([(per_user, "u1"), (other, "u1")])
    with pytest.raises(backend.ValidationError):
        storage.allow_all([(per_user, "u1"), (per_ip, "ip", 0)])
    with pytest.raises(backend.ValidationError):
        storage.allow_all([(per_user, "u1"), (per_ip, 42)])
    with pytest.raises(backend.ValidationError):
        storage.allow_all([(per_user, "u1"), (per_user, "u1")])
    with pytest.raises(backend.ValidationError):
        storage.allow_all(["not a tuple"])
    assert len(storage) == 0


def test_compound_under_eight_threads(backend) -> None:
    clock = backend.FakeClock(0.0)
    storage = backend.InMemoryStorage(stripes=4)
    a = backend.SlidingWindowLog(50, 60.0, storage, clock, rule="a")
    b = backend.FixedWindowCounter(80, 60.0, storage, clock, rule="b")
    counts = [0] * 8
    barrier = threading.Barrier(8)

    def work(slot: int) -> None:
        barrier.wait()
        for i in range(100):
            # b is shared by everyone; a by pairs of threads
            if storage.allow_all([(b, "shared"), (a, f"pair{slot // 2}")]).allowed:
                counts[slot] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive(), "compound decision deadlocked"
    assert sum(counts) == 80  # b's ceiling, never exceeded
    assert b.state("shared").count == 80
    # every admitted request charged a as well, and nothing else did
    assert sum(len(a.state(f"pair{p}").log or ()) for p in range(4) if a.state(f"pair{p}")) == 80


@settings(max_examples=rounds(60, 15), deadline=None)
@given(
    st.lists(
        st.tuples(st.sets(st.integers(0, 2), min_size=1), st.integers(1, 3), st.floats(0, 2.0)),
        min_size=1,
        max_size=40,
    )
)
def test_no_rule_is_charged_for_a_denied_request(backend, trace) -> None:
    """Replaying the trace against standalone limiters that are only asked
    when the compound request passed gives the same states: a denied compound
    request never charged anything."""
    clock = backend.FakeClock(100.0)
    storage = backend.InMemoryStorage()
    shadow_clock = backend.FakeClock(100.0)
    specs = [(backend.TokenBucket, 4, 1.0), (backend.FixedWindowCounter, 5, 2.0), (backend.GCRA, 3, 1.0)]
    limiters = [
        cls(limit, window, storage, clock, rule=f"r{i}") for i, (cls, limit, window) in enumerate(specs)
    ]
    shadows = [
        cls(limit, window, None, shadow_clock, rule=f"r{i}") for i, (cls, limit, window) in enumerate(specs)
    ]
    for chosen, cost, dt in trace:
        clock.advance(dt)
        shadow_clock.advance(dt)
        picked = sorted(chosen)
        result = storage.allow_all([(limiters[i], "k", cost) for i in picked])
        would = [shadows[i].peek("k", cost).allowed for i in picked]
        assert result.allowed == all(would)
        if result.allowed:
            for i in picked:
                assert shadows[i].allow("k", cost).allowed
        for i in picked:
            assert limiters[i].peek("k").remaining == shadows[i].peek("k").remaining
