"""The Decision value (docs/spec.md §2), its headers, and BatchResult, for both twins."""

from __future__ import annotations

import copy
import math
import pickle
import time

import pytest
from _helpers import FIELDS, fields

WALL = 1_700_000_000.0


@pytest.fixture
def allowed(backend):
    return backend.Decision(True, 5, 4, 0.0, 12.0, "api", 60.0)


@pytest.fixture
def denied(backend):
    return backend.Decision(False, 5, 0, 11.5, 59.2, "api", 0.5)


def test_fields_and_defaults(backend):
    d = backend.Decision(True, 5, 4, 0.0, 12.0)
    assert fields(d) == (True, 5, 4, 0.0, 12.0, "", 0.0, 0.0)
    full = backend.Decision(False, 10, 0, 1.5, 2.5, "login", 30.0, 0.25)
    assert fields(full) == (False, 10, 0, 1.5, 2.5, "login", 30.0, 0.25)
    assert type(full.allowed) is bool
    assert type(full.limit) is int and type(full.remaining) is int
    for name in ("retry_after", "reset_after", "window", "delay"):
        assert type(getattr(full, name)) is float, name
    assert type(full.rule) is str


def test_keyword_construction(backend):
    d = backend.Decision(
        allowed=False,
        limit=3,
        remaining=0,
        retry_after=2.0,
        reset_after=4.0,
        rule="r",
        window=6.0,
        delay=0.0,
    )
    assert fields(d) == (False, 3, 0, 2.0, 4.0, "r", 6.0, 0.0)


def test_limiter_decisions_have_the_declared_types(limiter_cls, backend):
    limiter = limiter_cls(2, 1.0, clock=backend.FakeClock(1000.0), rule="r")
    for d in [limiter.allow("k") for _ in range(3)] + [limiter.peek("k")]:
        assert isinstance(d, backend.Decision)
        assert type(d.allowed) is bool
        assert type(d.limit) is int and type(d.remaining) is int
        assert type(d.retry_after) is float and type(d.reset_after) is float
        assert type(d.window) is float and type(d.delay) is float
        assert d.retry_after >= 0.0 and d.reset_after >= 0.0 and d.remaining >= 0


@pytest.mark.parametrize("name", FIELDS)
def test_frozen(allowed, name):
    before = fields(allowed)
    with pytest.raises(AttributeError):
        setattr(allowed, name, getattr(allowed, name))
    with pytest.raises(AttributeError):
        delattr(allowed, name)
    assert fields(allowed) == before


def test_no_new_attributes(allowed):
    with pytest.raises(AttributeError):
        allowed.extra = 1


def test_equality_and_hash(backend, allowed):
    twin = backend.Decision(True, 5, 4, 0.0, 12.0, "api", 60.0)
    assert allowed == twin
    assert not (allowed != twin)
    assert hash(allowed) == hash(twin)
    assert len({allowed, twin}) == 1
    base = list(fields(allowed))
    changed = [False, 6, 3, 0.5, 11.0, "web", 30.0, 0.1]
    for i, value in enumerate(changed):
        other = list(base)
        other[i] = value
        assert allowed != backend.Decision(*other), FIELDS[i]
    assert allowed != fields(allowed)
    assert allowed != object()
    assert allowed is not None


def test_repr_round_trips(backend, allowed, denied):
    for d in (allowed, denied, backend.Decision(True, 1, 0, 0.0, 0.1, "it's", 1 / 3, 0.2)):
        text = repr(d)
        assert text.startswith("Decision(")
        for name in FIELDS:
            assert f"{name}={getattr(d, name)!r}" in text
        assert eval(text, {"Decision": backend.Decision}) == d


@pytest.mark.parametrize("protocol", range(pickle.HIGHEST_PROTOCOL + 1))
def test_pickle_round_trip(backend, allowed, denied, protocol):
    for d in (allowed, denied):
        back = pickle.loads(pickle.dumps(d, protocol=protocol))
        assert type(back) is backend.Decision
        assert back == d
        assert fields(back) == fields(d)


def test_copy(allowed):
    assert copy.copy(allowed) == allowed
    assert copy.deepcopy(allowed) == allowed


# --------------------------------------------------------------------------
# headers (docs/spec.md §2)


def test_headers_allowed(allowed):
    assert allowed.headers(wall_now=WALL) == {
        "X-RateLimit-Limit": "5",
        "X-RateLimit-Remaining": "4",
        "X-RateLimit-Reset": "1700000012",  # ceil(WALL + 12.0)
        "RateLimit-Policy": '"api";q=5;w=60',  # w=60, never w=60.0
        "RateLimit": '"api";r=4;t=12',
    }


def test_headers_denied(denied):
    assert denied.headers(wall_now=WALL + 0.25) == {
        "X-RateLimit-Limit": "5",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "1700000060",  # ceil(1_700_000_000.25 + 59.2)
        "RateLimit-Policy": '"api";q=5;w=1',  # window 0.5 rounds up to 1
        "RateLimit": '"api";r=0;t=60',  # ceil(59.2)
        "Retry-After": "12",  # ceil(11.5)
    }


