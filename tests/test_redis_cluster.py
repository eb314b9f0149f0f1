"""A three-master cluster on loopback (Redis 7 and Valkey 9): single
decisions and batches route to the node owning each key, scripts load on every
node, and compound limits on one identity run as one script on one slot."""

from __future__ import annotations

import types
from typing import Any

import pytest
from _helpers import fields

from nanolimit import reference
from nanolimit.errors import ValidationError
from nanolimit.storage.redis import RedisStorage

pytest_plugins = ["redis_servers"]  # the server fixtures


@pytest.fixture
def cluster(redis_cluster: Any) -> Any:
    return redis_cluster


@pytest.fixture
def storage(cluster: Any) -> Any:
    client = cluster.client()
    storage = RedisStorage(client, timeout=2.0, on_error="raise")
    yield storage
    storage.client.close()
    client.close()


def test_decisions_spread_over_the_nodes(backend: types.SimpleNamespace, storage: Any, cluster: Any) -> None:
    clock = backend.FakeClock(10.0)
    limiter = backend.GCRA(3, 10.0, storage, clock, rule="c")
    ref = reference.GCRA(3, 10.0, None, clock, rule="c")
    for i in range(60):
        key = f"user{i % 20}"
        assert fields(limiter.allow(key)) == fields(ref.allow(key))
    assert len(storage) == 20
    per_node = [server.client().dbsize() for server in cluster.nodes]
    assert sum(per_node) == 20 and sum(1 for n in per_node if n) == 3
    assert limiter.state("user3") == ref.state("user3")


@pytest.mark.parametrize("batch", ["script", "pipeline"])
@pytest.mark.parametrize("algorithm", ["token_bucket", "sliding_log", "sliding_counter"])
def test_allow_many_groups_by_node(
    backend: types.SimpleNamespace, cluster: Any, algorithm: str, batch: str
) -> None:
    storage = RedisStorage(cluster.client(), timeout=2.0, on_error="raise", batch=batch)
    clock = backend.FakeClock(10.0)
    limiter = backend.limiters[algorithm](2, 10.0, storage, clock, rule="m")
    ref = reference.LIMITERS[reference.Algorithm(algorithm)](2, 10.0, None, clock, rule="m")
    keys = [f"k{i % 13}" for i in range(50)] + ["same"] * 3
    got = limiter.allow_many(keys)
    want = ref.allow_many(keys)
    assert [fields(d) for d in got] == [fields(d) for d in want] and not got.degraded


def test_compound_on_one_identity(backend: types.SimpleNamespace, storage: Any) -> None:
    clock = backend.FakeClock(0.0)
    burst = backend.TokenBucket(3, 1.0, storage, clock, rule="burst")
    hourly = backend.SlidingWindowLog(4, 3600.0, storage, clock, rule="hourly")
    daily = backend.FixedWindowCounter(100, 86400.0, storage, clock, rule="daily")
    trio = [(burst, "alice"), (hourly, "alice"), (daily, "alice")]
    assert [storage.allow_all(trio).allowed for _ in range(4)] == [True, True, True, False]
    clock.advance(1.0)
    assert storage.allow_all(trio).allowed  # burst refilled, hourly has its 4th
    denied = storage.allow_all(trio)
    assert not denied.allowed and denied.denied_by == "hourly"
    assert daily.peek("alice").remaining == 95  # 4 charged; peek spends 1 more


def test_compound_across_identities_is_refused(backend: types.SimpleNamespace, storage: Any) -> None:
    """A global ceiling's key lives in its own slot: it cannot join a
    per-user compound in one script on a cluster — a clear error, not a
    CROSSSLOT from the server and not a silently split decision."""
    clock = backend.FakeClock(0.0)
    user = backend.TokenBucket(3, 1.0, storage, clock, rule="user")
    ceiling = backend.GCRA(1000, 1.0, storage, clock, rule="global")
    with pytest.raises(ValidationError, match="one slot"):
        storage.allow_all([(user, "alice"), (ceiling, "*")])
    assert len(storage) == 0


