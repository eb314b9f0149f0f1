"""The shared-memory zone (``SharedMemoryStorage``) next to ``InMemoryStorage``,
side by side in one run: ``allow()`` on a hot key (all six algorithms) and
round-robin over 100,000 stored keys (all six), ``allow_many`` over 1,000 keys
(all six) and over 100,000 keys (token bucket), one decision on a loopback
Redis (the zone's reason to exist: a budget shared by every worker process,
without a round trip), and bytes per key at 1,000,000 keys.

``test_paired`` gives the same ratios with the two cells alternated round
by round, which this VM's drifting speed does not skew; the separate cases
show each side in pytest-benchmark's table.

The cells are ``nanolimit bench``'s (:mod:`nanolimit.cli.bench`: the in-memory
``nanolimit`` subject and the ``nanolimit-zone`` one, whose zone is a fresh
segment per cell, unlinked when it closes), so the suite and the CLI time the
same calls. Each pair runs in-memory first, then zone, and the zone's
``extra_info`` holds ``zone_over_memory``, its median over the in-memory one
measured seconds before. The Redis case's ``redis_over_zone`` is the Redis
decision's median over the zone's hot-key token-bucket one (target: ≥ 300).

Multi-process throughput is ``bench/zone_processes.py`` (pytest-benchmark
times one process at a time).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from bench_helpers import check_adapter, pinned_to_one_core

from nanolimit.cli import bench as _bench
from nanolimit.cli.bench import ALGORITHMS, LIBRARIES, OURS, ZONE, Maker, Prepared, Shared

if os.environ.get("NANOLIMIT_NO_EXTENSIONS") or not _bench.zone_available():
    pytest.skip("SharedMemoryStorage needs the native extension", allow_module_level=True)

from nanolimit import _core

CASE_SECONDS = 0.2
KINDS = (OURS, ZONE)  # in-memory first: the zone's ratio is to the figure just taken
BATCH_KEYS = 1000
REDIS_TARGET = 300
MILLION = 1_000_000

#: (scenario, algorithm, library) -> ns per decision, median
_MEDIANS: dict[tuple[str, str, str], float] = {}
_makers: dict[tuple[str, str], Maker] = {}


def _maker(lib: str, alg: str) -> Maker:
    """One maker per library and algorithm, so ``Shared`` keeps its filled store."""
    if (lib, alg) not in _makers:
        _makers[(lib, alg)] = LIBRARIES[lib].makers()[alg]
    return _makers[(lib, alg)]


def _pairs(algorithms: tuple[str, ...]) -> list[Any]:
    return [pytest.param(alg, lib, id=f"{alg}-{lib}") for alg in algorithms for lib in KINDS]


def _record(benchmark: Any, scenario: str, alg: str, lib: str) -> None:
    median = benchmark.extra_info.get("ns_per_decision_median")
    if median is None:
        return
    _MEDIANS[(scenario, alg, lib)] = median
    memory = _MEDIANS.get((scenario, alg, OURS))
    if lib == ZONE and memory:
        benchmark.extra_info["zone_over_memory"] = round(median / memory, 3)


@pytest.fixture(scope="module")
def shared() -> Iterator[Shared]:
    store = Shared()
    yield store
    store.close()


@pytest.mark.parametrize(("alg", "lib"), _pairs(ALGORITHMS))
def test_hot_key(time_cell: Callable[..., None], benchmark: Any, shared: Shared, alg: str, lib: str) -> None:
    """``allow(key)`` on one key, always allowed."""
    time_cell(_bench.prepare("hot_allowed", _maker(lib, alg), shared), f"zone/hot/{alg}", CASE_SECONDS, 200)
    _record(benchmark, "hot_allowed", alg, lib)


@pytest.mark.parametrize(("alg", "lib"), _pairs(ALGORITHMS))
def test_keys_100k(
    time_cell: Callable[..., None], benchmark: Any, shared: Shared, alg: str, lib: str
) -> None:
    """``allow`` round-robin over 100,000 keys already stored (the zone is
    made 1.25x that: its capacity is split evenly over its stripes)."""
    prepared: Prepared = _bench.prepare("keys_100k", _maker(lib, alg), shared)
    time_cell(prepared, f"zone/100k/{alg}", CASE_SECONDS, 200)
    _record(benchmark, "keys_100k", alg, lib)


def _batch_cell(subject: Any, keys: list[str]) -> Prepared:
    many = subject.allow_many
    assert many(keys).allowed_count == len(keys)  # stored, and the allowed path

    def check() -> None:
        assert many(keys[:1]).allowed_count == 1, "allow_many denied"

    return Prepared(many, lambda: (keys,), len(keys), check, subject.close)


@pytest.mark.parametrize(("alg", "lib"), _pairs(ALGORITHMS))
def test_allow_many_1k(time_cell: Callable[..., None], benchmark: Any, alg: str, lib: str) -> None:
    """One ``allow_many`` over the same 1,000 stored keys (the table in cache)."""
    subject = _maker(lib, alg)(_bench.HIGH_LIMIT, _bench.HIGH_WINDOW)
    time_cell(_batch_cell(subject, _bench.key_list(BATCH_KEYS)), f"zone/many_1k/{alg}", CASE_SECONDS, 2000)
    _record(benchmark, "allow_many_1k", alg, lib)


@pytest.mark.parametrize(("alg", "lib"), _pairs(("token_bucket",)))
def test_allow_many_100k(
    time_cell: Callable[..., None], benchmark: Any, shared: Shared, alg: str, lib: str
) -> None:
    """One ``allow_many`` over the 100,000 stored keys."""
    prepared = _bench.prepare("allow_many_100k", _maker(lib, alg), shared)
    time_cell(prepared, f"zone/many_100k/{alg}", CASE_SECONDS, 30)
    _record(benchmark, "allow_many_100k", alg, lib)


def _cell(scenario: str, lib: str, alg: str, shared: Shared) -> Prepared:
    if scenario == "allow_many_1k":
        subject = _maker(lib, alg)(_bench.HIGH_LIMIT, _bench.HIGH_WINDOW)
        return _batch_cell(subject, _bench.key_list(BATCH_KEYS))
    return _bench.prepare(scenario, _maker(lib, alg), shared)


PAIRED = [
    pytest.param(scen, alg, id=f"{scen}-{alg}")
    for scen in ("hot_allowed", "keys_100k", "allow_many_1k")
    for alg in ALGORITHMS
] + [pytest.param("allow_many_100k", "token_bucket", id="allow_many_100k-token_bucket")]


@pytest.mark.parametrize(("scenario", "alg"), PAIRED)
def test_paired(benchmark: Any, scenario: str, alg: str) -> None:
    """The zone's ratio to in-memory with the two alternated round by round:
    before each timed round of the zone's cell, untimed by pytest-benchmark,
    the in-memory cell's round is timed here. On this VM single cells move by
    a third within a minute; a ratio of rounds taken microseconds apart does
    not. ``extra_info``: both medians, ``zone_over_memory`` (the median of
    the per-round ratios) and its quartiles."""
    shared_memory, shared_zone = Shared(), Shared()
    memory = _cell(scenario, OURS, alg, shared_memory)
    zone = _cell(scenario, ZONE, alg, shared_zone)
    try:
        memory_ns: list[float] = []

        def setup() -> tuple[tuple[Any, ...], dict[str, Any]]:
            args = memory.setup()
            t0 = time.perf_counter_ns()
            memory.body(*args)
            memory_ns.append((time.perf_counter_ns() - t0) / memory.decisions)
            return zone.setup(), {}

        for cell in (memory, zone):  # warm-up
            cell.body(*cell.setup())
        benchmark.group = "zone/paired"
        rounds = 30 if scenario == "allow_many_100k" else 300
        benchmark.pedantic(zone.body, setup=setup, rounds=rounds)
        memory.check()
        zone.check()
        stats = benchmark.stats.stats if benchmark.stats else None
        if stats is not None:
            zone_ns = [t / zone.decisions * 1e9 for t in stats.data]
            ratios = [z / m for z, m in zip(zone_ns, memory_ns)]
            q1, median, q3 = statistics.quantiles(ratios, n=4)
            benchmark.extra_info.update(
                memory_ns_median=round(statistics.median(memory_ns), 1),
                zone_ns_median=round(statistics.median(zone_ns), 1),
                zone_over_memory=round(median, 3),
                zone_over_memory_q1=round(q1, 3),
                zone_over_memory_q3=round(q3, 3),
            )
    finally:
        for cell in (memory, zone):
            cell.close()
        shared_memory.close()
        shared_zone.close()


@pytest.mark.parametrize("alg", ALGORITHMS)
def test_zone_adapter_sanity(alg: str) -> None:
    """The zone subject decides (see ``bench_helpers.check_adapter``)."""
    check_adapter(_maker(ZONE, alg))


# ---------------------------------------------------------------------------
# Against Redis on loopback
# ---------------------------------------------------------------------------


def _zone_hot_ns() -> float:
    """The zone's hot-key token-bucket figure of this run, or (the Redis case
    run alone) one measured now: median of 200 loops of 1,000 calls."""
    known = _MEDIANS.get(("hot_allowed", "token_bucket", ZONE))
    if known is not None:
        return known
    subject = _maker(ZONE, "token_bucket")(_bench.HIGH_LIMIT, _bench.HIGH_WINDOW)
    try:
        allow, keys = subject.allow, [_bench.HOT_KEY] * 1000
        samples = []
        for _ in range(201):
            t0 = time.perf_counter_ns()
            for k in keys:
                allow(k)
            samples.append((time.perf_counter_ns() - t0) / len(keys))
        return statistics.median(samples[1:])
    finally:
        subject.close()


@pytest.fixture(scope="module")
def redis_server() -> Iterator[Any]:
    from redis_servers import Server, find_binary

    binary = find_binary("redis")
    if binary is None:
        pytest.skip("!!! redis-server not found: the zone-vs-Redis ratio NOT measured !!!")
    srv = Server(binary, "redis")
    srv.start()
    with pinned_to_one_core(srv):
        yield srv
    srv.stop()


def test_redis_hot_key(benchmark: Any, redis_server: Any) -> None:
    """One decision (``limiter.allow``, native limiter, token bucket) on
    ``RedisStorage`` against a throwaway loopback ``redis-server``, client
    and server pinned to one core, as ``bench/test_redis.py`` does; the ratio
    is to the zone's hot-key figure."""
    from nanolimit import SystemClock
    from nanolimit.storage.redis import RedisStorage

    client = redis_server.client()
    storage = RedisStorage(client)
    try:
        storage.load_scripts()
        limiter = _core.TokenBucket(
            _bench.HIGH_LIMIT, _bench.HIGH_WINDOW, storage, SystemClock(), rule="bench"
        )
        assert limiter.allow(_bench.HOT_KEY).allowed
        benchmark.group = "zone/redis/token_bucket"
        benchmark.pedantic(limiter.allow, args=(_bench.HOT_KEY,), rounds=3000, warmup_rounds=100)
        assert limiter.allow(_bench.HOT_KEY).allowed
    finally:
        storage.client.close()
        client.close()
    stats = benchmark.stats.stats if benchmark.stats else None
    if stats is not None:
        redis_ns = stats.median * 1e9
        zone_ns = _zone_hot_ns()
        benchmark.extra_info["ns_per_decision_median"] = round(redis_ns, 1)
        benchmark.extra_info["zone_ns_per_decision"] = round(zone_ns, 1)
        benchmark.extra_info["redis_over_zone"] = round(redis_ns / zone_ns, 1)
        benchmark.extra_info["target_met"] = redis_ns / zone_ns >= REDIS_TARGET


