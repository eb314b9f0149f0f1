"""Per-decision cost of the core, for both twins and all six algorithms:
``allow`` on a hot key (allowed and denied), over 100,000 and 1,000,000 keys,
with a fresh key string per request, with a cost above 1; ``peek``;
``allow_many`` over 100,000 keys; and bytes per key at 1,000,000 keys.

Each benchmarked call decides ``BATCH`` requests in a tight loop, so the
figure to read is ``ns/decision`` (pytest-benchmark's time / ``BATCH``,
written into ``extra_info``). ``test_loop_overhead`` measures the same loop
around a trivial C call: the part of each figure that is the loop itself.
"""

from __future__ import annotations

import gc
import resource
import time
import types
from collections.abc import Callable
from typing import Any

import pytest

from nanolimit import SystemClock

BATCH = 1000
MANY_KEYS = 100_000
MILLION = 1_000_000
COST = 5
# Limits high enough that the hot-key cases measure the allowed path.
HIGH_LIMIT = 1 << 24
# Each case times about this long, so ``pytest bench --benchmark-only`` over
# every twin, algorithm and scenario stays within a few minutes.
CASE_SECONDS = 0.2

# A short warm-up per case: without it the first case of a run (token bucket,
# hot key) read ~20 % slow, the process still settling.
pytestmark = pytest.mark.benchmark(max_time=CASE_SECONDS, min_rounds=3, warmup=True, warmup_iterations=200)


def _per_decision(benchmark, n: int) -> None:
    stats = benchmark.stats.stats if benchmark.stats else None
    if stats is not None:
        benchmark.extra_info["ns_per_decision_median"] = round(stats.median / n * 1e9, 1)
        benchmark.extra_info["ns_per_decision_min"] = round(stats.min / n * 1e9, 1)


def _rounds(once: Callable[[], Any], cap: int = 200) -> int:
    """Rounds that fill about ``CASE_SECONDS``, from one timed call (pedantic
    cases, which have no ``max_time`` of their own)."""
    t0 = time.perf_counter()
    once()
    return max(3, min(cap, int(CASE_SECONDS / max(time.perf_counter() - t0, 1e-9))))


def test_loop_overhead(benchmark) -> None:
    keys = [f"user:{i}" for i in range(BATCH)]

    def loop() -> None:
        f = len
        for k in keys:
            f(k)

    benchmark(loop)
    _per_decision(benchmark, BATCH)


def test_allow_hot_key(benchmark, limiter_type: type) -> None:
    limiter = limiter_type(HIGH_LIMIT, 1.0, clock=SystemClock())
    allow = limiter.allow
    keys = ["user:42"] * BATCH

    def loop() -> None:
        for k in keys:
            allow(k)

    benchmark(loop)
    _per_decision(benchmark, BATCH)


def test_allow_100k_keys(benchmark, limiter_type: type) -> None:
    limiter = limiter_type(HIGH_LIMIT, 1.0, clock=SystemClock())
    allow = limiter.allow
    keys = [f"user:{i}" for i in range(MANY_KEYS)]
    limiter.allow_many(keys)  # the table holds every key before timing
    cursor = [0]

    def loop() -> None:
        start = cursor[0]
        for k in keys[start : start + BATCH]:
            allow(k)
        cursor[0] = (start + BATCH) % MANY_KEYS

    benchmark(loop)
    _per_decision(benchmark, BATCH)


def test_allow_many_100k_keys(benchmark, limiter_type: type) -> None:
    limiter = limiter_type(HIGH_LIMIT, 1.0, clock=SystemClock())
    keys = [f"user:{i}" for i in range(MANY_KEYS)]
    limiter.allow_many(keys)
    # 15 rounds for the native twin; the reference takes ~0.5 s a round
    rounds = _rounds(lambda: limiter.allow_many(keys), cap=15)
    benchmark.pedantic(limiter.allow_many, args=(keys,), rounds=rounds, warmup_rounds=1)
    _per_decision(benchmark, MANY_KEYS)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


