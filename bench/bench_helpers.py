"""What the benchmark files share that is not a fixture: an adapter's
self-check, the peer case tables and client/server pinning. A module of its
own, not ``conftest``: a test module importing ``conftest`` by name gets
whichever conftest is first on ``sys.path`` (``tests/`` has one too)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest


def check_adapter(make: Callable[[int, float], Any]) -> None:
    """An adapter really decides: 5 per hour admits exactly 5 of 7 on a fresh
    key and not another key's budget; a cost of 4 against 10 passes twice of
    three; peek (where the library has one) spends nothing."""
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


@contextlib.contextmanager
def pinned_to_one_core(server: Any) -> Iterator[None]:
    """Client (this process) and server on one core, for the whole block
    (``NANOLIMIT_BENCH_PIN=0`` to leave them free): unpinned, every round
    trip also pays for waking an idle core (~70 µs instead of ~27 µs for a
    ``PING``), which measures the scheduler, not the code."""
    if os.environ.get("NANOLIMIT_BENCH_PIN", "1") == "0" or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    cpu = min(before)
    assert server.proc is not None
    os.sched_setaffinity(server.proc.pid, {cpu})
    os.sched_setaffinity(0, {cpu})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def peer_cases(libs: tuple[str, ...], scenarios: Any) -> tuple[list[Any], list[Any]]:
    """The (library, algorithm, scenario) cases, ordered algorithm first so
    ours and the peers' figures for one algorithm are taken close together,
    and the (library, algorithm) pairs, of ``nanolimit bench``'s libraries."""
    from nanolimit.cli.bench import ALGORITHMS as BENCH_ALGORITHMS
    from nanolimit.cli.bench import LIBRARIES

    cases = [
        pytest.param(lib, alg, scen, id=f"{lib}-{alg}-{scen}")
        for alg in BENCH_ALGORITHMS
        for lib in libs
        if alg in LIBRARIES[lib].algorithms
        for scen in scenarios
    ]
    pairs = [pytest.param(lib, alg, id=f"{lib}-{alg}") for lib in libs for alg in LIBRARIES[lib].algorithms]
    return cases, pairs
