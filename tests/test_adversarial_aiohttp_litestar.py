"""Attacks on route-level limits through aiohttp (nanolimit.aiohttp) and
Litestar (nanolimit.asgi, as a Litestar middleware and wrapping the whole
app), as an attacker would send them.

1. A probe changes the limits of later requests (route-cache poisoning):
   for each probe, a fresh app; the probe is sent first (by another
   client: its own budget), then three requests to each target (each
   target its own client), and the statuses must equal those of a control
   run without the probe, which must itself be what the rules say.
2. An exempt route exempts another route: same shape with other
   converters, regexes or names; a path's methods bound to two views; a
   web.View beside a handler; a sub-app's route; one sub-app under two
   domains.
3. Rules naming routes by loose spellings bind to the one route meant; an
   ambiguous one fails at startup.

aiohttp runs under its TestServer (a real server on 127.0.0.1) and once
under web.AppRunner/TCPSite; Litestar under its TestClient and under a real
uvicorn (adversarial_servers). Probes travel as raw bytes where a client
library would tidy them (``//``, percent-encodings, lower-case methods).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import types
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

import pytest
from adversarial_servers import free_port, raw_request, uvicorn_server
from aiohttp import WSMsgType, web
from aiohttp.test_utils import TestClient, TestServer
from gateway_helpers import aiohttp_startup
from litestar import Litestar, MediaType, WebSocket, asgi, get, post, websocket
from litestar.middleware import DefineMiddleware
from litestar.testing import TestClient as LitestarClient

import nanolimit.aiohttp as nl_aiohttp
from nanolimit import LimiterFactory, RateLimitRule, RuleRegistry
from nanolimit.asgi import RateLimitMiddleware as ASGIMiddleware
from nanolimit.errors import RuleValidationError
from nanolimit.gateway.routes import RouteLimits
from nanolimit.gateway.starlette import routes_of as litestar_routes_of

KEY = "X-API-Key"  # every rule is per API key: a probe spends its own budget, never a target's
N = 3  # target requests after the probe; every limit below is 2
TIMEOUT = 60.0


@pytest.fixture(autouse=True)
def _quiet_denials() -> Iterator[None]:
    logger = logging.getLogger("nanolimit.denials")
    level = logger.level
    logger.setLevel(logging.ERROR)  # hundreds of expected 429s
    yield
    logger.setLevel(level)


def rule(name: str, limit: int = 2, prefix: str = "/", **kw: Any) -> RateLimitRule:
    return RateLimitRule(name, kw.pop("method", "*"), prefix, "api_key", "fixed_window", limit, 60.0, **kw)


def factory(backend: types.SimpleNamespace) -> LimiterFactory:
    return LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(1_000.0))


# ---------------------------------------------------------------------------
# Raw HTTP/1.1 over asyncio (aiohttp's servers run in the test's loop)


async def araw(
    port: int, method: str, target: str, headers: dict[str, str] | None = None, upgrade: bool = False
) -> int:
    """``METHOD target HTTP/1.1`` as given, byte for byte; the status (0:
    none came back). ``upgrade``: a websocket handshake."""
    given = dict(headers or {})
    lines = [f"{method} {target} HTTP/1.1", f"Host: {given.pop('Host', '127.0.0.1')}"]
    if upgrade:
        lines += [
            "Upgrade: websocket",
            "Connection: Upgrade",
            "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
            "Sec-WebSocket-Version: 13",
        ]
    else:
        lines.append("Connection: close")
    lines += [f"{k}: {v}" for k, v in given.items()]
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        await writer.drain()
        status_line = await asyncio.wait_for(reader.readline(), 10.0)
        parts = status_line.split(b" ")
        if not upgrade:
            await asyncio.wait_for(reader.read(), 10.0)
        return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def raw_ws_handshake(port: int, target: str, headers: dict[str, str] | None = None) -> int:
    """A websocket handshake to a blocking server thread (uvicorn): the status."""
    lines = [
        f"GET {target} HTTP/1.1",
        f"Host: {(headers or {}).get('Host', '127.0.0.1')}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
    ] + [f"{k}: {v}" for k, v in (headers or {}).items() if k != "Host"]
    with socket.create_connection(("127.0.0.1", port), timeout=5.0) as sock:
        sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
        status_line = sock.recv(4096).split(b"\r\n", 1)[0]
    parts = status_line.split(b" ")
    return int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


# ---------------------------------------------------------------------------
# aiohttp: the app under attack


def aio_app(backend: types.SimpleNamespace) -> web.Application:
    """Every route shape the attacks aim at. Limits of 2 per API key:
    ``/items/{item_id:\\d+}`` (declared), ``/page`` (a registry rule naming
    the route), and ``all`` (a prefix rule) for the rest; exempt:
    ``/items/{name}``, ``GET /free``, the sub-app's ``/sub/page``, the
    ``api.example.com`` domain's ``/login`` and the web.View's POST of
    ``/things``."""
    registry = RuleRegistry([rule("all"), rule("page", routes=("/page",))])
    limits = RouteLimits(registry, algorithm="fixed_window", scope="api_key")

    def text(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def handler(request: web.Request) -> web.Response:
            return web.Response(text=name)

        handler.__name__ = handler.__qualname__ = name  # its limit is named after it
        return handler

    async def ws(request: web.Request) -> web.StreamResponse:
        sock = web.WebSocketResponse()
        await sock.prepare(request)  # a plain GET: aiohttp's 400
        await sock.send_str("hi")
        await sock.close()
        return sock

    @limits.exempt
    class Things(web.View):
        async def post(self) -> web.Response:
            return web.Response(text="made")

    app = web.Application()
    app.router.add_get(r"/items/{item_id:\d+}", limits.limit("2/minute")(text("item")))
    app.router.add_get("/items/{name}", limits.exempt(text("named")))
    app.router.add_get("/page", text("page"))
    app.router.add_get("/ws", ws)
    app.router.add_get("/free", limits.exempt(text("free_get")))
    app.router.add_post("/free", text("free_post"))
    app.router.add_get("/things", text("things_get"))
    app.router.add_view("/things", Things)
    app.router.add_get("/login", text("login"))
    sub = web.Application()
    sub.router.add_get("/page", limits.exempt(text("sub_page")))
    app.add_subapp("/sub", sub)
    api = web.Application()
    api.router.add_get("/login", limits.exempt(text("api_login")))
    app.add_domain("api.example.com", api)
    nl_aiohttp.setup(app, limits=limits, factory=factory(backend))
    return app


# target: (method, path, headers) -> what three requests answer
AIO_TARGETS: list[tuple[tuple[str, str, dict[str, str]], list[int]]] = [
    (("GET", "/items/1", {}), [200, 200, 429]),
    (("GET", "/items/abc", {}), [200, 200, 200]),
    (("GET", "/page", {}), [200, 200, 429]),
    (("HEAD", "/page", {}), [200, 200, 429]),
    (("GET", "/sub/page", {}), [200, 200, 200]),
    (("GET", "/login", {}), [200, 200, 429]),
    (("GET", "/login", {"Host": "api.example.com"}), [200, 200, 200]),
    (("GET", "/free", {}), [200, 200, 200]),
    (("POST", "/free", {}), [200, 200, 429]),
    (("GET", "/things", {}), [200, 200, 429]),
    (("POST", "/things", {}), [200, 200, 200]),
]

# probe: (method, raw request-target, headers, websocket handshake?)
AIO_PROBES: list[tuple[str, str, dict[str, str], bool]] = [
    ("GET", "/page", {}, True),  # a websocket handshake to an HTTP route
    ("GET", "/items/1", {}, True),
    ("GET", "/things", {}, True),
    ("GET", "/ws", {}, False),  # a plain GET to the websocket route
    ("GET", "/ws", {}, True),
    ("GET", "/login", {"Host": "evil.example"}, False),
    ("GET", "/login", {"Host": "API.EXAMPLE.COM"}, False),
    ("GET", "/login", {"Host": "api.example.com."}, False),
    ("GET", "/login", {"Host": "api.example.com:80"}, False),
    ("GET", "/login", {"Host": "x.api.example.com"}, False),
    ("GET", "/page", {"Host": "api.example.com"}, False),  # the domain has no /page
    ("GET", "/items/1", {"Host": "api.example.com"}, False),
    ("HEAD", "/page", {}, False),
    ("HEAD", "/items/abc", {}, False),
    ("OPTIONS", "/page", {}, False),
    ("OPTIONS", "/things", {}, False),
    ("get", "/page", {}, False),
    ("post", "/free", {}, False),
    ("FOO", "/page", {}, False),
    ("PURGE", "/items/1", {}, False),
    ("PUT", "/things", {}, False),  # the view answers only POST: 405
    ("POST", "/page", {}, False),  # 405 on an existing path
    ("DELETE", "/items/1", {}, False),
    ("POST", "/sub/page", {}, False),
    ("GET", "/nope", {}, False),
    ("GET", "/items/1/x", {}, False),
    ("GET", "//page", {}, False),
    ("GET", "/page/", {}, False),
    ("GET", "/page//", {}, False),
    ("GET", "/%70age", {}, False),
    ("GET", "/items/%31", {}, False),
    ("GET", "/items/1%2F", {}, False),
    ("GET", "/items/%2e%2e/page", {}, False),
    ("GET", "/items/../page", {}, False),
    ("GET", "/sub", {}, False),
    ("GET", "/sub/", {}, False),
    ("GET", "/sub//page", {}, False),
    ("GET", "/sub/page/", {}, False),
    ("GET", "/sub/%70age", {}, False),
    ("GET", "/free?x=1", {}, False),
    ("GET", "http://127.0.0.1/page", {}, False),  # absolute-form
    ("GET", "/login", {"Host": ""}, False),
]


async def aio_targets(port: int) -> list[list[int]]:
    out = []
    for i, ((method, path, headers), _) in enumerate(AIO_TARGETS):
        who = {KEY: f"victim-{i}", **headers}
        out.append([await araw(port, method, path, who) for _ in range(N)])
    return out


def aio_run(backend: types.SimpleNamespace, probe: tuple[str, str, dict[str, str], bool] | None) -> Any:
    async def main() -> Any:
        async with TestClient(TestServer(aio_app(backend), host="127.0.0.1")) as client:
            port = client.server.port
            assert port is not None
            if probe is not None:
                method, target, headers, upgrade = probe
                await araw(port, method, target, {KEY: "probe", **headers}, upgrade)
            return await aio_targets(port)

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def test_aiohttp_control_run_is_what_the_rules_say(backend: types.SimpleNamespace) -> None:
    assert aio_run(backend, None) == [expected for _, expected in AIO_TARGETS]


@pytest.mark.parametrize("probe", AIO_PROBES, ids=lambda p: f"{p[0]} {p[1]} {p[2]} ws={p[3]}")
def test_aiohttp_no_probe_changes_the_limits_of_later_requests(
    backend: types.SimpleNamespace, probe: tuple[str, str, dict[str, str], bool]
) -> None:
    assert aio_run(backend, probe) == [expected for _, expected in AIO_TARGETS]


def test_aiohttp_under_app_runner_websockets_and_hosts_change_nothing(backend: types.SimpleNamespace) -> None:
    """aiohttp's own AppRunner/TCPSite on a free loopback port: a real
    websocket session (aiohttp's client) and Host probes, then the targets."""

    async def main() -> tuple[list[list[int]], list[str]]:
        runner = web.AppRunner(aio_app(backend))
        await runner.setup()
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            got: list[str] = []
            async with TestClient(TestServer(web.Application())) as helper:  # only for its session
                async with helper.session.ws_connect(
                    f"http://127.0.0.1:{port}/ws", headers={KEY: "probe"}
                ) as sock:
                    msg = await sock.receive()
                    if msg.type == WSMsgType.TEXT:
                        got.append(msg.data)
            for host in ("evil.example", "api.example.com", "API.example.com:1"):
                for path in ("/login", "/page", "/items/1"):
                    await araw(port, "GET", path, {KEY: "probe", "Host": host})
                    await araw(port, "GET", path, {KEY: "probe", "Host": host}, upgrade=True)
            return await aio_targets(port), got
        finally:
            await runner.cleanup()

    statuses, got = asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    assert got == ["hi"]  # the websocket route served a session
    assert statuses == [expected for _, expected in AIO_TARGETS]


# ---------------------------------------------------------------------------
# aiohttp: an exempt route never exempts another


def serve(app: web.Application, requests: list[tuple[str, str, dict[str, str]]]) -> list[tuple[int, str]]:
    async def main() -> list[tuple[int, str]]:
        async with TestClient(TestServer(app, host="127.0.0.1")) as client:
            out = []
            for method, path, headers in requests:
                async with client.request(method, path, headers={KEY: "v", **headers}) as r:
                    out.append((r.status, (await r.text()) if r.status != 429 else "429"))
            return out

    return asyncio.run(asyncio.wait_for(main(), TIMEOUT))


def hello(name: str) -> Callable[[web.Request], Awaitable[web.Response]]:
    async def handler(request: web.Request) -> web.Response:
        return web.Response(text=name)

    handler.__name__ = handler.__qualname__ = name
    return handler


def limited(backend: types.SimpleNamespace, build: Callable[[RouteLimits, web.Application], None]) -> Any:
    limits = RouteLimits(RuleRegistry([rule("all")]), algorithm="fixed_window", scope="api_key")
    app = web.Application()
    build(limits, app)
    nl_aiohttp.setup(app, limits=limits, factory=factory(backend))
    return app


def test_aiohttp_an_exempt_plain_placeholder_does_not_exempt_a_regex_one(
    backend: types.SimpleNamespace,
) -> None:
    """Before: aiohttp's ``canonical`` drops the regex, both were
    ``/items/{id}``, and the exempt one exempted /items/1: [200, 200, 200]."""

    def build(limits: RouteLimits, app: web.Application) -> None:
        app.router.add_get(r"/items/{id:\d+}", hello("num"))
        app.router.add_get("/items/{id}", limits.exempt(hello("any")))

    app = limited(backend, build)
    got = serve(app, [("GET", "/items/1", {})] * 3 + [("GET", "/items/abc", {})] * 3)
    assert got == [(200, "num"), (200, "num"), (429, "429")] + [(200, "any")] * 3
    templates = {r.template for r in nl_aiohttp.routes_of(app)}
    assert templates == {r"/items/{id:\d+}", "/items/{id}"}


def test_aiohttp_exempt_by_name_and_converter_under_a_sub_app_prefix(backend: types.SimpleNamespace) -> None:
    def build(limits: RouteLimits, app: web.Application) -> None:
        sub = web.Application()
        sub.router.add_get(r"/items/{item_id:\d+}", hello("num"))
        sub.router.add_get("/items/{name}", limits.exempt(hello("named")))
        sub.router.add_get(r"/v/{x:[a-z]+}", limits.exempt(hello("letters")))
        sub.router.add_get(r"/v/{x:\d+}", hello("digits"))
        app.add_subapp("/api", sub)

    got = serve(
        limited(backend, build),
        [("GET", "/api/items/7", {})] * 3 + [("GET", "/api/items/x", {})] * 3 + [("GET", "/api/v/9", {})] * 3,
    )
    # "all" is one budget: /api/v/9 finds it spent, the exempt ones never touch it
    assert [s for s, _ in got] == [200, 200, 429, 200, 200, 200, 429, 429, 429]


def test_aiohttp_an_exempt_view_does_not_exempt_the_handler_of_its_path(
    backend: types.SimpleNamespace,
) -> None:
    """Before: a web.View ("*") exempt beside a GET handler of its path was
    exempt for every method: GET /things ran unlimited, [200, 200, 200]."""

    def build(limits: RouteLimits, app: web.Application) -> None:
        @limits.exempt
        class Things(web.View):
            async def post(self) -> web.Response:
                return web.Response(text="made")

        app.router.add_get("/things", hello("list"))
        app.router.add_view("/things", Things)

    got = serve(limited(backend, build), [("GET", "/things", {})] * 3 + [("POST", "/things", {})] * 3)
    assert got == [(200, "list"), (200, "list"), (429, "429")] + [(200, "made")] * 3


def test_aiohttp_an_exempt_method_does_not_exempt_the_other_method(backend: types.SimpleNamespace) -> None:
    def build(limits: RouteLimits, app: web.Application) -> None:
        app.router.add_get("/x", limits.exempt(hello("get")))
        app.router.add_post("/x", hello("post"))
        app.router.add_get("/y", hello("y_get"))
        app.router.add_post("/y", limits.exempt(hello("y_post")))

    got = serve(
        limited(backend, build),
        [("POST", "/x", {})] * 3 + [("GET", "/x", {}), ("HEAD", "/x", {})] + [("GET", "/y", {})] * 3,
    )
    assert [s for s, _ in got] == [200, 200, 429, 200, 200, 429, 429, 429]


def test_aiohttp_a_class_view_limit_and_exempt_views_by_method(backend: types.SimpleNamespace) -> None:
    def build(limits: RouteLimits, app: web.Application) -> None:
        @limits.limit("1/minute", methods=["POST"])
        class Limited(web.View):
            async def get(self) -> web.Response:
                return web.Response(text="list")

            async def post(self) -> web.Response:
                return web.Response(text="made")

        @limits.exempt
        class Open(web.View):
            async def get(self) -> web.Response:
                return web.Response(text="open")

        app.router.add_view("/limited", Limited)
        app.router.add_view("/open", Open)

    got = serve(
        limited(backend, build),
        [("POST", "/limited", {})] * 2 + [("GET", "/open", {})] * 3 + [("GET", "/limited", {})] * 3,
    )
    assert [s for s, _ in got] == [200, 429, 200, 200, 200, 200, 200, 429]


def test_aiohttp_the_same_template_under_two_domains_one_exempt(backend: types.SimpleNamespace) -> None:
    def build(limits: RouteLimits, app: web.Application) -> None:
        a = web.Application()
        a.router.add_get("/login", limits.exempt(hello("a")))
        b = web.Application()
        b.router.add_get("/login", hello("b"))
        app.add_domain("a.example.com", a)
        app.add_domain("*.example.com", b)
        app.router.add_get("/login", hello("own"))

    got = serve(
        limited(backend, build),
        [("GET", "/login", {"Host": "a.example.com"})] * 3
        + [("GET", "/login", {"Host": "b.example.com"})] * 3
        + [("GET", "/login", {"Host": "a.example.com"})],
    )
    assert got == [(200, "a")] * 3 + [(200, "b"), (200, "b"), (429, "429"), (200, "a")]


def test_aiohttp_one_sub_app_under_two_domains_is_two_routes(backend: types.SimpleNamespace) -> None:
    """Before: the sub-app's domain was whichever was added last, so a rule
    naming //a.example.com/login limited nothing on a: [200, 200, 200]."""
    shared = web.Application()
    shared.router.add_get("/login", hello("login"))
    app = web.Application()
    app.add_domain("a.example.com", shared)
    app.add_domain("b.example.com", shared)
    registry = RuleRegistry([rule("a_login", routes=("//a.example.com/login",))])
    nl_aiohttp.setup(app, registry, factory(backend))
    got = serve(
        app,
        [("GET", "/login", {"Host": "a.example.com"})] * 3
        + [("GET", "/login", {"Host": "b.example.com"})] * 3,
    )
    assert [s for s, _ in got] == [200, 200, 429, 200, 200, 200]


def test_aiohttp_an_exempt_sub_app_route_does_not_exempt_the_apps_own_route(
    backend: types.SimpleNamespace,
) -> None:
    def build(limits: RouteLimits, app: web.Application) -> None:
        sub = web.Application()
        sub.router.add_get("/page", limits.exempt(hello("sub")))
        app.add_subapp("/sub", sub)
        app.router.add_get("/sub/page", hello("own"))  # aiohttp serves this one

    got = serve(limited(backend, build), [("GET", "/sub/page", {})] * 3)
    assert got == [(200, "own"), (200, "own"), (429, "429")]


# ---------------------------------------------------------------------------
# aiohttp: rules naming routes


def aio_startup(app: web.Application) -> None:
    aiohttp_startup(app, TIMEOUT)


@pytest.mark.parametrize(
    "spelling", ["/items/{item_id}", r"/items/{item_id:\d+}", "/items/<item_id>", "items/{item_id}"]
)
def test_aiohttp_a_loose_spelling_binds_to_the_one_route_meant(
    backend: types.SimpleNamespace, spelling: str
) -> None:
    app = web.Application()
    app.router.add_get(r"/items/{item_id:\d+}", hello("num"))
    app.router.add_get("/items/{name}", hello("named"))
    nl_aiohttp.setup(app, RuleRegistry([rule("item", routes=(spelling,))]), factory(backend))
    got = serve(app, [("GET", "/items/1", {})] * 3 + [("GET", "/items/abc", {})] * 3)
    assert [s for s, _ in got] == [200, 200, 429, 200, 200, 200]


def test_aiohttp_the_exact_spelling_wins_over_a_regex_route_of_the_same_name(
    backend: types.SimpleNamespace,
) -> None:
    app = web.Application()
    app.router.add_get(r"/items/{id:\d+}", hello("num"))
    app.router.add_get("/items/{id}", hello("any"))
    nl_aiohttp.setup(app, RuleRegistry([rule("any", routes=("/items/{id}",))]), factory(backend))
    got = serve(app, [("GET", "/items/1", {})] * 3 + [("GET", "/items/abc", {})] * 3)
    assert [s for s, _ in got] == [200, 200, 200, 200, 200, 429]


@pytest.mark.parametrize(
    ("paths", "spelling"),
    [
        ((r"/items/{item_id:\d+}", "/items/{name}"), "/items/{x}"),
        ((r"/items/{id:\d+}", "/items/{id:[a-z]+}"), "/items/{id}"),
        ((r"/items/{id:\d+}", "/items/{id:[a-z]+}"), "/items/<id>"),
    ],
)
def test_aiohttp_an_ambiguous_spelling_fails_the_startup(paths: tuple[str, str], spelling: str) -> None:
    app = web.Application()
    for i, path in enumerate(paths):
        app.router.add_get(path, hello(f"h{i}"))
    nl_aiohttp.setup(app, RuleRegistry([rule("loose", routes=(spelling,))]))
    with pytest.raises(RuleValidationError, match=r"rule 'loose'.*could name any of"):
        aio_startup(app)


def test_aiohttp_a_path_under_domains_binds_to_the_apps_own_route_or_fails(
    backend: types.SimpleNamespace,
) -> None:
    def with_domains(own: bool) -> web.Application:
        app = web.Application()
        for domain in ("a.example.com", "b.example.com"):
            sub = web.Application()
            sub.router.add_get("/login", hello(domain))
            app.add_domain(domain, sub)
        if own:
            app.router.add_get("/login", hello("own"))
        return app

    app = with_domains(own=True)
    nl_aiohttp.setup(app, RuleRegistry([rule("login", routes=("/login",))]), factory(backend))
    got = serve(app, [("GET", "/login", {})] * 3 + [("GET", "/login", {"Host": "a.example.com"})] * 3)
    assert [s for s, _ in got] == [200, 200, 429, 200, 200, 200]  # the app's own /login only
    app = with_domains(own=False)
    nl_aiohttp.setup(app, RuleRegistry([rule("login", routes=("/login",))]))
    with pytest.raises(RuleValidationError, match="could name any of"):
        aio_startup(app)


# ---------------------------------------------------------------------------
# Litestar: the app under attack


@get("/items/{item_id:int}", media_type=MediaType.TEXT)
async def ls_item(item_id: int) -> str:
    return "item"


@get("/items/{name:str}", media_type=MediaType.TEXT)
async def ls_named(name: str) -> str:
    return "named"


@get("/names/{name:str}", media_type=MediaType.TEXT)
async def ls_name(name: str) -> str:
    return "name"


@get("/page", media_type=MediaType.TEXT)
async def ls_page() -> str:
    return "page"


@websocket("/ws")
async def ls_ws(socket: WebSocket[Any, Any, Any]) -> None:
    await socket.accept()
    await socket.send_text("hi")
    await socket.close()


@get("/free", media_type=MediaType.TEXT)
async def ls_free_get() -> str:
    return "free"


@post("/free", media_type=MediaType.TEXT)
async def ls_free_post() -> str:
    return "posted"


@asgi("/static", is_mount=True)
async def ls_static(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"static"})


