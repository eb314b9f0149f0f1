"""Eight threads mixing every operation on one storage, for a bounded time.

Deciders (allow, allow_many, compound), a resetter, an evictor, a hot
reloader and a user algorithm through ``apply`` all run at once over
overlapping keys. A watchdog fails the test if any thread is stuck; the
invariant is that the "guard" key, never reset nor evicted and judged by a
frozen clock, admits exactly its capacity however the work interleaves.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

# The shared-memory zone runs this test too (conftest.py, the zone backend):
# its eighth thread reads the zone's counters instead of running ``apply``.
ZONE_SUITE = True

DURATION = 1.5
WATCHDOG = 60.0
GUARD_CAPACITY = 300


@pytest.mark.parametrize("algorithm", ["token_bucket", "sliding_log", "fixed_window", "gcra"])
def test_mixed_operations_under_eight_threads(backend, algorithm) -> None:
    storage = backend.InMemoryStorage(stripes=4)
    clock = backend.FakeClock(10_000.0)  # frozen: the guard's budget is exact
    old_clock = backend.FakeClock(1_000.0)  # stamps entries the evictor may take
    cls = backend.limiters[algorithm]
    limiters = {
        "guard": cls(GUARD_CAPACITY, 3600.0, storage, clock, rule="guard"),
        "busy": cls(50, 1.0, storage, clock, rule="busy"),
        "old": cls(50, 1.0, storage, old_clock, rule="old"),
    }
    admitted = [0] * 8
    errors: list[BaseException] = []
    stop = threading.Event()
    start = threading.Barrier(8)
    keys = [f"k{i}" for i in range(20)]

    def guarded(slot: int, body) -> None:
        start.wait()
        rng = random.Random(slot)
        try:
            while not stop.is_set():
                body(rng)
        except BaseException as exc:  # surfaced by the main thread
            errors.append(exc)

    def decider(slot: int):
        def body(rng: random.Random) -> None:
            choice = rng.random()
            if choice < 0.4:
                admitted[slot] += limiters["guard"].allow("guard").allowed
            elif choice < 0.6:
                batch = limiters["guard"].allow_many(["guard", rng.choice(keys)])
                admitted[slot] += batch.allowed[0]
            elif choice < 0.8:
                limiters["busy"].allow_many(rng.sample(keys, 5))
            else:
                storage.allow_all([(limiters["busy"], rng.choice(keys)), (limiters["old"], rng.choice(keys))])

        return body

    def resetter(rng: random.Random) -> None:
        limiters[rng.choice(["busy", "old"])].reset(rng.choice(keys))

    def evictor(rng: random.Random) -> None:
        storage.evict_idle(5_000.0)  # only "old" entries are older than this
        time.sleep(0.001)

    def reloader(rng: random.Random) -> None:
        # same rule and parameters: a hot reload must keep the key state
        limiters["guard"] = cls(GUARD_CAPACITY, 3600.0, storage, clock, rule="guard")
        limiters["busy"] = cls(rng.randint(40, 60), 1.0, storage, clock, rule="busy")
        time.sleep(0.001)

    def user_algorithm(rng: random.Random) -> None:
        storage.apply(f"raw{rng.randint(0, 9)}", 10_000.0, lambda s: ((s or 0) + 1, None))

    def reader(rng: random.Random) -> None:
        assert len(storage.keys()) <= 3 * len(keys) + 1  # three rules over the keys, and the guard
        storage.metrics()

    on_zone = backend.name == "zone"
    last = reader if on_zone else user_algorithm
    bodies = [decider(0), decider(1), decider(2), decider(3), resetter, evictor, reloader, last]
    threads = [threading.Thread(target=guarded, args=(i, body), daemon=True) for i, body in enumerate(bodies)]
    for t in threads:
        t.start()
    time.sleep(DURATION)
    stop.set()
    deadline = time.monotonic() + WATCHDOG
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a thread is stuck: deadlock or livelock"
    assert not errors, errors
    assert sum(admitted) == GUARD_CAPACITY
    assert not limiters["guard"].allow("guard").allowed
    assert len(storage.keys()) == len(storage)
    if not on_zone:
        total = sum(storage.apply(f"raw{i}", 10_000.0, lambda s: (s, s or 0)) for i in range(10))
        assert total > 0
