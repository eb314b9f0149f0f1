"""``limiter.refund``: giving back what an admitted decision charged
(counting by response: charge on entry, refund what should not count).

Every test runs on the native table, the reference and a shared-memory zone
(``ZONE_SUITE``). The exact algorithms must end as if the charge was never
made; the buckets and GCRA as docs/algorithms.md (Refunds) says, inexact
case included. The twins must agree to the last bit, ``Decision.at`` too.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from collections.abc import Sequence
from typing import Any

import pytest
from _helpers import DictStorage, needs_shared_memory, rounds
from conftest import ALGORITHM_CLASSES, ALGORITHMS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanolimit._clocks import FakeClock
from nanolimit.errors import ValidationError

ZONE_SUITE = True
pytest_plugins = ["redis_servers"]  # the real servers of the two-tier test

T0 = 1000.0
LIMIT = 4
# 4 units per 8 s: a bucket's rate is 0.5/s, so every level below is an exact
# binary fraction and "the same as never charged" can be asserted with ==.
WINDOW = 8.0
EXACT = ("fixed_window", "sliding_log", "sliding_counter")


def make(backend: types.SimpleNamespace, algorithm: str, storage: Any = None, t: float = T0) -> Any:
    clock = backend.FakeClock(t)
    store = backend.InMemoryStorage() if storage is None else storage
    return backend.limiters[algorithm](LIMIT, WINDOW, store, clock), clock, store


def answers(limiter: Any, clock: Any, steps: Sequence[tuple[float, int]]) -> list[tuple[Any, ...]]:
    """(advance, cost) steps on key "k": every Decision field, ``at`` too."""
    out = []
    for dt, cost in steps:
        clock.advance(dt)
        d = limiter.allow("k", cost)
        out.append((*d._astuple(), d.at))
    return out


PROBE = [(0.0, 1), (0.0, 1), (0.25, 2), (0.5, 1), (0.0, 1), (3.0, 3), (0.0, 1)]


# ---------------------------------------------------------------- Decision.at


def test_decision_at_is_the_time_the_kernel_used(backend: types.SimpleNamespace, algorithm: str) -> None:
    limiter, clock, _ = make(backend, algorithm)
    first = limiter.allow("k")
    assert first.at == T0
    clock.advance(1.5)
    assert limiter.allow("k").at == T0 + 1.5
    assert limiter.peek("k").at == T0 + 1.5
    clock.set(T0)  # the clock stepped back: the key's own time does not
    assert limiter.allow("k").at == T0 + 1.5


def test_decision_at_is_outside_equality_but_pickled(backend: types.SimpleNamespace) -> None:
    a = backend.Decision(True, 5, 4, 0.0, 1.0, "r", 10.0, 0.0, False, "", 12.5)
    b = backend.Decision(True, 5, 4, 0.0, 1.0, "r", 10.0, 0.0, False, "")
    assert b.at == 0.0 and a.at == 12.5
    assert a == b and hash(a) == hash(b) and repr(a) == repr(b)
    assert "12.5" not in repr(a)
    back = pickle.loads(pickle.dumps(a))
    assert back == a and back.at == 12.5
    with pytest.raises(AttributeError):
        a.at = 1.0


def test_compound_decisions_carry_at(backend: types.SimpleNamespace) -> None:
    storage = backend.InMemoryStorage()
    clock = backend.FakeClock(T0)
    one = backend.limiters["fixed_window"](LIMIT, WINDOW, storage, clock, "one")
    two = backend.limiters["sliding_log"](LIMIT, WINDOW, storage, clock, "two")
    clock.advance(2.0)
    compound = storage.allow_all([(one, "k"), (two, "k")])
    assert [d.at for d in compound.decisions] == [T0 + 2.0, T0 + 2.0]
    two.refund("k", at=compound.decisions[1].at)
    assert two.state("k").log == ()


def test_a_degraded_decision_has_no_at(backend: types.SimpleNamespace) -> None:
    storage = backend.InMemoryStorage(stripes=1, max_keys=1, on_full="deny_new")
    limiter, _, _ = make(backend, "fixed_window", storage)
    assert limiter.allow("a").at == T0
    refused = limiter.allow("b")
    assert refused.degraded and refused.reason == "storage_full"
    assert refused.at == 0.0


# ---------------------------------------------------------------- exact refunds


@pytest.mark.parametrize("gap", [0.0, 0.5])
def test_refund_leaves_the_state_of_never_charging(
    backend: types.SimpleNamespace, algorithm: str, gap: float
) -> None:
    """Charge then refund, and the decisions after it are those of a trace
    that never charged (buckets too: nothing refilled to full in between)."""
    charged, clock_a, _ = make(backend, algorithm)
    plain, clock_b, _ = make(backend, algorithm)
    for lim in (charged, plain):
        lim.allow("k")
        lim.allow("k")
    d = charged.allow("k", 2)
    assert d.allowed
    clock_a.advance(gap)
    clock_b.advance(gap)
    charged.refund("k", 2, at=d.at)
    assert answers(charged, clock_a, PROBE) == answers(plain, clock_b, PROBE)


def test_inexact_bucket_case_is_as_documented(backend: types.SimpleNamespace, algorithm: str) -> None:
    """Buckets and GCRA: a charge the key refilled over (went idle) and a
    refund after a later request hands ``cost`` units more than the
    never-charged trace has, once; the exact algorithms do not."""
    charged, clock_a, _ = make(backend, algorithm)
    plain, clock_b, _ = make(backend, algorithm)
    d = charged.allow("k", 2)
    assert d.allowed
    for clock in (clock_a, clock_b):
        clock.advance(2 * WINDOW)  # full again (idle), and past both windows
    for lim in (charged, plain):
        assert lim.allow("k", LIMIT).allowed  # both spend everything
    charged.refund("k", 2, at=d.at)
    got_a = charged.allow("k", 2)
    got_b = plain.allow("k", 2)
    if algorithm in EXACT:
        assert got_a.allowed == got_b.allowed is False
    else:
        assert got_a.allowed and not got_b.allowed
        # once: after it, both are spent out alike
        assert not charged.allow("k", 1).allowed and not plain.allow("k", 1).allowed


def test_fixed_window_rollover_refunds_nothing(backend: types.SimpleNamespace) -> None:
    limiter, clock, _ = make(backend, "fixed_window")
    d = limiter.allow("k", 3)
    clock.advance(WINDOW)  # the next window: the charge expired with its own
    limiter.allow("k", 2)
    limiter.refund("k", 3, at=d.at)
    assert limiter.state("k").count == 2
    assert limiter.allow("k", 2).allowed and not limiter.allow("k", 1).allowed


def test_sliding_counter_refunds_the_previous_window_and_not_older(backend: types.SimpleNamespace) -> None:
    limiter, clock, _ = make(backend, "sliding_counter")
    plain, plain_clock, _ = make(backend, "sliding_counter")
    old = limiter.allow("k", 1)
    clock.advance(WINDOW)
    plain_clock.advance(WINDOW)
    d = limiter.allow("k", 2)  # window k
    for c in (clock, plain_clock):
        c.advance(WINDOW)  # window k + 1: d is in the previous one
    limiter.refund("k", 2, at=d.at)
    limiter.refund("k", 1, at=old.at)  # two windows back: expired, nothing
    state = limiter.state("k")
    assert (state.count, state.previous) == (0, 0)
    assert answers(limiter, clock, PROBE) == answers(plain, plain_clock, PROBE)


def test_sliding_log_removes_exactly_the_named_stamps(backend: types.SimpleNamespace) -> None:
    limiter, clock, _ = make(backend, "sliding_log")
    first = limiter.allow("k", 2)
    clock.advance(1.0)
    middle = limiter.allow("k", 1)
    clock.advance(1.0)
    limiter.allow("k", 1)  # a later request: its stamp stays
    limiter.refund("k", 3, at=middle.at)  # only one stamp has that time
    assert limiter.state("k").log == (T0, T0, T0 + 2.0)
    limiter.refund("k", 1, at=first.at)
    assert limiter.state("k").log == (T0, T0 + 2.0)
    limiter.refund("k", 1, at=T0 + 0.5)  # no such stamp: nothing
    assert limiter.state("k").log == (T0, T0 + 2.0)


def test_sliding_log_middle_refund_keeps_order_and_budget(backend: types.SimpleNamespace) -> None:
    limiter, clock, _ = make(backend, "sliding_log")
    stamps = []
    for _ in range(LIMIT):
        stamps.append(limiter.allow("k").at)
        clock.advance(1.0)
    limiter.refund("k", at=stamps[1])
    limiter.refund("k", at=stamps[2])
    assert limiter.state("k").log == (stamps[0], stamps[3])
    assert limiter.allow("k", 2).allowed and not limiter.allow("k").allowed


def test_sliding_log_expired_stamps_are_nothing_to_remove(backend: types.SimpleNamespace) -> None:
    limiter, clock, _ = make(backend, "sliding_log")
    d = limiter.allow("k", 2)
    clock.advance(WINDOW)  # the stamps expire at exactly ``window`` old
    limiter.allow("k", LIMIT)
    limiter.refund("k", 2, at=d.at)
    assert limiter.state("k").log == (T0 + WINDOW,) * LIMIT


def test_at_none_refunds_the_latest_decision(backend: types.SimpleNamespace, algorithm: str) -> None:
    charged, clock_a, _ = make(backend, algorithm)
    plain, clock_b, _ = make(backend, algorithm)
    for lim, clock in ((charged, clock_a), (plain, clock_b)):
        lim.allow("k")
        clock.advance(1.0)
    assert charged.allow("k").allowed
    charged.refund("k")
    assert charged.state("k").updated_at == T0 + 1.0
    assert answers(charged, clock_a, PROBE) == answers(plain, clock_b, PROBE)


# ---------------------------------------------------------------- bounds and input


def test_unknown_key_is_a_noop_and_creates_nothing(backend: types.SimpleNamespace, algorithm: str) -> None:
    limiter, _, storage = make(backend, algorithm)
    limiter.allow("held")
    limiter.refund("never-seen")
    limiter.refund("never-seen", at=T0)
    assert len(storage) == 1
    assert limiter.state("never-seen") is None


def test_refund_never_goes_above_a_fresh_key(backend: types.SimpleNamespace, algorithm: str) -> None:
    limiter, clock, _ = make(backend, algorithm)
    fresh, fresh_clock, _ = make(backend, algorithm)
    d = limiter.allow("k", 1)
    limiter.refund("k", LIMIT, at=d.at)  # more than was charged
    limiter.refund("k", LIMIT, at=d.at)  # and again
    assert answers(limiter, clock, PROBE) == answers(fresh, fresh_clock, PROBE)


@pytest.mark.parametrize(
    "bad",
    [
        {"key": ""},
        {"key": 7},
        {"key": "x" * 5000},
        {"cost": 0},
        {"cost": -1},
        {"cost": LIMIT + 1},
        {"cost": True},
        {"cost": 1.5},
        {"at": True},
        {"at": "1000.0"},
        {"at": math.nan},
        {"at": math.inf},
        {"at": -math.inf},
        {"at": 1e300},
        {"at": 10**400},
        {"at": object()},
    ],
    ids=lambda bad: f"{next(iter(bad))}={next(iter(bad.values()))!r}"[:24],
)
def test_bad_input_raises_and_changes_nothing(
    backend: types.SimpleNamespace, algorithm: str, bad: dict[str, Any]
) -> None:
    limiter, _, storage = make(backend, algorithm)
    d = limiter.allow("k", 2)
    before = limiter.state("k")
    args = {"key": "k", "cost": 1, "at": d.at, **bad}
    with pytest.raises(backend.ValidationError):
        limiter.refund(args["key"], args["cost"], at=args["at"])
    assert limiter.state("k") == before
    assert len(storage) == 1


def test_at_accepts_ints_and_other_reals(backend: types.SimpleNamespace) -> None:
    import fractions

    limiter, _, _ = make(backend, "fixed_window")
    limiter.allow("k", 2)
    limiter.refund("k", at=int(T0))
    limiter.refund("k", at=fractions.Fraction(int(T0)))
    assert limiter.state("k").count == 0


# ---------------------------------------------------------------- equivalence

OPS = st.lists(
    st.tuples(
        st.sampled_from(["allow", "allow", "refund", "refund_latest", "peek"]),
        st.integers(min_value=1, max_value=LIMIT),
        st.sampled_from([0.0, 0.0, 0.001, 0.25, 0.7, 1.0, 3.3, WINDOW, 2.5 * WINDOW]),
        st.integers(min_value=0, max_value=50),
        st.sampled_from(["a", "b"]),
    ),
    max_size=60,
)


def run_trace(module: Any, storage: Any, algorithm: str, ops: Any) -> list[Any]:
    clock = FakeClock(T0)
    limiter = getattr(module, ALGORITHM_CLASSES[algorithm])(LIMIT, WINDOW / 3, storage, clock)
    admitted: list[tuple[str, float]] = []
    out: list[Any] = []
    for op, cost, dt, pick, key in ops:
        clock.advance(dt)
        if op in ("allow", "peek"):
            d = limiter.allow(key, cost) if op == "allow" else limiter.peek(key, cost)
            out.append((*d._astuple(), d.at))
            if op == "allow" and d.allowed:
                admitted.append((key, d.at))
        elif op == "refund" and admitted:
            name, at = admitted[pick % len(admitted)]
            limiter.refund(name, cost, at=at)
        else:
            limiter.refund(key, cost)
        out.append(limiter.state(key))
    return out


@pytest.mark.native
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@settings(
    max_examples=rounds(150, 25),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(ops=OPS)
def test_twins_agree_on_traces_with_refunds(native: types.ModuleType, algorithm: str, ops: Any) -> None:
    reference = importlib.import_module("nanolimit.reference")
    want = run_trace(reference, reference.InMemoryStorage(), algorithm, ops)
    assert run_trace(native, native.InMemoryStorage(), algorithm, ops) == want
    zone = native.SharedMemoryStorage(f"nltest-{uuid.uuid4().hex[:16]}", max_keys=64)
    zone.unlink()
    try:
        assert run_trace(native, zone, algorithm, ops) == want
    finally:
        zone.close()


# ---------------------------------------------------------------- threads


def test_threads_allow_then_refund_end_at_a_fresh_key(backend: types.SimpleNamespace, algorithm: str) -> None:
    """Eight threads charging and refunding one key under a still clock: every
    refund gives back a charge that was admitted, so the key ends as fresh."""
    limiter, clock, _ = make(backend, algorithm)
    errors: list[BaseException] = []
    start = threading.Barrier(8)

    def work() -> None:
        try:
            start.wait()
            for _ in range(300):
                d = limiter.allow("hot")
                if d.allowed:
                    limiter.refund("hot", at=d.at)
        except BaseException as exc:  # reported below: a thread's error must fail the test
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads)
    fresh, fresh_clock, _ = make(backend, algorithm)
    fresh.allow("hot", 1)
    fresh.refund("hot", 1)
    assert limiter.state("hot") == fresh.state("hot")
    assert answers(limiter, clock, PROBE) == answers(fresh, fresh_clock, PROBE)


# ---------------------------------------------------------------- other storages


class RecordingKernelStore:
    """A KernelStorage of our own (protocol test): decides with the reference
    kernels in a dict and says the decision's time as Redis will, an eighth
    element, and records the refunds it is asked for."""

    def __init__(self, width: int = 8) -> None:
        self.reference = importlib.import_module("nanolimit.reference")
        self.inner = self.reference.InMemoryStorage()
        self.width = width
        self.refunds: list[tuple[Any, ...]] = []

    def _limiter(self, config: Any, now: float) -> Any:
        cls = getattr(self.reference, ALGORITHM_CLASSES[config.algorithm.value])
        return cls(
            config.limit, config.window_seconds, self.inner, self.reference.FakeClock(now), config.rule
        )

    def run_kernel(
        self, config: Any, key: str, cost: int, now: float | None, commit: bool
    ) -> tuple[Any, ...]:
        t = time.time() if now is None else now
        lim = self._limiter(config, t)
        d = lim.allow(key, cost) if commit else lim.peek(key, cost)
        full = (d.allowed, float(d.remaining), d.retry_after, d.reset_after, d.delay, False, "", d.at)
        return full[: self.width]

    def run_kernel_many(self, config: Any, keys: Any, costs: Any, now: float | None) -> list[Any]:
        return [self.run_kernel(config, k, c, now, True) for k, c in zip(keys, costs)]

    def run_kernel_all(self, items: Any, now: float | None) -> list[Any]:
        return [self.run_kernel(cfg, k, c, now, True) for cfg, k, c in items]

    def refund_kernel(self, config: Any, key: str, cost: int, at: float | None, now: float | None) -> None:
        self.refunds.append(("sync", config, key, cost, at, now))
        self._limiter(config, time.time() if now is None else now).refund(key, cost, at=at)

    def forget(self, config: Any, key: str) -> None:
        self._limiter(config, 0.0).reset(key)

    def snapshot(self, config: Any, key: str, now: float | None) -> Any:
        return self._limiter(config, time.time() if now is None else now).state(key)

    def apply(self, key: str, now: float, mutate: Any) -> Any:
        raise NotImplementedError("a kernel store")

    def evict_idle(self, cutoff: float) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.inner)


class AsyncRecordingKernelStore(RecordingKernelStore):
    async def refund_kernel_async(
        self, config: Any, key: str, cost: int, at: float | None, now: float | None
    ) -> None:
        await asyncio.sleep(0)
        self.refunds.append(("async", config, key, cost, at, now))
        self._limiter(config, time.time() if now is None else now).refund(key, cost, at=at)


@pytest.fixture(params=["reference", pytest.param("native", marks=pytest.mark.native)])
def twin(request: pytest.FixtureRequest) -> Any:
    if request.param == "native":
        return request.getfixturevalue("native")
    return importlib.import_module("nanolimit.reference")


@pytest.mark.parametrize("width", [5, 6, 7, 8])
def test_kernel_store_verdicts_carry_at_when_given(twin: Any, width: int) -> None:
    store = RecordingKernelStore(width)
    limiter = twin.FixedWindowCounter(LIMIT, WINDOW, store, FakeClock(T0 + 3.0))
    d = limiter.allow("k")
    assert d.allowed and d.remaining == LIMIT - 1
    assert d.at == (T0 + 3.0 if width == 8 else 0.0)


def test_kernel_store_gets_refund_kernel_calls(twin: Any) -> None:
    store = RecordingKernelStore()
    clock = FakeClock(T0)
    limiter = twin.SlidingWindowLog(LIMIT, WINDOW, store, clock)
    d = limiter.allow("k", 2)
    clock.advance(1.0)
    limiter.refund("k", 2, at=d.at)
    assert store.refunds == [("sync", limiter.config, "k", 2, T0, T0 + 1.0)]
    assert limiter.state("k").log == ()
    with pytest.raises(ValidationError):
        limiter.refund("k", at=math.nan)
    assert len(store.refunds) == 1
    system = twin.SlidingWindowLog(LIMIT, WINDOW, store)  # the store's own clock: now is None
    system.refund("k")
    assert store.refunds[-1][-2:] == (None, None)


def test_refund_async_awaits_the_store_or_refunds_at_once(twin: Any) -> None:
    async def main() -> None:
        store = AsyncRecordingKernelStore()
        limiter = twin.FixedWindowCounter(LIMIT, WINDOW, store, FakeClock(T0))
        d = limiter.allow("k", 2)
        await limiter.refund_async("k", 2, at=d.at)
        assert store.refunds[-1][0] == "async"
        assert limiter.state("k").count == 0
        with pytest.raises(ValidationError):
            await limiter.refund_async("k", 0)
        plain = RecordingKernelStore()
        on_sync = twin.FixedWindowCounter(LIMIT, WINDOW, plain, FakeClock(T0))
        on_sync.allow("k")
        await on_sync.refund_async("k")
        assert plain.refunds[-1][0] == "sync"
        memory = twin.FixedWindowCounter(LIMIT, WINDOW, twin.InMemoryStorage(), FakeClock(T0))
        d = memory.allow("k", 3)
        await memory.refund_async("k", 3, at=d.at)
        assert memory.state("k").count == 0

    asyncio.run(main())


def test_foreign_storage_refunds_through_apply(twin: Any, algorithm: str) -> None:
    reference = importlib.import_module("nanolimit.reference")
    limiter = getattr(twin, ALGORITHM_CLASSES[algorithm])(LIMIT, WINDOW, DictStorage(), FakeClock(T0))
    plain = getattr(reference, ALGORITHM_CLASSES[algorithm])(
        LIMIT, WINDOW, reference.InMemoryStorage(), reference.FakeClock(T0)
    )
    limiter.allow("k")
    plain.allow("k")
    d = limiter.allow("k", 2)
    limiter.refund("k", 2, at=d.at)
    limiter.refund("unknown")
    assert len(limiter.storage) == 1
    assert limiter.state("k") == plain.state("k")


@pytest.mark.parametrize("algorithm", ["fixed_window", "sliding_counter", "token_bucket"])
def test_two_tier_refund_reaches_the_fleet_at_the_next_sync(
    twin: Any, redis_server: Any, algorithm: str
) -> None:
    """Two instances on a real server: one spends the key's whole limit and
    refunds one unit; after its sync the other instance sees the unit free."""
    from nanolimit.storage.two_tier import TwoTierStorage

    tiers = [
        TwoTierStorage(
            twin.InMemoryStorage(), redis_server.client(), instance_id=f"i{i}", instances=2, start=False
        )
        for i in range(2)
    ]
    try:
        for tier in tiers + tiers:
            tier.sync_now()
        clocks = [FakeClock(T0), FakeClock(T0)]
        cls = getattr(twin, ALGORITHM_CLASSES[algorithm])
        limiters = [cls(LIMIT, WINDOW, tier, clock) for tier, clock in zip(tiers, clocks)]
        assert limiters[1].peek("k").allowed  # the second instance tracks the key: its syncs read it
        admitted = []
        for _ in range(LIMIT):  # the first instance takes everything, syncing for leases
            d = limiters[0].allow("k")
            if not d.allowed:
                tiers[0].sync_now()
                d = limiters[0].allow("k")
            assert d.allowed and d.at == T0
            admitted.append(d)
        for tier in tiers + tiers:
            tier.sync_now()
        assert not limiters[1].allow("k").allowed
        limiters[0].refund("k", at=admitted[0].at)
        limiters[0].refund("never-seen")
        for tier in tiers + tiers:
            tier.sync_now()
        assert sum(tiers[1].fleet_counts(limiters[1].config, "k").values()) == LIMIT - 1
        again = 0  # the fleet admits the unit given back, and only it
        for _ in range(4):
            for lim, tier in zip(limiters[::-1], tiers[::-1]):
                again += lim.allow("k").allowed
                tier.sync_now()
        assert again == 1
        stale = admitted[1].at
        for clock in clocks:
            clock.advance(3 * WINDOW)
        limiters[0].refund("k", at=stale)  # its window has passed: nothing comes back
        tiers[0].sync_now()
        assert sum(tiers[0].fleet_counts(limiters[0].config, "k").values()) == LIMIT
    finally:
        for tier in tiers:
            tier.close()


# ---------------------------------------------------------------- the zone across processes


CHILD_REFUND = """
import sys
import nanolimit._core as core
from nanolimit._clocks import FakeClock
name, cls, limit, window, cost, at = sys.argv[1:]
zone = core.SharedMemoryStorage(name, max_keys=64)
getattr(core, cls)(int(limit), float(window), zone, FakeClock(float(at))).refund("k", int(cost), at=float(at))
zone.close()
"""


def wait_bounded(pid: int, seconds: float = 60.0) -> int:
    """A forked child's exit code; killed (by its pid) if it overstays."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    pytest.fail(f"child {pid} did not finish in {seconds} s")