LS_HANDLERS = [ls_item, ls_name, ls_page, ls_ws, ls_free_get, ls_free_post, ls_static]


def ls_registry() -> RuleRegistry:
    """Limits of 2 per API key: the int item route, /page and the /static
    mount by rules naming them, ``all`` for the rest; exempt: the str
    ``/names`` route and GET /free."""
    return RuleRegistry(
        [
            rule("all"),
            rule("item", routes=("/items/{item_id:int}",)),
            rule("page", routes=("/page",)),
            rule("static", routes=("/static",)),
        ],
        exempt=("/names/{name}", ("/free", frozenset({"GET", "HEAD"}))),
    )


def ls_app(
    backend: types.SimpleNamespace, mode: str, registry: RuleRegistry | None = None, handlers: Any = None
) -> Any:
    """``middleware``: a Litestar middleware (after Litestar's router);
    ``wrapped``: nanolimit's ASGI middleware around the whole app (before it)."""
    registry = registry or ls_registry()
    handlers = handlers or LS_HANDLERS
    if mode == "middleware":
        middleware = DefineMiddleware(ASGIMiddleware, registry=registry, factory=factory(backend))
        return Litestar(handlers, middleware=[middleware], openapi_config=None)
    return ASGIMiddleware(Litestar(handlers, openapi_config=None), registry, factory(backend))


