"""Route-level limits an attacker cannot switch off: probes first, then the
victim, on Starlette, FastAPI and Flask (Django's are in
test_django_limiter.py, aiohttp's and Litestar's in
test_adversarial_aiohttp_litestar.py).

Two classes of attack, each as a property over many variants:

- **A probe changes the next request's limits.** The gateway caches the
  route it resolved; a route a framework picks also depends on the scope's
  type (a websocket is not an HTTP GET), the Host (Starlette's ``Host``,
  Flask's subdomains) and the method. So: any request may be sent first,
  from another client, and the victim's statuses afterwards must be the
  same as without it.
- **An exemption covers another route.** ``/items/{item_id:int}`` limited
  and ``/items/{name}`` exempt are two routes; so are ``/login`` on two
  hosts, and ``/x`` GET and POST bound to two views.

In process through each framework's test client, and through real servers
where a server changes what the app sees: uvicorn (websocket upgrades, Host
headers) and Werkzeug's server (Host headers for Flask's subdomains).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import socket
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from adversarial_servers import IO_TIMEOUT, uvicorn_server, werkzeug_server
from fastapi import Depends, FastAPI, WebSocket
from flask import Blueprint, Flask
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as StarletteRequest
from starlette.responses import PlainTextResponse
from starlette.routing import Host, Route, WebSocketRoute
from starlette.testclient import TestClient
from starlette.websockets import WebSocket as StarletteWebSocket
from starlette.websockets import WebSocketDisconnect

from nanolimit import LimiterFactory, RateLimitRule, RuleRegistry, ValidationError
from nanolimit.asgi import RateLimitMiddleware as ASGIMiddleware
from nanolimit.flask import Limiter
from nanolimit.gateway.routes import RouteLimits

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

LIMITED = [200, 200, 429]  # a limit of 2, three requests
FREE = [200, 200, 200]
VICTIM = "victim-key"
PROBER = "prober-key"


# ---------------------------------------------------------------------------
# Starlette: every kind of route a probe can confuse with another


async def _text(request: StarletteRequest) -> PlainTextResponse:
    return PlainTextResponse(request.url.path)


def _view(name: str) -> Callable[[StarletteRequest], Any]:
    async def view(request: StarletteRequest) -> PlainTextResponse:
        return PlainTextResponse(name)

    view.__name__ = view.__qualname__ = name
    return view


async def _ws_endpoint(websocket: StarletteWebSocket) -> None:
    await websocket.accept()
    await websocket.send_text("hi")
    await websocket.close()


def starlette_app(backend: types.SimpleNamespace, registry: RuleRegistry | None = None) -> Starlette:
    """``/page`` and the websocket ``/ws`` limited; ``/login`` limited on
    ``api.example.com`` and exempt elsewhere; ``/items/{item_id:int}``
    limited and ``/items/{name}`` exempt; ``/x`` GET limited and POST (another
    view) exempt. Every limit is 2 a minute per API key."""
    limits = RouteLimits(registry, scope="api_key", algorithm="fixed_window")
    two = limits.limit("2/minute")
    page, api_login, item, x_get = (two(_view(n)) for n in ("page", "api_login", "item", "x_get"))
    open_login, named, x_post = (limits.exempt(_view(n)) for n in ("open_login", "named", "x_post"))

    async def ws(websocket: StarletteWebSocket) -> None:
        await _ws_endpoint(websocket)

    two(ws)
    api = Starlette(routes=[Route("/login", api_login)])
    return Starlette(
        routes=[
            Route("/page", page),
            WebSocketRoute("/ws", ws),
            Host("api.example.com", app=api),
            Route("/login", open_login),
            Route("/items/{item_id:int}", item),
            Route("/items/{name}", named),
            Route("/x", x_get, methods=["GET"]),
            Route("/x", x_post, methods=["POST"]),
        ],
        middleware=[
            Middleware(
                ASGIMiddleware,
                limits=limits,
                factory=LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(1_000.0)),
            )
        ],
    )


def ws_status(client: TestClient, url: str, key: str) -> int:
    """101 for an accepted websocket, the status of a refused handshake, or
    the close code the server answered with."""
    try:
        with client.websocket_connect(url, headers={"x-api-key": key}) as ws:
            ws.receive_text()
            return 101
    except WebSocketDisconnect as exc:
        status = getattr(exc, "status_code", None)  # a refused handshake (WebSocketDenialResponse)
        return status if isinstance(status, int) else exc.code


def http_status(client: TestClient, method: str, url: str, key: str) -> int:
    return client.request(method, url, headers={"x-api-key": key}).status_code


# What a victim sends, and what it gets on a fresh app (the control).
STARLETTE_TARGETS: dict[str, tuple[Callable[[TestClient, str], int], list[int]]] = {
    "GET /page": (lambda c, k: http_status(c, "GET", "/page", k), LIMITED),
    "WS /ws": (lambda c, k: ws_status(c, "/ws", k), [101, 101, 429]),
    "GET api.example.com/login": (
        lambda c, k: http_status(c, "GET", "http://api.example.com/login", k),
        LIMITED,
    ),
    "GET /login": (lambda c, k: http_status(c, "GET", "/login", k), FREE),
    "GET /items/1": (lambda c, k: http_status(c, "GET", "/items/1", k), LIMITED),
    "GET /items/abc": (lambda c, k: http_status(c, "GET", "/items/abc", k), FREE),
    "GET /x": (lambda c, k: http_status(c, "GET", "/x", k), LIMITED),
    "POST /x": (lambda c, k: http_status(c, "POST", "/x", k), FREE),
}


def _ws_probe(url: str) -> Callable[[TestClient], Any]:
    return lambda c: ws_status(c, url, PROBER)


def _http_probe(method: str, url: str) -> Callable[[TestClient], Any]:
    return lambda c: http_status(c, method, url, PROBER)


# Sent first, by another client: none may change what the victim gets.
STARLETTE_PROBES: dict[str, Callable[[TestClient], Any]] = {
    "WS /page": _ws_probe("/page"),
    "WS /items/1": _ws_probe("/items/1"),
    "WS /x": _ws_probe("/x"),
    "WS api.example.com/login": _ws_probe("ws://api.example.com/login"),
    "WS evil.example.com/login": _ws_probe("ws://evil.example.com/login"),
    "GET /ws": _http_probe("GET", "/ws"),
    "HEAD /ws": _http_probe("HEAD", "/ws"),
    "POST /ws": _http_probe("POST", "/ws"),
    "GET evil.example.com/login": _http_probe("GET", "http://evil.example.com/login"),
    "GET API.EXAMPLE.COM/login": _http_probe("GET", "http://API.EXAMPLE.COM/login"),
    "GET api.example.com:8080/login": _http_probe("GET", "http://api.example.com:8080/login"),
    "GET evil.example.com/page": _http_probe("GET", "http://evil.example.com/page"),
    "GET api.example.com/page": _http_probe("GET", "http://api.example.com/page"),
    "GET api.example.com/items/1": _http_probe("GET", "http://api.example.com/items/1"),
    "GET /items/abc": _http_probe("GET", "/items/abc"),
    "GET /items/-1": _http_probe("GET", "/items/-1"),
    "POST /page": _http_probe("POST", "/page"),
    "OPTIONS /page": _http_probe("OPTIONS", "/page"),
    "HEAD /page": _http_probe("HEAD", "/page"),
    "PUT /x": _http_probe("PUT", "/x"),
    "POST /x": _http_probe("POST", "/x"),
    "HEAD /x": _http_probe("HEAD", "/x"),
    "GET /nope": _http_probe("GET", "/nope"),
    "GET /page/": _http_probe("GET", "/page/"),
}


def _victim(client: TestClient, target: str) -> list[int]:
    send, _ = STARLETTE_TARGETS[target]
    return [send(client, VICTIM) for _ in range(3)]


@pytest.mark.parametrize("target", sorted(STARLETTE_TARGETS))
def test_starlette_control_each_target_is_limited_as_declared(
    backend: types.SimpleNamespace, target: str
) -> None:
    with TestClient(starlette_app(backend)) as client:
        assert _victim(client, target) == STARLETTE_TARGETS[target][1]


@pytest.mark.parametrize("probe", sorted(STARLETTE_PROBES))
def test_starlette_no_probe_changes_the_limits_of_the_next_request(
    backend: types.SimpleNamespace, probe: str
) -> None:
    """Each probe first (its route resolved and cached), then every target
    on the same app: each still gets what it gets on a fresh app."""
    app = starlette_app(backend)
    with TestClient(app) as client:
        STARLETTE_PROBES[probe](client)
        got = {target: _victim(client, target) for target in STARLETTE_TARGETS}
    assert got == {target: expected for target, (_, expected) in STARLETTE_TARGETS.items()}


def test_starlette_probes_in_any_order_on_one_app(backend: types.SimpleNamespace) -> None:
    """Every probe, twice, interleaved with the victims' first requests."""
    with TestClient(starlette_app(backend)) as client:
        got: dict[str, list[int]] = {t: [] for t in STARLETTE_TARGETS}
        for _ in range(3):
            for probe in STARLETTE_PROBES.values():
                probe(client)
            for target, (send, _) in STARLETTE_TARGETS.items():
                got[target].append(send(client, VICTIM))
    assert got == {target: expected for target, (_, expected) in STARLETTE_TARGETS.items()}


