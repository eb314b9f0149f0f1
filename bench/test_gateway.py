"""Gateway costs: the framework-free middleware per request, the ASGI and
WSGI adapters' admitted path, ``rule_for`` with 1 vs 1,000 rules, and replay
throughput on the native batch path.

Each benchmarked call runs ``BATCH`` requests; read ``ns_per_request_median``
in ``extra_info`` (pytest-benchmark's time / ``BATCH``). Targets:
middleware ≤ 1.5 µs per request; ``rule_for`` with 1,000 rules within 2× of
1 rule; replay ≥ 5 M decisions/s after parsing.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest

from nanolimit import FakeClock, SystemClock, asgi, wsgi
from nanolimit import __main__ as cli
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.middleware import RateLimitPipeline, Request, Response
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import RateLimitRule

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
    mw = RateLimitPipeline(RuleRegistry([rule]), factory)
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


def _api_rule() -> RateLimitRule:
    return RateLimitRule("api", "*", "/api", "ip", "token_bucket", HIGH_LIMIT, 60.0)


def test_asgi_request(benchmark, twin: types.ModuleType) -> None:
    """The ASGI adapter's admitted path with a bare ASGI app: scope to
    Request, the decision, the headers encoded into ``http.response.start``.
    Nothing suspends, so each coroutine runs to the end on one ``send(None)``
    (no event loop in the timing)."""
    mw = asgi.RateLimitMiddleware(_app, RuleRegistry([_api_rule()]), LimiterFactory(twin.InMemoryStorage()))
    scopes = [
        {
            "type": "http",
            "method": "GET",
            "path": f"/api/items/{i % 50}",
            "root_path": "",
            "headers": [(b"host", b"example.com")],
            "client": (f"10.0.{i % 7}.{i % 100}", 40000 + i),
        }
        for i in range(BATCH)
    ]
    sent: list[Any] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: Any) -> None:
        sent.append(message)

    def loop() -> None:
        del sent[:]
        for scope in scopes:
            coro = mw(scope, receive, send)
            try:
                coro.send(None)
            except StopIteration:
                continue
            raise AssertionError("the admitted path suspended")

    benchmark(loop)
    assert len(sent) == 2 * BATCH and (b"x-ratelimit-limit", str(HIGH_LIMIT).encode()) in sent[0]["headers"]
    _per_request(benchmark, BATCH)


async def _app(scope: Any, receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


def test_wsgi_request(benchmark, twin: types.ModuleType) -> None:
    """The WSGI adapter's admitted path with a bare WSGI app: environ to
    Request, the decision, the headers appended in ``start_response``."""
    started: list[Any] = []

    def app(environ: dict[str, Any], start_response: Any) -> list[bytes]:
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    def start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
        started.append(headers)

    mw = wsgi.RateLimitMiddleware(app, RuleRegistry([_api_rule()]), LimiterFactory(twin.InMemoryStorage()))
    environs = [
        {
            "REQUEST_METHOD": "GET",
            "SCRIPT_NAME": "",
            "PATH_INFO": f"/api/items/{i % 50}",
            "REMOTE_ADDR": f"10.0.{i % 7}.{i % 100}",
            "HTTP_HOST": "example.com",
        }
        for i in range(BATCH)
    ]

    def loop() -> None:
        del started[:]
        for environ in environs:
            mw(environ, start_response)

    benchmark(loop)
    assert len(started) == BATCH and ("X-RateLimit-Limit", str(HIGH_LIMIT)) in started[0]
    _per_request(benchmark, BATCH)


def test_middleware_denied_request(benchmark, twin: types.ModuleType) -> None:
    """The 429 path (JSON body, Retry-After)."""
    rule = RateLimitRule("api", "*", "/", "ip", "token_bucket", 1, 3600.0)
    mw = RateLimitPipeline(RuleRegistry([rule]), LimiterFactory(twin.InMemoryStorage(), FakeClock(0.0)))
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
