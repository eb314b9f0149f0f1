"""A cluster master SIGKILLed mid-run (Redis 7 and Valkey 9, with
``cluster-require-full-coverage`` on and off): a dead node costs only its own
keys, and never more than the timeout (docs/redis.md, "Cluster failures").

- keys on the other masters keep exact answers from Redis (with full
  coverage on, until the cluster itself marks the node failed and refuses
  every slot: then they are answered by policy too, never wrongly);
- the dead node's keys are answered by policy, and its breaker opens;
- no decision takes longer than its timeout plus a margin, on redis-py's
  ``RedisCluster``, valkey-py's ``ValkeyCluster`` and redis-py's asyncio one;
- ``on_error="local"`` gives the dead node's keys one share per outage,
  under traffic mixed with a live node's key.

Each test starts a cluster of its own (a master is killed in it).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis_servers import HOST, Cluster, require_binary

from nanolimit import FakeClock, reference
from nanolimit.storage.redis import REASON_STORE_UNAVAILABLE_LOCAL, AsyncRedisStorage, RedisStorage

pytest_plugins = ["redis_servers"]  # the server fixtures
# decisions here are bounded in wall time: a full collection of the test
# run's heap must not be what they measure (conftest.steady_heap)
pytestmark = pytest.mark.usefixtures("steady_heap")

TIMEOUT = 0.05
MARGIN = 0.1  # a correctness bound on a loaded 2-core box, not a speed benchmark
BIG = 1_000_000  # the live key's limit: every Redis answer is one unit less than the last
SHARE_LIMIT, INSTANCES = 10, 2  # the dead key's limit, and the local share: 5 of 10
OUTAGE = 4.0  # past the 2 s node timeout: with full coverage on, the cluster goes to "fail"
EARLY = 1.2  # well before the cluster can mark the node failed (node timeout 2 s)


@pytest.fixture(params=["yes", "no"], ids=["full-coverage", "partial-coverage"])
def coverage(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def dying_cluster(server_kind: str, coverage: str) -> Iterator[Cluster]:
    cluster = Cluster(require_binary(server_kind), server_kind)
    for node in cluster.nodes:
        node.extra = (*node.extra, "--cluster-require-full-coverage", coverage)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _key_on(storage: Any, limiter: Any, port: int, stem: str) -> str:
    """A limiter key whose slot lives on the master listening on ``port``."""
    for i in range(10_000):
        key = f"{stem}{i}"
        node = storage._route(storage.redis_key(limiter.config, key))[1]
        if node is not None and int(node.port) == port:
            return key
    raise AssertionError(f"no key on port {port}")


def _valkey_client(cluster: Cluster) -> Any:
    valkey_cluster = pytest.importorskip("valkey.cluster")
    return valkey_cluster.ValkeyCluster(
        startup_nodes=[valkey_cluster.ClusterNode(HOST, cluster.nodes[1].port)], socket_timeout=5.0
    )


class _Side:
    """One storage in the run: its limiters, its keys, what it answered."""

    def __init__(self, name: str, storage: Any, dead_port: int, live_port: int) -> None:
        self.name = name
        self.storage = storage
        clock = FakeClock(1_000_000.0)  # one window for the whole run
        self.live = reference.FixedWindowCounter(BIG, 3600.0, storage=storage, clock=clock, rule="live")
        self.dead = reference.FixedWindowCounter(
            SHARE_LIMIT, 3600.0, storage=storage, clock=clock, rule="dead"
        )
        self.live_key = _key_on(storage, self.live, live_port, "live")
        self.dead_key = _key_on(storage, self.dead, dead_port, "dead")
        self.charged = 0  # units Redis charged the live key, as its answers said
        self.uncertain = 0  # live decisions answered by policy: a timed-out one may have been charged
        self.times: list[float] = []

    def decide(self, limiter: Any, key: str) -> Any:
        start = time.monotonic()
        d = limiter.allow(key)
        self.times.append(time.monotonic() - start)
        return d

    def live_step(self, must_answer: bool) -> Any:
        """One decision of the live key: exact from Redis. ``must_answer``:
        the cluster serves the live slots, so only a timeout (a loaded box
        missing the 50 ms) may answer it by policy."""
        timeouts = self.storage.metrics()["timeouts"]
        d = self.decide(self.live, self.live_key)
        if d.degraded:
            if must_answer:
                assert self.storage.metrics()["timeouts"] > timeouts, (self.name, d)
            self.uncertain += 1
        else:
            self.charged += 1
            low, high = BIG - self.charged - self.uncertain, BIG - self.charged
            assert d.allowed and low <= d.remaining <= high, (self.name, d, low, high)  # exact
        return d


def test_a_dead_master_costs_only_its_own_keys(dying_cluster: Cluster, coverage: str) -> None:
    cluster = dying_cluster
    dead, live = cluster.nodes[0], cluster.nodes[1]
    made = [cluster.client(), cluster.client()]
    kwargs: dict[str, Any] = {"timeout": TIMEOUT, "breaker_threshold": 3, "breaker_cooldown": 0.2}
    sides = [
        _Side("allow", RedisStorage(made[0], on_error="allow", prefix="a:", **kwargs), dead.port, live.port),
        _Side(
            "local",
            RedisStorage(made[1], on_error="local", local_instances=INSTANCES, prefix="l:", **kwargs),
            dead.port,
            live.port,
        ),
    ]
    try:
        made.append(_valkey_client(cluster))
        sides.append(
            _Side(
                "valkey-py",
                RedisStorage(made[-1], on_error="allow", prefix="v:", **kwargs),
                dead.port,
                live.port,
            )
        )
    except pytest.skip.Exception:
        pass
    for side in sides:  # healthy: every answer from Redis
        side.live_step(True)
        assert not side.dead.peek(side.dead_key).degraded
    dead.kill()
    killed = time.monotonic()
    local_admitted = 0
    while time.monotonic() - killed < OUTAGE:
        for side in sides:
            # the cluster still serves the live slots (with full coverage on,
            # until it marks the dead node failed: then it refuses them too)
            side.live_step(coverage == "no" or time.monotonic() - killed < EARLY)
            d = side.decide(side.dead, side.dead_key)
            assert d.degraded, (side.name, d)
            if side.name == "local":
                assert d.reason == REASON_STORE_UNAVAILABLE_LOCAL
                local_admitted += d.allowed
    for side in sides:
        assert side.charged > 100, (side.name, side.charged)
    dead_name = f"{HOST}:{dead.port}"
    for side in sides:
        worst = max(side.times)
        assert worst <= TIMEOUT + MARGIN, (side.name, worst)
        m = side.storage.metrics()
        assert m["nodes"][dead_name]["breaker_opened"] >= 1, (side.name, m)
        assert m["nodes"][dead_name]["breaker_state"] in ("open", "half-open")
        assert m["breaker_state"] in ("open", "half-open") and m["breakers_open"] >= 1
        assert m["breaker_open_skips"] > 0
        if coverage == "no":
            live_name = f"{HOST}:{live.port}"
            assert m["nodes"][live_name]["breaker_opened"] == 0
            assert m["breakers_open"] == 1
        # the breaker spares the dead node: most of its decisions made no round trip
        assert m["breaker_open_skips"] > m["errors"], (side.name, m)
    # one outage, one share: not a fresh share at each of the live key's answers
    assert local_admitted == SHARE_LIMIT // INSTANCES
    local_m = sides[1].storage.metrics()
    if coverage == "no":
        assert local_m["local_episodes"] == 1 and local_m["local_active"] == 1
    for side in sides:
        side.storage.close()
    for client in made:
        client.close()


def test_async_cluster_a_dead_master_costs_only_its_own_keys(dying_cluster: Cluster, coverage: str) -> None:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    cluster = dying_cluster
    dead, live = cluster.nodes[0], cluster.nodes[1]

    async def main() -> None:
        user = RedisCluster(startup_nodes=[ClusterNode(HOST, live.port)])
        storage = AsyncRedisStorage(
            user,
            timeout=TIMEOUT,
            on_error="local",
            local_instances=INSTANCES,
            breaker_threshold=3,
            breaker_cooldown=0.2,
        )
        clock = FakeClock(1_000_000.0)
        live_limiter = reference.FixedWindowCounter(BIG, 3600.0, storage=storage, clock=clock, rule="live")
        dead_limiter = reference.FixedWindowCounter(
            SHARE_LIMIT, 3600.0, storage=storage, clock=clock, rule="dead"
        )
        assert not (await live_limiter.allow_async("warm")).degraded  # the slot map is learnt
        live_key = _key_on(storage, live_limiter, live.port, "live")
        dead_key = _key_on(storage, dead_limiter, dead.port, "dead")
        charged = uncertain = 0
        times: list[float] = []
        admitted = 0
        dead.kill()
        killed = time.monotonic()
        while time.monotonic() - killed < 2.5:
            timeouts = storage.metrics()["timeouts"]
            start = time.monotonic()
            d = await live_limiter.allow_async(live_key)
            times.append(time.monotonic() - start)
            if not d.degraded:
                charged += 1
                assert BIG - charged - uncertain <= d.remaining <= BIG - charged
            else:
                if time.monotonic() - killed < EARLY or coverage == "no":  # only a timeout may
                    assert storage.metrics()["timeouts"] > timeouts, d
                uncertain += 1
            start = time.monotonic()
            d = await dead_limiter.allow_async(dead_key)
            times.append(time.monotonic() - start)
            assert d.degraded and d.reason == REASON_STORE_UNAVAILABLE_LOCAL
            admitted += d.allowed
        assert max(times) <= TIMEOUT + MARGIN, max(times)
        assert admitted == SHARE_LIMIT // INSTANCES
        m = storage.metrics()
        assert m["nodes"][f"{HOST}:{dead.port}"]["breaker_opened"] >= 1
        assert m["breaker_open_skips"] > m["errors"]
        batch = await storage.run_kernel_many_async(
            live_limiter.config, [live_key, dead_key], [1, 1], clock.now()
        )
        assert batch[1][5]  # the dead node's key: by policy, no round trip
        if coverage == "no" and not batch[0][5]:
            assert BIG - charged - uncertain - 1 <= batch[0][1] <= BIG - charged - 1
        await storage.close()
        await user.aclose()

    asyncio.run(main())


@contextlib.contextmanager
def frozen_cluster() -> Iterator[Cluster]:
    """A real three-master cluster with every node SIGSTOPped, so an asyncio
    client's first slot map gets no answer; thawed and stopped at the end."""
    cluster = Cluster(require_binary("redis"), "redis")
    cluster.start()
    try:
        for node in cluster.nodes:
            assert node.proc is not None
            node.proc.send_signal(signal.SIGSTOP)
        yield cluster
    finally:
        thaw(cluster)
        cluster.stop()


