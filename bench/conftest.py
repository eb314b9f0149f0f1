"""Benchmark fixtures: every case runs for both twins, as the tests do."""

from __future__ import annotations

import importlib
import os
import types

import pytest

from nanolimit._shared import LIMITER_CLASS_NAMES

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
