"""docs/spec.md §5: read, decide and write are one atomic step per key.

8 threads start together on a Barrier against a frozen clock; the budget
must be spent exactly, never more, whatever the interleaving.
"""

from __future__ import annotations

import threading
import time

import pytest

from nanolimit import FakeClock

THREADS = 8
PER_THREAD = 400
CAPACITY = 100
JOIN_TIMEOUT = 60.0


def run_threads(target, n=THREADS):
    """Run ``target(i)`` in n threads started together; return their results.

    A watchdog join fails the test if a thread hangs (a deadlock), and any
    exception raised in a thread fails it too.
    """
    barrier = threading.Barrier(n)
    results = [None] * n
    errors = []

    def worker(i):
        try:
            barrier.wait(timeout=JOIN_TIMEOUT)
            results[i] = target(i)
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT)
    alive = [t.name for t in threads if t.is_alive()]
    assert not alive, f"threads still running after {JOIN_TIMEOUT}s (deadlock?): {alive}"
    assert not errors, errors
    return results


def frozen_limiter(limiter_cls, backend):
    return limiter_cls(CAPACITY, 60.0, backend.InMemoryStorage(), backend.FakeClock(1_000_000.0))


def test_one_key_exact_budget(limiter_cls, backend):
    limiter = frozen_limiter(limiter_cls, backend)

    def hammer(_i):
        return sum(limiter.allow("shared").allowed for _ in range(PER_THREAD))

    counts = run_threads(hammer)
    assert sum(counts) == CAPACITY
    assert not limiter.peek("shared").allowed


