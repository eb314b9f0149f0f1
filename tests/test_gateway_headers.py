"""The gateway's one header renderer (``nanolimit.gateway.headers``) against
the other writers of the same bytes: the native lane
``AdmittedRequests.record``, its Python fallback, and the core's own
``Decision.headers`` / ``CompoundDecision.headers``, for both twins."""

from __future__ import annotations

import json
import math
import types
from typing import Any

import pytest
from gateway_helpers import WALL, gateway, get, ok_handler, rule
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolimit._shared import ValidationError
from nanolimit.gateway.headers import (
    MAX_HEADER_SECONDS,
    deny_body,
    rate_headers,
    retry_seconds,
    rule_pieces,
)
from nanolimit.gateway.metrics import Metrics, _ShardedAdmitted
from nanolimit.middleware import Request

FIVE = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "RateLimit-Policy", "RateLimit")

# remaining counts and reset times that round both ways, at the edges of
# what a header holds, and wall clocks with and without a fraction
CASES = [
    (0, 0.0, WALL),
    (1, 1e-9, WALL + 0.25),
    (7, 2.5, WALL + 0.75),
    (9, 0.75, 0.0),
    (10, 2.4999999999, -12.5),
    (123456789, 3599.000001, WALL),
    (2**40, 2.0**61, 1.5),
    ((1 << 62) - 1, MAX_HEADER_SECONDS - 1024.0, WALL),
]
# inputs neither lane may write: a wall clock that is not a time, a reset
# that is negative, not a number or beyond an int64 header
REFUSED = [
    (1, 1.0, math.nan),
    (1, 1.0, math.inf),
    (1, 1.0, -math.inf),
    (1, 1.0, 1e300),
    (1, -1e-9, WALL),
    (1, math.nan, WALL),
    (1, math.inf, WALL),
    (1, MAX_HEADER_SECONDS, WALL),
]


def _decision(backend: types.SimpleNamespace, remaining: int, reset: float, allowed: bool = True) -> Any:
    return backend.Decision(allowed, 10, remaining, 0.0 if allowed else 1.5, reset, "r", 2.5)


class _HeaderMap(dict[str, str]):
    """A framework's own header mapping: a dict, but not exactly one."""


@pytest.mark.native
def test_the_native_lane_and_the_python_fallback_write_the_same_bytes(
    backend: types.SimpleNamespace, native: types.ModuleType
) -> None:
    """For decisions of either twin: the same five headers, into a dict or
    another mapping, the same counts, and the same inputs refused with
    nothing written or counted."""
    pieces = rule_pieces("r", 10, 2.5)
    metrics = Metrics()
    fast = native.AdmittedRequests("r")
    slow = _ShardedAdmitted(metrics, "r")
    near = 2.0
    for remaining, reset, wall in CASES:
        d = _decision(backend, remaining, reset)
        for mapping in (dict, _HeaderMap):
            got: dict[str, str] = mapping()
            want: dict[str, str] = mapping()
            fast.record(d, got, *pieces, near, wall)
            slow.record(d, want, *pieces, near, wall)
            assert got == want == rate_headers(*pieces, remaining, reset, wall)
            assert list(got) == list(want) == list(FIVE)  # the same order on the wire
    n = 2 * len(CASES)
    near_count = 2 * sum(1 for remaining, _, _ in CASES if remaining < near)
    assert (fast.allowed, fast.near_limit) == (n, near_count)
    assert metrics.snapshot()["r"] == {
        "allowed": n,
        "denied": 0,
        "shadow_denied": 0,
        "near_limit": near_count,
    }
    for remaining, reset, wall in REFUSED:
        d = _decision(backend, remaining, reset)
        for lane in (fast, slow):
            headers: dict[str, str] = {}
            with pytest.raises(ValidationError):
                lane.record(d, headers, *pieces, near, wall)
            assert headers == {}
        with pytest.raises(ValidationError):
            rate_headers(*pieces, remaining, reset, wall)
    assert fast.allowed == n and metrics.snapshot()["r"]["allowed"] == n  # refusals count nothing


