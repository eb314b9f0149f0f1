"""The ASGI middleware never holds the event loop on I/O.

An ``AsyncRedisStorage`` is awaited; a synchronous ``RedisStorage`` decides
in a worker thread; in-process stores decide inline. The proof that the
loop is free is an ordering, not a stopwatch: with Redis frozen (SIGSTOP),
requests to a Redis-limited route hang until the store's timeout, and
meanwhile every request to an in-memory-limited route on the same server
is answered. A loop held by the frozen store could answer none of them
before the first Redis-limited request gave up.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from typing import Any

import pytest
from adversarial_servers import raw_request, uvicorn_server
from gateway_helpers import post_statuses
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from nanolimit import InMemoryStorage, LimiterFactory, RuleRegistry, ValidationError
from nanolimit.asgi import RateLimitMiddleware
from nanolimit.gateway.rules import RateLimitRule
from nanolimit.storage.redis import AsyncRedisStorage, RedisStorage

pytest_plugins = ["redis_servers"]  # the server fixtures
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

TIMEOUT = 1.5  # the store's socket timeout: how long a frozen Redis holds a request


def rule(name: str, prefix: str, limit: int, **kw: Any) -> RateLimitRule:
    return RateLimitRule(name, "*", prefix, "ip", "fixed_window", limit, 3600.0, **kw)


async def page(request: Any) -> PlainTextResponse:
    return PlainTextResponse("ok", status_code=int(request.query_params.get("status", "200")))


def app_with(storage: Any, *, fast_limit: int = 1000, decide: str | None = None) -> Starlette:
    """/fast limited in memory (outer middleware), /slow on ``storage``."""
    inner = [
        Middleware(
            RateLimitMiddleware,
            registry=RuleRegistry([rule("slow", "/slow", 1000)]),
            factory=LimiterFactory(storage),
            decide=decide,
        )
    ]
    outer = Middleware(
        RateLimitMiddleware,
        registry=RuleRegistry([rule("fast", "/fast", fast_limit)]),
        factory=LimiterFactory(InMemoryStorage()),
    )
    return Starlette(routes=[Route("/fast", page), Route("/slow", page)], middleware=[outer, *inner])


def async_store(server: Any, **kw: Any) -> AsyncRedisStorage:
    import redis.asyncio

    kw.setdefault("timeout", TIMEOUT)
    kw.setdefault("on_error", "deny")
    kw.setdefault("breaker_threshold", 1000)
    return AsyncRedisStorage(redis.asyncio.Redis(host="127.0.0.1", port=server.port), **kw)


def sync_store(server: Any, **kw: Any) -> RedisStorage:
    kw.setdefault("timeout", TIMEOUT)
    kw.setdefault("on_error", "deny")
    kw.setdefault("breaker_threshold", 1000)
    return RedisStorage(server.client(), **kw)


def test_the_decision_mode_follows_the_store(own_server: Any) -> None:
    def mode(storage: Any, **kw: Any) -> str:
        return RateLimitMiddleware(
            page, RuleRegistry([rule("r", "/", 5)]), LimiterFactory(storage), **kw
        ).decide

    assert mode(InMemoryStorage()) == "inline"
    assert mode(sync_store(own_server)) == "thread"
    assert mode(sync_store(own_server), decide="inline") == "inline"
    assert mode(async_store(own_server)) == "await"
    with pytest.raises(ValueError, match="awaited"):
        mode(async_store(own_server), decide="inline")
    with pytest.raises(ValueError, match="decide"):
        mode(InMemoryStorage(), decide="later")


@pytest.mark.parametrize("make", [async_store, sync_store], ids=["async", "sync"])
def test_a_status_the_server_cannot_read_settles_a_redis_charge_as_500(own_server: Any, make: Any) -> None:
    """Awaited and threaded settling read the status before marking the
    charge settled: a start whose status int() rejects settles as 500, as
    the inline path does, and never leaves a count_when charge spent."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": "OK", "headers": []})

    registry = RuleRegistry([rule("fails", "/login", 3, count_when={401})])
    mw = RateLimitMiddleware(app, registry, LimiterFactory(make(own_server, on_error="raise")))

    assert mw.decide in ("await", "thread")
    assert asyncio.run(post_statuses(mw, 5)) == [500] * 5


@pytest.mark.parametrize("make", [async_store, sync_store], ids=["async", "sync"])
def test_a_redis_limit_decides_through_the_asgi_path(own_server: Any, make: Any) -> None:
    storage = make(own_server, on_error="raise")
    registry = RuleRegistry([rule("slow", "/slow", 3), rule("fails", "/fast", 2, count_when={401})])
    app = Starlette(
        routes=[Route("/fast", page), Route("/slow", page)],
        middleware=[Middleware(RateLimitMiddleware, registry=registry, factory=LimiterFactory(storage))],
    )
    with TestClient(app) as client:
        assert [client.get("/slow").status_code for _ in range(4)] == [200, 200, 200, 429]
        # counting by response: successes are refunded through the store's own refund
        assert [client.get("/fast").status_code for _ in range(5)] == [200] * 5
        assert [client.get("/fast?status=401").status_code for _ in range(3)] == [401, 401, 429]


def test_an_async_store_refuses_compound_limits(own_server: Any) -> None:
    registry = RuleRegistry([rule("a", "/", 5), rule("b", "/slow", 5)], stacked=True)
    app = Starlette(
        routes=[Route("/slow", page)],
        middleware=[
            Middleware(
                RateLimitMiddleware, registry=registry, factory=LimiterFactory(async_store(own_server))
            )
        ],
    )
    with TestClient(app) as client, pytest.raises(ValidationError, match="compound"):
        client.get("/slow")


@pytest.mark.parametrize("make", [async_store, sync_store], ids=["async", "sync"])
def test_a_frozen_redis_never_holds_requests_under_in_memory_rules(own_server: Any, make: Any) -> None:
    app = app_with(make(own_server))
    with uvicorn_server(app) as port:
        assert raw_request(port, "GET", b"/slow").status == 200  # Redis answers while alive
        assert own_server.proc is not None
        slow_done: list[tuple[float, int]] = []
        fast_done: list[tuple[float, int]] = []
        lock = threading.Lock()

        def slow() -> None:
            status = raw_request(port, "GET", b"/slow").status
            with lock:
                slow_done.append((time.monotonic(), status))

        os.kill(own_server.proc.pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            slow_threads = [threading.Thread(target=slow) for _ in range(4)]
            for t in slow_threads:
                t.start()
            time.sleep(0.1)  # the slow requests are in flight, waiting on the frozen store
            for _ in range(20):
                status = raw_request(port, "GET", b"/fast").status
                fast_done.append((time.monotonic(), status))
            for t in slow_threads:
                t.join(TIMEOUT * 10)
        finally:
            os.kill(own_server.proc.pid, signal.SIGCONT)
    assert [s for _, s in fast_done] == [200] * 20
    assert len(slow_done) == 4 and {s for _, s in slow_done} == {429}  # answered by policy: deny
    first_slow = min(t for t, _ in slow_done)
    assert max(t for t, _ in fast_done) < first_slow  # every fast request beat the frozen store
    assert first_slow - started >= TIMEOUT * 0.5  # the slow ones really waited on the store
    assert max(t for t, _ in slow_done) - started < TIMEOUT * 6  # and gave up by the timeout
