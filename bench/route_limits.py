"""What route limits, counting by response and denials cost, in process.

    python bench/route_limits.py            # 41 rounds of 20,000 calls per variant
    python bench/route_limits.py --quick    # a smoke run

Variants, interleaved round by round, medians of the rounds' ns per call:

- ``plain``: the pipeline's ``check`` on one prefix rule, admitted;
- ``counted``: the same rule with ``count_when={401}``, ``check`` then
  ``settle(outcome, 401)`` (the charge stands);
- ``counted_refund``: the same, settled with 200 (the charge is refunded:
  the dearest case of counting by response);
- ``denied``: ``check`` of an exhausted key (a 429);
- ``asgi_bare`` / ``asgi_prefix`` / ``asgi_route``: one Starlette app
  alone (the floor), and behind the ASGI middleware with a prefix rule or
  the same limit declared on the route with ``RouteLimits`` (the route
  cache answers both; the app's own routing is the same in all three).

The targets: counting by response within 1.2x plain counting;
a 429 at least as fast as an admitted request; a route-level declaration
no slower than the middleware path.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from nanolimit import InMemoryStorage, LimiterFactory, RuleRegistry
from nanolimit.asgi import RateLimitMiddleware as ASGIMiddleware
from nanolimit.gateway.middleware import RateLimitPipeline, Request
from nanolimit.gateway.routes import RouteLimits
from nanolimit.gateway.rules import RateLimitRule

HUGE = 1 << 30


def _pipeline(**kw: Any) -> RateLimitPipeline:
    rule = RateLimitRule("api", "*", "/", "ip", "fixed_window", kw.pop("limit", HUGE), 3600.0, **kw)
    return RateLimitPipeline(RuleRegistry([rule]), LimiterFactory(InMemoryStorage()), log_denials=None)


def _drive(coro: Any) -> None:
    with contextlib.suppress(StopIteration):
        coro.send(None)


def variants() -> dict[str, Callable[[], Any]]:
    request = Request("GET", "/x", client="192.0.2.1")
    plain = _pipeline()
    counted = _pipeline(count_when={401})
    denied = _pipeline(limit=1)
    denied.check(request)

    def counted_call() -> None:
        counted.settle(counted.check(request), 401)

    def refund_call() -> None:
        counted.settle(counted.check(request), 200)

    async def page(r: Any) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def receive() -> dict[str, Any]:
        return {"type": "http.request"}

    async def send(message: Any) -> None:
        pass

    def asgi(limits: RouteLimits | None, bare: bool = False) -> Callable[[], None]:
        app = Starlette(routes=[Route("/items/{id}", page)])
        mw: Any
        if bare:
            mw = app
        elif limits is None:
            registry = RuleRegistry([RateLimitRule("api", "*", "/items", "ip", "fixed_window", HUGE, 3600.0)])
            mw = ASGIMiddleware(app, registry, LimiterFactory(InMemoryStorage()))
        else:
            mw = ASGIMiddleware(app, limits=limits, factory=LimiterFactory(InMemoryStorage()))
        scope = {
            "type": "http",
            "method": "GET",
            "path": "/items/7",
            "root_path": "",
            "headers": [],
            "query_string": b"",
            "client": ("192.0.2.1", 1),
            "app": app,
        }

        def call() -> None:
            _drive(mw(dict(scope), receive, send))

        return call

    limits = RouteLimits(algorithm="fixed_window")
    limits.limit(f"{HUGE}/hour")(page)
    return {
        "plain": lambda: plain.check(request),
        "counted": counted_call,
        "counted_refund": refund_call,
        "denied": lambda: denied.check(request),
        "asgi_bare": asgi(None, bare=True),
        "asgi_prefix": asgi(None),
        "asgi_route": asgi(limits),
    }


def measure(rounds: int, calls: int) -> dict[str, float]:
    cases = variants()
    for fn in cases.values():
        for _ in range(200):
            fn()  # warm: route caches, bindings
    times: dict[str, list[float]] = {name: [] for name in cases}
    gc.disable()
    try:
        for _ in range(rounds):
            for name, fn in cases.items():
                start = time.perf_counter_ns()
                for _ in range(calls):
                    fn()
                times[name].append((time.perf_counter_ns() - start) / calls)
    finally:
        gc.enable()
    return {name: statistics.median(values) for name, values in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args(argv)
    rounds, calls = (3, 500) if args.quick else (41, 20_000)
    m = measure(rounds, calls)
    print(f"| variant | ns/call (median of {rounds} rounds of {calls:,}) | ratio |")
    print("| --- | ---: | ---: |")
    for name, ns in m.items():
        base = m["asgi_prefix"] if name.startswith("asgi") else m["plain"]
        print(f"| {name} | {ns:,.0f} | {ns / base:.2f} |")
    floor = m["asgi_bare"]
    prefix, route = m["asgi_prefix"] - floor, m["asgi_route"] - floor
    print(f"\nover the bare app: prefix {prefix:+,.0f} ns, route {route:+,.0f} ns")
    return 0


if __name__ == "__main__":
    sys.exit(main())