def thaw(cluster: Cluster) -> None:
    for node in cluster.nodes:
        if node.proc is not None:
            node.proc.send_signal(signal.SIGCONT)


def test_async_cluster_unreachable_at_startup_is_answered_within_the_timeout() -> None:
    """An asyncio cluster whose nodes do not answer its first slot map: each
    try at the map connects to every startup node (155-311 ms with a 50 ms
    timeout), and every decision made one, breaker open or not. Once the
    breaker of the unmapped keys is open, a decision is the policy's, within
    the timeout; once the nodes answer, the map is learnt and Redis decides."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    with frozen_cluster() as cluster:

        async def main() -> None:
            user = RedisCluster(startup_nodes=[ClusterNode(HOST, n.port) for n in cluster.nodes])
            storage = AsyncRedisStorage(
                user, timeout=TIMEOUT, on_error="deny", breaker_threshold=2, breaker_cooldown=0.5
            )
            limiter = reference.TokenBucket(10, 60.0, storage=storage, clock=FakeClock(1000.0), rule="s")
            for _ in range(2):  # the map's tries fail: the breaker opens
                d = await limiter.allow_async("k")
                assert d.degraded and not d.allowed
            assert storage.metrics()["breaker_state"] == "open"
            times = []
            for _ in range(10):
                start = time.monotonic()
                d = await limiter.allow_async("k")
                times.append(time.monotonic() - start)
                assert d.degraded and not d.allowed  # on_error="deny"
            assert max(times) <= TIMEOUT + MARGIN, times
            assert storage.metrics()["breaker_open_skips"] >= 10
            thaw(cluster)
            deadline = time.monotonic() + 10.0
            while (d := await limiter.allow_async("k")).degraded and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not d.degraded and d.allowed, d  # the map is learnt: Redis decides again
            await storage.close()
            await user.aclose()

        asyncio.run(main())


def test_the_uncovered_breaker_and_its_episode_end_once_every_slot_has_an_owner() -> None:
    """Decisions made while no node was known feed the "(uncovered)"
    breaker and, under ``on_error="local"``, open its local episode; once
    the map covers every slot no key is routed there, and both had stayed
    for good (``metrics()`` an open breaker, an active episode)."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    with frozen_cluster() as cluster:

        async def main() -> None:
            user = RedisCluster(startup_nodes=[ClusterNode(HOST, n.port) for n in cluster.nodes])
            storage = AsyncRedisStorage(
                user, timeout=TIMEOUT, on_error="local", breaker_threshold=2, breaker_cooldown=0.2
            )
            limiter = reference.TokenBucket(10, 60.0, storage=storage, clock=FakeClock(1000.0), rule="u")
            for _ in range(3):
                assert (await limiter.allow_async("k")).reason == REASON_STORE_UNAVAILABLE_LOCAL
            assert storage.metrics()["local_active"] == 1
            thaw(cluster)
            deadline = time.monotonic() + 10.0
            while (d := await limiter.allow_async("k")).degraded and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert not d.degraded, d
            m = storage.metrics()
            assert m["breaker_state"] == "closed" and m["breakers_open"] == 0, m
            assert m["local_active"] == 0 and "(uncovered)" not in m["nodes"], m
            await storage.close()
            await user.aclose()

        asyncio.run(main())