def ls_targets(mode: str) -> list[tuple[tuple[str, str], list[int]]]:
    # Litestar's router answers a 404 before its middleware runs
    missing = [404, 404, 404] if mode == "middleware" else [404, 404, 429]
    missing_method = [405, 405, 405] if mode == "middleware" else [405, 405, 429]
    return [
        (("GET", "/items/1"), [200, 200, 429]),
        (("GET", "/items/abc"), missing),  # the wrong type for {item_id:int}: Litestar's 404
        (("GET", "/names/abc"), [200, 200, 200]),
        (("GET", "/page"), [200, 200, 429]),
        (("HEAD", "/page"), missing_method),  # a Litestar @get answers no HEAD: 405
        (("GET", "/free"), [200, 200, 200]),
        (("POST", "/free"), [201, 201, 429]),
        (("GET", "/static/a"), [200, 200, 429]),
        (("GET", "/missing"), missing),
    ]


# probe: (method, path, headers, websocket?)
LS_PROBES: list[tuple[str, str, dict[str, str], bool]] = [
    ("GET", "/page", {}, True),  # a websocket handshake to an HTTP route
    ("GET", "/items/1", {}, True),
    ("GET", "/ws", {}, False),  # a plain GET to the websocket route
    ("GET", "/ws", {}, True),
    ("GET", "/items/abc", {}, False),  # the wrong type for {item_id:int}: a 404
    ("GET", "/names/1", {}, False),
    ("GET", "/items/1.5", {}, False),
    ("GET", "/items/-1", {}, False),
    ("GET", "/items/%31", {}, False),
    ("GET", "/items/01", {}, False),
    ("GET", "/page", {"Host": "evil.example"}, False),
    ("GET", "/items/1", {"Host": "x" * 300}, False),
    ("HEAD", "/page", {}, False),
    ("OPTIONS", "/page", {}, False),
    ("OPTIONS", "/items/1", {}, False),
    ("FOO", "/page", {}, False),
    ("DELETE", "/items/1", {}, False),  # 405 on an existing path
    ("POST", "/page", {}, False),
    ("PUT", "/free", {}, False),
    ("GET", "/nope", {}, False),
    ("GET", "//page", {}, False),
    ("GET", "/page/", {}, False),
    ("GET", "/%70age", {}, False),
    ("GET", "/Page", {}, False),
    ("GET", "/static", {}, False),
    ("GET", "/static/", {}, False),
    ("GET", "//static//a", {}, False),
    ("GET", "/items", {}, False),
    ("GET", "/free?x=1", {}, False),
]


