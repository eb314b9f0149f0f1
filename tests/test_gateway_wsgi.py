"""The WSGI middleware end to end under Flask's test client, and on a bare
WSGI callable."""

from __future__ import annotations

import types
from typing import Any

import pytest
from flask import Flask, Response, jsonify, request
from gateway_helpers import rule

from nanolimit.errors import ValidationError
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.keys import DefaultKeyExtractor
from nanolimit.gateway.metrics import Metrics
from nanolimit.gateway.middleware import RateLimitPipeline as Core
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.request import Request
from nanolimit.gateway.rules import RateLimitRule
from nanolimit.wsgi import RateLimitMiddleware, request_from_environ


def _flask(backend: types.SimpleNamespace, rules: list, **kw: Any) -> tuple[Flask, Metrics]:
    app = Flask("limited")
    metrics = Metrics()

    @app.get("/")
    def home() -> Response:
        resp = Response("home", mimetype="text/plain")
        resp.headers["X-App"] = "yes"
        return resp

    @app.post("/orders")
    def orders() -> Any:
        return jsonify(ordered=True, user=request.environ.get("REMOTE_USER")), 201

    @app.get("/metrics")
    def metrics_endpoint() -> Response:
        return Response(metrics.render_prometheus(), mimetype="text/plain")

    registry = RuleRegistry(rules, stacked=kw.pop("stacked", False))
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
    app.wsgi_app = RateLimitMiddleware(app.wsgi_app, registry, factory, metrics=metrics, **kw)  # type: ignore[method-assign]
    return app, metrics


def test_flask_app_is_limited_end_to_end(backend) -> None:
    app, metrics = _flask(
        backend, [rule("site", 3, 60.0), rule("orders", 1, 10.0, method="POST", path_prefix="/orders")]
    )
    client = app.test_client()
    responses = [client.get("/", environ_base={"REMOTE_ADDR": "192.0.2.1"}) for _ in range(4)]
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    first = responses[0]
    assert first.get_data(as_text=True) == "home" and first.headers["X-App"] == "yes"
    assert first.headers["X-RateLimit-Limit"] == "3"
    assert first.headers["X-RateLimit-Remaining"] == "2"
    assert first.headers["RateLimit-Policy"] == '"site";q=3;w=60'
    assert first.headers["RateLimit"] == '"site";r=2;t=20'
    assert int(first.headers["X-RateLimit-Reset"]) > 1_600_000_000
    assert "Retry-After" not in first.headers
    denied = responses[3]
    assert denied.get_json() == {"error": "rate_limit_exceeded", "rule": "site", "retry_after": 20}
    assert denied.headers["Content-Type"] == "application/json"
    assert denied.headers["Retry-After"] == "20"
    assert denied.headers["X-RateLimit-Remaining"] == "0"
    assert denied.headers["RateLimit"] == '"site";r=0;t=60'
    orders = [client.post("/orders", environ_base={"REMOTE_ADDR": "192.0.2.1"}) for _ in range(2)]
    assert [r.status_code for r in orders] == [201, 429]
    assert orders[1].headers["Retry-After"] == "10"
    assert client.get("/", environ_base={"REMOTE_ADDR": "192.0.2.2"}).status_code == 200
    snap = metrics.snapshot()
    assert snap["site"] == {"allowed": 4, "denied": 1, "shadow_denied": 0, "near_limit": 1}
    assert snap["orders"] == {"allowed": 1, "denied": 1, "shadow_denied": 0, "near_limit": 1}
    text = client.get("/metrics", environ_base={"REMOTE_ADDR": "192.0.2.3"}).get_data(as_text=True)
    assert 'nanolimit_requests_total{rule="orders",outcome="denied"} 1' in text


