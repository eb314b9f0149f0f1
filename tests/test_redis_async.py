"""AsyncRedisStorage on real Redis 7 and Valkey 9 servers: ``await
limiter.allow_async`` decides on the server without blocking the event loop.

Equivalence with the in-memory reference and the synchronous RedisStorage on
an injected clock, 8 tasks on one key, a killed and a frozen server (the
policy answers within the timeout while another task keeps running), a
flushed script cache, the near-cache, and the synchronous entry points that
must refuse. Plain tests drive their own loop with ``asyncio.run``.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
import types
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
import redis
import redis.asyncio
from _helpers import FIELDS, EqualsEverything

from nanolimit import ValidationError, reference
from nanolimit.errors import CircuitOpenError, RedisUnavailableError
from nanolimit.storage.redis import AsyncRedisStorage, RedisStorage

pytest_plugins = ["redis_servers"]  # the server fixtures
# decisions here are bounded in wall time: a full collection of the test
# run's heap must not be what they measure (conftest.steady_heap)
pytestmark = pytest.mark.usefixtures("steady_heap")

HOST = "127.0.0.1"
ALGORITHMS = ("token_bucket", "leaky_bucket", "fixed_window", "sliding_log", "sliding_counter", "gcra")
TOLERANCE = 1e-9
TIMEOUT = 0.05
BOUND = 1.0  # generous for a loaded CI box, still far from redis-py's 5 s default


def _storage(server: Any, **kwargs: Any) -> AsyncRedisStorage:
    kwargs.setdefault("timeout", 2.0)
    kwargs.setdefault("on_error", "raise")
    return AsyncRedisStorage(redis.asyncio.Redis(host=HOST, port=server.port), **kwargs)


def _run(main: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(main())  # type: ignore[arg-type]


def assert_same(got: Any, want: Any, where: str = "") -> None:
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        if isinstance(w, float) and name != "window":
            assert math.isclose(g, w, rel_tol=0.0, abs_tol=TOLERANCE), f"{where} {name}: {g!r} != {w!r}"
        else:
            assert g == w, f"{where} {name}: {g!r} != {w!r}"
    assert not got.degraded, f"{where}: degraded decision from a healthy server"


class Ticker:
    """A task that ticks every millisecond: proof the loop was not blocked."""

    def __init__(self) -> None:
        self.ticks = 0
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(0.001)
            self.ticks += 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._tick())

    async def stop(self) -> None:
        assert self._task is not None
        self._task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await self._task


# --------------------------------------------------------------------------
# Equivalence on an injected clock


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_async_decisions_equal_sync_and_reference(
    backend: types.SimpleNamespace, redis_server: Any, algorithm: str
) -> None:
    rng = random.Random(f"{algorithm}-{backend.name}-{redis_server.kind}")
    window = rng.choice([0.3, 1 / 3, 1.0, 60.0])
    limit = rng.randint(2, 8)
    kwargs: dict[str, Any] = {}
    if algorithm in ("token_bucket", "gcra"):
        kwargs["burst"] = limit + 2
    capacity = kwargs.get("burst", limit)
    start = rng.choice([0.0, 12345.678, 1.8e9])
    cls = backend.limiters[algorithm]
    ref_cls = reference.LIMITERS[reference.Algorithm(algorithm)]
    keys = ("a", "b", "ключ")

    async def main() -> None:
        storage = _storage(redis_server)
        sync_client = redis_server.client()
        sync_storage = RedisStorage(sync_client, prefix="sync:", timeout=2.0, on_error="raise")
        clock = backend.FakeClock(start)
        ref_clock = reference.FakeClock(start)
        on_async = cls(limit, window, storage, clock, "r:1", **kwargs)
        on_sync = cls(limit, window, sync_storage, clock, "r:1", **kwargs)
        in_memory = ref_cls(limit, window, None, ref_clock, "r:1", **kwargs)
        for step in range(60):
            move = rng.random()
            if move < 0.6:
                clock.advance(rng.uniform(0.0, 0.4) * window)
            elif move < 0.8:
                clock.set(math.floor(clock.now() / window + 1) * window)  # a window boundary
            elif move < 0.9:
                clock.advance(-rng.uniform(0.0, 2.0) * window)  # time never runs backwards per key
            ref_clock.set(clock.now())
            key = rng.choice(keys)
            cost = 1 if rng.random() < 0.6 else rng.randint(1, capacity)
            op = rng.choice(["allow", "allow", "allow", "peek", "many", "reset"])
            where = f"step {step} {op} {key} cost={cost} t={clock.now()!r}"
            if op == "allow":
                got = await on_async.allow_async(key, cost)
                assert isinstance(got, backend.Decision)
                assert_same(got, in_memory.allow(key, cost), where)
                assert_same(got, on_sync.allow(key, cost), where + " (sync Redis)")
            elif op == "peek":
                got = await on_async.peek_async(key, cost)
                assert_same(got, in_memory.peek(key, cost), where)
                assert_same(got, on_sync.peek(key, cost), where + " (sync Redis)")
            elif op == "reset":
                await storage.forget_async(on_async.config, key)
                on_sync.reset(key)
                in_memory.reset(key)
            else:
                batch = [rng.choice(keys) for _ in range(rng.randint(1, 5))]
                costs = [rng.randint(1, capacity) for _ in batch]
                verdicts = await storage.run_kernel_many_async(on_async.config, batch, costs, clock.now())
                want = in_memory.allow_many(batch, costs)
                synced = on_sync.allow_many(batch, costs)
                for j, (v, w, s) in enumerate(zip(verdicts, want, synced)):
                    assert_same(on_async._decision(v), w, f"{where} item {j}")
                    assert_same(on_async._decision(v), s, f"{where} item {j} (sync Redis)")
        for key in keys:
            assert await storage.snapshot_async(on_async.config, key) == in_memory.state(key), key
        assert await storage.count() == len(sync_storage)
        await storage.close()
        sync_client.close()

    _run(main)


# --------------------------------------------------------------------------
# Concurrency: atomic per key, on the server's clock


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_eight_tasks_on_one_key_spend_exactly_the_capacity(
    backend: types.SimpleNamespace, redis_server: Any, algorithm: str
) -> None:
    capacity = 50
    limiter_cls = backend.limiters[algorithm]

    async def main() -> None:
        storage = _storage(redis_server)
        limiter = limiter_cls(capacity, 1e6, storage, rule="hot")  # default SystemClock: server TIME

        async def worker() -> int:
            allowed = 0
            for _ in range(100):
                decision = await limiter.allow_async("one-key")
                assert not decision.degraded
                allowed += decision.allowed
            return allowed

        counts = await asyncio.gather(*(worker() for _ in range(8)))
        assert sum(counts) == capacity, counts
        assert storage.metrics()["decisions"] == 800
        assert not (await limiter.peek_async("one-key")).allowed
        await storage.close()

    _run(main)


# --------------------------------------------------------------------------
# Faults: the policy answers within the timeout, and the loop keeps running


def _fault_storage(server: Any, **kwargs: Any) -> AsyncRedisStorage:
    kwargs.setdefault("timeout", TIMEOUT)
    kwargs.setdefault("breaker_threshold", 3)
    kwargs.setdefault("breaker_cooldown", 0.2)
    return _storage(server, **kwargs)


async def _until_healthy(limiter: Any, key: str, limit: float = 5.0) -> Any:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        decision = await limiter.allow_async(key)
        if not decision.degraded:
            return decision
        await asyncio.sleep(0.05)
    raise AssertionError("decisions did not resume after the restart")


def test_killed_server_applies_each_policy_and_restart_resumes(
    backend: types.SimpleNamespace, own_server: Any
) -> None:
    async def main() -> None:
        storage = _fault_storage(
            own_server, on_error="deny", rule_on_error={"open": "allow", "strict": "raise"}
        )
        closed = backend.TokenBucket(5, 1.0, storage, rule="closed")
        fail_open = backend.TokenBucket(5, 1.0, storage, rule="open")
        strict = backend.TokenBucket(5, 1.0, storage, rule="strict")
        assert not (await closed.allow_async("k")).degraded
        ticker = Ticker()
        ticker.start()
        own_server.kill()
        for _ in range(6):  # through the threshold, then behind the open breaker
            begun = time.monotonic()
            denied = await closed.allow_async("k")
            passed = await fail_open.allow_async("k")
            with pytest.raises(RedisUnavailableError):
                await strict.allow_async("k")
            assert time.monotonic() - begun < BOUND
            assert (denied.allowed, denied.degraded, denied.retry_after) == (False, True, 1.0)
            assert (passed.allowed, passed.degraded, passed.remaining) == (True, True, 0)
            await asyncio.sleep(0.002)
        with pytest.raises(CircuitOpenError):
            await strict.allow_async("k")
        metrics = storage.metrics()
        assert metrics["errors"] >= 3 and metrics["breaker_open_skips"] > 0
        assert metrics["breaker_opened"] >= 1 and metrics["degraded"] >= 12
        assert ticker.ticks > 0
        own_server.start()
        resumed = await _until_healthy(closed, "k")
        assert resumed.allowed  # a fresh server: a full bucket
        assert storage.metrics()["breaker_state"] == "closed"
        await ticker.stop()
        await storage.close()

    _run(main)


def test_frozen_server_times_out_without_blocking_the_loop(
    backend: types.SimpleNamespace, own_server: Any
) -> None:
    admin = own_server.client()

    async def main() -> None:
        storage = _fault_storage(own_server, on_error="allow")
        limiter = backend.GCRA(5, 1.0, storage, rule="frozen")
        assert not (await limiter.allow_async("k")).degraded
        freeze = threading.Thread(target=admin.execute_command, args=("DEBUG", "SLEEP", "0.6"))
        freeze.start()
        await asyncio.sleep(0.05)  # the server is asleep now
        ticker = Ticker()
        ticker.start()
        begun = time.monotonic()
        decision = await limiter.allow_async("k")
        took = time.monotonic() - begun
        ticks = ticker.ticks
        await ticker.stop()
        assert decision.allowed and decision.degraded
        assert TIMEOUT * 0.8 <= took < BOUND, took
        assert ticks >= 5, f"the loop ran {ticks} ticks in {took:.3f} s: blocked"
        assert storage.metrics()["timeouts"] >= 1
        await asyncio.to_thread(freeze.join)
        resumed = await _until_healthy(limiter, "k")
        assert resumed.allowed
        await storage.close()

    _run(main)
    admin.close()


def test_cancelled_decision_leaves_no_late_reply_behind(
    backend: types.SimpleNamespace, redis_server: Any
) -> None:
    admin = redis_server.client()

    async def main() -> None:
        storage = _storage(redis_server)  # 2 s timeout: the cancellation comes first
        limiter = backend.FixedWindowCounter(5, 60.0, storage, backend.FakeClock(0.0), rule="cancel")
        assert (await limiter.allow_async("k")).remaining == 4
        freeze = threading.Thread(target=admin.execute_command, args=("DEBUG", "SLEEP", "0.3"))
        freeze.start()
        await asyncio.sleep(0.05)
        pending = asyncio.ensure_future(limiter.allow_async("k", 2))
        await asyncio.sleep(0.05)  # sent, waiting for the frozen server
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        await asyncio.to_thread(freeze.join)
        # The cancelled script may have run (no retry, no undo): 4 or 2 left. Every
        # later answer must be its own, never the cancelled call's late reply.
        before = (await limiter.peek_async("k")).remaining + 1  # a peek answers what would be left
        assert before in (2, 4)
        for spent in range(1, 3):
            decision = await limiter.allow_async("k")
            assert decision.allowed and decision.remaining == before - spent
        assert storage.metrics()["errors"] == 0
        await storage.close()

    _run(main)
    admin.close()


def test_script_flush_is_reloaded_transparently(backend: types.SimpleNamespace, redis_server: Any) -> None:
    admin = redis_server.client()

    async def main() -> None:
        storage = _storage(redis_server)
        limiter = backend.SlidingWindowLog(3, 10.0, storage, backend.FakeClock(0.0), rule="flush")
        assert (await limiter.allow_async("k")).remaining == 2
        admin.script_flush()
        assert (await limiter.allow_async("k")).remaining == 1
        admin.script_flush()
        verdicts = await storage.run_kernel_many_async(limiter.config, ["k", "k"], [1, 1], 0.0)
        assert [v[0] for v in verdicts] == [True, False]
        metrics = storage.metrics()
        assert metrics["script_loads"] == 3 and metrics["errors"] == 0 and metrics["degraded"] == 0
        await storage.close()

    _run(main)
    admin.close()


def test_near_cache_denies_without_a_round_trip(backend: types.SimpleNamespace, redis_server: Any) -> None:
    admin = redis_server.client()

    def evalsha_calls() -> int:
        stats = admin.info("commandstats")
        return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))

    async def main() -> None:
        storage = _storage(redis_server, near_cache=True)
        limiter = backend.FixedWindowCounter(2, 60.0, storage, rule="hot")
        assert [(await limiter.allow_async("abuser")).allowed for _ in range(3)] == [True, True, False]
        sent = evalsha_calls()
        for _ in range(50):
            decision = await limiter.allow_async("abuser")
            assert not decision.allowed and not decision.degraded
            assert 0.0 < decision.retry_after <= 60.0
        assert evalsha_calls() == sent
        assert storage.metrics()["near_cache_hits"] == 50
        assert (await limiter.allow_async("someone-else")).allowed  # other keys still ask the store
        await storage.forget_async(limiter.config, "abuser")  # a reset drops the local denial too
        assert (await limiter.allow_async("abuser")).allowed
        await storage.close()

    _run(main)
    admin.close()


# --------------------------------------------------------------------------
# The client, the synchronous entry points, admin calls


def test_derived_client_is_short_and_never_retries(redis_server: Any) -> None:
    async def main() -> None:
        user = redis.asyncio.Redis(host=HOST, port=redis_server.port, socket_timeout=5.0)
        storage = AsyncRedisStorage(user, timeout=TIMEOUT)
        kwargs = storage.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == TIMEOUT and kwargs["socket_connect_timeout"] == TIMEOUT
        assert kwargs["retry"].get_retries() == 0
        assert user.connection_pool.connection_kwargs["socket_timeout"] == 5.0
        assert await storage.client.ping()
        await storage.close()
        assert await user.ping()  # the caller's client is never closed by us
        await user.aclose()
        assert AsyncRedisStorage(user, derive=False).client is user

    _run(main)


def test_synchronous_entry_points_refuse_clearly(backend: types.SimpleNamespace, redis_server: Any) -> None:
    storage = _storage(redis_server)
    limiter = backend.TokenBucket(5, 1.0, storage, rule="sync")
    for call in (
        lambda: limiter.allow("k"),
        lambda: limiter.peek("k"),
        lambda: limiter.allow_many(["k"]),
    ):
        with pytest.raises(TypeError, match="allow_async"):
            call()
    with pytest.raises(TypeError, match="forget_async"):
        limiter.reset("k")
    with pytest.raises(TypeError, match="snapshot_async"):
        limiter.state("k")
    with pytest.raises(TypeError, match=r"await storage\.count\(\)"):
        len(storage)
    assert bool(storage)
    assert storage.evict_idle(123.0) == 0
    with pytest.raises(NotImplementedError):
        storage.apply("k", 0.0, lambda s: (s, None))
    with pytest.raises(ValueError, match="asyncio client"):
        AsyncRedisStorage(redis_server.client())
    with pytest.raises(ValueError, match="synchronous client"):
        RedisStorage(redis.asyncio.Redis(host=HOST, port=redis_server.port))
    assert "AsyncRedisStorage" in repr(storage)


def test_admin_calls_count_clear_and_close(backend: types.SimpleNamespace, redis_server: Any) -> None:
    async def main() -> None:
        storage = _storage(redis_server, prefix="adm[1]:")
        other = _storage(redis_server, prefix="adm-other:")
        limiter = backend.GCRA(3, 1.0, storage, backend.FakeClock(10.0), rule="adm")
        await backend.GCRA(3, 1.0, other, rule="adm").allow_async("x")
        for key in ("a", "b", "{tag}"):
            await limiter.allow_async(key)
        assert await storage.count() == 3
        names = await storage.keys()
        assert all(name.startswith("adm[1]:gcra:adm:") for name in names)
        assert not any("tag" in name for name in names)  # braces are hashed away
        assert (await storage.snapshot_async(limiter.config, "a")) is not None
        assert await storage.clear() == 3
        assert await storage.count() == 0 and await other.count() == 1
        assert (await limiter.peek_async("a", 3)).allowed  # a full budget again
        await storage.close()
        await other.close()

    _run(main)


def test_async_cluster_routes_decisions_and_batches(
    backend: types.SimpleNamespace, redis_cluster: Any
) -> None:
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    async def main() -> None:
        user = RedisCluster(startup_nodes=[ClusterNode(HOST, redis_cluster.nodes[0].port)])
        storage = AsyncRedisStorage(user, timeout=2.0, on_error="raise")
        assert storage.cluster and storage.client is not user
        assert storage.client.nodes_manager.connection_kwargs["socket_timeout"] == 2.0
        clock = backend.FakeClock(0.0)
        limiter = backend.TokenBucket(2, 60.0, storage, clock, rule="c")
        keys = [f"user:{i}" for i in range(12)]
        for key in keys:
            assert (await limiter.allow_async(key)).remaining == 1
        verdicts = await storage.run_kernel_many_async(limiter.config, keys + keys, [1] * 24, 0.0)
        assert [v[0] for v in verdicts] == [True] * 12 + [False] * 12
        assert await storage.count() == 12
        await storage.close()
        await user.aclose()

    _run(main)


def test_async_cluster_follows_ask_and_moved_mid_migration(
    backend: types.SimpleNamespace, redis_cluster: Any
) -> None:
    """A slot migrating under an asyncio cluster: ``ASK`` sends the script
    once to the importing node (loading it there first), then ``MOVED``
    teaches the new owner; the state moves with the slot, nothing is
    charged twice."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    async def main() -> None:
        user = RedisCluster(startup_nodes=[ClusterNode(HOST, redis_cluster.nodes[0].port)])
        storage = AsyncRedisStorage(user, timeout=2.0, on_error="raise")
        limiter = backend.TokenBucket(6, 3600.0, storage, backend.FakeClock(50.0), rule="move")
        assert [(await limiter.allow_async("mover")).remaining for _ in range(3)] == [5, 4, 3]
        slot = storage.client.keyslot(storage.redis_key(limiter.config, "mover"))
        _, target = redis_cluster.migrate(slot)
        try:
            asked = await limiter.allow_async("mover")  # on_error="raise": a failed redirect raises
            assert asked.allowed and asked.remaining == 2
        finally:
            redis_cluster.assign(slot, target)
        assert [(await limiter.allow_async("mover")).remaining for _ in range(2)] == [1, 0]
        assert not (await limiter.allow_async("mover")).allowed
        await storage.close()
        await user.aclose()

    _run(main)


