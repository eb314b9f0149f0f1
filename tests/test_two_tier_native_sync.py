"""The two-tier sync planned and applied in C (``LeaseBook.plan_step`` and
``apply``, docs/two_tier.md, Keeping the interval): a native limiter's
fixed-window keys are synced without their Python records, and must leave
Redis and every decision exactly as the Python plan does (the reference
limiters always take it)."""

from __future__ import annotations

import os
import random
from typing import Any

import pytest
from _helpers import cut_off_switch, from_window
from _helpers import two_tier_fleet as fleet

from nanolimit import FakeClock, reference
from nanolimit.storage.two_tier._records import SETTLE_READS

pytest_plugins = ["redis_servers"]
pytestmark = pytest.mark.native


# Heartbeats that outlive a slow run (valgrind): no member of either fleet
# goes silent on real time, which the two fleets would see at different steps.
SLOW_BEATS = {"sync_interval": 60.0, "heartbeat_ttl": 3600.0, "partition_grace": 3600.0}


# NANOLIMIT_SWEEP_SEEDS=0,1,...,99 runs a wider sweep by hand (each took 1-2 s)
SEEDS = [int(s) for s in os.environ.get("NANOLIMIT_SWEEP_SEEDS", "0,1,2,6,12,24,29,42").split(",")]


def redis_state(server: Any, prefix: str) -> dict[str, dict[bytes, bytes]]:
    """Every window hash a fleet wrote, by the part of its name after the prefix."""
    client = server.client()
    marker = f":{prefix}"
    out = {}
    for name in client.scan_iter(match=f"*{marker}*"):
        text = name.decode()
        if text.endswith(f"{prefix}instances"):
            continue
        head, _, tail = text.partition(marker)
        out[f"{head.rsplit(':', 1)[-1]}|{tail}"] = client.hgetall(name)
    return out


def native_keys(tier: Any) -> int:
    return sum(book.planned_keys for book in tier._books.values())


