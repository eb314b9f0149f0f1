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
from _helpers import rounds
from gateway_helpers import WALL, gateway, get, ok_handler, rule
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolimit import FakeClock
from nanolimit.errors import ValidationError
from nanolimit.gateway.headers import (
    MAX_HEADER_SECONDS,
    deny_body,
    rate_headers,
    retry_seconds,
    rule_pieces,
)
from nanolimit.gateway.metrics import Metrics, _ShardedAdmitted
from nanolimit.gateway.middleware import Request

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


@settings(max_examples=rounds(200, 40), deadline=None)
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


# -- a burst rule's policy: q is the capacity (the burst), w the rule's window ---------------

# "100/minute burst 20": a request is measured against the burst, 20, so the
# policy says q=20;w=60 (docs/spec.md §2), not q=100. The refill is still 100
# a minute: one unit every 0.6 s, so after one request the key is full again
# in 0.6 s (t=1, X-RateLimit-Reset = ceil(WALL + 0.6)).
BURST_ADMITTED = {
    "X-RateLimit-Limit": "20",
    "X-RateLimit-Remaining": "19",
    "X-RateLimit-Reset": str(int(WALL) + 1),
    "RateLimit-Policy": '"api";q=20;w=60',
    "RateLimit": '"api";r=19;t=1',
}
# The 21st request at the same instant: none left, one unit back in 0.6 s,
# the bucket full again in 20 * 0.6 = 12 s.
BURST_DENIED = {
    "X-RateLimit-Limit": "20",
    "X-RateLimit-Remaining": "0",
    "X-RateLimit-Reset": str(int(WALL) + 12),
    "RateLimit-Policy": '"api";q=20;w=60',
    "RateLimit": '"api";r=0;t=12',
    "Retry-After": "1",
}