def test_one_key_exact_budget_in_batches(limiter_cls, backend):
    limiter = frozen_limiter(limiter_cls, backend)
    batch = 40

    def hammer(_i):
        total = 0
        for _ in range(PER_THREAD // batch):
            result = limiter.allow_many(["shared"] * batch)
            total += result.allowed_count
        return total

    counts = run_threads(hammer)
    assert sum(counts) == CAPACITY


def test_mixed_costs_never_overspend(limiter_cls, backend):
    limiter = frozen_limiter(limiter_cls, backend)

    def hammer(i):
        cost = 1 + i % 3
        return sum(cost for _ in range(PER_THREAD // 4) if limiter.allow("shared", cost).allowed)

    # Cost-1 requests keep coming until one is denied, so with a frozen clock
    # the budget ends spent exactly: 300 cost-1 attempts alone exceed it.
    assert sum(run_threads(hammer)) == CAPACITY
    assert not limiter.peek("shared", 1).allowed


def test_independent_keys_each_get_their_capacity(limiter_cls, backend):
    limiter = frozen_limiter(limiter_cls, backend)

    def hammer(i):
        key = f"user-{i}"
        return sum(limiter.allow(key).allowed for _ in range(PER_THREAD))

    assert run_threads(hammer) == [CAPACITY] * THREADS
    assert len(limiter.storage) == THREADS


def test_apply_is_atomic(backend):
    storage = backend.InMemoryStorage(stripes=2)

    def incr(state):
        n = (state or 0) + 1
        return n, n

    def hammer(i):
        for _ in range(PER_THREAD // 2):
            storage.apply("counter", 1.0, incr)
            storage.apply(f"own-{i}", 1.0, incr)

    run_threads(hammer)
    assert storage.apply("counter", 1.0, lambda s: (s, s)) == THREADS * PER_THREAD // 2
    for i in range(THREADS):
        assert storage.apply(f"own-{i}", 1.0, lambda s: (s, s)) == PER_THREAD // 2


def test_evict_and_reset_race_with_decisions(limiter_cls, backend):
    # Eviction and reset may hand back budget (that is their job) but must not
    # crash, deadlock or corrupt the table while decisions run.
    limiter = frozen_limiter(limiter_cls, backend)

    def churn(i):
        for n in range(PER_THREAD // 4):
            if i == 0:
                limiter.storage.evict_idle(2_000_000.0)
            elif i == 1:
                limiter.reset("k1")
            else:
                limiter.allow(f"k{n % 3}")
        return True

    assert run_threads(churn) == [True] * THREADS
    assert len(limiter.storage) <= 3
    assert all(k.endswith(("k0", "k1", "k2")) for k in limiter.storage.keys())


def churn_indexes(limiter, storage, rounds=40):
    """allow_many batches of fresh keys (their stripes' indexes grow) on three
    threads while a fourth evicts every key (each index is rebuilt small).
    A batch prefetches from other stripes' indexes without their locks, so
    an index replaced under it must stay readable until it is done."""

    def churn(i):
        for r in range(rounds):
            if i == 0:
                storage.evict_idle(2_000_000.0)
            else:
                result = limiter.allow_many([f"t{i}:{r}:{n}" for n in range(300)])
                assert all(result.allowed)  # every key is fresh: a full bucket
        return True

    assert run_threads(churn, n=4) == [True] * 4


def test_batches_survive_indexes_replaced_under_them(backend):
    storage = backend.InMemoryStorage(stripes=4)
    limiter = backend.TokenBucket(10, 60.0, storage, backend.FakeClock(1_000_000.0))
    churn_indexes(limiter, storage)
    storage.evict_idle(2_000_000.0)
    assert len(storage) == 0
    assert all(limiter.allow_many(["a", "b", "a"]).allowed)


def test_retired_indexes_are_freed_once_no_batch_is_in_flight(native):
    storage = native.InMemoryStorage(stripes=4)
    limiter = native.TokenBucket(10, 60.0, storage, FakeClock(1_000_000.0))
    churn_indexes(limiter, storage)
    limiter.allow_many(["last"])  # the only batch: at its end nothing can read a retired block
    assert storage._retired_index_blocks == 0


# --------------------------------------------------------------------------
# Native only: apply runs its mutate with no stripe lock held.

BOUNDED_WAIT = 10.0


@pytest.mark.native
def test_slow_apply_does_not_block_a_decision_on_its_stripe(native):
    """A mutate that waits (here on an Event) holds up no limiter: allow() on
    another key of the same stripe (one stripe: every key) answers while the
    mutate is still running, and the apply then completes as usual."""
    storage = native.InMemoryStorage(stripes=1)
    limiter = native.TokenBucket(5, 60.0, storage, FakeClock(1000.0))
    inside, release = threading.Event(), threading.Event()
    applied: list[object] = []
    decided: list[bool] = []

    def slow(state):
        inside.set()
        assert release.wait(BOUNDED_WAIT), "the test never released the mutate"
        return (state or 0) + 1, "done"

    def run_slow() -> None:
        applied.append(storage.apply("slow", 1.0, slow))

    slow_thread = threading.Thread(target=run_slow, daemon=True)
    slow_thread.start()
    try:
        assert inside.wait(BOUNDED_WAIT)
        decider = threading.Thread(target=lambda: decided.append(limiter.allow("other").allowed), daemon=True)
        decider.start()
        decider.join(BOUNDED_WAIT)
        assert not decider.is_alive(), "allow() waited for a mutate of another key"
        assert decided == [True]
        assert slow_thread.is_alive()  # the mutate is still running
        assert len(storage) == 1  # "other" is stored; "slow" is not written yet
    finally:
        release.set()
        slow_thread.join(BOUNDED_WAIT)
    assert not slow_thread.is_alive()
    assert applied == ["done"]
    assert storage.apply("slow", 2.0, lambda s: (s, s)) == 1
    assert limiter.state("other").level == 4.0


@pytest.mark.native
def test_slow_applies_of_one_key_stay_atomic(native):
    """Mutates that give the GIL away mid-way (a sleep) still never lose an
    update of their key, while decisions on the same stripe go on."""
    storage = native.InMemoryStorage(stripes=1)
    limiter = native.GCRA(10**6, 1.0, storage, FakeClock(1000.0))

    def incr(state):
        n = (state or 0) + 1
        time.sleep(0.0005)
        return n, n

    def hammer(i):
        for n in range(25):
            if i % 2:
                storage.apply("counter", 1.0, incr)
            else:
                assert limiter.allow(f"user-{i}-{n % 3}").allowed
        return True

    assert run_threads(hammer) == [True] * THREADS
    assert storage.apply("counter", 1.0, lambda s: (s, s)) == THREADS // 2 * 25
