"""Hypothesis equivalence: the native twin against the pure-Python reference.

docs/spec.md §4: with the same sequence of (key, now, cost) every implementation
returns the same ``allowed`` and ``remaining``, and ``retry_after`` /
``reset_after`` equal to 1e-9 s. The state snapshots must agree bit for bit:
the twins evaluate the same IEEE-double formulas in the same order, so any
difference is a bug in one of them, never a tolerance to widen.

This module imports both twins directly (the deliberate exception to the
fixture rule): it compares them, so it needs both at once.
"""

from __future__ import annotations

import importlib
import math
import os
from typing import NamedTuple

import pytest
from _helpers import DictStorage, needs_shared_memory
from hypothesis import example, given, settings
from hypothesis import strategies as st

import nanolimit.reference as reference
from nanolimit._clocks import FakeClock
from nanolimit._limiter_config import LIMITER_CLASS_NAMES

pytestmark = pytest.mark.native


@pytest.fixture(scope="module")
def native(request: pytest.FixtureRequest):
    # A native twin that fails to import is an ERROR of every test here (as
    # in conftest), never a skip, unless the pure twin was asked for; the
    # `native` marker lets `-m "not native"` deselect the whole module.
    if os.environ.get("NANOLIMIT_NO_EXTENSIONS"):
        pytest.skip("NANOLIMIT_NO_EXTENSIONS is set: no native twin to compare with the reference")
    return importlib.import_module("nanolimit._core")


ALGORITHMS = (
    "token_bucket",
    "leaky_bucket",
    "fixed_window",
    "sliding_log",
    "sliding_counter",
    "gcra",
)
CLASS_NAMES = LIMITER_CLASS_NAMES
BURST_ALGORITHMS = ("token_bucket", "gcra")
KEYS = ("a", "b", "ключ", "2001:db8:85a3::8a2e:370:7334")  # the last is over 16 bytes
START = 1.8e9
TOLERANCE = 1e-9

EQUIVALENCE = settings(max_examples=300, deadline=None, derandomize=False)


class Step(NamedTuple):
    """One operation. ``move`` changes the clock first: ("dt", seconds) adds
    (possibly negative), ("boundary", n) jumps to window index floor(t/w) + n
    exactly, as (k * window), and ("at", t) sets an absolute time."""

    op: str  # allow | peek | reset | many
    keys: tuple[str, ...]
    costs: tuple[int, ...]
    move: tuple[str, float]


class Scenario(NamedTuple):
    algorithm: str
    limit: int
    window: float
    burst: int | None
    rule: str
    start: float
    steps: tuple[Step, ...]


# --------------------------------------------------------------------------
# Strategies

WINDOWS = st.one_of(
    st.floats(min_value=0.05, max_value=3600.0, allow_nan=False, allow_infinity=False),
    st.sampled_from([0.1, 0.3, 0.05, 1 / 3, 0.7, 1.0, 60.0, 3600.0]),
)


def moves(window: float) -> st.SearchStrategy[tuple[str, float]]:
    small = st.floats(min_value=0.0, max_value=0.3).map(lambda f: ("dt", f * window))
    medium = st.floats(min_value=0.0, max_value=1.5).map(lambda f: ("dt", f * window))
    zero = st.just(("dt", 0.0))
    boundary = st.tuples(st.just("boundary"), st.integers(min_value=1, max_value=2))
    backward = st.floats(min_value=0.0, max_value=5.0).map(lambda f: ("dt", -f * window))
    # one_of picks a branch uniformly: repeat to weight (mostly small steps forward).
    return st.one_of(small, small, medium, zero, zero, boundary, backward)


def costs_for(capacity: int) -> st.SearchStrategy[int]:
    return st.one_of(st.just(1), st.integers(min_value=1, max_value=capacity))


