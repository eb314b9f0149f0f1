"""``nanolimit demo``: the reference scenarios of docs/spec.md §7, replayed through
the real framework-free gateway middleware (rules, keys, limiter, metrics,
headers) on the in-memory default store with a fake clock. It prints what
each request got, so a new user sees the whole contract in one screen, and
exits non-zero if any answer differs from the spec: the demo is also a smoke
test of an installation.
"""

from __future__ import annotations

import json
import threading

import nanolimit
from nanolimit import FakeClock, InMemoryStorage

from .._limiter_config import Algorithm
from ..gateway.factory import LimiterFactory
from ..gateway.middleware import RateLimitPipeline, Request, Response
from ..gateway.registry import RuleRegistry
from ..gateway.rules import KeyScope, RateLimitRule

WALL = 1_700_000_000.0
ALGORITHM_ORDER = (
    ("TokenBucket", Algorithm.TOKEN_BUCKET),
    ("LeakyBucket", Algorithm.LEAKY_BUCKET),
    ("FixedWindowCounter", Algorithm.FIXED_WINDOW),
    ("SlidingWindowLog", Algorithm.SLIDING_LOG),
    ("SlidingWindowCounter", Algorithm.SLIDING_COUNTER),
    ("GCRA", Algorithm.GCRA),
)


def _gateway(
    algorithm: Algorithm, limit: int, window: float, clock: FakeClock, name: str = "demo"
) -> RateLimitPipeline:
    """One rule on ``/`` per client IP, on a fresh in-memory store: the
    middleware a gateway would run, with the clocks pinned."""
    rule = RateLimitRule(name, "*", "/", KeyScope.IP, algorithm, limit, window)
    factory = LimiterFactory(InMemoryStorage(), clock)
    return RateLimitPipeline(RuleRegistry([rule]), factory, wall_clock=lambda: WALL, sleep=lambda _s: None)


def _ok(_request: Request) -> Response:
    return Response(200, {"Content-Type": "text/plain"}, b"ok")


def _get(client: str = "192.0.2.1") -> Request:
    return Request("GET", "/orders", {}, client)


def _scenario_token_bucket_429() -> tuple[bool, list[str]]:
    gateway = _gateway(Algorithm.TOKEN_BUCKET, 5, 60.0, FakeClock(0.0))
    responses = [gateway(_get(), _ok) for _ in range(7)]
    statuses = [r.status for r in responses]
    last = responses[-1]
    body = last.json()
    lines = [
        "1. token bucket, 5 per 60 s, 7 requests at once through the middleware",
        f"   statuses {statuses}",
        "   429 headers: " + json.dumps(last.headers),
        "   429 body: " + last.body.decode(),
    ]
    counts = gateway.metrics.snapshot().get("demo", {})
    ok = (
        statuses == [200] * 5 + [429] * 2
        and last.headers.get("Retry-After") == "12"
        and last.headers.get("X-RateLimit-Remaining") == "0"
        and body == {"error": "rate_limit_exceeded", "rule": "demo", "retry_after": 12}
        and counts.get("allowed") == 5
        and counts.get("denied") == 2
    )
    return ok, lines


def _scenario_five_per_second() -> tuple[bool, list[str]]:
    lines = ["2. limit 5 per second, 7 requests at t = 0"]
    expected_retry = {
        Algorithm.TOKEN_BUCKET: 0.2,
        Algorithm.LEAKY_BUCKET: 0.2,
        Algorithm.GCRA: 0.2,
        Algorithm.FIXED_WINDOW: 1.0,
        Algorithm.SLIDING_LOG: 1.0,
        Algorithm.SLIDING_COUNTER: 1.0,
    }
    ok = True
    for label, algorithm in ALGORITHM_ORDER:
        gateway = _gateway(algorithm, 5, 1.0, FakeClock(0.0))
        outcomes = [gateway.check(_get()) for _ in range(7)]
        admitted = sum(1 for o in outcomes if o is not None and o.allowed)
        sixth = outcomes[5]
        retry = sixth.decision.retry_after if sixth is not None else float("nan")
        header = sixth.headers.get("Retry-After") if sixth is not None else None
        ok &= admitted == 5 and abs(retry - expected_retry[algorithm]) < 1e-9 and header == "1"
        lines.append(
            f"   {label:<22} allowed {admitted}, 6th retry_after {retry:.3f} s (Retry-After: {header})"
        )
    return ok, lines


def _scenario_boundary_burst() -> tuple[bool, list[str]]:
    lines = ["3. boundary burst, 5 per second: 5 at t=1,000,000.9 and 5 at t=1,000,001.0"]
    ok = True
    for label, algorithm, expected in (
        ("FixedWindowCounter", Algorithm.FIXED_WINDOW, (5, 5)),
        ("SlidingWindowCounter", Algorithm.SLIDING_COUNTER, (5, 0)),
    ):
        clock = FakeClock(1_000_000.9)
        gateway = _gateway(algorithm, 5, 1.0, clock)
        first = sum(gateway(_get(), _ok).status == 200 for _ in range(5))
        clock.set(1_000_001.0)
        second = sum(gateway(_get(), _ok).status == 200 for _ in range(5))
        ok &= (first, second) == expected
        lines.append(f"   {label:<22} allowed {first} then {second}")
    return ok, lines


def _scenario_threads() -> tuple[bool, list[str]]:
    lines = ["4. 8 threads x 50 requests, one client, frozen clock, capacity 100"]
    ok = True
    for label, algorithm in ALGORITHM_ORDER:
        gateway = _gateway(algorithm, 100, 60.0, FakeClock(0.0))
        counts = [0] * 8
        barrier = threading.Barrier(8)

        def work(
            slot: int,
            gateway: RateLimitPipeline = gateway,
            barrier: threading.Barrier = barrier,
            counts: list[int] = counts,
        ) -> None:
            barrier.wait()
            counts[slot] = sum(gateway(_get(), _ok).status == 200 for _ in range(50))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        snap = gateway.metrics.snapshot()["demo"]
        ok &= sum(counts) == 100 and snap["allowed"] == 100 and snap["denied"] == 300
        lines.append(f"   {label:<22} allowed {sum(counts)} of 400 (metrics: {snap['allowed']} allowed)")
    return ok, lines


def demo() -> int:
    print(
        f"nanolimit {nanolimit.__version__} ({nanolimit.IMPLEMENTATION} core), "
        "docs/spec.md §7 scenarios through the gateway middleware\n"
    )
    all_ok = True
    for scenario in (
        _scenario_token_bucket_429,
        _scenario_five_per_second,
        _scenario_boundary_burst,
        _scenario_threads,
    ):
        ok, lines = scenario()
        all_ok &= ok
        print("\n".join(lines))
        print("   -> " + ("as specified" if ok else "DIFFERS FROM THE SPEC") + "\n")
    return 0 if all_ok else 1
