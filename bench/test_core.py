"""Per-decision cost of the core: ``allow`` on a hot key and over 100,000 keys,
``allow_many`` over 100,000 keys, and bytes per key at 1,000,000 keys.

Each benchmarked call decides ``BATCH`` requests in a tight loop, so the
figure to read is ``ns/decision`` (pytest-benchmark's time / ``BATCH``,
written into ``extra_info``). ``test_loop_overhead`` measures the same loop
around a trivial C call: the part of each figure that is the loop itself.
"""

from __future__ import annotations

import gc
import resource
import types

import pytest

from nanolimit import SystemClock

BATCH = 1000
MANY_KEYS = 100_000
# Limits high enough that the hot-key cases measure the allowed path.
HIGH_LIMIT = 1 << 24


def _per_decision(benchmark, n: int) -> None:
    stats = benchmark.stats.stats if benchmark.stats else None
    if stats is not None:
        benchmark.extra_info["ns_per_decision_median"] = round(stats.median / n * 1e9, 1)
        benchmark.extra_info["ns_per_decision_min"] = round(stats.min / n * 1e9, 1)


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
    benchmark.pedantic(limiter.allow_many, args=(keys,), rounds=15, warmup_rounds=1)
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
