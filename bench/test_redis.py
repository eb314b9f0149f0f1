"""Redis backend cost, side by side in one run on one throwaway loopback
server: a bare redis-py ``PING`` round trip (the floor), one decision
(``limiter.allow``, one ``EVALSHA``; and ``storage.run_kernel`` without the
limiter glue), a pipelined ``allow_many`` of 100 keys, and a denial answered by
the near-cache.

Targets: one decision ≤ 1.2 × PING (and, for the asyncio client,
≤ 1.2 × its own ``PING``); ``allow_many`` of 100 ≥
100,000 decisions/s; a near-cache denial ≤ 1 µs. ``extra_info`` holds
``us_median`` / ``decisions_per_s`` / ``ratio_to_ping``.

Client and server are pinned to one core (``NANOLIMIT_BENCH_PIN=0`` to
disable): unpinned, every round trip pays for waking an idle core (~70 µs
instead of ~27 µs for PING), which measures the scheduler, not the limiter.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from bench_helpers import pinned_to_one_core
from redis_servers import Server, find_binary

from nanolimit import FakeClock
from nanolimit._limiter_config import LimiterConfig
from nanolimit.storage.redis import RedisStorage

pytestmark = pytest.mark.benchmark(max_time=0.5, min_rounds=5)

HIGH_LIMIT = 1 << 30  # never denied during a run: the allowed path
BATCH = 100
_PING_MEDIAN: dict[str, float] = {}


@pytest.fixture(scope="module", params=["redis", "valkey"])
def server(request: pytest.FixtureRequest) -> Iterator[Server]:
    binary = find_binary(request.param)
    if binary is None:
        pytest.skip(f"!!! {request.param}-server not found: Redis benchmarks NOT run !!!")
    srv = Server(binary, request.param)
    srv.start()
    with pinned_to_one_core(srv):
        yield srv
    srv.stop()


@pytest.fixture(scope="module")
def storage(server: Server) -> Iterator[RedisStorage]:
    client = server.client()
    store = RedisStorage(client)
    store.load_scripts()
    yield store
    store.client.close()
    client.close()


def _record(benchmark: Any, kind: str, per_call: int = 1, ping: bool = False) -> None:
    stats = benchmark.stats.stats if benchmark.stats else None
    if stats is None:
        return
    median = stats.median / per_call
    benchmark.extra_info["us_median"] = round(median * 1e6, 3)
    benchmark.extra_info["decisions_per_s"] = round(1.0 / median)
    if ping:
        _PING_MEDIAN[kind] = median
    elif kind in _PING_MEDIAN and (per_call == 1 or kind.endswith("-asyncio")):
        benchmark.extra_info["ratio_to_ping"] = round(median / _PING_MEDIAN[kind], 3)


def test_ping(benchmark: Any, server: Server, storage: RedisStorage) -> None:
    """The floor: one redis-py round trip on the same (derived) client."""
    benchmark(storage.client.ping)
    _record(benchmark, server.kind, ping=True)


def test_run_kernel(benchmark: Any, server: Server, storage: RedisStorage) -> None:
    """One EVALSHA through the storage seam (no limiter glue)."""
    cfg = LimiterConfig.build("gcra", HIGH_LIMIT, 1.0, rule="bench")
    benchmark(storage.run_kernel, cfg, "user:42", 1, None, True)
    _record(benchmark, server.kind)


@pytest.mark.parametrize("twin_name", ["native", "reference"])
def test_allow(benchmark: Any, server: Server, storage: RedisStorage, twin_name: str) -> None:
    """One decision as a caller makes it: ``limiter.allow(key)``."""
    import importlib

    twin = importlib.import_module("nanolimit._core" if twin_name == "native" else "nanolimit.reference")
    limiter = twin.GCRA(HIGH_LIMIT, 1.0, storage, rule="bench")
    benchmark(limiter.allow, "user:42")
    _record(benchmark, server.kind)


ASYNC_CALLS = 100  # awaited one after another per timed round: the loop's own start is amortised


def _awaited(server: Server, make_call: Any) -> Any:
    """A timed round for the asyncio client: ``ASYNC_CALLS`` awaits of the
    call ``make_call(storage)`` returns, on one event loop that stays up for
    the whole test (an ``AsyncRedisStorage`` belongs to one loop)."""
    import asyncio

    import redis.asyncio

    from nanolimit.storage.redis import AsyncRedisStorage

    loop = asyncio.new_event_loop()
    storage = AsyncRedisStorage(redis.asyncio.Redis(host="127.0.0.1", port=server.port))
    loop.run_until_complete(storage.load_scripts())
    call = make_call(storage)

    async def rounds() -> None:
        for _ in range(ASYNC_CALLS):
            await call()

    loop.run_until_complete(rounds())  # connect, warm up

    def run() -> None:
        loop.run_until_complete(rounds())

    def close() -> None:
        loop.run_until_complete(storage.close())
        loop.close()

    run.close = close  # type: ignore[attr-defined]
    return run


def test_ping_asyncio(benchmark: Any, server: Server) -> None:
    """The asyncio floor: ``await client.ping()`` on the storage's derived client."""
    run = _awaited(server, lambda storage: storage.client.ping)
    benchmark(run)
    run.close()
    _record(benchmark, server.kind + "-asyncio", per_call=ASYNC_CALLS, ping=True)


