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

from nanolimit._shared import ValidationError
from nanolimit.storage.redis import AsyncRedisStorage, RedisStorage, direct_path

pytest_plugins = ["redis_servers"]  # the server fixtures

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


def test_a_pool_that_cannot_be_rebuilt_names_derive_false(
    redis_server: Any, backend: types.SimpleNamespace
) -> None:
    import redis

    class TenantPool(redis.ConnectionPool):  # type: ignore[misc]
        def __init__(self, tenant: str, **kwargs: Any) -> None:
            self.tenant = tenant
            super().__init__(**kwargs)

    client = redis.Redis(connection_pool=TenantPool("t1", host=HOST, port=redis_server.port))
    try:
        with pytest.raises(ValidationError, match="derive=False"):
            RedisStorage(client, timeout=TIMEOUT)
        storage = RedisStorage(client, derive=False, on_error="raise")  # the caller's own, as it is
        limiter = backend.TokenBucket(1, 60.0, storage, rule="tenant")
        assert _drain(limiter, "k", 2) == [True, False]
    finally:
        client.close()
