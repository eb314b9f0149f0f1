"""Attacks on which rule applies: HEAD, path variants, and cache floods.

Three classes of defect, each tested through every lookup that could get it
wrong (the rule trie, the ruleset's caches, the middleware's route cache) and
through real frameworks and servers that receive the attacker's exact bytes:

1. Starlette, Flask and Django answer ``HEAD`` with the ``GET`` handler, so a
   ``GET`` rule must charge ``HEAD`` to the same budget.
2. Werkzeug routes ``//login`` and ``/%2flogin`` to ``/login``: the path rules
   match must be the path the frameworks route (``normalize_path``).
3. The lookup caches are keyed by what clients send: a flood of unique long
   paths must not grow them by bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import tracemalloc
import types
from collections.abc import Iterator
from typing import Any

import adversarial_servers as servers
import pytest
from gateway_helpers import gateway, get, ok_handler, rule
from hypothesis import given, settings
from hypothesis import strategies as st
from werkzeug.test import Client as WerkzeugClient

from nanolimit.asgi import request_from_scope
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.middleware import RateLimitPipeline, Request, Response
from nanolimit.gateway.registry import CACHE_KEY_BYTES, MAX_CACHED_KEY_BYTES, RuleRegistry
from nanolimit.gateway.rules import normalize_path
from nanolimit.wsgi import RateLimitMiddleware as WSGIRateLimit
from nanolimit.wsgi import request_from_environ

# ---------------------------------------------------------------------------
# The normalisation rule, exactly

NORMALISED = [
    # already normal: returned as is
    ("/login", "/login"),
    ("/", "/"),
    ("/api/v1/items/42", "/api/v1/items/42"),
    # a missing leading slash (Werkzeug routes PATH_INFO "login" as /login)
    ("", "/"),
    ("login", "/login"),
    ("api/x", "/api/x"),
    # repeated slashes collapse, wherever they are
    ("//login", "/login"),
    ("///login", "/login"),
    ("/" * 40 + "login", "/login"),
    ("/api//x", "/api/x"),
    ("/api///x//", "/api/x/"),
    ("//", "/"),
    # kept: no documented server or framework routes these as anything else
    ("/login/", "/login/"),
    ("/x/../login", "/x/../login"),
    ("/./login", "/./login"),
    ("/api/../login", "/api/../login"),
    ("/%2e%2e/login", "/%2e%2e/login"),
    ("/login%2f", "/login%2f"),
    ("/LOGIN", "/LOGIN"),
    ("/login;jsessionid=1", "/login;jsessionid=1"),
    ("/\\login", "/\\login"),
]


@pytest.mark.parametrize(("raw", "expected"), NORMALISED)
def test_normalize_path_is_the_documented_rule(raw: str, expected: str) -> None:
    assert normalize_path(raw) == expected
    assert normalize_path(expected) == expected  # idempotent


def test_an_already_normal_path_is_returned_as_is() -> None:
    """The common path costs one substring check and allocates nothing."""
    path = "/api/items/" + str(12345)
    assert normalize_path(path) is path


# ---------------------------------------------------------------------------
# 1. HEAD spends the GET budget


def _runs(mw: RateLimitPipeline, requests: list[Request]) -> list[int]:
    statuses = []
    for request in requests:
        statuses.append(mw(request, ok_handler).status)
    return statuses


@pytest.mark.parametrize("method_case", ["HEAD", "head", "Head"])
def test_alternating_get_and_head_admit_only_the_limit(
    backend: types.SimpleNamespace, method_case: str
) -> None:
    """15 handler runs against a limit of 10 was the bug: HEAD found no rule."""
    mw = gateway(backend, [rule("page", 10, 60.0, method="GET", path_prefix="/page")])
    ran: list[str] = []

    def handler(request: Request) -> Response:
        ran.append(request.method)
        return ok_handler(request)

    for i in range(30):  # the second round of each method is a route-cache hit
        method = "GET" if i % 2 == 0 else method_case
        mw(Request(method, "/page", {}, "192.0.2.1"), handler)
    assert len(ran) == 10
    assert ran.count(method_case) == 5
    # one budget: the rule, its limiter and the key are the same for both
    head = mw.check(Request(method_case, "/page", {}, "192.0.2.1"))
    got = mw.check(Request("GET", "/page", {}, "192.0.2.1"))
    assert head is not None and got is not None
    assert head.rule == got.rule == "page" and not head.allowed and not got.allowed
    assert mw.metrics.snapshot()["page"]["allowed"] == 10


def test_head_through_every_lookup_finds_the_get_rule() -> None:
    get_rule = rule("page", method="GET", path_prefix="/page")
    post_rule = rule("post", method="POST", path_prefix="/page")
    assert get_rule.matches("HEAD", "/page/1") and get_rule.matches("head", "/page")
    assert not post_rule.matches("HEAD", "/page")
    for cache_size in (0, 16):
        for stacked in (False, True):
            reg = RuleRegistry([get_rule, post_rule], stacked=stacked, cache_size=cache_size)
            for _ in range(2):  # the miss, then the cached answer
                assert reg.rule_for("HEAD", "/page/1") is get_rule
                assert reg.rules_for("HEAD", "/page/1") == (get_rule,)
                assert reg.snapshot().match_all("head", "/page") == (get_rule,)


def test_an_explicit_head_rule_is_more_specific_for_head() -> None:
    """The decision: at equal prefix length HEAD > GET > ``*`` for a HEAD
    request; a longer prefix still wins first (docs/spec.md §6)."""
    any_rule = rule("any", method="*", path_prefix="/page")
    get_rule = rule("get", method="GET", path_prefix="/page")
    head_rule = rule("head", method="HEAD", path_prefix="/page")
    deep_get = rule("deep-get", method="GET", path_prefix="/page/deep")
    shallow_head = rule("shallow-head", method="HEAD", path_prefix="/")
    for order in ([any_rule, get_rule, head_rule, deep_get], [head_rule, deep_get, get_rule, any_rule]):
        reg = RuleRegistry([*order, shallow_head])
        assert reg.rule_for("HEAD", "/page") is head_rule
        assert reg.rule_for("GET", "/page") is get_rule
        assert reg.rule_for("POST", "/page") is any_rule
        assert reg.rule_for("HEAD", "/page/deep/1") is deep_get  # longer prefix first
        assert reg.rule_for("HEAD", "/other") is shallow_head
        assert RuleRegistry(order).snapshot().match("GET", "/other") is None  # HEAD rules never cover GET
        stacked = RuleRegistry([*order, shallow_head], stacked=True)
        assert stacked.rules_for("HEAD", "/page") == (head_rule, get_rule, any_rule, shallow_head)
        assert stacked.rules_for("GET", "/page") == (get_rule, any_rule)
    without_get = RuleRegistry([any_rule, head_rule])
    assert without_get.rule_for("GET", "/page") is any_rule
    assert without_get.rule_for("HEAD", "/page") is head_rule


def test_a_head_rule_never_covers_get(backend: types.SimpleNamespace) -> None:
    mw = gateway(backend, [rule("head-only", 1, 60.0, method="HEAD", path_prefix="/")])
    assert [mw(get("/", method="HEAD"), ok_handler).status for _ in range(2)] == [200, 429]
    assert mw.check(get("/")) is None  # GET is unlimited here


# ---------------------------------------------------------------------------
# 2. Every lookup matches the normalised path

# (path, the rule that must charge it)
VARIANTS_OF_LOGIN = [
    ("//login", "login"),
    ("///login", "login"),
    ("login", "login"),
    ("login/x", "login"),
    ("//login/", "login"),
    ("/login//x", "login"),
    ("////login//", "login"),
    ("", "default"),
    ("//", "default"),
    ("/x//login", "default"),
    ("//loginx", "default"),
]


@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("cache_size", [0, 4096])
def test_every_lookup_matches_the_normalised_path(stacked: bool, cache_size: int) -> None:
    login = rule("login", method="*", path_prefix="/login")
    default = rule("default", method="*", path_prefix="/")
    reg = RuleRegistry([login], default, stacked=stacked, cache_size=cache_size)
    for path, name in VARIANTS_OF_LOGIN:
        for _ in range(2):  # uncached, then cached
            assert reg.rule_for("GET", path).name == name, path
            assert reg.rules_for("GET", path)[0].name == name, path
            assert login.matches("GET", path) is (name == "login"), path


_seg = st.sampled_from(["a", "b", "api", "", ".", ".."])
_raw_path = st.lists(_seg, max_size=6).map("/".join)  # with or without the leading "/"
_rule_prefix = st.lists(st.sampled_from(["a", "b", "api", "", "."]), max_size=3).map(
    lambda s: "/" + "/".join(s)
)


@settings(max_examples=200, deadline=None)
@given(
    specs=st.lists(st.tuples(_rule_prefix, st.sampled_from(["GET", "HEAD", "POST", "*"])), max_size=8),
    probes=st.lists(st.tuples(st.sampled_from(["GET", "HEAD", "head", "POST"]), _raw_path), min_size=1),
)
def test_the_trie_answers_as_if_every_path_were_normalised_first(
    specs: list[tuple[str, str]], probes: list[tuple[str, str]]
) -> None:
    """The walk normalises only when it meets an empty segment or a missing
    leading slash; whatever the path, the answer is the normalised path's,
    and that of a linear scan with ``RateLimitRule.matches``."""
    rules = [rule(f"r{i}", method=m, path_prefix=p) for i, (p, m) in enumerate(specs)]
    for cache_size in (0, 64):
        for stacked in (False, True):
            reg = RuleRegistry(rules, stacked=stacked, cache_size=cache_size)
            for method, path in probes * 2:
                normal = normalize_path(path)
                every = [r for r in rules if r.matches(method, path)]
                assert every == [r for r in rules if r.matches(method, normal)]
                got = reg.snapshot().match_all(method, path)
                assert got == reg.snapshot().match_all(method, normal)
                assert set(got) == set(every)
                assert reg.snapshot().match(method, path) is (got[0] if got else None)


@pytest.mark.parametrize("path", ["//login", "///login", "login", "/login//", "//login//again"])
def test_the_middleware_charges_variants_to_one_budget(backend: types.SimpleNamespace, path: str) -> None:
    """The framework-free pipeline, its inlined cache-hit path included."""
    mw = gateway(backend, [rule("login", 3, 60.0, method="POST", path_prefix="/login")])
    ran = 0

    def handler(request: Request) -> Response:
        nonlocal ran
        ran += 1
        return ok_handler(request)

    for i in range(12):
        mw(Request("POST", path if i % 2 else "/login", {}, "192.0.2.1"), handler)
    assert ran == 3
    outcome = mw.check(Request("POST", path, {}, "192.0.2.1"))
    assert outcome is not None and outcome.rule == "login" and not outcome.allowed


def test_dot_segments_stay_under_the_rule_of_the_routed_handler(backend: types.SimpleNamespace) -> None:
    """``/api/../public`` reaches an ``/api/{rest:path}`` handler (no server
    we document resolves dot segments): resolving them here would charge an
    API call to the unlimited ``/public``."""
    mw = gateway(backend, [rule("api", 2, 60.0, path_prefix="/api")])
    statuses = [mw(get(p), ok_handler).status for p in ("/api/../public", "/api/./x", "/api/%2e%2e/public")]
    assert statuses == [200, 200, 429]
    assert mw.check(get("/public")) is None


def test_a_prefix_with_repeated_slashes_is_normalised_too() -> None:
    r = rule("login", path_prefix="//login//")
    assert r.path_prefix == "/login/"
    assert r == rule("login", path_prefix="/login/")
    assert RuleRegistry([r]).rule_for("GET", "/login/x") is r


def test_adapters_join_a_path_without_its_slash_below_the_mount() -> None:
    environ = {"SCRIPT_NAME": "/app", "PATH_INFO": "login", "REQUEST_METHOD": "GET"}
    assert request_from_environ(environ).path == "/app/login"
    assert request_from_environ({"PATH_INFO": "", "SCRIPT_NAME": ""}).path == "/"
    scope = {"type": "http", "path": "login", "root_path": "/app", "headers": []}
    assert request_from_scope(scope).path == "/app/login"


# ---------------------------------------------------------------------------
# Real frameworks, in process: exact paths via their test clients / ASGI


def _asgi(app: Any, method: str, path: str, key: str) -> tuple[int, dict[str, str]]:
    """Call an ASGI app with exactly this ``scope["path"]`` (what a server
    hands over after decoding the request-target)."""
    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("latin-1"),
        "root_path": "",
        "query_string": b"",
        "headers": [(b"host", b"testserver"), (b"x-api-key", key.encode())],
        "client": ("192.0.2.1", 1234),
        "server": ("testserver", 80),
    }
    out: dict[str, Any] = {}

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            out["status"] = message["status"]
            out["headers"] = {k.decode().lower(): v.decode() for k, v in message["headers"]}

    asyncio.run(app(scope, receive, send))
    return out["status"], out["headers"]


def _policy(headers: dict[str, str]) -> str | None:
    policy = headers.get("ratelimit-policy")
    return None if policy is None else policy.split(";", 1)[0].strip('"')


RULE_OF_HANDLER = {"login": {"login", "login-post"}, "api": {"api"}, "home": {"default"}}


def test_starlette_routes_and_charges_every_scope_path(backend: types.SimpleNamespace) -> None:
    app = servers.starlette_app(backend.name, limit=2)
    paths = ["/login", "//login", "/login/", "/x/../login", "/api/../login", "/api//x", "login", "/LOGIN"]
    for i, path in enumerate(paths):
        for method in ("GET", "HEAD", "POST"):
            status, headers = _asgi(app, method, path, f"probe-{i}-{method}")
            handler = headers.get("x-handler")
            if handler is not None:
                assert _policy(headers) in RULE_OF_HANDLER[handler], (method, path, headers)
    # HEAD and GET share one budget: 2 handler runs in all
    runs = [_asgi(app, m, "/login", "flood")[1].get("x-handler") for m in ("GET", "HEAD") * 3]
    assert runs.count("login") == 2


@pytest.mark.parametrize(
    ("make_app", "must_reach"),
    [
        # Werkzeug strips every leading slash and adds a missing one
        (
            servers.flask_app,
            {("GET", "//login"), ("HEAD", "///login"), ("head", "login"), ("POST", "//login")},
        ),
        # Django's convention: ``login/``, HEAD answered by the view
        (servers.django_app, {("HEAD", "/login/"), ("GET", "/login/")}),
    ],
    ids=["flask", "django"],
)
def test_wsgi_frameworks_route_and_charge_every_path_info(
    backend: types.SimpleNamespace, make_app: Any, must_reach: set[tuple[str, str]]
) -> None:
    """Flask and Django through Werkzeug's test client, PATH_INFO set exactly:
    whatever handler a path reaches, its rule charged it."""
    client = WerkzeugClient(make_app(backend.name, limit=2))
    reached = set()
    paths = ["/login", "/login/", "//login", "///login", "//login/", "login", "/x/../login", "/api/../login"]
    for i, path in enumerate(paths):
        for method in ("GET", "HEAD", "head", "POST"):
            response = client.open(
                method=method,
                environ_overrides={"PATH_INFO": path, "REQUEST_METHOD": method},
                headers={"X-API-Key": f"probe-{i}-{method}"},
            )
            handler = response.headers.get("X-Handler")
            if handler is not None:
                reached.add((method, path, handler))
                assert _policy(dict(response.headers.items(lower=True))) in RULE_OF_HANDLER[handler]
    assert {h for *_, h in reached} >= {"login", "api"}
    assert must_reach <= {(m, p) for m, p, h in reached if h == "login"}  # the attack is real here


def test_a_mounted_wsgi_app_is_matched_below_its_script_name(backend: types.SimpleNamespace) -> None:
    from flask import Flask

    app = Flask("mounted")
    app.add_url_rule("/login", "login", lambda: "login")
    registry = RuleRegistry([rule("login", 1, 60.0, path_prefix="/app/login")])
    wrapped = WSGIRateLimit(app.wsgi_app, registry, LimiterFactory(backend.InMemoryStorage()))
    client = WerkzeugClient(wrapped)
    statuses = [
        client.get(environ_overrides={"SCRIPT_NAME": "/app", "PATH_INFO": p}).status_code
        for p in ("login", "//login", "/login")
    ]
    assert statuses == [200, 429, 429]


# ---------------------------------------------------------------------------
# Real servers over raw sockets: the bytes an attacker sends

VARIANTS: list[bytes] = [
    b"/login",
    b"//login",
    b"///login",
    b"/%2flogin",
    b"/%2Flogin",
    b"/%2f%2flogin",
    b"/./login",
    b"/login/.",
    b"/x/../login",
    b"/%2e/login",
    b"/%2e%2e/login",
    b"/x/%2e%2e/login",
    b"/x/%2E%2E/login",
    b"/../login",
    b"/.%2e/login",
    b"/x/./../login",
    b"/api/../login",
    b"/api/%2e%2e/login",
    b"/api/%252e%252e/login",
    b"/login/",
    b"/login//",
    b"//login/",
    b"/login/./",
    b"/login/..",
    b"/login%2f",
    b"/%2Flogin%2F",
    b"/LOGIN",
    b"/Login",
    b"/login;jsessionid=1",
    b"/login;",
    b"/login%3b",
    b"/;/login",
    b"/login?x=1",
    b"/login#frag",
    b"/login%23frag",
    b"/%6cogin",
    b"/login%00",
    b"/login%20",
    b"/login%09",
    b"/login.",
    b"/\\login",
    b"/%5clogin",
    b"/x/..%2flogin",
    b"/%2e%2e%2flogin",
    b"http://127.0.0.1/login",
    b"http://127.0.0.1//login",
    b"login",
    b"*",
    b"//api/x",
    b"/%2fapi/x",
    b"/api%2fx",
    b"/api//x",
]
METHODS = ("GET", "HEAD", "head", "POST")
LIMIT = 3

# What each server and framework was seen to route to the login handler, at
# least: the attacks that ran the handler uncharged before the fix are among
# them (the tests assert these still reach it, so the attack stays real).
MUST_REACH_LOGIN: dict[str, set[tuple[str, bytes]]] = {
    "werkzeug-flask": {
        ("HEAD", b"/login"),
        ("head", b"/login"),
        ("GET", b"//login"),
        ("GET", b"/%2flogin"),
        ("HEAD", b"/%2f%2flogin"),
        ("GET", b"http://127.0.0.1//login"),
        ("GET", b"login"),
    },
    "gunicorn-flask": {
        ("HEAD", b"/login"),
        ("GET", b"//login"),
        ("GET", b"/%2flogin"),
        ("POST", b"///login"),
    },
    "werkzeug-django": {("HEAD", b"/login/"), ("GET", b"/login%2f"), ("GET", b"//login/")},
    "gunicorn-django": {("HEAD", b"/login/"), ("GET", b"/login%2f")},
    "uvicorn-starlette": {("HEAD", b"/login"), ("GET", b"/%6cogin")},
}


@contextlib.contextmanager
def _serve(kind: str, twin: str) -> Iterator[int]:
    """One of the documented server/framework pairs on a loopback port."""
    if kind == "werkzeug-flask":
        with servers.werkzeug_server(servers.flask_app(twin, LIMIT)) as port:
            yield port
    elif kind == "werkzeug-django":
        with servers.werkzeug_server(servers.django_app(twin, LIMIT)) as port:
            yield port
    elif kind == "uvicorn-starlette":
        with servers.uvicorn_server(servers.starlette_app(twin, LIMIT)) as port:
            yield port
    elif kind == "gunicorn-flask":
        with servers.gunicorn_server("adversarial_servers:flask_app()", twin, LIMIT) as port:
            yield port
    elif kind == "gunicorn-django":
        with servers.gunicorn_server("adversarial_servers:django_app()", twin, LIMIT) as port:
            yield port
    else:
        raise ValueError(kind)


@pytest.mark.parametrize("kind", list(MUST_REACH_LOGIN))
def test_real_servers_charge_every_variant_to_the_rule_of_its_handler(
    backend: types.SimpleNamespace, kind: str
) -> None:
    """Every request-target variant, sent as raw bytes, with every method:
    whichever handler it reaches, the rule that charged it is that handler's
    (its own budget per probe, so each answer names the charging rule).
    Then one client floods the variants that reach the login handler: the
    handler runs exactly ``LIMIT`` times per budget (GET+HEAD, POST)."""
    with _serve(kind, backend.name) as port:
        login: list[tuple[str, bytes]] = []
        for i, target in enumerate(VARIANTS):
            for method in METHODS:
                r = servers.raw_request(port, method, target, {"X-API-Key": f"probe-{i}-{method}"})
                assert r.status != 0, (method, target)
                if r.handler is None:
                    continue
                assert r.charged in RULE_OF_HANDLER[r.handler], (kind, method, target, r.headers)
                if r.handler == "login":
                    login.append((method, target))
        assert MUST_REACH_LOGIN[kind] <= set(login), sorted(MUST_REACH_LOGIN[kind] - set(login))
        budgets = {"login" if m.upper() in ("GET", "HEAD") else "login-post" for m, _ in login}
        runs = 0
        for _ in range(LIMIT + 1):
            for method, target in login:
                r = servers.raw_request(port, method, target, {"X-API-Key": "flood"})
                runs += r.handler == "login"
                assert r.status in (200, 429), (method, target, r.status)
    assert runs == LIMIT * len(budgets)


# ---------------------------------------------------------------------------
# 3. Caches bounded by bytes

FLOOD_PEAK_BYTES = 4 << 20  # what a flood may add to one middleware, its ruleset's caches included


@pytest.mark.parametrize("stacked", [False, True], ids=["single", "stacked"])
def test_a_path_flood_leaves_the_caches_bounded_by_bytes(
    backend: types.SimpleNamespace, stacked: bool
) -> None:
    """1,500 unique 15 KB paths kept 22 MiB before; now a long key is never
    cached and the cached keys take at most CACHE_KEY_BYTES per cache."""
    big = 1 << 30
    registry = RuleRegistry(
        [rule("api", big, 60.0, path_prefix="/api"), rule("all", big, 60.0)], stacked=stacked
    )
    mw = RateLimitPipeline(registry, LimiterFactory(backend.InMemoryStorage()))
    response = Response(200, {}, b"")

    def handler(_request: Request) -> Response:
        return response

    mw(Request("GET", "/api/warm", {}, "192.0.2.1"), handler)
    registry.rule_for("GET", "/api/warm")
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        floods: list[Iterator[tuple[str, str]]] = [
            (("GET", f"/api/{i:05d}/" + "x" * 15_000) for i in range(1_500)),  # one key over the cut-off
            (("GET", f"/api/{i:05d}/" + "y" * 230) for i in range(5_000)),  # many keys under it
            (("GET", f"/api/{i:05d}/" + "\u00e9" * 200) for i in range(2_000)),  # 2 bytes a character
            (("X" * 900 + str(i), "/api") for i in range(1_500)),  # long unique methods
        ]
        for flood in floods:
            for method, path in flood:
                mw(Request(method, path, {}, "192.0.2.1"), handler)
                registry.rule_for(method, path)
        current, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak - base < FLOOD_PEAK_BYTES, (peak - base) / 2**20
    assert current - base < FLOOD_PEAK_BYTES
    ruleset = registry.snapshot()
    assert ruleset.cached_key_bytes() <= 2 * CACHE_KEY_BYTES
    assert mw._route_bytes <= mw.route_cache_bytes == CACHE_KEY_BYTES
    # short keys are still cached (a hit is one dict look-up), long ones never
    mw(Request("GET", "/api/normal", {}, "192.0.2.1"), handler)
    assert ("GET", "/api/normal", None) in mw._routes[1]
    long_path = "/api/" + "z" * MAX_CACHED_KEY_BYTES
    mw(Request("GET", long_path, {}, "192.0.2.1"), handler)
    assert ("GET", long_path, None) not in mw._routes[1]
    assert mw.metrics.snapshot()["api"]["allowed"] == 10_003


def test_the_byte_budget_of_a_ruleset_cache_is_kept() -> None:
    registry = RuleRegistry([rule("api", path_prefix="/api")], cache_bytes=2_000)
    ruleset = registry.snapshot()
    for i in range(200):
        assert registry.rule_for("GET", f"/api/{i}/" + "a" * 90).name == "api"
        assert ruleset.cached_key_bytes() <= 2_000
    assert 0 < len(ruleset._cache) < 200
    assert registry.replace([rule("api", path_prefix="/api")])._cache_max_bytes == 2_000
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError):
            RuleRegistry([], cache_bytes=bad)  # type: ignore[arg-type]