@pytest.mark.parametrize("algorithm", ["FixedWindowCounter", "SlidingWindowCounter", "TokenBucket"])
# 6, 12, 24 and 29 each found a difference once: a cost refused in a window
# C rolled away from asked a lease of the next one, and a key whose two
# windows were settled in two holds had the second overwritten from C; 42,
# that the Python plan kept re-reading a window two behind while it was the
# only one a key held
@pytest.mark.parametrize("seed", SEEDS)
def test_the_native_plan_leaves_redis_and_decisions_as_the_python_plan(
    native: Any, redis_server: Any, seed: int, algorithm: str
) -> None:
    """Two fleets of two on one server, one native (its keys synced in C),
    one reference (the Python plan), the same random trace over 40 keys:
    background and full syncs, tight limits (leases run out, wanted costs),
    window rollovers, a partition and a third member joining. Every decision
    agrees, and so do the window hashes in Redis, field for field. Sliding
    keys (a sliding counter, a token bucket) send the previous window's
    weighted units, and in a full sync that window too, from C as well."""
    rng = random.Random(seed)
    fast, slow = fleet(redis_server, "ns:", 3, **SLOW_BEATS), fleet(redis_server, "rs:", 3, **SLOW_BEATS)
    down = cut_off_switch((*fast, *slow))
    try:
        clock = FakeClock(5000.25)
        limit, window = rng.choice([(4, 1.0), (12, 2.0), (50, 1.0)])
        lf = [getattr(native, algorithm)(limit, window, storage=s, clock=clock) for s in fast]
        ls = [getattr(reference, algorithm)(limit, window, storage=s, clock=clock) for s in slow]
        for tiers in (fast, slow):
            for tier in tiers[:2] * 2:
                tier.sync_now()
        keys = [f"user:{i}" for i in range(40)]
        in_c = 0
        # a sliding key is planned in C once its previous window is read
        # SETTLE_READS times: windows turn over less often for them
        rollover = 0.04 if algorithm == "FixedWindowCounter" else 0.01
        cut_at = 0
        for step in range(600):
            if down[0] and step - cut_at > 150:
                down[0] = False  # a partition heals: the fleets sync in C again after it
            i = rng.randrange(2)
            op = rng.random()
            if op < 0.08:
                assert fast[i]._sync(full=False) == slow[i]._sync(full=False)
                in_c += native_keys(fast[i])
                assert fast[i].metrics()["keys_synced_last"] == slow[i].metrics()["keys_synced_last"]
            elif op < 0.10:
                assert fast[i].sync_now() == slow[i].sync_now()
            elif op < 0.105:
                fast[2].sync_now()  # the third member heartbeats: N and the shares change
                slow[2].sync_now()
            elif op < 0.11:
                down[0] = not down[0]
                cut_at = step
            elif op < 0.11 + rollover:
                clock.advance(rng.choice([0.05, window / 2, window]))
            else:
                key = rng.choice(keys)
                cost = rng.choice([1, 1, 1, 2, limit])
                method = "peek" if op < 0.2 else "allow"
                got = getattr(lf[i], method)(key, cost)
                want = getattr(ls[i], method)(key, cost)
                assert got == want, (step, method, key, cost, clock.now())
        down[0] = False
        for tiers in (fast, slow):
            for tier in (*tiers, *tiers):
                tier._sync(full=False)
        assert in_c > 0  # the C plan took part
        assert redis_state(redis_server, "ns:") == redis_state(redis_server, "rs:")
        for a, b in zip(fast, slow):
            ma, mb = a.metrics(), b.metrics()
            for name in ("decisions", "early_syncs", "units_pushed", "keys_tracked", "partitions"):
                assert ma[name] == mb[name], name
        # the windows a decision reads (the current one and the one before): which
        # older ones a track still holds differs, C dropping a settled window when
        # it rolls past it, the Python plan at the key's next sync (or, with no
        # units of ours there, never: a window only read)
        k = int(clock.now() // window)
        for key in keys:
            got = fast[0].fleet_counts(lf[0].config, key)
            assert from_window(got, k - 1) == from_window(slow[0].fleet_counts(ls[0].config, key), k - 1)
    finally:
        for tier in (*fast, *slow):
            tier.close(deregister=False)


@pytest.mark.parametrize("twin", ["native", "reference"])
def test_a_key_taken_over_by_python_during_the_round_trip_gets_its_answer(
    native: Any, redis_server: Any, twin: str
) -> None:
    """A key planned in C whose record Python takes over before the answer
    lands (a decision two windows on, on the Python path) gets the answer
    through the Python apply: the same counts and lease as the Python plan."""
    module = native if twin == "native" else reference
    (tier,) = fleet(redis_server, f"tk{twin}:", 1)
    try:
        clock = FakeClock(300.5)
        limiter = module.FixedWindowCounter(10, 1.0, storage=tier, clock=clock)
        limiter.allow("a", 2)
        tier.sync_now()
        limiter.allow("a", 3)  # in C on the native twin: 5 in window 300
        real = tier._exchange

        def exchange(*args: Any) -> Any:
            out = real(*args)
            tier.run_kernel(limiter.config, "a", 1, 302.5, True)  # the Python path, window 302
            return out

        tier._exchange = exchange  # type: ignore[method-assign]
        assert tier._sync(full=False)
        tier._exchange = real  # type: ignore[method-assign]
        assert tier.metrics()["keys_synced_last"] == 1
        if twin == "native":
            assert native_keys(tier) == 1  # planned in C, answered through Python
        assert tier.fleet_counts(limiter.config, "a") == {300: 5, 302: 1}
        track = tier._tracks[(limiter.config, "a")]
        assert track.pushed[300] == track.acked[300] == 5 and track.seen_total[300] == 5
        assert track.lease[300] == 5  # ceil((10 - 5) / 1)
        tier.sync_now()
        # window 300 pruned before the last sync (pushed, two behind): its lease stays
        # until it expires; 301 and 303 hold the claims of our default share
        assert redis_state(redis_server, f"tk{twin}:") == {
            "{a}|300": {b"i0": b"5", b"lease:i0": b"5"},
            "{a}|301": {b"lease:i0": b"10"},
            "{a}|302": {b"i0": b"1", b"lease:i0": b"9"},
            "{a}|303": {b"lease:i0": b"10"},
        }
    finally:
        tier.close()


def test_twenty_thousand_keys_in_one_native_sync(native: Any) -> None:
    """One background sync of 20,000 keys decided since the last one: all of
    them planned in C, every count in Redis, every lease back in the records
    (a second instance then sees the fleet totals). Redis only: the C side
    is the same for Valkey, which the other tests here cover."""
    from redis_servers import shared_server

    redis_server = shared_server("redis")
    first, second = fleet(redis_server, "tt20:", 2)
    try:
        clock = FakeClock(7200.5)
        limiter = native.FixedWindowCounter(100, 3600.0, storage=first, clock=clock)
        keys = [f"k{i}" for i in range(20_000)]
        for key in keys:
            limiter.allow(key)
        first.sync_now()
        for n, key in enumerate(keys):
            limiter.allow(key, 1 + n % 3)
        assert first._sync(full=False)
        assert first.metrics()["keys_synced_last"] == native_keys(first) == 20_000
        client = redis_server.client()
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.hmget(first._tracks[(limiter.config, key)].base + "2", "i0", "lease:i0")
        counts = pipe.execute()
        # count 1 + (1..3); a lease of what remains (N = 1 then), held for us
        assert counts == [[str(2 + n % 3).encode(), str(98 - n % 3).encode()] for n in range(20_000)]
        for n, key in enumerate(keys[:500]):
            assert first.fleet_counts(limiter.config, key) == {2: 2 + n % 3}
        other = native.FixedWindowCounter(100, 3600.0, storage=second, clock=clock)
        other.allow("k7")
        second.sync_now()
        assert second.fleet_counts(other.config, "k7") == {2: 4}  # 3 from the first instance
        assert first.metrics()["decisions"] == 40_000
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize("algorithm", ["SlidingWindowCounter", "TokenBucket"])
def test_sliding_keys_are_planned_in_c_in_background_and_full_syncs(native: Any, algorithm: str) -> None:
    """Once a sliding key's previous window is read often enough, its
    background syncs send its current window alone and its full syncs the
    previous one too, both planned in C (they took the Python plan, ~13 us a
    key: 50,000 sliding keys stalled the syncs). What a full sync reads of
    the previous window again (a late push) reaches the estimate."""
    from redis_servers import shared_server

    redis_server = shared_server("redis")
    (tier,) = fleet(redis_server, f"tts{algorithm[0]}:", 1)
    try:
        clock = FakeClock(7200.5)
        limiter = getattr(native, algorithm)(100, 3600.0, storage=tier, clock=clock)
        keys = [f"k{i}" for i in range(5_000)]
        for key in keys:
            limiter.allow(key)
        for _ in range(3):  # the previous window (hour 1) read SETTLE_READS times
            tier.sync_now()
        for n, key in enumerate(keys):
            limiter.allow(key, 1 + n % 3)
        assert tier._sync(full=False)
        assert tier.metrics()["keys_synced_last"] == native_keys(tier) == 5_000
        base = tier._tracks[(limiter.config, "k4")].base
        client = redis_server.client()
        client.hset(base + "1", "late", 7)  # another member's push to hour 1, after it settled
        limiter.allow("k4")
        assert tier._sync(full=False)  # hour 2 alone: the late units are not seen yet
        assert limiter.peek("k4", 96).allowed  # 4 + 96: the limit, and within the ceiling
        assert tier.sync_now()  # full: hours 1 and 2, 5,000 keys, all in C
        assert tier.metrics()["keys_synced_last"] == native_keys(tier) == 5_000
        instance = tier.instance_id.encode()
        assert client.hgetall(base + "1") == {instance: b"0", b"lease:" + instance: b"0", b"late": b"7"}
        assert client.hgetall(base + "2")[instance] == b"4"
        # hour 1's 7 units, weighed (0.99986), in the estimate and in the lease
        assert not limiter.peek("k4", 90).allowed
        assert limiter.allow("k4", 89).allowed and not limiter.allow("k4").allowed
        assert tier.fleet_counts(limiter.config, "k4") == {1: 7, 2: 93}
    finally:
        tier.close()


@pytest.mark.parametrize("algorithm", ["FixedWindowCounter", "SlidingWindowCounter", "TokenBucket"])
def test_a_window_boundary_keeps_every_key_on_the_c_plan(native: Any, algorithm: str) -> None:
    """C rolls a planned key into its next window and syncs the window it
    left from there: every decision and every sync after a boundary stays in
    C (before, each key took the Python plan, ~20-50 us, for the three syncs
    after every boundary: 0.7-0.9 s a sync at 20,000 keys). The window left
    goes while it is needed, no longer: a fixed key's until the units
    admitted after its last sync there are pushed, a sliding key's until its
    total (the estimate's previous window) is read SETTLE_READS times."""
    from redis_servers import shared_server

    redis_server = shared_server("redis")
    (tier,) = fleet(redis_server, f"twb{algorithm[0]}:", 1)
    try:
        clock = FakeClock(7200.5)
        limiter = getattr(native, algorithm)(100, 10.0, storage=tier, clock=clock)  # a bucket: 100 / 10 s
        keys = [f"k{i}" for i in range(300)]
        for key in keys:
            limiter.allow(key)
        for _ in range(4):  # every key fast, the window before its first settled
            tier.sync_now()
        for key in keys:
            limiter.allow(key, 2)  # 3 in window k, 2 of them not yet pushed
        k = int(clock.now() // 10.0)
        clock.advance(10.0)
        client = redis_server.client()
        base = tier._tracks[(limiter.config, "k7")].base
        held = b"lease:" + tier.instance_id.encode()
        reads = 1 if algorithm == "FixedWindowCounter" else SETTLE_READS  # C keeps its own copy
        native_before = tier.metrics()["decisions_native"]
        for sync in range(5):
            for key in keys:
                assert limiter.allow(key).allowed
            client.hset(base + str(k), held, 77)  # a send of window k writes 0 over it
            assert tier._sync(full=False)
            assert tier.metrics()["keys_synced_last"] == native_keys(tier) == len(keys), sync
            assert (client.hget(base + str(k), held) == b"0") is (sync < reads), sync
        assert tier.metrics()["decisions_native"] - native_before == 5 * len(keys)
        assert client.hget(base + str(k), tier.instance_id) == b"3"  # the 2 left unpushed reached Redis
        assert tier.fleet_counts(limiter.config, "k7") == {k: 3, k + 1: 5}
    finally:
        tier.close()


@pytest.mark.parametrize("algorithm", ["FixedWindowCounter", "SlidingWindowCounter"])
def test_a_key_back_after_idle_windows_is_decided_and_synced_in_c(native: Any, algorithm: str) -> None:
    """A planned key decided again windows later (idle meanwhile) moves
    there in C once its units are pushed: the windows it skipped saw none
    of ours, and no estimate reads the one it left. Before, such a key took
    the Python path and plan, and at 50,000 keys on 1 s windows, syncs
    longer than a window kept every key there. With units not yet pushed it
    still takes the Python path, which sends them."""
    from redis_servers import shared_server

    redis_server = shared_server("redis")
    (tier,) = fleet(redis_server, f"twi{algorithm[0]}:", 1)
    try:
        clock = FakeClock(7200.5)
        limiter = getattr(native, algorithm)(100, 10.0, storage=tier, clock=clock)
        for key in ("pushed", "unpushed"):
            limiter.allow(key, 4)
        for _ in range(4):
            tier.sync_now()
        limiter.allow("unpushed", 3)  # 7 in window k, 3 not yet pushed
        k = int(clock.now() // 10.0)
        clock.advance(30.0)  # windows k + 1 and k + 2 skipped
        decided = tier.metrics()["decisions_native"]
        assert limiter.allow("pushed", 5).remaining == 95  # k + 2 saw none of our units
        assert tier.metrics()["decisions_native"] == decided + 1
        assert limiter.allow("unpushed").allowed
        assert tier.metrics()["decisions_native"] == decided + 1  # the Python path: 3 units to push
        assert tier._sync(full=False)
        assert tier.metrics()["keys_synced_last"] == 2 and native_keys(tier) == 1
        client = redis_server.client()
        base = tier._tracks[(limiter.config, "unpushed")].base
        assert client.hget(base + str(k), tier.instance_id) == b"7"
        assert tier.fleet_counts(limiter.config, "pushed") == (
            {k + 2: 0, k + 3: 5} if algorithm == "SlidingWindowCounter" else {k + 3: 5}
        )
    finally:
        tier.close()


def test_the_native_plan_over_a_valkey_py_client(native: Any, redis_server: Any) -> None:
    """valkey-py's pool wants a command name where redis-py's wants none: the
    native calls go over either client's connection."""
    import valkey

    from nanolimit.storage.two_tier import TwoTierStorage

    tier = TwoTierStorage(
        None, valkey.Valkey(host="127.0.0.1", port=redis_server.port), instance_id="vk", start=False
    )
    try:
        limiter = native.FixedWindowCounter(100, 3600.0, storage=tier, clock=FakeClock(7200.5))
        limiter.allow("a")
        tier.sync_now()
        limiter.allow("a", 2)
        assert tier._sync(full=False) and native_keys(tier) == 1
        base = tier._tracks[(limiter.config, "a")].base
        assert redis_server.client().hgetall(base + "2") == {b"vk": b"3", b"lease:vk": b"97"}
    finally:
        tier.close()
