"""Refunds on Redis and Valkey (``RedisStorage.refund_kernel``, one
``EVALSHA`` of a refund script) and the decision time every verdict now
carries (its 8th element, ``Decision.at``), on real servers.

Against the in-memory reference twin on an injected clock, bit for bit;
charge-then-refund against a trace that never charged; a missing key, a
planted value, a frozen and a dead server, a flushed script cache; the
asyncio storage; and 8 threads charging and refunding one key.
"""

from __future__ import annotations

import asyncio
import math
import random
import threading
import time
import types
from typing import Any

import pytest
import redis.asyncio
from _helpers import FIELDS
from redis_servers import _ping, free_port, timed

from nanolimit import reference
from nanolimit._limiter_config import LimiterConfig, LimiterState
from nanolimit.errors import CircuitOpenError, RedisKeyError, RedisUnavailableError
from nanolimit.storage.redis import AsyncRedisStorage, RedisStorage

pytest_plugins = ["redis_servers"]  # the server fixtures
# decisions here are bounded in wall time: a full collection of the test
# run's heap must not be what they measure (conftest.steady_heap)
pytestmark = pytest.mark.usefixtures("steady_heap")

ALGORITHMS = ("token_bucket", "leaky_bucket", "fixed_window", "sliding_log", "sliding_counter", "gcra")
# where charge-then-refund at one instant is exactly "never charged" (the
# buckets' level + cost - cost is a float sum, which may round)
EXACT = ("fixed_window", "sliding_log", "sliding_counter", "gcra")
T0 = 1_000_000.0
TIMEOUT = 0.05
BOUND = 1.0  # seconds a call may take on a loaded 2-core box (the timeout is 50 ms)


def _reference(algorithm: str) -> type:
    return reference.LIMITERS[reference.Algorithm(algorithm)]


def _config(algorithm: str, limit: int = 4, window: float = 10.0) -> LimiterConfig:
    return LimiterConfig.build(algorithm, limit, window, rule="r")


def _state(storage: RedisStorage, config: LimiterConfig, key: str) -> LimiterState:
    state = storage.snapshot(config, key, None)
    assert state is not None
    return state


def _u(storage: RedisStorage, config: LimiterConfig, key: str) -> float:
    return _state(storage, config, key).updated_at


def _fields(d: Any) -> tuple[Any, ...]:
    """Every field a Decision answers (``at`` is compared on its own)."""
    return tuple(getattr(d, name) for name in (*FIELDS, "degraded"))


# --------------------------------------------------------------------------
# The decision time in verdicts


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_eighth_element_is_the_servers_now_the_kernel_used(make_storage: Any, algorithm: str) -> None:
    """On the server's clock: ``at`` is the key's new ``u`` (for the sliding
    log also the stamp it stored), within a second of the server's ``TIME``;
    a peek answers its ``now`` too and stores nothing."""
    storage = make_storage()
    config = _config(algorithm)
    seconds, micros = storage.client.time()
    server_now = seconds + micros / 1e6
    verdict = storage.run_kernel(config, "k", 1, None, True)
    assert len(verdict) == 8 and verdict[5] is False and verdict[6] == ""
    at = verdict[7]
    assert isinstance(at, float) and abs(at - server_now) < 1.0
    state = storage.snapshot(config, "k", None)
    assert state is not None and state.updated_at == at
    if algorithm == "sliding_log":
        assert state.log == (at,)
    peeked = storage.run_kernel(config, "k", 1, None, False)
    assert len(peeked) == 8 and peeked[7] >= at
    assert _u(storage, config, "k") == at  # a peek wrote nothing


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_at_is_max_of_clock_and_the_keys_time(make_storage: Any, algorithm: str) -> None:
    """An injected clock that steps back (within the clock-lead bound)
    decides at the key's own time: ``at`` says so; one that comes back more
    than the bound is rebased, and ``at`` is the clock."""
    storage = make_storage()
    config = _config(algorithm)
    assert storage.run_kernel(config, "k", 1, T0, True)[7] == T0
    assert storage.run_kernel(config, "k", 1, T0 - 5.0, True)[7] == T0  # stands still
    assert storage.run_kernel(config, "k", 1, T0 - 600.0, True)[7] == T0 - 600.0  # rebased