# ---------------------------------------------------------------------------
# Bytes per key
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("max_keys", "arena_bytes"),
    [
        pytest.param(MILLION, None, id="1m-default_arena"),
        pytest.param(MILLION, 0, id="1m-no_arena"),
        pytest.param(MILLION * 103 // 100, 0, id="1.03m-no_arena"),
    ],
)
def test_bytes_per_key_1m(benchmark: Any, max_keys: int, arena_bytes: int | None) -> None:
    """``memory_bytes() / 1,000,000`` (the whole segment: header, stripes,
    entries, index, arena) of a token-bucket zone, and the keys of 16 bytes
    each it holds once 1,000,000 are decided (``stats()["keys"]``): a zone
    of ``max_keys=1,000,000`` splits them evenly over its 64 stripes, and
    hashing overfills a few."""
    keys = [f"user:{i:011d}" for i in range(MILLION)]
    name = f"nlbench-{os.getpid()}-bytes-{max_keys}-{arena_bytes}"
    zone = _core.SharedMemoryStorage(name, max_keys=max_keys, arena_bytes=arena_bytes)
    try:
        limiter = _core.TokenBucket(100, 60.0, storage=zone, rule="bench")

        def fill() -> None:
            for i in range(0, MILLION, 100_000):
                limiter.allow_many(keys[i : i + 100_000])

        benchmark.group = "zone/bytes_per_key"
        benchmark.pedantic(fill, rounds=1, iterations=1)
        held = zone.stats()["keys"]
        benchmark.extra_info["bytes_per_key"] = round(zone.memory_bytes() / MILLION, 2)
        benchmark.extra_info["keys_held"] = held
        benchmark.extra_info["keys_evicted"] = MILLION - held
        assert held <= min(max_keys, MILLION)
    finally:
        zone.close()
        _core.SharedMemoryStorage.unlink_segment(name)
