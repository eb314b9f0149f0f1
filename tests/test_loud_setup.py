"""No limit that silently does nothing (docs/routes.md, "A forgotten front
end"): a declared view that runs with nothing enforcing it warns once, in
FastAPI, Starlette, aiohttp and Flask (Django's are in test_django_loud.py),
and ``registry=`` beside ``limits=`` on one middleware composes instead of
failing every request, under a real uvicorn with its lifespan on.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import warnings
from collections.abc import Iterator
from typing import Any

import pytest
from adversarial_servers import uvicorn_server
from fastapi import FastAPI
from flask import Blueprint, Flask
from flask.views import MethodView
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from nanolimit import FakeClock, InMemoryStorage, LimiterFactory, RuleRegistry
from nanolimit.asgi import RateLimitMiddleware as ASGIMiddleware
from nanolimit.errors import UnenforcedLimitWarning
from nanolimit.flask import Limiter
from nanolimit.gateway.routes import RouteLimits
from nanolimit.gateway.rules import RateLimitRule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@contextlib.contextmanager
def caught() -> Iterator[list[warnings.WarningMessage]]:
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        yield seen


def unenforced(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, UnenforcedLimitWarning)]


# ---------------------------------------------------------------------------
# FastAPI and Starlette: the view's guard


def fastapi_app(limits: RouteLimits) -> FastAPI:
    app = FastAPI()

    @app.get("/items/{item_id}")
    @limits.limit("1/minute")
    async def item(item_id: int) -> dict[str, int]:
        return {"item_id": item_id}

    @app.get("/sync")
    @limits.limit("1/minute")
    def sync_view() -> dict[str, str]:
        return {}

    return app


def test_fastapi_without_the_middleware_warns_once_and_serves() -> None:
    limits = RouteLimits()
    app = fastapi_app(limits)
    with caught() as seen, TestClient(app) as client:
        answers = [client.get("/items/7") for _ in range(3)] + [client.get("/sync")]
    assert [a.status_code for a in answers] == [200] * 4  # unlimited, as before: but said
    assert answers[0].json() == {"item_id": 7}  # the guard kept FastAPI's reading of the signature
    [message] = unenforced(seen)
    assert "item declares a rate limit, but nothing enforces it" in message
    assert "RateLimitMiddleware" in message and "limits=limits" in message


def test_fastapi_with_the_middleware_is_enforced_and_silent() -> None:
    limits = RouteLimits()
    app = fastapi_app(limits)
    app.add_middleware(ASGIMiddleware, limits=limits)
    with caught() as seen, TestClient(app) as client:
        assert [client.get("/items/7").status_code for _ in range(2)] == [200, 429]
        assert [client.get("/sync").status_code for _ in range(2)] == [200, 429]
    assert unenforced(seen) == []


def test_a_middleware_given_only_a_registry_leaves_the_declarations_unenforced_and_says_so() -> None:
    limits = RouteLimits()
    app = fastapi_app(limits)
    app.add_middleware(ASGIMiddleware, registry=RuleRegistry())  # limits= forgotten
    with caught() as seen, TestClient(app) as client:
        assert [client.get("/items/7").status_code for _ in range(2)] == [200, 200]
    assert len(unenforced(seen)) == 1


def test_starlette_function_endpoint_warns_and_a_warning_filter_makes_it_an_error() -> None:
    limits = RouteLimits()

    @limits.limit("1/minute")
    async def page(request: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/p", page)])
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnenforcedLimitWarning)
        with TestClient(app) as client, pytest.raises(UnenforcedLimitWarning, match="page declares"):
            client.get("/p")


# ---------------------------------------------------------------------------
# aiohttp


def test_aiohttp_without_setup_warns_once() -> None:
    from aiohttp import web
    from aiohttp.test_utils import TestClient as AioClient
    from aiohttp.test_utils import TestServer

    limits = RouteLimits()

    @limits.limit("1/minute")
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/hello", hello)

    async def run() -> list[int]:
        async with AioClient(TestServer(app, host="127.0.0.1")) as client:
            out = []
            for _ in range(2):
                async with client.get("/hello") as response:
                    out.append(response.status)
            return out

    with caught() as seen:
        assert asyncio.run(asyncio.wait_for(run(), 20)) == [200, 200]
    assert len(unenforced(seen)) == 1


# ---------------------------------------------------------------------------
# Flask: a Limiter never initialised with the app


def flask_app(limiter: Limiter) -> Flask:
    app = Flask(__name__)
    bp = Blueprint("bp", __name__)

    @app.get("/fn")
    @limiter.limit("1/hour")
    def fn() -> str:
        return "fn"

    @app.get("/free")
    def free() -> str:
        return "free"

    @limiter.limit("1/hour")
    class Thing(MethodView):
        def get(self) -> str:
            return "thing"

    app.add_url_rule("/thing", view_func=Thing.as_view("thing"))

    @bp.get("/in")
    def inside() -> str:
        return "in"

    limiter.limit("1/hour")(bp)
    app.register_blueprint(bp, url_prefix="/bp")
    return app


@pytest.mark.parametrize("path", ["/fn", "/thing", "/bp/in"])
def test_flask_without_init_app_warns_once_on_a_declared_view(path: str) -> None:
    limiter = Limiter()
    app = flask_app(limiter)
    client = app.test_client()
    with caught() as seen:
        assert client.get("/free").status_code == 200  # nothing declared there: nothing to say
        assert unenforced(seen) == []
        assert [client.get(path).status_code for _ in range(3)] == [200, 200, 200]
    [message] = unenforced(seen)
    assert "its Limiter was never initialised with app" in message and "init_app" in message
    assert not limiter._watching  # the watch ended with its one warning


def test_flask_with_init_app_is_enforced_silent_and_unwatched() -> None:
    limiter = Limiter()
    app = flask_app(limiter)
    assert limiter._watching  # declarations, no app yet: the watch is on
    limiter.init_app(app)
    assert not limiter._watching  # ended by init_app: no cost per request from here on
    client = app.test_client()
    with caught() as seen:
        assert [client.get("/fn").status_code for _ in range(2)] == [200, 429]
        assert [client.get("/bp/in").status_code for _ in range(2)] == [200, 429]
    assert unenforced(seen) == []


def test_flask_enabled_false_is_off_on_purpose_and_silent() -> None:
    limiter = Limiter()
    app = flask_app(limiter)
    app.config["RATELIMIT_ENABLED"] = False
    limiter.init_app(app)
    with caught() as seen:
        assert [app.test_client().get("/fn").status_code for _ in range(2)] == [200, 200]
    assert unenforced(seen) == []


# ---------------------------------------------------------------------------
# registry= beside limits=: global rules and route limits, both enforced


def composed_app(stacked: bool) -> FastAPI:
    everywhere = RateLimitRule.from_rate("global", "3/minute", algorithm="fixed_window")
    limits = RouteLimits(algorithm="fixed_window")
    app = FastAPI()

    @app.get("/login")
    @limits.limit("2/minute")
    async def login() -> dict[str, str]:
        return {}

    @app.get("/other")
    async def other() -> dict[str, str]:
        return {}

    factory = LimiterFactory(InMemoryStorage(), FakeClock(1_000.0))
    app.add_middleware(
        ASGIMiddleware, registry=RuleRegistry([everywhere], stacked=stacked), limits=limits, factory=factory
    )
    return app


@pytest.mark.parametrize("stacked", [False, True], ids=["unstacked", "stacked"])
def test_registry_and_limits_compose_both_enforced(stacked: bool) -> None:
    with caught() as seen, TestClient(composed_app(stacked)) as client:
        login = [client.get("/login") for _ in range(3)]
        assert [r.status_code for r in login] == [200, 200, 429]
        assert login[2].json()["rule"].endswith("login")  # the route's limit denied it
        # the two admitted logins spent the global budget too: one of three is left
        assert [client.get("/other").status_code for _ in range(2)] == [200, 429]
        assert client.get("/other").json()["rule"] == "global"
    assert unenforced(seen) == []


def test_a_reload_of_the_registry_keeps_route_limits_adding_to_it() -> None:
    everywhere = RateLimitRule.from_rate("global", "100/minute", algorithm="fixed_window")
    registry = RuleRegistry([everywhere])
    limits = RouteLimits(algorithm="fixed_window")
    app = FastAPI()

    @app.get("/login")
    @limits.limit("5/minute")
    async def login() -> dict[str, str]:
        return {}

    app.add_middleware(ASGIMiddleware, registry=registry, limits=limits)
    with TestClient(app) as client:
        assert client.get("/login").status_code == 200
        # a rules-file reload: the route's limit still adds to the new global rule
        registry.replace([RateLimitRule.from_rate("global-2", "1/minute", algorithm="fixed_window")])
        answers = [client.get("/login") for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 429] and answers[1].json()["rule"] == "global-2"


def get(port: int, path: str) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    try:
        conn.request("GET", path)
        response = conn.getresponse()
        response.read()
        return response.status
    finally:
        conn.close()


def test_registry_and_limits_under_real_uvicorn_start_and_limit() -> None:
    with uvicorn_server(composed_app(stacked=False), lifespan="on") as port:
        assert [get(port, "/login") for _ in range(3)] == [200, 200, 429]
        assert [get(port, "/other") for _ in range(2)] == [200, 429]
