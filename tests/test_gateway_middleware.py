"""The framework-free middleware: decisions, docs/spec.md §2 responses, shadow mode,
shaping, metrics and compound (stacked) limits, for both twins."""

from __future__ import annotations

import importlib
import json
import logging
import threading
import time
import types
import warnings
from http import HTTPStatus
from typing import Any

import pytest
from _helpers import DictStorage
from gateway_helpers import WALL, gateway, get, ok_handler, rule
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolimit.errors import ValidationError
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.metrics import Metrics
from nanolimit.gateway.middleware import RateLimitPipeline, Request, Response
from nanolimit.gateway.registry import RuleRegistry

SPEC_HEADERS = (
    "X-RateLimit-Limit",
    "X-RateLimit-Remaining",
    "X-RateLimit-Reset",
    "RateLimit-Policy",
    "RateLimit",
)


def test_spec_scenario_one_through_the_middleware(backend) -> None:
    mw = gateway(backend, [rule("demo", 5, 60.0)])
    responses = [mw(get("/orders"), ok_handler) for _ in range(7)]
    assert [r.status for r in responses] == [200] * 5 + [429] * 2
    for i, r in enumerate(responses[:5]):
        assert r.body == b"ok" and r.headers["Content-Type"] == "text/plain"
        assert r.headers["X-RateLimit-Remaining"] == str(4 - i)
        assert "Retry-After" not in r.headers
    denied = responses[-1]
    assert denied.headers["Retry-After"] == "12"
    assert denied.headers["X-RateLimit-Remaining"] == "0"
    assert denied.headers["X-RateLimit-Limit"] == "5"
    assert denied.headers["X-RateLimit-Reset"] == str(int(WALL) + 60)
    assert denied.headers["RateLimit-Policy"] == '"demo";q=5;w=60'
    assert denied.headers["RateLimit"] == '"demo";r=0;t=60'
    assert denied.headers["Content-Type"] == "application/json"
    assert json.loads(denied.body) == {"error": "rate_limit_exceeded", "rule": "demo", "retry_after": 12}
    assert mw.metrics.snapshot() == {"demo": {"allowed": 5, "denied": 2, "shadow_denied": 0, "near_limit": 1}}


def test_headers_equal_the_decisions_own_rendering(backend, algorithm: str) -> None:
    clock = backend.FakeClock(100.25)
    mw = gateway(backend, [rule("r", 4, 2.5, algorithm=algorithm)], clock)
    for i in range(6):
        outcome = mw.check(get())
        assert outcome is not None
        assert outcome.headers == outcome.decision.headers(wall_now=WALL)
        assert outcome.allowed == (i < 4)
        clock.advance(0.1)


def test_no_rule_passes_through_untouched(backend) -> None:
    mw = gateway(backend, [rule("api", 1, 60.0, path_prefix="/api")])
    for _ in range(3):
        response = mw(get("/health"), ok_handler)
        assert response.status == 200 and response.headers == {"Content-Type": "text/plain"}
    assert mw.check(get("/health")) is None
    assert mw.metrics.snapshot() == {}


def test_default_rule_limits_what_no_rule_matches(backend) -> None:
    mw = gateway(backend, [rule("api", 5, 60.0, path_prefix="/api")], default=rule("fallback", 1, 60.0))
    assert [mw(get("/x"), ok_handler).status for _ in range(2)] == [200, 429]
    assert mw(get("/api"), ok_handler).status == 200


def test_dry_run_decides_and_counts_but_never_rejects(backend) -> None:
    mw = gateway(backend, [rule("trial", 2, 60.0, dry_run=True)])
    responses = [mw(get(), ok_handler) for _ in range(5)]
    assert [r.status for r in responses] == [200] * 5
    assert all("X-RateLimit-Limit" not in r.headers for r in responses)  # invisible to clients
    assert mw.metrics.snapshot()["trial"] == {"allowed": 2, "denied": 0, "shadow_denied": 3, "near_limit": 1}
    assert 'outcome="shadow_denied"} 3' in mw.metrics.render_prometheus()