@pytest.mark.parametrize(
    ("window", "w"),
    [(0.5, "1"), (1e-6, "1"), (1.0, "1"), (1.5, "2"), (60.0, "60"), (3600.0, "3600")],
)
def test_policy_window_whole_seconds_at_least_one(backend, window, w):
    d = backend.Decision(True, 7, 6, 0.0, 0.0, "r", window)
    assert d.headers(wall_now=WALL)["RateLimit-Policy"] == f'"r";q=7;w={w}'


@pytest.mark.parametrize(
    ("retry_after", "header"),
    [(0.0001, "1"), (0.0, "1"), (1.0, "1"), (1.0001, "2"), (12.0, "12"), (59.999, "60")],
)
def test_retry_after_is_never_zero(backend, retry_after, header):
    d = backend.Decision(False, 5, 0, retry_after, retry_after, "", 60.0)
    assert d.headers(wall_now=WALL)["Retry-After"] == header


def test_remaining_never_below_zero(backend):
    d = backend.Decision(False, 5, -3, 1.0, 1.0, "r", 60.0)
    headers = d.headers(wall_now=WALL)
    assert headers["X-RateLimit-Remaining"] == "0"
    assert headers["RateLimit"] == '"r";r=0;t=1'


@pytest.mark.parametrize(
    ("wall_now", "reset_after", "expected"),
    [
        (WALL, 0.0, "1700000000"),
        (WALL + 0.5, 0.0, "1700000001"),
        (WALL, 0.001, "1700000001"),
        (WALL + 0.25, 0.75, "1700000001"),
    ],
)
def test_reset_header_is_a_ceiled_unix_time(backend, wall_now, reset_after, expected):
    d = backend.Decision(True, 5, 5, 0.0, reset_after, "", 60.0)
    headers = d.headers(wall_now=wall_now)
    assert headers["X-RateLimit-Reset"] == expected
    assert headers["RateLimit"] == f'"";r=5;t={math.ceil(reset_after)}'


def test_headers_default_to_the_wall_clock(backend):
    d = backend.Decision(True, 5, 4, 0.0, 12.5, "", 60.0)
    before = time.time()
    reset = int(d.headers()["X-RateLimit-Reset"])
    after = time.time()
    assert math.ceil(before + 12.5) <= reset <= math.ceil(after + 12.5)


def test_headers_of_a_limiter_decision(backend):
    limiter = backend.TokenBucket(5, 60, clock=backend.FakeClock(WALL), rule="search")
    for _ in range(5):
        limiter.allow("k")
    headers = limiter.allow("k").headers(wall_now=WALL)
    # level 0 after 5 at once: reset_after = 5 / (5/60) = 60 s; retry 12 s
    assert headers == {
        "X-RateLimit-Limit": "5",
        "X-RateLimit-Remaining": "0",
        "X-RateLimit-Reset": "1700000060",
        "RateLimit-Policy": '"search";q=5;w=60',
        "RateLimit": '"search";r=0;t=60',
        "Retry-After": "12",
    }


# --------------------------------------------------------------------------
# BatchResult


@pytest.fixture
def batch(backend):
    limiter = backend.FixedWindowCounter(3, 10.0, clock=backend.FakeClock(1000.0), rule="b")
    return limiter.allow_many(["k", "k", "other", "k", "k"], [1, 2, 3, 1, 1])


def test_batch_len_and_allowed_count(batch):
    assert len(batch) == 5
    assert batch.allowed_count == 3
    assert [bool(a) for a in batch.allowed] == [True, True, True, False, False]


def test_batch_getitem(backend, batch):
    first = batch[0]
    assert isinstance(first, backend.Decision)
    # fixed window 3 per 10 s from t = 1000: window [1000, 1010)
    assert fields(first) == (True, 3, 2, 0.0, 10.0, "b", 10.0, 0.0)
    assert fields(batch[3]) == (False, 3, 0, 10.0, 10.0, "b", 10.0, 0.0)
    assert batch[-1] == batch[4]
    assert batch[-5] == batch[0]
    for bad in (5, -6):
        with pytest.raises(IndexError):
            batch[bad]


def test_batch_slice_and_iter(batch):
    items = list(batch)
    assert len(items) == 5
    assert batch[1:3] == items[1:3]
    assert batch[::-1] == items[::-1]
    assert batch[10:] == []
    assert [d.allowed for d in batch] == [True, True, True, False, False]
    assert [fields(d) for d in batch] == [fields(batch[i]) for i in range(5)]


def test_batch_arrays_match_items(batch):
    assert list(batch.remaining) == [d.remaining for d in batch]
    assert list(batch.retry_after) == [d.retry_after for d in batch]
    assert list(batch.reset_after) == [d.reset_after for d in batch]
    assert list(batch.delay) == [d.delay for d in batch]


def test_empty_batch(backend):
    limiter = backend.TokenBucket(3, 1.0, clock=backend.FakeClock(1000.0))
    empty = limiter.allow_many([])
    assert len(empty) == 0
    assert list(empty) == []
    assert empty.allowed_count == 0
    with pytest.raises(IndexError):
        empty[0]