def test_batches_and_compounds_carry_each_keys_own_time(make_storage: Any) -> None:
    storage = make_storage()
    config = _config("sliding_log")
    storage.run_kernel(config, "ahead", 1, T0 + 5.0, True)
    verdicts = storage.run_kernel_many(config, ["a", "ahead", "a"], [1, 1, 1], T0)
    assert [v[7] for v in verdicts] == [T0, T0 + 5.0, T0]
    pipelined = make_storage(batch="pipeline").run_kernel_many(config, ["b", "ahead"], [1, 1], T0)
    assert [v[7] for v in pipelined] == [T0, T0 + 5.0]
    other = _config("gcra")
    parts = storage.run_kernel_all([(config, "ahead", 1), (other, "c", 1)], T0)
    assert [len(v) for v in parts] == [8, 8]
    assert [v[7] for v in parts] == [T0 + 5.0, T0]
    assert _u(storage, other, "c") == T0


def test_policy_and_near_cache_answers_say_no_time(own_server: Any) -> None:
    """A verdict the store did not make has ``at = 0.0``: nothing was
    stamped, so there is nothing a refund could name."""
    config = _config("token_bucket", limit=1)
    near = RedisStorage(own_server.client(), near_cache=True, timeout=2.0)
    near.run_kernel(config, "k", 1, T0, True)
    denied = near.run_kernel(config, "k", 1, T0, True)  # the store's denial, remembered
    assert not denied[0] and denied[-1] == T0
    cached = near.run_kernel(config, "k", 1, T0, True)
    assert near.metrics()["near_cache_hits"] == 1 and len(cached) == 8 and cached[-1] == 0.0
    storage = RedisStorage(own_server.client(), on_error="allow", timeout=TIMEOUT)
    own_server.kill()
    fallback = storage.run_kernel(config, "k", 1, T0, True)
    assert fallback[5] is True and len(fallback) == 8 and fallback[7] == 0.0


def test_decision_at_reaches_a_limiter(backend: types.SimpleNamespace, make_storage: Any) -> None:
    """Both twins' limiters read the 8th element into ``Decision.at``."""
    clock = backend.FakeClock(T0)
    limiter = backend.SlidingWindowLog(3, 10.0, make_storage(), clock, rule="at")
    first = limiter.allow("k")
    clock.advance(0.25)
    assert (first.at, limiter.allow("k").at) == (T0, T0 + 0.25)


# --------------------------------------------------------------------------
# Refunds against the reference twin, bit for bit