def test_leaky_bucket_rules_shape_instead_of_reject(backend) -> None:
    waits: list[float] = []
    mw = gateway(backend, [rule("shaper", 5, 1.0, algorithm="leaky_bucket")], sleep=waits.append)
    statuses = [mw(get(), ok_handler).status for _ in range(6)]
    assert statuses == [200] * 5 + [429]
    assert waits == pytest.approx([0.2, 0.4, 0.6, 0.8])  # the first runs at once
    plain_waits: list[float] = []
    plain = gateway(
        backend, [rule("noshape", 5, 1.0, algorithm="leaky_bucket", shape=False)], sleep=plain_waits.append
    )
    assert [plain(get(), ok_handler).status for _ in range(5)] == [200] * 5
    assert plain_waits == []


def test_tiers_through_the_middleware(backend) -> None:
    rules = [
        rule("anon", 2, 3600.0, tier="anonymous"),
        rule("auth", 4, 3600.0, tier="authenticated", scope="user"),
    ]
    mw = gateway(backend, rules)
    assert [mw(get(), ok_handler).status for _ in range(3)] == [200, 200, 429]
    alice = Request("GET", "/", {}, "192.0.2.1", user="alice")
    assert [mw(alice, ok_handler).status for _ in range(5)] == [200] * 4 + [429]
    snap = mw.metrics.snapshot()
    assert snap["anon"]["denied"] == 1 and snap["auth"]["denied"] == 1 and snap["auth"]["allowed"] == 4


def test_metrics_merge_per_thread_counters_and_render_prometheus(backend) -> None:
    mw = gateway(backend, [rule("hot", 1000, 60.0, scope="global"), rule("api", 1, 60.0, path_prefix="/api")])
    barrier = threading.Barrier(4)

    def work() -> None:
        barrier.wait()
        for _ in range(100):
            mw(get("/x"), ok_handler)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    mw(get("/api"), ok_handler)
    mw(get("/api"), ok_handler)
    snap = mw.metrics.snapshot()
    assert snap["hot"] == {"allowed": 400, "denied": 0, "shadow_denied": 0, "near_limit": 0}
    assert snap["api"] == {"allowed": 1, "denied": 1, "shadow_denied": 0, "near_limit": 1}
    text = mw.metrics.render_prometheus()
    lines = text.splitlines()
    assert "# TYPE nanolimit_requests_total counter" in lines
    assert 'nanolimit_requests_total{rule="hot",outcome="allowed"} 400' in lines
    assert 'nanolimit_requests_total{rule="api",outcome="denied"} 1' in lines
    assert 'nanolimit_near_limit_total{rule="api"} 1' in lines
    assert text.endswith("\n")
    for line in lines:
        assert line.startswith("#") or line.rsplit(" ", 1)[1].isdigit()


def test_near_limit_counts_admitted_requests_under_a_fifth_left() -> None:
    metrics = Metrics()
    for remaining in (9, 2, 1, 0):
        metrics.record("r", True, remaining, 10)
    metrics.record("r", False, 0, 10)
    assert metrics.snapshot()["r"] == {"allowed": 4, "denied": 1, "shadow_denied": 0, "near_limit": 2}


def test_reloaded_registry_is_picked_up_and_unchanged_rules_keep_state(backend) -> None:
    mw = gateway(backend, [rule("a", 3, 60.0, path_prefix="/a"), rule("b", 3, 60.0, path_prefix="/b")])
    for _ in range(2):
        assert mw(get("/a"), ok_handler).status == 200
    mw.registry.replace([rule("a", 3, 60.0, path_prefix="/a"), rule("b", 1, 60.0, path_prefix="/b")])
    assert [mw(get("/a"), ok_handler).status for _ in range(2)] == [200, 429]  # one left, not a fresh 3
    assert [mw(get("/b"), ok_handler).status for _ in range(2)] == [200, 429]


# -- compound limits -----------------------------------------------------------------


def _compound_rules() -> list:
    return [
        rule("orders-user", 4, 60.0, method="POST", path_prefix="/orders", scope="user"),
        rule("per-ip", 6, 60.0, algorithm="fixed_window"),
        rule("ceiling", 9, 60.0, scope="global", algorithm="gcra"),
    ]