def test_flask_user_and_proxy_keys(backend) -> None:
    ex = DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"])
    app, _ = _flask(backend, [rule("per-user", 1, 60.0, scope="user")], extractor=ex)
    client = app.test_client()
    alice = {"REMOTE_ADDR": "192.0.2.1", "REMOTE_USER": "alice"}
    assert [client.post("/orders", environ_base=alice).status_code for _ in range(2)] == [201, 429]
    bob = {"REMOTE_ADDR": "192.0.2.1", "REMOTE_USER": "bob"}
    assert client.post("/orders", environ_base=bob).get_json() == {"ordered": True, "user": "bob"}
    proxied = {"REMOTE_ADDR": "10.0.0.1"}
    spoofed = [
        client.get("/", environ_base=proxied, headers={"X-Forwarded-For": "203.0.113.1"}).status_code
        for _ in range(2)
    ]
    assert spoofed == [200, 429]
    assert (
        client.get("/", environ_base=proxied, headers={"X-Forwarded-For": "203.0.113.2"}).status_code == 200
    )


def test_flask_compound_limits(backend) -> None:
    rules = [
        rule("orders-user", 2, 60.0, method="POST", path_prefix="/orders", scope="user"),
        rule("per-ip", 3, 60.0),
    ]
    app, metrics = _flask(backend, rules, stacked=True)
    client = app.test_client()
    env = {"REMOTE_ADDR": "192.0.2.1", "REMOTE_USER": "alice"}
    assert [client.post("/orders", environ_base=env).status_code for _ in range(3)] == [201, 201, 429]
    # alice's third order was denied by her own rule and did not spend the IP's budget
    assert client.get("/", environ_base=env).status_code == 200
    assert client.get("/", environ_base=env).status_code == 429
    assert metrics.snapshot()["per-ip"] == {"allowed": 3, "denied": 1, "shadow_denied": 0, "near_limit": 1}


def test_wsgi_shaping_sleeps_in_the_worker(backend) -> None:
    waits: list[float] = []
    app, _ = _flask(backend, [rule("shape", 2, 1.0, algorithm="leaky_bucket")], sleep=waits.append)
    client = app.test_client()
    assert [client.get("/").status_code for _ in range(3)] == [200, 200, 429]
    assert waits == pytest.approx([0.5])


def test_bare_wsgi_app_and_environ_view(backend) -> None:
    calls: list[str] = []

    def app(environ: dict, start_response: Any) -> list[bytes]:
        calls.append(environ["PATH_INFO"])
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"bare"]

    core = Core(
        RuleRegistry([rule("api", 1, 60.0, path_prefix="/mount/api")]),
        LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0)),
    )
    wrapped = RateLimitMiddleware(app, core=core)
    seen: list[tuple[str, list]] = []

    def start_response(status: str, headers: list, exc_info: Any = None) -> None:
        seen.append((status, headers))

    environ = {
        "REQUEST_METHOD": "GET",
        "SCRIPT_NAME": "/mount",
        "PATH_INFO": "/api/x",
        "REMOTE_ADDR": "192.0.2.1",
        "HTTP_X_API_KEY": "k",
        "CONTENT_TYPE": "text/plain",
    }
    assert wrapped(dict(environ), start_response) == [b"bare"]
    body = wrapped(dict(environ), start_response)
    assert seen[0][0] == "200 OK" and ("X-RateLimit-Limit", "1") in seen[0][1]
    assert seen[1][0] == "429 Too Many Requests" and b"rate_limit_exceeded" in b"".join(body)
    assert calls == ["/api/x"]  # the denied request never reached the app
    other = dict(environ, PATH_INFO="/other")
    wrapped(other, start_response)
    assert seen[2][1] == [("Content-Type", "text/plain")]  # no rule: untouched
    view = request_from_environ(environ)
    assert view.path == "/mount/api/x" and view.client == "192.0.2.1"
    assert view.headers.get("x-api-key") == "k" and view.headers["content-type"] == "text/plain"
    assert set(view.headers) == {"x-api-key", "content-type"} and len(view.headers) == 2


