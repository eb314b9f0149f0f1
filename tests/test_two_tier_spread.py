"""A spread sync (docs/two_tier.md, Keeping the interval): when the keys
decided per interval are more than one sync covers in half the interval, a
key with room in its lease waits its turn, one sync of ``spread``, and the
others go with every sync. Through a real server, on both twins (the
native plan in C, the reference limiters' Python plan)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest

pytest_plugins = ["redis_servers"]

SLOW = 0.01  # seconds per key: the cost a sync of many keys on a slow link would measure
WINDOW = 600.0  # every test stays in one window


def tier_of(server: Any, instance_id: str) -> Any:
    from nanolimit.storage.two_tier import TwoTierStorage

    return TwoTierStorage(None, server.client(), instance_id=instance_id, sync_interval=0.05, start=False)


@contextmanager
def fleet_of_two(
    backend: Any, server: Any, algorithm: str = "FixedWindowCounter"
) -> Iterator[tuple[Any, Any, Any, Any]]:
    """Instances "a" and "b", each with a limiter of 100 a window on one
    fake clock; both closed after."""
    a, b = tier_of(server, "a"), tier_of(server, "b")
    try:
        clock = backend.FakeClock(6_000.0)
        on_a = getattr(backend, algorithm)(100, WINDOW, storage=a, clock=clock)
        on_b = getattr(backend, algorithm)(100, WINDOW, storage=b, clock=clock)
        yield a, b, on_a, on_b
    finally:
        a.close()
        b.close()


def held(server: Any, tier: Any, limiter: Any, key: str) -> tuple[int, int]:
    """(count, lease) Redis holds for ``tier`` in ``key``'s current window."""
    track = tier._tracks[(limiter.config, key)]
    # the track's window: a token bucket's is its capacity over its rate
    name = f"{track.base}{math.floor(limiter.clock.now() / track.window)}"
    fields = server.client().hgetall(name)
    ident = tier.instance_id.encode()
    return int(fields.get(ident, 0)), int(fields.get(b"lease:" + ident, 0))


def decided_once(
    backend: Any, tier: Any, prefix: str, n: int, algorithm: str = "FixedWindowCounter"
) -> tuple[Any, list[str]]:
    """A limiter of 1,000 a window on ``tier`` and ``n`` keys, each admitted once."""
    limiter = getattr(backend, algorithm)(1_000, WINDOW, storage=tier, clock=backend.FakeClock(6_000.0))
    keys = [f"{prefix}{i}" for i in range(n)]
    for key in keys:
        assert limiter.allow(key).allowed
    return limiter, keys


def background(tier: Any, slow: bool = True) -> dict[str, Any]:
    """One background sync; ``slow``: as if each key sent had cost ``SLOW``."""
    if slow:
        tier._cost_per_key = SLOW
    assert tier._sync(full=False, background=True)
    metrics: dict[str, Any] = tier.metrics()
    return metrics


def test_the_spread_keeps_one_sync_within_half_the_interval() -> None:
    from nanolimit.storage.two_tier import MAX_SPREAD

    class Probe:
        sync_interval = 0.05
        _cost_per_key = 10e-6
        _sync_floor = 0.0

    from nanolimit.storage.two_tier._sync import _FleetSync

    probe: Any = Probe()
    assert _FleetSync._spread(probe, 1_000) == 1  # 10 ms of the 25 ms
    assert _FleetSync._spread(probe, 2_500) == 1
    assert _FleetSync._spread(probe, 5_000) == 2
    assert _FleetSync._spread(probe, 10_000) == 4
    assert _FleetSync._spread(probe, 50_000) == MAX_SPREAD  # 20 keys an interval would be 16
    probe._sync_floor = 0.015  # a 15 ms round trip: 10 ms are left for keys
    assert _FleetSync._spread(probe, 2_500) == 4
    probe._sync_floor = 0.04  # longer than the budget: spread what keys add
    assert _FleetSync._spread(probe, 2_500) == 1
    probe._cost_per_key = 0.0  # nothing measured yet: every key, every sync
    assert _FleetSync._spread(probe, 50_000) == 1