def steps(window: float, capacity: int) -> st.SearchStrategy[Step]:
    key = st.sampled_from(KEYS)
    cost = costs_for(capacity)
    single = st.builds(
        lambda op, k, c, m: Step(op, (k,), (c,), m),
        st.sampled_from(["allow", "allow", "allow", "allow", "peek", "reset"]),
        key,
        cost,
        moves(window),
    )
    pair = st.builds(
        lambda ks, cs, m: Step("many", tuple(ks), tuple(cs), m),
        st.lists(key, min_size=2, max_size=2),
        st.lists(cost, min_size=2, max_size=2),
        moves(window),
    )
    return st.one_of(single, single, single, pair)


@st.composite
def configs(draw):
    algorithm = draw(st.sampled_from(ALGORITHMS))
    limit = draw(st.integers(min_value=1, max_value=50))
    burst = None
    if algorithm in BURST_ALGORITHMS:
        burst = draw(st.none() | st.integers(min_value=1, max_value=60))
    window = draw(WINDOWS)
    rule = draw(st.sampled_from(["", "api"]))
    start = draw(
        st.one_of(
            st.just(START),
            st.floats(min_value=START - 1e5, max_value=START + 1e5),
        )
    )
    return algorithm, limit, window, burst, rule, start


@st.composite
def scenarios(draw, max_steps: int = 60):
    algorithm, limit, window, burst, rule, start = draw(configs())
    capacity = burst or limit
    trace = draw(st.lists(steps(window, capacity), max_size=max_steps))
    return Scenario(algorithm, limit, window, burst, rule, start, tuple(trace))


# --------------------------------------------------------------------------
# Driving both twins


def build(module, scenario: Scenario, storage=None):
    cls = getattr(module, CLASS_NAMES[scenario.algorithm])
    clock = FakeClock(scenario.start)
    kwargs = {} if scenario.burst is None else {"burst": scenario.burst}
    limiter = cls(scenario.limit, scenario.window, storage, clock, scenario.rule, **kwargs)
    return limiter, clock


def move_clock(t: float, move: tuple[str, float], window: float) -> float:
    kind, x = move
    if kind == "dt":
        return t + x
    if kind == "boundary":
        return (math.floor(t / window) + int(x)) * window
    return float(x)


def assert_same_decision(n, r, where: str) -> None:
    assert type(n.allowed) is bool, where
    assert (n.allowed, n.remaining) == (r.allowed, r.remaining), where
    assert (n.limit, n.rule, n.window) == (r.limit, r.rule, r.window), where
    assert abs(n.retry_after - r.retry_after) <= TOLERANCE, (where, n.retry_after, r.retry_after)
    assert abs(n.reset_after - r.reset_after) <= TOLERANCE, (where, n.reset_after, r.reset_after)
    assert abs(n.delay - r.delay) <= TOLERANCE, (where, n.delay, r.delay)


def assert_same_states(nat, ref, where: str) -> None:
    for key in KEYS:
        # exact: the twins must agree bit for bit (see the module docstring)
        assert nat.state(key) == ref.state(key), (where, key)


def check_scenario(native, scenario: Scenario, native_storage=None, reference_storage=None) -> None:
    nat, nat_clock = build(native, scenario, native_storage)
    ref, ref_clock = build(reference, scenario, reference_storage)
    t = scenario.start
    for i, step in enumerate(scenario.steps):
        t = move_clock(t, step.move, scenario.window)
        nat_clock.set(t)
        ref_clock.set(t)
        where = f"step {i} at t={t!r}: {step}"
        if step.op == "reset":
            assert nat.reset(step.keys[0]) is None
            ref.reset(step.keys[0])
        elif step.op == "many":
            n_batch = nat.allow_many(list(step.keys), list(step.costs))
            r_batch = ref.allow_many(list(step.keys), list(step.costs))
            assert len(n_batch) == len(r_batch) == len(step.keys), where
            for j in range(len(step.keys)):
                assert_same_decision(n_batch[j], r_batch[j], f"{where} item {j}")
        else:
            n = getattr(nat, step.op)(step.keys[0], step.costs[0])
            r = getattr(ref, step.op)(step.keys[0], step.costs[0])
            assert isinstance(n, native.Decision), where
            assert_same_decision(n, r, where)
        assert_same_states(nat, ref, where)


