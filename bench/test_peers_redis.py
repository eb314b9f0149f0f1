"""nanolimit next to its peers on Redis: the ``redis_`` scenarios of
``nanolimit bench`` (:mod:`nanolimit.cli.bench`) through each library's Redis
backend, against one throwaway server, so every comparison is a ratio from
one run. Client and server are pinned to one core, as in ``test_redis.py``
(``NANOLIMIT_BENCH_PIN=0`` to disable): unpinned, every round trip also pays
for waking an idle core.

``test_redis_adapter_sanity`` is a plain test: each Redis adapter really
decides, exactly N allowed of M on a fresh key.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator

import pytest
from bench_helpers import check_adapter, peer_cases, pinned_to_one_core
from redis_servers import Server, find_binary

from nanolimit.cli import bench as _bench
from nanolimit.cli.bench import LIBRARIES, REDIS_SCENARIOS, Maker, Prepared, RedisTarget

LIBS = ("nanolimit", "limits", "throttled", "pyrate")
CASE_SECONDS = 0.3
CASES, PAIRS = peer_cases(LIBS, REDIS_SCENARIOS)
_UNUSED_STORE = _bench.Shared()


@pytest.fixture(scope="module")
def target() -> Iterator[RedisTarget]:
    binary = find_binary("redis")
    if binary is None:
        pytest.skip("!!! redis-server not found: Redis peer benchmarks NOT run !!!")
    server = Server(binary, "redis")
    server.start()
    with pinned_to_one_core(server):
        found = RedisTarget(f"redis://127.0.0.1:{server.port}/0")
        yield found
        found.cleanup()
    server.stop()


def _redis_maker(target: RedisTarget, lib: str, alg: str) -> Maker:
    library = LIBRARIES[lib]
    if importlib.util.find_spec(library.module) is None:
        pytest.skip(f"{lib} is not installed (pip install -e '.[bench]')")
    assert library.redis_makers is not None
    return library.redis_makers(target)[alg]


@pytest.mark.parametrize(("lib", "alg", "scen"), CASES)
def test_peer_on_redis(
    time_cell: Callable[..., None], target: RedisTarget, lib: str, alg: str, scen: str
) -> None:
    make = _redis_maker(target, lib, alg)
    try:
        prepared: Prepared = _bench.prepare(scen, make, _UNUSED_STORE)  # Redis cells fill their own
    except NotImplementedError as exc:
        pytest.skip(f"{lib} has {exc}")
    time_cell(prepared, f"{alg}/{scen}", CASE_SECONDS, 100, unit="us")


@pytest.mark.parametrize(("lib", "alg"), PAIRS)
def test_redis_adapter_sanity(target: RedisTarget, lib: str, alg: str) -> None:
    """Each Redis adapter decides (see ``bench_helpers.check_adapter``)."""
    check_adapter(_redis_maker(target, lib, alg))