def test_keys_with_room_wait_their_turn_and_each_goes_once(backend: Any, redis_server: Any) -> None:
    """64 keys decided again after a sync: the spread sync sends the keys
    whose lease is more than half spent at once, and every other in its
    turn, each exactly once over ``spread`` syncs. Redis holds every waiting
    key's whole ceiling (its count and the lease, 1,000) meanwhile. A
    foreground sync (``sync_now``) defers nothing."""
    tier = tier_of(redis_server, "spread")
    try:
        limiter, keys = decided_once(backend, tier, "k", 64)
        hot = [f"hot{i}" for i in range(8)]
        for key in hot:
            assert limiter.allow(key).allowed
        tier.sync_now()  # each key pushed, leased 999 and its next window claimed
        for key in keys:
            assert limiter.allow(key).allowed
        for key in hot:
            assert limiter.allow(key, 500).allowed  # 500 of a 999 lease: more than half spent
        m = background(tier)
        assert m["sync_spread"] == 16 and m["keys_deferred_last"] > 0
        assert {held(redis_server, tier, limiter, key)[0] for key in hot} == {501}  # none deferred
        synced = m["keys_synced_last"]
        waiting = [key for key in keys if held(redis_server, tier, limiter, key)[0] == 1]
        assert len(waiting) == m["keys_deferred_last"]
        for _ in range(15):
            for key in keys:  # Redis holds all it may admit, pushed or not
                assert sum(held(redis_server, tier, limiter, key)) >= 1_000
            m = background(tier)
            synced += m["keys_synced_last"]
        assert synced == 72  # every key once: 64 in their turns, the hot ones in the first
        assert m["keys_deferred_last"] == 0
        assert {held(redis_server, tier, limiter, key)[0] for key in keys} == {2}
        for key in keys:
            limiter.allow(key)
        assert tier.sync_now()
        assert tier.metrics()["keys_deferred_last"] == 0
        assert {held(redis_server, tier, limiter, key)[0] for key in keys} == {3}
    finally:
        tier.close()


@pytest.mark.parametrize("algorithm", ["SlidingWindowCounter", "TokenBucket"])
def test_a_sliding_key_waits_its_turn_once_its_past_window_is_settled(
    backend: Any, redis_server: Any, algorithm: str
) -> None:
    """A sliding key (a sliding counter, or a token bucket, which the two
    tiers keep as one) sends its past window too until that window's total
    has been read ``SETTLE_READS`` times, so it waits no turn before; from
    then on it waits its turn as a fixed-window key does: every key goes
    once over ``spread`` syncs, Redis holding its whole ceiling meanwhile.
    (It went with every sync before: 10,000 sliding keys were 10,000 keys
    a sync.)"""
    from nanolimit.storage.two_tier._records import SETTLE_READS

    tier = tier_of(redis_server, "sliding")
    try:
        limiter, keys = decided_once(backend, tier, "s", 64, algorithm)
        tier.sync_now()  # pushed, leased 999 and the next window claimed; the past window read once
        for _ in range(SETTLE_READS - 1):
            for key in keys:
                assert limiter.allow(key).allowed
            m = background(tier)
            assert m["sync_spread"] == 16 and m["keys_deferred_last"] == 0 and m["keys_synced_last"] == 64
        for key in keys:
            assert limiter.allow(key).allowed
        m = background(tier)
        assert m["sync_spread"] == 16 and m["keys_deferred_last"] > 0
        synced = m["keys_synced_last"]
        for _ in range(15):
            for key in keys:
                assert sum(held(redis_server, tier, limiter, key)) >= 1_000
            m = background(tier)
            synced += m["keys_synced_last"]
        assert synced == 64 and m["keys_deferred_last"] == 0
        assert {held(redis_server, tier, limiter, key)[0] for key in keys} == {SETTLE_READS + 1}
        # A full background sync sends a sliding key's settled past window
        # again (a late push lands in the estimate), in the key's turn: each
        # key once over the spread, not 64 keys in every full sync.
        for key in keys:
            assert limiter.allow(key).allowed
        tier._cost_per_key = SLOW
        assert tier._sync(full=True, background=True)
        m = tier.metrics()
        assert m["sync_spread"] == 16 and 0 < m["keys_synced_last"] < 64
        synced = m["keys_synced_last"]
        for _ in range(15):
            synced += background(tier)["keys_synced_last"]
        assert synced == 64
        assert {held(redis_server, tier, limiter, key)[0] for key in keys} == {SETTLE_READS + 2}
    finally:
        tier.close()


def test_a_key_that_has_not_claimed_the_next_window_is_not_deferred(backend: Any, redis_server: Any) -> None:
    """A sync of a key claims its default share of the next window: a key
    whose claim is not the share now (a key's first sync; a member joined,
    so the share halved) goes with every sync, spread or not."""
    tier, other = tier_of(redis_server, "claims"), tier_of(redis_server, "joins")
    try:
        limiter, keys = decided_once(backend, tier, "c", 32)
        m = background(tier)  # their first sync: none was leased or claimed yet
        assert m["sync_spread"] == 16 and m["keys_deferred_last"] == 0 and m["keys_synced_last"] == 32
        for key in keys:
            limiter.allow(key)
        assert background(tier)["keys_deferred_last"] > 0  # claimed, leased, room: most wait
        assert other.sync_now()  # a second member: the share is 500 from our next heartbeat
        background(tier)
        for key in keys:
            limiter.allow(key)
        m = background(tier)
        assert tier.instances == 2 and m["keys_deferred_last"] == 0 and m["keys_synced_last"] == 32
    finally:
        tier.close()
        other.close()