def ls_run(
    backend: types.SimpleNamespace, mode: str, probe: tuple[str, str, dict[str, str], bool] | None
) -> Any:
    base = "http://testserver.local"
    with LitestarClient(ls_app(backend, mode), base_url=base) as client:
        if probe is not None:
            method, path, headers, ws = probe
            if ws:
                with contextlib.suppress(Exception):  # refused or not, only what it leaves behind counts
                    with client.websocket_connect(path, headers={KEY: "probe", **headers}) as sock:
                        sock.receive_text()
            else:
                client.request(method, base + path, headers={KEY: "probe", **headers})
        out = []
        for i, ((method, path), _) in enumerate(ls_targets(mode)):
            out.append(
                [client.request(method, path, headers={KEY: f"victim-{i}"}).status_code for _ in range(N)]
            )
        return out


@pytest.mark.parametrize("mode", ["middleware", "wrapped"])
def test_litestar_control_run_is_what_the_rules_say(backend: types.SimpleNamespace, mode: str) -> None:
    """Before (wrapped): the rules naming routes limited nothing, the whole
    Litestar app being one route the resolver could not read: /items/1,
    /page and /static/a ran [200, 200, 200]; a mount under a Litestar
    middleware answered 500 (its empty path_template)."""
    assert ls_run(backend, mode, None) == [expected for _, expected in ls_targets(mode)]


