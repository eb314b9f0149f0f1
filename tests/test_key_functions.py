"""Key functions (``key=callable(request) -> str``) on rules and on route
declarations of every front end, what each is handed, how a bad one fails;
``RateLimitRule.from_rate`` taking every field; and what flask-limiter and
slowapi users type (docs/routes.md, "Key functions"; docs/migrating.md).

Every app here is a real one (FastAPI through Starlette's TestClient, a
Flask test client, an aiohttp TestServer on 127.0.0.1); Django's are in
test_django_loud.py, where Django's settings are configured.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
from typing import Any

import pytest
from fastapi import FastAPI
from flask import Flask
from flask import Request as FlaskRequest
from flask import request as flask_request
from starlette.requests import Request as StarletteRequest
from starlette.testclient import TestClient

from nanolimit import FakeClock, InMemoryStorage, LimiterFactory, RuleRegistry, ValidationError
from nanolimit.asgi import RateLimitMiddleware as ASGIMiddleware
from nanolimit.errors import RuleValidationError
from nanolimit.flask import Limiter
from nanolimit.gateway.keyfuncs import DIGESTED, MAX_KEY_BYTES
from nanolimit.gateway.middleware import RateLimitPipeline, Request, Response
from nanolimit.gateway.routes import FOREIGN_KEYWORDS, RouteLimits
from nanolimit.gateway.rules import KeyScope, RateLimitRule

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def tenant(request: Any) -> str:
    return str(request.headers["x-tenant"])


def pipeline(*rules: RateLimitRule) -> RateLimitPipeline:
    return RateLimitPipeline(
        RuleRegistry(rules), LimiterFactory(InMemoryStorage(), FakeClock(1_000.0)), wall_clock=lambda: 1_000.0
    )


def ok(request: Request) -> Response:
    return Response(200)


# ---------------------------------------------------------------------------
# RateLimitRule.from_rate takes every keyword the rule takes


def count_5xx(status: int) -> bool:
    return status >= 500


def cost_of(request: Any) -> int:
    return 2


KEYWORDS: dict[str, Any] = {
    "method": "POST",
    "path_prefix": "/api",
    "scope": KeyScope.USER,
    "algorithm": "fixed_window",
    "tier": "gold",
    "dry_run": True,
    "shape": False,
    "cost": 3,
    "routes": ("/users/{id}",),
    "count_when": frozenset({401, 403}),
    "group": "logins",
    "key": tenant,
}


def test_from_rate_names_every_field_of_the_rule() -> None:
    made = {f.name for f in dataclasses.fields(RateLimitRule) if f.init}
    positional = {"name", "limit", "window_seconds", "burst"}  # the name, and what the rate string says
    assert made - positional == set(KEYWORDS)


@pytest.mark.parametrize("field", sorted(KEYWORDS))
def test_from_rate_keyword_round_trips(field: str) -> None:
    rule = RateLimitRule.from_rate("r", "10/minute", **{field: KEYWORDS[field]})
    got = getattr(rule, field)
    want = KEYWORDS[field]
    assert (got.value if field == "algorithm" else got) == want
    # and the same rule as the constructor makes it
    assert rule == RateLimitRule("r", *_positional(field), **_keywords(field))


def _positional(field: str) -> tuple[Any, ...]:
    base = {"method": "*", "path_prefix": "/", "scope": KeyScope.IP, "algorithm": "token_bucket"}
    if field in base:
        base[field] = KEYWORDS[field]
    return (base["method"], base["path_prefix"], base["scope"], base["algorithm"], 10, 60.0)


def _keywords(field: str) -> dict[str, Any]:
    return {} if field in ("method", "path_prefix", "scope", "algorithm") else {field: KEYWORDS[field]}


def test_from_rate_callables_and_burst() -> None:
    rule = RateLimitRule.from_rate("r", "10/minute", cost=cost_of, count_when=count_5xx, burst=20)
    assert rule.cost is cost_of and rule.count_when is count_5xx and rule.burst == 20
    assert RateLimitRule.from_rate("r", "10/minute burst 20").burst == 20
    with pytest.raises(RuleValidationError, match="burst: given twice"):
        RateLimitRule.from_rate("r", "10/minute burst 20", burst=30)
    with pytest.raises(RuleValidationError, match="count_when"):
        RateLimitRule.from_rate("r", "10/minute", count_when={99})


# ---------------------------------------------------------------------------
# The framework-free pipeline


def test_a_rules_key_function_names_the_budget() -> None:
    mw = pipeline(RateLimitRule.from_rate("api", "2/minute", algorithm="fixed_window", key=tenant))
    a = [mw(Request("GET", "/x", {"x-tenant": "a"}, client=f"10.0.0.{i}"), ok).status for i in range(3)]
    b = mw(Request("GET", "/x", {"x-tenant": "b"}, client="10.0.0.1"), ok).status
    assert a == [200, 200, 429] and b == 200  # three IPs, one tenant's budget; another tenant has its own


def test_the_framework_free_pipeline_hands_the_gateway_request() -> None:
    seen: list[Any] = []

    def key(request: Any) -> str:
        seen.append(request)
        return "k"

    mw = pipeline(RateLimitRule.from_rate("api", "5/minute", key=key))
    request = Request("GET", "/x", client="c")
    assert mw(request, ok).status == 200 and seen == [request]


@pytest.mark.parametrize(
    ("returned", "why"),
    [
        (42, "key must be a str, got int"),
        ("", "key must not be empty"),
        (None, "key must be a str, got NoneType"),
        (b"tenant", "key must be a str, got bytes"),
    ],
)
def test_a_bad_key_is_an_error_naming_the_rule(returned: Any, why: str) -> None:
    mw = pipeline(RateLimitRule.from_rate("api", "5/minute", key=lambda request: returned))
    with pytest.raises(ValidationError, match=f"rule 'api': its key function .* returned .*{why}"):
        mw(Request("GET", "/x", client="c"), ok)
    longest = "x" * MAX_KEY_BYTES  # the bound itself is a key
    mw = pipeline(RateLimitRule.from_rate("api", "5/minute", key=lambda request: longest))
    assert mw(Request("GET", "/x", client="c"), ok).status == 200


def keyed_by_header(request: Any) -> str:
    return str(request.headers["x-id"])


LONG = "x" * (MAX_KEY_BYTES + 1)
LONG_UTF8 = "é" * (MAX_KEY_BYTES // 2 + 1)  # 258 UTF-8 bytes in 129 characters


@pytest.mark.parametrize("long", [LONG, LONG_UTF8, "tenant-\ud800", DIGESTED + "a" * (MAX_KEY_BYTES - 3)])
def test_a_key_too_long_to_store_is_keyed_by_its_digest(long: str) -> None:
    # The length of a key is often the client's to choose (a header, a
    # token): a long one is limited like any other, never a server error,
    # and it shares no budget with a shorter key, nor with another long one.
    mw = pipeline(RateLimitRule.from_rate("api", "2/minute", algorithm="fixed_window", key=keyed_by_header))

    def status(value: str) -> int:
        return mw(Request("GET", "/x", {"x-id": value}, client="10.0.0.1"), ok).status

    assert [status(long) for _ in range(3)] == [200, 200, 429]
    assert status(long + "y") == 200 and status(long[:-1] + "z") == 200
    assert status(long[: len(long) // 2]) == 200


def test_no_key_a_function_returns_is_taken_for_a_digest() -> None:
    mw = pipeline(RateLimitRule.from_rate("api", "1/minute", algorithm="fixed_window", key=keyed_by_header))
    storage = mw.factory.storage
    for long in (LONG, "tenant-\ud800"):
        before = set(storage.keys())
        assert mw(Request("GET", "/x", {"x-id": long}, client="c"), ok).status == 200
        # the budget the long key spends is stored under the mark and a digest:
        # a client sending that very text as its key is someone else
        (digested,) = set(storage.keys()) - before
        own = digested[digested.index(DIGESTED) :]
        assert len(own) == 33 and mw(Request("GET", "/x", {"x-id": own}, client="c"), ok).status == 200
        assert mw(Request("GET", "/x", {"x-id": long}, client="c"), ok).status == 429


def test_a_key_function_that_raises_reaches_the_caller_as_it_is() -> None:
    def key(request: Any) -> str:
        raise LookupError("no tenant")

    mw = pipeline(RateLimitRule.from_rate("api", "5/minute", key=key))
    with pytest.raises(LookupError, match="no tenant") as caught:
        mw(Request("GET", "/x", client="c"), ok)
    if sys.version_info >= (3, 11):
        assert caught.value.__notes__ == ["nanolimit: raised by the key function of rule 'api'"]


@pytest.mark.parametrize("bad", ["myapp.keys.tenant", 7, lambda: "k", lambda a, b: "k"])
def test_a_key_that_is_no_one_argument_callable_fails_where_the_rule_is_written(bad: Any) -> None:
    with pytest.raises(RuleValidationError, match="rule 'api': key: "):
        RateLimitRule.from_rate("api", "5/minute", key=bad)
    with pytest.raises(ValidationError, match="key: "):
        RouteLimits().limit("5/minute", key=bad)
    with pytest.raises(ValidationError, match="key: "):
        RouteLimits(key=bad)


# ---------------------------------------------------------------------------
# FastAPI: a Starlette Request


def test_fastapi_route_key_is_handed_a_starlette_request_and_names_the_budget() -> None:
    seen: list[Any] = []

    def key(request: StarletteRequest) -> str:
        seen.append(request)
        return request.headers.get("x-tenant") or request.client.host  # type: ignore[union-attr]

    limits = RouteLimits(algorithm="fixed_window")
    app = FastAPI()

    @app.get("/items")
    @limits.limit("2/minute", key=key)
    async def items() -> dict[str, str]:
        return {}

    app.add_middleware(ASGIMiddleware, limits=limits)
    with TestClient(app) as client:
        a = [client.get("/items", headers={"x-tenant": "a"}).status_code for _ in range(3)]
        b = client.get("/items", headers={"x-tenant": "b"}).status_code
    assert a == [200, 200, 429] and b == 200
    assert all(type(r) is StarletteRequest for r in seen) and seen[0].url.path == "/items"


def test_a_route_limits_key_is_the_default_of_its_declarations() -> None:
    limits = RouteLimits(algorithm="fixed_window", key=tenant)
    app = FastAPI()

    @app.get("/a")
    @limits.limit("1/minute")
    async def a() -> dict[str, str]:
        return {}

    @app.get("/b")
    @limits.limit("1/minute", scope="ip", key=lambda request: "everyone")
    async def b() -> dict[str, str]:
        return {}

    app.add_middleware(ASGIMiddleware, limits=limits)
    with TestClient(app) as client:
        assert [client.get("/a", headers={"x-tenant": t}).status_code for t in "xxy"] == [200, 429, 200]
        assert [client.get("/b", headers={"x-tenant": t}).status_code for t in "xy"] == [200, 429]


def test_fastapi_bad_key_result_is_a_500_raising_the_error() -> None:
    limits = RouteLimits()
    app = FastAPI()

    @app.get("/items")
    @limits.limit("5/minute", key=lambda request: request.headers.get("x-tenant", ""))
    async def items() -> dict[str, str]:
        return {}

    app.add_middleware(ASGIMiddleware, limits=limits)
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/items", headers={"x-tenant": "a"}).status_code == 200
        assert client.get("/items").status_code == 500
    with TestClient(app) as client, pytest.raises(ValidationError, match=r"its key function .* returned ''"):
        client.get("/items")  # what the server logs with its 500


def test_a_long_key_is_limited_in_fastapi_and_flask_never_a_500() -> None:
    long = "t" * 1000  # an API key header: its length is the client's to choose
    limits = RouteLimits(algorithm="fixed_window")
    api = FastAPI()

    @api.get("/items")
    @limits.limit("2/minute", key=lambda request: request.headers["x-id"])
    async def items() -> dict[str, str]:
        return {}

    api.add_middleware(ASGIMiddleware, limits=limits)
    web = Flask(__name__)
    limiter = Limiter(web, key=lambda request: request.headers["x-id"])

    @web.get("/items")
    @limiter.limit("2/minute")
    def flask_items() -> str:
        return "ok"

    with TestClient(api, raise_server_exceptions=False) as client:
        fastapi = [
            client.get("/items", headers={"x-id": value}).status_code for value in (long,) * 3 + (long + "u",)
        ]
    flask = [
        web.test_client().get("/items", headers={"x-id": v}).status_code for v in (long,) * 3 + (long + "u",)
    ]
    assert fastapi == flask == [200, 200, 429, 200]


# ---------------------------------------------------------------------------
# Flask: flask.request, and flask-limiter's Limiter(key_func, app=app)


def get_remote_address() -> str:
    """flask-limiter's flask_limiter.util.get_remote_address, as it is written."""
    return flask_request.remote_addr or "127.0.0.1"


