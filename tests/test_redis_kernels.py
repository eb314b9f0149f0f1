"""The six Lua kernels against the in-memory reference, on real Redis 7 and
Valkey 9 servers: hypothesis equivalence with an injected clock, the docs/spec.md §7
scenarios, and 8 threads on one key."""

from __future__ import annotations

import math
import threading
import types
from typing import Any

import pytest
from _helpers import FIELDS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanolimit import reference
from nanolimit._limiter_config import Algorithm, LimiterConfig
from nanolimit.storage.redis._scripts import SCRIPTS

pytest_plugins = ["redis_servers"]  # the server fixtures

ALGORITHMS = ("token_bucket", "leaky_bucket", "fixed_window", "sliding_log", "sliding_counter", "gcra")
TOLERANCE = 1e-9
KEYS = ("a", "b", "ключ")


def assert_same(got: Any, want: Any, where: str = "") -> None:
    """Identical allowed/remaining/limit/rule/window, 1e-9 s on the floats."""
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        if isinstance(w, float) and name != "window":
            assert math.isclose(g, w, rel_tol=0.0, abs_tol=TOLERANCE), f"{where} {name}: {g!r} != {w!r}"
        else:
            assert g == w, f"{where} {name}: {g!r} != {w!r}"
    assert not got.degraded, f"{where}: degraded decision from a healthy server"


# --------------------------------------------------------------------------
# Hypothesis equivalence


@st.composite
def scenarios(draw: Any, algorithm: str) -> dict[str, Any]:
    window = draw(
        st.one_of(
            st.sampled_from([0.1, 0.3, 1 / 3, 0.7, 1.0, 60.0, 3600.0]),
            st.floats(min_value=0.05, max_value=3600.0, allow_nan=False),
        )
    )
    limit = draw(st.integers(min_value=1, max_value=12))
    burst = None
    if algorithm in ("token_bucket", "gcra"):
        burst = draw(st.one_of(st.none(), st.integers(min_value=1, max_value=15)))
    capacity = burst if burst is not None else limit
    start = draw(st.sampled_from([0.0, 1.0, 1.8e9, 1_000_000.9, 12345.678]))
    move = st.one_of(
        st.floats(min_value=0.0, max_value=0.3).map(lambda f: ("dt", f * window)),
        st.floats(min_value=0.0, max_value=1.5).map(lambda f: ("dt", f * window)),
        st.just(("dt", 0.0)),
        st.integers(min_value=1, max_value=2).map(lambda n: ("boundary", n)),
        st.floats(min_value=0.0, max_value=3.0).map(lambda f: ("dt", -f * window)),
    )
    cost = st.one_of(st.just(1), st.integers(min_value=1, max_value=capacity))
    step = st.one_of(
        st.tuples(
            st.sampled_from(["allow", "allow", "allow", "peek", "reset"]), st.sampled_from(KEYS), cost, move
        ),
        st.tuples(
            st.just("many"),
            st.lists(st.tuples(st.sampled_from(KEYS), cost), min_size=1, max_size=5),
            st.just(0),
            move,
        ),
    )
    steps = draw(st.lists(step, min_size=1, max_size=30))
    return {"window": window, "limit": limit, "burst": burst, "start": start, "steps": steps}


def _move(clock: Any, move: tuple[str, float], window: float) -> None:
    kind, amount = move
    if kind == "dt":
        clock.advance(amount)
    else:
        clock.set(math.floor(clock.now() / window + amount) * window)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_lua_kernels_equal_the_reference(
    backend: types.SimpleNamespace, make_storage: Any, algorithm: str, data: Any
) -> None:
    scenario = data.draw(scenarios(algorithm))
    storage = make_storage()
    storage.client.flushdb()
    clock = backend.FakeClock(scenario["start"])
    ref_clock = reference.FakeClock(scenario["start"])
    kwargs = {} if scenario["burst"] is None else {"burst": scenario["burst"]}
    window = scenario["window"]
    on_redis = backend.limiters[algorithm](scenario["limit"], window, storage, clock, "r:1", **kwargs)
    in_memory = reference.LIMITERS[reference.Algorithm(algorithm)](
        scenario["limit"], window, None, ref_clock, "r:1", **kwargs
    )
    for i, (op, key, cost, move) in enumerate(scenario["steps"]):
        _move(clock, move, window)
        ref_clock.set(clock.now())
        where = f"step {i} {op} t={clock.now()!r}"
        if op == "allow":
            assert_same(on_redis.allow(key, cost), in_memory.allow(key, cost), where)
        elif op == "peek":
            assert_same(on_redis.peek(key, cost), in_memory.peek(key, cost), where)
        elif op == "reset":
            on_redis.reset(key)
            in_memory.reset(key)
        else:
            keys = [k for k, _ in key]
            costs = [c for _, c in key]
            got = on_redis.allow_many(keys, costs)
            want = in_memory.allow_many(keys, costs)
            assert not got.degraded
            for j, (g, w) in enumerate(zip(got, want)):
                assert_same(g, w, f"{where} item {j}")
    for key in KEYS:
        assert on_redis.state(key) == in_memory.state(key), f"state of {key!r}"
    storage.client.close()


