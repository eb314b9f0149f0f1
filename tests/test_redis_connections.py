"""The connections a RedisStorage keeps between decisions (``keep_connections``):
reused without a trip through the pool, checked before reuse, dropped after an
error, shared safely by threads, given back on ``close()`` and collection, and
never shared with a forked child."""

from __future__ import annotations

import asyncio
import gc
import os
import threading
import time
import types
from typing import Any

import pytest

from nanolimit._limiter_config import LimiterConfig
from nanolimit.errors import ValidationError
from nanolimit.storage.redis import RedisStorage, _connections  # where the hiredis packer is looked up
from nanolimit.storage.redis._connections import _SpareConnections

pytest_plugins = ["redis_servers"]  # the server fixtures


def _count_borrows(pool: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count ``pool.get_connection`` calls (the trip a kept connection saves)."""
    borrows = [0]
    original = pool.get_connection

    def counted(*args: Any, **kwargs: Any) -> Any:
        borrows[0] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(pool, "get_connection", counted)
    return borrows


def _counted(
    backend: types.SimpleNamespace,
    make_storage: Any,
    monkeypatch: pytest.MonkeyPatch,
    rule: str,
    **kwargs: Any,
) -> tuple[Any, list[int], Any]:
    """A storage with its scripts loaded, its pool's borrows counted from
    here on, and a token bucket of 100 on it."""
    storage = make_storage(**kwargs)
    storage.load_scripts()
    borrows = _count_borrows(storage.client.connection_pool, monkeypatch)
    return storage, borrows, backend.TokenBucket(100, 60.0, storage, rule=rule)


def _received(server: Any) -> int:
    """Connections the server has accepted so far."""
    admin = server.client()
    try:
        return int(admin.info("stats")["total_connections_received"])
    finally:
        admin.close()


def test_decisions_reuse_a_kept_connection(
    backend: types.SimpleNamespace, make_storage: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, borrows, limiter = _counted(backend, make_storage, monkeypatch, "reuse")
    remaining = [limiter.allow("k").remaining for _ in range(50)]
    assert remaining == list(range(99, 49, -1))
    assert borrows[0] == 1
    assert len(storage._spares._idle) == 1


def test_keep_connections_zero_borrows_every_time(
    backend: types.SimpleNamespace, make_storage: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    storage, borrows, limiter = _counted(backend, make_storage, monkeypatch, "borrow", keep_connections=0)
    assert storage._spares is None
    assert [limiter.allow("k").remaining for _ in range(10)] == list(range(99, 89, -1))
    assert borrows[0] == 10


@pytest.mark.parametrize("bad", [-1, True, 2.5, "8", None])
def test_keep_connections_is_validated(redis_server: Any, bad: Any) -> None:
    with pytest.raises(ValidationError, match="keep_connections"):
        RedisStorage(redis_server.client(), keep_connections=bad)


def test_only_the_derived_client_keeps_and_small_or_blocking_pools_keep_fewer(redis_server: Any) -> None:
    import redis

    small = redis.Redis(connection_pool=redis.ConnectionPool(port=redis_server.port, max_connections=3))
    assert RedisStorage(small)._spares._keep == 1  # the derived pool copies max_connections
    assert RedisStorage(small, keep_connections=0)._spares is None
    assert RedisStorage(small, derive=False)._spares is None  # the caller's pool: nothing kept
    tiny = redis.Redis(connection_pool=redis.ConnectionPool(port=redis_server.port, max_connections=1))
    assert RedisStorage(tiny)._spares is None
    blocking = redis.Redis(
        connection_pool=redis.BlockingConnectionPool(port=redis_server.port, max_connections=50, timeout=1)
    )
    through_pool = RedisStorage(blocking)
    assert through_pool._spares is None
    config = LimiterConfig.build("token_bucket", 5, 60.0)
    verdicts = [through_pool.run_kernel(config, "k", 1, None, True) for _ in range(6)]
    assert [v[0] for v in verdicts] == [True] * 5 + [False]  # still decides, through the pool
    for client in (small, tiny, blocking):
        client.close()


def test_a_connection_the_server_closed_is_replaced_before_use(
    backend: types.SimpleNamespace, make_storage: Any, redis_server: Any
) -> None:
    storage = make_storage(on_error="allow")
    limiter = backend.TokenBucket(100, 60.0, storage, rule="killed")
    assert limiter.allow("k").remaining == 99
    admin = redis_server.client()
    killed = admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes")
    admin.close()
    assert killed >= 1
    time.sleep(0.05)  # the server's FIN reaches the kept socket
    d = limiter.allow("k")
    assert not d.degraded and d.remaining == 98
    assert storage.metrics()["errors"] == 0


def test_an_idle_connection_goes_back_through_the_pool(
    backend: types.SimpleNamespace, make_storage: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, borrows, limiter = _counted(backend, make_storage, monkeypatch, "idle")
    limiter.allow("k")
    monkeypatch.setattr(_SpareConnections, "IDLE_CHECK", 0.0)
    time.sleep(0.01)
    assert limiter.allow("k").remaining == 98
    assert borrows[0] == 2  # the first, and the idle one's way back out


def test_a_timeout_drops_the_connection_and_no_late_reply_is_read(
    backend: types.SimpleNamespace, own_server: Any
) -> None:
    storage = RedisStorage(own_server.client(), timeout=0.05, on_error="deny", breaker_threshold=100)
    limiter = backend.TokenBucket(100, 3600.0, storage, rule="late")
    assert limiter.allow("k").remaining == 99
    admin = own_server.client(socket_timeout=10.0)
    sleeper = threading.Thread(target=lambda: admin.execute_command("DEBUG", "SLEEP", "0.3"))
    sleeper.start()
    time.sleep(0.05)
    late = limiter.allow("k")  # the server runs it after its sleep; the reply comes too late
    sleeper.join()
    admin.close()
    assert late.degraded and not late.allowed
    assert storage.metrics()["timeouts"] == 1
    # the late script did run (99 -> 98); what follows reads its own replies
    assert [limiter.allow("k").remaining for _ in range(3)] == [97, 96, 95]


def test_a_reply_error_keeps_the_socket(
    backend: types.SimpleNamespace, make_storage: Any, redis_server: Any
) -> None:
    storage = make_storage(on_error="allow")
    limiter = backend.TokenBucket(100, 60.0, storage, rule="wrongtype")
    limiter.allow("good")
    admin = redis_server.client()
    (name,) = storage.keys()
    admin.set(name.replace("{good}", "{bad}"), "not a hash")
    admin.close()
    before = _received(redis_server)
    d = limiter.allow("bad")  # WRONGTYPE: the server's error reply, read in full
    assert d.degraded and storage.metrics()["errors"] == 1
    assert limiter.allow("good").remaining == 98
    assert _received(redis_server) == before + 1  # only _received's own admin connection


def test_threads_share_kept_connections_and_never_overspend(
    backend: types.SimpleNamespace, make_storage: Any
) -> None:
    storage = make_storage(keep_connections=4)
    limiter = backend.FixedWindowCounter(500, 3600.0, storage, rule="threads")
    allowed = [0] * 8
    start = threading.Barrier(8)

    def work(i: int) -> None:
        start.wait()
        allowed[i] = sum(limiter.allow("shared").allowed for _ in range(100))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(allowed) == 500
    assert 1 <= len(storage._spares._idle) <= 4
    assert storage.metrics()["errors"] == 0


def test_close_and_collection_give_kept_connections_back(
    backend: types.SimpleNamespace, redis_server: Any
) -> None:
    user = redis_server.client()
    storage = RedisStorage(user)
    pool = storage.client.connection_pool
    backend.GCRA(10, 60.0, storage, rule="close").allow("k")
    (kept,) = [entry[0] for entry in storage._spares._idle]
    assert pool._in_use_connections == {kept} and kept._sock is not None
    storage.close()
    assert not pool._in_use_connections and kept._sock is None  # given back, and closed with the pool
    assert user.ping()  # the caller's client is untouched
    dropped = RedisStorage(user)
    dropped_pool = dropped.client.connection_pool
    backend.GCRA(10, 60.0, dropped, rule="close").allow("k")
    assert len(dropped_pool._in_use_connections) == 1
    del dropped
    gc.collect()
    assert not dropped_pool._in_use_connections
    user.close()


def test_a_connection_redis_py_wants_back_goes_through_the_pool(
    backend: types.SimpleNamespace, make_storage: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reconnect flag (a maintenance notice) or a long keep sends a kept
    connection back through the pool, where redis-py acts on its release."""
    storage, borrows, limiter = _counted(backend, make_storage, monkeypatch, "due")
    limiter.allow("k")
    (kept,) = [entry[0] for entry in storage._spares._idle]
    kept.mark_for_reconnect()
    assert limiter.allow("k").remaining == 98
    assert borrows[0] == 2 and not kept.should_reconnect()  # released (and reconnected) by the pool
    monkeypatch.setattr(_SpareConnections, "MAX_KEPT", 0.0)
    assert limiter.allow("k").remaining == 97
    assert borrows[0] == 3


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_never_uses_the_parents_socket(
    backend: types.SimpleNamespace, make_storage: Any
) -> None:
    storage = make_storage()
    parent_limiter = backend.TokenBucket(1000, 3600.0, storage, rule="fork")
    assert parent_limiter.allow("parent").remaining == 999  # a connection is kept now
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: decide on its own key, report, leave at once
        code = 1
        try:
            os.close(read_end)
            assert len(storage._spares._idle) == 0
            got = [parent_limiter.allow("child").remaining for _ in range(200)]
            os.write(write_end, repr(got).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    mine = [parent_limiter.allow("parent").remaining for _ in range(200)]
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_end) as f:
        theirs = f.read()
    assert os.waitstatus_to_exitcode(status) == 0
    assert mine == list(range(998, 798, -1))
    assert theirs == repr(list(range(999, 799, -1)))


def test_commands_are_packed_as_the_connection_would(
    backend: types.SimpleNamespace, make_storage: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With hiredis, a kept connection is sent hiredis's packing directly
    (the same bytes, checked once on a real connection); without it, or
    where the bytes would differ, the connection packs."""
    hiredis = pytest.importorskip("hiredis", reason="the redis extra installs hiredis; CI has it")

    packed = make_storage()
    limiter = backend.TokenBucket(5, 60.0, packed, rule="pack")
    assert limiter.allow("caf\u00e9").remaining == 4
    assert packed._spares._pack is hiredis.pack_command

    monkeypatch.setattr(_connections, "_hiredis_pack", None)  # as if hiredis were missing
    unpacked = make_storage()
    other = backend.TokenBucket(5, 60.0, unpacked, rule="pack")
    assert other.allow("caf\u00e9").remaining == 3  # the same Redis key as above
    assert unpacked._spares._pack is None
    monkeypatch.undo()

    differs = make_storage()
    monkeypatch.setattr(_connections, "_hiredis_pack", lambda args: b"*0\r\n")
    third = backend.TokenBucket(5, 60.0, differs, rule="pack")
    assert third.allow("caf\u00e9").remaining == 2
    assert differs._spares._pack is None


# --------------------------------------------------------------------------
# The asyncio storage: the same on its derived client


def _async_storage(server: Any, **kwargs: Any) -> Any:
    import redis.asyncio

    from nanolimit.storage.redis import AsyncRedisStorage

    kwargs.setdefault("timeout", 2.0)
    kwargs.setdefault("on_error", "raise")
    return AsyncRedisStorage(redis.asyncio.Redis(host="127.0.0.1", port=server.port), **kwargs)


def _count_async_borrows(pool: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    borrows = [0]
    original = pool.get_connection

    async def counted(*args: Any, **kwargs: Any) -> Any:
        borrows[0] += 1
        return await original(*args, **kwargs)

    monkeypatch.setattr(pool, "get_connection", counted)
    return borrows


def test_async_decisions_reuse_a_kept_connection_and_close_gives_it_back(
    backend: types.SimpleNamespace, redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        storage = _async_storage(redis_server)
        await storage.load_scripts()
        pool = storage.client.connection_pool
        borrows = _count_async_borrows(pool, monkeypatch)
        limiter = backend.TokenBucket(100, 60.0, storage, rule="async-reuse")
        remaining = [(await limiter.allow_async("k")).remaining for _ in range(30)]
        assert remaining == list(range(99, 69, -1))
        assert borrows[0] == 1
        assert len(storage._spares._idle) == 1 and len(pool._in_use_connections) == 1
        await storage.close()
        assert len(pool._in_use_connections) == 0

    asyncio.run(main())


def test_async_caller_client_borrows_every_time(
    backend: types.SimpleNamespace, redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        storage = _async_storage(redis_server, derive=False)
        assert storage._spares is None  # a kept connection could only be given back by awaiting
        await storage.load_scripts()
        borrows = _count_async_borrows(storage.client.connection_pool, monkeypatch)
        limiter = backend.TokenBucket(100, 60.0, storage, rule="async-borrow")
        assert [(await limiter.allow_async("k")).remaining for _ in range(5)] == [99, 98, 97, 96, 95]
        assert borrows[0] == 5
        await storage.client.aclose()

    asyncio.run(main())


def test_async_connection_the_server_closed_is_replaced_before_use(
    backend: types.SimpleNamespace, redis_server: Any
) -> None:
    async def main() -> None:
        storage = _async_storage(redis_server, on_error="allow")
        limiter = backend.TokenBucket(100, 60.0, storage, rule="async-killed")
        assert (await limiter.allow_async("k")).remaining == 99
        admin = redis_server.client()
        assert admin.execute_command("CLIENT", "KILL", "TYPE", "normal", "SKIPME", "yes") >= 1
        admin.close()
        await asyncio.sleep(0.05)  # the loop reads the server's FIN
        d = await limiter.allow_async("k")
        assert not d.degraded and d.remaining == 98
        assert storage.metrics()["errors"] == 0
        await storage.close()

    asyncio.run(main())


def test_a_fork_the_hook_missed_is_caught_by_the_pid(
    backend: types.SimpleNamespace, make_storage: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A C-level fork that skips Python's at-fork hooks: the kept
    connections were recorded under another process id, so they are dropped
    unused (the pool resets itself for the new process)."""
    storage, borrows, limiter = _counted(backend, make_storage, monkeypatch, "pid")
    limiter.allow("k")
    (kept,) = [entry[0] for entry in storage._spares._idle]
    storage._spares._pid = -1  # as if recorded by the parent
    assert limiter.allow("k").remaining == 98
    assert borrows[0] == 2
    assert [entry[0] for entry in storage._spares._idle] != [kept]


def test_async_sends_on_the_stream_unless_health_checks_are_due(
    backend: types.SimpleNamespace, redis_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept asyncio connection gets the packed command written to its
    stream (redis-py's send wraps it in a Task per call); a client with
    health checks goes through redis-py's send, which runs them."""
    import redis.asyncio

    from nanolimit.storage.redis import AsyncRedisStorage

    sent_by_redis_py = [0]
    original = redis.asyncio.Connection.send_packed_command

    async def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        sent_by_redis_py[0] += 1
        return await original(self, *args, **kwargs)

    monkeypatch.setattr(redis.asyncio.Connection, "send_packed_command", counted)

    async def main(**client_kwargs: Any) -> int:
        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port, **client_kwargs)
        storage = AsyncRedisStorage(client, timeout=2.0, on_error="raise")
        await storage.load_scripts()
        limiter = backend.GCRA(10, 60.0, storage, rule=f"send{len(client_kwargs)}")
        sent_by_redis_py[0] = 0
        assert [(await limiter.allow_async("k")).remaining for _ in range(5)] == [9, 8, 7, 6, 5]
        await storage.close()
        await client.aclose()
        return sent_by_redis_py[0]

    assert asyncio.run(main()) == 0
    assert asyncio.run(main(health_check_interval=30)) == 5


def test_a_connect_that_fails_with_an_error_reply_is_a_store_failure(
    backend: types.SimpleNamespace, redis_server: Any
) -> None:
    """The pool's own connect can fail with the server's error reply (here
    ``SELECT`` of a database the server does not have): no connection was
    made, so none is kept, and the decision is the failure policy's."""
    import redis
    import redis.asyncio

    from nanolimit.storage.redis import AsyncRedisStorage

    storage = RedisStorage(redis.Redis(host="127.0.0.1", port=redis_server.port, db=99), on_error="deny")
    d = backend.TokenBucket(5, 60.0, storage, rule="db99").allow("k")
    assert d.degraded and not d.allowed and storage.metrics()["errors"] == 1
    assert storage._spares._idle == []

    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port, db=99)
        async_storage = AsyncRedisStorage(client, on_error="deny")
        d = await backend.TokenBucket(5, 60.0, async_storage, rule="db99").allow_async("k")
        assert d.degraded and not d.allowed and async_storage.metrics()["errors"] == 1
        assert async_storage._spares._idle == []
        await async_storage.close()
        await client.aclose()

    asyncio.run(main())
