"""The attacker's suite against the core: key floods that try to buy an
indebted key its budget back, costs that lie about their value, clocks that
jump, and hot reloads that try to exhaust the storage's namespaces.

Each test is a class of attack, run for every algorithm and both twins where
it applies; docs/reliability.md lists them with what each promises.
"""

from __future__ import annotations

import math
import threading
import types
from typing import Any

import pytest
from conftest import ALGORITHMS

from nanolimit._clocks import MAX_CLOCK_LEAD

START = 1_800_000_000.0


# ------------------------------------------------------------ key floods


@pytest.mark.parametrize("stripes", [1, 8])
def test_key_flood_never_hands_an_indebted_key_its_budget_back(
    backend: types.SimpleNamespace, algorithm: str, stripes: int
) -> None:
    # The victim spends its whole budget, then 20,000 fresh keys arrive, each
    # spending one unit, on a table of 64 keys. Between every 100 flood keys
    # the victim tries again: within its window it must never pass again.
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage(max_keys=64, stripes=stripes)
    limiter = backend.limiters[algorithm](5, 3600.0, storage, clock, rule="login")
    admitted = sum(limiter.allow("victim").allowed for _ in range(5))
    assert admitted == 5
    for block in range(200):
        for i in range(100):
            limiter.allow(f"flood-{block}-{i}")
        clock.advance(0.01)
        admitted += limiter.allow("victim").allowed
    assert admitted == 5
    assert len(storage) <= 64
    assert storage.stats()["evicted_active"] > 0  # the flood keys made room for each other


def test_partly_spent_key_is_not_the_victim_of_fresh_keys(
    backend: types.SimpleNamespace, algorithm: str
) -> None:
    # A key that spent 4 of 5 gives back more than a flood key that spent 1:
    # it must outlive the flood, so its next 2 requests see 1 unit left.
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage(max_keys=16, stripes=1)
    limiter = backend.limiters[algorithm](5, 3600.0, storage, clock, rule="api")
    for _ in range(4):
        assert limiter.allow("user").allowed
    for i in range(2_000):
        limiter.allow(f"flood-{i}")
    assert [limiter.allow("user").allowed for _ in range(2)] == [True, False]


def test_table_full_of_keys_in_debt_refuses_the_new_key(
    backend: types.SimpleNamespace, algorithm: str
) -> None:
    # Every key held is out of budget: forgetting any would hand budget back,
    # so a new key is refused (storage_full) and every held key stays denied.
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage(max_keys=8, stripes=1)
    limiter = backend.limiters[algorithm](1, 3600.0, storage, clock, rule="one")
    for i in range(8):
        assert limiter.allow(f"k{i}").allowed
    refused = limiter.allow("newcomer")
    assert not refused.allowed
    assert refused.reason == "storage_full"
    assert refused.retry_after > 0
    assert len(storage) == 8
    assert storage.stats()["evicted_active"] == 0
    assert storage.stats()["denied_new"] >= 1
    assert not any(limiter.allow(f"k{i}").allowed for i in range(8))


def test_refused_newcomer_gets_in_once_a_key_is_at_rest(
    backend: types.SimpleNamespace, algorithm: str
) -> None:
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage(max_keys=4, stripes=1)
    limiter = backend.limiters[algorithm](1, 10.0, storage, clock, rule="one")
    for i in range(4):
        limiter.allow(f"k{i}")
    assert limiter.allow("newcomer").reason == "storage_full"
    clock.advance(25.0)  # every key is back at rest
    assert limiter.allow("newcomer").allowed
    assert storage.stats()["evicted_at_rest"] >= 1