def _trace(rng: random.Random, algorithm: str) -> dict[str, Any]:
    window = rng.choice([0.3, 1 / 3, 1.0, 7.0, 60.0])
    limit = rng.randint(1, 8)
    burst = limit + rng.randint(0, 3) if algorithm in ("token_bucket", "gcra") else None
    return {"window": window, "limit": limit, "burst": burst, "start": rng.choice([0.0, 12345.678, 1.8e9])}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_refunds_equal_the_reference(
    backend: types.SimpleNamespace, make_storage: Any, algorithm: str
) -> None:
    """Random traces of charges, peeks, refunds (of a past decision's
    ``at``, of the latest, of a time never decided), clock steps forward
    and back (past the clock-lead bound too): every Decision (its ``at``
    too) and every state equal the reference on an InMemoryStorage
    exactly."""
    rng = random.Random(f"refund-{algorithm}-{backend.name}")
    for trace in range(12):
        storage = make_storage(prefix=f"t{trace}:")
        shape = _trace(rng, algorithm)
        window, kwargs = shape["window"], {} if shape["burst"] is None else {"burst": shape["burst"]}
        capacity = shape["burst"] or shape["limit"]
        clock = backend.FakeClock(shape["start"])
        ref_clock = reference.FakeClock(shape["start"])
        on_redis = backend.limiters[algorithm](shape["limit"], window, storage, clock, "r", **kwargs)
        in_memory = _reference(algorithm)(shape["limit"], window, None, ref_clock, "r", **kwargs)
        stamps: list[float] = []
        for step in range(40):
            where = f"trace {trace} step {step} t={clock.now()!r}"
            move = rng.random()
            if move < 0.5:
                clock.advance(rng.uniform(0.0, 0.5) * window)
            elif move < 0.6:
                clock.set(math.floor(clock.now() / window + 1) * window)
            elif move < 0.65:
                clock.advance(-rng.uniform(0.0, 1.0) * window)
            elif move < 0.68:  # back past the clock-lead bound: decisions rebase, refunds do not
                clock.advance(-rng.uniform(61.0, 200.0))
            ref_clock.set(clock.now())
            key = rng.choice(("a", "b"))
            cost = rng.randint(1, capacity)
            op = rng.random()
            if op < 0.45:
                got, want = on_redis.allow(key, cost), in_memory.allow(key, cost)
                assert _fields(got) == _fields(want) and got.at == want.at, where
                if got.allowed:
                    stamps.append(got.at)
            elif op < 0.55:
                got, want = on_redis.peek(key, cost), in_memory.peek(key, cost)
                assert _fields(got) == _fields(want) and got.at == want.at, where
            else:
                at = rng.choice([None, *stamps[-3:], clock.now() - 2 * window])
                on_redis.refund(key, cost, at=at)
                in_memory.refund(key, cost, at=at)
            assert on_redis.state(key) == in_memory.state(key), where
        assert storage.metrics()["refunds_dropped"] == 0 and storage.metrics()["errors"] == 0


@pytest.mark.parametrize("algorithm", EXACT)
def test_charge_then_refund_is_never_charged(
    backend: types.SimpleNamespace, make_storage: Any, algorithm: str
) -> None:
    """For the log, the windows and GCRA a refund of a charge at the time it
    was made leaves the key as if it had never been charged: the next
    decisions are those of a trace without it (bit for bit)."""
    rng = random.Random(f"never-{algorithm}-{backend.name}")
    storage = make_storage()
    clock = backend.FakeClock(T0)
    ref_clock = reference.FakeClock(T0)
    on_redis = backend.limiters[algorithm](5, 3.0, storage, clock, "never")
    never = _reference(algorithm)(5, 3.0, None, ref_clock, "never")
    for step in range(200):
        clock.advance(rng.choice([0.0, 0.01, 0.3, 1.0, 2.9]))
        ref_clock.set(clock.now())
        cost = rng.randint(1, 5)
        if rng.random() < 0.5:  # charged, and given back by the response
            charged = on_redis.allow("k", cost)
            if charged.allowed:
                on_redis.refund("k", cost, at=charged.at)
        else:
            got, want = on_redis.allow("k", cost), never.allow("k", cost)
            assert _fields(got) == _fields(want), f"step {step}"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_refund_formulas_by_hand(make_storage: Any, algorithm: str) -> None:
    """The stored state after one refund, computed by hand from the spec's
    formulas (not from the reference)."""
    storage = make_storage()
    config = _config(algorithm, limit=4, window=10.0)  # rate 0.4/s; GCRA interval 2.5 s
    storage.run_kernel(config, "k", 3, T0, True)
    storage.refund_kernel(config, "k", 2, None, T0 + 1.0)
    state = storage.snapshot(config, "k", None)
    assert state is not None and state.updated_at == T0 + 1.0
    if algorithm == "token_bucket":
        assert state.level == min(4.0, (4.0 - 3) + 1.0 * 0.4) + 2  # refilled, then given back
    elif algorithm == "leaky_bucket":
        assert state.level == max(0.0, 3.0 - 1.0 * 0.4) - 2
    elif algorithm == "gcra":
        interval = config.gcra_interval_us
        assert state.tat == math.floor(T0 * 1e6) + 3 * interval - 2 * interval
    elif algorithm == "fixed_window":
        assert (state.window_index, state.count) == (math.floor(T0 / 10.0), 1)
    elif algorithm == "sliding_counter":
        assert (state.window_index, state.count, state.previous) == (math.floor(T0 / 10.0), 1, 0)
    else:
        assert state.log == (T0,)
    if algorithm in ("fixed_window", "sliding_counter", "sliding_log"):  # a charge of a passed window
        storage.refund_kernel(config, "k", 1, T0 - 30.0, T0 + 1.0)
        assert storage.snapshot(config, "k", None) == state
    if algorithm == "sliding_counter":  # the previous window's charge comes off ``previous``
        storage.refund_kernel(config, "k", 5, T0, T0 + 10.0)
        assert storage.snapshot(config, "k", None).previous == 0


