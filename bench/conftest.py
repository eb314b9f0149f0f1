"""Benchmark fixtures: every case runs for both twins, as the tests do."""

from __future__ import annotations

import contextlib
import importlib
import os
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nanolimit._shared import LIMITER_CLASS_NAMES

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # redis_servers

TWINS = ("native", "reference")
ALGORITHMS = LIMITER_CLASS_NAMES


@pytest.fixture(scope="session", params=TWINS)
def twin(request: pytest.FixtureRequest) -> types.ModuleType:
    if request.param == "native":
        if os.environ.get("NANOLIMIT_NO_EXTENSIONS"):
            pytest.skip("native twin deselected by NANOLIMIT_NO_EXTENSIONS")
        return importlib.import_module("nanolimit._core")
    return importlib.import_module("nanolimit.reference")


@pytest.fixture(params=list(ALGORITHMS))
def limiter_type(request: pytest.FixtureRequest, twin: types.ModuleType) -> type:
    return getattr(twin, ALGORITHMS[request.param])


@pytest.fixture
def time_cell(benchmark: Any) -> Callable[..., None]:
    """Time one :class:`nanolimit._bench.Prepared` cell with pytest-benchmark:
    a warm-up call sizes the rounds to about ``seconds``, the cell's check
    runs after timing, and ``extra_info`` gets the per-decision median and
    min in ``unit`` (``"ns"`` or ``"us"``). Closes the cell."""

    def run(prepared: Any, group: str, seconds: float, max_rounds: int, unit: str = "ns") -> None:
        scale = {"ns": 1e9, "us": 1e6}[unit]
        try:
            benchmark.group = group
            args = prepared.setup()
            t0 = time.perf_counter()
            prepared.body(*args)  # warm-up, and the size of a round
            rounds = max(3, min(max_rounds, int(seconds / max(time.perf_counter() - t0, 1e-9))))
            benchmark.pedantic(prepared.body, setup=lambda: (prepared.setup(), {}), rounds=rounds)
            prepared.check()
            stats = benchmark.stats.stats if benchmark.stats else None
            if stats is not None:
                for name, value in (("median", stats.median), ("min", stats.min)):
                    benchmark.extra_info[f"{unit}_per_decision_{name}"] = round(
                        value / prepared.decisions * scale, 2 if unit == "us" else 1
                    )
        finally:
            prepared.close()

    return run


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
