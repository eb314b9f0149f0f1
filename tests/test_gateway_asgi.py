"""The ASGI middleware end to end: Starlette through httpx's ASGI transport, a
bare ASGI app, websockets, and one real uvicorn server on a loopback port."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import types
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from gateway_helpers import post_statuses, rule
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as StarletteRequest
from starlette.responses import JSONResponse, PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.testclient import TestClient, WebSocketDenialResponse
from starlette.websockets import WebSocket, WebSocketDisconnect

from nanolimit.asgi import RateLimitMiddleware
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.keys import DefaultKeyExtractor
from nanolimit.gateway.metrics import Metrics
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import RateLimitRule


def test_asgi_module_imports_no_framework() -> None:
    import nanolimit.asgi
    import nanolimit.wsgi

    for module in (nanolimit.asgi, nanolimit.wsgi):
        names = set(vars(module))
        assert not names & {"starlette", "flask", "django", "fastapi"}
    source = "".join(Path(m.__file__).read_text() for m in (nanolimit.asgi, nanolimit.wsgi))
    for framework in ("starlette", "flask", "django", "fastapi", "werkzeug"):
        assert f"import {framework}" not in source and f"from {framework}" not in source


def _app(
    backend: types.SimpleNamespace,
    rules: list,
    *,
    stacked: bool = False,
    clock: Any = None,
    extractor: Any = None,
    sleep: Any = None,
) -> tuple[Starlette, Metrics, RuleRegistry]:
    metrics = Metrics()
    registry = RuleRegistry(rules, stacked=stacked)
    factory = LimiterFactory(backend.InMemoryStorage(), clock or backend.FakeClock(0.0))

    async def home(request: StarletteRequest) -> PlainTextResponse:
        return PlainTextResponse("home", headers={"X-App": "yes"})

    async def orders(request: StarletteRequest) -> JSONResponse:
        return JSONResponse({"ordered": True}, status_code=201)

    async def metrics_endpoint(request: StarletteRequest) -> PlainTextResponse:
        return PlainTextResponse(metrics.render_prometheus())

    async def ws(websocket: WebSocket) -> None:
        await websocket.accept()
        await websocket.send_text("hello")
        await websocket.close()

    kwargs: dict[str, Any] = {"registry": registry, "factory": factory, "metrics": metrics}
    if extractor is not None:
        kwargs["extractor"] = extractor
    if sleep is not None:
        kwargs["sleep"] = sleep
    app = Starlette(
        routes=[
            Route("/", home),
            Route("/orders", orders, methods=["POST"]),
            Route("/metrics", metrics_endpoint),
            WebSocketRoute("/ws", ws),
        ],
        middleware=[Middleware(RateLimitMiddleware, **kwargs)],
    )
    return app, metrics, registry


async def _requests(
    app: Any,
    calls: list[tuple[str, str]],
    client: tuple[str, int] = ("192.0.2.1", 5000),
    headers: dict[str, str] | None = None,
) -> list[httpx.Response]:
    transport = httpx.ASGITransport(app=app, client=client)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
        return [await http.request(method, path, headers=headers) for method, path in calls]


def test_starlette_app_is_limited_end_to_end(backend) -> None:
    app, metrics, _ = _app(
        backend, [rule("site", 3, 60.0), rule("orders", 1, 10.0, method="POST", path_prefix="/orders")]
    )
    before = time.time()
    responses = asyncio.run(_requests(app, [("GET", "/")] * 4 + [("POST", "/orders")] * 2))
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 201, 429]
    first = responses[0]
    assert first.text == "home" and first.headers["x-app"] == "yes"
    assert first.headers["x-ratelimit-limit"] == "3"
    assert first.headers["x-ratelimit-remaining"] == "2"
    reset = int(first.headers["x-ratelimit-reset"])
    assert before + 19 <= reset <= time.time() + 21  # one token back in 20 s, as a Unix time
    assert first.headers["ratelimit-policy"] == '"site";q=3;w=60'
    assert first.headers["ratelimit"] == '"site";r=2;t=20'
    assert "retry-after" not in first.headers
    denied = responses[3]
    assert denied.json() == {"error": "rate_limit_exceeded", "rule": "site", "retry_after": 20}
    assert denied.headers["content-type"] == "application/json"
    assert denied.headers["retry-after"] == "20"
    assert denied.headers["x-ratelimit-remaining"] == "0"
    assert denied.headers["ratelimit"] == '"site";r=0;t=60'
    assert responses[4].json() == {"ordered": True}
    assert responses[5].headers["retry-after"] == "10"
    assert responses[5].json()["rule"] == "orders"
    assert metrics.snapshot()["site"] == {"allowed": 3, "denied": 1, "shadow_denied": 0, "near_limit": 1}
    assert metrics.snapshot()["orders"]["denied"] == 1
    # another client has its own budget
    other = asyncio.run(_requests(app, [("GET", "/")], client=("192.0.2.99", 1)))
    assert other[0].status_code == 200


def test_starlette_metrics_endpoint_serves_prometheus_text(backend) -> None:
    app, _, _ = _app(backend, [rule("site", 2, 60.0, path_prefix="/metrics")])
    responses = asyncio.run(_requests(app, [("GET", "/metrics")] * 3))
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert 'nanolimit_requests_total{rule="site",outcome="allowed"} 2' in responses[1].text


def test_api_key_scope_and_trusted_proxy_under_starlette(backend) -> None:
    ex = DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"])
    app, _, _ = _app(backend, [rule("keys", 2, 60.0, scope="api_key")], extractor=ex)
    with_key = asyncio.run(_requests(app, [("GET", "/")] * 3, headers={"Authorization": "Bearer abc"}))
    assert [r.status_code for r in with_key] == [200, 200, 429]
    other_key = asyncio.run(_requests(app, [("GET", "/")], headers={"X-API-Key": "xyz"}))
    assert other_key[0].status_code == 200
    # anonymous callers behind the proxy fall back to their forwarded IP
    proxied = asyncio.run(
        _requests(app, [("GET", "/")] * 3, client=("10.0.0.5", 1), headers={"X-Forwarded-For": "203.0.113.5"})
    )
    assert [r.status_code for r in proxied] == [200, 200, 429]
    second = asyncio.run(
        _requests(app, [("GET", "/")], client=("10.0.0.5", 1), headers={"X-Forwarded-For": "203.0.113.6"})
    )
    assert second[0].status_code == 200


def test_leaky_bucket_shapes_by_awaiting(backend) -> None:
    waits: list[float] = []

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)

    app, _, _ = _app(backend, [rule("shape", 4, 1.0, algorithm="leaky_bucket")], sleep=fake_sleep)
    responses = asyncio.run(_requests(app, [("GET", "/")] * 5))
    assert [r.status_code for r in responses] == [200] * 4 + [429]
    assert waits == pytest.approx([0.25, 0.5, 0.75])


def test_real_asyncio_sleep_delays_the_request(backend) -> None:
    app, _, _ = _app(
        backend, [rule("shape", 20, 1.0, algorithm="leaky_bucket")], clock=backend.FakeClock(0.0)
    )

    async def run() -> list[float]:
        transport = httpx.ASGITransport(app=app, client=("192.0.2.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as http:
            stamps = []
            for _ in range(3):
                start = time.perf_counter()
                await http.get("/")
                stamps.append(time.perf_counter() - start)
            return stamps

    stamps = asyncio.run(run())
    assert stamps[2] >= 0.09  # the third waits 2 / 20 s


def test_websockets_are_limited_at_connect(backend) -> None:
    app, metrics, _ = _app(backend, [rule("ws", 1, 60.0, path_prefix="/ws")])
    client = TestClient(app)
    with client.websocket_connect("/ws") as ws:
        assert ws.receive_text() == "hello"
    from starlette.testclient import WebSocketDenialResponse

    with pytest.raises(WebSocketDenialResponse) as info:
        with client.websocket_connect("/ws"):
            pass
    assert info.value.status_code == 429
    assert info.value.json()["rule"] == "ws"
    assert metrics.snapshot()["ws"]["denied"] == 1


async def _bare_app(scope: dict, receive: Any, send: Any) -> None:
    assert scope["type"] in ("http", "websocket")
    if scope["type"] == "websocket":
        await receive()
        await send({"type": "websocket.accept"})
        await send({"type": "websocket.close", "code": 1000})
        return
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"bare"})


def test_bare_asgi_app_and_websocket_close_without_the_extension(backend) -> None:
    registry = RuleRegistry([rule("all", 1, 60.0)])
    app = RateLimitMiddleware(
        _bare_app, registry, LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
    )
    responses = asyncio.run(_requests(app, [("GET", "/a"), ("GET", "/a")]))
    assert responses[0].text == "bare" and responses[0].headers["x-ratelimit-limit"] == "1"
    assert responses[1].status_code == 429

    async def websocket(client: str) -> list[dict]:
        sent: list[dict] = []
        queue = [{"type": "websocket.connect"}]

        async def receive() -> dict:
            return queue.pop(0) if queue else {"type": "websocket.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        await app({"type": "websocket", "path": "/ws", "headers": [], "client": (client, 1)}, receive, send)
        return sent

    assert asyncio.run(websocket("198.51.100.1"))[0]["type"] == "websocket.accept"
    refused = asyncio.run(websocket("198.51.100.1"))
    assert refused == [{"type": "websocket.close", "code": 1008, "reason": "rate_limit_exceeded"}]
    passing = RateLimitMiddleware(_bare_app, registry, websocket="pass")
    assert asyncio.run(_ws_through(passing))[0]["type"] == "websocket.accept"
    # lifespan and other scope types pass straight through
    lifespan_seen: list[str] = []

    async def lifespan_app(scope: dict, receive: Any, send: Any) -> None:
        lifespan_seen.append(scope["type"])

    asyncio.run(RateLimitMiddleware(lifespan_app, registry)({"type": "lifespan"}, None, None))  # type: ignore[arg-type]
    assert lifespan_seen == ["lifespan"]


async def _ws_through(app: Any) -> list[dict]:
    sent: list[dict] = []
    queue = [{"type": "websocket.connect"}]

    async def receive() -> dict:
        return queue.pop(0) if queue else {"type": "websocket.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    for _ in range(3):
        sent.clear()
        queue[:] = [{"type": "websocket.connect"}]
        await app(
            {"type": "websocket", "path": "/ws", "headers": [], "client": ("198.51.100.1", 1)}, receive, send
        )
    return sent


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_real_uvicorn_server_on_loopback(backend) -> None:
    app, metrics, _ = _app(backend, [rule("site", 2, 60.0)])
    port = _free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan="off")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10.0
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=5.0) as http:
            responses = [http.get("/") for _ in range(3)]
    finally:
        server.should_exit = True
        thread.join(10.0)
    assert [r.status_code for r in responses] == [200, 200, 429]
    assert responses[0].headers["x-ratelimit-remaining"] == "1"
    assert json.loads(responses[2].content) == {
        "error": "rate_limit_exceeded",
        "rule": "site",
        "retry_after": 30,
    }
    assert responses[2].headers["retry-after"] == "30"
    assert metrics.snapshot()["site"]["denied"] == 1
    assert not thread.is_alive()


def test_starlette_authenticated_user_is_the_key(backend) -> None:
    from starlette.authentication import AuthCredentials, AuthenticationBackend, SimpleUser
    from starlette.middleware.authentication import AuthenticationMiddleware

    class HeaderAuth(AuthenticationBackend):
        async def authenticate(self, conn: Any) -> Any:
            name = conn.headers.get("x-user")
            return (AuthCredentials(["authenticated"]), SimpleUser(name)) if name else None

    async def home(request: StarletteRequest) -> PlainTextResponse:
        return PlainTextResponse("hi")

    registry = RuleRegistry(
        [rule("anon", 1, 60.0, tier="anonymous"), rule("users", 2, 60.0, tier="authenticated", scope="user")]
    )
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
    app = Starlette(
        routes=[Route("/", home)],
        middleware=[
            Middleware(AuthenticationMiddleware, backend=HeaderAuth()),
            Middleware(RateLimitMiddleware, registry=registry, factory=factory),
        ],
    )
    alice = asyncio.run(_requests(app, [("GET", "/")] * 3, headers={"X-User": "alice"}))
    assert [r.status_code for r in alice] == [200, 200, 429]
    assert alice[2].json()["rule"] == "users"
    bob = asyncio.run(_requests(app, [("GET", "/")], headers={"X-User": "bob"}))
    assert bob[0].status_code == 200  # same IP, own budget
    anon = asyncio.run(_requests(app, [("GET", "/")] * 2))
    assert [r.status_code for r in anon] == [200, 429] and anon[1].json()["rule"] == "anon"


class _Settled:
    """A charge from another front end: anything with ``settle(status)``."""

    def __init__(self) -> None:
        self.statuses: list[object] = []

    def settle(self, status: object) -> int:
        self.statuses.append(status)
        return 1


def _header_sends() -> list[Any]:
    import nanolimit.gateway.asgi as asgi_module
    from nanolimit._select import native_core

    sends = [pytest.param(asgi_module._header_send_py, id="reference")]
    core = native_core()
    if core is not None:
        sends.append(pytest.param(core.header_send, id="native", marks=pytest.mark.native))
    return sends


@pytest.mark.parametrize("header_send", _header_sends())
def test_the_send_wrapper_adds_headers_and_settles_only_at_the_response_start(header_send: Any) -> None:
    """Both twins' wrappers: the pairs go after the app's own headers on the
    start only, a charge is settled once by the status (a str status as the
    int it names), and every message reaches the server unchanged otherwise."""
    seen: list[dict[str, Any]] = []

    async def server_send(message: dict[str, Any]) -> None:
        seen.append(dict(message))

    charge = _Settled()
    pairs = [(b"x-ratelimit-limit", b"5")]
    send = header_send(server_send, pairs, charge)

    async def app() -> None:
        await send({"type": "http.response.start", "status": "401", "headers": [(b"x-app", b"1")]})
        await send({"type": "http.response.body", "body": b"no", "more_body": False})

    asyncio.run(app())
    assert seen[0]["headers"] == [(b"x-app", b"1"), (b"x-ratelimit-limit", b"5")]
    assert seen[1] == {"type": "http.response.body", "body": b"no", "more_body": False}
    assert charge.statuses == [401]

    seen.clear()
    bare = header_send(server_send, [])
    asyncio.run(bare({"type": "http.response.start", "status": 200}))
    assert seen == [{"type": "http.response.start", "status": 200}]

    async def teapot() -> None:
        await header_send(server_send, pairs, charge)({"type": "http.response.start", "status": "teapot"})

    with pytest.raises(ValueError):
        asyncio.run(teapot())
    assert seen == [{"type": "http.response.start", "status": 200}] and charge.statuses == [401]


@pytest.mark.parametrize("decide", ["inline", "thread"])
def test_a_status_the_server_cannot_read_settles_the_charge_as_500(backend, decide: str) -> None:
    """An app whose response start carries a status ``int()`` rejects has
    failed: its count_when charge settles as 500 (refunded under {401}) in
    every decision mode, so a broken app never spends the client's budget."""

    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": "OK", "headers": []})

    failed = RateLimitRule("failed-logins", "*", "/login", "ip", "fixed_window", 3, 60.0, count_when={401})
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
    mw = RateLimitMiddleware(app, RuleRegistry([failed]), factory, decide=decide)
    assert asyncio.run(post_statuses(mw, 5)) == [500] * 5


