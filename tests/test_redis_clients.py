"""Which clients a Redis storage accepts, and which path each one's
decisions take (docs/redis.md, "Clients"): the library's own client and
pool types get the fast paths built on redis-py internals; a Sentinel-managed
client is derived through its Sentinel; a subclass or an unknown pool goes
through the public ``execute_command``; anything that is not a client object
is refused with a message naming what is accepted. Real servers (and a real
``--sentinel`` process) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import types
from typing import Any

import pytest

from nanolimit.errors import ValidationError
from nanolimit.storage.redis import AsyncRedisStorage, RedisStorage
from nanolimit.storage.redis._connections import direct_path

pytest_plugins = ["redis_servers"]  # the server fixtures
# decisions here are bounded in wall time: a full collection of the test
# run's heap must not be what they measure (conftest.steady_heap)
pytestmark = pytest.mark.usefixtures("steady_heap")

HOST = "127.0.0.1"
TIMEOUT = 0.5


def _drain(limiter: Any, key: str, n: int) -> list[bool]:
    return [limiter.allow(key).allowed for _ in range(n)]


# --------------------------------------------------------------------------
# Not a client


@pytest.mark.parametrize("value", ["redis://127.0.0.1:6379/0", b"redis://127.0.0.1:6379/0"])
def test_a_url_is_refused_with_what_is_accepted(value: Any) -> None:
    """A URL used to fail with ``ModuleNotFoundError: builtins.retry``."""
    with pytest.raises(ValidationError) as err:
        RedisStorage(value)
    message = str(err.value)
    assert "redis.Redis.from_url" in message
    assert "redis.sentinel.Sentinel" in message and "redis.RedisCluster" in message
    with pytest.raises(ValidationError, match="from_url"):
        RedisStorage(value, derive=False)  # refused before anything is derived, too


@pytest.mark.parametrize("value", [None, 6379, object()])
def test_an_object_without_commands_is_refused(value: Any) -> None:
    with pytest.raises(ValidationError, match="client must be a redis-py or valkey-py client"):
        RedisStorage(value)


def test_a_url_is_refused_by_the_asyncio_storage_too() -> None:
    with pytest.raises(ValidationError, match="from_url"):
        AsyncRedisStorage("redis://127.0.0.1:6379/0")


# --------------------------------------------------------------------------
# The library's own types: the fast path stays


def test_a_plain_client_keeps_connections(redis_server: Any, backend: types.SimpleNamespace) -> None:
    client = redis_server.client()
    try:
        storage = RedisStorage(client, timeout=TIMEOUT, on_error="raise")
        assert direct_path(storage.client) == "kept"
        assert storage._spares is not None and storage._pool is storage.client.connection_pool
        limiter = backend.TokenBucket(3, 60.0, storage, rule="plain")
        assert _drain(limiter, "k", 4) == [True, True, True, False]
        storage.close()
    finally:
        client.close()


# --------------------------------------------------------------------------
# Sentinel


def test_a_sentinel_managed_client_decides(
    sentinel: Any, redis_server: Any, backend: types.SimpleNamespace
) -> None:
    """``Sentinel(...).master_for(name)`` used to raise TypeError (its pool
    takes the service and the Sentinel first). It is derived through the
    Sentinel: the same pool class, the master found by the Sentinel, the
    short timeout; the caller's client keeps its own settings."""
    import redis.sentinel

    manager = redis.sentinel.Sentinel([(HOST, sentinel.port)], socket_timeout=2.0)
    client = manager.master_for(sentinel.name, socket_timeout=5.0)
    direct = redis_server.client()
    try:
        storage = RedisStorage(client, timeout=TIMEOUT, on_error="raise")
        pool = storage.client.connection_pool
        assert type(pool) is redis.sentinel.SentinelConnectionPool
        assert pool is not client.connection_pool and pool.service_name == sentinel.name
        assert pool.connection_kwargs["socket_timeout"] == TIMEOUT
        assert client.connection_pool.connection_kwargs["socket_timeout"] == 5.0
        assert direct_path(storage.client) == "pool" and storage._spares is None
        limiter = backend.TokenBucket(3, 60.0, storage, rule="sentinel")
        assert _drain(limiter, "user:1", 4) == [True, True, True, False]
        # the state is on the master the Sentinel named
        assert direct.exists(storage.redis_key(limiter.config, "user:1")) == 1
        assert limiter.allow_many(["user:2", "user:2"]) is not None
        assert storage.metrics()["errors"] == 0
        storage.close()
    finally:
        client.close()
        direct.close()
        for conn in manager.sentinels:
            conn.close()