def test_sliding_log_refunds_inside_the_log(make_storage: Any) -> None:
    """The stamps of the charge come out wherever they sit: at the tail, in
    the middle (newer stamps kept in order), a run longer or shorter than
    the refund; the list's head, the key's ``u``, is never one of them."""
    storage = make_storage()
    config = _config("sliding_log", limit=6, window=10.0)
    for at, cost in ((T0, 2), (T0 + 1.0, 2), (T0 + 2.0, 1)):
        storage.run_kernel(config, "k", cost, at, True)
    storage.refund_kernel(config, "k", 1, T0 + 1.0, T0 + 2.0)
    assert _state(storage, config, "k").log == (T0, T0, T0 + 1.0, T0 + 2.0)
    storage.refund_kernel(config, "k", 5, T0, T0 + 2.0)
    assert _state(storage, config, "k").log == (T0 + 1.0, T0 + 2.0)
    storage.refund_kernel(config, "k", 1, None, T0 + 2.0)  # u is T0 + 2: the latest charge
    state = _state(storage, config, "k")
    assert (state.updated_at, state.log) == (T0 + 2.0, (T0 + 1.0,))
    storage.refund_kernel(config, "k", 3, T0 + 1.0, T0 + 2.0)
    assert _state(storage, config, "k").log == ()
    storage.refund_kernel(config, "k", 1, T0 + 2.0, T0 + 2.0)  # the head's time: no stamp of it
    assert _state(storage, config, "k").updated_at == T0 + 2.0


def test_a_refund_expires_and_keeps_the_ttl_rules(make_storage: Any) -> None:
    """A refund writes the expiry a decision would: the time until the state
    is "never seen" again (a full bucket: 1 ms), with the injected clock's
    floor of an hour."""
    storage = make_storage()
    config = _config("token_bucket")
    storage.run_kernel(config, "k", 1, None, True)
    storage.refund_kernel(config, "k", 1, None, None)
    rkey = storage.redis_key(config, "k")
    assert storage.client.pttl(rkey) <= 1 or not storage.client.exists(rkey)
    log = _config("sliding_log")
    storage.run_kernel(log, "k", 2, None, True)
    storage.refund_kernel(log, "k", 1, None, None)
    assert 9_000 < storage.client.pttl(storage.redis_key(log, "k")) <= 10_002
    storage.run_kernel(log, "j", 1, T0, True)
    storage.refund_kernel(log, "j", 1, T0, T0)
    assert storage.client.pttl(storage.redis_key(log, "j")) > 3_000_000


# --------------------------------------------------------------------------
# What is not the limiter's: a missing key, a planted value


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("now", [None, T0])
def test_a_missing_key_stays_missing(make_storage: Any, algorithm: str, now: float | None) -> None:
    storage = make_storage()
    config = _config(algorithm)
    storage.refund_kernel(config, "nobody", 1, None, now)
    storage.refund_kernel(config, "nobody", 2, T0, now)
    assert storage.client.exists(storage.redis_key(config, "nobody")) == 0
    assert storage.metrics()["refunds"] == 2 and storage.metrics()["errors"] == 0