@pytest.mark.parametrize("mode", ["middleware", "wrapped"])
@pytest.mark.parametrize("probe", LS_PROBES, ids=lambda p: f"{p[0]} {p[1][:20]} {sorted(p[2])} ws={p[3]}")
def test_litestar_no_probe_changes_the_limits_of_later_requests(
    backend: types.SimpleNamespace, mode: str, probe: tuple[str, str, dict[str, str], bool]
) -> None:
    assert ls_run(backend, mode, probe) == [expected for _, expected in ls_targets(mode)]


@pytest.mark.parametrize("mode", ["middleware", "wrapped"])
def test_litestar_under_uvicorn_raw_probes_change_nothing(backend: types.SimpleNamespace, mode: str) -> None:
    """A real uvicorn: raw websocket handshakes to HTTP routes, raw odd
    Hosts, methods and paths (lower-case methods, ``//``, percent-encoding),
    all by the probe's key first; then the targets."""
    with uvicorn_server(ls_app(backend, mode)) as port:
        for target in ("/page", "/items/1", "/static/a", "/ws"):
            raw_ws_handshake(port, target, {KEY: "probe"})
            raw_ws_handshake(port, target, {KEY: "probe", "Host": "evil.example"})
        for method, target in [
            ("get", b"/page"),
            ("FOO", b"/items/1"),
            ("GET", b"//page"),
            ("GET", b"/items/%31"),
            ("GET", b"/items/abc"),
            ("GET", b"/page/"),
            ("DELETE", b"/page"),
            ("GET", b"/ws"),
            ("GET", b"/static"),
        ]:
            raw_request(port, method, target, {KEY: "probe"})
        got = [
            [raw_request(port, method, path.encode(), {KEY: f"victim-{i}"}).status for _ in range(N)]
            for i, ((method, path), _) in enumerate(ls_targets(mode))
        ]
    assert got == [expected for _, expected in ls_targets(mode)]