def test_starlette_route_cache_keys_by_scope_type_and_host(backend: types.SimpleNamespace) -> None:
    """The mechanism: one path, three routes by scope type and Host, three
    cache entries; a prefix-only ruleset keeps its three-part keys."""
    app = starlette_app(backend)
    with TestClient(app) as client:
        http_status(client, "GET", "/login", PROBER)
        http_status(client, "GET", "http://api.example.com/login", PROBER)
        ws_status(client, "/login", PROBER)
        middleware = app.middleware_stack
        while not isinstance(middleware, ASGIMiddleware):
            middleware = middleware.app
        keys = [k for k in middleware.core._routes[1] if k[1] == "/login"]
    assert len(keys) == 3 and all(len(k) == 4 for k in keys)
    assert len({k[3] for k in keys}) == 3  # http/testserver, http/api.example.com, websocket


# ---------------------------------------------------------------------------
# Exemptions cover their own route only, whatever else shares its shape


def test_starlette_rules_file_loose_templates_bind_to_one_route_or_fail(
    backend: types.SimpleNamespace,
) -> None:
    rule = RateLimitRule(
        "items", "*", "/", "api_key", "fixed_window", 2, 60.0, routes=("/items/<int:item_id>",)
    )
    registry = RuleRegistry([rule], exempt=["/items/{name}"])
    app = Starlette(
        routes=[Route("/items/{item_id:int}", _view("item")), Route("/items/{name}", _view("named"))],
        middleware=[
            Middleware(ASGIMiddleware, registry=registry, factory=LimiterFactory(backend.InMemoryStorage()))
        ],
    )
    with TestClient(app) as client:
        assert [http_status(client, "GET", "/items/7", VICTIM) for _ in range(3)] == LIMITED
        assert [http_status(client, "GET", "/items/seven", VICTIM) for _ in range(3)] == FREE
    # a loose template that could name either route is refused at startup, naming both
    loose = RateLimitRule("loose", "*", "/", "ip", "fixed_window", 2, 60.0, routes=("/items/{x}",))
    app = Starlette(
        routes=[Route("/items/{item_id:int}", _view("item")), Route("/items/{name}", _view("named"))],
        middleware=[Middleware(ASGIMiddleware, registry=RuleRegistry([loose]))],
    )
    with pytest.raises(ValidationError, match=r"could name any of the routes '/items/\{item_id:int\}'"):
        TestClient(app).get("/items/1")  # no lifespan: the first request binds, and fails