@pytest.mark.parametrize("batch", ["script", "pipeline"])
def test_async_cluster_batch_follows_ask_and_moved_mid_migration(
    backend: types.SimpleNamespace, redis_cluster: Any, batch: str
) -> None:
    """The async batch while a key's slot migrates: ``ASK`` sends that
    key's calls once more to the importing node after ``ASKING``, then the
    stale map meets ``MOVED`` and the batch follows it; every answer is
    Redis's own (``on_error="raise"``), nothing is charged twice."""
    from redis.asyncio.cluster import ClusterNode, RedisCluster

    async def main() -> None:
        user = RedisCluster(startup_nodes=[ClusterNode(HOST, redis_cluster.nodes[0].port)])
        storage = AsyncRedisStorage(user, timeout=2.0, on_error="raise", batch=batch)
        limiter = backend.TokenBucket(8, 3600.0, storage, backend.FakeClock(50.0), rule="bmove")
        cfg, now = limiter.config, 50.0
        others = [f"o{i}" for i in range(12)]
        first = await storage.run_kernel_many_async(cfg, ["mover", *others], [1] * 13, now)
        assert first[0][1] == 7
        slot = storage.client.keyslot(storage.redis_key(cfg, "mover"))
        _, target = redis_cluster.migrate(slot)
        try:
            keys = ["mover", *others, "mover"]
            asked = await storage.run_kernel_many_async(cfg, keys, [1] * len(keys), now)
            assert not any(v[5] for v in asked), asked  # none degraded
            assert (asked[0][1], asked[-1][1]) == (6, 5)
        finally:
            redis_cluster.assign(slot, target)
        moved = await storage.run_kernel_many_async(cfg, ["mover", *others], [1] * 13, now)
        assert not any(v[5] for v in moved) and moved[0][1] == 4 and moved[1][1] == 5
        await storage.close()
        await user.aclose()

    _run(main)


