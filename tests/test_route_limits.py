"""Limits where users declare them (docs/routes.md): per-request cost,
counting by response, denials the app controls, route templates and
route-level declarations on real FastAPI and Starlette apps, and one real
uvicorn run.

Count-by-response charges on entry and refunds when the status does not
count, so concurrent requests can never overspend: the concurrency test
holds eight connections at once against a real server and counts what
was admitted.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import Counter
from typing import Any

import pytest
from _helpers import clear_of_window_edge
from adversarial_servers import raw_request, uvicorn_server
from fastapi import APIRouter, Depends, FastAPI, HTTPException
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Mount, Route
from starlette.testclient import TestClient

from nanolimit import FakeClock, InMemoryStorage, LimiterFactory, RuleRegistry, ValidationError
from nanolimit.asgi import RateLimitMiddleware as ASGIMiddleware
from nanolimit.errors import RuleValidationError
from nanolimit.gateway.config import parse_rules
from nanolimit.gateway.middleware import RateLimitPipeline, Request, Response
from nanolimit.gateway.routes import RouteLimits
from nanolimit.gateway.rules import KeyScope, RateLimitRule, resolve_route, route_key, route_shape
from nanolimit.wsgi import RateLimitMiddleware as WSGIMiddleware

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.fixture(autouse=True)
def _clear_of_a_minute_edge() -> None:
    """Most limits here are "N/minute" fixed windows on the real clock: a
    test that crossed a minute boundary saw a fresh budget (one CI run's
    fourth request came back 200, not 429)."""
    clear_of_window_edge(60.0, 3.0)


def ok(request: Request) -> Response:
    return Response(200)


def rule(name: str = "api", limit: int = 10, window: float = 60.0, **kw: Any) -> RateLimitRule:
    kw.setdefault("algorithm", "fixed_window")
    return RateLimitRule(
        name,
        kw.pop("method", "*"),
        kw.pop("path_prefix", "/"),
        kw.pop("scope", "ip"),
        kw.pop("algorithm"),
        limit,
        window,
        kw.pop("burst", None),
        **kw,
    )


def pipeline(*rules: RateLimitRule, stacked: bool = False, **options: Any) -> RateLimitPipeline:
    clock = FakeClock(1_000.0)
    factory = LimiterFactory(InMemoryStorage(), clock)
    return RateLimitPipeline(
        RuleRegistry(rules, stacked=stacked), factory, wall_clock=lambda: 1_000.0, **options
    )


# ---------------------------------------------------------------------------
# Per-request cost


def test_the_seed_demo_three_requests_of_cost_five_get_200_200_429() -> None:
    mw = pipeline(rule("search", 10, 60.0, method="GET", path_prefix="/api/search"))
    statuses = [mw(Request("GET", "/api/search", client="1.2.3.4", cost=5), ok).status for _ in range(3)]
    assert statuses == [200, 200, 429]


def test_a_rule_cost_multiplies_the_request_cost() -> None:
    mw = pipeline(rule("fanout", 30, cost=10))
    assert [mw(Request("GET", "/", client="c"), ok).status for _ in range(4)] == [200, 200, 200, 429]
    mw = pipeline(rule("fanout", 30, cost=10))
    assert mw(Request("GET", "/", client="c", cost=3), ok).status == 200  # 30 of 30
    assert mw(Request("GET", "/", client="c"), ok).status == 429


def test_a_cost_callable_reads_the_request() -> None:
    mw = pipeline(rule("bytes", 100, cost=lambda r: int(r.headers.get("x-items", "1"))))
    assert mw(Request("GET", "/", {"x-items": "60"}, "c"), ok).status == 200
    assert mw(Request("GET", "/", {"x-items": "60"}, "c"), ok).status == 429
    assert mw(Request("GET", "/", {"x-items": "40"}, "c"), ok).status == 200


def test_a_cost_above_the_capacity_is_a_429_that_says_why_never_a_500() -> None:
    mw = pipeline(rule("search", 10))
    response = mw(Request("GET", "/", client="c", cost=11), ok)
    assert response.status == 429
    assert "Retry-After" not in response.headers  # no wait would let it pass
    body = response.json()
    assert body["reason"] == "cost_exceeds_limit" and body["cost"] == 11 and body["limit"] == 10
    assert body["rule"] == "search" and body["retry_after"] is None
    assert mw.metrics.snapshot()["search"]["denied"] == 1
    # nothing was spent: the full budget is still there
    assert mw(Request("GET", "/", client="c", cost=10), ok).status == 200


@pytest.mark.parametrize("bad", [0, -1, True, 1.5, "2"])
def test_a_bad_request_cost_is_a_clear_error_and_spends_nothing(bad: Any) -> None:
    mw = pipeline(rule("api", 2))
    with pytest.raises(ValidationError, match="cost"):
        mw.check(Request("GET", "/", client="c", cost=bad))
    assert [mw(Request("GET", "/", client="c"), ok).status for _ in range(3)] == [200, 200, 429]


@pytest.mark.parametrize("bad", [0, -3, True, "1", 11])
def test_a_bad_static_cost_is_refused_with_the_rule_named(bad: Any) -> None:
    with pytest.raises(RuleValidationError, match=r"rule .api.: cost"):
        rule("api", 10, cost=bad)


def test_a_callable_cost_returning_nonsense_is_refused() -> None:
    mw = pipeline(rule("api", 10, cost=lambda r: 0))
    with pytest.raises(ValidationError, match=r"rule .api.: cost"):
        mw.check(Request("GET", "/", client="c"))


# ---------------------------------------------------------------------------
# Counting by response


def _login(status: int) -> Any:
    return lambda request: Response(status)


@pytest.mark.parametrize(
    "algorithm", ["token_bucket", "leaky_bucket", "fixed_window", "sliding_log", "sliding_counter", "gcra"]
)
def test_only_failed_logins_count(algorithm: str) -> None:
    mw = pipeline(rule("login", 3, 60.0, algorithm=algorithm, count_when={401}, shape=False))
    request = Request("POST", "/login", client="c")
    assert [mw(request, _login(200)).status for _ in range(10)] == [200] * 10  # successes never count
    assert [mw(request, _login(401)).status for _ in range(4)] == [401, 401, 401, 429]


def test_count_when_takes_a_predicate_and_settles_once() -> None:
    mw = pipeline(rule("errors", 2, count_when=lambda status: status >= 500))
    request = Request("GET", "/", client="c")
    outcome = mw.check(request)
    assert outcome is not None and outcome.charge is not None
    assert mw.settle(outcome, 200) == 1  # refunded
    assert mw.settle(outcome, 200) == 0  # once
    for _ in range(2):
        assert mw(request, _login(503)).status == 503
    assert mw(request, _login(503)).status == 429


def test_a_handler_that_raises_counts_as_a_500() -> None:
    mw = pipeline(rule("errors", 1, count_when={500}))
    request = Request("GET", "/", client="c")

    def boom(r: Request) -> Response:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        mw(request, boom)
    assert mw(request, ok).status == 429


def test_count_by_response_in_a_stack_refunds_only_the_rules_that_do_not_count() -> None:
    everything = rule("all", 5)
    failures = rule("failures", 2, count_when={401})
    mw = pipeline(everything, failures, stacked=True)
    request = Request("POST", "/login", client="c")
    assert [mw(request, _login(200)).status for _ in range(4)] == [200] * 4
    assert mw(request, _login(401)).status == 401  # the fifth: 'all' is spent now
    assert mw(request, _login(200)).status == 429


# ---------------------------------------------------------------------------
# Denials the app controls


def test_headers_off_sends_none_but_a_429_keeps_retry_after() -> None:
    mw = pipeline(rule("api", 1), headers=False)
    admitted = mw(Request("GET", "/", client="c"), ok)
    assert not any(h.lower().startswith(("x-ratelimit", "ratelimit")) for h in admitted.headers)
    denied = mw(Request("GET", "/", client="c"), ok)
    assert denied.status == 429 and set(denied.headers) == {"Retry-After", "Content-Type"}


def test_renamed_headers() -> None:
    mw = pipeline(rule("api", 1), header_names={"X-RateLimit-Limit": "X-Limit", "Retry-After": "X-Wait"})
    admitted = mw(Request("GET", "/", client="c"), ok)
    assert admitted.headers["X-Limit"] == "1" and "X-RateLimit-Limit" not in admitted.headers
    assert "X-RateLimit-Remaining" in admitted.headers
    denied = mw(Request("GET", "/", client="c"), ok)
    assert "X-Wait" in denied.headers and "Retry-After" not in denied.headers


@pytest.mark.parametrize(
    "names",
    [{"X-Nope": "X"}, {"X-RateLimit-Limit": "bad name"}, {"X-RateLimit-Limit": ""}, {"Retry-After": "a\nb"}],
)
def test_bad_header_names_are_refused(names: dict[str, str]) -> None:
    with pytest.raises(ValidationError, match="header_names"):
        pipeline(rule(), header_names=names)


def test_on_breach_sees_every_denial() -> None:
    seen: list[tuple[str, str]] = []
    mw = pipeline(
        rule("api", 1), on_breach=lambda request, outcome: seen.append((request.client, outcome.rule))
    )
    for client in ("a", "a", "b", "b", "b"):
        mw(Request("GET", "/", client=client), ok)
    assert seen == [("a", "api"), ("b", "api"), ("b", "api")]


def test_denials_are_logged_but_a_flood_is_not(caplog: pytest.LogCaptureFixture) -> None:
    mw = pipeline(rule("api", 1), log_denials=3600.0)
    with caplog.at_level(logging.WARNING, logger="nanolimit.denials"):
        for _ in range(101):
            mw(Request("GET", "/a\nFAKE LINE", client="c"), ok)
    records = [r for r in caplog.records if r.name == "nanolimit.denials"]
    assert len(records) == 1  # one record for the 100 denials within the interval
    assert records[0].rule == "api"  # type: ignore[attr-defined]
    assert "\n" not in records[0].getMessage()  # the client's path cannot forge a line
    mw = pipeline(rule("api", 1), log_denials=0.0)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanolimit.denials"):
        for _ in range(3):
            mw(Request("GET", "/", client="c"), ok)
    assert len([r for r in caplog.records if r.name == "nanolimit.denials"]) == 2
    mw = pipeline(rule("api", 1), log_denials=None)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nanolimit.denials"):
        for _ in range(3):
            mw(Request("GET", "/", client="c"), ok)
    assert not caplog.records


def test_the_framework_free_class_refuses_to_be_an_asgi_middleware_naming_the_right_import() -> None:
    app = Starlette(middleware=[Middleware(RateLimitPipeline, registry=RuleRegistry([rule()]))])
    with pytest.raises(TypeError, match=r"from nanolimit\.asgi import RateLimitMiddleware"):
        with TestClient(app) as client:
            client.get("/")
    with pytest.raises(TypeError, match=r"nanolimit\.wsgi"):
        RateLimitPipeline(lambda environ, start: [], RuleRegistry([rule()]))  # type: ignore[arg-type]


def test_the_spellings_users_bring() -> None:
    assert rule(scope="IP").scope is KeyScope.IP
    assert rule(scope="API-Key").scope is KeyScope.API_KEY
    one = rule("api")
    assert RuleRegistry(one).rules() == (one,)  # type: ignore[arg-type]
    with pytest.raises(RuleValidationError, match="scope"):
        rule(scope="everyone")


# ---------------------------------------------------------------------------
# Route templates


def test_route_templates_of_every_framework_compare_equal() -> None:
    # one spelling for one route, whatever the framework's syntax
    assert (
        route_key("/users/{id:int}/avatar")
        == route_key("/users/<int:id>/avatar")
        == route_key("users/<int:id>/avatar")
        == "/users/{id:int}/avatar"
    )
    assert route_key("/p/{x}") == route_key("/p/{x:str}") == route_key("/p/<x>") == route_key("/p/<string:x>")
    assert route_key("/f/{p:path}") == route_key("/f/<path:p>") == "/f/{p:path}"
    # what tells two routes apart is kept: converters and names
    assert route_key("/items/{item_id:int}") != route_key("/items/{name}")
    assert route_key("/items/<int:item_id>") != route_key("/items/<slug:name>")
    loose = route_shape("users/<int:user_id>/avatar")
    assert route_shape("/users/{id}/avatar") == loose == "/users/{}/avatar"
    with pytest.raises(ValidationError):
        route_key("")


def test_a_loose_template_binds_to_the_one_route_it_can_name() -> None:
    known = {route_key(t) for t in ("/users/<int:id>/avatar", "/items/{item_id:int}", "/items/{name}")}
    assert resolve_route("/users/{id}/avatar", known) == ("/users/{id:int}/avatar",)
    assert resolve_route("/users/{uid}/avatar", known) == ("/users/{id:int}/avatar",)  # the one of that shape
    assert resolve_route("/items/{name}", known) == ("/items/{name}",)  # spelt as the app does: that one only
    assert resolve_route("/items/<int:item_id>", known) == ("/items/{item_id:int}",)
    with pytest.raises(ValidationError, match="could name any of"):
        resolve_route("/items/{x}", known)  # two routes of that shape, neither named: refused
    assert resolve_route("/nope", known) == ()
    hosts = {"//api.example.com/login", "/login", "//admin.example.com/panel"}
    assert resolve_route("/login", hosts) == ("/login",)
    assert resolve_route("/panel", hosts) == ("//admin.example.com/panel",)
    with pytest.raises(ValidationError, match="could name any of"):
        resolve_route("/login", hosts - {"/login"} | {"//b.example.com/login"})


def test_a_route_rule_beats_prefix_rules_and_shares_one_budget_across_ids() -> None:
    avatar = rule("avatar", 2, routes=("/users/{id}/avatar",))
    mw = pipeline(rule("users", 100, path_prefix="/users"), avatar)
    statuses = [
        mw(Request("GET", f"/users/{i}/avatar", client="c", route="/users/{id}/avatar"), ok).status
        for i in (1, 2, 3)
    ]
    assert statuses == [200, 200, 429]
    # without the route (a front end that cannot tell) the prefix rule decides
    assert mw.rules_for(Request("GET", "/users/1/avatar")) == (mw.registry.rules()[0],)


def test_exempt_routes_get_no_limit_even_stacked() -> None:
    registry = RuleRegistry([rule("global", 1)], stacked=True, exempt=["/health"])
    mw = RateLimitPipeline(registry)
    assert mw.check(Request("GET", "/health", client="c", route="/health")) is None
    assert [mw(Request("GET", "/x", client="c", route="/x"), ok).status for _ in range(2)] == [200, 429]


# ---------------------------------------------------------------------------
# Route-level declarations on FastAPI and Starlette


def fastapi_app(limits: RouteLimits) -> FastAPI:
    app = FastAPI()

    @app.get("/users/{uid}/avatar")
    @limits.limit("2/minute", algorithm="fixed-window")
    async def avatar(uid: int) -> dict[str, int]:
        return {"uid": uid}

    router = APIRouter(
        prefix="/r", dependencies=[Depends(limits.depends("3/minute", algorithm="fixed_window"))]
    )

    @router.get("/a")
    async def router_a() -> dict[str, str]:
        return {}

    app.include_router(router)

    search = limits.shared("3/minute", name="search", algorithm="fixed_window")

    @app.get("/search/users")
    @search
    async def search_users() -> dict[str, str]:
        return {}

    @app.get("/search/orders")
    @search
    async def search_orders() -> dict[str, str]:
        return {}

    @app.get("/listed")
    @limits.limit("5/minute;2/second", algorithm="fixed_window")
    async def listed() -> dict[str, str]:
        return {}

    @app.get("/costly")
    @limits.limit("10/minute", algorithm="fixed_window", cost=lambda r: int(r.native["query_string"] or 1))
    async def costly() -> dict[str, str]:
        return {}

    @app.post("/login")
    @limits.limit("3/minute", algorithm="fixed_window", count_when={401, 403})
    async def login(ok: bool = False) -> dict[str, str]:
        if not ok:
            raise HTTPException(401)
        return {}

    @app.get("/health")
    @limits.exempt
    async def health() -> dict[str, str]:
        return {}

    @app.get("/open")
    async def unlimited() -> dict[str, str]:
        return {}

    app.add_middleware(ASGIMiddleware, limits=limits)
    return app


def statuses(client: TestClient, path: str, n: int, method: str = "GET") -> list[int]:
    return [client.request(method, path).status_code for _ in range(n)]


def test_fastapi_every_declaration_form() -> None:
    limits = RouteLimits(RuleRegistry([rule("global", 2, path_prefix="/open")]))
    with TestClient(fastapi_app(limits)) as client:
        assert [client.get(f"/users/{i}/avatar").status_code for i in (1, 2, 3)] == [200, 200, 429]
        assert statuses(client, "/r/a", 4) == [200, 200, 200, 429]  # the router's dependency
        # one named budget, two routes
        assert [
            client.get(p).status_code
            for p in ("/search/users", "/search/orders", "/search/users", "/search/orders")
        ] == [200, 200, 200, 429]
        assert statuses(client, "/listed", 3) == [200, 200, 429]  # 2/second of the list binds first
        assert statuses(client, "/health", 20) == [200] * 20  # exempt
        assert statuses(client, "/open", 3) == [200, 200, 429]  # the global rule still applies elsewhere
        denied = client.get("/users/9/avatar")
        assert denied.json()["rule"].endswith(".avatar") and "retry-after" in denied.headers
    names = {r.name for r in limits.registry.rules()}
    assert "search" in names and any(n.endswith(".listed:1s") for n in names)


def test_fastapi_cost_callable_sees_the_native_scope() -> None:
    with TestClient(fastapi_app(RouteLimits())) as client:
        assert client.get("/costly?6").status_code == 200
        assert client.get("/costly?6").status_code == 429
        response = client.get("/costly?11")
        assert response.status_code == 429 and response.json()["reason"] == "cost_exceeds_limit"


def test_fastapi_failed_logins_only() -> None:
    with TestClient(fastapi_app(RouteLimits())) as client:
        assert statuses(client, "/login?ok=true", 6, "POST") == [200] * 6
        assert statuses(client, "/login", 4, "POST") == [401, 401, 401, 429]


def test_a_dependency_without_the_middleware_fails_loudly() -> None:
    limits = RouteLimits()
    app = FastAPI()

    @app.get("/x", dependencies=[Depends(limits.depends("1/minute"))])
    async def x() -> dict[str, str]:
        return {}

    with (
        TestClient(app, raise_server_exceptions=True) as client,
        pytest.raises(RuntimeError, match="middleware"),
    ):
        client.get("/x")


def test_starlette_routes_mounts_and_router_level_limits() -> None:
    limits = RouteLimits(algorithm="fixed_window")

    @limits.limit("2/minute")
    async def item(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def plain(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def other(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    api = limits.limit("1/minute")(Mount("/api", routes=[Route("/v/{name}", plain), Route("/w", other)]))
    app = Starlette(
        routes=[Route("/items/{id:int}", item), api], middleware=[Middleware(ASGIMiddleware, limits=limits)]
    )
    with TestClient(app) as client:
        assert [client.get(f"/items/{i}").status_code for i in (1, 2, 3)] == [200, 200, 429]
        assert [client.get(f"/api/v/{n}").status_code for n in ("a", "b")] == [200, 429]
        assert client.get("/api/w").status_code == 200  # each view under the mount has its own budget
    assert {route_key(t) for r in limits.registry.rules() for t in r.routes} == {
        "/items/{id:int}",
        "/api/v/{name}",
        "/api/w",
    }


def test_behind_a_root_path_rules_match_the_public_path_and_routes_keep_their_budget() -> None:
    """An app served under a ``root_path``: a prefix rule is written
    against the public URL, a route's declaration is its own budget."""
    limits = RouteLimits(algorithm="fixed_window")

    @limits.limit("2/minute")
    async def item(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def other(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    routes = [Route("/items/{id:int}", item), Route("/other", other)]
    app = Starlette(routes=routes, middleware=[Middleware(ASGIMiddleware, limits=limits)])
    with TestClient(app, root_path="/api") as client:
        assert [client.get(f"/items/{i}").status_code for i in (1, 2, 3)] == [200, 200, 429]
        assert [client.get("/other").status_code for _ in range(3)] == [200, 200, 200]
    registry = RuleRegistry([rule("api", 2, path_prefix="/api/items")])
    app = Starlette(routes=routes, middleware=[Middleware(ASGIMiddleware, registry=registry)])
    with TestClient(app, root_path="/api") as client:
        assert [client.get(f"/items/{i}").status_code for i in (1, 2, 3)] == [200, 200, 429]
        assert client.get("/other").status_code == 200


def test_a_custom_denial_response_and_the_apps_own_json() -> None:
    limits = RouteLimits(algorithm="fixed_window")

    @limits.limit("1/minute")
    async def page(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    def deny(request: Request, outcome: Any) -> JSONResponse:
        return JSONResponse({"slow down": outcome.rule}, status_code=429, headers=outcome.headers)

    app = Starlette(
        routes=[Route("/p", page)], middleware=[Middleware(ASGIMiddleware, limits=limits, deny=deny)]
    )
    with TestClient(app) as client:
        client.get("/p")
        denied = client.get("/p")
    assert (
        denied.status_code == 429 and list(denied.json()) == ["slow down"] and "retry-after" in denied.headers
    )


def test_wsgi_deny_hook_and_headers_off() -> None:
    def app(environ: dict[str, Any], start: Any) -> list[bytes]:
        start("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    def deny(request: Request, outcome: Any) -> Any:
        def teapot(environ: dict[str, Any], start: Any) -> list[bytes]:
            start("418 I'm a teapot", [])
            return [b"no"]

        return teapot

    mw = WSGIMiddleware(app, RuleRegistry([rule("api", 1)]), deny=deny, headers=False)
    from werkzeug.test import Client

    client = Client(mw)
    first = client.get("/")
    assert first.status_code == 200 and "X-RateLimit-Limit" not in first.headers
    assert client.get("/").status_code == 418


# ---------------------------------------------------------------------------
# Bad declarations fail at startup, naming what is wrong


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("5/minute",), None),
        (("5/fortnight",), "fortnight"),
        (("banana",), "banana"),
        (("0/minute",), "limit"),
    ],
)
def test_bad_rates_fail_when_declared(args: tuple[str], message: str | None) -> None:
    limits = RouteLimits()
    if message is None:
        limits.limit(*args)
        return
    with pytest.raises(ValidationError, match=message):
        limits.limit(*args)


def test_bad_algorithm_and_costs_fail_when_declared() -> None:
    limits = RouteLimits()
    with pytest.raises(ValidationError, match="algorithm"):
        limits.limit("5/minute", algorithm="sliding-window")
    with pytest.raises(ValidationError, match="cost"):
        limits.limit("5/minute", cost=0)
    with pytest.raises(ValidationError, match="cost"):
        limits.limit("5/minute", cost=6)
    with pytest.raises(ValidationError, match="name"):
        limits.shared("5/minute", name="")


def test_a_rule_naming_a_route_the_app_lacks_fails_the_first_request_without_a_lifespan() -> None:
    registry = RuleRegistry([rule("typo", 5, routes=("/userz/{id}",))])

    async def user(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[Route("/users/{id}", user)], middleware=[Middleware(ASGIMiddleware, registry=registry)]
    )
    client = TestClient(app)  # no lifespan: the middleware binds on the first request
    with pytest.raises(RuleValidationError, match=r"rule 'typo': routes: '/userz/\{id\}' matches no route"):
        client.get("/users/1")


def test_uvicorn_refuses_to_start_on_a_bad_declaration(capfd: pytest.CaptureFixture[str]) -> None:
    import uvicorn

    registry = RuleRegistry([rule("typo", 5, routes=("/nope",))])
    app = Starlette(routes=[], middleware=[Middleware(ASGIMiddleware, registry=registry)])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, lifespan="on", log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    thread.join(30.0)
    assert not thread.is_alive() and not server.started
    err = capfd.readouterr().err
    assert "nanolimit: rule 'typo': routes: '/nope' matches no route of the app" in err
    assert "Application startup failed" in err


# ---------------------------------------------------------------------------
# Rules files


def test_rules_files_take_cost_routes_count_when_lists_and_exempt() -> None:
    loaded = parse_rules(
        {
            "rules": [
                {"name": "search", "path_prefix": "/search", "rate": "10/minute", "cost": 5},
                {"name": "avatar", "routes": ["/users/{id}/avatar"], "rate": "5/minute;100/hour"},
                {"name": "login", "path_prefix": "/login", "rate": "3/minute", "count_when": [401, 403]},
            ],
            "exempt": ["/health"],
        }
    )
    names = [r.name for r in loaded.rules]
    assert names == ["search", "avatar:60s", "avatar:3600s", "login"]
    assert loaded.rules[0].cost == 5 and loaded.rules[3].count_when == frozenset({401, 403})
    assert loaded.rules[1].group == "avatar" and loaded.rules[1].routes == ("/users/{id}/avatar",)
    registry = loaded.registry()
    assert registry.ruleset.exempt == frozenset({"/health"})
    mw = RateLimitPipeline(registry)
    assert len(mw.rules_for(Request("GET", "/users/1/avatar", route="/users/{id}/avatar"))) == 2
    with pytest.raises(Exception, match="cost"):
        parse_rules({"rules": [{"name": "x", "rate": "5/minute", "cost": 6}]})
    with pytest.raises(Exception, match="count_when"):
        parse_rules({"rules": [{"name": "x", "rate": "5/minute", "count_when": [99]}]})
    with pytest.raises(Exception, match="exempt"):
        parse_rules({"rules": [{"name": "x", "rate": "5/minute"}], "exempt": [3]})


def test_a_prefix_rate_list_decides_together_unstacked() -> None:
    loaded = parse_rules(
        {"rules": [{"name": "api", "rate": "3/minute;1/second", "algorithm": "fixed_window"}]}
    )
    clock = FakeClock(100.0)
    mw = RateLimitPipeline(loaded.registry(), LimiterFactory(InMemoryStorage(), clock))
    assert [mw(Request("GET", "/x", client="c"), ok).status for _ in range(2)] == [200, 429]
    clock.advance(1.0)
    assert mw(Request("GET", "/x", client="c"), ok).status == 200
    clock.advance(1.0)
    assert mw(Request("GET", "/x", client="c"), ok).status == 200
    clock.advance(1.0)
    assert mw(Request("GET", "/x", client="c"), ok).status == 429  # the minute's 3 are spent


def test_a_reload_keeps_the_declared_rules() -> None:
    limits = RouteLimits()

    @limits.limit("1/minute")
    def view() -> None:
        pass

    from nanolimit.gateway.routes import RouteInfo

    limits.bind([RouteInfo("/v", frozenset(), view)])
    declared = limits.registry.declared
    limits.registry.replace([rule("file", 5)])
    assert set(limits.registry.rules()) == {*declared, rule("file", 5)}


# ---------------------------------------------------------------------------
# A real server: eight connections at once never overspend a failed-login budget


def test_uvicorn_concurrent_failed_logins_never_exceed_the_budget() -> None:
    limits = RouteLimits(algorithm="fixed_window")
    app = FastAPI()

    @app.post("/login")
    @limits.limit("10/hour", count_when={401})
    async def login(ok: bool = False) -> dict[str, str]:
        if not ok:
            raise HTTPException(401)
        return {}

    app.add_middleware(ASGIMiddleware, limits=limits)
    # uvicorn_server runs with lifespan off: bind happens on the first request
    results: Counter[tuple[str, int]] = Counter()
    lock = threading.Lock()
    with uvicorn_server(app) as port:

        def worker(index: int) -> None:
            for i in range(12):
                ok = (index + i) % 2 == 0
                target = b"/login?ok=true" if ok else b"/login"
                status = raw_request(port, "POST", target).status
                with lock:
                    results[("ok" if ok else "fail", status)] += 1

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60.0)
    assert results[("fail", 401)] <= 10  # never more failures admitted than the budget
    assert results[("fail", 401)] == 10  # and the budget is spent exactly (48 tried)
    assert sum(n for (kind, _), n in results.items()) == 96
    # a success admitted while the failures had budget left was refunded, never counted
    assert results[("ok", 200)] >= 1
    print("uvicorn-failed-logins:", json.dumps({f"{k[0]}-{k[1]}": v for k, v in sorted(results.items())}))