@pytest.mark.parametrize("twin_name", ["native", "reference"])
def test_allow_asyncio(benchmark: Any, server: Server, twin_name: str) -> None:
    """One decision as an ASGI handler makes it: ``await limiter.allow_async(key)``."""
    import importlib

    twin = importlib.import_module("nanolimit._core" if twin_name == "native" else "nanolimit.reference")

    def make_call(storage: Any) -> Any:
        limiter = twin.GCRA(HIGH_LIMIT, 1.0, storage, rule="bench-asyncio")
        return lambda: limiter.allow_async("user:42")

    run = _awaited(server, make_call)
    benchmark(run)
    run.close()
    _record(benchmark, server.kind + "-asyncio", per_call=ASYNC_CALLS)


@pytest.mark.parametrize("batch", ["script", "pipeline"])
def test_allow_many_100(benchmark: Any, server: Server, batch: str) -> None:
    """100 keys, one round trip: one batch script (default) or a pipeline of
    100 ``EVALSHA``."""
    from nanolimit import reference

    storage = RedisStorage(server.client(), batch=batch)  # type: ignore[arg-type]
    storage.load_scripts()
    limiter = reference.TokenBucket(HIGH_LIMIT, 1.0, storage, rule="batch")
    keys = [f"user:{i}" for i in range(BATCH)]
    result = benchmark(limiter.allow_many, keys)
    assert result.allowed_count == BATCH and not result.degraded
    _record(benchmark, server.kind, per_call=BATCH)


def test_near_cache_denial(benchmark: Any, server: Server) -> None:
    """A hot abusive key, denied locally (storage seam: no limiter glue)."""
    store = RedisStorage(server.client(), near_cache=True, near_cache_ttl=60.0)
    cfg = LimiterConfig.build("token_bucket", 1, 3600.0, rule="abuse")
    store.run_kernel(cfg, "abuser", 1, None, True)
    assert not store.run_kernel(cfg, "abuser", 1, None, True)[0]
    hits = store.metrics()["near_cache_hits"]
    result = benchmark(store.run_kernel, cfg, "abuser", 1, None, True)
    assert not result[0] and store.metrics()["near_cache_hits"] > hits
    _record(benchmark, server.kind)


@pytest.mark.parametrize("twin", ["native", "reference"])
def test_near_cache_denial_via_limiter(benchmark: Any, server: Server, twin: str) -> None:
    """The same denial through ``limiter.allow``: the native limiter calls the
    storage directly, the reference one through its Python glue."""
    import importlib

    module = importlib.import_module("nanolimit._core" if twin == "native" else "nanolimit.reference")
    store = RedisStorage(server.client(), near_cache=True, near_cache_ttl=60.0)
    limiter = module.TokenBucket(1, 3600.0, store, FakeClock(0.0), rule="abuse")
    limiter.allow("abuser")
    assert not limiter.allow("abuser").allowed
    benchmark(limiter.allow, "abuser")
    _record(benchmark, server.kind)
