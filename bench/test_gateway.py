"""Gateway costs: the framework-free middleware per request, ``rule_for``
with 1 vs 1,000 rules, and replay throughput on the native batch path.

Each benchmarked call runs ``BATCH`` requests; read ``ns_per_request_median``
in ``extra_info`` (pytest-benchmark's time / ``BATCH``). Targets (issue 8):
middleware ≤ 1.5 µs per request; ``rule_for`` with 1,000 rules within 2× of
1 rule; replay ≥ 5 M decisions/s after parsing.
"""

from __future__ import annotations

import types
from pathlib import Path

import pytest

from nanolimit import FakeClock, SystemClock
from nanolimit import __main__ as cli
from nanolimit.factory import LimiterFactory
from nanolimit.middleware import RateLimitMiddleware, Request, Response
from nanolimit.rules import RateLimitRule, RuleRegistry

BATCH = 1000
HIGH_LIMIT = 1 << 24
REPLAY_N = 1 << 16


def _per_request(benchmark, n: int, key: str = "ns_per_request") -> None:
    stats = benchmark.stats.stats if benchmark.stats else None
    if stats is not None:
        benchmark.extra_info[f"{key}_median"] = round(stats.median / n * 1e9, 1)
        benchmark.extra_info[f"{key}_min"] = round(stats.min / n * 1e9, 1)


def _rules(n: int) -> list[RateLimitRule]:
    """``n`` rules over 40 services, as a large API's ruleset looks."""
    rules = [
        RateLimitRule(
            f"r{i}",
            ("GET", "POST", "*")[i % 3],
            f"/svc{i % 40}/res{i}",
            "ip",
            "token_bucket",
            HIGH_LIMIT,
            60.0,
        )
        for i in range(n - 1)
    ]
    rules.append(RateLimitRule("api", "*", "/svc7", "ip", "token_bucket", HIGH_LIMIT, 60.0))
    return rules


@pytest.mark.parametrize("scope", ["ip", "user"])
def test_middleware_request(benchmark, twin: types.ModuleType, scope: str) -> None:
    """The whole path: rule lookup, key, decision, metrics, headers, response."""
    rule = RateLimitRule("api", "*", "/api", scope, "token_bucket", HIGH_LIMIT, 60.0)
    factory = LimiterFactory(twin.InMemoryStorage(), SystemClock())
    mw = RateLimitMiddleware(RuleRegistry([rule]), factory)
    requests = [
        Request("GET", f"/api/items/{i % 50}", {}, f"10.0.{i % 7}.{i % 100}", user=f"u{i % 100}")
        for i in range(BATCH)
    ]
    response = Response(200, {}, b"")

    def handler(_request: Request) -> Response:
        return response

    def loop() -> None:
        for request in requests:
            mw(request, handler)

    benchmark(loop)
    assert mw.metrics.snapshot()["api"]["allowed"] > 0
    _per_request(benchmark, BATCH)


def test_middleware_denied_request(benchmark, twin: types.ModuleType) -> None:
    """The 429 path (JSON body, Retry-After)."""
    rule = RateLimitRule("api", "*", "/", "ip", "token_bucket", 1, 3600.0)
    mw = RateLimitMiddleware(RuleRegistry([rule]), LimiterFactory(twin.InMemoryStorage(), FakeClock(0.0)))
    request = Request("GET", "/x", {}, "10.0.0.1")
    response = Response(200, {}, b"")
    mw(request, lambda _r: response)

    def loop() -> None:
        for _ in range(BATCH):
            mw(request, lambda _r: response)

    benchmark(loop)
    _per_request(benchmark, BATCH)


@pytest.mark.parametrize("cached", [True, False], ids=["cached", "uncached"])
@pytest.mark.parametrize("n_rules", [1, 1000])
def test_rule_for(benchmark, n_rules: int, cached: bool) -> None:
    """Compare n_rules=1000 with n_rules=1: the index keeps them within 2x."""
    registry = RuleRegistry(_rules(n_rules), cache_size=4096 if cached else 0)
    paths = [f"/svc7/res{(i * 40 + 7) % max(n_rules, 1)}/items/{i}" for i in range(BATCH)]
    rule_for = registry.rule_for

    def loop() -> None:
        for path in paths:
            rule_for("GET", path)

    benchmark(loop)
    _per_request(benchmark, BATCH, "ns_per_lookup")


def test_replay_batch_decisions(benchmark, twin: types.ModuleType) -> None:
    """``allow_many(..., times=...)`` as replay calls it: 64k requests over
    ~10k keys, the time list built outside the timed call."""
    limiter = twin.SlidingWindowCounter(100, 60.0, twin.InMemoryStorage(), FakeClock(0.0))
    keys = [f"10.0.{i % 100}.{i % 97}" for i in range(REPLAY_N)]
    start = [1_700_000_000.0]

    def setup() -> tuple[tuple[list[str]], dict[str, list[float]]]:
        t0 = start[0]
        start[0] += 120.0
        return (keys,), {"times": [t0 + i * 0.001 for i in range(REPLAY_N)]}

    rounds = 15 if twin.__name__.endswith("_core") else 3
    benchmark.pedantic(limiter.allow_many, setup=setup, rounds=rounds, iterations=1)
    _per_request(benchmark, REPLAY_N, "ns_per_decision")
    stats = benchmark.stats.stats if benchmark.stats else None
    if stats is not None:
        benchmark.extra_info["decisions_per_second_median"] = round(REPLAY_N / stats.median)


def test_replay_cli_end_to_end(benchmark, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``nanolimit replay`` over a 200,000-line file, parsing included."""
    trace = tmp_path / "trace.csv"
    n = 200_000
    with trace.open("w") as f:
        f.write("timestamp,key\n")
        for i in range(n):
            f.write(f"{1_700_000_000 + i * 0.002:.3f},10.0.{i % 50}.{i % 199}\n")

    def run() -> None:
        assert (
            cli.main(
                [
                    "replay",
                    str(trace),
                    "--rule",
                    "100/minute",
                    "--algorithm",
                    "sliding_counter",
                    "--no-progress",
                    "--json",
                ]
            )
            == 0
        )
        capsys.readouterr()

    benchmark.pedantic(run, rounds=3, iterations=1)
    _per_request(benchmark, n, "ns_per_line")