def test_a_non_ascii_path_matches_its_rule_as_under_asgi() -> None:
    """PEP 3333 hands PATH_INFO over as latin-1-decoded bytes; rules (and
    ASGI paths) are UTF-8. /café must hit the /café rule under both."""
    raw = "/café/menu".encode().decode("latin-1")  # what a WSGI server puts in the environ
    request = request_from_environ({"REQUEST_METHOD": "GET", "PATH_INFO": raw, "REMOTE_ADDR": "192.0.2.1"})
    assert request.path == "/café/menu"
    registry = RuleRegistry([rule("cafe", 1, 60.0, path_prefix="/café")])
    assert registry.rule_for("GET", request.path) is not None
    assert registry.rule_for("GET", request.path).name == "cafe"
    bad = request_from_environ({"PATH_INFO": b"/\xff".decode("latin-1")})  # not UTF-8: replaced, no error
    assert bad.path == "/\ufffd"


class _Settled:
    """A charge recording what it was settled by."""

    def __init__(self) -> None:
        self.statuses: list[object] = []

    def settle(self, status: object) -> int:
        self.statuses.append(status)
        return 1


def _header_starts() -> list[Any]:
    import nanolimit.gateway.wsgi as wsgi_module
    from nanolimit._select import native_core

    starts = [pytest.param(wsgi_module._header_start_py, id="reference")]
    core = native_core()
    if core is not None:
        starts.append(pytest.param(core.header_start, id="native", marks=pytest.mark.native))
    return starts


@pytest.mark.parametrize("header_start", _header_starts())
def test_the_start_response_wrapper_adds_headers_and_settles_by_the_status_line(header_start: Any) -> None:
    """Both twins' wrappers: the pairs go after the app's own headers, a
    charge is settled by the status line's code (500 for a line with none)
    on every call, exc_info is passed on only when given, and the app's
    list is not changed in place."""
    calls: list[tuple[Any, ...]] = []

    def server_start(*args: Any) -> str:
        calls.append(args)
        return "write"

    charge = _Settled()
    pairs = [("X-RateLimit-Limit", "5")]
    start = header_start(server_start, pairs, charge)
    own = [("X-App", "1")]
    assert start("401 Unauthorized", own) == "write"
    assert calls == [("401 Unauthorized", [("X-App", "1"), ("X-RateLimit-Limit", "5")])]
    assert own == [("X-App", "1")] and charge.statuses == [401]

    error = (ValueError, ValueError("late"), None)
    start("500 Internal Server Error", [], error)
    start("teapot", ())
    assert calls[1:] == [
        ("500 Internal Server Error", [("X-RateLimit-Limit", "5")], error),
        ("teapot", [("X-RateLimit-Limit", "5")]),
    ]
    assert charge.statuses == [401, 500, 500]

    calls.clear()
    header_start(server_start, pairs)("200 OK", [])
    assert calls == [("200 OK", [("X-RateLimit-Limit", "5")])] and charge.statuses == [401, 500, 500]


class _HugeStatus:
    """A status object whose first three items read as a code past any C int."""

    def __getitem__(self, item: slice) -> str:
        return "9" * 30


@pytest.mark.native
@pytest.mark.parametrize(
    "status",
    [
        "200 OK",
        "429 Too Many Requests",
        " 20 odd",
        "٢٠٠ OK",
        "2_0 x",
        "-1 x",
        "99",
        "",
        "abc",
        b"201 Created",
        None,
        bytearray(b"204 No Content"),  # unhashable: read, never looked up
        ["2", "0", "0"],
        _HugeStatus(),
    ],
)
def test_the_native_status_code_reads_a_status_line_as_the_reference_does(status: Any) -> None:
    from nanolimit._select import native_core
    from nanolimit.gateway.wsgi import _status_code

    core = native_core()
    assert core is not None
    assert core.wsgi_status_code(status) == _status_code(status)