def test_async_batch_to_a_frozen_node_is_one_failure_a_round_trip() -> None:
    """redis-py's asyncio cluster node stores a failed read as every
    command's result: a batch of 40 keys on a frozen node fed its breaker 40
    failures (opening it from one blip). One round trip is one failure, as
    on the synchronous storage."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    cluster = Cluster(require_binary("redis"), "redis")
    cluster.start()
    frozen = cluster.nodes[0]
    try:

        async def main() -> None:
            user = RedisCluster(startup_nodes=[ClusterNode(HOST, cluster.nodes[1].port)])
            storage = AsyncRedisStorage(
                user, timeout=TIMEOUT, on_error="deny", breaker_threshold=3, breaker_cooldown=5.0
            )
            limiter = reference.FixedWindowCounter(
                10, 3600.0, storage=storage, clock=FakeClock(1e6), rule="f"
            )
            assert not (await limiter.allow_async("warm")).degraded  # the slot map is learnt
            keys = [_key_on(storage, limiter, frozen.port, f"f{i}_") for i in range(40)]
            assert len(set(keys)) == 40
            assert not any(
                v[5] for v in await storage.run_kernel_many_async(limiter.config, keys, [1] * 40, 1e6)
            )
            assert frozen.proc is not None
            frozen.proc.send_signal(signal.SIGSTOP)
            verdicts = await storage.run_kernel_many_async(limiter.config, keys, [1] * 40, 1e6)
            assert all(v[5] and not v[0] for v in verdicts)  # by policy: on_error="deny"
            m = storage.metrics()
            assert m["errors"] == 1, m["errors"]
            assert m["nodes"][f"{HOST}:{frozen.port}"]["breaker_state"] == "closed"  # one blip of three
            frozen.proc.send_signal(signal.SIGCONT)
            await storage.close()
            await user.aclose()

        asyncio.run(main())
    finally:
        if frozen.proc is not None:
            frozen.proc.send_signal(signal.SIGCONT)
        cluster.stop()


def test_a_batch_splits_by_node_and_spares_the_dead_one(dying_cluster: Cluster, coverage: str) -> None:
    """``allow_many`` over every master: one pipeline per node, and the dead
    node's keys alone answered by policy (no hidden sleep in the cluster
    pipeline either)."""
    cluster = dying_cluster
    client = cluster.client()
    storage = RedisStorage(
        client, timeout=TIMEOUT, on_error="deny", breaker_threshold=2, breaker_cooldown=0.2
    )
    limiter = reference.TokenBucket(100, 3600.0, storage=storage, clock=FakeClock(10.0), rule="b")
    keys = [f"k{i}" for i in range(60)]
    on_dead = {
        k
        for k in keys
        if storage._route(storage.redis_key(limiter.config, k))[1].port == cluster.nodes[0].port
    }
    assert 0 < len(on_dead) < len(keys)
    assert not limiter.allow_many(keys).degraded
    cluster.nodes[0].kill()
    for _ in range(5):
        timeouts = storage.metrics()["timeouts"]
        start = time.monotonic()
        result = limiter.allow_many(keys)
        assert time.monotonic() - start <= TIMEOUT + MARGIN
        timed_out = storage.metrics()["timeouts"] > timeouts  # a loaded box missed the 50 ms
        for key, d in zip(keys, result):
            if key in on_dead:
                assert d.degraded and not d.allowed
            else:
                assert (not d.degraded and d.allowed) or timed_out
    assert storage.metrics()["nodes"][f"{HOST}:{cluster.nodes[0].port}"]["breaker_opened"] >= 1
    storage.close()
    client.close()


def test_a_failed_over_master_hands_its_keys_and_its_outage_to_the_replica() -> None:
    """A master SIGKILLed with a replica: its keys are answered by policy
    (one local share) until the replica takes its slots over (TAKEOVER,
    mid-outage), then by Redis
    again, exactly (its count replicated before the kill), and the dead
    node's breaker and local episode are dropped with it, so ``metrics()``
    reports no outage that no key meets any more."""
    cluster = Cluster(require_binary("redis"), "redis", replicas=1, node_timeout_ms=500)
    cluster.start()
    client = cluster.client()
    try:
        storage = RedisStorage(
            client,
            timeout=TIMEOUT,
            on_error="local",
            local_instances=INSTANCES,
            breaker_threshold=3,
            breaker_cooldown=0.2,
        )
        limiter = reference.FixedWindowCounter(
            SHARE_LIMIT, 3600.0, storage=storage, clock=FakeClock(1_000_000.0), rule="f"
        )
        dead = cluster.nodes[0]
        key = _key_on(storage, limiter, dead.port, "k")
        assert [limiter.allow(key).remaining for _ in range(3)] == [9, 8, 7]
        assert dead.client().execute_command("WAIT", 1, 2000) == 1  # the replica has the 3
        dead.kill()
        local = []
        promoted = False
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline:
            d = limiter.allow(key)
            if not d.degraded:
                break
            assert d.reason == REASON_STORE_UNAVAILABLE_LOCAL
            local.append(d.allowed)
            if not promoted and len(local) > 20:
                # the outage is under way: the replica takes the slots over now
                # (TAKEOVER: an election's timing on a loaded box is not what
                # this test is about, the client's following the new map is)
                replica_client = cluster.replicas[0].client()
                replica_client.execute_command("CLUSTER", "FAILOVER", "TAKEOVER")
                replica_client.close()
                promoted = True
            time.sleep(0.01)
        else:
            # what to tell a cluster that stayed down (its bus timing on a loaded
            # box) from a client that never asked the new owner again
            probe = cluster.replicas[0].client()
            info = probe.execute_command("CLUSTER", "INFO")
            probe.close()
            info = info.decode() if isinstance(info, bytes) else str(info)
            state = [row for row in info.splitlines() if row.startswith(("cluster_state", "cluster_slots"))]
            breakers = storage.metrics()["nodes"]
            raise AssertionError(f"the replica never took the slots over: {state}, breakers {breakers}")
        assert sum(local) == SHARE_LIMIT // INSTANCES and len(local) > sum(local)  # one share, then denials
        assert d.remaining == 6  # the new master's count: the 3 replicated, and this one
        replica = f"{HOST}:{cluster.replicas[0].port}"
        gone = f"{HOST}:{dead.port}"
        deadline = time.monotonic() + 5.0
        while gone in storage.metrics()["nodes"] and time.monotonic() < deadline:
            limiter.allow(key)  # the refresh that saw the new owner prunes in the background
            time.sleep(0.05)
        m = storage.metrics()
        assert gone not in m["nodes"] and replica in m["nodes"], m["nodes"]
        assert m["nodes_dropped"] >= 1 and m["breaker_state"] == "closed" and m["breakers_open"] == 0
        assert m["local_active"] == 0 and m["local_episodes"] == 1
        storage.close()
    finally:
        client.close()
        cluster.stop()


@pytest.mark.parametrize("lost", [False, True], ids=["learnt", "unknown-target"])
def test_a_batch_moved_to_a_new_master_is_answered_by_it_sync_and_async(lost: bool) -> None:
    """A slot resharded to a fourth master the clients' maps do not know
    yet: a batch meets ``MOVED`` to an unknown node. The synchronous client
    learns it in ``move_slot``; the asyncio one's is a coroutine that was
    never awaited, so its calls were lost: answered by the local store in
    the standalone scope, whose episode nothing on a cluster ends (errors 0,
    every breaker closed, ``local_active`` 1 for good). Both now answer every
    key from Redis, exactly, and leave no episode. ``lost``: a target the
    client cannot learn is answered in its first node's episode, which that
    node's answers end."""
    import redis
    from redis.asyncio.cluster import ClusterNode, RedisCluster
    from redis_servers import Server, free_port

    binary = require_binary("redis")
    cluster = Cluster(binary, "redis")
    cluster.start()
    bus = free_port()
    extra = Server(binary, "redis", extra=("--cluster-enabled", "yes", "--cluster-port", str(bus)))
    extra.extra = (*extra.extra, "--cluster-config-file", f"{extra.dir}/nodes.conf")
    clients: list[Any] = []
    try:
        extra.start()
        sync_user = cluster.client()
        sync_storage = RedisStorage(sync_user, timeout=2.0, on_error="local")
        clock = FakeClock(1_000_000.0)
        sync_limiter = reference.FixedWindowCounter(100, 3600.0, storage=sync_storage, clock=clock, rule="n")
        keys = ["k", *(f"o{i}" for i in range(8))]

        def check(verdicts: list[Any], remaining: float) -> None:
            assert not any(v[5] for v in verdicts), [v[6:7] for v in verdicts]
            assert verdicts[0][1] == remaining and all(v[1] == remaining for v in verdicts), verdicts

        async def main() -> None:
            user = RedisCluster(startup_nodes=[ClusterNode(HOST, cluster.nodes[0].port)], socket_timeout=5.0)
            storage = AsyncRedisStorage(user, timeout=2.0, on_error="local")
            config = sync_limiter.config
            check(sync_storage.run_kernel_many(config, keys, [1] * len(keys), 1e6), 99)
            check(await storage.run_kernel_many_async(config, keys, [1] * len(keys), 1e6), 98)
            # a fourth master joins and the key's slot is resharded to it
            slot = redis.crc.key_slot(storage.redis_key(config, "k").encode())
            new = extra.client(socket_timeout=5.0)
            old = [n.client(socket_timeout=5.0) for n in cluster.nodes]
            clients.extend([new, *old])
            new.execute_command("CLUSTER", "MEET", HOST, cluster.nodes[0].port, cluster.bus_ports[0])
            deadline = time.monotonic() + 30.0
            while not all(
                "cluster_known_nodes:4" in info and "cluster_state:ok" in info and "slots_ok:16384" in info
                for info in (str(c.execute_command("CLUSTER", "INFO")) for c in [new, *old])
            ):
                assert time.monotonic() < deadline, "the fourth master did not join"
                await asyncio.sleep(0.05)
            ids = [c.execute_command("CLUSTER", "MYID") for c in old]
            new_id = new.execute_command("CLUSTER", "MYID")
            counts = [c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) for c in old]
            owner = next(i for i, count in enumerate(counts) if count)
            new.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[owner])
            old[owner].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", new_id)
            moving = old[owner].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            old[owner].execute_command("MIGRATE", HOST, extra.port, "", 0, 5000, "KEYS", *moving)
            for c in [new, *old]:
                c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", new_id)
            # the key's first call meets MOVED to a node neither map knows
            check(sync_storage.run_kernel_many(config, keys, [1] * len(keys), 1e6), 97)
            if lost:  # the redirect names a node the client cannot know
                routes = storage._routes
                routes._target = lambda exc: None
                verdicts = await storage.run_kernel_many_async(config, keys, [1] * len(keys), 1e6)
                assert verdicts[0][5] and verdicts[0][6] == REASON_STORE_UNAVAILABLE_LOCAL, verdicts[0]
                check(verdicts[1:], 96)
                # in the first node's episode, ended by that node's answers to the others
                assert storage.metrics()["local_active"] == 0, storage.metrics()
                del routes._target
                check(await storage.run_kernel_many_async(config, ["k"], [1], 1e6), 96)  # not charged before
            else:
                check(await storage.run_kernel_many_async(config, keys, [1] * len(keys), 1e6), 96)
            for m, episodes in ((sync_storage.metrics(), 0), (storage.metrics(), int(lost))):
                assert m["local_active"] == 0 and m["local_episodes"] == episodes and m["errors"] == 0, m
            assert new.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 1
            await storage.close()
            await user.aclose()

        asyncio.run(main())
        sync_storage.client.close()
        sync_user.close()
    finally:
        for c in clients:
            c.close()
        extra.stop()
        cluster.stop()