@settings(max_examples=200, deadline=None)
@given(
    remaining=st.integers(0, 2**53),
    reset=st.floats(0.0, 1e12, allow_nan=False),
    wall=st.floats(-1e9, 4e9, allow_nan=False),
    window=st.floats(1e-3, 1e7, allow_nan=False),
    capacity=st.integers(1, 2**32 - 1),
    allowed=st.booleans(),
)
def test_the_renderer_writes_what_the_decision_writes(
    backend: types.SimpleNamespace,
    remaining: int,
    reset: float,
    wall: float,
    window: float,
    capacity: int,
    allowed: bool,
) -> None:
    """The gateway's pieces-based renderer and the core's ``Decision.headers``
    are one rendering: the same five headers for any decision."""
    d = backend.Decision(allowed, capacity, remaining, 0.3, reset, "api.v1", window)
    want = d.headers(wall_now=wall)
    got = rate_headers(*rule_pieces("api.v1", capacity, window), remaining, reset, wall)
    assert got == {k: want[k] for k in FIVE}
    if not allowed:
        assert want["Retry-After"] == str(retry_seconds(0.3)) == "1"


@pytest.mark.parametrize(
    ("retry_after", "seconds"),
    [(0.0, 1), (1e-9, 1), (0.2, 1), (1.0, 1), (1.000001, 2), (11.5, 12), (3600.0, 3600)],
)
def test_retry_after_is_whole_seconds_rounded_up_and_at_least_one(retry_after: float, seconds: int) -> None:
    assert retry_seconds(retry_after) == seconds
    assert json.loads(deny_body("r", seconds)) == {
        "error": "rate_limit_exceeded",
        "rule": "r",
        "retry_after": seconds,
    }


def test_a_denial_carries_the_same_retry_after_in_header_body_and_outcome(
    backend: types.SimpleNamespace, algorithm: str
) -> None:
    """Every algorithm's fractional waits: the header, the 429 body and the
    Outcome say the same whole seconds, and the core's rendering agrees."""
    clock = backend.FakeClock(0.0)
    mw = gateway(backend, [rule("r", 3, 2.5, algorithm=algorithm)], clock)
    for _ in range(3):
        assert mw(get(), ok_handler).status == 200
    for step in (0.0, 0.3, 0.05):
        clock.advance(step)
        outcome = mw.check(get())
        assert outcome is not None
        if outcome.allowed:
            continue
        d = outcome.decision
        assert outcome.retry_after == max(1, math.ceil(d.retry_after))
        assert outcome.headers == d.headers(wall_now=WALL)
        assert json.loads(outcome.body())["retry_after"] == outcome.retry_after
        response = mw(get(), ok_handler)
        if response.status == 429:
            assert response.headers["Retry-After"] == str(response.json()["retry_after"])


def test_compound_headers_are_the_compound_decisions_own(backend: types.SimpleNamespace) -> None:
    """Stacked rules: the gateway renders the binding rule from its own
    pieces, and writes what ``CompoundDecision.headers`` writes, admitted
    (the least remaining binds) and denied (the longest wait binds)."""
    rules = [
        rule("per-user", 4, 60.0, scope="user"),
        rule("per-ip", 6, 10.0, algorithm="fixed_window"),
        rule("ceiling", 9, 3.5, scope="global", algorithm="gcra"),
    ]
    mw = gateway(backend, rules, stacked=True)
    seen = set()
    for i in range(12):
        outcome = mw.check(Request("GET", "/", {}, "192.0.2.1", user=f"u{i % 2}"))
        assert outcome is not None
        summary = outcome.decision
        assert outcome.headers == summary.headers(wall_now=WALL)
        assert outcome.rule == summary.rule and outcome.allowed == summary.allowed
        seen.add((outcome.allowed, outcome.rule))
    assert (True, "per-user") in seen and (False, "per-ip") in seen
