"""``on_error="local"`` on real Redis 7 and Valkey 9 servers: while the
server is unreachable (killed, refused, frozen with SIGSTOP, behind the open
breaker) decisions are made in a bounded local store at a share of each
limit, degraded with ``reason="store_unavailable_local"``; the server's
breaker closed again (once it opened, after ``breaker_threshold`` answers
in a row, the probe's the first; before it opened, at the first answer)
hands decisions back to Redis, and what was admitted locally is never
replayed there (docs/redis.md, "Failures").

The exact-count tests run on an injected clock that stays inside one window,
and on a server with an fsync-always append-only file: a SIGKILL then keeps
every charge made before it, so the Redis-side count after the restart
shows exactly what was (and was not) written there.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
import types
from collections.abc import Iterator
from typing import Any

import pytest
import redis
import redis.asyncio
from redis_servers import Server, free_port, require_binary, timed

from nanolimit import FakeClock, ValidationError, reference
from nanolimit.storage.redis import REASON_STORE_UNAVAILABLE_LOCAL, AsyncRedisStorage, RedisStorage
from nanolimit.storage.uri import storage_from_uri

pytest_plugins = ["redis_servers"]  # the server fixtures
# decisions here are bounded in wall time: a full collection of the test
# run's heap must not be what they measure (conftest.steady_heap)
pytestmark = pytest.mark.usefixtures("steady_heap")

LOCAL = REASON_STORE_UNAVAILABLE_LOCAL
TIMEOUT = 0.05
DURABLE_TIMEOUT = 2.0
BOUND = 1.0  # generous for a loaded CI box, far from redis-py's 5 s default
T0 = 1_000_000.0  # window 60 s: T0 .. T0 + 3 stays inside one fixed window
LIMIT = 10
INSTANCES = 2  # local share 1/2: 5 of 10


@pytest.fixture
def durable_server(server_kind: str) -> Iterator[Server]:
    """A server of its own whose data survives SIGKILL (AOF, fsync always)."""
    server = Server(
        require_binary(server_kind),
        server_kind,
        extra=("--appendonly", "yes", "--appendfsync", "always"),
    )
    server.start()
    try:
        yield server
    finally:
        server.stop()


def _storage(server: Server, **kwargs: Any) -> RedisStorage:
    kwargs.setdefault("on_error", "local")
    # an fsync per write can outlast 50 ms on a busy disk; a killed server
    # refuses at once whatever the timeout
    kwargs.setdefault("timeout", DURABLE_TIMEOUT if "--appendonly" in server.extra else TIMEOUT)
    kwargs.setdefault("breaker_threshold", 3)
    kwargs.setdefault("breaker_cooldown", 0.1)
    return RedisStorage(server.client(), **kwargs)


def _limiter(backend: types.SimpleNamespace, algorithm: str, storage: Any, clock: Any, rule: str) -> Any:
    return backend.limiters[algorithm](LIMIT, 60.0, storage, clock, rule)


def _healthy(limiter: Any, key: str, limit: float = 10.0) -> tuple[Any, int]:
    """The first decision Redis makes after a restart, and how many local
    ones came before it (each must have been denied: the share was spent)."""
    deadline = time.monotonic() + limit
    local = 0
    while time.monotonic() < deadline:
        d = limiter.allow(key)
        if not d.degraded:
            return d, local
        assert d.reason == LOCAL and not d.allowed, "the spent local share admitted again"
        local += 1
        time.sleep(0.02)
    raise AssertionError("decisions did not come back from Redis")


def test_kill_and_restart_each_algorithm(
    backend: types.SimpleNamespace, durable_server: Server, algorithm: str
) -> None:
    """Before: 3 in Redis. Outage: exactly the share (5) admitted locally.
    After: Redis admits exactly its own 7 — the local 5 were not replayed —
    and its state is the state of those 10 charges alone."""
    storage = _storage(durable_server, local_instances=INSTANCES)
    clock = backend.FakeClock(T0)
    limiter = _limiter(backend, algorithm, storage, clock, "kill")
    before = [limiter.allow("k") for _ in range(3)]
    assert all(d.allowed and not d.degraded for d in before), (
        [(d.allowed, d.reason) for d in before],
        storage.metrics(),
    )

    durable_server.kill()
    clock.advance(1.0)
    during = [limiter.allow("k") for _ in range(12)]
    assert all(d.degraded and d.reason == LOCAL for d in during)
    assert sum(d.allowed for d in during) == LIMIT // INSTANCES
    assert [d.allowed for d in during] == [True] * 5 + [False] * 7  # the share, then denials
    assert during[0].limit == LIMIT and during[0].remaining == 4  # the header limit is the rule's
    m = storage.metrics()
    assert m["local_active"] == 1 and m["local_episodes"] == 1
    assert m["local_decisions"] == 12 and m["local_denials"] == 7 and m["degraded"] == 12

    durable_server.start()
    clock.advance(1.0)
    first, waited = _healthy(limiter, "k")
    after = [first] + [limiter.allow("k") for _ in range(10)]
    assert all(not d.degraded for d in after)
    assert sum(d.allowed for d in after) == LIMIT - 3  # what Redis had left: nothing of the outage
    assert sum(d.allowed for d in before + during + after) == LIMIT + LIMIT // INSTANCES
    m = storage.metrics()
    assert m["local_active"] == 0 and m["breaker_state"] == "closed"
    assert m["local_decisions"] == 12 + waited and m["local_episodes"] == 1

    # The Redis-side state is exactly that of the 10 charges made there.
    mirror = _limiter(backend, algorithm, backend.InMemoryStorage(), backend.FakeClock(T0), "kill")
    for _ in range(3):
        mirror.allow("k")
    mirror.clock.advance(2.0)
    for _ in range(LIMIT - 3):
        mirror.allow("k")
    assert limiter.state("k") == mirror.state("k")


def test_a_frozen_server_falls_back_within_the_timeout(
    backend: types.SimpleNamespace, own_server: Server
) -> None:
    """SIGSTOP: each decision gives up after the socket timeout and the
    local store answers; after SIGCONT Redis decides again."""
    storage = _storage(own_server, breaker_threshold=100, local_instances=INSTANCES)
    limiter = _limiter(backend, "sliding_counter", storage, backend.FakeClock(T0), "frozen")
    assert not limiter.allow("warm").degraded
    proc = own_server.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        # another key than after the thaw: a request sent to the frozen
        # server may still run when it wakes (a timeout is not a refusal)
        seen = []
        for _ in range(7):
            d, elapsed = timed(lambda: limiter.allow("frozen-key"))
            assert d.degraded and d.reason == LOCAL and elapsed < BOUND
            seen.append(d.allowed)
        assert seen == [True] * 5 + [False] * 2
        m = storage.metrics()
        assert m["timeouts"] >= 1 and m["local_active"] == 1 and m["local_decisions"] == 7
    finally:
        proc.send_signal(signal.SIGCONT)
    d, _ = _healthy(limiter, "warm")
    assert d.allowed and d.remaining == LIMIT - 2
    assert storage.metrics()["local_active"] == 0


def test_eight_threads_never_exceed_the_share(
    backend: types.SimpleNamespace, own_server: Server, algorithm: str
) -> None:
    storage = _storage(own_server, local_instances=4, breaker_cooldown=30.0)
    limiter = backend.limiters[algorithm](100, 60.0, storage, backend.FakeClock(T0), "threads")
    own_server.kill()
    admitted = [0] * 8
    problems: list[str] = []
    start = threading.Barrier(8)

    def work(slot: int) -> None:
        start.wait()
        for _ in range(40):
            try:
                d = limiter.allow("shared")
            except Exception as exc:  # nothing may escape into a request
                problems.append(repr(exc))
                return
            if d.reason != LOCAL:
                problems.append(f"reason {d.reason!r}")
            admitted[slot] += d.allowed

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not problems
    assert sum(admitted) == 100 // 4
    m = storage.metrics()
    assert m["local_decisions"] == 320 and m["local_denials"] == 320 - 25


def test_batches_compounds_and_peeks_decide_locally(
    backend: types.SimpleNamespace, own_server: Server
) -> None:
    storage = _storage(own_server, local_share=0.5, rule_on_error={"login": "deny"})
    clock = backend.FakeClock(T0)
    api = backend.FixedWindowCounter(LIMIT, 60.0, storage, clock, "api")
    user = backend.TokenBucket(4, 60.0, storage, clock, "user")  # share 2
    login = backend.GCRA(LIMIT, 60.0, storage, clock, "login")
    storage.load_scripts()
    own_server.kill()

    assert api.peek("p").allowed and api.peek("p").reason == LOCAL  # a peek charges nothing
    batch, elapsed = timed(lambda: api.allow_many(["p"] * 7))
    assert elapsed < BOUND and batch.degraded and batch.allowed_count == 5
    assert [d.reason for d in batch] == [LOCAL] * 7 and batch.reasons == dict.fromkeys(range(7), LOCAL)

    # all-or-nothing in the local store: two pass, the third is refused by
    # the user limit and charges the api limit nothing
    for _ in range(2):
        compound = storage.allow_all([(api, "c"), (user, "c")])
        assert compound.allowed and compound.degraded
        assert {d.reason for d in compound.decisions} == {LOCAL}
    compound = storage.allow_all([(api, "c"), (user, "c")])
    assert not compound.allowed and compound.denied_by == "user"
    assert api.allow_many(["c"] * 4).allowed_count == 3  # 5 - the two compounds

    # another policy denies: the local limits only look
    compound = storage.allow_all([(api, "d"), (login, "d")])
    assert not compound.allowed and compound.denied_by == "login"
    assert [d.reason for d in compound.decisions] == [LOCAL, "store_unavailable"]
    assert api.allow_many(["d"] * 6).allowed_count == 5  # nothing was charged

    m = storage.metrics()
    assert m["local_active"] == 1 and m["local_decisions"] > 0


def test_refunds_go_where_the_charge_was_made(backend: types.SimpleNamespace, durable_server: Server) -> None:
    storage = _storage(durable_server, local_instances=INSTANCES)
    clock = backend.FakeClock(T0)
    limiter = backend.FixedWindowCounter(LIMIT, 60.0, storage, clock, "refund")
    in_redis = limiter.allow("k")
    assert in_redis.allowed and not in_redis.degraded

    durable_server.kill()
    clock.advance(1.0)
    local = [limiter.allow("k") for _ in range(5)]
    assert all(d.allowed and d.reason == LOCAL for d in local)
    assert not limiter.allow("k").allowed
    limiter.refund("k", at=local[0].at)  # a local charge: given back locally
    assert limiter.allow("k").allowed
    assert not limiter.allow("k").allowed
    limiter.refund("k", at=in_redis.at)  # Redis's charge: Redis cannot be reached, dropped
    assert not limiter.allow("k").allowed
    m = storage.metrics()
    assert m["local_refunds"] == 1 and m["refunds_dropped"] == 1

    durable_server.start()
    clock.advance(1.0)
    _healthy(limiter, "k")  # one more unit in Redis: 2 of its 10
    limiter.refund("k", at=local[1].at)  # after the handover: never credited to Redis
    state = limiter.state("k")
    assert state is not None and state.count == 2
    limiter.refund("k", at=in_redis.at)  # Redis's own charge: refunded there
    state = limiter.state("k")
    assert state is not None and state.count == 1
    m = storage.metrics()
    assert m["local_refunds"] == 2 and m["refunds"] == 1


def test_each_outage_starts_a_fresh_bounded_store(backend: types.SimpleNamespace, own_server: Server) -> None:
    storage = _storage(own_server, local_instances=INSTANCES, local_max_keys=3, breaker_threshold=1)
    clock = backend.FakeClock(T0)
    limiter = _limiter(backend, "gcra", storage, clock, "episodes")
    own_server.kill()
    for i in range(10):
        assert limiter.allow(f"k{i}").reason == LOCAL
    local = storage._local
    assert local is not None and local._episode is not None
    assert len(local._episode.store) <= 3  # bounded: the oldest keys were evicted
    assert sum(limiter.allow("x").allowed for _ in range(8)) == 5
    own_server.start()
    _healthy(limiter, "x")
    assert storage.metrics()["local_active"] == 0
    own_server.kill()  # a second outage: a fresh local store, a fresh share
    assert sum(limiter.allow("x").allowed for _ in range(8)) == 5
    m = storage.metrics()
    assert m["local_episodes"] == 2 and m["local_active"] == 1


def test_the_episode_ends_when_the_breaker_is_closed_again(
    backend: types.SimpleNamespace, own_server: Server
) -> None:
    """What docs/redis.md says of the handover: the episode ends when the
    breaker is closed again: once it opened, after ``breaker_threshold``
    answers in a row, the probe's the first (not at the first answer);
    before it opened, at the first answer."""
    storage = _storage(own_server, breaker_threshold=3)
    limiter = _limiter(backend, "fixed_window", storage, backend.FakeClock(T0), "handover")
    own_server.kill()
    assert limiter.allow("k").reason == LOCAL  # one failure of three: the breaker is closed
    own_server.start()
    assert not limiter.allow("k").degraded and storage.metrics()["local_active"] == 0
    own_server.kill()
    for _ in range(4):
        assert limiter.allow("k").reason == LOCAL
    assert storage.metrics()["breaker_state"] != "closed"
    own_server.start()
    deadline = time.monotonic() + 10.0
    while limiter.allow("k").degraded:  # until the probe's answer: recovering
        assert time.monotonic() < deadline, "decisions did not come back from Redis"
        time.sleep(0.02)
    assert storage.metrics()["local_active"] == 1
    assert not limiter.allow("k").degraded and storage.metrics()["local_active"] == 1
    assert not limiter.allow("k").degraded and storage.metrics()["local_active"] == 0
    assert storage.metrics()["local_episodes"] == 2


def test_per_rule_local_and_key_errors(backend: types.SimpleNamespace, own_server: Server) -> None:
    """``rule_on_error`` picks "local" per rule; a key's error reply (the
    server is up) is denied under "local", never decided locally."""
    storage = _storage(own_server, on_error="allow", rule_on_error={"strict": "local"}, local_instances=5)
    clock = backend.FakeClock(T0)
    strict = backend.SlidingWindowLog(LIMIT, 60.0, storage, clock, "strict")
    loose = backend.SlidingWindowLog(LIMIT, 60.0, storage, clock, "loose")
    admin = own_server.client()
    admin.set(storage.redis_key(strict.config, "planted"), "not a log")
    d = strict.allow("planted")
    assert not d.allowed and d.degraded and d.reason == "store_error"
    assert storage.metrics()["local_decisions"] == 0
    own_server.kill()
    assert [strict.allow("s").allowed for _ in range(3)] == [True, True, False]
    assert all(loose.allow("s").allowed for _ in range(20))  # fails open, as its policy says
    assert loose.allow("s").reason == "store_unavailable"


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"local_share": 0}, "local_share"),
        ({"local_share": -0.5}, "local_share"),
        ({"local_share": 1.01}, "local_share"),
        ({"local_share": float("nan")}, "local_share"),
        ({"local_share": True}, "local_share"),
        ({"local_share": "0.5"}, "local_share"),
        ({"local_instances": 0}, "local_instances"),
        ({"local_instances": 1.5}, "local_instances"),
        ({"local_instances": True}, "local_instances"),
        ({"local_max_keys": 0}, "local_max_keys"),
        ({"local_max_keys": None}, "local_max_keys"),
    ],
)
def test_bad_options_are_validation_errors(options: dict[str, Any], name: str) -> None:
    client = redis.Redis(host="127.0.0.1", port=free_port())
    with pytest.raises(ValidationError, match=name):
        RedisStorage(client, on_error="local", **options)
    with pytest.raises(ValidationError, match=name):
        AsyncRedisStorage(redis.asyncio.Redis(host="127.0.0.1", port=free_port()), **options)


def test_storage_from_uri_takes_the_local_options(own_server: Server) -> None:
    base = f"redis://127.0.0.1:{own_server.port}/?on_error=local"
    storage = storage_from_uri(base + "&local_share=0.25&local_max_keys=50")
    assert isinstance(storage, RedisStorage) and storage.on_error == "local"
    local = storage._local
    assert local is not None and local.share == 0.25 and local.max_keys == 50
    storage = storage_from_uri(base + "&local_instances=3")
    assert isinstance(storage, RedisStorage) and storage._local is not None
    assert storage._local.instances == 3 and storage._local.share == 1 / 3
    for bad, name in (("local_share=2", "local_share"), ("local_instances=0", "local_instances")):
        with pytest.raises(ValidationError, match=name):
            storage_from_uri(f"{base}&{bad}")
    with pytest.raises(ValidationError, match="local_share"):  # past a float: no OverflowError
        storage_from_uri(base, local_share=10**400)


def test_the_async_store_falls_back_and_hands_over(
    backend: types.SimpleNamespace, durable_server: Server
) -> None:
    async def main() -> None:
        storage = AsyncRedisStorage(
            redis.asyncio.Redis(host="127.0.0.1", port=durable_server.port),
            on_error="local",
            local_instances=INSTANCES,
            timeout=DURABLE_TIMEOUT,
            breaker_threshold=3,
            breaker_cooldown=0.1,
        )
        clock = backend.FakeClock(T0)
        limiter = backend.TokenBucket(LIMIT, 60.0, storage, clock, rule="async")
        before = [await limiter.allow_async("k") for _ in range(3)]
        assert all(d.allowed and not d.degraded for d in before), (
            [(d.allowed, d.reason) for d in before],
            storage.metrics(),
        )
        durable_server.kill()
        clock.advance(1.0)
        during = [await limiter.allow_async("k") for _ in range(8)]
        assert [d.allowed for d in during] == [True] * 5 + [False] * 3
        assert {d.reason for d in during} == {LOCAL}
        await limiter.refund_async("k", at=during[0].at)
        assert (await limiter.allow_async("k")).allowed
        verdicts = await storage.run_kernel_many_async(limiter.config, ["b", "b", "b"], [2, 2, 2], T0 + 1)
        assert [v[0] for v in verdicts] == [True, True, False] and {v[6] for v in verdicts} == {LOCAL}
        assert storage.metrics()["local_active"] == 1
        durable_server.start()
        clock.advance(1.0)
        deadline = time.monotonic() + 10.0
        while True:
            d = await limiter.allow_async("k")
            if not d.degraded:
                break
            assert not d.allowed and time.monotonic() < deadline
            await asyncio.sleep(0.02)
        after = [d] + [await limiter.allow_async("k") for _ in range(10)]
        assert sum(x.allowed for x in after) == LIMIT - 3 and not any(x.degraded for x in after)
        m = storage.metrics()
        assert m["local_active"] == 0 and m["local_refunds"] == 1
        await storage.close()

    asyncio.run(main())


def test_a_decision_routed_to_a_node_that_left_the_map_spends_its_old_share() -> None:
    """The race a failover opens (a cluster's refresh thread prunes the dead
    node and hands its episode over while a decision routed to it is still
    failing): that stale decision is charged to the node's last episode, so
    its share is not granted twice, and it begins no outage that nothing
    would end. The same name behind a fresh breaker (the node back in the
    map and failing again) is a new outage with a share of its own."""
    from nanolimit.storage.redis._local import LocalFallback
    from nanolimit.storage.redis._resilience import _Breaker

    config = reference.FixedWindowCounter(10, 3600.0, clock=FakeClock(T0), rule="f").config
    fallback = LocalFallback(0.5, 2, 1000, 256, 1.0)
    node = "127.0.0.1:7000"
    stale = _Breaker(3, 0.2, node)
    admitted = [fallback.decide(config, "k", 1, T0, True, stale)[0] for _ in range(7)]
    assert admitted == [True] * 5 + [False] * 2
    assert fallback.metrics()["local_active"] == 1
    stale.retired = True  # what NodeRoutes._prune does, before the storage's handover
    fallback.handover(node)
    late = fallback.decide(config, "k", 1, T0, True, stale)
    assert not late[0] and late[6] == LOCAL
    assert fallback.decide_all([(config, "k", 1, T0)], True, stale)[0][0] is False
    m = fallback.metrics()
    assert m["local_active"] == 0 and m["local_episodes"] == 1
    # a stale decision on a node whose outage had no episode yet: one share, never active
    other = _Breaker(3, 0.2, "127.0.0.1:7001")
    other.retired = True
    assert [fallback.decide(config, "k", 1, T0, True, other)[0] for _ in range(6)] == [True] * 5 + [False]
    assert fallback.metrics()["local_active"] == 0
    fresh = _Breaker(3, 0.2, node)
    assert fallback.decide(config, "k", 1, T0, True, fresh)[0]
    assert fallback.metrics()["local_active"] == 1