def test_starlette_a_reload_binds_its_routes_to_the_app_too(backend: types.SimpleNamespace) -> None:
    registry = RuleRegistry()
    app = starlette_app(backend, registry)
    with TestClient(app) as client:
        client.get("/page")
        typo = RateLimitRule("typo", "*", "/", "ip", "fixed_window", 2, 60.0, routes=("/itemz/{item_id}",))
        with pytest.raises(ValidationError, match="matches no route"):
            registry.replace([typo])  # refused: the running ruleset is kept
        # a reload's loose spelling binds to the app's /items/{item_id:int}, next to its declaration
        loose = RateLimitRule(
            "one", "*", "/", "api_key", "fixed_window", 1, 60.0, routes=("/items/<item_id>",)
        )
        registry.replace([loose])
        assert [http_status(client, "GET", "/items/1", VICTIM) for _ in range(3)] == [200, 429, 429]
        # the declared exemption of /items/{name} outlives the reload
        assert [http_status(client, "GET", "/items/abc", VICTIM) for _ in range(3)] == FREE


# ---------------------------------------------------------------------------
# FastAPI: dependencies, routers, websockets, hosts


def fastapi_app(backend: types.SimpleNamespace) -> FastAPI:
    limits = RouteLimits(scope="api_key", algorithm="fixed_window")
    app = FastAPI()
    api = FastAPI()

    @api.get("/login", dependencies=[Depends(limits.depends("2/minute"))])
    async def api_login() -> str:
        return "api"

    app.host("api.example.com", api)  # before the app's own /login: the router takes the first match

    @app.get("/login")
    @limits.exempt
    async def open_login() -> str:
        return "open"

    @app.get("/page", dependencies=[Depends(limits.depends("2/minute"))])
    async def page() -> str:
        return "page"

    @app.websocket("/ws")
    @limits.limit("2/minute")
    async def ws(websocket: WebSocket) -> None:
        await _ws_endpoint(websocket)

    @app.get("/items/{item_id:int}")
    @limits.limit("2/minute")
    async def item(item_id: int) -> int:
        return item_id

    @app.get("/items/{name}")
    @limits.exempt
    async def named(name: str) -> str:
        return name

    app.add_middleware(
        ASGIMiddleware,  # type: ignore[arg-type]
        limits=limits,
        factory=LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(1_000.0)),
    )
    return app


