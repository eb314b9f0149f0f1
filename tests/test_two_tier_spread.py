"""A spread sync (docs/two_tier.md, Keeping the interval): when the keys
decided per interval are more than one sync covers in half the interval, a
key with room in its lease waits its turn, one sync of ``spread``, and the
others go with every sync. Through a real server, on both twins (the
native plan in C, the reference limiters' Python plan)."""

from __future__ import annotations

from typing import Any

import pytest

pytest_plugins = ["redis_servers"]

SLOW = 0.01  # seconds per key: the cost a sync of many keys on a slow link would measure
WINDOW = 600.0  # every test stays in one window


def tier_of(server: Any, instance_id: str) -> Any:
    from nanolimit.storage.two_tier import TwoTierStorage

    return TwoTierStorage(None, server.client(), instance_id=instance_id, sync_interval=0.05, start=False)


def held(server: Any, tier: Any, limiter: Any, key: str) -> tuple[int, int]:
    """(count, lease) Redis holds for ``tier`` in ``key``'s current window."""
    track = tier._tracks[(limiter.config, key)]
    name = f"{track.base}{int(limiter.clock.now() // WINDOW)}"
    fields = server.client().hgetall(name)
    ident = tier.instance_id.encode()
    return int(fields.get(ident, 0)), int(fields.get(b"lease:" + ident, 0))


def decided_once(backend: Any, tier: Any, prefix: str, n: int) -> tuple[Any, list[str]]:
    """A limiter of 1,000 a window on ``tier`` and ``n`` keys, each admitted once."""
    limiter = backend.FixedWindowCounter(1_000, WINDOW, storage=tier, clock=backend.FakeClock(6_000.0))
    keys = [f"{prefix}{i}" for i in range(n)]
    for key in keys:
        assert limiter.allow(key).allowed
    return limiter, keys


def background(tier: Any) -> dict[str, Any]:
    assert tier._sync(full=False, background=True)
    metrics: dict[str, Any] = tier.metrics()
    return metrics


def test_the_spread_keeps_one_sync_within_half_the_interval() -> None:
    from nanolimit.storage.two_tier import MAX_SPREAD

    class Probe:
        sync_interval = 0.05
        _cost_per_key = 10e-6

    from nanolimit.storage.two_tier._sync import _FleetSync

    probe: Any = Probe()
    assert _FleetSync._spread(probe, 1_000) == 1  # 10 ms of the 25 ms
    assert _FleetSync._spread(probe, 2_500) == 1
    assert _FleetSync._spread(probe, 5_000) == 2
    assert _FleetSync._spread(probe, 10_000) == 4
    assert _FleetSync._spread(probe, 50_000) == MAX_SPREAD  # 20 keys an interval would be 16
    probe._cost_per_key = 0.0  # nothing measured yet: every key, every sync
    assert _FleetSync._spread(probe, 50_000) == 1


def test_keys_with_room_wait_their_turn_and_each_goes_once(backend: Any, redis_server: Any) -> None:
    """64 keys decided again after a sync: the spread sync sends a key whose
    lease is more than half spent at once, and every other in its turn, each
    exactly once over ``spread`` syncs. Redis holds every key's whole ceiling
    meanwhile. A foreground sync (``sync_now``) defers nothing."""
    tier = tier_of(redis_server, "spread")
    try:
        limiter, keys = decided_once(backend, tier, "k", 64)
        assert limiter.allow("hot").allowed
        tier.sync_now()  # each key pushed, leased 999 and its next window claimed
        for key in keys:
            assert limiter.allow(key).allowed
        assert limiter.allow("hot", 600).allowed  # 600 of a 999 lease: more than half spent
        tier._cost_per_key = SLOW
        m = background(tier)
        assert m["sync_spread"] == 16 and m["keys_deferred_last"] > 0
        assert held(redis_server, tier, limiter, "hot")[0] == 601  # never deferred
        synced, deferred = m["keys_synced_last"], [m["keys_deferred_last"]]
        for _ in range(15):
            for key in keys:  # Redis holds all it may admit, pushed or not
                count, lease = held(redis_server, tier, limiter, key)
                assert count + lease >= 2
            m = background(tier)
            synced += m["keys_synced_last"]
            deferred.append(m["keys_deferred_last"])
        assert synced == 65  # every key once: 64 in their turns, "hot" in the first
        assert deferred[-1] == 0 and deferred == sorted(deferred, reverse=True)
        assert {held(redis_server, tier, limiter, key)[0] for key in keys} == {2}
        for key in keys:
            limiter.allow(key)
        assert tier.sync_now()
        assert tier.metrics()["keys_deferred_last"] == 0
        assert {held(redis_server, tier, limiter, key)[0] for key in keys} == {3}
    finally:
        tier.close()


def test_a_key_that_has_not_claimed_the_next_window_is_not_deferred(backend: Any, redis_server: Any) -> None:
    """The first sync of a key in a window claims its default share of the
    next: a key that has not made it goes with every sync, spread or not."""
    tier = tier_of(redis_server, "claims")
    try:
        decided_once(backend, tier, "c", 32)
        tier._cost_per_key = SLOW
        m = background(tier)  # their first sync: none was leased or claimed yet
        assert m["sync_spread"] == 16 and m["keys_deferred_last"] == 0 and m["keys_synced_last"] == 32
    finally:
        tier.close()


def test_a_spreading_instance_keeps_the_fleet_within_the_limit(backend: Any, redis_server: Any) -> None:
    """Two instances on 24 keys of limit 100, one of them spreading its
    syncs (a measured cost of 10 ms a key), each admitting 3 a key per
    round until the limit is spent: no key passes 100, Redis holds exactly
    what each admitted, and the spreading one did defer."""
    a, b = tier_of(redis_server, "a"), tier_of(redis_server, "b")
    try:
        clock = backend.FakeClock(6_000.0)
        on_a = backend.FixedWindowCounter(100, WINDOW, storage=a, clock=clock)
        on_b = backend.FixedWindowCounter(100, WINDOW, storage=b, clock=clock)
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
    finally:
        a.close()
        b.close()


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