def _handshakes(client: TestClient, path: str, n: int) -> list[int]:
    """How ``n`` websocket handshakes to ``path`` were answered: 101 when
    accepted, else the denial's status or the close code."""
    answers = []
    for _ in range(n):
        try:
            with client.websocket_connect(path):
                answers.append(101)
        except WebSocketDenialResponse as exc:
            answers.append(exc.status_code)
        except WebSocketDisconnect as exc:
            answers.append(exc.code)
    return answers


@pytest.mark.parametrize("decide", ["inline", "thread"])
def test_a_refused_websocket_handshake_counts_by_the_status_the_client_saw(backend, decide: str) -> None:
    """A handshake closed before accept is answered 403 by the server, and a
    denial response carries its own status: under ``count_when={401, 403}``
    both count, so failed websocket logins spend the budget (they were
    settled as 500 and given back: every guess went through a budget of 3)."""

    async def guard(websocket: WebSocket) -> None:
        if websocket.query_params.get("token") != "secret":
            await websocket.close(code=1008)
            return
        await websocket.accept()
        await websocket.close()

    async def deny(websocket: WebSocket) -> None:
        await websocket.send_denial_response(PlainTextResponse("no", status_code=401))

    app = Starlette(routes=[WebSocketRoute("/ws", guard), WebSocketRoute("/ws2", deny)])
    failed = RateLimitRule("ws-auth", "*", "/", "ip", "fixed_window", 3, 60.0, count_when={401, 403})

    def client() -> TestClient:
        factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
        return TestClient(RateLimitMiddleware(app, RuleRegistry([failed]), factory, decide=decide))

    assert _handshakes(client(), "/ws?token=guess", 5) == [1008, 1008, 1008, 429, 429]
    assert _handshakes(client(), "/ws2", 5) == [401, 401, 401, 429, 429]
    # an accepted handshake (101) does not count: given back every time
    assert _handshakes(client(), "/ws?token=secret", 5) == [101] * 5