FASTAPI_TARGETS = {k: v for k, v in STARLETTE_TARGETS.items() if "/x" not in k}


@pytest.mark.parametrize("probe", sorted(p for p in STARLETTE_PROBES if "/x" not in p))
def test_fastapi_no_probe_changes_the_limits_of_the_next_request(
    backend: types.SimpleNamespace, probe: str
) -> None:
    with TestClient(fastapi_app(backend)) as client:
        STARLETTE_PROBES[probe](client)
        got = {t: [send(client, VICTIM) for _ in range(3)] for t, (send, _) in FASTAPI_TARGETS.items()}
    assert got == {target: expected for target, (_, expected) in FASTAPI_TARGETS.items()}


# ---------------------------------------------------------------------------
# Flask: subdomains, converters, one template for two views


def flask_app(backend: types.SimpleNamespace) -> Flask:
    # token buckets: a fixed window on the wall clock could turn over between two requests
    limiter = Limiter(storage=backend.InMemoryStorage(), log_denials=None)
    app = Flask("attacks", subdomain_matching=True)
    app.config["SERVER_NAME"] = "example.com"
    api = Blueprint("api", "attacks_api", subdomain="api")

    @api.get("/login")
    @limiter.limit("2/minute")
    def api_login() -> str:
        return "api"

    @app.get("/login")
    @limiter.exempt
    def open_login() -> str:
        return "open"

    @app.get("/items/<int:item_id>")
    @limiter.limit("2/minute")
    def item(item_id: int) -> str:
        return str(item_id)

    @app.get("/items/<name>")
    @limiter.exempt
    def named(name: str) -> str:
        return name

    @app.get("/x")
    @limiter.limit("2/minute")
    def x_get() -> str:
        return "get"

    @app.post("/x")
    @limiter.exempt
    def x_post() -> str:
        return "post"

    app.register_blueprint(api)
    limiter.init_app(app)
    return app