def test_script_flush_on_every_node(backend: types.SimpleNamespace, storage: Any) -> None:
    limiter = backend.LeakyBucket(5, 1.0, storage, backend.FakeClock(0.0), rule="f")
    keys = [f"k{i}" for i in range(10)]
    limiter.allow_many(keys)
    storage.client.script_flush()
    assert all(not d.degraded for d in [limiter.allow(k) for k in keys])
    storage.client.script_flush()
    result = limiter.allow_many(keys)
    assert not result.degraded and result.allowed_count == 10


def _node_client(cluster: Any, index: int) -> Any:
    return cluster.nodes[index].client(socket_timeout=5.0)


def test_a_slot_moving_loses_and_double_charges_nothing(backend: types.SimpleNamespace, cluster: Any) -> None:
    """A key's slot migrates to another master mid-run (IMPORTING/MIGRATING,
    MIGRATE, SETSLOT NODE): decisions follow it, its state moves with it, and
    no request is charged twice or lost (fail-open answers charge nothing)."""
    client = cluster.client()
    storage = RedisStorage(client, timeout=2.0, on_error="allow")
    clock = backend.FakeClock(50.0)
    limiter = backend.TokenBucket(6, 3600.0, storage, clock, rule="move")
    admitted = sum(limiter.allow("mover").allowed for _ in range(3))
    assert admitted == 3
    redis_key = storage.redis_key(limiter.config, "mover")
    slot = client.keyslot(redis_key)
    owner, target = cluster.migrate(slot)
    try:
        # mid-migration: the owner answers ASK, the script goes once to the
        # importing node after ASKING (loaded there first: it never ran it),
        # and the state it finds is the one moved
        asked = limiter.allow("mover")
        assert not asked.degraded and asked.allowed and asked.remaining == 2, asked
        admitted += 1
    finally:
        cluster.assign(slot, target)
    nodes = [_node_client(cluster, i) for i in range(len(cluster.nodes))]
    degraded = 0
    for _ in range(6):
        d = limiter.allow("mover")
        if d.degraded:
            degraded += 1  # a redirect the client had not learned yet: fail-open, charged nothing
        else:
            admitted += d.allowed
    assert admitted == 6  # exactly the capacity: the 3 spent before the move were not lost
    assert nodes[target].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) >= 1
    assert nodes[owner].execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    assert degraded <= 2
    for n in nodes:
        n.close()
    storage.client.close()
    client.close()


@pytest.mark.parametrize("batch", ["script", "pipeline"])
def test_a_batch_follows_ask_and_moved_mid_migration(
    backend: types.SimpleNamespace, cluster: Any, batch: str
) -> None:
    """``allow_many`` while a key's slot migrates: mid-migration the old
    owner answers ``ASK`` (the script did not run there) and the batch sends
    that key's calls once more to the importing node after ``ASKING``; after
    the move the client's stale map meets ``MOVED`` and the batch follows it.
    Every answer is Redis's own (``on_error="deny"`` would show a failure as
    a degraded denial), nothing is charged twice, and no breaker counts a
    redirect as a failure."""
    client = cluster.client()
    storage = RedisStorage(client, timeout=2.0, on_error="deny", batch=batch, breaker_threshold=1)
    limiter = backend.TokenBucket(8, 3600.0, storage, backend.FakeClock(50.0), rule="bmove")
    others = [f"o{i}" for i in range(12)]
    first = limiter.allow_many(["mover", *others])
    assert not first.degraded and first[0].remaining == 7
    slot = client.keyslot(storage.redis_key(limiter.config, "mover"))
    owner, target = cluster.migrate(slot)
    try:
        asked = limiter.allow_many(["mover", *others, "mover"])
        assert not asked.degraded, [d.reason for d in asked]
        assert (asked[0].remaining, asked[-1].remaining) == (6, 5)  # the moved state, charged once each
        assert all(d.remaining == 6 for d in asked[1:-1])
    finally:
        cluster.assign(slot, target)
    moved = limiter.allow_many(["mover", *others])
    assert not moved.degraded and moved[0].remaining == 4 and moved[1].remaining == 5
    nodes = storage.metrics()["nodes"]
    assert all(n["breaker_opened"] == 0 and n["breaker_state"] == "closed" for n in nodes.values()), nodes
    target_client = cluster.nodes[target].client(socket_timeout=5.0)
    owner_client = cluster.nodes[owner].client(socket_timeout=5.0)
    assert target_client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 1
    assert owner_client.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
    target_client.close()
    owner_client.close()
    storage.client.close()
    client.close()
