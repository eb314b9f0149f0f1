"""Shared fixtures: every test runs against both twins.

One session fixture, ``backend``, parametrized over the native core
(``nanolimit._core``) and the pure-Python reference (``nanolimit.reference``);
every other fixture derives from it, and tests never import a twin directly
(``test_equivalence`` and ``test_import`` are the deliberate exceptions).

A third parameter, ``zone``, runs the native twin with every
``backend.InMemoryStorage(...)`` made a ``SharedMemoryStorage`` (the
shared-memory zone, same API): it is collected only in modules that set
``ZONE_SUITE = True`` (the SPEC scenarios, validation, bounded-store and
compound suites) or in a test marked ``on_zone`` (one test of another
module that holds for the zone too), and a test there marked
``not_on_zone`` (the ``apply`` seam, which a zone refuses) is deselected
for it.

The native parameter is skipped only when asked to: ``--no-c-extensions`` or
``NANOLIMIT_NO_EXTENSIONS`` set. Otherwise a failing ``import nanolimit._core``
is an *error* of every native test, so CI can never silently test the Python
twin twice.
"""

from __future__ import annotations

import gc
import importlib
import os
import sys
import types
from collections.abc import Iterator

import pytest

# Imports of nanolimit stay inside the fixtures: ``--no-c-extensions`` must be
# turned into NANOLIMIT_NO_EXTENSIONS before ``nanolimit/__init__.py`` runs.

TWIN_NAMES = (
    "TokenBucket",
    "LeakyBucket",
    "FixedWindowCounter",
    "SlidingWindowLog",
    "SlidingWindowCounter",
    "GCRA",
    "InMemoryStorage",
    "Decision",
    "IMPLEMENTATION",
)

# the pure names both twins share -> the module that holds each
SHARED_NAMES = {
    "Algorithm": "nanolimit._limiter_config",
    "BatchResult": "nanolimit._decision_py",
    "Clock": "nanolimit._clocks",
    "FakeClock": "nanolimit._clocks",
    "LimiterConfig": "nanolimit._limiter_config",
    "LimiterState": "nanolimit._limiter_config",
    "RateLimiter": "nanolimit._protocols",
    "Storage": "nanolimit._protocols",
    "SystemClock": "nanolimit._clocks",
    "UnknownAlgorithmError": "nanolimit.errors",
    "StorageFullError": "nanolimit.errors",
    "ValidationError": "nanolimit.errors",
    "MAX_KEY_BYTES": "nanolimit._validation",
    "storage_key": "nanolimit._limiter_config",
}

