"""One request's trip, the same through every front end: the pipeline
(``__call__``), its public decision (``check``), Starlette over the ASGI
adapter and Flask over the WSGI adapter.

Each limited request enters the core once, reads the wall clock once, and
finds its route in one cache (the pipeline's; the ruleset's own lookup
caches stay empty); the adapters decide through ``check``, the public entry
point, so a subclass of the pipeline is what they run.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import DictStorage
from flask import Flask
from gateway_helpers import WALL, get, ok_handler, rule
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as StarletteRequest
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from nanolimit import asgi, wsgi
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.middleware import Outcome, RateLimitPipeline, Request
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import RateLimitRule

FRONT_ENDS = ("pipeline", "check", "starlette", "flask")


class CountingWallClock:
    """The pipeline's ``wall_clock``, counting its reads."""

    def __init__(self) -> None:
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return WALL


def _sender(front_end: str, core: RateLimitPipeline) -> Callable[[str, str | None], int]:
    """``send(path, user) -> status`` through one front end sharing ``core``."""
    if front_end == "pipeline":
        return lambda path, user: core(Request("GET", path, {}, "192.0.2.1", user), ok_handler).status
    if front_end == "check":

        def check(path: str, user: str | None) -> int:
            outcome = core.check(Request("GET", path, {}, "192.0.2.1", user))
            return 200 if outcome is None or outcome.allowed else 429

        return check
    if front_end == "starlette":

        async def page(request: StarletteRequest) -> PlainTextResponse:
            return PlainTextResponse("ok")

        routes = [Route("/{rest:path}", page)]

        def scope_user(scope: Any) -> Request:
            request = asgi.request_from_scope(scope)
            request.user = dict(scope["headers"]).get(b"x-user", b"").decode() or None
            return request

        app = Starlette(
            routes=routes,
            middleware=[Middleware(asgi.RateLimitMiddleware, core=core, request_factory=scope_user)],
        )
        client = TestClient(app, client=("192.0.2.1", 50000))
        return lambda path, user: client.get(path, headers={"x-user": user} if user else {}).status_code
    flask = Flask("limited")

    @flask.get("/<path:rest>")
    def page_(rest: str) -> str:
        return "ok"

    flask.wsgi_app = wsgi.RateLimitMiddleware(flask.wsgi_app, core=core)  # type: ignore[method-assign]
    client_ = flask.test_client()

    def send(path: str, user: str | None) -> int:
        environ = {"REMOTE_ADDR": "192.0.2.1", **({"REMOTE_USER": user} if user else {})}
        return client_.get(path, environ_base=environ).status_code

    return send


def _core(
    backend: types.SimpleNamespace, rules: list[RateLimitRule], storage: Any, *, stacked: bool = False
) -> tuple[RateLimitPipeline, CountingWallClock]:
    limiters = None if hasattr(storage, "allow_all") else backend.module.LIMITERS
    factory = LimiterFactory(storage, backend.FakeClock(0.0), limiters=limiters)
    wall = CountingWallClock()
    core = RateLimitPipeline(RuleRegistry(rules, stacked=stacked), factory, wall_clock=wall)
    return core, wall


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_a_request_enters_the_core_once_and_reads_the_clock_once(
    backend: types.SimpleNamespace, front_end: str
) -> None:
    storage = DictStorage()  # counts the core's calls into it
    core, wall = _core(backend, [rule("api", 3, 60.0, path_prefix="/api")], storage)
    send = _sender(front_end, core)
    assert [send("/api/items", None) for _ in range(5)] == [200, 200, 200, 429, 429]
    assert (storage.calls, wall.reads) == (5, 5)
    assert [send("/health", None) for _ in range(3)] == [200, 200, 200]  # unlimited: neither
    assert (storage.calls, wall.reads) == (5, 5)
    assert core.metrics.snapshot()["api"] == {"allowed": 3, "denied": 2, "shadow_denied": 0, "near_limit": 1}


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_the_route_is_cached_once_in_the_pipeline(backend: types.SimpleNamespace, front_end: str) -> None:
    """Flat and stacked: the ruleset's lookup caches are not filled by
    traffic (the pipeline's route cache is the one), and a stacked request
    is decided from its cached route, the ruleset not asked again."""
    big = 1 << 20
    for stacked in (False, True):
        rules = [rule("api", big, 60.0, path_prefix="/api"), rule("all", big, 60.0, scope="global")]
        core, _ = _core(backend, rules, backend.InMemoryStorage(), stacked=stacked)
        send = _sender(front_end, core)
        paths = [f"/api/{i}" for i in range(20)] + ["/other"]
        for _ in range(3):
            assert all(send(path, None) == 200 for path in paths)
        ruleset = core.registry.ruleset
        assert ruleset.cached_key_bytes() == 0 and not ruleset._cache and not ruleset._cache_all
        assert {("GET", p, None) for p in paths} <= set(core._routes[1])
        snap = core.metrics.snapshot()
        assert snap["api"]["allowed"] == 60 and snap["all"]["allowed"] == (63 if stacked else 3)
        # direct users of the registry still get its cached lookup
        assert core.registry.rule_for("GET", "/api/1").name == "api" and ruleset.cached_key_bytes() > 0