def _flask(method: str, url: str, ip: str) -> Callable[[Any], int]:
    return lambda c: c.open(url, method=method, environ_base={"REMOTE_ADDR": ip}).status_code


FLASK_TARGETS = {
    "GET api.example.com/login": ("GET", "http://api.example.com/login", LIMITED),
    "GET example.com/login": ("GET", "http://example.com/login", FREE),
    "GET /items/1": ("GET", "http://example.com/items/1", LIMITED),
    "GET /items/abc": ("GET", "http://example.com/items/abc", FREE),
    "GET /x": ("GET", "http://example.com/x", LIMITED),
    "POST /x": ("POST", "http://example.com/x", FREE),
}
FLASK_PROBES = {
    "GET evil.example.com/login": ("GET", "http://evil.example.com/login"),
    "GET API.example.com/login": ("GET", "http://API.example.com/login"),
    "GET api.example.com/items/1": ("GET", "http://api.example.com/items/1"),
    "GET other.host/login": ("GET", "http://other.host/login"),
    "GET example.com:8080/login": ("GET", "http://example.com:8080/login"),
    "GET /items/abc": ("GET", "http://example.com/items/abc"),
    "GET /items/-1": ("GET", "http://example.com/items/-1"),
    "POST /x": ("POST", "http://example.com/x"),
    "PUT /x": ("PUT", "http://example.com/x"),
    "HEAD /x": ("HEAD", "http://example.com/x"),
    "OPTIONS /x": ("OPTIONS", "http://example.com/x"),
    "POST api.example.com/login": ("POST", "http://api.example.com/login"),
    "GET /nope": ("GET", "http://example.com/nope"),
}


@pytest.mark.parametrize("probe", sorted(FLASK_PROBES))
def test_flask_no_probe_changes_the_limits_of_the_next_request(
    backend: types.SimpleNamespace, probe: str
) -> None:
    client = flask_app(backend).test_client()
    method, url = FLASK_PROBES[probe]
    _flask(method, url, "192.0.2.66")(client)
    got = {t: [_flask(m, u, "192.0.2.1")(client) for _ in range(3)] for t, (m, u, _) in FLASK_TARGETS.items()}
    assert got == {t: expected for t, (_, _, expected) in FLASK_TARGETS.items()}


def test_flask_control_each_target_is_limited_as_declared(backend: types.SimpleNamespace) -> None:
    client = flask_app(backend).test_client()
    got = {t: [_flask(m, u, "192.0.2.1")(client) for _ in range(3)] for t, (m, u, _) in FLASK_TARGETS.items()}
    assert got == {t: expected for t, (_, _, expected) in FLASK_TARGETS.items()}


# ---------------------------------------------------------------------------
# Real servers: what uvicorn and Werkzeug's server hand the app


def _raw(
    port: int, method: str, target: str, host: str, extra: dict[str, str] | None = None, key: str = VICTIM
) -> int:
    """One HTTP/1.1 request with exactly this Host header; the status."""
    head = [f"{method} {target} HTTP/1.1", f"Host: {host}", "Connection: close", f"X-API-Key: {key}"]
    head += [f"{k}: {v}" for k, v in (extra or {}).items()]
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT) as sock:
        sock.sendall(("\r\n".join(head) + "\r\n\r\n").encode("latin-1"))
        data = b""
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    line = data.split(b"\r\n", 1)[0].split()
    return int(line[1]) if len(line) > 1 and line[1].isdigit() else 0