def test_route_limits_and_global_rules_decide_together_all_or_nothing() -> None:
    """Stacked: a request on a declared route spends the route's limit and
    the global rule's together; a denial by the route charges the global
    rule nothing."""
    limits = RouteLimits(RuleRegistry([rule("global", 3)], stacked=True), algorithm="fixed_window")
    app = FastAPI()

    @app.get("/search")
    @limits.limit("2/minute")
    async def search() -> dict[str, str]:
        return {}

    @app.get("/other")
    async def other() -> dict[str, str]:
        return {}

    app.add_middleware(ASGIMiddleware, limits=limits)
    with TestClient(app) as client:
        assert statuses(client, "/search", 3) == [200, 200, 429]  # the route's 2
        assert client.get("/search").json()["rule"].endswith(".search")
        # the two denials charged 'global' nothing: one of its 3 is left
        assert statuses(client, "/other", 2) == [200, 429]
        assert client.get("/other").json()["rule"] == "global"


def test_an_attacker_cannot_get_past_a_route_limit_with_ids_heads_or_slashes() -> None:
    """A flood of distinct ids shares the route's one budget (and the route
    cache stays bounded); HEAD spends the GET route's budget; a doubled
    slash reaches no route at all (Starlette answers 404), so it gains
    nothing either."""
    limits = RouteLimits(algorithm="fixed_window")
    app = FastAPI()

    @app.get("/users/{uid}/avatar")
    @limits.limit("5/minute")
    async def avatar(uid: int) -> dict[str, int]:
        return {"uid": uid}

    # a fake clock: 600 requests on the wall clock could straddle a minute, and a
    # fixed window then admits its limit twice
    factory = LimiterFactory(InMemoryStorage(), FakeClock(1_000.0))
    middleware = ASGIMiddleware(app, limits=limits, factory=factory)
    with TestClient(middleware) as client:
        codes = Counter(client.get(f"/users/{i}/avatar").status_code for i in range(600))
        assert codes == {200: 5, 429: 595}
        assert client.head("/users/1/avatar").status_code == 429
        assert client.get("//users/1/avatar").status_code == 404
    core = middleware.core
    assert len(core._routes[1]) <= core.route_cache_size


