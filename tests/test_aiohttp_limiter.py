"""nanolimit.aiohttp through real aiohttp servers on 127.0.0.1 (aiohttp's
TestServer, started and closed by each test, every run bounded by a
timeout): prefix rules, limits declared on routes (templates, exempt,
shared budgets, class-based views, sub-apps), cost, counting by response
under concurrent connections, denials the app controls, headers off and
renamed, a bad declaration failing the startup, shaping, and Redis
decisions kept off the event loop."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time
import types
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from gateway_helpers import aiohttp_startup

import nanolimit.aiohttp as nl_aiohttp
from nanolimit import LimiterFactory, RuleRegistry, ValidationError
from nanolimit.errors import RuleValidationError
from nanolimit.gateway.metrics import Metrics
from nanolimit.gateway.middleware import Outcome, Request
from nanolimit.gateway.routes import RouteLimits
from nanolimit.gateway.rules import RateLimitRule

pytest_plugins = ["redis_servers"]  # the server fixtures

T = TypeVar("T")
RATE = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "RateLimit-Policy")


def rule(name: str = "api", limit: int = 10, window: float = 60.0, **kw: Any) -> RateLimitRule:
    return RateLimitRule(
        name,
        kw.pop("method", "*"),
        kw.pop("path_prefix", "/"),
        kw.pop("scope", "ip"),
        kw.pop("algorithm", "fixed_window"),
        limit,
        window,
        kw.pop("burst", None),
        **kw,
    )


def factory(backend: types.SimpleNamespace) -> LimiterFactory:
    return LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(1_000.0))


def serve(app: web.Application, body: Callable[[TestClient[Any, Any]], Awaitable[T]]) -> T:
    """Run ``body`` against ``app`` served on a loopback port; the server is
    closed on the way out, and the whole run is bounded."""

    async def main() -> T:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            return await body(client)

    return asyncio.run(asyncio.wait_for(main(), 60.0))


async def statuses(client: TestClient[Any, Any], path: str, n: int, method: str = "GET") -> list[int]:
    out = []
    for _ in range(n):
        async with client.request(method, path) as r:
            out.append(r.status)
    return out


async def hello(request: web.Request) -> web.Response:
    return web.Response(text="hello", headers={"X-App": "yes"})


# ---------------------------------------------------------------------------
# Prefix rules


def test_a_prefix_rule_admits_then_answers_the_429_json_with_headers(backend: types.SimpleNamespace) -> None:
    app = web.Application()
    app.router.add_get("/api/items", hello)
    app.router.add_get("/open", hello)
    mw = nl_aiohttp.setup(app, RuleRegistry([rule("api", 2, path_prefix="/api")]), factory(backend))

    async def body(client: TestClient[Any, Any]) -> Any:
        out = []
        for _ in range(3):
            async with client.get("/api/items") as r:
                out.append((r.status, dict(r.headers), await r.read()))
        async with client.get("/open") as r:
            out.append((r.status, dict(r.headers), await r.read()))
        return out

    (s1, h1, b1), (s2, h2, _), (s3, h3, b3), (s4, h4, _) = serve(app, body)
    assert (s1, s2, s3, s4) == (200, 200, 429, 200)
    assert b1 == b"hello" and h1["X-App"] == "yes"  # the handler's own response, headers added
    assert h1["X-RateLimit-Limit"] == "2" and h1["X-RateLimit-Remaining"] == "1"
    assert h2["X-RateLimit-Remaining"] == "0" and "RateLimit-Policy" in h2
    assert h3["Content-Type"].startswith("application/json") and int(h3["Retry-After"]) >= 1
    denial = json.loads(b3)
    assert denial["error"] == "rate_limit_exceeded" and denial["rule"] == "api"
    assert denial["retry_after"] == int(h3["Retry-After"])
    assert not any(k in h4 for k in RATE)  # no rule covers /open: unlimited, no headers
    snapshot = mw.metrics.snapshot()["api"]
    assert snapshot["allowed"] == 2 and snapshot["denied"] == 1


def test_the_client_is_the_peer_never_a_forwarded_header(backend: types.SimpleNamespace) -> None:
    app = web.Application(middlewares=[nl_aiohttp.rate_limit_middleware(RuleRegistry([rule("api", 2)]))])
    app.router.add_get("/", hello)

    async def body(client: TestClient[Any, Any]) -> list[int]:
        out = []
        for i in range(4):  # a new X-Forwarded-For each time buys nothing
            async with client.get("/", headers={"X-Forwarded-For": f"203.0.113.{i}"}) as r:
                out.append(r.status)
        return out

    assert serve(app, body) == [200, 200, 429, 429]


def test_a_404_is_still_limited_by_its_prefix(backend: types.SimpleNamespace) -> None:
    app = web.Application()
    app.router.add_get("/", hello)
    nl_aiohttp.setup(app, RuleRegistry([rule("all", 2)]), factory(backend))
    assert serve(app, lambda c: statuses(c, "/missing", 3)) == [404, 404, 429]


# ---------------------------------------------------------------------------
# Limits declared on routes


def declared_app(limits: RouteLimits) -> web.Application:
    routes = web.RouteTableDef()

    @routes.get("/users/{id}/avatar")
    @limits.limit("2/minute")
    async def avatar(request: web.Request) -> web.Response:
        return web.json_response({"id": request.match_info["id"]})

    @routes.get("/health")
    @limits.exempt
    async def health(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    search = limits.shared("3/minute", name="search")

    @routes.get("/search/users")
    @search
    async def search_users(request: web.Request) -> web.Response:
        return web.Response(text="users")

    @routes.get("/search/orders")
    @search
    async def search_orders(request: web.Request) -> web.Response:
        return web.Response(text="orders")

    @routes.view("/things")
    @limits.limit("1/minute", methods=["POST"])
    class Things(web.View):
        async def get(self) -> web.Response:
            return web.Response(text="list")

        async def post(self) -> web.Response:
            return web.Response(text="made", status=201)

    @routes.get("/plain")
    async def plain(request: web.Request) -> web.Response:
        return web.Response(text="plain")

    app = web.Application()
    app.add_routes(routes)
    admin = web.Application()

    @limits.limit("1/minute")
    async def panel(request: web.Request) -> web.Response:
        return web.Response(text="panel")

    admin.router.add_get("/panel/{section}", panel)
    app.add_subapp("/admin", admin)
    return app


def test_route_declarations_templates_exempt_shared_views_and_sub_apps(
    backend: types.SimpleNamespace,
) -> None:
    limits = RouteLimits(RuleRegistry([rule("global", 100)], stacked=True), algorithm="fixed_window")
    app = declared_app(limits)
    nl_aiohttp.setup(app, limits=limits, factory=factory(backend))

    async def body(client: TestClient[Any, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        out["avatar"] = [(await client.get(f"/users/{i}/avatar")).status for i in (1, 2, 3)]
        health = [await client.get("/health") for _ in range(5)]
        out["health"] = [r.status for r in health]
        out["health_headers"] = [k for k in RATE if k in health[0].headers]
        out["search"] = [(await client.get(p)).status for p in ("/search/users", "/search/orders") * 2]
        out["things"] = [(await client.request(m, "/things")).status for m in ("POST", "POST", "GET", "GET")]
        out["admin"] = [(await client.get(f"/admin/panel/{s}")).status for s in ("a", "b")]
        plain = await client.get("/plain")
        out["plain"] = (plain.status, plain.headers.get("X-RateLimit-Limit"))
        return out

    out = serve(app, body)
    assert out["avatar"] == [200, 200, 429]  # every user id spends one budget
    assert out["health"] == [200] * 5 and out["health_headers"] == []  # exempt even from the stacked global
    assert out["search"] == [200, 200, 200, 429]  # two routes, one shared budget of 3
    assert out["things"] == [201, 429, 200, 200]  # the view's limit covers POST only
    assert out["admin"] == [200, 429]  # a sub-app's template carries its prefix
    assert out["plain"] == (200, "100")  # only the global rule
    names = {r.name for r in limits.registry.rules()}
    assert "search" in names and any(n.endswith("avatar") for n in names)


def test_a_limit_on_one_of_two_handlers_sharing_a_path_is_that_handlers_alone(
    backend: types.SimpleNamespace,
) -> None:
    """add_get and add_post on one path: the POST handler's limit neither
    limits the GET (nor its HEAD) nor is spent by it (docs/routes.md)."""
    limits = RouteLimits(algorithm="fixed_window")

    async def form(request: web.Request) -> web.Response:
        return web.Response(text="form")

    @limits.limit("3/minute")
    async def submit(request: web.Request) -> web.Response:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/login", form)
    app.router.add_post("/login", submit)
    nl_aiohttp.setup(app, limits=limits, factory=factory(backend))

    async def body(client: TestClient[Any, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {"get": await statuses(client, "/login", 5)}
        out["get_headers"] = [k for k in RATE if k in (await client.get("/login")).headers]
        out["head"] = await statuses(client, "/login", 2, "HEAD")
        out["post"] = await statuses(client, "/login", 4, "POST")
        out["get_after"] = (await client.get("/login")).status
        return out

    out = serve(app, body)
    assert out["get"] == [200] * 5 and out["get_headers"] == [] and out["head"] == [200] * 2
    assert out["post"] == [200, 200, 200, 429]
    assert out["get_after"] == 200


def test_routes_of_reads_templates_methods_and_views() -> None:
    limits = RouteLimits()
    app = declared_app(limits)
    routes = {(r.template, tuple(sorted(r.methods))) for r in nl_aiohttp.routes_of(app)}
    assert ("/users/{id}/avatar", ("GET",)) in routes
    assert ("/users/{id}/avatar", ("HEAD",)) in routes  # aiohttp's add_get answers HEAD too
    assert ("/things", ()) in routes  # a web.View answers every method
    assert ("/admin/panel/{section}", ("GET",)) in routes


def test_a_template_matching_no_route_fails_the_startup_naming_the_rule() -> None:
    app = web.Application()
    app.router.add_get("/login", hello)
    registry = RuleRegistry([rule("login", 5, routes=("/signin",))])
    nl_aiohttp.setup(app, registry)

    with pytest.raises(RuleValidationError, match=r"rule 'login'.*'/signin' matches no route of the app"):
        aiohttp_startup(app)


def test_a_limit_on_a_method_of_a_web_view_fails_the_startup() -> None:
    """``@limits.limit`` on ``async def post`` of a ``web.View`` bound to
    nothing: the POSTs ran unlimited. The startup fails, naming it."""
    limits = RouteLimits()

    class Things(web.View):
        @limits.limit("2/minute")
        async def post(self) -> web.Response:
            return web.Response(text="made")

    app = web.Application()
    app.router.add_view("/things", Things)
    nl_aiohttp.setup(app, limits=limits)

    with pytest.raises(ValidationError, match=r"Things\.post declares a limit.*methods=\['POST'\]"):
        aiohttp_startup(app)


def test_a_middleware_listed_before_setups_answers_unlimited() -> None:
    """docs/aiohttp.md: ``setup`` appends nanolimit's middleware, so one the
    app lists already runs first, and what it answers by itself (an API-key
    check's 401) never reaches the limit; one appended after ``setup`` is
    limited."""

    @web.middleware
    async def api_key(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.headers.get("X-Key") != "secret":
            raise web.HTTPUnauthorized()
        return await handler(request)

    async def statuses(first: bool) -> list[int]:
        app = web.Application(middlewares=[api_key] if first else [])
        app.router.add_post("/login", hello)
        nl_aiohttp.setup(app, RuleRegistry([rule("login", 3, count_when=frozenset({401}))]))
        if not first:
            app.middlewares.append(api_key)
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            return [(await client.post("/login")).status for _ in range(5)]

    assert asyncio.run(asyncio.wait_for(statuses(first=False), 30.0)) == [401, 401, 401, 429, 429]
    assert asyncio.run(asyncio.wait_for(statuses(first=True), 30.0)) == [401] * 5


def test_without_setup_the_first_request_binds_and_a_good_template_decides() -> None:
    app = web.Application()
    app.router.add_get("/users/{name}", hello)
    registry = RuleRegistry([rule("users", 1, routes=("/users/<name>",))])
    app.middlewares.append(nl_aiohttp.rate_limit_middleware(registry))
    assert serve(app, lambda c: statuses(c, "/users/ann", 2)) == [200, 429]


# ---------------------------------------------------------------------------
# Cost


def test_a_static_cost_and_a_callable_reading_the_aiohttp_request(backend: types.SimpleNamespace) -> None:
    seen: list[Any] = []

    def items(request: Request) -> int:
        seen.append(request.native)
        return int(request.native.query.get("n", "1"))

    limits = RouteLimits(algorithm="fixed_window")
    app = web.Application()

    @limits.limit("10/minute", cost=5)
    async def search(request: web.Request) -> web.Response:
        return web.Response(text="found")

    @limits.limit("100/minute", cost=items)
    async def export(request: web.Request) -> web.Response:
        return web.Response(text="exported")

    app.router.add_get("/search", search)
    app.router.add_get("/export", export)
    nl_aiohttp.setup(app, limits=limits, factory=factory(backend))

    async def body(client: TestClient[Any, Any]) -> tuple[list[int], list[int], str]:
        first = await statuses(client, "/search", 3)
        second = [(await client.get(f"/export?n={n}")).status for n in (60, 60, 40)]
        remaining = (await client.get("/export?n=1")).headers.get("X-RateLimit-Remaining", "")
        return first, second, remaining

    first, second, remaining = serve(app, body)
    assert first == [200, 200, 429]  # the seed demo: cost 5 against 10
    assert second == [200, 429, 200]
    assert remaining == "0"  # 60 + 40 spent all 100: the 429 for one more says none is left
    assert all(isinstance(native, web.Request) for native in seen)


def test_a_cost_above_the_limit_is_a_429_that_says_why(backend: types.SimpleNamespace) -> None:
    app = web.Application()
    app.router.add_get("/bulk", hello)
    nl_aiohttp.setup(app, RuleRegistry([rule("bulk", 10, cost=lambda r: 11)]), factory(backend))

    async def body(client: TestClient[Any, Any]) -> tuple[int, dict[str, str], Any]:
        async with client.get("/bulk") as r:
            return r.status, dict(r.headers), await r.json()

    status, headers, denial = serve(app, body)
    assert status == 429 and "Retry-After" not in headers  # no wait would let it pass
    assert denial["reason"] == "cost_exceeds_limit" and denial["cost"] == 11 and denial["limit"] == 10
    assert denial["rule"] == "bulk" and denial["retry_after"] is None


# ---------------------------------------------------------------------------
# Counting by response


def test_eight_concurrent_connections_never_admit_more_failed_logins_than_the_budget(
    backend: types.SimpleNamespace,
) -> None:
    limits = RouteLimits(algorithm="fixed_window")
    app = web.Application()

    @limits.limit("10/hour", count_when={401})
    async def login(request: web.Request) -> web.Response:
        await asyncio.sleep(0.005)  # the requests overlap: the charge is taken before the status is known
        if request.query.get("ok") != "true":
            raise web.HTTPUnauthorized()
        return web.Response(text="token")

    app.router.add_post("/login", login)
    nl_aiohttp.setup(app, limits=limits, factory=factory(backend))
    results: Counter[tuple[str, int]] = Counter()

    async def body(client: TestClient[Any, Any]) -> None:
        async def worker(index: int) -> None:
            for i in range(12):
                ok = (index + i) % 2 == 0
                async with client.post("/login?ok=true" if ok else "/login") as r:
                    await r.read()
                    results[("ok" if ok else "fail", r.status)] += 1

        await asyncio.gather(*(worker(n) for n in range(8)))
        # Alone now: what the successes held in flight was given back, so
        # failures are admitted again until exactly the budget has failed.
        after = []
        for _ in range(11):
            async with client.post("/login") as r:
                after.append(r.status)
                if r.status == 429:
                    break
        return after

    after = serve(app, body)
    concurrent_failures = results[("fail", 401)]
    assert 1 <= concurrent_failures <= 10  # never more failures admitted than the budget
    assert sum(results.values()) == 96
    assert results[("ok", 200)] >= 1  # successes admitted while budget was left were refunded
    assert after == [401] * (10 - concurrent_failures) + [429]  # no unit leaked: 10 failures in all


def test_a_raised_http_exception_counts_with_its_status_and_carries_the_headers(
    backend: types.SimpleNamespace,
) -> None:
    app = web.Application()

    async def login(request: web.Request) -> web.Response:
        if request.query.get("ok") != "true":
            raise web.HTTPForbidden()
        return web.Response(text="token")

    async def boom(request: web.Request) -> web.Response:
        raise RuntimeError("boom")

    app.router.add_post("/login", login)
    app.router.add_get("/boom", boom)
    registry = RuleRegistry(
        [
            rule("login", 2, path_prefix="/login", count_when={403}),
            rule("errors", 2, path_prefix="/boom", count_when=lambda status: status >= 500),
        ]
    )
    nl_aiohttp.setup(app, registry, factory(backend))

    async def body(client: TestClient[Any, Any]) -> tuple[list[int], str | None, list[int]]:
        logins = [(await client.post(p)).status for p in ("/login?ok=true",) * 3]
        forbidden = await client.post("/login")
        logins.append(forbidden.status)
        logins += [(await client.post("/login")).status for _ in range(2)]
        errors = await statuses(client, "/boom", 3)
        return logins, forbidden.headers.get("X-RateLimit-Limit"), errors

    logins, limit_header, errors = serve(app, body)
    assert logins == [200, 200, 200, 403, 403, 429]  # successes never count, two 403s do
    assert limit_header == "2"  # the HTTPException's response has the rate-limit headers
    assert errors == [500, 500, 429]  # a handler that raises counts as a 500


def test_a_streamed_response_gets_the_headers_before_they_are_sent(backend: types.SimpleNamespace) -> None:
    async def stream(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse()
        await response.prepare(request)
        await response.write(b"chunk")
        return response

    app = web.Application()
    app.router.add_get("/stream", stream)
    nl_aiohttp.setup(app, RuleRegistry([rule("stream", 3)]), factory(backend))

    async def body(client: TestClient[Any, Any]) -> tuple[int, str | None, bytes]:
        async with client.get("/stream") as r:
            return r.status, r.headers.get("X-RateLimit-Remaining"), await r.read()

    assert serve(app, body) == (200, "2", b"chunk")


# ---------------------------------------------------------------------------
# Denials the app controls


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_the_deny_hook_answers_denials(backend: types.SimpleNamespace, kind: str) -> None:
    seen: list[tuple[str, Any]] = []

    def answer(request: Request, outcome: Outcome) -> web.StreamResponse | None:
        seen.append((outcome.rule, request.native))
        if request.path == "/default":
            return None  # the stock 429
        return web.json_response({"slow": "down", "rule": outcome.rule}, status=429)

    async def answer_async(request: Request, outcome: Outcome) -> web.StreamResponse | None:
        await asyncio.sleep(0)
        return answer(request, outcome)

    app = web.Application()
    app.router.add_get("/custom", hello)
    app.router.add_get("/default", hello)
    nl_aiohttp.setup(
        app,
        RuleRegistry([rule("api", 1)]),
        factory(backend),
        deny=answer if kind == "sync" else answer_async,
    )

    async def body(client: TestClient[Any, Any]) -> list[tuple[int, Any, str | None]]:
        out = []
        for path in ("/custom", "/custom", "/default"):
            async with client.get(path) as r:
                out.append(
                    (r.status, await r.json() if r.status == 429 else None, r.headers.get("Retry-After"))
                )
        return out

    first, custom, default = serve(app, body)
    assert first[0] == 200
    assert custom[0] == 429 and custom[1] == {"slow": "down", "rule": "api"}
    assert custom[2] is not None  # the hook's response still says when to come back
    assert default[0] == 429 and default[1]["error"] == "rate_limit_exceeded"
    assert [rule_name for rule_name, _ in seen] == ["api", "api"]
    assert all(isinstance(native, web.Request) for _, native in seen)


def test_a_deny_hook_returning_no_response_is_a_clear_error(backend: types.SimpleNamespace) -> None:
    app = web.Application()
    app.router.add_get("/", hello)
    nl_aiohttp.setup(app, RuleRegistry([rule("api", 1)]), factory(backend), deny=lambda r, o: "slow down")
    assert serve(app, lambda c: statuses(c, "/", 2)) == [200, 500]  # the TypeError is aiohttp's 500


def test_a_request_factory_gives_user_scoped_rules_their_user(backend: types.SimpleNamespace) -> None:
    import dataclasses

    user_key = web.RequestKey("user", str)

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        request[user_key] = request.headers.get("X-User", "")  # what an auth middleware would verify
        return await handler(request)

    def with_user(request: web.Request) -> Request:
        return dataclasses.replace(nl_aiohttp.request_from_aiohttp(request), user=request.get(user_key))

    app = web.Application(middlewares=[auth])
    app.router.add_get("/", hello)
    nl_aiohttp.setup(
        app, RuleRegistry([rule("per-user", 1, scope="user")]), factory(backend), request_factory=with_user
    )

    async def body(client: TestClient[Any, Any]) -> list[int]:
        out = []
        for user in ("ann", "ann", "bob"):
            async with client.get("/", headers={"X-User": user}) as r:
                out.append(r.status)
        return out

    assert serve(app, body) == [200, 429, 200]  # one budget per user, not per connection


def test_headers_off_and_renamed(backend: types.SimpleNamespace) -> None:
    quiet = web.Application()
    quiet.router.add_get("/", hello)
    nl_aiohttp.setup(quiet, RuleRegistry([rule("api", 1)]), factory(backend), headers=False)
    renamed = web.Application()
    renamed.router.add_get("/", hello)
    nl_aiohttp.setup(
        renamed,
        RuleRegistry([rule("api", 1)]),
        factory(backend),
        header_names={"X-RateLimit-Limit": "X-Limit", "Retry-After": "X-Wait"},
    )

    async def two(client: TestClient[Any, Any]) -> list[tuple[int, dict[str, str]]]:
        out = []
        for _ in range(2):
            async with client.get("/") as r:
                out.append((r.status, dict(r.headers)))
        return out

    (s1, h1), (s2, h2) = serve(quiet, two)
    assert (s1, s2) == (200, 429)
    assert not any(k.lower().startswith(("x-ratelimit", "ratelimit")) for k in (*h1, *h2))
    assert "Retry-After" in h2  # a 429 still says when
    (s1, h1), (s2, h2) = serve(renamed, two)
    assert (s1, s2) == (200, 429)
    assert h1["X-Limit"] == "1" and "X-RateLimit-Limit" not in h1 and "X-RateLimit-Remaining" in h1
    assert "X-Wait" in h2 and "Retry-After" not in h2


def test_on_breach_and_shared_metrics(backend: types.SimpleNamespace) -> None:
    metrics = Metrics()
    breaches: list[str] = []
    app = web.Application()
    app.router.add_get("/", hello)
    mw = nl_aiohttp.setup(
        app,
        RuleRegistry([rule("api", 1)]),
        factory(backend),
        metrics=metrics,
        on_breach=lambda request, outcome: breaches.append(outcome.rule),
    )
    assert serve(app, lambda c: statuses(c, "/", 3)) == [200, 429, 429]
    assert mw.metrics is metrics and metrics.snapshot()["api"]["denied"] == 2
    assert breaches == ["api", "api"]


# ---------------------------------------------------------------------------
# Shaping


def test_a_shaping_leaky_bucket_awaits_its_delay(backend: types.SimpleNamespace) -> None:
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)

    app = web.Application()
    app.router.add_get("/", hello)
    nl_aiohttp.setup(
        app,
        RuleRegistry([rule("shape", 4, 1.0, algorithm="leaky_bucket")]),
        factory(backend),
        sleep=fake_sleep,
    )
    assert serve(app, lambda c: statuses(c, "/", 5)) == [200] * 4 + [429]
    assert waits == pytest.approx([0.25, 0.5, 0.75])


def test_the_real_asyncio_sleep_delays_the_request(backend: types.SimpleNamespace) -> None:
    app = web.Application()
    app.router.add_get("/", hello)
    nl_aiohttp.setup(app, RuleRegistry([rule("shape", 20, 1.0, algorithm="leaky_bucket")]), factory(backend))

    async def body(client: TestClient[Any, Any]) -> float:
        await statuses(client, "/", 2)
        start = time.perf_counter()
        await client.get("/")
        return time.perf_counter() - start

    assert serve(app, body) >= 0.09  # the third request waited 2 / 20 s (the FakeClock stands still)


# ---------------------------------------------------------------------------
# Stores and arguments


TIMEOUT = 1.5  # the Redis stores' socket timeout: how long a frozen server holds a request


def sync_store(server: Any, **kw: Any) -> Any:
    from nanolimit.storage.redis import RedisStorage

    kw.setdefault("timeout", TIMEOUT)
    kw.setdefault("breaker_threshold", 1000)
    return RedisStorage(server.client(), **kw)


def async_store(server: Any, **kw: Any) -> Any:
    import redis.asyncio

    from nanolimit.storage.redis import AsyncRedisStorage

    kw.setdefault("timeout", TIMEOUT)
    kw.setdefault("breaker_threshold", 1000)
    return AsyncRedisStorage(redis.asyncio.Redis(host="127.0.0.1", port=server.port), **kw)


def test_the_decision_mode_follows_the_store(own_server: Any) -> None:
    def mode(storage: Any, **kw: Any) -> str:
        return nl_aiohttp.rate_limit_middleware(RuleRegistry([rule()]), LimiterFactory(storage), **kw).decide

    from nanolimit import InMemoryStorage

    assert mode(InMemoryStorage()) == "inline"
    assert mode(sync_store(own_server)) == "thread"
    assert mode(sync_store(own_server), decide="inline") == "inline"
    assert mode(InMemoryStorage(), decide="thread") == "thread"
    assert mode(async_store(own_server)) == "await"
    with pytest.raises(ValidationError, match="awaited"):
        mode(async_store(own_server), decide="thread")
    with pytest.raises(ValidationError, match="decide"):
        mode(InMemoryStorage(), decide="later")


def test_a_sync_redis_store_decides_in_a_worker_thread(make_storage: Any) -> None:
    on_main: list[bool] = []
    main = threading.main_thread()

    def cost(request: Request) -> int:
        on_main.append(threading.current_thread() is main)
        return 1

    app = web.Application()
    app.router.add_get("/", hello)
    app.router.add_get("/fails", hello)
    registry = RuleRegistry(
        [
            rule("redis-api", 2, path_prefix="/", cost=cost),
            rule("fails", 1, path_prefix="/fails", count_when={401}),
        ]
    )
    mw = nl_aiohttp.setup(app, registry, LimiterFactory(make_storage()))
    assert mw.decide == "thread"

    async def body(client: TestClient[Any, Any]) -> tuple[list[int], list[int]]:
        return await statuses(client, "/", 3), await statuses(client, "/fails", 4)

    limited, fails = serve(app, body)
    assert limited == [200, 200, 429]
    assert on_main and not any(on_main)  # the loop thread never ran a decision
    assert fails == [200] * 4  # 200s do not count under count_when={401}: each refunded through Redis


def test_an_async_redis_store_is_awaited(redis_server: Any) -> None:
    async def login(request: web.Request) -> web.Response:
        if request.query.get("ok") != "true":
            raise web.HTTPUnauthorized()
        return web.Response(text="token")

    app = web.Application()
    app.router.add_get("/", hello)
    app.router.add_post("/login", login)
    registry = RuleRegistry(
        [rule("api", 3, path_prefix="/"), rule("login", 2, path_prefix="/login", count_when={401})]
    )
    storage = async_store(redis_server, on_error="raise")
    mw = nl_aiohttp.setup(app, registry, LimiterFactory(storage))
    assert mw.decide == "await"

    async def body(client: TestClient[Any, Any]) -> tuple[list[int], list[int]]:
        try:
            first = await statuses(client, "/", 4)
            logins = [(await client.post("/login?ok=true")).status for _ in range(3)]
            logins += [(await client.post("/login")).status for _ in range(3)]
            return first, logins
        finally:
            await storage.close()

    first, logins = serve(app, body)
    assert first == [200, 200, 200, 429]
    assert logins == [200, 200, 200, 401, 401, 429]  # successes refunded by the store's own refund


@pytest.mark.parametrize("make", [async_store, sync_store], ids=["async", "sync"])
def test_a_frozen_redis_never_holds_requests_under_in_memory_rules(own_server: Any, make: Any) -> None:
    """The loop is free while Redis is frozen (SIGSTOP): an ordering, not a
    stopwatch. Requests to a Redis-limited route wait on the store until its
    timeout; meanwhile every request to an in-memory-limited route of the
    same server is answered. Client and server share one loop, so a loop
    held by the store could answer none of them first."""
    from nanolimit import InMemoryStorage

    app = web.Application()
    app.router.add_get("/fast", hello)
    app.router.add_get("/slow", hello)
    storage = make(own_server, on_error="deny")
    nl_aiohttp.setup(
        app, RuleRegistry([rule("fast", 1000, path_prefix="/fast")]), LimiterFactory(InMemoryStorage())
    )
    nl_aiohttp.setup(app, RuleRegistry([rule("slow", 1000, path_prefix="/slow")]), LimiterFactory(storage))
    assert own_server.proc is not None
    pid = own_server.proc.pid

    async def body(
        client: TestClient[Any, Any],
    ) -> tuple[float, list[tuple[float, int]], list[tuple[float, int]]]:
        assert (await client.get("/slow")).status == 200  # Redis answers while alive
        slow_done: list[tuple[float, int]] = []
        fast_done: list[tuple[float, int]] = []

        async def slow() -> None:
            async with client.get("/slow") as r:
                slow_done.append((time.monotonic(), r.status))

        os.kill(pid, signal.SIGSTOP)
        try:
            started = time.monotonic()
            tasks = [asyncio.create_task(slow()) for _ in range(4)]
            await asyncio.sleep(0.1)  # the slow requests are in flight, waiting on the frozen store
            for _ in range(20):
                async with client.get("/fast") as r:
                    fast_done.append((time.monotonic(), r.status))
            await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT * 10)
        finally:
            os.kill(pid, signal.SIGCONT)
        if hasattr(storage, "close") and asyncio.iscoroutinefunction(storage.close):
            await storage.close()
        return started, slow_done, fast_done

    started, slow_done, fast_done = serve(app, body)
    assert [s for _, s in fast_done] == [200] * 20
    assert len(slow_done) == 4 and {s for _, s in slow_done} == {429}  # answered by policy: deny
    first_slow = min(t for t, _ in slow_done)
    assert max(t for t, _ in fast_done) < first_slow  # every fast request beat the frozen store
    assert first_slow - started >= TIMEOUT * 0.5  # the slow ones really waited on the store
    assert max(t for t, _ in slow_done) - started < TIMEOUT * 6  # and gave up by the timeout


def test_bad_arguments_are_clear_errors() -> None:
    limits = RouteLimits()
    with pytest.raises(ValidationError, match="limits must be a RouteLimits"):
        nl_aiohttp.rate_limit_middleware(limits="5/minute")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="registry must be a RuleRegistry"):
        nl_aiohttp.rate_limit_middleware("rules.toml", limits=limits)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="needs a registry"):
        nl_aiohttp.rate_limit_middleware()
    with pytest.raises(ValidationError, match="deny must be callable"):
        nl_aiohttp.rate_limit_middleware(RuleRegistry([rule()]), deny="no")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match=r"web\.Application"):
        nl_aiohttp.setup(object(), RuleRegistry([rule()]))  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="header_names"):
        nl_aiohttp.rate_limit_middleware(RuleRegistry([rule()]), header_names={"X-Nope": "X"})
    app = web.Application()
    before = (len(app.middlewares), len(app.on_startup), len(app.on_response_prepare))
    with pytest.raises(ValidationError):
        nl_aiohttp.setup(app, RuleRegistry([rule()]), headers="yes")
    after = (len(app.middlewares), len(app.on_startup), len(app.on_response_prepare))
    assert after == before  # a bad call changes nothing


def test_the_middleware_decides_through_the_pipelines_public_decide(
    backend: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway_helpers import audit_decisions

    log = audit_decisions(monkeypatch)
    app = web.Application()
    app.router.add_get("/api/items", hello)
    nl_aiohttp.setup(app, RuleRegistry([rule("api", 2, path_prefix="/api")]), factory(backend))

    async def body(client: TestClient[Any, Any]) -> list[int]:
        out = []
        for _ in range(3):
            async with client.get("/api/items") as r:
                out.append(r.status)
        return out

    assert serve(app, body) == [200, 200, 429]
    assert log == [True, True, False]