def _upgrade(port: int, target: str, host: str, key: str) -> int:
    """A websocket handshake over a raw socket: 101 when accepted, else the
    status the server refused it with."""
    nonce = base64.b64encode(os.urandom(16)).decode()
    return _raw(
        port,
        "GET",
        target,
        host,
        {
            "Upgrade": "websocket",
            "Connection": "Upgrade",
            "Sec-WebSocket-Key": nonce,
            "Sec-WebSocket-Version": "13",
        },
        key,
    )


@contextlib.contextmanager
def _uvicorn_ws(app: Any) -> Iterator[int]:
    pytest.importorskip("websockets")  # the websocket protocol uvicorn serves upgrades with
    with uvicorn_server(app) as port:
        yield port


def test_uvicorn_a_websocket_upgrade_then_http_gets_keep_their_limit(backend: types.SimpleNamespace) -> None:
    with _uvicorn_ws(starlette_app(backend)) as port:
        probe = _upgrade(port, "/page", "127.0.0.1", PROBER)  # no websocket route at /page
        pages = [_raw(port, "GET", "/page", "127.0.0.1") for _ in range(3)]
        plain = _raw(port, "GET", "/ws", "127.0.0.1")  # an HTTP GET of the websocket route
        upgrades = [_upgrade(port, "/ws", "127.0.0.1", VICTIM) for _ in range(3)]
    assert probe != 101
    assert pages == LIMITED
    assert plain == 404
    assert upgrades[:2] == [101, 101] and upgrades[2] != 101


def test_uvicorn_an_unknown_host_then_the_hosts_route_keeps_its_limit(backend: types.SimpleNamespace) -> None:
    with uvicorn_server(starlette_app(backend)) as port:
        hosts = ("evil.example.com", "API.example.com:80", "")
        probes = [_raw(port, "GET", "/login", h, key=PROBER) for h in hosts]
        api = [_raw(port, "GET", "/login", "api.example.com") for _ in range(3)]
        elsewhere = [_raw(port, "GET", "/login", "www.example.com") for _ in range(3)]
    assert probes[0] == 200  # the exempt /login of every other host
    assert api == LIMITED and elsewhere == FREE


def test_werkzeug_an_unknown_subdomain_then_the_subdomains_route_keeps_its_limit(
    backend: types.SimpleNamespace,
) -> None:
    with werkzeug_server(flask_app(backend)) as port:
        probe = _raw(port, "GET", "/login", "evil.example.com", key=PROBER)
        api = [_raw(port, "GET", "/login", "api.example.com") for _ in range(3)]
        plain = [_raw(port, "GET", "/login", "example.com") for _ in range(3)]
        items = [_raw(port, "GET", "/items/5", "example.com") for _ in range(3)]
        named = [_raw(port, "GET", "/items/five", "example.com") for _ in range(3)]
    assert probe == 404
    assert api == LIMITED and plain == FREE and items == LIMITED and named == FREE


def test_an_asgi_lifespan_failure_names_an_ambiguous_route() -> None:
    """Under uvicorn's lifespan, a rules file's loose template that could
    name two routes stops the startup with the message."""
    loose = RateLimitRule("loose", "*", "/", "ip", "fixed_window", 2, 60.0, routes=("/items/{x}",))
    app = Starlette(
        routes=[Route("/items/{item_id:int}", _text), Route("/items/{name}", _text)],
        middleware=[Middleware(ASGIMiddleware, registry=RuleRegistry([loose]))],
    )
    sent: list[dict[str, Any]] = []
    messages = [{"type": "lifespan.startup"}]

    async def receive() -> dict[str, Any]:
        return messages.pop() if messages else {"type": "lifespan.shutdown"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    async def main() -> None:
        await app({"type": "lifespan", "asgi": {"version": "3.0"}, "app": app}, receive, send)

    asyncio.run(main())
    failed = [m for m in sent if m["type"] == "lifespan.startup.failed"]
    assert failed and "could name any of the routes" in failed[0]["message"]