def _limited_starlette(**app_options: Any) -> Starlette:
    limits = RouteLimits(algorithm="fixed_window")

    @limits.limit("1/minute")
    async def page(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    return Starlette(
        routes=[Route("/p", page)], middleware=[Middleware(ASGIMiddleware, limits=limits)], **app_options
    )


def test_a_starlette_apps_own_429_handler_answers_the_denial() -> None:
    seen: list[Any] = []

    async def too_many(request: Any, exc: Any) -> JSONResponse:
        seen.append((request.url.path, exc.status_code, exc.outcome.rule, dict(exc.headers)))
        return JSONResponse({"mine": exc.detail}, status_code=429, headers={"X-Mine": "1"})

    with TestClient(_limited_starlette(exception_handlers={429: too_many})) as client:
        first = client.get("/p")
        denied = client.get("/p")
    assert first.status_code == 200 and len(seen) == 1  # admitted requests never meet the handler
    path, status, rule_name, headers = seen[0]
    assert (path, status) == ("/p", 429) and rule_name.endswith(".page")  # the declaration's rule
    assert headers["retry-after"] == denied.headers["retry-after"]  # the exception carries the headers
    assert denied.status_code == 429 and list(denied.json()) == ["mine"]
    assert denied.headers["x-mine"] == "1"
    assert denied.headers["x-ratelimit-remaining"] == "0"  # added where the handler left them out
    assert denied.headers.get_list("retry-after") == [denied.headers["retry-after"]]  # kept once


def test_a_sync_handler_of_httpexception_answers_and_fastapis_stock_one_does_not() -> None:
    from starlette.exceptions import HTTPException as StarletteHTTPException

    calls: list[int] = []

    def http_errors(request: Any, exc: Any) -> PlainTextResponse:  # sync: run in Starlette's threadpool
        calls.append(exc.status_code)
        return PlainTextResponse(f"error {exc.status_code}", status_code=exc.status_code, headers=exc.headers)

    with TestClient(_limited_starlette(exception_handlers={StarletteHTTPException: http_errors})) as client:
        client.get("/p")
        denied = client.get("/p")
    assert calls == [429] and denied.text == "error 429" and "x-ratelimit-limit" in denied.headers

    # FastAPI registers its stock HTTPException handler on every app: not the
    # app's own, so the middleware's JSON 429 answers, without raising
    limits = RouteLimits(algorithm="fixed_window")
    app = FastAPI()

    @app.get("/p")
    @limits.limit("1/minute")
    async def page() -> dict[str, str]:
        return {"ok": "yes"}

    app.add_middleware(ASGIMiddleware, limits=limits)
    with TestClient(app) as client:
        client.get("/p")
        denied = client.get("/p")
    assert denied.status_code == 429 and denied.json()["error"] == "rate_limit_exceeded"


def test_a_fastapi_429_handler_answers_under_a_real_uvicorn() -> None:
    limits = RouteLimits(algorithm="fixed_window")
    app = FastAPI()

    @app.exception_handler(429)
    async def too_many(request: Any, exc: Any) -> JSONResponse:
        return JSONResponse({"try later": exc.headers["Retry-After"]}, status_code=429)

    @app.get("/p")
    @limits.limit("1/minute")
    async def page() -> dict[str, str]:
        return {"ok": "yes"}

    app.add_middleware(ASGIMiddleware, limits=limits)
    with uvicorn_server(app, lifespan="on") as port:
        first = raw_request(port, "GET", b"/p")
        denied = raw_request(port, "GET", b"/p")
    assert first.status == 200
    assert denied.status == 429 and json.loads(denied.body) == {"try later": denied.headers["retry-after"]}
    assert denied.headers["x-ratelimit-remaining"] == "0"


def test_a_limit_on_one_of_two_views_sharing_a_template_is_that_views_alone(backend: Any) -> None:
    """docs/routes.md: two views on one template are two routes, told apart
    by their methods. The POST view's limit neither limits the GET view
    beside it nor is spent by it; HEAD goes with GET (unlimited too)."""
    limits = RouteLimits(algorithm="fixed_window")

    async def form(request: Any) -> PlainTextResponse:
        return PlainTextResponse("form")

    @limits.limit("3/minute")
    async def submit(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(
        routes=[Route("/login", form, methods=["GET"]), Route("/login", submit, methods=["POST"])],
        middleware=[
            Middleware(ASGIMiddleware, limits=limits, factory=LimiterFactory(backend.InMemoryStorage()))
        ],
    )
    with TestClient(app) as client:
        assert [client.get("/login").status_code for _ in range(5)] == [200] * 5
        assert "x-ratelimit-limit" not in client.get("/login").headers
        assert [client.head("/login").status_code for _ in range(2)] == [200] * 2
        assert [client.post("/login").status_code for _ in range(4)] == [200, 200, 200, 429]
        assert client.get("/login").status_code == 200
    assert [(r.method, r.routes) for r in limits.registry.rules()] == [("POST", ("/login",))]