@pytest.mark.parametrize(
    ("keys", "costs", "now"),
    [
        (["a", "b", "c"], [1], None),  # lengths differ
        (["a", "b"], [1, -1000], None),  # a negative cost would refund the key
        (["a", "b"], [1, 0], None),
        (["a", "b"], [1, 1.5], None),
        (["a", "b"], [1, 10**30], None),
        (["a", 7], [1, 1], None),  # not a str
        (["a", "b"], [1, 1], math.nan),  # a non-finite clock would poison the key
    ],
)
def test_async_batch_checks_everything_and_sends_nothing(
    redis_server: Any, keys: list[Any], costs: list[Any], now: Any
) -> None:
    """run_kernel_many_async is the async allow_many, called directly: bad input
    is refused before any command, as the limiters refuse it."""

    async def main() -> None:
        storage = _storage(redis_server)
        limiter = reference.TokenBucket(10, 3600.0, storage=storage)
        admin = redis.Redis(host=HOST, port=redis_server.port)
        admin.config_resetstat()
        with pytest.raises(ValidationError):
            await storage.run_kernel_many_async(limiter.config, keys, costs, now)
        stats = admin.info("commandstats")
        assert not any(name in stats for name in ("cmdstat_evalsha", "cmdstat_eval")), stats
        assert await storage.count() == 0
        admin.close()
        await storage.close()

    _run(main)