@pytest.mark.native
@needs_shared_memory
@pytest.mark.parametrize("how", ["fork", "spawn"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_refund_from_another_process_is_seen(native: types.ModuleType, algorithm: str, how: str) -> None:
    """``fork``: the child refunds on the zone object it inherited (a
    pre-forking server's workers); ``spawn``: a fresh interpreter attaches
    by name. Either way the first process sees the units back."""
    name = f"nltest-{uuid.uuid4().hex[:16]}"
    zone = native.SharedMemoryStorage(name, max_keys=64)
    try:
        limiter = getattr(native, ALGORITHM_CLASSES[algorithm])(LIMIT, WINDOW, zone, FakeClock(T0))
        d = limiter.allow("k", LIMIT)
        assert d.allowed and not limiter.allow("k").allowed
        if how == "fork":
            pid = os.fork()
            if pid == 0:  # the child: refund, and say how it went by its exit code
                code = 1
                try:
                    limiter.refund("k", LIMIT, at=d.at)
                    code = 0
                finally:
                    os._exit(code)
            assert wait_bounded(pid) == 0
        else:
            args = [name, ALGORITHM_CLASSES[algorithm], str(LIMIT), repr(WINDOW), str(LIMIT), repr(d.at)]
            out = subprocess.run(
                [sys.executable, "-c", CHILD_REFUND, *args],
                capture_output=True,
                text=True,
                timeout=120,
                env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
            )
            assert out.returncode == 0, out.stderr
        assert limiter.allow("k", LIMIT).allowed
    finally:
        zone.unlink()
        zone.close()
