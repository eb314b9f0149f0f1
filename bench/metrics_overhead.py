"""What exporting the metrics costs the request path: ns per
``RateLimitPipeline.check`` without a Collector, and with the Metrics
registered on a ``prometheus_client`` registry (its store watched too) while
another thread scrapes it every 100 ms.

The two conditions alternate round by round on one middleware, in ABBA
order (so the process's warm-up and the machine's drift fall on both
alike); each
round decides for ``ROUND_SECONDS`` and the medians over the rounds are
printed, of wall time (what a request waits, the scrapes' hold on the GIL
included) and of the deciding thread's own CPU time (what a check itself
costs). On a loaded machine the wall figures wander: read them over many
rounds. Usage: python bench/metrics_overhead.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import threading
import time

from prometheus_client import CollectorRegistry, generate_latest

import nanolimit
from nanolimit import LimiterFactory, RateLimitPipeline, RateLimitRule, Request, RuleRegistry, SystemClock

ROUND_SECONDS = 0.25
BATCH = 1000
SCRAPE_EVERY = 0.1
HIGH_LIMIT = 1 << 24


def build() -> tuple[RateLimitPipeline, list[Request], nanolimit.InMemoryStorage]:
    store = nanolimit.InMemoryStorage()
    rule = RateLimitRule("api", "*", "/api", "ip", "token_bucket", HIGH_LIMIT, 60.0)
    mw = RateLimitPipeline(RuleRegistry([rule]), LimiterFactory(store, SystemClock()))
    requests = [Request("GET", f"/api/items/{i % 50}", {}, f"10.0.{i % 7}.{i % 100}") for i in range(BATCH)]
    return mw, requests, store


def decide(mw: RateLimitPipeline, requests: list[Request]) -> tuple[float, float]:
    """(wall, this thread's CPU) ns per check over one round."""
    check = mw.check
    n = 0
    start, cpu = time.perf_counter(), time.thread_time()
    deadline = start + ROUND_SECONDS
    while True:
        for request in requests:
            check(request)
        n += len(requests)
        now = time.perf_counter()
        if now >= deadline:
            return (now - start) / n * 1e9, (time.thread_time() - cpu) / n * 1e9


def exported_round(
    mw: RateLimitPipeline, requests: list[Request], store: object
) -> tuple[tuple[float, float], int]:
    """One round with the Collector registered and scraped: ns per check, scrapes."""
    registry = CollectorRegistry()
    mw.metrics.watch_storage(store, name="memory")
    registry.register(mw.metrics)
    stop = threading.Event()
    scrapes = 0

    def scraper() -> None:
        nonlocal scrapes
        while not stop.is_set():
            generate_latest(registry)
            scrapes += 1
            stop.wait(SCRAPE_EVERY)

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    try:
        ns = decide(mw, requests)
    finally:
        stop.set()
        thread.join()
        registry.unregister(mw.metrics)
        mw.metrics.unwatch_storage(store)
    return ns, scrapes


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 20
    mw, requests, store = build()
    decide(mw, requests)  # warm: the route cache, the keys, the shards
    plain: list[tuple[float, float]] = []
    exported: list[tuple[float, float]] = []
    scrapes = 0
    for i in range(rounds):
        if i % 2:  # ABBA: a drift of the machine falls on both conditions alike
            plain.append(decide(mw, requests))
        ns, n = exported_round(mw, requests, store)
        exported.append(ns)
        scrapes += n
        if not i % 2:
            plain.append(decide(mw, requests))
    registry = CollectorRegistry()
    mw.metrics.watch_storage(store, name="memory")
    registry.register(mw.metrics)
    start = time.perf_counter()
    for _ in range(100):
        generate_latest(registry)
    scrape_us = (time.perf_counter() - start) / 100 * 1e6
    print(f"nanolimit {nanolimit.__version__} ({nanolimit.IMPLEMENTATION}), Python {sys.version.split()[0]}")
    print(f"{rounds} interleaved rounds of {ROUND_SECONDS} s, {scrapes} scrapes in the exported rounds")
    print(f"one scrape (generate_latest, one rule, one store): {scrape_us:.0f} us")
    print("RateLimitPipeline.check, ns (median)      wall      CPU")
    for label, column in (("no Collector", plain), ("Collector, scraped every 100 ms", exported)):
        wall = statistics.median(w for w, _ in column)
        cpu = statistics.median(c for _, c in column)
        print(f"  {label:<38} {wall:8.1f} {cpu:8.1f}")


if __name__ == "__main__":
    main()