def test_async_str_subclass_keys_are_their_characters(
    backend: types.SimpleNamespace, redis_server: Any
) -> None:
    """``allow_async``/``peek_async``/``refund_async`` hand the storage the
    key's characters, as ``allow`` does (a str subclass's ``__eq__`` and
    ``__hash__`` must not pick the near-cache entry: "b" was denied on
    "a"'s cached denial, without a round trip)."""

    async def main() -> None:
        storage = _storage(redis_server, near_cache=True)
        limiter = backend.FixedWindowCounter(2, 3600.0, storage, rule="subclass")  # no window ends mid-test
        a, b = EqualsEverything("a"), EqualsEverything("b")
        assert [(await limiter.allow_async(a)).allowed for _ in range(3)] == [True, True, False]
        assert (await limiter.peek_async(b)).allowed  # a budget of its own
        assert (await limiter.allow_async(b)).allowed
        # read before the refund, which may delete b's key (its count back at 0)
        mine = sorted(k for k in await storage.keys() if ":subclass:" in k)  # the server is shared
        assert mine == sorted(storage.redis_key(limiter.config, k) for k in "ab")
        await limiter.refund_async(b)
        assert (await limiter.peek_async(b)).remaining == 1  # b's unit given back: a fresh key's peek
        for k in mine:
            await storage.client.delete(k)
        await storage.close()

    _run(main)