def test_compound_denial_by_the_last_rule_charges_nobody(backend) -> None:
    mw = gateway(backend, _compound_rules(), stacked=True)
    alice = Request("POST", "/orders", {}, "192.0.2.1", user="alice")
    bob = Request("POST", "/orders", {}, "192.0.2.1", user="bob")
    assert [mw(alice, ok_handler).status for _ in range(4)] == [200] * 4
    assert [mw(bob, ok_handler).status for _ in range(2)] == [200, 200]
    # per-ip (6) is now spent: bob's next order is denied by it ...
    denied = mw(bob, ok_handler)
    assert denied.status == 429 and denied.json()["rule"] == "per-ip"
    assert denied.headers["X-RateLimit-Remaining"] == "0"
    # ... and bob's own budget and the ceiling were not charged for it
    limiters = {r.name: mw.factory.for_rule(r) for r in _compound_rules()}
    assert limiters["orders-user"].state("user:bob").level == pytest.approx(2.0)
    assert limiters["ceiling"].peek("global:*").remaining == 9 - 6 - 1
    other_ip = Request("POST", "/orders", {}, "192.0.2.2", user="bob")
    ok = mw(other_ip, ok_handler)
    assert ok.status == 200
    # the tightest remaining wins the headers: bob has 1 left of 4
    assert ok.headers["X-RateLimit-Remaining"] == "1" and ok.headers["X-RateLimit-Limit"] == "4"
    snap = mw.metrics.snapshot()
    assert (
        snap["per-ip"]["denied"] == 1
        and snap["orders-user"]["denied"] == 0
        and snap["ceiling"]["denied"] == 0
    )
    assert snap["orders-user"]["allowed"] == 7


def test_compound_with_a_shadow_rule_never_rejects_for_it(backend) -> None:
    rules = [rule("enforced", 3, 60.0), rule("trial", 1, 60.0, scope="global", dry_run=True)]
    mw = gateway(backend, rules, stacked=True)
    assert [mw(get(), ok_handler).status for _ in range(4)] == [200, 200, 200, 429]
    snap = mw.metrics.snapshot()
    assert snap["trial"]["shadow_denied"] == 3 and snap["enforced"]["denied"] == 1


@pytest.mark.parametrize(
    "count_when", [lambda status: status != 200, lambda status: HTTPStatus(status) >= 500]
)
def test_a_refused_stack_gives_its_shadow_charges_back_whatever_they_count(backend, count_when) -> None:
    """An enforced rule refuses the request: the shadow rule's charge goes
    back, since the request never ran. It was settled as status -1, which a
    ``count_when`` callable may count (``!= 200``: kept spent, so the trial
    rule reported denials no response had earned) or refuse (``HTTPStatus(-1)``
    raises ValueError: a 500 instead of the 429)."""
    rules = [
        rule("enforced", 2, 60.0, algorithm="fixed_window"),
        rule("trial", 5, 60.0, scope="global", dry_run=True, algorithm="fixed_window", count_when=count_when),
    ]
    mw = gateway(backend, rules, stacked=True)
    assert [mw(get(), ok_handler).status for _ in range(10)] == [200, 200] + [429] * 8
    snap = mw.metrics.snapshot()
    assert snap["enforced"]["denied"] == 8
    assert snap["trial"]["shadow_denied"] == 0  # every charge went back: 200s and refusals alike


def test_compound_needs_a_storage_that_can_decide_all_at_once(backend) -> None:
    factory = LimiterFactory(DictStorage(), backend.FakeClock(0.0), limiters=backend.module.LIMITERS)
    mw = RateLimitPipeline(RuleRegistry(_compound_rules(), stacked=True), factory)
    with pytest.raises(ValidationError, match="allow_all"):
        mw(Request("POST", "/orders", {}, "192.0.2.1", user="alice"), ok_handler)


_request = st.tuples(
    st.sampled_from(["alice", "bob", None]),
    st.sampled_from(["192.0.2.1", "192.0.2.2"]),
    st.sampled_from([("POST", "/orders"), ("GET", "/orders"), ("GET", "/x")]),
    st.sampled_from([0.0, 0.0, 0.0, 1.5, 7.0]),
)