# ---------------------------------------------------------------------------
# Litestar: an exempt route never exempts another; rules naming routes


def ls_statuses(app: Any, requests: list[tuple[str, str]]) -> list[int]:
    with LitestarClient(app) as client:
        return [client.request(m, p, headers={KEY: "v"}).status_code for m, p in requests]


@pytest.mark.parametrize("mode", ["middleware", "wrapped"])
def test_litestar_the_route_that_serves_decides_between_int_and_str_routes(
    backend: types.SimpleNamespace, mode: str
) -> None:
    """Litestar takes ``/items/{item_id:int}`` and ``/items/{name:str}``
    both, and the one added last serves every ``/items/x`` (the other is
    dead): an exemption of the dead one exempts nothing, and an exemption
    of the one that serves is its own."""
    page = rule("page", routes=("/page",))  # a rule naming a route: the app's routes are read
    dead_exempt = RuleRegistry([rule("all"), page], exempt=("/items/{item_id:int}",))
    app = ls_app(backend, mode, dead_exempt, handlers=[ls_item, ls_named, ls_page])  # ls_named serves
    assert ls_statuses(app, [("GET", "/items/1")] * 3) == [200, 200, 429]
    dead_exempt = RuleRegistry([rule("all"), page], exempt=("/items/{name}",))
    app = ls_app(backend, mode, dead_exempt, handlers=[ls_named, ls_item, ls_page])  # ls_item serves
    missing = [404, 404] if mode == "middleware" else [429, 429]  # wrapped: a 404 spends "all"
    assert ls_statuses(app, [("GET", "/items/1")] * 3 + [("GET", "/items/x")] * 2) == [
        200,
        200,
        429,
        *missing,
    ]
    serving_exempt = RuleRegistry([rule("all"), page], exempt=("/items/{name:str}",))
    app = ls_app(backend, mode, serving_exempt, handlers=[ls_item, ls_named, ls_page])
    assert ls_statuses(app, [("GET", "/items/1")] * 3 + [("GET", "/page")] * 3) == [200] * 5 + [429]