@pytest.mark.native
@pytest.mark.parametrize("algorithm_name", ["fixed_window", "sliding_counter", "sliding_log", "token_bucket"])
def test_threads_flooding_keys_cannot_free_a_guard_key(
    backend: types.SimpleNamespace, algorithm_name: str
) -> None:
    # 8 threads on max_keys=64: four hammer a guard key of capacity 300,
    # four flood fresh keys. With a frozen clock the guard admits exactly 300.
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage(max_keys=64)
    limiter = backend.limiters[algorithm_name](300, 3600.0, storage, clock, rule="guard")
    # Two units spent first: a key that has spent one unit hands back as much
    # as a flood key, so the eviction rule may forget it (documented, at most
    # what it spent); with the GIL the guard was always ahead, without one
    # the floods can fill its stripe at its first admission (301 of 300).
    assert limiter.allow("guard").allowed and limiter.allow("guard").allowed
    admitted = [2, 0, 0, 0]
    barrier = threading.Barrier(8)

    def guard(slot: int) -> None:
        barrier.wait()
        for _ in range(2_000):
            admitted[slot] += limiter.allow("guard").allowed

    def flood(slot: int) -> None:
        barrier.wait()
        for i in range(5_000):
            limiter.allow(f"flood-{slot}-{i}")

    threads = [threading.Thread(target=guard, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=flood, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
        assert not thread.is_alive(), "deadlock: a thread did not finish within 60 s"
    assert sum(admitted) == 300


# ------------------------------------------------------------ costs


class LyingInt(int):
    """An int that says 1 to comparisons but -5 to int()."""

    def __int__(self) -> int:
        return -5

    def __index__(self) -> int:
        return -5


class HugeInt(int):
    def __int__(self) -> int:
        return 10**9

    def __index__(self) -> int:
        return 10**9


class Indexable:
    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


def test_int_subclass_cost_is_charged_by_its_value(backend: types.SimpleNamespace, algorithm: str) -> None:
    clock = backend.FakeClock(START)
    limiter = backend.limiters[algorithm](5, 60.0, clock=clock, rule="c")
    for cost in (LyingInt(1), HugeInt(1)):
        decision = limiter.allow("k", cost)
        assert decision.allowed
    # two units spent, not -5 + 10**9: three left (a peek of 1 would leave 2)
    assert limiter.peek("k").remaining == 2
    assert [limiter.allow("k").allowed for _ in range(4)] == [True, True, True, False]
    state = limiter.state("k")
    assert state is not None
    if state.count is not None:
        assert state.count == 5
    if state.log is not None:
        assert len(state.log) == 5


def test_int_like_costs_agree_between_twins(backend: types.SimpleNamespace, algorithm: str) -> None:
    np = pytest.importorskip("numpy")
    clock = backend.FakeClock(START)
    limiter = backend.limiters[algorithm](10, 60.0, clock=clock, rule="c")
    accepted = [np.int64(2), np.uint8(1), Indexable(3), LyingInt(1)]
    for cost in accepted:
        assert limiter.allow("k", cost).allowed
    spent = 2 + 1 + 3 + 1
    assert limiter.peek("k").remaining == 10 - spent - 1
    for bad in (True, False, np.True_, Indexable(0), Indexable(-1), Indexable(11), 2.0, "1", None):
        with pytest.raises(backend.ValidationError):
            limiter.allow("k", bad)
    with pytest.raises(backend.ValidationError):
        limiter.allow_many(["k", "j"], [1, LyingInt(0)])
    assert limiter.peek("k").remaining == 10 - spent - 1  # nothing charged by the refusals


def test_lying_costs_in_batches_and_compounds(backend: types.SimpleNamespace) -> None:
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage()
    log = backend.limiters["sliding_log"](5, 60.0, storage, clock, rule="log")
    window = backend.limiters["fixed_window"](5, 60.0, storage, clock, rule="fw")
    batch = log.allow_many(["a", "a"], [LyingInt(1), HugeInt(2)])
    assert list(batch.allowed) == [True, True]
    assert log.peek("a").remaining == 1
    both = storage.allow_all([(log, "b", LyingInt(2)), (window, "b", HugeInt(3))])
    assert both.allowed
    assert log.peek("b").remaining == 2
    assert window.peek("b").remaining == 1


# ------------------------------------------------------------ clocks


def test_clock_jump_ahead_and_back_locks_nobody_out(backend: types.SimpleNamespace, algorithm: str) -> None:
    # A bad NTP step one year ahead and back. Keys touched during the jump
    # keep their debt, but are judged against the real clock again: their
    # Retry-After is truthful and passes as promised.
    clock = backend.FakeClock(START)
    limiter = backend.limiters[algorithm](5, 60.0, clock=clock, rule="jump")
    year = 365 * 86400.0
    clock.set(START + year)
    assert sum(limiter.allow("k").allowed for _ in range(7)) == 5
    clock.set(START)  # the step is corrected
    denied = limiter.allow("k")
    assert not denied.allowed  # the debt is kept: no budget handed back
    assert 0 < denied.retry_after <= 60.0
    clock.advance(denied.retry_after + 1e-6)
    if algorithm != "sliding_counter":  # its retry_after is a lower bound by formula
        assert limiter.allow("k").allowed  # ... and the Retry-After was the truth
    state = limiter.state("k")
    assert state is not None and state.updated_at <= clock.now()


def test_small_backward_step_keeps_time_still_and_tells_the_truth(
    backend: types.SimpleNamespace, algorithm: str
) -> None:
    # Within MAX_CLOCK_LEAD, per-key time stands still (no budget back), and
    # Retry-After counts the lead: waiting that long really is enough.
    clock = backend.FakeClock(START)
    limiter = backend.limiters[algorithm](5, 10.0, clock=clock, rule="step")
    clock.advance(30.0)
    for _ in range(5):
        assert limiter.allow("k").allowed
    clock.advance(-20.0)
    denied = limiter.allow("k")
    assert not denied.allowed
    assert denied.retry_after > 20.0
    clock.advance(denied.retry_after - 0.01)
    assert not limiter.allow("k").allowed
    clock.advance(0.02)
    if algorithm != "sliding_counter":  # its retry_after is a lower bound by formula
        assert limiter.allow("k").allowed


@pytest.mark.parametrize("lead", [MAX_CLOCK_LEAD + 0.5, 3 * 3600.0, 365 * 86400.0])
def test_peek_after_a_clock_jump_changes_nothing(
    backend: types.SimpleNamespace, algorithm: str, lead: float
) -> None:
    clock = backend.FakeClock(START + lead)
    limiter = backend.limiters[algorithm](4, 60.0, clock=clock, rule="p")
    for _ in range(3):
        limiter.allow("k")
    before = limiter.state("k")
    clock.set(START)
    peeked = [limiter.peek("k") for _ in range(3)]
    assert limiter.state("k") == before
    assert all(p.allowed and p.remaining == 0 for p in peeked)
    assert limiter.allow("k").allowed
    assert not limiter.allow("k").allowed


def test_clock_jump_back_hands_out_nothing_until_the_real_clock_moves(backend: types.SimpleNamespace) -> None:
    # Spent during a 30-day jump, then the clock is corrected: at the real
    # time nothing passes for any algorithm (each forward step of a clock
    # counts as time passed, so only the step back is a fault to absorb).
    for algorithm in ALGORITHMS:
        clock = backend.FakeClock(START + 30 * 86400.0)
        limiter = backend.limiters[algorithm](3, 3600.0, clock=clock, rule="j")
        assert sum(limiter.allow("k").allowed for _ in range(5)) == 3, algorithm
        clock.set(START)
        assert sum(limiter.allow("k").allowed for _ in range(5)) == 0, algorithm
        clock.advance(1.0)
        assert sum(limiter.allow("k").allowed for _ in range(5)) == 0, algorithm


# ------------------------------------------------------------ namespaces


def test_renamed_rules_never_exhaust_the_namespaces(backend: types.SimpleNamespace) -> None:
    # 70,000 renames, each a fresh limiter whose predecessor is dropped: no
    # request may fail because of configuration history.
    storage = backend.InMemoryStorage()
    clock = backend.FakeClock(START)
    limiter: Any = None
    for i in range(70_000):
        limiter = backend.limiters["token_bucket"](5, 60.0, storage, clock, rule=f"rule-{i}")
        if i % 10_000 == 0:
            assert limiter.allow("k").allowed
    assert limiter is not None and limiter.allow("k").allowed


def test_namespace_reuse_never_reads_a_retired_rule_state(backend: types.SimpleNamespace) -> None:
    # A key spent under a retired rule must not show up under the rule that
    # inherits its namespace slot; a live rule keeps its debt throughout.
    storage = backend.InMemoryStorage()
    clock = backend.FakeClock(START)
    kept = backend.limiters["fixed_window"](2, 3600.0, storage, clock, rule="kept")
    kept.allow("k")
    kept.allow("k")
    for i in range(70_000):
        retired = backend.limiters["fixed_window"](2, 3600.0, storage, clock, rule=f"old-{i}")
        if i % 7_000 == 0:
            retired.allow("k")
            retired.allow("k")
        del retired
    fresh = backend.limiters["fixed_window"](2, 3600.0, storage, clock, rule="fresh")
    assert fresh.allow("k").remaining == 1
    assert not kept.allow("k").allowed
    assert len(storage) <= 2 + 10  # retired rules' keys go with their namespace, at the latest


def test_live_rules_keep_their_namespaces(backend: types.SimpleNamespace) -> None:
    # A rule whose limiter is alive keeps its state however many others come and go.
    storage = backend.InMemoryStorage()
    clock = backend.FakeClock(START)
    live = [backend.limiters["gcra"](1, 3600.0, storage, clock, rule=f"live-{i}") for i in range(50)]
    for limiter in live:
        assert limiter.allow("k").allowed
    for i in range(66_000):
        backend.limiters["gcra"](1, 3600.0, storage, clock, rule=f"gone-{i}")
    assert not any(limiter.allow("k").allowed for limiter in live)


# ------------------------------------------------------------ headers


@pytest.mark.parametrize("algorithm_name", ALGORITHMS)
@pytest.mark.parametrize("window", [1e9, 1e8, 86400.0 * 366, 1e-6])
def test_headers_never_raise_for_a_valid_rule(
    backend: types.SimpleNamespace, algorithm_name: str, window: float
) -> None:
    # RateLimitRule("slow", "*", "/", "ip", ..., 1, 1e9, 6) once raised while
    # rendering headers after charging: every decision of a rule inside the
    # documented ranges renders.
    burst = 6 if algorithm_name in ("token_bucket", "gcra") else None
    clock = backend.FakeClock(START)
    limiter = backend.limiters[algorithm_name](1, window, clock=clock, rule="slow", burst=burst)
    for _ in range(8):
        decision = limiter.allow("k")
        headers = dict(decision.headers(wall_now=START))
        assert int(headers["X-RateLimit-Reset"]) >= START
        assert int(headers["X-RateLimit-Remaining"]) >= 0
        if not decision.allowed:
            assert int(headers["Retry-After"]) >= 1
        reset = int(headers["X-RateLimit-Reset"])
        assert reset == math.ceil(START + decision.reset_after) or reset > START + 1e15


# ------------------------------------------------------------ through the gateway


@pytest.mark.parametrize("algorithm_name", ALGORITHMS)
def test_slow_valid_rule_is_answered_never_raised(
    backend: types.SimpleNamespace, algorithm_name: str
) -> None:
    from gateway_helpers import gateway as make_gateway
    from gateway_helpers import get, ok_handler
    from gateway_helpers import rule as make_rule

    burst = 6 if algorithm_name in ("token_bucket", "gcra") else None
    slow = make_rule("slow", 1, 1e9, algorithm=algorithm_name, burst=burst)
    pipeline = make_gateway(backend, [slow], backend.FakeClock(START))
    statuses = [pipeline(get("/"), ok_handler).status for _ in range(8)]
    admitted = 6 if burst else 1
    assert statuses == [200] * admitted + [429] * (8 - admitted)


def test_default_factory_is_bounded_and_keeps_debt(backend: types.SimpleNamespace) -> None:
    from nanolimit.gateway.factory import DEFAULT_MAX_KEYS, LimiterFactory

    factory = LimiterFactory()
    assert factory.storage.max_keys == DEFAULT_MAX_KEYS
    # 120,000 one-off clients on a factory over this twin's storage, bounded alike
    storage = backend.InMemoryStorage(max_keys=DEFAULT_MAX_KEYS)
    clock = backend.FakeClock(START)
    limiter = backend.limiters["token_bucket"](5, 60.0, storage, clock, rule="login")
    for _ in range(5):
        limiter.allow("attacker")
    for i in range(120_000):
        limiter.allow(f"client-{i}")
        if i % 20_000 == 0:
            clock.advance(0.1)
    assert len(storage) <= DEFAULT_MAX_KEYS
    assert not limiter.allow("attacker").allowed


def test_hot_reloads_renaming_a_rule_never_fail_a_request(backend: types.SimpleNamespace) -> None:
    # 66,000 reloads through the registry, each renaming the rule, pruned as
    # the docs say: the 65,536th namespace reuses a retired one, and every
    # request is answered.
    from gateway_helpers import gateway as make_gateway
    from gateway_helpers import get, ok_handler
    from gateway_helpers import rule as make_rule

    pipeline = make_gateway(backend, [make_rule("r-0", 5)], backend.FakeClock(START))
    registry, factory = pipeline.registry, pipeline.factory
    for i in range(1, 66_000):
        renamed = make_rule(f"r-{i}", 5)
        registry.replace([renamed])
        factory.prune([renamed])
        if i % 6_000 == 0 or i > 65_530:
            assert pipeline(get("/"), ok_handler).status == 200
    assert len(factory) <= 1


# ------------------------------------------------------------ threads


@pytest.mark.parametrize(
    "algorithm_name", ["token_bucket", "sliding_log", "fixed_window", "sliding_counter", "gcra"]
)
def test_eight_thread_mix_on_a_full_table(backend: types.SimpleNamespace, algorithm_name: str) -> None:
    # allow, peek, allow_many, allow_all, reset, evict_idle, renaming reloads
    # and clock jumps at once, on a 64-key table flooded with fresh keys and
    # with keys in debt. A watchdog catches deadlocks; the guard key (frozen
    # clock, never reset), in debt from the start, is never forgotten, so it
    # admits nothing more however the work interleaves. (A key *not* in debt
    # may be forgotten when every other key looked at is: docs/algorithms.md.)
    import random
    import time

    storage = backend.InMemoryStorage(max_keys=64, stripes=4)
    frozen = backend.FakeClock(START)
    jumpy = backend.FakeClock(START)
    cls = backend.limiters[algorithm_name]
    guard = cls(200, 3600.0, storage, frozen, rule="guard")
    assert guard.allow("guard", 200).allowed
    busy: list[Any] = [cls(5, 1.0, storage, jumpy, rule="busy-0")]
    busy_lock = threading.Lock()  # without a GIL, a read of a list being cut can fail

    def newest() -> Any:
        with busy_lock:
            return busy[-1]

    admitted = [0] * 3
    errors: list[BaseException] = []
    stop = threading.Event()
    barrier = threading.Barrier(8)

    def run(slot: int, body: Any) -> None:
        barrier.wait()
        rng = random.Random(slot)
        try:
            while not stop.is_set():
                body(slot, rng)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    def decide(slot: int, rng: random.Random) -> None:
        choice = rng.random()
        if choice < 0.5:
            admitted[slot] += guard.allow("guard").allowed
        elif choice < 0.7:
            guard.peek("guard")
        elif choice < 0.85:
            admitted[slot] += guard.allow_many(["guard", f"g{rng.randint(0, 99)}"]).allowed[0]
        else:
            lim = newest()
            storage.allow_all([(lim, f"b{rng.randint(0, 9)}"), (lim, f"c{rng.randint(0, 9)}")])

    def flood(slot: int, rng: random.Random) -> None:
        newest().allow(f"flood-{slot}-{rng.random()}")

    def churn(slot: int, rng: random.Random) -> None:
        newest().reset(f"b{rng.randint(0, 9)}")
        storage.evict_idle(START - 10.0)
        fresh = cls(5, 1.0, storage, jumpy, rule=f"busy-{rng.randint(0, 10**9)}")
        with busy_lock:
            busy.append(fresh)
            del busy[:-4]

    def jump(slot: int, rng: random.Random) -> None:
        # backwards only: a step forward is time passing for every key on the
        # clock, the guard's too (docs/algorithms.md, "Clock faults")
        jumpy.set(START - rng.choice([0.0, 0.5, 120.0, 86400.0 * 365]))
        time.sleep(0.0005)

    bodies = [decide, decide, decide, flood, flood, churn, jump, flood]
    threads = [threading.Thread(target=run, args=(i, b), daemon=True) for i, b in enumerate(bodies)]
    for thread in threads:
        thread.start()
    time.sleep(1.0)
    stop.set()
    deadline = time.monotonic() + 60.0
    for thread in threads:
        thread.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(thread.is_alive() for thread in threads), "a thread is stuck: deadlock or livelock"
    assert not errors, errors
    assert sum(admitted) == 0
    assert not guard.allow("guard").allowed
    assert len(storage) <= 64  # an all-or-nothing pair makes room for both its keys, or is refused


@pytest.mark.on_zone  # the zone's allow_all holds the bound alike
@pytest.mark.parametrize("on_full", ["evict", "deny_new"])
def test_pair_compounds_on_a_full_table_stay_within_max_keys(
    backend: types.SimpleNamespace, on_full: str
) -> None:
    # The eight-thread mix once held 67 keys on a 64-key table, with no race
    # needed: two new keys of one compound in one full stripe each saw room
    # for one, and the commit wrote both (or room for the second forgot the
    # first, at rest, and the commit wrote it back). Four stripes reached 68.
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage(max_keys=64, stripes=4, on_full=on_full)
    limiter = backend.FixedWindowCounter(5, 1.0, storage, clock, rule="r")
    for i in range(200):
        limiter.allow(f"flood-{i}")
    assert len(storage) == 64
    admitted = 0
    for i in range(400):
        if i in (100, 250):
            clock.advance(1.0)  # every key so far at rest: forgetting any changes no decision
        pair = [(limiter, f"a{i % 40}"), (limiter, f"b{i}")]  # "a" keys come back, some at rest
        held = [limiter.state(key) is not None for _, key in pair]
        decision = storage.allow_all(pair)
        assert len(storage) <= 64, (i, len(storage))
        admitted += decision.allowed
        if not decision.allowed:  # refused: no new key of the pair went in
            assert [limiter.state(key) is not None for _, key in pair] == held
    assert admitted > 20
    assert storage.stats()["keys"] == len(storage)


def test_compound_only_key_refills_after_a_clock_jump_back(
    backend: types.SimpleNamespace, algorithm: str
) -> None:
    # A denied compound charges nothing but stores the move-back of a key
    # stamped over MAX_CLOCK_LEAD ahead: else every compound would move it
    # back again from the clock's new time and it would never refill.
    clock = backend.FakeClock(START + 365 * 86400.0)
    storage = backend.InMemoryStorage()
    limiter = backend.limiters[algorithm](3, 10.0, storage, clock, rule="c")
    other = backend.limiters["token_bucket"](100, 10.0, storage, clock, rule="o")
    for _ in range(4):
        storage.allow_all([(limiter, "k"), (other, "k")])
    clock.set(START)
    denied = storage.allow_all([(limiter, "k"), (other, "k")])
    assert not denied.allowed
    wait = denied.decisions[0].retry_after
    assert 0 < wait <= 10.0
    assert other.peek("k").remaining == 100 - 3 - 1  # the denied compounds charged nothing
    clock.advance(wait + 1e-6)
    if algorithm == "sliding_counter":  # its retry_after is a lower bound: wait out the window too
        clock.advance(10.0)
    assert storage.allow_all([(limiter, "k"), (other, "k")]).allowed