def test_flask_limiter_style_limiter_key_func_app_works() -> None:
    app = Flask(__name__)
    limiter = Limiter(get_remote_address, app=app, default_limits="2/hour", algorithm="fixed_window")

    @app.get("/")
    def index() -> str:
        return "hi"

    client = app.test_client()
    got = [client.get("/", environ_base={"REMOTE_ADDR": "192.0.2.1"}).status_code for _ in range(3)]
    other = client.get("/", environ_base={"REMOTE_ADDR": "192.0.2.2"}).status_code
    assert got == [200, 200, 429] and other == 200
    rules = limiter.pipeline(app).registry.ruleset.rules
    assert rules and all(r.key is not None for r in rules)


def test_flask_key_is_handed_flask_request_or_nothing() -> None:
    seen: list[Any] = []

    def by_header(request: Any) -> str:
        seen.append(request)
        return str(request.headers.get("X-Tenant", "anon"))

    app = Flask(__name__)
    limiter = Limiter(app=app, algorithm="fixed_window")

    @app.get("/t")
    @limiter.limit("1/hour", key=by_header)
    def t() -> str:
        return "t"

    @app.get("/n")
    @limiter.limit("1/hour", key=lambda: flask_request.headers.get("X-Tenant", "anon"))
    def n() -> str:
        return "n"

    client = app.test_client()
    for path in ("/t", "/n"):
        assert [client.get(path, headers={"X-Tenant": x}).status_code for x in "aab"] == [200, 429, 200]
    assert len(seen) == 3 and all(isinstance(r, FlaskRequest) and r.path == "/t" for r in seen)