@settings(max_examples=60, deadline=None)
@given(requests=st.lists(_request, min_size=1, max_size=40))
def test_compound_never_charges_a_denied_request(backend: types.SimpleNamespace, requests: list) -> None:
    """Against an oracle that spends only when every rule would allow: the
    middleware answers the same, and a 429 leaves every rule's state as it was."""
    clock = backend.FakeClock(1000.0)
    rules = _compound_rules()
    mw = gateway(backend, rules, clock, stacked=True)
    oracle_store = backend.InMemoryStorage()
    oracle = {
        r.name: backend.limiters[r.algorithm.value](r.limit, r.window_seconds, oracle_store, clock, r.name)
        for r in rules
    }
    live = {r.name: mw.factory.for_rule(r) for r in rules}
    ex = mw.extractor
    for user, ip, (method, path), dt in requests:
        clock.advance(dt)
        request = Request(method, path, {}, ip, user=user)
        applied = mw.registry.rules_for(method, path)
        keys = [(r.name, ex.key_for(request, r.scope).storage_key()) for r in applied]
        before = [live[name].state(key) for name, key in keys]
        expected = all(oracle[name].peek(key).allowed for name, key in keys)
        if expected:
            for name, key in keys:
                assert oracle[name].allow(key).allowed
        status = mw(request, ok_handler).status
        assert status == (200 if expected else 429)
        if status == 429:
            assert [live[name].state(key) for name, key in keys] == before
        for name, key in keys:
            assert live[name].peek(key).remaining == oracle[name].peek(key).remaining


def test_compound_is_all_or_nothing_under_eight_threads(backend) -> None:
    """4 users x 20 per user under a global ceiling of 50: exactly 50 pass and
    the per-user budgets were charged exactly 50 times in all."""
    rules = [rule("per-user", 20, 60.0, scope="user"), rule("ceiling", 50, 60.0, scope="global")]
    mw = gateway(backend, rules, stacked=True)
    passed = [0] * 8
    barrier = threading.Barrier(8)

    def work(slot: int) -> None:
        request = Request("GET", "/", {}, "192.0.2.1", user=f"u{slot % 4}")
        barrier.wait()
        passed[slot] = sum(mw(request, ok_handler).status == 200 for _ in range(40))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(passed) == 50
    per_user = mw.factory.for_rule(rules[0])
    ceiling = mw.factory.for_rule(rules[1])
    states = [per_user.state(f"user:u{i}") for i in range(4)]
    spent = sum(0.0 if s is None else 20 - s.level for s in states)  # None: never admitted
    assert spent == pytest.approx(50.0)
    assert ceiling.state("global:*").level == pytest.approx(0.0)
    snap = mw.metrics.snapshot()
    assert snap["ceiling"]["allowed"] == 50 and snap["per-user"]["allowed"] == 50
    assert snap["ceiling"]["denied"] + snap["per-user"]["denied"] >= 320 - 50


def test_the_pipeline_returns_the_handlers_response_object(backend) -> None:
    mw = gateway(backend, [rule("r", 5, 60.0)])
    sentinel = Response(201, {"X-App": "1"}, b"made")
    out = mw(get(), lambda _req: sentinel)
    assert out is sentinel and out.status == 201 and out.headers["X-App"] == "1"
    assert set(SPEC_HEADERS) <= set(out.headers)


class _HeaderMap(dict):  # a framework's own header mapping: not exactly a dict
    pass


@pytest.mark.native
def test_admitted_lane_refuses_what_it_cannot_write(native) -> None:
    """A non-finite wall clock would have written -2**63 as X-RateLimit-Reset;
    None would have become a header value. Refused, nothing written or counted."""
    import math

    from nanolimit import ValidationError

    lane = native.AdmittedRequests("r")
    d = native.Decision(True, 10, 1, 0.0, 1.0, "r", 1.0)
    headers: dict[str, str] = {}
    for wall in (math.nan, math.inf, -math.inf):
        with pytest.raises(ValidationError):
            lane.record(d, headers, "10", "p", "x", 2.0, wall)
    for args in ((None, "p", "x"), ("10", None, "x"), ("10", "p", None)):
        with pytest.raises(TypeError):
            lane.record(d, headers, *args, 2.0, 0.0)
    assert headers == {} and lane.allowed == 0


def test_admitted_lane_counts_exactly_under_threads_and_any_mapping(native) -> None:
    lane = native.AdmittedRequests("r")
    d = native.Decision(True, 10, 1, 0.0, 1.0, "r", 1.0)
    barrier = threading.Barrier(8)

    def work() -> None:
        headers = _HeaderMap()
        barrier.wait()
        for _ in range(20_000):
            lane.record(d, headers, "10", "p", "x", 2.0, 0.0)
        assert headers["RateLimit"] == "x1;t=1" and type(headers) is _HeaderMap

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert lane.allowed == lane.near_limit == 160_000
    with pytest.raises(TypeError):
        lane.record(d, None, "10", "p", "x", 2.0, 0.0)  # not a mapping
    assert lane.allowed == 160_000  # a failed call counts nothing