@pytest.mark.parametrize("mode", ["middleware", "wrapped"])
def test_litestar_an_exemption_alone_exempts_its_route(backend: types.SimpleNamespace, mode: str) -> None:
    registry = RuleRegistry([rule("all")], exempt=("/names/{name}",))
    app = ls_app(backend, mode, registry, handlers=[ls_name, ls_page])
    assert ls_statuses(app, [("GET", "/names/x")] * 3 + [("GET", "/page")] * 3) == [200] * 5 + [429]


@pytest.mark.parametrize("mode", ["middleware", "wrapped"])
def test_litestar_an_exempt_method_does_not_exempt_another(backend: types.SimpleNamespace, mode: str) -> None:
    registry = RuleRegistry(
        [rule("all"), rule("page", routes=("/page",))], exempt=(("/free", frozenset({"POST"})),)
    )
    got = ls_statuses(ls_app(backend, mode, registry), [("POST", "/free")] * 3 + [("GET", "/free")] * 3)
    assert got == [201, 201, 201, 200, 200, 429]


@pytest.mark.parametrize("mode", ["middleware", "wrapped"])
@pytest.mark.parametrize("spelling", ["/items/{item_id}", "/items/<int:item_id>", "items/{item_id:int}"])
def test_litestar_a_loose_spelling_binds_to_the_one_route_meant(
    backend: types.SimpleNamespace, mode: str, spelling: str
) -> None:
    registry = RuleRegistry([rule("item", routes=(spelling,))])
    app = ls_app(backend, mode, registry, handlers=[ls_item, ls_name, ls_page])
    got = ls_statuses(app, [("GET", "/items/1")] * 3 + [("GET", "/names/x")] * 3)
    assert got == [200, 200, 429, 200, 200, 200]