# --------------------------------------------------------------------------
# Pinned regressions


def at(t: float, op: str = "allow", key: str = "a", cost: int = 1) -> Step:
    return Step(op, (key,), (cost,), ("at", t))


def boundary(n: int = 1, op: str = "allow", key: str = "a", cost: int = 1) -> Step:
    return Step(op, (key,), (cost,), ("boundary", n))


def repeat(n: int, op: str = "allow", key: str = "a", cost: int = 1) -> tuple[Step, ...]:
    return tuple(Step(op, (key,), (cost,), ("dt", 0.0)) for _ in range(n))


# Window 0.1 on exact window boundaries k * 0.1: where k * w - w and
# (k - 1) * w differ in the last bit (docs/spec.md §4).
WINDOW_01_BOUNDARIES = tuple(
    step
    for _ in range(6)
    for step in (boundary(1, "allow", "a", 2), *repeat(2, "allow", "a", 2), boundary(1, "peek", "a", 3))
)
# GCRA 100 per 60 s, full burst: T = 600 000 us; 100 fit exactly, the 101st waits 0.6 s.
GCRA_FULL_BURST = (*repeat(9, cost=11), *repeat(2, cost=1), *repeat(1, cost=1), at(START + 0.6))
BACKWARDS = (
    *repeat(3),
    Step("allow", ("a",), (2,), ("dt", 0.75)),
    Step("allow", ("a",), (1,), ("dt", -3.0)),
    Step("many", ("a", "b"), (1, 1), ("dt", -100.0)),
    Step("peek", ("a",), (4,), ("dt", 0.25)),
    Step("allow", ("a",), (4,), ("boundary", 1)),
)


@EQUIVALENCE
@given(scenario=scenarios())
@example(scenario=Scenario("fixed_window", 5, 0.1, None, "", START, WINDOW_01_BOUNDARIES))
@example(scenario=Scenario("sliding_counter", 5, 0.1, None, "api", START, WINDOW_01_BOUNDARIES))
@example(scenario=Scenario("sliding_log", 5, 0.1, None, "", START, WINDOW_01_BOUNDARIES))
@example(scenario=Scenario("sliding_counter", 7, 1 / 3, None, "", START + 0.1, WINDOW_01_BOUNDARIES))
@example(scenario=Scenario("gcra", 100, 60.0, None, "", START, GCRA_FULL_BURST))
@example(scenario=Scenario("gcra", 100, 60.0, 100, "", START, GCRA_FULL_BURST))
@example(scenario=Scenario("gcra", 3, 0.3, 5, "", START, BACKWARDS))
@example(scenario=Scenario("token_bucket", 5, 1.0, 5, "", START, BACKWARDS))
@example(scenario=Scenario("leaky_bucket", 5, 1.0, None, "", START, BACKWARDS))
@example(scenario=Scenario("sliding_log", 5, 1.0, None, "", START, BACKWARDS))
@example(scenario=Scenario("sliding_counter", 5, 1.0, None, "", START, BACKWARDS))
@example(scenario=Scenario("fixed_window", 5, 1.0, None, "", START, BACKWARDS))
def test_traces_agree(native, scenario: Scenario) -> None:
    check_scenario(native, scenario)


# Clock readings where floor() and truncation part ways (negative, just
# under a boundary, signed zeros, subnormals, near ±MAX_TIME): the native twin
# floors with integer arithmetic, and its window indexes and GCRA
# microseconds must still be the reference's to the bit.
FLOOR_EDGES = (
    -4503599626.5,
    -7.25,
    -3.0,
    -2.9999999999999996,
    -0.3,
    -1e-300,
    -0.0,
    0.0,
    5e-324,
    0.3,
    2.9999999999999996,
    3.0,
    4294967296.5,
    4503599626.75,
)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("window", [0.3, 1.5])
def test_floor_edges_agree(native, algorithm: str, window: float) -> None:
    trace = tuple(
        step
        for i, t in enumerate(FLOOR_EDGES)
        for step in (
            at(t, "allow", KEYS[i % 3], 2),
            at(t, "peek", KEYS[(i + 1) % 3]),
            at(t, "allow", KEYS[i % 3]),
        )
    )
    check_scenario(native, Scenario(algorithm, 4, window, None, "", FLOOR_EDGES[0], trace))