@pytest.mark.parametrize("algorithm", ["FixedWindowCounter", "SlidingWindowCounter", "TokenBucket"])
def test_a_spreading_instance_keeps_the_fleet_within_the_limit(
    backend: Any, redis_server: Any, algorithm: str
) -> None:
    """Two instances on 24 keys of limit 100, one of them spreading its
    syncs (a measured cost of 10 ms a key), each admitting 3 a key per
    round until the limit is spent: no key passes 100, Redis holds exactly
    what each admitted, and the spreading one did defer."""
    with fleet_of_two(backend, redis_server, algorithm) as (a, b, on_a, on_b):
        keys = [f"f{i}" for i in range(24)]
        for tier in (a, b, a, b):
            tier.sync_now()
        admitted = {key: [0, 0] for key in keys}
        deferred = 0
        for _ in range(40):
            for key in keys:
                for i, limiter in enumerate((on_a, on_b)):
                    admitted[key][i] += sum(limiter.allow(key).allowed for _ in range(3))
            a._cost_per_key = SLOW
            deferred += background(a)["keys_deferred_last"]
            assert b.sync_now()
        a.sync_now()
        b.sync_now()
        assert deferred > 0
        for key in keys:
            got_a, got_b = admitted[key]
            assert got_a + got_b <= 100, (key, got_a, got_b)
            assert got_a > 0 and got_b > 0
            assert held(redis_server, a, on_a, key)[0] == got_a
            assert held(redis_server, b, on_b, key)[0] == got_b


@pytest.mark.parametrize("leaving", [False, True])
def test_no_sync_that_must_rewrite_every_count_is_spread(
    backend: Any, redis_server: Any, leaving: bool
) -> None:
    """After a rejoin (the server lost our membership) every count is
    re-written, and close() hands every lease back: neither defers a key."""
    tier = tier_of(redis_server, "whole")
    try:
        limiter, keys = decided_once(backend, tier, "w", 32)
        tier.sync_now()
        for key in keys:
            limiter.allow(key)
        tier._cost_per_key = SLOW
        if leaving:
            tier._leaving = True
        else:
            tier._need_full = True
        m = background(tier)
        assert m["sync_spread"] == 1 and m["keys_deferred_last"] == 0
        assert {held(redis_server, tier, limiter, key)[0] for key in keys} == {2}
    finally:
        tier._leaving = False
        tier.close()


@pytest.mark.parametrize("algorithm", ["FixedWindowCounter", "SlidingWindowCounter", "TokenBucket"])
def test_a_restart_during_a_spread_sync_keeps_the_fleet_within_the_limit(
    backend: Any, redis_server: Any, algorithm: str
) -> None:
    """The server loses everything (a restart, a flush) just before a spread
    sync: the keys it left for their turn had their counts and leases
    dropped with it. From that reply on the instance admits nothing on the
    leases it held, and its next sync re-writes every count, spread or not;
    then the other instance's leases leave them out, and no key passes its
    limit (107 of 100 when the waiting keys kept deciding on the old lease
    until their turn)."""
    with fleet_of_two(backend, redis_server, algorithm) as (a, b, on_a, on_b):
        keys = [f"r{i}" for i in range(32)]
        for key in keys:
            assert on_b.allow(key).allowed
        for tier in (a, b, a, b):
            tier.sync_now()
        got = dict.fromkeys(keys, 0)
        for _ in range(8):
            for key in keys:
                got[key] += sum(on_a.allow(key).allowed for _ in range(15))
            a.sync_now()
            b.sync_now()
        for key in keys:
            got[key] += on_a.allow(key).allowed  # dirty again, with room in the lease
        redis_server.client().flushall()
        m = background(a)
        assert m["sync_spread"] == 16 and m["keys_deferred_last"] > 0 and m["rejoins"] == 1
        assert not any(on_a.allow(key).allowed for key in keys)  # no lease until the re-write
        m = background(a)  # the re-write: every key, not spread
        assert m["sync_spread"] == 1 and m["keys_deferred_last"] == 0 and m["keys_synced_last"] == 32
        assert {key: held(redis_server, a, on_a, key)[0] for key in keys} == got
        b.sync_now()
        b.sync_now()
        for key in keys:
            got_b = 1 + sum(on_b.allow(key).allowed for _ in range(100))
            got_a = got[key] + sum(on_a.allow(key).allowed for _ in range(100))
            assert got_a + got_b <= 100, (key, got_a, got_b)
