"""Two-tier cost, side by side in one run: ``limiter.allow`` on an
``InMemoryStorage`` (the baseline) and on a ``TwoTierStorage`` whose sync
thread runs against a throwaway loopback Redis, for the three supported
algorithms and both twins; a hot key and 10,000 keys round-robin.

Target: a local decision ≤ 1.5 × the in-memory ``allow()`` (native
twin: the limiter decides against the lease in C); Redis round trips per
decision ≤ 0.01. ``extra_info`` holds ``ns_median``, ``ratio_to_in_memory``
and, for two-tier cases, ``redis_round_trips_per_decision`` (syncs, each one
pipeline, over the decisions the storage counted).
"""

from __future__ import annotations

import itertools
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis_servers import Server, find_binary

from nanolimit.storage.two_tier import TwoTierStorage

pytestmark = pytest.mark.benchmark(max_time=0.5, min_rounds=5)

HIGH_LIMIT = 1 << 30  # never denied during a run: the allowed path
KEYS = [f"user:{i}" for i in range(10_000)]
CLASSES = ["FixedWindowCounter", "SlidingWindowCounter", "TokenBucket"]
_BASELINE: dict[tuple[str, str, str], float] = {}


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    binary = find_binary("redis")
    if binary is None:
        pytest.skip("!!! redis-server not found: two-tier benchmarks NOT run !!!")
    srv = Server(binary, "redis")
    srv.start()
    yield srv
    srv.stop()


def _cycle_allow(limiter: Any, scenario: str) -> Any:
    if scenario == "hot":
        return lambda: limiter.allow("user:42")
    keys = itertools.cycle(KEYS)
    return lambda: limiter.allow(next(keys))


def _median_ns(benchmark: Any) -> float | None:
    stats = benchmark.stats.stats if benchmark.stats else None
    return None if stats is None else stats.median * 1e9


@pytest.mark.parametrize("scenario", ["hot", "10k_keys"])
@pytest.mark.parametrize("cls", CLASSES)
def test_in_memory(benchmark: Any, twin: types.ModuleType, cls: str, scenario: str) -> None:
    """The baseline: the same limiter on the in-memory default."""
    limiter = getattr(twin, cls)(HIGH_LIMIT, 60.0, twin.InMemoryStorage())
    call = _cycle_allow(limiter, scenario)
    assert call().allowed
    benchmark(call)
    median = _median_ns(benchmark)
    if median is not None:
        _BASELINE[(twin.IMPLEMENTATION, cls, scenario)] = median
        benchmark.extra_info["ns_median"] = round(median, 1)


@pytest.mark.parametrize("scenario", ["hot", "10k_keys"])
@pytest.mark.parametrize("cls", CLASSES)
def test_two_tier(benchmark: Any, server: Server, twin: types.ModuleType, cls: str, scenario: str) -> None:
    """A local decision, the sync thread running (one pipeline per 50 ms)."""
    tier = TwoTierStorage(None, server.client(), instance_id=f"bench-{twin.IMPLEMENTATION}-{cls}")
    try:
        limiter = getattr(twin, cls)(HIGH_LIMIT, 60.0, tier)
        call = _cycle_allow(limiter, scenario)
        if scenario != "hot":
            for key in KEYS:  # every key tracked and leased before timing
                limiter.allow(key)
            tier.sync_now()
        assert call().allowed
        before = tier.metrics()
        benchmark(call)
        after = tier.metrics()
    finally:
        tier.close()
    decisions = after["decisions"] - before["decisions"]
    trips = after["syncs"] - before["syncs"]  # one pipeline each, early ones included
    assert after["partition"] is False
    benchmark.extra_info["redis_round_trips_per_decision"] = trips / max(1, decisions)
    benchmark.extra_info["decided_in_c"] = after["decisions_native"] - before["decisions_native"]
    median = _median_ns(benchmark)
    if median is not None:
        benchmark.extra_info["ns_median"] = round(median, 1)
        base = _BASELINE.get((twin.IMPLEMENTATION, cls, scenario))
        if base is not None:
            benchmark.extra_info["ratio_to_in_memory"] = round(median / base, 3)