# --------------------------------------------------------------------------
# docs/spec.md §7 scenarios on the server


def test_token_bucket_seven_at_once(backend: types.SimpleNamespace, make_storage: Any) -> None:
    clock = backend.FakeClock(0.0)
    limiter = backend.TokenBucket(5, 60.0, make_storage(), clock, rule="tb")
    decisions = [limiter.allow("client") for _ in range(7)]
    assert [d.allowed for d in decisions] == [True] * 5 + [False] * 2
    headers = decisions[-1].headers(wall_now=0.0)
    assert headers["Retry-After"] == "12"
    assert headers["X-RateLimit-Remaining"] == "0"


SIXTH_RETRY = {
    "token_bucket": 0.2,
    "leaky_bucket": 0.2,
    "gcra": 0.2,
    "fixed_window": 1.0,
    "sliding_log": 1.0,
    "sliding_counter": 1.0,
}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_five_per_second_seven_at_zero(
    backend: types.SimpleNamespace, make_storage: Any, algorithm: str
) -> None:
    clock = backend.FakeClock(0.0)
    limiter = backend.limiters[algorithm](5, 1.0, make_storage(), clock, rule="r")
    decisions = [limiter.allow("k") for _ in range(7)]
    assert sum(d.allowed for d in decisions) == 5
    assert decisions[5].retry_after == pytest.approx(SIXTH_RETRY[algorithm], abs=1e-9)