# algorithm name -> limiter class name, in docs/spec.md §4 order
# (a copy of nanolimit._limiter_config.LIMITER_CLASS_NAMES: importing it here would
# load nanolimit before --no-c-extensions can take effect)
ALGORITHM_CLASSES = {
    "token_bucket": "TokenBucket",
    "leaky_bucket": "LeakyBucket",
    "fixed_window": "FixedWindowCounter",
    "sliding_log": "SlidingWindowLog",
    "sliding_counter": "SlidingWindowCounter",
    "gcra": "GCRA",
}
ALGORITHMS = tuple(ALGORITHM_CLASSES)
BURST_ALGORITHMS = ("token_bucket", "gcra")
NO_EXTENSIONS_ENV = "NANOLIMIT_NO_EXTENSIONS"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--no-c-extensions",
        action="store_true",
        default=False,
        help="skip the native twin (nanolimit._core) and test the pure-Python twin only",
    )
    parser.addoption(
        "--shard",
        default=None,
        metavar="I/N",
        help="run only every N-th test from the I-th (0-based): N processes split one run (.ci/memcheck.py)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "native: the test needs the compiled twin, nanolimit._core")
    config.addinivalue_line(
        "markers", "not_on_zone: a ZONE_SUITE test of what only InMemoryStorage has (apply)"
    )
    config.addinivalue_line(
        "markers", "on_zone: run this test on the zone backend too, in a module without ZONE_SUITE"
    )
    if config.getoption("--no-c-extensions"):
        # Run the identical suite pure: `import nanolimit` must pick the reference too.
        os.environ[NO_EXTENSIONS_ENV] = "1"
    if os.environ.get("NANOLIMIT_MEMCHECK") == "1":
        # under valgrind a property's first examples reach its C paths; the
        # suite runs all of them (see _helpers.rounds)
        from hypothesis import settings

        settings.register_profile("memcheck", max_examples=25)
        settings.load_profile("memcheck")


def native_skip_reason(config: pytest.Config) -> str | None:
    """Why the native twin is not under test, or None when it must be."""
    if config.getoption("--no-c-extensions"):
        return "native twin deselected by --no-c-extensions"
    if os.environ.get(NO_EXTENSIONS_ENV):
        return f"native twin deselected by {NO_EXTENSIONS_ENV}={os.environ[NO_EXTENSIONS_ENV]!r}"
    return None


@pytest.fixture(
    scope="session",
    params=[
        pytest.param("native", marks=pytest.mark.native, id="native"),
        pytest.param("reference", id="reference"),
        pytest.param("zone", marks=pytest.mark.native, id="zone"),
    ],
)
def backend(request: pytest.FixtureRequest) -> types.SimpleNamespace:
    """All names of one twin, plus the shared pure classes, and ``name``."""
    name = request.param
    if name in ("native", "zone"):
        reason = native_skip_reason(request.config)
        if reason is not None:
            pytest.skip(reason)
        if name == "zone" and sys.platform == "win32":
            pytest.skip("Windows has no POSIX shared memory: SharedMemoryStorage refuses to start")
        # Deliberately unguarded: an ImportError here is a test ERROR, not a skip.
        module = importlib.import_module("nanolimit._core")
    else:
        module = importlib.import_module("nanolimit.reference")
    ns = types.SimpleNamespace(name=name, module=module)
    for attr in TWIN_NAMES:
        setattr(ns, attr, getattr(module, attr))
    for attr, home in SHARED_NAMES.items():
        setattr(ns, attr, getattr(importlib.import_module(home), attr))
    ns.limiters = {algo: getattr(module, cls) for algo, cls in ALGORITHM_CLASSES.items()}
    if name == "zone":
        ns.InMemoryStorage = zone_factory(module)
    return ns


ZONE_TEST_KEYS = 65_536


def zone_factory(module: types.ModuleType):
    """``InMemoryStorage(...)`` made a fresh shared-memory zone. Its name is
    unlinked at once: the zone lives while the object does, and a crashed
    test run leaves nothing in /dev/shm."""
    import uuid

    def make(
        *,
        stripes: int = 64,
        max_key_bytes: int | None = None,
        max_keys: int | None = None,
        on_full: str = "evict",
        evict_idle_after: float | None = None,
    ):
        options = {} if max_key_bytes is None else {"max_key_bytes": max_key_bytes}
        zone = module.SharedMemoryStorage(
            f"nltest-{uuid.uuid4().hex[:16]}",
            max_keys=ZONE_TEST_KEYS if max_keys is None else max_keys,
            stripes=stripes,
            on_full=on_full,
            evict_idle_after=evict_idle_after,
            **options,
        )
        zone.unlink()
        return zone

    return make


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the ``zone`` backend only where a module asks for it."""
    kept, dropped = [], []
    for item in items:
        callspec = getattr(item, "callspec", None)
        on_zone = callspec is not None and callspec.params.get("backend") == "zone"
        opted_in = (getattr(item.module, "ZONE_SUITE", False) or item.get_closest_marker("on_zone")) and not (
            item.get_closest_marker("not_on_zone")
        )
        if on_zone and not opted_in:
            dropped.append(item)
        else:
            kept.append(item)
    shard = config.getoption("--shard")
    if shard is not None:
        index, _, count = shard.partition("/")
        if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
            raise pytest.UsageError(f"--shard wants I/N with 0 <= I < N, not {shard!r}")
        # by the sorted node ids, not the run's order: a shuffled order
        # (pytest-randomly seeds each process apart) would split differently
        n, i = int(count), int(index)
        rank = {item.nodeid: k for k, item in enumerate(sorted(kept, key=lambda item: item.nodeid))}
        dropped += [item for item in kept if rank[item.nodeid] % n != i]
        kept = [item for item in kept if rank[item.nodeid] % n == i]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = kept


@pytest.fixture
def steady_heap() -> Iterator[None]:
    """For tests that bound a decision's wall time: the objects every earlier
    test left are frozen out of the collector while this one runs. In one CI
    process the heap grows to ~700,000 objects and a full collection took
    0.2-1.2 s on a loaded 2-core box (measured per test with gc.callbacks),
    longer than the bounds these tests hold, and a cost of the test run's
    heap, not of the code under test. Unfrozen after: nothing is leaked."""
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@pytest.fixture(params=ALGORITHMS, ids=ALGORITHMS)
def algorithm(request: pytest.FixtureRequest) -> str:
    """One of the six algorithm names."""
    return request.param


@pytest.fixture
def limiter_cls(backend: types.SimpleNamespace, algorithm: str) -> type:
    """The limiter class of ``algorithm`` in the twin under test."""
    return backend.limiters[algorithm]


@pytest.fixture
def clock(backend: types.SimpleNamespace):
    """A fresh FakeClock at t = 0."""
    return backend.FakeClock(0.0)


@pytest.fixture
def storage(backend: types.SimpleNamespace):
    """A fresh InMemoryStorage of the twin under test."""
    return backend.InMemoryStorage()


@pytest.fixture
def native(request: pytest.FixtureRequest) -> types.ModuleType:
    """The native module alone, for tests of what only the C table has
    (collision hooks, C-memory accounting)."""
    reason = native_skip_reason(request.config)
    if reason is not None:
        pytest.skip(reason)
    return importlib.import_module("nanolimit._core")
