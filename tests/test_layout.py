"""The layout promises of docs/architecture.md: every documented import path
keeps working after the move into layers, pickles naming the old paths still
load, and the native core imports nothing above it (import-linter checks the
Python modules; it cannot read Cython, so this reads the .pyx sources)."""

from __future__ import annotations

import importlib
import importlib.metadata
import pickle
import re
import types
from pathlib import Path

import pytest

import nanolimit

# old path -> where the module lives now (the old path is the same module object)
MOVED = {
    "nanolimit.rules": "nanolimit.gateway.rules",
    "nanolimit.keys": "nanolimit.gateway.keys",
    "nanolimit.config": "nanolimit.gateway.config",
    "nanolimit.factory": "nanolimit.gateway.factory",
    "nanolimit.metrics": "nanolimit.gateway.metrics",
    "nanolimit.middleware": "nanolimit.gateway.middleware",
    "nanolimit.asgi": "nanolimit.gateway.asgi",
    "nanolimit.wsgi": "nanolimit.gateway.wsgi",
    "nanolimit.two_tier": "nanolimit.storage.two_tier",
    "nanolimit._bench": "nanolimit.cli.bench",
    "nanolimit.flask": "nanolimit.gateway.flask",
    "nanolimit.django": "nanolimit.gateway.django",
    "nanolimit.aiohttp": "nanolimit.gateway.aiohttp",
}
CORE_MODULES = {
    "_clocks", "_core", "_decision_py", "_kernels", "_limiter_config", "_protocols", "_select",
    "_table", "_types", "_validation", "_version", "_zone", "errors", "reference",
}  # fmt: skip


@pytest.mark.parametrize("old", sorted(MOVED))
def test_documented_paths_are_the_moved_modules(old: str) -> None:
    assert importlib.import_module(old) is importlib.import_module(MOVED[old])


def test_redis_storage_path_names_the_storage_layer() -> None:
    old = importlib.import_module("nanolimit.redis_storage")
    assert old.RedisStorage is nanolimit.RedisStorage
    assert old.RedisStorage.__module__.startswith("nanolimit.storage.redis")


def test_every_root_name_imports() -> None:
    for name in nanolimit.__all__:
        assert getattr(nanolimit, name) is not None, name
    assert set(nanolimit.__all__) <= set(dir(nanolimit))
    with pytest.raises(AttributeError):
        _ = nanolimit.NoSuchName  # type: ignore[attr-defined]


def test_root_twin_names_are_the_live_twin() -> None:
    from nanolimit._select import twin

    for name in ("TokenBucket", "GCRA", "InMemoryStorage", "Decision", "IMPLEMENTATION"):
        assert getattr(nanolimit, name) is getattr(twin, name)


def test_console_script_and_module_entry_point() -> None:
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "nanolimit"]
    assert script.value == "nanolimit.__main__:main"
    main = script.load()
    assert main is importlib.import_module("nanolimit.cli.main").main
    assert importlib.import_module("nanolimit.__main__").main is main


def test_pickles_naming_the_old_paths_still_load(backend: types.SimpleNamespace) -> None:
    rule = nanolimit.RateLimitRule.from_rate("login", "5/minute", method="POST", path_prefix="/login")
    data = pickle.dumps(rule, protocol=0)
    assert b"nanolimit.gateway.rules" in data
    old = data.replace(b"nanolimit.gateway.rules", b"nanolimit.rules")
    assert pickle.loads(old) == rule
    limiter = backend.TokenBucket(5, 60.0, clock=backend.FakeClock(0.0), rule="r")
    decision = limiter.allow("k")
    state = limiter.state("k")
    for value in (decision, state):
        assert pickle.loads(pickle.dumps(value)) == value
    state_data = pickle.dumps(state, protocol=0)
    assert b"nanolimit._limiter_config" in state_data
    assert pickle.loads(state_data) == state


def test_native_core_imports_nothing_above_it() -> None:
    src = Path(__file__).resolve().parents[1] / "src" / "nanolimit"
    sources = [*src.glob("_core*.pyx"), *src.glob("_core*.pxi")]
    if not sources:
        pytest.skip("run from a checkout: the Cython sources are not beside the installed package")
    imported = set()
    for path in sources:
        for line in path.read_text().splitlines():
            match = re.match(r"\s*(?:from|import)\s+nanolimit\.([A-Za-z_]+)", line)
            if match:
                imported.add(match.group(1))
            match = re.match(r"\s*from nanolimit import ([A-Za-z_]+)", line)
            if match:
                imported.add(match.group(1))
    assert imported, "the pattern must see the core's own imports"
    assert imported <= CORE_MODULES, imported - CORE_MODULES
