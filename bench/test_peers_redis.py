"""nanolimit next to its peers on Redis: the ``redis_`` scenarios of
``nanolimit bench`` (:mod:`nanolimit._bench`) through each library's Redis
backend, against one throwaway server, so every comparison is a ratio from
one run. Client and server are pinned to one core, as in ``test_redis.py``
(``NANOLIMIT_BENCH_PIN=0`` to disable): unpinned, every round trip also pays
for waking an idle core.

``test_redis_adapter_sanity`` is a plain test: each Redis adapter really
decides, exactly N allowed of M on a fresh key.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis_servers import Server, find_binary

from nanolimit import _bench
from nanolimit._bench import ALGORITHMS, LIBRARIES, REDIS_SCENARIOS, Maker, Prepared, RedisTarget

LIBS = ("nanolimit", "limits", "throttled", "pyrate")
CASE_SECONDS = 0.3
CASES = [
    pytest.param(lib, alg, scen, id=f"{lib}-{alg}-{scen}")
    for alg in ALGORITHMS
    for lib in LIBS
    if alg in LIBRARIES[lib].algorithms
    for scen in REDIS_SCENARIOS
]
PAIRS = [pytest.param(lib, alg, id=f"{lib}-{alg}") for lib in LIBS for alg in LIBRARIES[lib].algorithms]
_UNUSED_STORE = _bench.Shared()


@pytest.fixture(scope="module")
def target() -> Iterator[RedisTarget]:
    binary = find_binary("redis")
    if binary is None:
        pytest.skip("!!! redis-server not found: Redis peer benchmarks NOT run !!!")
    server = Server(binary, "redis")
    server.start()
    pinned = os.environ.get("NANOLIMIT_BENCH_PIN", "1") != "0" and hasattr(os, "sched_setaffinity")
    before = os.sched_getaffinity(0) if pinned else None
    if pinned:
        cpu = min(os.sched_getaffinity(0))
        assert server.proc is not None
        os.sched_setaffinity(server.proc.pid, {cpu})
        os.sched_setaffinity(0, {cpu})
    found = RedisTarget(f"redis://127.0.0.1:{server.port}/0")
    yield found
    found.cleanup()
    if before is not None:
        os.sched_setaffinity(0, before)
    server.stop()


def _redis_maker(target: RedisTarget, lib: str, alg: str) -> Maker:
    library = LIBRARIES[lib]
    if importlib.util.find_spec(library.module) is None:
        pytest.skip(f"{lib} is not installed (pip install -e '.[bench]')")
    assert library.redis_makers is not None
    return library.redis_makers(target)[alg]


@pytest.mark.parametrize(("lib", "alg", "scen"), CASES)
def test_peer_on_redis(benchmark: Any, target: RedisTarget, lib: str, alg: str, scen: str) -> None:
    make = _redis_maker(target, lib, alg)
    try:
        prepared: Prepared = _bench.prepare(scen, make, _UNUSED_STORE)  # Redis cells fill their own
    except NotImplementedError as exc:
        pytest.skip(f"{lib} has {exc}")
    try:
        benchmark.group = f"{alg}/{scen}"
        args = prepared.setup()
        t0 = time.perf_counter()
        prepared.body(*args)  # warm-up, and the size of a round
        rounds = max(3, min(100, int(CASE_SECONDS / max(time.perf_counter() - t0, 1e-9))))
        benchmark.pedantic(prepared.body, setup=lambda: (prepared.setup(), {}), rounds=rounds)
        prepared.check()
        stats = benchmark.stats.stats if benchmark.stats else None
        if stats is not None:
            benchmark.extra_info["us_per_decision_median"] = round(stats.median / prepared.decisions * 1e6, 2)
            benchmark.extra_info["us_per_decision_min"] = round(stats.min / prepared.decisions * 1e6, 2)
    finally:
        prepared.close()


@pytest.mark.parametrize(("lib", "alg"), PAIRS)
def test_redis_adapter_sanity(target: RedisTarget, lib: str, alg: str) -> None:
    """Each Redis adapter decides: 5 per hour admits exactly 5 of 7 on a fresh
    key and not another key's budget; a cost of 4 against 10 passes twice of
    three; peek (where the library has one) spends nothing."""
    make = _redis_maker(target, lib, alg)
    s = make(5, 3600.0)
    try:
        verdicts = [s.allowed(s.allow("sanity")) for _ in range(7)]
        assert verdicts == [True] * 5 + [False] * 2, verdicts
        assert s.allowed(s.allow("another")), "keys must not share a budget"
    finally:
        s.close()
    s = make(10, 3600.0)
    try:
        verdicts = [s.allowed(s.allow_cost("weighted", 4)) for _ in range(3)]
        assert verdicts == [True, True, False], verdicts
        if s.peek is not None and s.peek_allowed is not None:
            for _ in range(3):
                assert s.peek_allowed(s.peek("peeked"))
            assert [s.allowed(s.allow_cost("peeked", 4)) for _ in range(3)] == [True, True, False]
    finally:
        s.close()