def test_an_admitted_request_whose_handler_raises_is_still_counted(backend) -> None:
    mw = gateway(backend, [rule("r", 5, 60.0)])

    def broken(_request: Request) -> Response:
        raise RuntimeError("handler failed")

    with pytest.raises(RuntimeError, match="handler failed"):
        mw(get("/x"), broken)
    assert mw.metrics.snapshot()["r"]["allowed"] == 1
    assert mw(get("/x"), ok_handler).headers["X-RateLimit-Remaining"] == "3"


def test_counts_of_ended_threads_are_kept_and_their_shards_dropped() -> None:
    """A server may start a thread per request: each thread's counters are
    folded into the totals when it ends, so shards do not pile up."""
    from nanolimit.gateway.metrics import Metrics

    metrics = Metrics()

    def one_request(i: int) -> None:
        metrics.record("r", allowed=i % 3 != 0, remaining=50, limit=100)

    for i in range(300):
        t = threading.Thread(target=one_request, args=(i,))
        t.start()
        t.join()
    assert len(metrics._shards) <= 2  # the ended threads' shards are gone
    snap = metrics.snapshot()["r"]
    assert snap["allowed"] == 200 and snap["denied"] == 100
    metrics.record("r", allowed=True, remaining=50, limit=100)  # this thread keeps its own
    assert metrics.snapshot()["r"]["allowed"] == 201


def _counting_factory(built: list[str]) -> object:
    def factory(native: dict[str, str]) -> Request:
        built.append(native["path"])
        return Request("GET", native["path"], client=native["client"], user=native.get("user"))

    return factory


def test_decide_builds_a_request_only_when_a_rule_or_a_hook_needs_one(
    backend, caplog: pytest.LogCaptureFixture
) -> None:
    """``decide()`` answers what ``check()`` answers; on the native lane a
    plain IP rule on a cached route is keyed from the peer alone, and a user
    rule, a cache miss or a denial record still gets its Request."""
    from nanolimit.gateway.rules import RateLimitRule

    user_rule = RateLimitRule("me", "*", "/me", "user", "fixed_window", 1, 60.0)
    mw = gateway(backend, [rule("ip", 2, 60.0), user_rule], log_denials=3600.0)
    built: list[str] = []
    factory = _counting_factory(built)
    ip, me = {"path": "/", "client": "192.0.2.9"}, {"path": "/me", "client": "192.0.2.9", "user": "u1"}
    with caplog.at_level(logging.WARNING, logger="nanolimit.denials"):
        answers = [mw.decide(ip, "GET", "/", "192.0.2.9", None, factory) for _ in range(5)]
        mine = [mw.decide(me, "GET", "/me", "192.0.2.9", None, factory) for _ in range(2)]
    assert [o.allowed for o in answers] == [True, True, False, False, False]
    assert [o.allowed for o in mine] == [True, False]
    assert answers[2].headers["Retry-After"] == str(answers[2].retry_after)
    assert len(caplog.records) == 2  # one per rule within the interval
    lane = mw._state[1][id(mw.registry.ruleset.rules[0])].lane
    if lane is None:  # the Python path: check() on the Request every time
        assert built == ["/"] * 5 + ["/me"] * 2
    else:  # the miss and the denial record of "/"; every request of the user rule
        assert built == ["/", "/", "/me", "/me"]
    assert mw.metrics.snapshot()["ip"] == {"allowed": 2, "denied": 3, "shadow_denied": 0, "near_limit": 1}


class _ScopeView(dict[str, Any]):
    """A scope that is a dict subclass: read through its own ``get``."""