def test_flask_limiter_keywords_name_nanolimits_spelling() -> None:
    limiter = Limiter()
    with pytest.raises(TypeError, match=r"deduct_when=.*use count_when="):
        limiter.limit("5/minute", deduct_when=lambda response: response.status_code >= 400)
    with pytest.raises(TypeError, match=r"key_func=.*use key="):
        limiter.limit("5/minute", key_func=get_remote_address)
    with pytest.raises(TypeError, match=r"per_method=.*use methods="):
        limiter.shared("5/minute", name="s", per_method=True)
    with pytest.raises(TypeError, match=r"Limiter\(\) takes no key_func=.*use key="):
        Limiter(key_func=get_remote_address)
    with pytest.raises(TypeError, match=r"storage_uri=.*use storage="):
        Limiter(get_remote_address, storage_uri="memory://")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\): nope"):
        Limiter(nope=1)
    with pytest.raises(TypeError, match="give the key function once"):
        Limiter(get_remote_address, key=get_remote_address)
    with pytest.raises(ValidationError, match="app must be a Flask app"):
        Limiter(get_remote_address, app="app")  # type: ignore[arg-type]


def test_slowapi_keywords_on_route_limits_name_nanolimits_spelling() -> None:
    with pytest.raises(TypeError, match=r"RouteLimits\(\) takes no key_func=.*use key="):
        RouteLimits(key_func=tenant)
    with pytest.raises(TypeError, match=r"limit\(\) takes no deduct_when=.*use count_when="):
        RouteLimits().limit("5/minute", deduct_when=lambda response: True)
    with pytest.raises(TypeError, match=r"error_message=.*deny="):
        RouteLimits().depends("5/minute", error_message="slow down")