@pytest.mark.native
@pytest.mark.parametrize(
    "verdict",
    [
        (True, 4.0, 0.0, 1.5, 0.0),
        (False, -0.5, 2.25, 3.0, 0.0),
        (True, 9.99, 0.0, 0.0, 0.125, False),
        (False, 0.0, 1.0, 1.0, 0.0, True),
        (False, 0.0, 1.0, 1.0, 0.0, True, "store_unavailable"),
        (True, 2.0**40 + 0.5, 0.0, 1.0, 0.0, False, ""),
        (1, 3, 0, 1, 0),  # ints where floats are usual
        [False, 1.0, 0.5, 0.5, 0.0, True, "storage_full"],  # not a tuple: the general path
    ],
)
def test_a_storage_verdict_becomes_the_same_decision_in_both_twins(native, verdict) -> None:
    """The native limiter turns a KernelStorage's verdict tuple into a
    Decision in C; the reference limiter in Python. Same fields, same types."""
    from nanolimit import reference

    got = native.TokenBucket(10, 1.0, rule="r")._decision(verdict)
    want = reference.TokenBucket(10, 1.0, rule="r")._decision(verdict)
    assert got == want
    assert [type(getattr(got, f)) for f in FIELDS] == [type(getattr(want, f)) for f in FIELDS]


def test_an_infinite_remaining_from_a_storage_is_refused_in_both_twins(native) -> None:
    """A C cast of infinity to int64 is undefined (it read as -2**63): the
    native limiter refuses it as the reference does."""
    from nanolimit import reference

    for module in (native, reference):
        with pytest.raises(OverflowError):
            module.TokenBucket(10, 1.0)._decision((True, math.inf, 0.0, 0.0, 0.0))


@pytest.mark.parametrize("kind", [pytest.param("native", marks=pytest.mark.native), "python"])
def test_event_counters_lose_no_count_under_threads(request, kind: str) -> None:
    import threading

    from nanolimit._protocols import LockedCounter

    if kind == "native":
        native = request.getfixturevalue("native")
        counter = native.EventCounter()
    else:
        counter = LockedCounter()
    barrier = threading.Barrier(8)

    def work() -> None:
        barrier.wait()
        for _ in range(20_000):
            counter.add()
        counter.add(5)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert counter.value == 8 * 20_005


# -- the native Decision pool: dead Decisions are reused by the hot path ------


def _storage_full_then_fresh(module):
    """A degraded storage_full denial under rule "full", then an ordinary
    decision of a slow GCRA under rule "fresh": every field differs."""
    from nanolimit import FakeClock

    clock = FakeClock(50.0)
    storage = module.InMemoryStorage(stripes=1, max_keys=1, on_full="deny_new")
    full = module.TokenBucket(5, 1.0, storage, clock, rule="full")
    every = (*FIELDS, "degraded", "reason")
    full.allow("a")
    refused = tuple(getattr(full.allow("b"), f) for f in every)  # dead at once: pooled
    fresh = module.GCRA(3, 7.0, clock=clock, rule="fresh")
    return [refused] + [tuple(getattr(fresh.allow("k", 2), f) for f in every) for _ in range(3)]


@pytest.mark.native
def test_a_reused_decision_keeps_nothing_of_its_last_life(native) -> None:
    """The pool hands back objects whose fields hold the last decision's
    values: every one must be overwritten (a field left unset would show
    the storage_full denial's rule, reason or numbers here)."""
    from nanolimit import reference

    if native._decision_pool_size() < 0:
        pytest.skip("this build of CPython has no Decision pool (free-threaded or debug)")
    got = _storage_full_then_fresh(native)
    assert native._decision_pool_size() > 0
    assert got == _storage_full_then_fresh(reference)
    assert got[0][8:] == (True, "storage_full")
    assert [d[8:] for d in got[1:]] == [(False, "")] * 3


@pytest.mark.native
def test_a_live_decision_is_never_reused(native) -> None:
    from nanolimit import FakeClock

    limiter = native.TokenBucket(300, 1.0, clock=FakeClock(0.0))
    kept = [limiter.allow("k") for _ in range(300)]
    for _ in range(500):
        limiter.peek("k")  # churns the pool
    assert len({id(d) for d in kept}) == 300
    assert [d.remaining for d in kept] == list(range(299, -1, -1))


@pytest.mark.native
def test_the_pool_holds_at_most_64_and_releases_what_it_held(native) -> None:
    """A pooled Decision still references its rule name; the pool is
    bounded, and reusing an object drops its old references."""
    import sys

    if native._decision_pool_size() < 0:
        pytest.skip("this build of CPython has no Decision pool (free-threaded or debug)")
    rule = "".join(["pool-", "rule"])  # a string of this test's own
    limiter = native.TokenBucket(10**6, 1.0, rule=rule)
    base = sys.getrefcount(rule)
    for _ in range(1000):
        limiter.allow("k")
    assert native._decision_pool_size() <= 64
    assert sys.getrefcount(rule) - base <= 64
    other = native.TokenBucket(10**6, 1.0, rule="other")
    for _ in range(1000):
        other.allow("k")
    assert sys.getrefcount(rule) == base