PLANTED = {
    "string": lambda c, k: c.set(k, "not a limiter state"),
    "list": lambda c, k: c.rpush(k, "garbage", "1e300"),
    "hash": lambda c, k: c.hset(k, mapping={"l": "abc", "u": "abc", "k": "abc", "n": "abc", "p": "abc"}),
    "foreign hash": lambda c, k: c.hset(k, mapping={"owner": "another application"}),
}


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("planted", list(PLANTED))
def test_a_planted_value_is_left_untouched_and_counted(
    make_storage: Any, algorithm: str, planted: str
) -> None:
    storage = make_storage(on_error="allow")
    config = _config(algorithm)
    rkey = storage.redis_key(config, "evil")
    admin = storage.client
    PLANTED[planted](admin, rkey)
    admin.pexpire(rkey, 500_000)
    before = admin.dump(rkey)
    storage.refund_kernel(config, "evil", 1, None, T0)  # no raise under "allow"
    storage.refund_kernel(config, "evil", 1, T0, None)
    assert admin.dump(rkey) == before and 490_000 < admin.pttl(rkey) <= 500_000
    metrics = storage.metrics()
    assert (metrics["key_errors"], metrics["refunds_dropped"], metrics["refunds"]) == (2, 2, 0)
    assert metrics["breaker_state"] == "closed" and metrics["degraded"] == 0
    strict = make_storage(on_error="raise")
    with pytest.raises(RedisKeyError) as caught:
        strict.refund_kernel(config, "evil", 1, None, T0)
    assert caught.value.code in ("WRONGTYPE", "BADSTATE")
    assert admin.dump(rkey) == before


# --------------------------------------------------------------------------
# A store that fails


def _freeze(server: Any, seconds: float) -> threading.Thread:
    """``DEBUG SLEEP`` on its own connection; returns once the server is asleep."""
    admin = server.client(socket_timeout=seconds + 10.0)
    sleeper = threading.Thread(target=lambda: admin.execute_command("DEBUG", "SLEEP", str(seconds)))
    sleeper.start()
    deadline = time.monotonic() + 5.0
    while _ping(server.port, timeout=0.05) and time.monotonic() < deadline:
        time.sleep(0.01)
    return sleeper


def test_a_frozen_server_drops_the_refund_within_the_timeout(own_server: Any) -> None:
    config = _config("sliding_log")
    allow = RedisStorage(own_server.client(), on_error="allow", timeout=TIMEOUT, breaker_threshold=100)
    deny = RedisStorage(own_server.client(), on_error="deny", timeout=TIMEOUT, breaker_threshold=100)
    strict = RedisStorage(own_server.client(), on_error="raise", timeout=TIMEOUT, breaker_threshold=100)
    for storage in (allow, deny, strict):
        storage.run_kernel(config, "k", 1, T0, True)
    sleeper = _freeze(own_server, 1.5)
    try:
        for storage in (allow, deny):
            result, elapsed = timed(lambda s=storage: s.refund_kernel(config, "k", 1, T0, T0))
            assert result is None and elapsed < BOUND
            metrics = storage.metrics()
            assert metrics["timeouts"] == 1 and metrics["refunds_dropped"] == 1 and metrics["refunds"] == 0
        with pytest.raises(RedisUnavailableError):
            strict.refund_kernel(config, "k", 1, T0, T0)
    finally:
        sleeper.join(timeout=10)
    # (a refund that timed out may still have run once the server woke, as a
    # timed-out decision may have charged: nothing is retried.) Back awake,
    # one goes through.
    before = _state(allow, config, "k").log
    assert before is not None and len(before) >= 1
    allow.refund_kernel(config, "k", 1, T0, T0)
    assert _state(allow, config, "k").log == before[1:]
    assert allow.metrics()["refunds"] == 1