@pytest.mark.parametrize("mode", ["middleware", "wrapped"])
def test_litestar_an_ambiguous_spelling_fails_the_startup(backend: types.SimpleNamespace, mode: str) -> None:
    # Litestar takes two routes of one shape (the last serves): a loose name of both is refused
    registry = RuleRegistry([rule("loose", routes=("/items/{x}",))])
    app = ls_app(backend, mode, registry, handlers=[ls_item, ls_named, ls_name])
    if mode == "wrapped":  # bound at the lifespan startup, which fails with the reason
        assert "could name any of" in asgi_startup_failure(app)
        return
    # a Litestar middleware is not on the lifespan path: it binds on the first
    # request, which fails (Litestar answers the 500), and so does every later one
    with LitestarClient(app) as client:
        assert [client.get(p).status_code for p in ("/items/1", "/names/x")] == [500, 500]  # not unlimited
    with pytest.raises(RuleValidationError, match="could name any of"):
        RouteLimits(registry).bind(litestar_routes_of(app))


def asgi_startup_failure(app: Any) -> str:
    """Run an ASGI app's lifespan startup: the message of a
    ``lifespan.startup.failed`` (empty when it started)."""
    sent: list[dict[str, Any]] = []

    async def main() -> None:
        messages = [{"type": "lifespan.startup"}]

        async def receive() -> dict[str, Any]:
            if messages:
                return messages.pop()
            await asyncio.sleep(3600)
            return {}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}}, receive, send))
        while not sent and not task.done():
            await asyncio.sleep(0.01)
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    asyncio.run(asyncio.wait_for(main(), TIMEOUT))
    failed = [m for m in sent if m["type"] == "lifespan.startup.failed"]
    return str(failed[0]["message"]) if failed else ""


@pytest.mark.parametrize("mode", ["middleware", "wrapped"])
def test_litestar_a_prefix_rule_limits_a_mount(backend: types.SimpleNamespace, mode: str) -> None:
    registry = RuleRegistry([rule("static", 2, "/static")])
    app = ls_app(backend, mode, registry, handlers=[ls_static, ls_page])
    assert ls_statuses(app, [("GET", "/static/a")] * 3) == [200, 200, 429]
