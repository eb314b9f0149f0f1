"""The layout promises of docs/architecture.md: one real module per public
path (the framework paths are explicit facades, the old aliases are gone),
pickles name the real modules, and the native core imports nothing above it
(import-linter checks the Python modules; it cannot read Cython, so this
reads the .pyx sources)."""

from __future__ import annotations

import importlib
import importlib.metadata
import pickle
import re
import types
from pathlib import Path

import pytest

import nanolimit

# the framework paths users type -> the adapter each one names (an explicit facade)
FACADES = {
    "nanolimit.asgi": "nanolimit.gateway.asgi",
    "nanolimit.wsgi": "nanolimit.gateway.wsgi",
    "nanolimit.flask": "nanolimit.gateway.flask",
    "nanolimit.django": "nanolimit.gateway.django",
    "nanolimit.aiohttp": "nanolimit.gateway.aiohttp",
}
# the paths that were aliases of a moved module: there is one path per module now
GONE = (
    "nanolimit.rules", "nanolimit.keys", "nanolimit.config", "nanolimit.factory", "nanolimit.metrics",
    "nanolimit.middleware", "nanolimit.redis_storage", "nanolimit.two_tier", "nanolimit._bench",
    "nanolimit._shared", "nanolimit._errors",
)  # fmt: skip
CORE_MODULES = {
    "_clocks", "_core", "_decision_py", "_evict", "_kernels", "_limiter_config", "_protocols", "_select",
    "_table", "_types", "_validation", "_version", "_zone", "errors", "reference",
}  # fmt: skip


@pytest.mark.parametrize("path", sorted(FACADES))
def test_framework_paths_are_facades_of_their_adapters(path: str) -> None:
    facade = importlib.import_module(path)
    adapter = importlib.import_module(FACADES[path])
    assert facade is not adapter
    assert facade.__all__ == adapter.__all__
    for name in facade.__all__:
        assert getattr(facade, name) is getattr(adapter, name), name


@pytest.mark.parametrize("path", GONE)
def test_old_alias_paths_are_gone(path: str) -> None:
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(path)


def test_no_module_replaces_itself_in_sys_modules() -> None:
    src = Path(__file__).resolve().parents[1] / "src" / "nanolimit"
    if not src.is_dir():
        pytest.skip("run from a checkout")
    swapped = [p.name for p in src.rglob("*.py") if "sys.modules[__name__]" in p.read_text()]
    assert swapped == []


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


def test_pickles_name_the_real_modules(backend: types.SimpleNamespace) -> None:
    rule = nanolimit.RateLimitRule.from_rate("login", "5/minute", method="POST", path_prefix="/login")
    data = pickle.dumps(rule, protocol=0)
    assert b"nanolimit.gateway.rules" in data
    assert pickle.loads(data) == rule
    limiter = backend.TokenBucket(5, 60.0, clock=backend.FakeClock(0.0), rule="r")
    decision = limiter.allow("k")
    state = limiter.state("k")
    for value in (decision, state):
        assert pickle.loads(pickle.dumps(value)) == value
    state_data = pickle.dumps(state, protocol=0)
    assert b"nanolimit._limiter_config" in state_data
    assert pickle.loads(state_data) == state
    error = nanolimit.RedisUnavailableError("down")
    assert b"nanolimit.errors" in pickle.dumps(error, protocol=0)
    assert str(pickle.loads(pickle.dumps(error))) == "down"


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