@pytest.mark.parametrize("package", ["redis", "valkey"])
def test_unreachable_sentinels_cost_a_decision_its_timeout_not_retries(
    package: str, backend: types.SimpleNamespace
) -> None:
    """Finding the master asks the Sentinels on the decision path; the
    caller's Sentinel retries with backoff (8 s for one decision at a 50 ms
    timeout). The derived one asks each watcher once, within the timeout,
    and leaves the caller's Sentinel as it was."""
    import socket
    import time

    sentinel_mod = pytest.importorskip(package + ".sentinel")
    closed = []
    for _ in range(2):
        with socket.socket() as probe:
            probe.bind((HOST, 0))
            closed.append((HOST, probe.getsockname()[1]))  # nothing listens there
    manager = sentinel_mod.Sentinel(closed, socket_timeout=2.0)
    client = manager.master_for("mymaster")
    before = [watcher.get_retry() for watcher in manager.sentinels]
    storage = RedisStorage(client, timeout=0.05, on_error="allow", breaker_threshold=100)
    try:
        derived = storage.client.connection_pool.sentinel_manager
        assert derived is not manager
        ports = [w.connection_pool.connection_kwargs["port"] for w in derived.sentinels]
        assert ports == [port for _, port in closed]
        assert all(w.connection_pool.connection_kwargs["socket_timeout"] == 0.05 for w in derived.sentinels)
        limiter = backend.TokenBucket(3, 60.0, storage, rule="lost")
        for _ in range(3):
            start = time.monotonic()
            decision = limiter.allow("k")
            elapsed = time.monotonic() - start
            assert decision.allowed and decision.degraded
            assert elapsed < 1.0, elapsed  # two refused connects, not seconds of backoff
        assert [watcher.get_retry() for watcher in manager.sentinels] == before
        assert manager.sentinels[0].connection_pool.connection_kwargs["socket_timeout"] == 2.0
    finally:
        storage.close()
        client.close()


def test_an_asyncio_sentinel_managed_client_decides(sentinel: Any, backend: types.SimpleNamespace) -> None:
    import redis.asyncio.sentinel

    async def main() -> list[bool]:
        manager = redis.asyncio.sentinel.Sentinel([(HOST, sentinel.port)], socket_timeout=2.0)
        client = manager.master_for(sentinel.name)
        storage = AsyncRedisStorage(client, timeout=TIMEOUT, on_error="raise")
        try:
            assert type(storage.client.connection_pool) is redis.asyncio.sentinel.SentinelConnectionPool
            assert storage.client.connection_pool.connection_kwargs["socket_timeout"] == TIMEOUT
            limiter = backend.TokenBucket(2, 60.0, storage, rule="sentinel-async")
            return [(await limiter.allow_async("k")).allowed for _ in range(3)]
        finally:
            await storage.close()
            await client.aclose()
            for conn in manager.sentinels:
                await conn.aclose()

    assert asyncio.run(main()) == [True, True, False]


# --------------------------------------------------------------------------
# Types the storage does not know: the public API


def test_a_client_subclass_goes_through_execute_command(
    redis_server: Any, backend: types.SimpleNamespace
) -> None:
    """A subclass may change ``execute_command`` (tracing, say): the fast
    path would skip it, so a subclass gets the public path, and its hook
    sees every decision."""
    import redis

    seen: list[Any] = []

    class TracingRedis(redis.Redis):  # type: ignore[misc,type-arg]
        def execute_command(self, *args: Any, **options: Any) -> Any:
            seen.append(args[0])
            return super().execute_command(*args, **options)

    client = TracingRedis(host=HOST, port=redis_server.port)
    try:
        storage = RedisStorage(client, timeout=TIMEOUT, on_error="raise")
        assert type(storage.client) is TracingRedis
        assert direct_path(storage.client) == "public"
        assert storage._pool is None and storage._spares is None
        storage.load_scripts()
        seen.clear()
        limiter = backend.TokenBucket(2, 60.0, storage, rule="traced")
        assert _drain(limiter, "k", 3) == [True, True, False]
        assert seen == ["EVALSHA"] * 3
        storage.close()
    finally:
        client.close()