def _serve(wrapped: Any, path: str = "/login") -> str:
    """One request as a WSGI server runs it (PEP 3333): the body iterated,
    then closed; an app error is the server's 500."""
    status: list[str] = []
    environ = {"REQUEST_METHOD": "POST", "PATH_INFO": path, "REMOTE_ADDR": "203.0.113.9"}
    body = wrapped(environ, lambda s, h, e=None: status.append(s))
    try:
        for _chunk in body:
            pass
    except RuntimeError:
        return "500"
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()
    return status[0][:3] if status else "500"


@pytest.mark.parametrize("lane", ["stock", "request_factory"])
def test_a_lazy_app_that_fails_before_starting_settles_its_charge_as_500(backend, lane: str) -> None:
    """A generator app starts its response only as the server iterates it:
    raising first, or never starting one, is a 500 (not counted under
    {401}), a 401 it starts lazily still counts, and the app's own close()
    is still called."""
    from nanolimit.gateway.rules import RateLimitRule

    closed: list[str] = []

    def app(environ: dict, start_response: Any) -> Any:
        try:
            mode = environ["PATH_INFO"]
            if mode == "/raises":
                raise RuntimeError("db down")
            if mode == "/unauthorized":
                start_response("401 Unauthorized", [])
                yield b"no"
        finally:
            closed.append(environ["PATH_INFO"])

    failed = RateLimitRule("failed-logins", "*", "/", "ip", "fixed_window", 3, 60.0, count_when={401})
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
    kw: dict[str, Any] = {} if lane == "stock" else {"request_factory": lambda e: request_from_environ(e)}
    wrapped = RateLimitMiddleware(app, RuleRegistry([failed]), factory, **kw)
    assert [_serve(wrapped, "/raises") for _ in range(5)] == ["500"] * 5
    assert [_serve(wrapped, "/silent") for _ in range(5)] == ["500"] * 5  # never started a response
    assert closed == ["/raises"] * 5 + ["/silent"] * 5
    assert [_serve(wrapped, "/unauthorized") for _ in range(4)] == ["401", "401", "401", "429"]


def test_rules_naming_routes_are_refused_where_no_route_is_known(backend) -> None:
    """A bare WSGI app has no route table: a rule naming a route and an
    ``exempt`` entry never applied (a ``routes = [...]`` limit admitted
    every request, an exempt health check was refused like any other).
    The middleware now refuses them unless a ``route_resolver`` names the
    route, and then both apply."""

    def app(environ: dict, start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    avatar = RateLimitRule.from_rate(
        "avatar", "2/hour", algorithm="fixed_window", routes=["/users/{id}/avatar"]
    )
    every = rule("all", 2, algorithm="fixed_window")
    for registry in (RuleRegistry([avatar]), RuleRegistry([every], exempt=["/health"])):
        named = r"routes \['/(users/\{id\}/avatar|health)'\] would never apply"
        with pytest.raises(ValidationError, match=named):
            RateLimitMiddleware(app, registry)

    def resolve(request: Request) -> str | None:
        if request.path.endswith("/avatar"):
            return "/users/{id}/avatar"
        return "/health" if request.path == "/health" else None

    def statuses(mw: RateLimitMiddleware, path: str, n: int) -> list[str]:
        out: list[str] = []
        environ = {"REQUEST_METHOD": "GET", "PATH_INFO": path, "REMOTE_ADDR": "192.0.2.1"}
        for _ in range(n):
            mw(dict(environ), lambda status, headers, exc_info=None: out.append(status[:3]))
        return out

    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
    limited = RateLimitMiddleware(app, RuleRegistry([avatar]), factory, route_resolver=resolve)
    assert statuses(limited, "/users/7/avatar", 3) == ["200", "200", "429"]
    exempt = RateLimitMiddleware(
        app, RuleRegistry([every], exempt=["/health"]), factory, route_resolver=resolve
    )
    assert statuses(exempt, "/health", 4) == ["200"] * 4
    assert statuses(exempt, "/healthz-admin", 3) == ["200", "200", "429"]