def _burst_rule(algorithm: str) -> Any:
    from nanolimit.gateway.rules import RateLimitRule

    return RateLimitRule.from_rate("api", "100/minute burst 20", algorithm=algorithm)


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_a_burst_rule_s_policy_on_the_pipeline(backend: types.SimpleNamespace, algorithm: str) -> None:
    mw = gateway(backend, [_burst_rule(algorithm)])
    first = mw(get(), ok_handler)
    assert first.status == 200
    assert {k: first.headers[k] for k in FIVE} == BURST_ADMITTED
    for _ in range(19):
        assert mw(get(), ok_handler).status == 200
    denied = mw(get(), ok_handler)
    assert denied.status == 429
    assert {k: denied.headers[k] for k in (*FIVE, "Retry-After")} == BURST_DENIED
    assert denied.json() == {"error": "rate_limit_exceeded", "rule": "api", "retry_after": 1}


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_a_burst_rule_s_policy_from_decision_headers(backend: types.SimpleNamespace, algorithm: str) -> None:
    cls = backend.limiters[algorithm]
    limiter = cls(100, 60.0, backend.InMemoryStorage(), rule="api", clock=backend.FakeClock(0.0), burst=20)
    first = limiter.allow("k")
    assert (first.limit, first.window) == (20, 60.0)
    assert first.headers(wall_now=WALL) == BURST_ADMITTED
    for _ in range(19):
        assert limiter.allow("k").allowed
    assert limiter.allow("k").headers(wall_now=WALL) == BURST_DENIED


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_a_burst_rule_s_policy_under_asgi_and_wsgi(backend: types.SimpleNamespace, algorithm: str) -> None:
    import asyncio

    import httpx

    from nanolimit.asgi import RateLimitMiddleware as ASGIMiddleware
    from nanolimit.wsgi import RateLimitMiddleware as WSGIMiddleware

    async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})

    async def over_asgi() -> list[httpx.Response]:
        app = ASGIMiddleware(asgi_app, core=gateway(backend, [_burst_rule(algorithm)]))
        transport = httpx.ASGITransport(app=app, client=("192.0.2.1", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            return [await http.get("/") for _ in range(21)]

    answers = asyncio.run(over_asgi())
    assert [r.status_code for r in answers] == [200] * 20 + [429]
    assert {k: answers[0].headers[k] for k in FIVE} == BURST_ADMITTED
    assert {k: answers[20].headers[k] for k in (*FIVE, "Retry-After")} == BURST_DENIED

    def wsgi_app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    wrapped = WSGIMiddleware(wsgi_app, core=gateway(backend, [_burst_rule(algorithm)]))
    seen: list[tuple[str, dict[str, str]]] = []

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        seen.append((status, dict(headers)))

    environ = {"REQUEST_METHOD": "GET", "PATH_INFO": "/", "REMOTE_ADDR": "192.0.2.1"}
    for _ in range(21):
        wrapped(dict(environ), start_response)
    assert [s for s, _ in seen] == ["200 OK"] * 20 + ["429 Too Many Requests"]
    assert {k: seen[0][1][k] for k in FIVE} == BURST_ADMITTED
    assert {k: seen[20][1][k] for k in (*FIVE, "Retry-After")} == BURST_DENIED


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_a_client_pacing_at_q_per_w_is_never_refused(backend: types.SimpleNamespace, algorithm: str) -> None:
    """The policy under-promises with a burst: q=20;w=60 for a rule that
    refills 100 a minute. A client that believes it (20 every 60 s, sent
    all at once at the start of each window: the worst pacing the policy
    allows) is never refused; nor is one that spreads them evenly."""
    clock = backend.FakeClock(0.0)
    mw = gateway(backend, [_burst_rule(algorithm)], clock)
    for _ in range(10):
        assert [mw(get(), ok_handler).status for _ in range(20)] == [200] * 20
        clock.advance(60.0)
    even = gateway(backend, [_burst_rule(algorithm)], backend.FakeClock(0.0))
    clock = even.factory.clock
    for _ in range(200):
        assert even(get(), ok_handler).status == 200
        clock.advance(3.0)
    for _ in range(500):  # and one every window / limit: the rule's 100 a minute
        assert even(get(), ok_handler).status == 200
        clock.advance(0.6)


@pytest.mark.parametrize("algorithm", ["token_bucket", "gcra"])
def test_no_more_than_q_in_any_w_seconds_is_never_refused(
    backend: types.SimpleNamespace, algorithm: str
) -> None:
    """The sliding reading of "q per w" as well: random times at which no 60 s
    span holds more than 20 requests (bursts at a window's end and the next
    one's start included) are all admitted."""
    import random

    rng = random.Random(20)
    clock = backend.FakeClock(0.0)
    mw = gateway(backend, [_burst_rule(algorithm)], clock)
    sent: list[float] = []
    now = 0.0
    while len(sent) < 2_000:
        now += rng.choice((0.0, 0.0, 0.001, 0.5, 3.0, 17.0))
        if sum(1 for t in sent[-20:] if t > now - 60.0) == 20:
            now = sent[-20] + 60.0  # the earliest time the 21st-last leaves the span
        clock.advance(now - clock.now())
        assert mw(get(), ok_handler).status == 200, (len(sent), now)
        sent.append(now)


def test_a_burst_above_the_limit_is_spent_once_not_per_window(backend: types.SimpleNamespace) -> None:
    """The boundary of that promise, as docs/gateway.md says: "10/minute
    burst 50" advertises q=50;w=60, a client can send 50 at once, but the
    bucket refills 10 a minute, so 50 a minute is not sustained."""
    from nanolimit.gateway.rules import RateLimitRule

    clock = backend.FakeClock(0.0)
    mw = gateway(backend, [RateLimitRule.from_rate("api", "10/minute burst 50")], clock)
    first = [mw(get(), ok_handler) for _ in range(50)]
    assert first[0].headers["RateLimit-Policy"] == '"api";q=50;w=60'
    assert {r.status for r in first} == {200}
    clock.advance(60.0)
    assert [mw(get(), ok_handler).status for _ in range(50)] == [200] * 10 + [429] * 40


@pytest.mark.native
def test_the_native_refusal_and_the_python_fallback_write_the_same_429_headers(
    backend: types.SimpleNamespace, native: types.ModuleType
) -> None:
    """A 429's six headers (the five and ``Retry-After``) and its retry
    seconds: the same bytes in C and in Python, the same inputs refused
    with nothing written, and nothing counted."""
    pieces = rule_pieces("r", 10, 2.5)
    metrics = Metrics()
    fast = native.AdmittedRequests("r")
    slow = _ShardedAdmitted(metrics, "r")
    for remaining, reset, wall in CASES:
        d = _decision(backend, remaining, reset)
        for retry_after in (0.0, 0.2, 1.0, 1.5, 59.999, 3600.0):
            got: dict[str, str] = {}
            want: dict[str, str] = {}
            assert (
                fast.refusal(d, got, *pieces, retry_after, wall)
                == slow.refusal(d, want, *pieces, retry_after, wall)
                == retry_seconds(retry_after)
            )
            expected = rate_headers(*pieces, remaining, reset, wall)
            expected["Retry-After"] = str(retry_seconds(retry_after))
            assert got == want == expected
            assert list(got) == [*FIVE, "Retry-After"]
    for retry_after in (math.nan, math.inf, 2.0**63):
        for lane in (fast, slow):
            headers: dict[str, str] = {}
            with pytest.raises(ValidationError):
                lane.refusal(_decision(backend, 0, 1.0), headers, *pieces, retry_after, 1e9)
            assert headers == {}
    for remaining, reset, wall in REFUSED:
        for lane in (fast, slow):
            headers = {}
            with pytest.raises(ValidationError):
                lane.refusal(_decision(backend, remaining, reset), headers, *pieces, 1.0, wall)
            assert headers == {}
    assert fast.allowed == 0 and metrics.snapshot() == {}  # a refusal counts nothing


def _asgi(headers: dict[str, str]) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in headers.items()]


@pytest.mark.native
def test_the_rule_lane_writes_what_the_renderer_writes(native: types.ModuleType) -> None:
    """``RuleLane.admit`` decides, counts and writes the headers in one call:
    the five headers ``rate_headers`` writes (and ``Retry-After`` on a
    denial) as a dict or as ASGI's lower-case bytes pairs, the 429 body
    ``deny_body`` writes, the counts in ``AdmittedRequests``; a wall clock
    no header holds is refused, as every writer refuses it."""
    from nanolimit.gateway.middleware import Outcome

    limiter = native.FixedWindowCounter(3, 2.5, clock=FakeClock(5.0), rule="r")
    pieces = rule_pieces("r", 3, 2.5)
    counts = native.AdmittedRequests("r")
    walls = [WALL, WALL + 0.25, -12.5, 0.0, 123.75, math.nan]
    read = iter(walls)
    lane = native.RuleLane(limiter, counts, Outcome, *pieces, 2.0, lambda: next(read))
    for i, wall in enumerate(walls[:-1]):  # three admitted, two denied
        outcome = lane.admit("k", i % 2 == 1)
        assert type(outcome) is Outcome and outcome.rule == "r" and outcome.delay == 0.0
        d = outcome.decision
        want = rate_headers(*pieces, d.remaining, d.reset_after, wall)
        assert outcome.allowed is d.allowed is (i < 3) and outcome.charge is None
        if not outcome.allowed:
            want["Retry-After"] = str(retry_seconds(d.retry_after))
            assert outcome.retry_after == retry_seconds(d.retry_after)
            assert lane.body(outcome.retry_after) == deny_body("r", outcome.retry_after) == outcome.body()
        assert outcome.headers == (_asgi(want) if i % 2 else want)
    assert (counts.allowed, counts.near_limit, counts.denied) == (3, 2, 2)
    with pytest.raises(ValidationError):
        lane.admit("other", False)  # the wall clock read NaN
    assert (counts.allowed, counts.denied) == (3, 2)  # refused: nothing counted
    assert native.rule_lane(object(), counts, Outcome, *pieces, 2.0) is None  # a Python limiter: no lane
    with pytest.raises(TypeError):
        native.RuleLane(limiter, counts, tuple, *pieces, 2.0)


@pytest.mark.native
def test_a_rule_lane_on_the_system_clock_reads_it_once_for_decision_and_headers(
    native: types.ModuleType,
) -> None:
    """With the wall clock left to the lane (``time.time``) and a limiter on
    ``SystemClock``, the Reset header is the decision's own clock reading
    plus its reset, rounded up."""
    import time

    from nanolimit.gateway.middleware import Outcome

    limiter = native.FixedWindowCounter(2, 3600.0, native.InMemoryStorage(), rule="r")
    lane = native.RuleLane(limiter, native.AdmittedRequests("r"), Outcome, *rule_pieces("r", 2, 3600.0), 0.0)
    before = time.time()
    outcome = lane.admit("k", False)
    after = time.time()
    reset = outcome.decision.reset_after
    assert math.ceil(before + reset) <= int(outcome.headers["X-RateLimit-Reset"]) <= math.ceil(after + reset)
    assert outcome.decision.at == pytest.approx(before, abs=after - before + 1e-3)


@pytest.mark.native
def test_a_charge_is_one_refund_at_most(native: types.ModuleType) -> None:
    """A ``count_when`` lane's Charge: a counted status keeps the charge, any
    other gives the unit back, and either settles it for good."""
    from nanolimit.gateway.middleware import Outcome

    clock = FakeClock(0.0)
    for storage in (native.InMemoryStorage(), None):
        limiter = native.FixedWindowCounter(2, 60.0, storage, clock=clock, rule="r")
        lane = native.RuleLane(
            limiter,
            native.AdmittedRequests("r"),
            Outcome,
            *rule_pieces("r", 2, 60.0),
            0.0,
            lambda: WALL,
            frozenset({401}),
        )
        first = lane.admit("k", False)
        assert first.charge.settle(401) == 0 and first.charge.settle(200) == 0  # counted, then settled
        second = lane.admit("k", False)
        assert second.headers["X-RateLimit-Remaining"] == "0"
        assert second.charge.settle(200) == 1 and second.charge.settle(200) == 0  # refunded once
        assert lane.admit("k", False).allowed and not lane.admit("k", False).allowed
    when = []
    lane = native.RuleLane(
        native.FixedWindowCounter(5, 60.0, clock=clock, rule="r"),
        native.AdmittedRequests("r"),
        Outcome,
        *rule_pieces("r", 5, 60.0),
        0.0,
        lambda: WALL,
        lambda status: when.append(status),
    )
    assert lane.admit("k", False).charge.settle(418) == 1 and when == [418]