def test_boundary_burst(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    clock = backend.FakeClock(1_000_000.9)
    fixed = backend.FixedWindowCounter(5, 1.0, storage, clock, rule="b")
    counter = backend.SlidingWindowCounter(5, 1.0, storage, clock, rule="b")
    first = [(fixed.allow("k").allowed, counter.allow("k").allowed) for _ in range(5)]
    clock.set(1_000_001.0)
    second = [(fixed.allow("k").allowed, counter.allow("k").allowed) for _ in range(5)]
    assert [f for f, _ in first + second] == [True] * 10
    assert [c for _, c in first] == [True] * 5
    assert [c for _, c in second] == [False] * 5


@pytest.mark.parametrize(
    ("algorithm", "clock_kind"),
    [(a, "fake") for a in ALGORITHMS] + [("token_bucket", "server"), ("sliding_log", "server")],
)
def test_eight_threads_on_one_key(
    backend: types.SimpleNamespace, make_storage: Any, algorithm: str, clock_kind: str
) -> None:
    """8 threads × 400 requests on one key, capacity 100: exactly 100 pass,
    judged by the real server (frozen fake clock, or the server's TIME with a
    window long enough that nothing refills during the test)."""
    storage = make_storage()
    clock = backend.FakeClock(1000.0) if clock_kind == "fake" else None
    limiter = backend.limiters[algorithm](100, 86400.0, storage, clock, rule="threads")
    counts = [0] * 8
    barrier = threading.Barrier(8)

    def work(slot: int) -> None:
        barrier.wait()
        for _ in range(400):
            if limiter.allow("hot").allowed:
                counts[slot] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert sum(counts) == 100
    assert storage.metrics()["degraded"] == 0


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_server_clock_decisions(backend: types.SimpleNamespace, make_storage: Any, algorithm: str) -> None:
    """With the default SystemClock the script reads the server's TIME; a
    long window makes the answers exact."""
    limiter = backend.limiters[algorithm](3, 3600.0, make_storage(), rule="srv")
    got = [limiter.allow("k") for _ in range(4)]
    assert [d.allowed for d in got] == [True, True, True, False]
    assert [d.remaining for d in got] == [2, 1, 0, 0]
    assert 0 < got[-1].retry_after <= 3600.0
    assert limiter.state("k").updated_at == pytest.approx(__import__("time").time(), abs=5.0)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_peek_writes_nothing_and_reset_forgets(
    backend: types.SimpleNamespace, make_storage: Any, algorithm: str
) -> None:
    storage = make_storage()
    clock = backend.FakeClock(50.0)
    limiter = backend.limiters[algorithm](2, 10.0, storage, clock, rule="p")
    assert limiter.peek("k").allowed
    assert len(storage) == 0 and limiter.state("k") is None
    limiter.allow("k", 2)
    assert not limiter.peek("k").allowed
    assert len(storage) == 1
    limiter.reset("k")
    assert len(storage) == 0
    assert limiter.allow("k", 2).allowed


def test_algorithm_is_part_of_the_key(backend: types.SimpleNamespace, make_storage: Any) -> None:
    """A rule switched from one algorithm to another never reads the other's state."""
    storage = make_storage()
    clock = backend.FakeClock(0.0)
    for algorithm in ALGORITHMS:
        limiter = backend.limiters[algorithm](1, 60.0, storage, clock, rule="same")
        assert limiter.allow("k").allowed, algorithm
    assert len(storage) == len(ALGORITHMS)


def test_big_sliding_log_cost_and_capacity_drop(backend: types.SimpleNamespace, make_storage: Any) -> None:
    """Costs above the Lua push chunk, and a capacity lowered by a hot reload."""
    storage = make_storage()
    clock = backend.FakeClock(0.0)
    big = backend.SlidingWindowLog(10_000, 10.0, storage, clock, rule="log")
    ref = reference.SlidingWindowLog(10_000, 10.0, None, reference.FakeClock(0.0), rule="log")
    assert_same(big.allow("k", 9_000), ref.allow("k", 9_000))
    assert_same(big.allow("k", 1_001), ref.allow("k", 1_001))
    clock.advance(1.0)
    ref._clock.advance(1.0)
    assert_same(big.allow("k", 1_000), ref.allow("k", 1_000))
    for dt in (9.5, 0.0, 0.25, 1.0):  # t=10.5: the 9,000 of t=0 expire (scanned in chunks)
        clock.advance(dt)
        ref._clock.advance(dt)
        assert_same(big.allow("k", 500), ref.allow("k", 500))
        assert_same(big.peek("k", 10_000), ref.peek("k", 10_000))
    assert big.state("k") == ref.state("k")
    small = backend.SlidingWindowLog(50, 10.0, storage, clock, rule="log")
    ref_small = reference.SlidingWindowLog(50, 10.0, ref.storage, ref._clock, rule="log")
    assert_same(small.allow("k"), ref_small.allow("k"))
    assert small.state("k") == ref_small.state("k")


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_reply_fields_are_exact_17g_strings(make_storage: Any, algorithm: str) -> None:
    """Each reply field is exactly what ``'%.17g'`` prints for its value (the
    scripts write a known 0 as a literal '0'), whether allowed or denied, so
    nothing is rounded on the way out; the token bucket's stored level, which
    the script formats itself, is that string too."""
    storage = make_storage()
    cfg = LimiterConfig.build(algorithm, 3, 0.7, rule="fmt")
    seen = set()
    for i, (now, cost) in enumerate([(10.0, 1), (10.05, 2), (10.1, 1), (10.3, 1), (10.9, 3), (11.0, 1)]):
        for commit in (False, True):
            keys, args = storage._single_args(cfg, "k", cost, now + i * 1e-7, commit)
            reply = storage._evalsha(SCRIPTS[Algorithm(algorithm)], keys, args)
            fields = reply.decode().split(" ")
            assert len(fields) == 6, reply  # ... delay, then the decision's time (Decision.at)
            assert fields[0] in ("0", "1")
            seen.add(fields[0])
            for text in fields[1:]:
                assert text == f"{float(text):.17g}", (algorithm, reply)
    assert seen == {"0", "1"}
    if algorithm == "token_bucket":
        level = storage.client.hget(storage.redis_key(cfg, "k"), "l").decode()
        assert level == f"{float(level):.17g}"