@pytest.mark.parametrize("name", ["TokenBucket", "FixedWindowCounter", "GCRA"])
def test_bytes_per_key_1m(benchmark, twin: types.ModuleType, name: str) -> None:
    """Memory per key at 1,000,000 keys of 16 bytes each: the storage's own
    count (``memory_bytes``) and the process's resident-set growth."""
    keys = [f"user:{i:011d}" for i in range(1_000_000)]  # 16 bytes each
    gc.collect()
    before = _rss_bytes()
    storage = twin.InMemoryStorage()
    limiter = getattr(twin, name)(100, 60.0, storage=storage)

    def fill() -> None:
        limiter.allow_many(keys)

    benchmark.pedantic(fill, rounds=1, iterations=1)
    after = _rss_bytes()
    assert len(storage) == len(keys)
    benchmark.extra_info["bytes_per_key_storage"] = round(storage.memory_bytes() / len(keys), 1)
    benchmark.extra_info["bytes_per_key_rss"] = round((after - before) / len(keys), 1)


def test_allow_hot_key_denied(benchmark, limiter_type: type) -> None:
    """The denied path: one unit per hour, spent before timing starts. A
    gateway under attack spends most of its time here, so it must be as
    cheap as the allowed path."""
    limiter = limiter_type(1, 3600.0, clock=SystemClock())
    allow = limiter.allow
    assert allow("user:42").allowed
    keys = ["user:42"] * BATCH

    def loop() -> None:
        for k in keys:
            allow(k)

    benchmark(loop)
    assert not allow("user:42").allowed
    _per_decision(benchmark, BATCH)


_million: list[str] = []


def _million_keys() -> list[str]:
    """Built once per session: 1,000,000 keys of 16 bytes or less."""
    if not _million:
        _million.extend(f"user:{i}" for i in range(MILLION))
    return _million


def test_allow_1m_keys(benchmark, limiter_type: type) -> None:
    """Round-robin over a million stored keys: the table no longer fits in
    cache, so this is the probe and the memory latency, not the kernel."""
    limiter = limiter_type(HIGH_LIMIT, 1.0, clock=SystemClock())
    allow = limiter.allow
    keys = _million_keys()
    for i in range(0, MILLION, MANY_KEYS):
        limiter.allow_many(keys[i : i + MANY_KEYS])
    cursor = [0]

    def loop() -> None:
        start = cursor[0]
        for k in keys[start : start + BATCH]:
            allow(k)
        cursor[0] = (start + BATCH) % MILLION

    benchmark(loop)
    _per_decision(benchmark, BATCH)


def test_allow_fresh_key(benchmark, limiter_type: type) -> None:
    """What a gateway really sees: each request's key is a str built from the
    request, never hashed before. The strings of a round are created in the
    setup, just before it, and never reused, so no hash is cached."""
    limiter = limiter_type(HIGH_LIMIT, 1.0, clock=SystemClock())
    allow = limiter.allow
    limiter.allow_many([f"user:{i}" for i in range(MANY_KEYS)])
    cursor = [0]

    def fresh() -> tuple[tuple[list[str]], dict[str, Any]]:
        start = cursor[0]
        cursor[0] = (start + BATCH) % MANY_KEYS
        return ([f"user:{i}" for i in range(start, start + BATCH)],), {}

    def loop(keys: list[str]) -> None:
        for k in keys:
            allow(k)

    rounds = _rounds(lambda: loop(fresh()[0][0]))
    benchmark.pedantic(loop, setup=fresh, rounds=rounds, warmup_rounds=1)
    assert allow(f"user:{cursor[0]}").allowed
    _per_decision(benchmark, BATCH)


def test_allow_cost(benchmark, limiter_type: type) -> None:
    """``allow(key, cost=5)`` on a hot key: the sliding log writes five entries."""
    limiter = limiter_type(HIGH_LIMIT, 1.0, clock=SystemClock())
    allow = limiter.allow
    keys = ["user:42"] * BATCH

    def loop() -> None:
        for k in keys:
            allow(k, COST)

    benchmark(loop)
    assert allow("user:42", COST).allowed
    _per_decision(benchmark, BATCH)


def test_peek_hot_key(benchmark, limiter_type: type) -> None:
    """``peek`` decides without spending: the same kernel, no write back."""
    limiter = limiter_type(HIGH_LIMIT, 1.0, clock=SystemClock())
    limiter.allow("user:42")
    peek = limiter.peek
    keys = ["user:42"] * BATCH

    def loop() -> None:
        for k in keys:
            peek(k)

    benchmark(loop)
    assert peek("user:42").allowed
    _per_decision(benchmark, BATCH)