def test_gcra_full_burst_pin() -> None:
    # The pinned GCRA example must really exercise the full burst.
    lim, _ = build(reference, Scenario("gcra", 100, 60.0, None, "", START, ()))
    got = [lim.allow("a", 11).allowed for _ in range(9)] + [lim.allow("a").allowed for _ in range(2)]
    assert got == [True] * 10 + [False]


@st.composite
def batch_scenarios(draw):
    algorithm, limit, window, burst, rule, start = draw(configs())
    capacity = burst or limit
    batches = draw(
        st.lists(
            st.tuples(
                moves(window),
                st.lists(st.tuples(st.sampled_from(KEYS), costs_for(capacity)), max_size=20),
            ),
            max_size=8,
        )
    )
    return Scenario(algorithm, limit, window, burst, rule, start, ()), batches


def check_batches(native, case, native_storage=None) -> None:
    scenario, batches = case
    nat, nat_clock = build(native, scenario, native_storage)
    ref, ref_clock = build(reference, scenario)
    t = scenario.start
    for i, (move, items) in enumerate(batches):
        t = move_clock(t, move, scenario.window)
        nat_clock.set(t)
        ref_clock.set(t)
        keys = [k for k, _ in items]
        costs = [c for _, c in items]
        n = nat.allow_many(keys, costs)
        r = ref.allow_many(keys, costs)
        where = f"batch {i} at t={t!r}"
        assert len(n) == len(r) == len(items), where
        assert [bool(x) for x in n.allowed] == [bool(x) for x in r.allowed], where
        assert list(n.remaining) == list(r.remaining), where
        assert n.allowed_count == r.allowed_count, where
        for name in ("retry_after", "reset_after", "delay"):
            for j, (a, b) in enumerate(zip(getattr(n, name), getattr(r, name))):
                assert abs(a - b) <= TOLERANCE, (where, name, j, a, b)
        for j in range(len(items)):
            assert_same_decision(n[j], r[j], f"{where} item {j}")
        assert_same_states(nat, ref, where)


@EQUIVALENCE
@given(case=batch_scenarios())
def test_batches_agree(native, case) -> None:
    check_batches(native, case)


@EQUIVALENCE
@given(scenario=scenarios(max_steps=30))
def test_traces_agree_on_a_user_storage(native, scenario: Scenario) -> None:
    # The generic apply seam (docs/spec.md §5): each twin on its own user-written storage.
    check_scenario(native, scenario, DictStorage(), DictStorage())


def fresh_zone(native):
    """A shared-memory zone for one example, its name unlinked at once (it
    lives while the object does)."""
    import uuid

    zone = native.SharedMemoryStorage(f"nltest-{uuid.uuid4().hex[:16]}", max_keys=1024, stripes=16)
    zone.unlink()
    return zone


@EQUIVALENCE
@given(scenario=scenarios())
@example(scenario=Scenario("sliding_log", 5, 0.1, None, "", START, WINDOW_01_BOUNDARIES))
@example(scenario=Scenario("gcra", 100, 60.0, None, "", START, GCRA_FULL_BURST))
@example(scenario=Scenario("sliding_log", 5, 1.0, None, "", START, BACKWARDS))
@example(scenario=Scenario("sliding_counter", 5, 1.0, None, "", START, BACKWARDS))
@needs_shared_memory
def test_traces_agree_on_a_zone(native, scenario: Scenario) -> None:
    # The shared-memory zone decides with the same kernels on its own entries
    # (rings in its arena, long keys as digests): bit for bit the reference.
    check_scenario(native, scenario, fresh_zone(native), None)


@needs_shared_memory
@EQUIVALENCE
@given(case=batch_scenarios())
def test_batches_agree_on_a_zone(native, case) -> None:
    check_batches(native, case, fresh_zone(native))