def test_an_unknown_pool_goes_through_the_public_path(
    redis_server: Any, backend: types.SimpleNamespace
) -> None:
    """A pool subclass is rebuilt as the same class (with the short timeout),
    never has connections kept out of it, and lends one per decision."""
    import redis

    class CountingPool(redis.ConnectionPool):  # type: ignore[misc]
        lent = 0

        def get_connection(self, *args: Any, **kwargs: Any) -> Any:
            CountingPool.lent += 1
            return super().get_connection(*args, **kwargs)

    pool = CountingPool(host=HOST, port=redis_server.port)
    client = redis.Redis(connection_pool=pool)
    try:
        storage = RedisStorage(client, timeout=TIMEOUT, on_error="raise")
        derived = storage.client.connection_pool
        assert type(derived) is CountingPool and derived is not pool
        assert derived.connection_kwargs["socket_timeout"] == TIMEOUT
        assert direct_path(storage.client) == "public" and storage._spares is None
        storage.load_scripts()
        limiter = backend.TokenBucket(4, 60.0, storage, rule="counted")
        before = CountingPool.lent
        assert _drain(limiter, "k", 5) == [True, True, True, True, False]
        assert CountingPool.lent - before == 5  # one borrow per decision: nothing kept
        storage.close()
    finally:
        client.close()