# ---------------------------------------------------------------------------
# aiohttp: its web.Request


def test_aiohttp_key_is_handed_the_aiohttp_request() -> None:
    from aiohttp import web
    from aiohttp.test_utils import TestClient as AioClient
    from aiohttp.test_utils import TestServer

    import nanolimit.aiohttp as nl_aiohttp

    seen: list[Any] = []

    def key(request: web.Request) -> str:
        seen.append(request)
        return request.headers.get("X-Tenant", "anon")

    limits = RouteLimits(algorithm="fixed_window")

    @limits.limit("1/minute", key=key)
    async def hello(request: web.Request) -> web.Response:
        return web.Response(text="hi")

    app = web.Application()
    app.router.add_get("/hello", hello)
    nl_aiohttp.setup(app, limits=limits)

    async def run() -> list[int]:
        async with AioClient(TestServer(app, host="127.0.0.1")) as client:
            out = []
            for tenant_name in "aab":
                async with client.get("/hello", headers={"X-Tenant": tenant_name}) as response:
                    out.append(response.status)
            return out

    assert asyncio.run(asyncio.wait_for(run(), 20)) == [200, 429, 200]
    assert seen and all(isinstance(r, web.Request) for r in seen)


# ---------------------------------------------------------------------------
# What the other front ends hand: the WSGI environ, a websocket's connection