def test_decide_scope_reads_the_scope_as_request_from_scope_does(backend) -> None:
    """The native twin reads an ASGI scope with dict lookups: each shape
    (a root_path joined under the path, a missing or empty path, no client,
    a dict subclass) charges the key and path the Python method would, so
    the two calls in a pair share one count."""
    from nanolimit.asgi import request_from_scope

    mw = gateway(backend, [rule("api", 1000, 60.0, path_prefix="/api", algorithm="fixed_window")])
    python_twin = RateLimitPipeline.decide_scope
    base: dict[str, Any] = {"type": "http", "method": "GET", "client": ("192.0.2.1", 1)}
    covered = [
        {**base, "path": "/api/x"},
        {**base, "path": "/x", "root_path": "/api"},
        {**base, "path": "/api/x", "root_path": "/api"},  # already under it: not joined twice
        {**base, "path": "x", "root_path": "/api"},
        {**base, "path": "/api/y", "client": None},
        _ScopeView({**base, "path": "/api/z", "method": "POST"}),
    ]
    for scope in covered:
        first = mw.decide_scope(scope, None, request_from_scope)
        second = python_twin(mw, scope, None, request_from_scope)
        assert first is not None and second is not None, scope
        assert first.allowed and second.allowed
        assert int(first.headers["X-RateLimit-Remaining"]) == int(second.headers["X-RateLimit-Remaining"]) + 1
    # the root is in the path only at a segment boundary, as Starlette routes:
    # "/api/x" under "/ap" is the public "/ap/api/x", outside the /api rule
    outside = {**base, "path": "/api/x", "root_path": "/ap"}
    for scope in ({**base, "path": "/x"}, {**base, "path": ""}, {**base, "root_path": "/v1"}, outside):
        assert mw.decide_scope(scope, None, request_from_scope) is None
        assert python_twin(mw, scope, None, request_from_scope) is None
    assert request_from_scope(outside).path == "/ap/api/x"
    assert request_from_scope({**base, "path": "/v1beta/x", "root_path": "/v1"}).path == "/v1/v1beta/x"
    assert request_from_scope({**base, "path": "/v1", "root_path": "/v1"}).path == "/v1"
    assert request_from_scope({**base, "path": "/v1/x", "root_path": "/v1/"}).path == "/v1/x"
    # a scope with no method is a GET, as request_from_scope reads it
    get_scope = {"type": "http", "path": "/api/q", "client": ("192.0.2.1", 1)}
    assert mw.decide_scope(get_scope, None, request_from_scope) is not None


def test_a_flood_of_denials_is_one_record_saying_how_many_it_stands_for(
    backend, caplog: pytest.LogCaptureFixture
) -> None:
    mw = gateway(backend, [rule("api", 1, 3600.0)], log_denials=0.2)
    env = {"path": "/", "client": "c"}
    factory = _counting_factory([])
    with caplog.at_level(logging.WARNING, logger="nanolimit.denials"):
        for _ in range(21):
            mw.decide(env, "GET", "/", "c", None, factory)
        time.sleep(0.25)
        mw.decide(env, "GET", "/", "c", None, factory)
    records = [r.getMessage() for r in caplog.records]
    assert len(records) == 2
    assert "more since" not in records[0] and "(+19 more since the last record)" in records[1]


def test_an_on_breach_hook_set_later_hears_every_denial_after(backend) -> None:
    mw = gateway(backend, [rule("api", 1, 3600.0)], log_denials=None)
    factory = _counting_factory([])
    env = {"path": "/", "client": "c"}
    assert [mw.decide(env, "GET", "/", "c", None, factory).allowed for _ in range(2)] == [True, False]
    seen: list[str] = []
    mw.on_breach = lambda request, outcome: seen.append(request.path)
    assert not mw.decide(env, "GET", "/", "c", None, factory).allowed
    assert mw.check(Request("GET", "/", client="c")).allowed is False  # type: ignore[union-attr]
    assert seen == ["/", "/"]
    with pytest.raises(ValidationError):
        mw.on_breach = "not callable"  # type: ignore[assignment]


@pytest.mark.parametrize("path", ["nanolimit", "nanolimit.gateway.middleware"])
def test_the_old_name_of_the_pipeline_still_imports_and_names_the_new_one(path: str) -> None:
    module = importlib.import_module(path)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        old = module.RateLimitMiddleware
        namespace: dict[str, object] = {}
        exec(f"from {path} import RateLimitMiddleware", namespace)  # the documented spelling
    assert old is namespace["RateLimitMiddleware"] is RateLimitPipeline
    # one warning per use, each pointing at the line that used the old name
    assert [w.category for w in caught] == [DeprecationWarning] * 2
    assert caught[0].filename == __file__ and caught[1].filename == "<string>"
    assert all("RateLimitPipeline" in str(w.message) for w in caught)
    assert "RateLimitMiddleware" not in module.__all__ and "RateLimitPipeline" in module.__all__
    with pytest.raises(AttributeError):
        _ = module.NoSuchName
    # handed an app, the old name still says which import wraps one
    with pytest.warns(DeprecationWarning), pytest.raises(TypeError, match=r"from nanolimit\.asgi import"):
        module.RateLimitMiddleware(lambda scope, receive, send: None, RuleRegistry([rule("all", 1, 60.0)]))
