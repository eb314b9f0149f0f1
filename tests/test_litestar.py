"""Litestar through the pure ASGI middleware (nanolimit.asgi), which
imports no framework: as a Litestar middleware (``DefineMiddleware``)
served by Litestar's TestClient, and wrapping the Litestar app as an ASGI
callable served by a real uvicorn on 127.0.0.1. Admitted requests carry the
headers, denials are the stock 429, renamed and switched-off headers, and
a count-by-response rule settled by the status Litestar's own exception
handling answers."""

from __future__ import annotations

import json
import types
from typing import Any

from adversarial_servers import raw_request, uvicorn_server
from litestar import Litestar, Request, Response, get, post
from litestar.exceptions import NotAuthorizedException
from litestar.middleware import DefineMiddleware
from litestar.testing import TestClient

from nanolimit import LimiterFactory, RuleRegistry
from nanolimit.asgi import RateLimitMiddleware
from nanolimit.gateway.metrics import Metrics
from nanolimit.gateway.rules import RateLimitRule

RATE = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset", "ratelimit-policy", "ratelimit")


def rule(name: str, limit: int, prefix: str = "/", **kw: Any) -> RateLimitRule:
    return RateLimitRule(name, "*", prefix, "ip", "fixed_window", limit, 60.0, **kw)


@get("/items/{item_id:int}")
async def item(request: Request[Any, Any, Any]) -> Response[dict[str, int]]:
    return Response({"id": request.path_params["item_id"]}, headers={"X-App": "yes"})


@get("/open")
async def open_page() -> str:
    return "open"


@post("/login")
async def login(request: Request[Any, Any, Any]) -> dict[str, str]:
    if request.query_params.get("ok") != "true":
        raise NotAuthorizedException()
    return {"token": "..."}


def app_with(backend: types.SimpleNamespace, *rules: RateLimitRule, **options: Any) -> Litestar:
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(1_000.0))
    middleware = DefineMiddleware(
        RateLimitMiddleware, registry=RuleRegistry(rules), factory=factory, **options
    )
    return Litestar([item, open_page, login], middleware=[middleware])


def test_litestar_admits_with_headers_then_denies_with_the_429_json(backend: types.SimpleNamespace) -> None:
    metrics = Metrics()
    app = app_with(backend, rule("items", 2, "/items"), metrics=metrics)
    with TestClient(app) as client:
        responses = [client.get(f"/items/{i}") for i in (1, 2, 3)]
        free = client.get("/open")
    assert [r.status_code for r in responses] == [200, 200, 429]
    first, second, denied = responses
    assert first.json() == {"id": 1} and first.headers["x-app"] == "yes"  # Litestar's own response
    assert first.headers["x-ratelimit-limit"] == "2" and first.headers["x-ratelimit-remaining"] == "1"
    assert second.headers["x-ratelimit-remaining"] == "0"
    assert first.headers["ratelimit-policy"] == '"items";q=2;w=60'
    assert denied.headers["content-type"] == "application/json"
    body = denied.json()
    assert body["error"] == "rate_limit_exceeded" and body["rule"] == "items"
    assert int(denied.headers["retry-after"]) == body["retry_after"] >= 1
    assert free.status_code == 200 and not any(h in free.headers for h in RATE)  # no rule: unlimited
    snapshot = metrics.snapshot()["items"]
    assert snapshot["allowed"] == 2 and snapshot["denied"] == 1


def test_litestar_headers_off_and_renamed(backend: types.SimpleNamespace) -> None:
    with TestClient(app_with(backend, rule("api", 1), headers=False)) as client:
        admitted, denied = client.get("/open"), client.get("/open")
    assert (admitted.status_code, denied.status_code) == (200, 429)
    assert not any(h in admitted.headers or h in denied.headers for h in RATE)
    assert "retry-after" in denied.headers  # a 429 still says when
    renamed = app_with(backend, rule("api", 1), header_names={"X-RateLimit-Limit": "X-Limit"})
    with TestClient(renamed) as client:
        admitted = client.get("/open")
    assert admitted.headers["x-limit"] == "1" and "x-ratelimit-limit" not in admitted.headers


def test_litestar_failed_logins_only_settled_by_its_exception_status(backend: types.SimpleNamespace) -> None:
    app = app_with(backend, rule("login", 2, "/login", count_when={401}))
    with TestClient(app) as client:
        successes = [client.post("/login?ok=true").status_code for _ in range(4)]
        failures = [client.post("/login").status_code for _ in range(3)]
    assert successes == [201] * 4  # Litestar's POST default; a success never counts
    assert failures == [401, 401, 429]


def test_litestar_wrapped_as_an_asgi_app_under_uvicorn(backend: types.SimpleNamespace) -> None:
    litestar_app = Litestar([item, open_page, login])
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(1_000.0))
    app = RateLimitMiddleware(litestar_app, RuleRegistry([rule("all", 2)]), factory)
    with uvicorn_server(app) as port:
        responses = [raw_request(port, "GET", b"/items/7") for _ in range(3)]
    assert [r.status for r in responses] == [200, 200, 429]
    assert json.loads(responses[0].body) == {"id": 7}
    assert responses[0].headers["x-ratelimit-remaining"] == "1"
    assert json.loads(responses[2].body)["rule"] == "all" and "retry-after" in responses[2].headers


def test_litestar_a_rule_naming_a_route_template_limits_that_route(backend: types.SimpleNamespace) -> None:
    app = app_with(backend, rule("item", 2, routes=("/items/{item_id:int}",)))
    with TestClient(app) as client:
        statuses = [client.get(f"/items/{i}").status_code for i in (1, 2, 3)]
    assert statuses == [200, 200, 429]
