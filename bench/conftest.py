"""Benchmark fixtures: every case runs for both twins, as the tests do."""

from __future__ import annotations

import importlib
import os
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from nanolimit._limiter_config import LIMITER_CLASS_NAMES

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
    """Time one :class:`nanolimit.cli.bench.Prepared` cell with pytest-benchmark:
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
