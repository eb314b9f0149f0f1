"""The gateway on the shared Redis store: the same middleware, compound limits
through ``RedisStorage.allow_all`` (one script), hot-reloaded limits keeping
their keys' state."""

from __future__ import annotations

import types
from typing import Any

from gateway_helpers import WALL, get, ok_handler, rule

from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.middleware import RateLimitPipeline, Request
from nanolimit.gateway.registry import RuleRegistry

pytest_plugins = ["redis_servers"]  # the server fixtures


def _gateway(backend: types.SimpleNamespace, storage: Any, rules: list, *, stacked: bool = False) -> Any:
    factory = LimiterFactory(storage, backend.FakeClock(0.0), limiters=backend.module.LIMITERS)
    return RateLimitPipeline(RuleRegistry(rules, stacked=stacked), factory, wall_clock=lambda: WALL)


def test_redis_backed_gateway_answers_like_the_spec(
    backend: types.SimpleNamespace, make_storage: Any
) -> None:
    mw = _gateway(backend, make_storage(), [rule("demo", 5, 60.0)])
    responses = [mw(get(), ok_handler) for _ in range(7)]
    assert [r.status for r in responses] == [200] * 5 + [429] * 2
    assert responses[-1].headers["Retry-After"] == "12"
    assert responses[-1].headers["X-RateLimit-Remaining"] == "0"
    assert responses[-1].json() == {"error": "rate_limit_exceeded", "rule": "demo", "retry_after": 12}


def test_redis_compound_limits_charge_nobody_on_a_denial(
    backend: types.SimpleNamespace, make_storage: Any
) -> None:
    rules = [
        rule("orders-user", 4, 60.0, method="POST", path_prefix="/orders", scope="user"),
        rule("per-ip", 6, 60.0, algorithm="fixed_window"),
        rule("ceiling", 9, 60.0, scope="global", algorithm="gcra"),
    ]
    mw = _gateway(backend, make_storage(), rules, stacked=True)
    alice = Request("POST", "/orders", {}, "192.0.2.1", user="alice")
    bob = Request("POST", "/orders", {}, "192.0.2.1", user="bob")
    assert [mw(alice, ok_handler).status for _ in range(5)] == [200] * 4 + [429]
    assert [mw(bob, ok_handler).status for _ in range(3)] == [200, 200, 429]
    assert mw(bob, ok_handler).json()["rule"] == "per-ip"
    ceiling = mw.factory.for_rule(rules[2])
    assert ceiling.peek("global:*").remaining == 9 - 6 - 1  # only the 6 admitted were charged
    snap = mw.metrics.snapshot()
    assert snap["orders-user"]["denied"] == 1 and snap["per-ip"]["denied"] == 2
    assert snap["ceiling"] == {"allowed": 6, "denied": 0, "shadow_denied": 0, "near_limit": 0}


def test_redis_reload_keeps_spent_budget(backend: types.SimpleNamespace, make_storage: Any) -> None:
    mw = _gateway(backend, make_storage(), [rule("api", 3, 60.0, algorithm="fixed_window")])
    assert [mw(get(), ok_handler).status for _ in range(3)] == [200] * 3
    mw.registry.replace([rule("api", 4, 60.0, algorithm="fixed_window")])
    assert [mw(get(), ok_handler).status for _ in range(2)] == [200, 429]
