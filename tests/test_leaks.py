"""Reference-count and allocation hygiene of the native twin: the number of
live Python blocks stays flat over many calls of every public method (a
leaked reference per call would grow it by the call count)."""

from __future__ import annotations

import gc
import sys

import pytest

from nanolimit import FakeClock

pytestmark = pytest.mark.native


def _blocks_after(call, repeat: int) -> int:
    for _ in range(1000):  # warm caches, freelists and interned objects
        call()
    gc.collect()
    before = sys.getallocatedblocks()
    for _ in range(repeat):
        call()
    gc.collect()
    return sys.getallocatedblocks() - before


def _subjects(native):
    clock = FakeClock(1000.0)
    storage = native.InMemoryStorage(max_keys=10_000)
    tb = native.TokenBucket(10**6, 1.0, storage, clock, rule="tb")
    log = native.SlidingWindowLog(1000, 1.0, storage, clock, rule="log")
    keys = [f"user:{i}" for i in range(100)]
    long_key = "x" * 200
    calls = {
        "allow": (lambda: tb.allow("user:1"), 1_000_000),
        "allow_denied": (lambda: log.allow("full", 1000) and log.allow("full"), 100_000),
        "allow_long_key": (lambda: tb.allow(long_key), 200_000),
        "peek": (lambda: tb.peek("user:2"), 1_000_000),
        "allow_many": (lambda: tb.allow_many(keys), 10_000),
        "allow_many_times": (lambda: tb.allow_many(keys, [1] * 100, times=[1000.0] * 100), 5_000),
        "allow_all": (lambda: storage.allow_all([(tb, "a"), (log, "b")]), 100_000),
        "reset": (lambda: (tb.allow("gone"), tb.reset("gone")), 200_000),
        "state": (lambda: (tb.state("user:1"), log.state("b")), 200_000),
        "apply": (lambda: storage.apply("raw", 1000.0, lambda s: ((s or 0) + 1, None)), 200_000),
        "apply_forget": (
            lambda: storage.apply("raw2", 1000.0, lambda s: (None if s else [1], None)),
            200_000,
        ),
        "evict_idle": (lambda: (tb.allow("idle"), storage.evict_idle(999.0)), 20_000),
        "len_keys_stats": (lambda: (len(storage), storage.keys(), storage.stats()), 2_000),
        "headers": (lambda: tb.allow("user:3").headers(wall_now=0.0), 100_000),
        "validation_error": (lambda: _swallow(tb.allow, 42), 100_000),
    }
    return calls


def _swallow(fn, *args) -> None:
    try:
        fn(*args)
    except ValueError:
        pass


@pytest.mark.parametrize(
    "name",
    [
        "allow",
        "allow_denied",
        "allow_long_key",
        "peek",
        "allow_many",
        "allow_many_times",
        "allow_all",
        "reset",
        "state",
        "apply",
        "apply_forget",
        "evict_idle",
        "len_keys_stats",
        "headers",
        "validation_error",
    ],
)
def test_allocations_stay_flat(native, name: str) -> None:
    call, repeat = _subjects(native)[name]
    grown = _blocks_after(call, repeat)
    assert grown < 50, f"{name}: {grown} blocks left behind by {repeat} calls"