@pytest.mark.parametrize("front_end", FRONT_ENDS)
def test_stacked_rules_read_the_clock_once_and_spend_only_when_all_agree(
    backend: types.SimpleNamespace, front_end: str
) -> None:
    rules = [
        rule("per-user", 2, 60.0, scope="user"),
        rule("ceiling", 3, 60.0, scope="global", algorithm="gcra"),
        rule("trial", 1, 60.0, scope="global", dry_run=True),
    ]
    storage = backend.InMemoryStorage()
    core, wall = _core(backend, rules, storage, stacked=True)
    send = _sender(front_end, core)
    statuses = [send("/x", user) for user in ("alice", "alice", "alice", "bob", "bob")]
    assert statuses == [200, 200, 429, 200, 429]
    assert wall.reads == 5
    snap = core.metrics.snapshot()
    assert snap["per-user"] == {"allowed": 3, "denied": 1, "shadow_denied": 0, "near_limit": 1}
    assert snap["ceiling"]["allowed"] == 3 and snap["ceiling"]["denied"] == 1
    assert snap["trial"]["allowed"] == 1 and snap["trial"]["shadow_denied"] == 4


class AuditedPipeline(RateLimitPipeline):
    """An extension through the public entry point: every decision logged,
    and one path refused whatever the budget says."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.seen: list[tuple[str, bool | None]] = []

    def check(self, request: Request) -> Outcome | None:
        outcome = super().check(request)
        if request.path == "/blocked" and outcome is not None:
            outcome = Outcome(False, {"Retry-After": "30"}, 0.0, "blocked", 30, outcome.decision)
        self.seen.append((request.path, None if outcome is None else outcome.allowed))
        return outcome


@pytest.mark.parametrize("front_end", ("pipeline", "starlette", "flask"))
def test_every_front_end_decides_through_the_public_check(
    backend: types.SimpleNamespace, front_end: str
) -> None:
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
    core = AuditedPipeline(RuleRegistry([rule("api", 2, 60.0, path_prefix="/")]), factory)
    send = _sender(front_end, core)
    assert [send("/a", None), send("/blocked", None), send("/a", None)] == [200, 429, 429]
    assert core.seen == [("/a", True), ("/blocked", False), ("/a", False)]


def test_check_is_the_decision_call_answers(backend: types.SimpleNamespace) -> None:
    """The same decisions, counts and headers through ``check`` and
    ``__call__`` on two pipelines fed the same requests."""
    made = [
        _core(backend, [rule("r", 3, 10.0), rule("s", 2, 5.0, path_prefix="/s")], backend.InMemoryStorage())[
            0
        ]
        for _ in range(2)
    ]
    by_check, by_call = made
    for path in ("/", "/s", "/", "/s", "/s", "/", "/", "/x"):
        outcome = by_check.check(get(path))
        response = by_call(get(path), ok_handler)
        assert outcome is not None
        assert response.status == (200 if outcome.allowed else 429)
        for name, value in outcome.headers.items():
            assert response.headers[name] == value
        if not outcome.allowed:
            assert response.body == outcome.body()
    assert by_check.metrics.snapshot() == by_call.metrics.snapshot()
