"""TwoTierStorage's native path: a native limiter decides against each key's
lease in C (``LeaseBook``) while the lease holds, and the Python path
(``TwoTierStorage._decide``, which the reference limiters always take)
handles the rest. The two must give the same answers, bit for bit, and the
handover between them must lose no unit under threads.
"""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
from _helpers import cut_off_switch, from_window, rounds
from _helpers import two_tier_fleet as fleet

from nanolimit import FakeClock, ValidationError, reference

pytest_plugins = ["redis_servers"]
pytestmark = pytest.mark.native

ALGORITHMS = ["FixedWindowCounter", "SlidingWindowCounter", "TokenBucket"]


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("cls", ALGORITHMS)
def test_native_leases_answer_like_the_python_path(
    native: Any, redis_server: Any, cls: str, seed: int
) -> None:
    """Two fleets on one server, the same random script of requests, peeks,
    costs, clock steps (some backwards), full and partial syncs, a third
    instance joining (N changes), Redis unreachable and back, forget and
    idle eviction: one fleet's limiters are native (C decisions on leases),
    the other's are the reference (the storage's Python path). Every
    decision and the final fleet view agree exactly."""
    rng = random.Random(seed)
    fast = fleet(redis_server, "n:", 3)
    slow = fleet(redis_server, "r:", 3)
    down = cut_off_switch((*fast, *slow))
    try:
        clock = FakeClock(9000.25)
        limit = rng.choice([3, 10, 40])
        window = rng.choice([0.5, 1.0, 2.5])
        lims_fast = [getattr(native, cls)(limit, window, storage=s, clock=clock) for s in fast]
        lims_slow = [getattr(reference, cls)(limit, window, storage=s, clock=clock) for s in slow]
        for tiers in (fast, slow):
            for tier in tiers[:2] * 2:
                tier.sync_now()
        keys = ["a", "b", "ключ"]
        for step in range(400):
            i = rng.randrange(2)
            op = rng.random()
            if op < 0.05:
                assert fast[i].sync_now() == slow[i].sync_now()
            elif op < 0.09:
                assert fast[i]._sync(full=False) == slow[i]._sync(full=False)
            elif op < 0.10:
                fast[2].sync_now()  # the third instance heartbeats: N changes
                slow[2].sync_now()
            elif op < 0.11:
                down[0] = not down[0]
            elif op < 0.115:
                key = rng.choice(keys)
                fast[i].forget(lims_fast[i].config, key)
                slow[i].forget(lims_slow[i].config, key)
            elif op < 0.12:
                cutoff = clock.now() - rng.choice([0.0, window, 3 * window])
                assert fast[i].evict_idle(cutoff) == slow[i].evict_idle(cutoff)
            elif op < 0.18:
                clock.advance(rng.choice([0.01, 0.1, window / 3, window, 2 * window]))
            elif op < 0.20:
                clock.set(clock.now() - rng.choice([0.05, window]))
            else:
                key = rng.choice(keys)
                cost = rng.choice([1, 1, 1, 2, limit])
                method = "peek" if op < 0.28 else "allow"
                got = getattr(lims_fast[i], method)(key, cost)
                want = getattr(lims_slow[i], method)(key, cost)
                assert got == want, (step, method, key, cost, clock.now())
        down[0] = False
        for tiers in (fast, slow):
            for tier in (*tiers, *tiers):
                tier.sync_now()
        # the windows a decision reads: which older ones a track still holds
        # differs (C drops what it rolled past, the Python plan at a key's next sync)
        k = int(clock.now() // window)
        for key in keys:
            got = fast[0].fleet_counts(lims_fast[0].config, key)
            want = slow[0].fleet_counts(lims_slow[0].config, key)
            assert from_window(got, k - 1) == from_window(want, k - 1)
        for a, b in zip(fast, slow):
            ma, mb = a.metrics(), b.metrics()
            for name in ("decisions", "early_syncs", "units_pushed", "keys_tracked", "partitions"):
                assert ma[name] == mb[name], name
            assert mb["decisions_native"] == 0
        assert fast[0].metrics()["decisions_native"] > 0  # the C path took part (not while blind)
    finally:
        for tier in (*fast, *slow):
            tier.close(deregister=False)


@pytest.mark.parametrize("algorithm", ["FixedWindowCounter", "SlidingWindowCounter", "TokenBucket"])
def test_native_decisions_under_threads_lose_no_unit(native: Any, redis_server: Any, algorithm: str) -> None:
    """Four threads decide on three keys while the sync thread pulls and
    reloads the leases every millisecond (planned in C for every algorithm):
    every admitted unit is in the fleet count, each key gets exactly its
    limit, and every decision is counted."""
    from nanolimit.storage.two_tier import TwoTierStorage

    tier = TwoTierStorage(None, redis_server.client(), instance_id="t", sync_interval=0.001)
    limit = 5000
    limiter = getattr(native, algorithm)(limit, 3600.0, storage=tier)
    keys = ["x", "y", "z"]
    admitted = {k: 0 for k in keys}
    calls = 0
    guard = threading.Lock()

    def work(seed: int) -> None:
        nonlocal calls
        rng = random.Random(seed)
        mine = {k: 0 for k in keys}
        for _ in range(6000):
            key = rng.choice(keys)
            if limiter.allow(key).allowed:
                mine[key] += 1
        with guard:
            calls += 6000
            for k, n in mine.items():
                admitted[k] += n

    try:
        for key in keys:  # each key's past window read SETTLE_READS times first:
            assert limiter.allow(key).allowed  # the threads meet the C plan at once
            admitted[key] += 1
            calls += 1
        for _ in range(3):
            tier.sync_now()
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        tier.sync_now()
        for key in keys:
            view = tier.fleet_counts(limiter.config, key)
            assert sum(view.values()) == admitted[key], key
        assert all(n == limit for n in admitted.values())  # ~8,000 asked per key
        metrics = tier.metrics()
        assert metrics["decisions"] == calls
        assert metrics["decisions_native"] > calls // 2
    finally:
        tier.close()


@pytest.mark.parametrize("algorithm", ["FixedWindowCounter", "SlidingWindowCounter"])
def test_window_rollovers_under_threads_lose_no_unit(native: Any, redis_server: Any, algorithm: str) -> None:
    """Four threads decide on three keys while a fifth moves the clock a
    quarter window on every few milliseconds and the sync runs every
    millisecond: keys roll over in C (into the next window, or past idle
    ones) while the sync plans and applies them. Every unit admitted in a
    window is in our count there in Redis, and no window admits more than
    the limit."""
    from nanolimit.storage.two_tier import TwoTierStorage

    tier = TwoTierStorage(None, redis_server.client(), instance_id="t", sync_interval=0.001)
    clock = FakeClock(50_000.0)
    limit = 400
    limiter = getattr(native, algorithm)(limit, 1.0, storage=tier, clock=clock)
    keys = ["x", "y", "z"]
    admitted: dict[tuple[str, int], int] = {}
    guard = threading.Lock()
    running = [True]

    def work(seed: int) -> None:
        rng = random.Random(seed)
        mine: dict[tuple[str, int], int] = {}
        while running[0]:
            key = rng.choice(keys)
            decision = limiter.allow(key)
            if decision.allowed:
                window = (key, int(decision.at // 1.0))
                mine[window] = mine.get(window, 0) + 1
        with guard:
            for window, n in mine.items():
                admitted[window] = admitted.get(window, 0) + n

    def tick() -> None:
        rng = random.Random(7)
        for _ in range(60):
            time.sleep(0.001)
            clock.advance(0.25 if rng.random() < 0.8 else 2.25)  # some windows skipped
        running[0] = False

    try:
        threads = [threading.Thread(target=work, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        tick()
        for t in threads:
            t.join()
        tier.sync_now()
        tier.sync_now()
        client = redis_server.client()
        rolled = len({w for _, w in admitted})
        assert rolled >= 15  # windows turned over many times during the run
        for (key, window), n in admitted.items():
            base = tier._tracks[(limiter.config, key)].base
            assert int(client.hget(base + str(window), "t") or 0) == n, (key, window)
            assert n <= limit
        assert tier.metrics()["decisions_native"] > 10_000
    finally:
        running[0] = False
        tier.close()


def test_tight_limit_is_met_exactly_under_threads(native: Any, redis_server: Any) -> None:
    """One hot key, more demand than budget: the C path and the sync hand
    the lease back and forth, and exactly the limit is admitted."""
    from nanolimit.storage.two_tier import TwoTierStorage

    tier = TwoTierStorage(None, redis_server.client(), instance_id="t", sync_interval=0.002)
    limiter = native.SlidingWindowCounter(3000, 3600.0, storage=tier)
    counts = [0] * 4

    def work(i: int) -> None:
        counts[i] = sum(limiter.allow("hot").allowed for _ in range(2500))

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        tier.sync_now()
        assert sum(counts) == 3000
        assert sum(tier.fleet_counts(limiter.config, "hot").values()) == 3000
    finally:
        tier.close()


def test_lease_book_refuses_changes_while_open(native: Any) -> None:
    woken: list[int] = []
    gate = native.LeaseGate(lambda: woken.append(1))
    book = native.LeaseBook(gate, 10, 1.0, False, 0.05)
    slot = book.attach("k", "owner-of-k")
    assert book.attach("k") == slot and len(book) == 1
    assert book.pull(slot) == (None, 0, 0.0, 0, None, 0, 0, None)
    book.load(slot, 100, 2, 5, 1, 7, 100.5, 5)  # previous is ignored: not sliding
    assert book.pull(slot) == (100, 2, 100.5, 0, None, 0, 0, None)
    with pytest.raises(IndexError):
        book.pull(slot + 1)
    gate.open()
    with pytest.raises(RuntimeError, match="gate is open"):
        book.attach("other")
    with pytest.raises(RuntimeError, match="gate is open"):
        book.load(slot, 0, 0, 0, 0, 0, 0.0, 0)
    gate.close()
    book.detach("k")
    assert len(book) == 0 and book.attach("again") == slot  # the slot is reused
    with pytest.raises(ValidationError):
        native.LeaseBook(gate, 0, 1.0, False, 0.05)
    with pytest.raises(ValidationError, match="too short"):
        native.LeaseBook(gate, 10, 1e-10, False, 0.05)  # window indexes past int64
    with pytest.raises(TypeError, match="str"):
        book.attach(Shadow("k"))
    with pytest.raises(TypeError, match="str"):
        book.attach(7)
    with pytest.raises(ValidationError):
        native.LeaseGate(None)


class Shadow(str):
    """A str subclass that compares in Python (and may switch threads there)."""

    __hash__ = str.__hash__

    def __eq__(self, other: object) -> bool:
        time.sleep(0)
        return str.__eq__(self, other)


@pytest.mark.parametrize("twin", ["native", "reference"])
def test_a_str_subclass_key_is_stored_as_a_plain_str(native: Any, redis_server: Any, twin: str) -> None:
    """The C lease index is looked up under the gate's spinlock, where a
    Python ``__eq__`` could switch threads and deadlock the sync: keys enter
    it as plain str, and both spellings are the same key."""
    module = _twin(native, twin)
    (tier,) = fleet(redis_server, "sub:", 1)
    try:
        limiter = module.FixedWindowCounter(3, 60.0, storage=tier, clock=FakeClock(600.0))
        assert limiter.allow(Shadow("x")).allowed
        (track,) = tier._tracks.values()
        assert type(track.key) is str
        assert [limiter.allow("x").allowed for _ in range(3)] == [True, True, False]
        tier.sync_now()
        assert tier.fleet_counts(limiter.config, "x") == {10: 3}
    finally:
        tier.close()


@pytest.mark.parametrize("twin", ["native", "reference"])
def test_a_token_bucket_refilling_in_under_a_nanosecond(native: Any, redis_server: Any, twin: str) -> None:
    """capacity / rate under 1 ns makes window indexes overflow int64: such a
    config stays on the Python path, and decisions and syncs still work."""
    module = _twin(native, twin)
    (tier,) = fleet(redis_server, "tiny:", 1)
    try:
        clock = FakeClock(1.7e9)
        limiter = module.TokenBucket(2**32 - 1, 0.5, storage=tier, clock=clock, burst=1)
        assert tier.lease_book(limiter.config) is None
        assert limiter.allow("k").allowed
        assert tier.sync_now()
        clock.advance(1.0)
        assert limiter.allow("k").allowed
        assert tier.sync_now()
    finally:
        tier.close()


def test_a_failing_sync_does_not_end_the_background_syncs(native: Any, redis_server: Any) -> None:
    from nanolimit.storage.two_tier import TwoTierStorage

    tier = TwoTierStorage(None, redis_server.client(), instance_id="i0", prefix="boom:", sync_interval=0.02)
    real = tier._sync
    calls: list[bool] = []

    def flaky(full: bool, background: bool = False) -> bool:
        calls.append(full)
        if len(calls) == 1:
            raise RuntimeError("a bug in one sync")
        return real(full, background)

    tier._sync = flaky  # type: ignore[method-assign]
    try:
        deadline = time.monotonic() + 5.0
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(calls) >= 3  # the thread went on after the error
        assert tier.metrics()["sync_errors"] == 1
    finally:
        tier.close()


class CountingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.sets = 0

    def set(self) -> None:
        self.sets += 1
        super().set()


def test_exhausted_lease_wakes_the_sync_once(native: Any, redis_server: Any) -> None:
    """Out of lease but not of budget: denied with retry_after at most the
    sync interval, counted as an early sync, and the sync thread woken once
    per sync rather than once per request."""
    tiers = fleet(redis_server, "w:", 2)
    try:
        clock = FakeClock(4000.0)
        limiter = native.FixedWindowCounter(10, 1.0, storage=tiers[0], clock=clock)
        for tier in (*tiers, *tiers):
            tier.sync_now()
        wake = CountingEvent()
        tiers[0]._wake = wake
        results = [limiter.allow("k") for _ in range(9)]
        assert [d.allowed for d in results] == [True] * 5 + [False] * 4  # ceil(10 / 2) each
        assert all(0 < d.retry_after <= 0.05 for d in results[5:])
        assert tiers[0].metrics()["early_syncs"] == 4
        assert wake.sets == 1
        tiers[0].sync_now()  # lease ceil((10 - 5) / 2) = 3; re-armed: the next spent lease wakes it
        assert sum(limiter.allow("k").allowed for _ in range(5)) == 3
        assert wake.sets == 2
    finally:
        for tier in tiers:
            tier.close()


@pytest.mark.parametrize("twin", ["native", "reference"])
def test_background_sync_covers_only_decided_keys(native: Any, redis_server: Any, twin: str) -> None:
    """The periodic sync sends only the keys decided since the last one (in C
    or in Python); every FULL_SYNC_EVERY-th sync, and ``sync_now()``, cover
    every key."""
    from nanolimit.storage.two_tier import FULL_SYNC_EVERY, TwoTierStorage

    module = native if twin == "native" else reference
    tier = TwoTierStorage(None, redis_server.client(), instance_id="inc", start=False)
    try:
        limiter = module.FixedWindowCounter(100, 3600.0, storage=tier, clock=FakeClock(36_000.5))
        for key in ("a", "b", "c"):
            limiter.allow(key)
        assert tier.sync_now()
        assert tier.metrics()["keys_synced_last"] == 3
        limiter.allow("a")
        limiter.peek("b")  # spends nothing: nothing to push
        assert tier._sync(full=False)
        metrics = tier.metrics()
        assert metrics["keys_synced_last"] == 1 and metrics["full_syncs"] == 1
        assert tier.fleet_counts(limiter.config, "a") == {10: 2}
        assert tier._sync(full=False) and tier.metrics()["keys_synced_last"] == 0
        assert tier.sync_now() and tier.metrics()["keys_synced_last"] == 3
    finally:
        tier.close()
    tier = TwoTierStorage(None, redis_server.client(), instance_id="thread", sync_interval=0.01)
    try:
        limiter = module.FixedWindowCounter(10**6, 3600.0, storage=tier)
        deadline = time.monotonic() + 10.0
        while tier.metrics()["syncs"] < 3 * FULL_SYNC_EVERY and time.monotonic() < deadline:
            limiter.allow("a")
            time.sleep(0.002)
        metrics = tier.metrics()
        # one full sync at start, then one in every FULL_SYNC_EVERY
        assert 1 < metrics["full_syncs"] <= 1 + metrics["syncs"] // FULL_SYNC_EVERY
    finally:
        tier.close()


# Races between the C path and a sync, found in review: each drives both
# twins through the same interleaving and expects the same outcome.

MODULES = ["native", "reference"]


def _twin(native: Any, name: str) -> Any:
    return native if name == "native" else reference


@pytest.mark.parametrize("twin", MODULES)
def test_a_key_forgotten_during_a_round_trip_leaves_its_slot_alone(
    native: Any, redis_server: Any, twin: str
) -> None:
    """forget() during a sync's round trip frees the key's slot, and a new
    key takes it: the sync's answer for the forgotten key must not land on
    the new one (its units, its lease). Called here from inside the round
    trip on the sync's own thread; another thread's forget waits for it."""
    module = _twin(native, twin)
    (tier,) = fleet(redis_server, "rf:", 1)
    try:
        clock = FakeClock(100.5)
        limiter = module.FixedWindowCounter(10, 1.0, storage=tier, clock=clock)
        limiter.allow("a")
        tier.sync_now()
        real = tier._exchange

        def exchange(*args: Any) -> Any:
            out = real(*args)
            tier.forget(limiter.config, "a")
            for _ in range(3):
                limiter.allow("b")  # window 100: a new track on the freed slot
            clock.advance(1.0)
            limiter.allow("b")  # window 101 (C rolls it over)
            return out

        tier._exchange = exchange  # type: ignore[method-assign]
        tier.sync_now()
        tier._exchange = real  # type: ignore[method-assign]
        tier.sync_now()
        assert tier.fleet_counts(limiter.config, "b") == {100: 3, 101: 1}
        assert sum(limiter.allow("b").allowed for _ in range(20)) == 9
    finally:
        tier.close()


@pytest.mark.parametrize("twin", MODULES)
def test_forget_deletes_the_window_c_rolled_into(native: Any, redis_server: Any, twin: str) -> None:
    module = _twin(native, twin)
    tiers = fleet(redis_server, "fg:", 2)
    try:
        clock = FakeClock(100.5)
        mine, other = (module.FixedWindowCounter(10, 1.0, storage=t, clock=clock) for t in tiers)
        for t in (*tiers, *tiers):
            t.sync_now()
        mine.allow("k")
        tiers[0].sync_now()
        clock.advance(1.0)
        mine.allow("k")  # window 101, known to this instance only through C
        other.allow("k")
        tiers[1].sync_now()
        tiers[0].forget(mine.config, "k")
        left = [name for name in redis_server.client().keys("*fg:*") if not name.endswith(b"instances")]
        assert left == []
    finally:
        for t in tiers:
            t.close()


@pytest.mark.parametrize("twin", MODULES)
def test_a_new_instance_count_reaches_c_and_python_at_once(native: Any, redis_server: Any, twin: str) -> None:
    """The sync releases its lock between chunks: a decision there must
    divide by the same N on either path (here N goes from 1 to 2 while a key
    enters a new window, whose default share is ceil(L / N))."""
    module = _twin(native, twin)
    tiers = fleet(redis_server, "nn:", 2)
    try:
        clock = FakeClock(100.5)
        limiter = module.FixedWindowCounter(10, 1.0, storage=tiers[0], clock=clock)
        limiter.allow("u")
        limiter.allow("v")
        tiers[0].sync_now()
        tiers[0].sync_now()  # N = 1
        tiers[1].sync_now()  # a second instance joins
        limiter.allow("v")  # only "v" to sync
        admitted: list[int] = []
        armed: list[bool] = []

        class Probe:  # the storage's lock, plus a decision right after a hold ends
            def __init__(self, inner: Any) -> None:
                self.inner = inner
                self.lock = inner.lock  # the raw lock the native plan holds (gate left open)

            def __enter__(self) -> None:
                self.inner.__enter__()

            def __exit__(self, *exc: object) -> None:
                self.inner.__exit__(*exc)
                if armed:
                    armed.clear()
                    clock.set(101.2)
                    admitted.append(sum(limiter.allow("u").allowed for _ in range(10)))

        tiers[0]._lock = Probe(tiers[0]._lock)  # type: ignore[assignment]
        real = tiers[0]._exchange

        def exchange(*args: Any) -> Any:
            out = real(*args)
            armed.append(True)  # after the lock hold that reads the live count
            return out

        tiers[0]._exchange = exchange  # type: ignore[method-assign]
        tiers[0]._sync(full=False)
        assert tiers[0].instances == 2
        # the sync applies the new N in its last hold: until then both paths
        # divide by the old one (C alone used to see the new one in between)
        assert admitted == [10]
        clock.set(102.2)
        assert sum(limiter.allow("u").allowed for _ in range(10)) == 5  # ceil(10 / 2) now
    finally:
        for t in tiers:
            t.__dict__.pop("_exchange", None)  # close()'s own sync: no probe decision (it would raise)
            t.close()


@pytest.mark.parametrize("twin", MODULES)
def test_a_reused_slot_is_not_synced_for_its_previous_key(native: Any, redis_server: Any, twin: str) -> None:
    module = _twin(native, twin)
    (tier,) = fleet(redis_server, "dr:", 1)
    try:
        limiter = module.FixedWindowCounter(10, 3600.0, storage=tier, clock=FakeClock(7200.5))
        limiter.allow("a")
        tier.sync_now()
        limiter.allow("a")  # decided (in C on the native twin): to sync
        tier.forget(limiter.config, "a")
        limiter.peek("a")  # a fresh track, nothing committed
        assert tier._sync(full=False)
        assert tier.metrics()["keys_synced_last"] == 0
    finally:
        tier.close()


def test_a_zone_is_refused_as_local(native: Any, redis_server: Any) -> None:
    """Every worker that builds a TwoTierStorage is a fleet member of its
    own, so a SharedMemoryStorage as ``local`` would be shared only while
    Redis is unreachable, where the host's workers would split one member's
    blind share between them: refused when the storage is made, before
    anything reaches Redis, with what to do instead."""
    import uuid

    from nanolimit.storage.two_tier import TwoTierStorage

    zone = native.SharedMemoryStorage(f"nltest-{uuid.uuid4().hex[:16]}", max_keys=1024)
    zone.unlink()
    client = redis_server.client()
    with pytest.raises(ValidationError, match=r"SharedMemoryStorage as local.*Leave local unset"):
        TwoTierStorage(zone, client, instance_id="zoned", prefix="zoned:")
    assert not list(client.scan_iter(match="*zoned:*"))


def test_the_lease_books_key_index_survives_churn(native: Any) -> None:
    """The book's key index (in C: open addressing, backward-shift deletion)
    through growth from 16 entries, detaches in random order and slots reused:
    every attached key, looked up by an equal but distinct str, finds its own
    slot; no detached key is found."""
    rng = random.Random(5)
    gate = native.LeaseGate(lambda: None)
    book = native.LeaseBook(gate, 10, 1.0, False, 0.05)
    names = [f"user:{i}" for i in range(1500)] + ["ключ", "é" * 40, "x" * 300, "a", "ab"]
    slots: dict[str, int] = {}

    def same(key: str) -> str:  # an equal str, not the attached object
        return "".join(list(key))

    for round_ in range(4):
        for key in rng.sample(names, len(names) // 2):
            if key in slots:
                book.detach(same(key))
                del slots[key]
            else:
                slot = book.attach(key)
                assert slot not in slots.values()
                slots[key] = slot
        assert len(book) == len(slots), round_
        for key in names:
            if key in slots:
                assert book.attach(same(key)) == slots[key], (round_, key)
            else:
                book.detach(same(key))  # not there: nothing happens
        assert len(book) == len(slots)
    for key in list(slots):
        book.detach(key)
    assert len(book) == 0
    book.detach(7)  # never a key: nothing happens


@pytest.mark.parametrize("cls", ["FixedWindowCounter", "SlidingWindowCounter"])
def test_many_keys_come_and_go_and_c_answers_like_python(native: Any, redis_server: Any, cls: str) -> None:
    """Hundreds of keys tracked, forgotten and evicted idle (each attach and
    detach a change to the C key index), keys passed as the attached str and
    as fresh equal ones: the native fleet decides exactly as the reference
    one, and most decisions are the C path's."""
    rng = random.Random(11)
    (fast,) = fleet(redis_server, "ci:", 1)
    (slow,) = fleet(redis_server, "cr:", 1)
    try:
        clock = FakeClock(50_000.5)
        lim_fast = getattr(native, cls)(4, 10.0, storage=fast, clock=clock)
        lim_slow = getattr(reference, cls)(4, 10.0, storage=slow, clock=clock)
        keys = [f"k{i}" for i in range(400)]
        steps = rounds(3000, 600)
        for step in range(steps):
            op = rng.random()
            if op < 0.02:
                assert fast.sync_now() == slow.sync_now()
            elif op < 0.05:
                key = rng.choice(keys)
                fast.forget(lim_fast.config, key)
                slow.forget(lim_slow.config, key)
            elif op < 0.055:
                cutoff = clock.now() - rng.choice([0.0, 10.0])
                assert fast.evict_idle(cutoff) == slow.evict_idle(cutoff)
            elif op < 0.07:
                clock.advance(rng.choice([0.5, 3.0, 10.0]))
            else:
                key = rng.choice(keys[: rng.choice([20, 400])])
                if rng.random() < 0.5:
                    key = "".join(list(key))
                method = "peek" if op < 0.15 else "allow"
                got = getattr(lim_fast, method)(key)
                want = getattr(lim_slow, method)(key)
                assert got == want, (step, method, key, clock.now())
        assert len(fast) == len(slow) and len(fast._books[lim_fast.config]) == len(fast)
        assert fast.metrics()["decisions_native"] > steps // 3  # of ~0.93 of them: the C index found the keys
        assert slow.metrics()["decisions_native"] == 0
    finally:
        fast.close(deregister=False)
        slow.close(deregister=False)