def test_the_wsgi_middleware_hands_the_environ() -> None:
    from werkzeug.test import Client as WerkzeugClient

    from nanolimit.wsgi import RateLimitMiddleware as WSGIMiddleware

    seen: list[Any] = []

    def key(environ: Any) -> str:
        seen.append(environ)
        return str(environ.get("HTTP_X_TENANT", "anon"))

    def app(environ: Any, start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    rule = RateLimitRule.from_rate("wsgi", "1/minute", algorithm="fixed_window", key=key)
    client = WerkzeugClient(WSGIMiddleware(app, RuleRegistry([rule]), LimiterFactory(InMemoryStorage())))
    got = [client.get("/", headers={"X-Tenant": t}).status_code for t in "aab"]
    assert got == [200, 429, 200] and all(type(e) is dict and "wsgi.version" in e for e in seen)


def test_a_websocket_key_is_handed_an_http_connection() -> None:
    from starlette.applications import Starlette
    from starlette.requests import HTTPConnection
    from starlette.routing import WebSocketRoute
    from starlette.websockets import WebSocket

    seen: list[Any] = []

    def key(connection: HTTPConnection) -> str:
        seen.append(connection)
        return connection.headers.get("x-tenant", "anon")

    async def echo(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.close()

    rule = RateLimitRule.from_rate("ws", "5/minute", key=key)
    app = Starlette(routes=[WebSocketRoute("/ws", echo)])
    app.add_middleware(ASGIMiddleware, registry=RuleRegistry([rule]))
    with TestClient(app) as client, client.websocket_connect("/ws", headers={"x-tenant": "a"}):
        pass
    assert len(seen) == 1 and type(seen[0]) is HTTPConnection and seen[0].url.path == "/ws"


def test_without_starlette_an_asgi_key_is_handed_the_scope(monkeypatch: pytest.MonkeyPatch) -> None:
    from nanolimit.gateway import keyfuncs

    monkeypatch.setattr(keyfuncs, "_StarletteRequest", None)
    monkeypatch.setitem(sys.modules, "starlette.requests", None)  # import fails, as uninstalled
    scope = {"type": "http", "method": "GET", "path": "/", "headers": []}
    assert keyfuncs.key_argument(Request("GET", "/", native=scope)) is scope


def test_an_http_exception_a_flask_key_raises_is_answered_as_itself() -> None:
    from werkzeug.exceptions import Unauthorized

    def key(request: Any) -> str:
        if "X-Api-Key" not in request.headers:
            raise Unauthorized("an API key, please")
        return str(request.headers["X-Api-Key"])

    app = Flask(__name__)
    limiter = Limiter(app=app)

    @app.get("/k")
    @limiter.limit("5/minute", key=key)
    def k() -> str:
        return "k"

    @app.get("/bad")
    @limiter.limit("5/minute", key=lambda request: None)
    def bad() -> str:
        return "bad"

    client = app.test_client()
    assert client.get("/k").status_code == 401
    assert client.get("/k", headers={"X-Api-Key": "s"}).status_code == 200
    app.testing = False  # a production app: the error is a 500, logged by Flask
    assert client.get("/bad").status_code == 500


@pytest.mark.parametrize("keyword", sorted(FOREIGN_KEYWORDS))
def test_every_foreign_keyword_is_refused_naming_ours(keyword: str) -> None:
    instead = FOREIGN_KEYWORDS[keyword]
    for call in (Limiter, Limiter().limit, RouteLimits, RouteLimits().limit):
        args = () if call in (Limiter, RouteLimits) else ("5/minute",)
        with pytest.raises(TypeError, match=f"takes no {keyword}=") as caught:
            call(*args, **{keyword: None})  # type: ignore[operator]
        assert str(caught.value).endswith("use " + instead)


def test_limiter_key_keyword_is_the_default_of_declarations_and_default_limits() -> None:
    app = Flask(__name__)
    app.config["RATELIMIT_DEFAULT"] = "1/hour"
    limiter = Limiter(app=app, key=lambda request: str(request.headers.get("X-Tenant", "anon")))

    @app.get("/d")
    @limiter.limit("1/hour")
    def d() -> str:
        return "d"

    @app.get("/other")
    def other() -> str:
        return "other"

    client = app.test_client()
    for path in ("/d", "/other"):
        assert [client.get(path, headers={"X-Tenant": t}).status_code for t in "aab"] == [200, 429, 200]
    assert all(r.key is not None for r in limiter.pipeline(app).registry.ruleset.rules)