def test_a_dead_server_opens_the_breaker_and_refunds_never_raise(own_server: Any) -> None:
    config = _config("gcra")
    storage = RedisStorage(own_server.client(), on_error="allow", timeout=TIMEOUT, breaker_threshold=2)
    strict = RedisStorage(own_server.client(), on_error="raise", timeout=TIMEOUT, breaker_threshold=2)
    storage.run_kernel(config, "k", 1, None, True)
    own_server.kill()
    for _ in range(4):
        result, elapsed = timed(lambda: storage.refund_kernel(config, "k", 1, None, None))
        assert result is None and elapsed < BOUND
    metrics = storage.metrics()
    assert metrics["refunds_dropped"] == 4 and metrics["errors"] == 2 and metrics["breaker_open_skips"] == 2
    assert metrics["breaker_state"] == "open"
    with pytest.raises(RedisUnavailableError):
        strict.refund_kernel(config, "k", 1, None, None)
    with pytest.raises(RedisUnavailableError):
        strict.refund_kernel(config, "k", 1, None, None)
    with pytest.raises(CircuitOpenError):  # the breaker did not even ask
        strict.refund_kernel(config, "k", 1, None, None)


def test_nothing_listening_drops_the_refund() -> None:
    storage = RedisStorage(redis.Redis(host="127.0.0.1", port=free_port()), timeout=TIMEOUT)
    result, elapsed = timed(lambda: storage.refund_kernel(_config("fixed_window"), "k", 1, None, None))
    assert result is None and elapsed < BOUND and storage.metrics()["refunds_dropped"] == 1


def test_noscript_after_a_script_flush_reloads_and_refunds_once(make_storage: Any) -> None:
    storage = make_storage()
    config = _config("fixed_window")
    storage.run_kernel(config, "k", 3, T0, True)
    storage.client.script_flush()
    loads = storage.metrics()["script_loads"]
    storage.refund_kernel(config, "k", 1, T0, T0)
    assert storage.metrics()["script_loads"] == loads + 1
    assert storage.snapshot(config, "k", None).count == 2
    storage.refund_kernel(config, "k", 1, T0, T0)  # loaded now: no second load
    assert storage.metrics()["script_loads"] == loads + 1
    assert storage.snapshot(config, "k", None).count == 1


def test_a_refund_drops_the_keys_near_cache_denial(make_storage: Any) -> None:
    """The near-cache remembers a denial until its retry_after; a refund
    gives units back, so that denial may no longer be the store's answer."""
    storage = make_storage(near_cache=True)
    config = _config("fixed_window", limit=1, window=60.0)
    at = storage.run_kernel(config, "k", 1, T0, True)[7]
    assert not storage.run_kernel(config, "k", 1, T0, True)[0]
    storage.refund_kernel(config, "k", 1, at, T0)
    again = storage.run_kernel(config, "k", 1, T0, True)
    assert again[0] and storage.metrics()["near_cache_hits"] == 0


# --------------------------------------------------------------------------
# The asyncio storage