def test_a_pool_that_cannot_be_rebuilt_is_used_as_it_is(
    redis_server: Any, backend: types.SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    """A pool subclass whose constructor wants arguments of its own cannot be
    rebuilt through public API: the storage uses the caller's client as it
    is (``derive=False``), on the public path, and a warning says why."""
    import redis

    class TenantPool(redis.ConnectionPool):  # type: ignore[misc]
        def __init__(self, tenant: str, **kwargs: Any) -> None:
            self.tenant = tenant
            super().__init__(**kwargs)

    client = redis.Redis(connection_pool=TenantPool("t1", host=HOST, port=redis_server.port))
    try:
        with caplog.at_level("WARNING", logger="nanolimit.storage.redis"):
            storage = RedisStorage(client, timeout=TIMEOUT, on_error="raise")
        assert storage.client is client and storage._spares is None and storage._pool is None
        [record] = [r for r in caplog.records if r.name == "nanolimit.storage.redis"]
        assert "derive=False" in record.getMessage() and "TenantPool" in record.getMessage()
        limiter = backend.TokenBucket(1, 60.0, storage, rule="tenant")
        assert _drain(limiter, "k", 2) == [True, False]
        storage.close()
        assert client.ping() is True  # the caller's client is never closed by the storage
        explicit = RedisStorage(client, derive=False, on_error="raise")  # the same, said outright
        assert explicit.client is client
    finally:
        client.close()


# --------------------------------------------------------------------------
# A URL names the function that takes one; valkey-py's own class names;
# subclasses on both sides; a connect timeout of its own


def test_a_url_names_storage_from_uri_and_never_its_password() -> None:
    with pytest.raises(ValidationError) as err:
        RedisStorage("redis://:hunter2-Zq@127.0.0.1:6379/0")
    assert "nanolimit.storage_from_uri(uri)" in str(err.value)
    assert "hunter2-Zq" not in str(err.value)


def test_valkey_py_clients_get_the_paths_of_their_redis_py_twins(
    redis_server: Any, redis_cluster: Any, sentinel: Any, backend: types.SimpleNamespace
) -> None:
    """valkey-py renamed its classes (Valkey, ValkeyCluster, ``valkey_class=``):
    its standalone client keeps connections, its cluster is routed as a
    cluster, and its Sentinel-managed client is derived through its Sentinel
    (each used to be refused or sent down the wrong path)."""
    import valkey
    import valkey.cluster
    import valkey.sentinel

    plain = valkey.Valkey(host=HOST, port=redis_server.port)
    nodes = [valkey.cluster.ClusterNode(HOST, redis_cluster.nodes[0].port)]
    clustered = valkey.cluster.ValkeyCluster(startup_nodes=nodes, socket_timeout=5.0)
    manager = valkey.sentinel.Sentinel([(HOST, sentinel.port)], socket_timeout=2.0)
    managed = manager.master_for(sentinel.name, socket_timeout=5.0)
    try:
        storage = RedisStorage(plain, timeout=TIMEOUT, on_error="raise")
        assert direct_path(storage.client) == "kept" and storage._spares is not None
        assert _drain(backend.TokenBucket(2, 60.0, storage, rule="vk"), "k", 3) == [True, True, False]
        storage.close()
        on_cluster = RedisStorage(clustered, timeout=TIMEOUT, on_error="raise")
        assert on_cluster.cluster and type(on_cluster.client) is valkey.cluster.ValkeyCluster
        assert on_cluster.client is not clustered
        assert on_cluster.client.nodes_manager.connection_kwargs["socket_timeout"] == TIMEOUT
        limiter = backend.TokenBucket(2, 60.0, on_cluster, rule="vk-cl")
        for n in range(4):  # several slots
            assert _drain(limiter, f"user:{n}", 3) == [True, True, False]
        on_cluster.close()
        on_sentinel = RedisStorage(managed, timeout=TIMEOUT, on_error="raise")
        pool = on_sentinel.client.connection_pool
        assert type(pool) is valkey.sentinel.SentinelConnectionPool and pool is not managed.connection_pool
        assert pool.connection_kwargs["socket_timeout"] == TIMEOUT
        assert type(on_sentinel.client) is valkey.Valkey and direct_path(on_sentinel.client) == "pool"
        assert _drain(backend.TokenBucket(2, 60.0, on_sentinel, rule="vk-s"), "k", 3) == [True, True, False]
        on_sentinel.close()
    finally:
        plain.close()
        clustered.close()
        managed.close()
        for conn in manager.sentinels:
            conn.close()


def test_an_asyncio_valkey_client_decides_on_the_pool_path(
    redis_server: Any, backend: types.SimpleNamespace
) -> None:
    """valkey-py's asyncio connection has no ``can_read`` check, so none is
    kept between calls; each decision borrows one from the pool."""
    import valkey.asyncio

    async def main() -> list[bool]:
        client = valkey.asyncio.Valkey(host=HOST, port=redis_server.port)
        storage = AsyncRedisStorage(client, timeout=TIMEOUT, on_error="raise")
        try:
            assert direct_path(storage.client) == "pool" and storage._spares is None
            limiter = backend.TokenBucket(2, 60.0, storage, rule="vk-async")
            return [(await limiter.allow_async("k")).allowed for _ in range(3)]
        finally:
            await storage.close()
            await client.aclose()

    assert asyncio.run(main()) == [True, True, False]


def test_a_client_subclass_on_a_pool_subclass_is_derived_as_both(
    redis_server: Any, backend: types.SimpleNamespace
) -> None:
    import redis

    class AppPool(redis.ConnectionPool):  # type: ignore[misc]
        made = 0

        def make_connection(self) -> Any:
            AppPool.made += 1
            return super().make_connection()

    class AppRedis(redis.Redis):  # type: ignore[misc,type-arg]
        pass

    client = AppRedis(connection_pool=AppPool(host=HOST, port=redis_server.port, socket_timeout=5.0))
    try:
        storage = RedisStorage(client, timeout=TIMEOUT, on_error="raise")
        assert type(storage.client) is AppRedis and type(storage.client.connection_pool) is AppPool
        assert storage.client.connection_pool is not client.connection_pool
        assert storage.client.connection_pool.connection_kwargs["socket_timeout"] == TIMEOUT
        assert client.connection_pool.connection_kwargs["socket_timeout"] == 5.0
        assert direct_path(storage.client) == "public"
        before = AppPool.made
        assert _drain(backend.TokenBucket(2, 60.0, storage, rule="app"), "k", 3) == [True, True, False]
        assert AppPool.made > before  # the subclass's own hook made the connection
        storage.close()
    finally:
        client.close()


def test_a_client_subclass_that_cannot_be_rebuilt_is_used_as_it_is(
    redis_server: Any, backend: types.SimpleNamespace, caplog: pytest.LogCaptureFixture
) -> None:
    import redis

    class TenantRedis(redis.Redis):  # type: ignore[misc,type-arg]
        def __init__(self, tenant: str, **kwargs: Any) -> None:
            self.tenant = tenant
            super().__init__(**kwargs)

    client = TenantRedis("t1", host=HOST, port=redis_server.port)
    try:
        with caplog.at_level("WARNING", logger="nanolimit.storage.redis"):
            storage = RedisStorage(client, timeout=TIMEOUT, on_error="raise")
        assert storage.client is client and direct_path(client) == "public"
        said = [r.getMessage() for r in caplog.records]
        assert any("TenantRedis" in text and "derive=False" in text for text in said)
        assert _drain(backend.TokenBucket(1, 60.0, storage, rule="tenant-c"), "k", 2) == [True, False]
        storage.close()
        assert client.ping() is True
    finally:
        client.close()


def test_a_connect_timeout_of_its_own_reaches_the_derived_client(redis_server: Any) -> None:
    from nanolimit.storage.redis._connections import connect_timeout

    client = redis_server.client()
    try:
        with connect_timeout(0.9):
            storage = RedisStorage(client, timeout=TIMEOUT)
        kwargs = storage.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == TIMEOUT and kwargs["socket_connect_timeout"] == 0.9
        storage.close()
        plain = RedisStorage(client, timeout=TIMEOUT)  # outside the block: the decision timeout
        assert plain.client.connection_pool.connection_kwargs["socket_connect_timeout"] == TIMEOUT
        plain.close()
    finally:
        client.close()