def test_async_refunds_equal_the_reference(redis_server: Any) -> None:
    rng = random.Random(f"async-refund-{redis_server.kind}")

    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
        storage = AsyncRedisStorage(client, on_error="raise")
        try:
            for algorithm in ALGORITHMS:
                clock = reference.FakeClock(T0)
                ref_clock = reference.FakeClock(T0)
                on_redis = _reference(algorithm)(4, 2.0, storage, clock, "async")
                in_memory = _reference(algorithm)(4, 2.0, None, ref_clock, "async")
                for step in range(40):
                    clock.advance(rng.choice([0.0, 0.1, 0.7, 2.0]))
                    ref_clock.set(clock.now())
                    cost = rng.randint(1, 4)
                    if rng.random() < 0.6:
                        got = await on_redis.allow_async("k", cost)
                        want = in_memory.allow("k", cost)
                        assert _fields(got) == _fields(want) and got.at == want.at, (algorithm, step)
                        if got.allowed and rng.random() < 0.7:
                            await on_redis.refund_async("k", cost, at=got.at)
                            in_memory.refund("k", cost, at=want.at)
                    else:
                        await on_redis.refund_async("k", cost)
                        in_memory.refund("k", cost)
                    assert await storage.snapshot_async(on_redis.config, "k") == in_memory.state("k")
            config = _config("gcra")
            await storage.refund_kernel_async(config, "nobody", 1, None, None)
            assert await storage.client.exists(storage.redis_key(config, "nobody")) == 0
            with pytest.raises(TypeError, match="refund_async"):
                storage.refund_kernel(config, "k", 1, None, None)
        finally:
            await storage.close()
            await client.aclose()

    asyncio.run(main())


def test_async_planted_flushed_and_frozen(own_server: Any) -> None:
    config = _config("token_bucket")

    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=own_server.port)
        storage = AsyncRedisStorage(client, on_error="allow", timeout=TIMEOUT, breaker_threshold=100)
        strict = AsyncRedisStorage(client, on_error="raise", timeout=TIMEOUT, breaker_threshold=100)
        admin = own_server.client()
        rkey = storage.redis_key(config, "evil")
        admin.set(rkey, "garbage")
        await storage.refund_kernel_async(config, "evil", 1, None, None)
        assert admin.get(rkey) == b"garbage" and storage.metrics()["key_errors"] == 1
        with pytest.raises(RedisKeyError):
            await strict.refund_kernel_async(config, "evil", 1, None, None)
        await storage.run_kernel_async(config, "k", 3, T0, True)
        admin.script_flush()
        await storage.refund_kernel_async(config, "k", 2, None, T0)
        state = await storage.snapshot_async(config, "k")
        assert state is not None and state.level == 3.0
        sleeper = _freeze(own_server, 1.5)
        try:
            start = time.monotonic()
            await storage.refund_kernel_async(config, "k", 1, None, T0)
            assert time.monotonic() - start < BOUND and storage.metrics()["refunds_dropped"] == 2
            with pytest.raises(RedisUnavailableError):
                await strict.refund_kernel_async(config, "k", 1, None, T0)
        finally:
            await asyncio.get_running_loop().run_in_executor(None, sleeper.join, 10)
        await storage.close()
        await strict.close()
        await client.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------------
# Threads


@pytest.mark.parametrize("algorithm", EXACT)
def test_eight_threads_charge_and_refund_one_key(make_storage: Any, algorithm: str) -> None:
    """Each thread charges the key and gives its charge back, 25 times, on
    one instant of an injected clock: at the end the key is a fresh key's
    (nothing spent), which a lost update or a double refund would break."""
    config = _config(algorithm, limit=5, window=60.0)
    storages = [make_storage() for _ in range(8)]
    problems: list[str] = []

    def work(storage: RedisStorage) -> None:
        try:
            for _ in range(25):
                verdict = storage.run_kernel(config, "hot", 1, T0, True)
                if verdict[0]:
                    storage.refund_kernel(config, "hot", 1, float(verdict[-1]), T0)
        except Exception as exc:  # the point: nothing may escape
            problems.append(repr(exc))

    threads = [threading.Thread(target=work, args=(s,)) for s in storages]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not problems
    state = storages[0].snapshot(config, "hot", None)
    assert state is not None and state.updated_at == T0
    if algorithm == "gcra":
        assert state.tat == math.floor(T0 * 1e6)
    elif algorithm == "sliding_log":
        assert state.log == ()
    else:
        assert (state.window_index, state.count, state.previous or 0) == (math.floor(T0 / 60.0), 0, 0)
    # and the next five pass, as on a never-charged key
    assert [storages[0].run_kernel(config, "hot", 1, T0, True)[0] for _ in range(6)] == [True] * 5 + [False]
