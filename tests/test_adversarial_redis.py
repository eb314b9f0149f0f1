"""The Redis backend against a hostile or failing store, on real servers.

Why these tests exist: a value planted at one limiter key used to feed the
circuit breaker like a dead server, so five poisoned calls opened it and every
other identity was answered by ``on_error`` (under ``"allow"``, an exhausted
key was admitted). Here a poisoned key must answer alone, by its own policy,
counted in ``key_errors``, while every other key keeps exact decisions; the
failures that do mean "the server cannot answer" (a SIGKILL, a frozen server,
``BUSY``) still open the breaker and recover; ``FLUSHALL`` and ``SCRIPT
FLUSH`` do what docs/redis.md says; and a clock that jumps a year ahead and
back never locks a key out (the scripts' half of the clock-lead rule).

Every server is a loopback process of ``redis_servers`` (shared, or this
test's own), bounded in time and stopped by its PID.
"""

from __future__ import annotations

import asyncio
import math
import signal
import threading
import time
import types
from collections.abc import Callable
from typing import Any

import pytest
from _helpers import FIELDS
from redis_servers import Server, require_binary, timed, until_healthy

from nanolimit import reference
from nanolimit.errors import RedisKeyError
from nanolimit.storage.redis import MAX_CLOCK_LEAD, AsyncRedisStorage, RedisStorage

pytest_plugins = ["redis_servers"]  # the server fixtures
# decisions here are bounded in wall time: a full collection of the test
# run's heap must not be what they measure (conftest.steady_heap)
pytestmark = pytest.mark.usefixtures("steady_heap")

ALGORITHMS = ("token_bucket", "leaky_bucket", "fixed_window", "sliding_log", "sliding_counter", "gcra")
CAPACITY = 3
WINDOW = 3600.0
POISONED_CALLS = 20
TIMEOUT = 0.05
BOUND = 1.0  # seconds a decision may take on a loaded 2-core box (the timeout is 50 ms)
YEAR = 365 * 86400.0
T0 = 1_000_000.0
EPSILON = 1e-3  # past a boundary that floating point may put a hair later

Plant = Callable[[Any, str], Any]

# A value of every type at a limiter's key. For the algorithm whose own type
# it is (a hash for the buckets and windows, a string for GCRA, a list for the
# sliding log) it is garbage of the right type: BADSTATE instead of WRONGTYPE.
FOREIGN: dict[str, Plant] = {
    "string": lambda c, k: c.set(k, "not a limiter state"),
    "list": lambda c, k: c.rpush(k, "garbage", "more garbage"),
    "set": lambda c, k: c.sadd(k, "a", "b"),
    "zset": lambda c, k: c.zadd(k, {"a": 1.0}),
    "stream": lambda c, k: c.xadd(k, {"f": "v"}),
    "hash": lambda c, k: c.hset(k, mapping={"l": "abc", "u": "abc", "k": "abc", "n": "abc", "p": "abc"}),
}


def _hash(**fields: str) -> Plant:
    return lambda c, k: c.hset(k, mapping=fields)


def _list(*items: str) -> Plant:
    return lambda c, k: c.rpush(k, *items)


def _string(text: str) -> Plant:
    return lambda c, k: c.set(k, text)


_BUCKET = [
    ("level-not-a-number", _hash(l="abc", u="1000")),
    ("level-minus-1e308", _hash(l="-1e308", u="1000")),  # would lock the key out
    ("level-nan", _hash(l="nan", u="1000")),
    ("level-inf", _hash(l="inf", u="1000")),
    ("level-over-max-limit", _hash(l="1e300", u="1000")),  # a leaky bucket would never drain
    ("stamp-missing", _hash(l="1")),
    ("level-missing", _hash(u="1000")),
    ("stamp-1e300", _hash(l="1", u="1e300")),
    ("no-limiter-fields", _hash(owner="another application")),
]
_WINDOWS = [
    ("index-not-a-number", _hash(k="abc", n="1", p="0", u="1000")),
    ("index-fractional", _hash(k="0.5", n="1", p="0", u="1000")),
    ("count-negative", _hash(k="0", n="-1e308", p="0", u="1000")),  # unlimited within the window
    ("count-fractional", _hash(k="0", n="1.5", p="0", u="1000")),
    ("count-inf", _hash(k="0", n="inf", p="0", u="1000")),
    ("stamp-missing", _hash(k="0", n="1", p="0")),
    ("index-missing", _hash(n="1", p="0", u="1000")),
    ("no-limiter-fields", _hash(owner="another application")),
]
GARBAGE: dict[str, list[tuple[str, Plant]]] = {
    "token_bucket": _BUCKET,
    "leaky_bucket": _BUCKET,
    "fixed_window": _WINDOWS,
    "sliding_counter": [
        *_WINDOWS,
        ("previous-negative", _hash(k="0", n="0", p="-5", u="1000")),
        ("previous-missing", _hash(k="0", n="0", u="1000")),
    ],
    "gcra": [
        ("words", _string("not a state")),
        ("empty", _string("")),
        ("no-stamp", _string("5")),
        ("tat-not-a-number", _string("abc 1000")),
        ("tat-fractional", _string("1.5 1000")),
        ("tat-1e300", _string("1e300 1000")),  # would lock the key out (and overflow PEXPIRE)
        ("stamp-nan", _string("5 nan")),
    ],
    "sliding_log": [
        ("stamp-not-a-number", _list("abc")),
        ("entry-not-a-number", _list("1000", "abc")),
        ("entry-far-ahead-of-its-stamp", _list("1000", "1e300")),  # would lock the key out
        ("entry-minus-inf", _list("1000", "-inf")),
        ("stamp-inf", _list("inf", "1")),
    ],
}
GARBAGE_CASES = [(algo, label, plant) for algo, cases in GARBAGE.items() for label, plant in cases]


def _limiter(backend: types.SimpleNamespace, algorithm: str, storage: Any, clock: Any, rule: str) -> Any:
    return backend.limiters[algorithm](CAPACITY, WINDOW, storage, clock, rule)


def _exhaust(limiter: Any, key: str) -> None:
    got = [limiter.allow(key).allowed for _ in range(CAPACITY + 1)]
    assert got == [True] * CAPACITY + [False]


def _frozen(admin: Any, rkey: str) -> tuple[Any, int]:
    """What must not change under a poisoned key: its serialized value and its TTL."""
    return admin.dump(rkey), admin.pttl(rkey)


def _check_poisoned_key_answers_alone(
    backend: types.SimpleNamespace, storage: RedisStorage, admin: Any, algorithm: str, plant: Plant
) -> None:
    """The contract of the fix, on one planted value: the planted key is
    answered by its policy (``allow`` here) and counted; an exhausted
    unrelated key stays denied, exactly, through 20 poisoned calls; the
    breaker never opens; nothing is written to the planted value."""
    clock = backend.FakeClock(T0)
    limiter = _limiter(backend, algorithm, storage, clock, "poison")
    _exhaust(limiter, "victim")
    rkey = storage.redis_key(limiter.config, "evil")
    plant(admin, rkey)
    before = _frozen(admin, rkey)
    for _ in range(POISONED_CALLS):
        bad = limiter.allow("evil")
        assert bad.allowed and bad.degraded and bad.reason == "store_error", bad
        victim = limiter.allow("victim")
        assert not victim.allowed and not victim.degraded, victim
        assert victim.retry_after > 0
    peeked = limiter.peek("evil")
    assert peeked.degraded and peeked.reason == "store_error"
    assert not limiter.peek("victim").degraded
    m = storage.metrics()
    assert m["key_errors"] == POISONED_CALLS + 1
    assert m["errors"] == POISONED_CALLS + 1  # every failed call, of either kind
    assert m["breaker_opened"] == 0 and m["breaker_state"] == "closed"
    assert m["breaker_open_skips"] == 0 and m["write_refused"] == 0
    assert _frozen(admin, rkey) == before  # left untouched: not rewritten, no expiry set
    fresh = limiter.allow("someone-else")
    assert fresh.allowed and not fresh.degraded and fresh.remaining == CAPACITY - 1


@pytest.fixture
def admin(redis_server: Any) -> Any:
    """A plain client on the shared server, for planting and inspecting."""
    client = redis_server.client()
    yield client
    client.close()


def _storage(make_storage: Any, **kwargs: Any) -> RedisStorage:
    kwargs.setdefault("on_error", "allow")
    kwargs.setdefault("breaker_threshold", 5)
    kwargs.setdefault("breaker_cooldown", 30.0)  # an opened breaker stays visibly open
    storage: RedisStorage = make_storage(**kwargs)
    return storage


# --------------------------------------------------------------------------
# A. Poisoned keys answer alone


@pytest.mark.parametrize("planted", list(FOREIGN))
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_value_of_any_type_at_a_key_answers_that_key_alone(
    backend: types.SimpleNamespace, make_storage: Any, admin: Any, algorithm: str, planted: str
) -> None:
    _check_poisoned_key_answers_alone(backend, _storage(make_storage), admin, algorithm, FOREIGN[planted])


@pytest.mark.parametrize(
    ("algorithm", "label", "plant"),
    GARBAGE_CASES,
    ids=[f"{algo}-{label}" for algo, label, _ in GARBAGE_CASES],
)
def test_garbage_of_the_right_type_is_rejected_not_trusted(
    backend: types.SimpleNamespace, make_storage: Any, admin: Any, algorithm: str, label: str, plant: Plant
) -> None:
    """A state of the limiter's own type whose fields do not parse, are
    missing, or lie outside what the kernel itself writes must neither crash
    the script (the old way to a policy answer for everyone) nor be taken at
    face value (``l=-1e308`` would lock the key out for ever, ``n=-1e308``
    would admit without limit): it is a per-key ``BADSTATE``."""
    _check_poisoned_key_answers_alone(backend, _storage(make_storage), admin, algorithm, plant)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_poisoned_key_under_deny_and_raise(
    backend: types.SimpleNamespace, make_storage: Any, admin: Any, algorithm: str
) -> None:
    """``deny`` denies the poisoned key alone (the others keep their exact
    budget); ``raise`` raises ``RedisKeyError`` with the reply's code."""
    storage = _storage(make_storage, on_error="deny", rule_on_error={"loud": "raise"})
    clock = backend.FakeClock(T0)
    quiet = _limiter(backend, algorithm, storage, clock, "quiet")
    loud = _limiter(backend, algorithm, storage, clock, "loud")
    for limiter in (quiet, loud):
        admin.sadd(storage.redis_key(limiter.config, "evil"), "x")
    for i in range(POISONED_CALLS):
        d = quiet.allow("evil")
        assert not d.allowed and d.degraded and d.reason == "store_error"
        assert d.retry_after == storage.deny_retry_after
        with pytest.raises(RedisKeyError) as raised:
            loud.allow("evil")
        assert raised.value.code == "WRONGTYPE"
        if i < CAPACITY:
            ok = quiet.allow("fine")
            assert ok.allowed and not ok.degraded and ok.remaining == CAPACITY - 1 - i
    assert not quiet.allow("fine").allowed  # the budget of an honest key is exact
    assert storage.metrics()["breaker_opened"] == 0


@pytest.mark.parametrize("batch", ["script", "pipeline"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_poisoned_key_in_a_batch_fails_only_itself(
    backend: types.SimpleNamespace, make_storage: Any, admin: Any, algorithm: str, batch: str
) -> None:
    """A batch script decides up to 200 keys: one key's error must not turn
    its batch-mates into policy answers (it is caught in the script, per key)."""
    storage = _storage(make_storage, batch=batch)
    limiter = _limiter(backend, algorithm, storage, backend.FakeClock(T0), "batch")
    _exhaust(limiter, "victim")
    admin.set(storage.redis_key(limiter.config, "evil"), "x")
    admin.rpush(storage.redis_key(limiter.config, "evil2"), "x")
    for i in range(POISONED_CALLS // 2):
        result = limiter.allow_many(["victim", "evil", "other", "evil2"])
        victim, evil, other, evil2 = list(result)
        assert not victim.allowed and not victim.degraded
        assert evil.allowed and evil.degraded and evil.reason == "store_error"
        assert evil2.allowed and evil2.degraded and evil2.reason == "store_error"
        if i < CAPACITY:
            assert other.allowed and not other.degraded and other.remaining == CAPACITY - 1 - i
        else:
            assert not other.allowed and not other.degraded
    m = storage.metrics()
    # for each algorithm one of the two plants is of its own type (BADSTATE), the other foreign
    assert m["key_errors"] == POISONED_CALLS
    assert m["breaker_opened"] == 0 and m["breaker_state"] == "closed"


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_poisoned_key_in_a_compound_answers_by_its_own_policy(
    backend: types.SimpleNamespace, make_storage: Any, admin: Any, algorithm: str
) -> None:
    """A poisoned global key in every request's compound must not open the
    per-user limits: each limit of a compound is decided exactly, the poisoned
    one by its policy (``allow``: it lets the compound through; ``deny``: it
    denies it and nobody is charged), all in one script."""
    storage = _storage(make_storage, rule_on_error={"global-deny": "deny"})
    clock = backend.FakeClock(T0)
    glob = _limiter(backend, algorithm, storage, clock, "global")
    glob_deny = _limiter(backend, algorithm, storage, clock, "global-deny")
    user = _limiter(backend, algorithm, storage, clock, "user")
    admin.sadd(storage.redis_key(glob.config, "*"), "a foreign value")
    GARBAGE[algorithm][0][1](admin, storage.redis_key(glob_deny.config, "*"))  # garbage of its own type
    for i in range(CAPACITY + 2):
        c = storage.allow_all([(glob, "*"), (user, "u1")])
        assert c.degraded
        g, u = c.decisions
        assert g.degraded and g.reason == "store_error" and g.allowed
        assert not u.degraded
        assert c.allowed == (i < CAPACITY) == u.allowed
        assert c.denied_by == (None if i < CAPACITY else "user")
    for _ in range(POISONED_CALLS):
        c = storage.allow_all([(glob_deny, "*"), (user, "u2")])
        assert not c.allowed and c.denied_by == "global-deny"
    assert user.state("u2") is None  # denied compounds charged (and wrote) nobody
    m = storage.metrics()
    assert m["key_errors"] == CAPACITY + 2 + POISONED_CALLS
    assert m["breaker_opened"] == 0


def test_reset_of_a_poisoned_key_deletes_it(
    backend: types.SimpleNamespace, make_storage: Any, admin: Any
) -> None:
    """``reset`` is an admin action: ``DEL``, whatever is there; the key then
    decides exactly again."""
    storage = _storage(make_storage)
    limiter = _limiter(backend, "gcra", storage, backend.FakeClock(T0), "reset")
    rkey = storage.redis_key(limiter.config, "evil")
    admin.set(rkey, "garbage")
    assert limiter.allow("evil").degraded
    limiter.reset("evil")
    assert admin.exists(rkey) == 0
    d = limiter.allow("evil")
    assert d.allowed and not d.degraded and d.remaining == CAPACITY - 1


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_async_poisoned_key_answers_alone(
    backend: types.SimpleNamespace, redis_server: Any, admin: Any, algorithm: str
) -> None:
    """The same contract through ``AsyncRedisStorage``: one decision, a peek
    and a batch."""
    import redis.asyncio

    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
        storage = AsyncRedisStorage(client, on_error="allow", timeout=2.0, breaker_cooldown=30.0)
        try:
            limiter = _limiter(backend, algorithm, storage, backend.FakeClock(T0), "async")
            got = [(await limiter.allow_async("victim")).allowed for _ in range(CAPACITY + 1)]
            assert got == [True] * CAPACITY + [False]
            rkey = storage.redis_key(limiter.config, "evil")
            admin.xadd(rkey, {"f": "v"})
            for _ in range(POISONED_CALLS):
                bad = await limiter.allow_async("evil")
                assert bad.allowed and bad.degraded and bad.reason == "store_error"
                victim = await limiter.allow_async("victim")
                assert not victim.allowed and not victim.degraded
            assert (await limiter.peek_async("evil")).reason == "store_error"
            verdicts = await storage.run_kernel_many_async(limiter.config, ["evil", "victim"], [1, 1], T0)
            assert verdicts[0][5] and verdicts[0][0]  # degraded, allowed by policy
            assert not verdicts[1][0] and not verdicts[1][5]  # exact denial
            m = storage.metrics()
            assert m["key_errors"] == POISONED_CALLS + 2 and m["breaker_opened"] == 0
        finally:
            await storage.close()
            await client.aclose()

    asyncio.run(main())


# --------------------------------------------------------------------------
# Server-wide conditions


def _own_storage(server: Any, **kwargs: Any) -> RedisStorage:
    kwargs.setdefault("timeout", TIMEOUT)
    kwargs.setdefault("on_error", "allow")
    kwargs.setdefault("breaker_threshold", 3)
    kwargs.setdefault("breaker_cooldown", 0.2)
    return RedisStorage(server.client(), **kwargs)


def test_out_of_memory_refuses_writes_per_call_and_reads_still_decide(
    backend: types.SimpleNamespace, own_server: Any
) -> None:
    """``OOM`` (maxmemory reached under noeviction) is server-wide memory
    pressure but not an unreachable server: every write is answered by its
    policy and counted in ``write_refused``, the breaker stays closed (so
    decisions come back the moment memory does, with no cooldown), and a
    peek, which writes nothing, still decides exactly."""
    storage = _own_storage(own_server, breaker_cooldown=30.0, timeout=2.0)
    clock = backend.FakeClock(T0)
    limiter = _limiter(backend, "sliding_log", storage, clock, "oom")
    counter = _limiter(backend, "fixed_window", storage, clock, "oom")
    storage.load_scripts()
    _exhaust(limiter, "victim")
    admin = own_server.client()
    try:
        admin.config_set("maxmemory-policy", "noeviction")
        admin.config_set("maxmemory", "1")
        for _ in range(POISONED_CALLS):
            d = limiter.allow("newcomer")
            assert d.allowed and d.degraded and d.reason == "store_error"
            peek = limiter.peek("victim")
            assert not peek.allowed and not peek.degraded
        batch = counter.allow_many(["a", "b"])
        assert [(d.degraded, d.reason) for d in batch] == [(True, "store_error")] * 2
        m = storage.metrics()
        assert m["write_refused"] == POISONED_CALLS + 2 == m["key_errors"]
        assert m["breaker_opened"] == 0 and m["breaker_state"] == "closed"
    finally:
        admin.config_set("maxmemory", "0")
        admin.close()
    d = limiter.allow("newcomer")
    assert d.allowed and not d.degraded and d.remaining == CAPACITY - 1  # at once: nothing was charged
    assert not limiter.allow("victim").allowed


def test_a_busy_server_opens_the_breaker_and_recovers(
    backend: types.SimpleNamespace, own_server: Any
) -> None:
    """``BUSY`` (another script holds the server) is the server's state, not a
    key's: it feeds the breaker like a timeout, and decisions resume after
    ``SCRIPT KILL``."""
    storage = _own_storage(own_server)
    limiter = _limiter(backend, "token_bucket", storage, backend.FakeClock(T0), "busy")
    storage.load_scripts()
    admin = own_server.client(socket_timeout=10.0)
    admin.config_set("busy-reply-threshold", "20")
    hog = own_server.client(socket_timeout=30.0)
    outcome: list[BaseException] = []

    def run_forever() -> None:
        try:
            hog.eval("while true do end", 0)
        except Exception as exc:  # SCRIPT KILL ends it with an error reply
            outcome.append(exc)

    thread = threading.Thread(target=run_forever)
    thread.start()
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            d = limiter.allow("k")
            if d.degraded:
                break
            time.sleep(0.02)
        for _ in range(5):
            d, elapsed = timed(lambda: limiter.allow("k"))
            assert d.degraded and d.allowed and d.reason == "store_unavailable" and elapsed < BOUND
        m = storage.metrics()
        assert m["errors"] >= 3 and m["key_errors"] == 0 and m["breaker_opened"] >= 1
        assert m["breaker_open_skips"] >= 1
    finally:
        deadline = time.monotonic() + 10.0
        while thread.is_alive() and time.monotonic() < deadline:
            try:
                admin.script_kill()
            except Exception:  # "no script running" when it has just ended
                pass
            thread.join(timeout=0.2)
        admin.close()
        hog.close()
    assert not thread.is_alive() and outcome
    time.sleep(0.25)  # the cooldown
    assert not until_healthy(limiter, "k").degraded


def test_sigkill_answers_by_policy_and_restart_recovers(
    backend: types.SimpleNamespace, own_server: Any
) -> None:
    """A crash (SIGKILL): every decision answered by the policy within the
    bound, the breaker opens and stops the round trips; after the restart
    decisions resume on the new, empty server."""
    storage = _own_storage(own_server, on_error="deny")
    limiter = _limiter(backend, "gcra", storage, backend.FakeClock(T0), "kill")
    _exhaust(limiter, "k")
    own_server.kill()
    for _ in range(6):
        d, elapsed = timed(lambda: limiter.allow("other"))
        assert d.degraded and not d.allowed and d.reason == "store_unavailable" and elapsed < BOUND
    m = storage.metrics()
    assert m["breaker_opened"] >= 1 and m["breaker_open_skips"] >= 1 and m["key_errors"] == 0
    own_server.start()
    time.sleep(0.25)
    d = until_healthy(limiter, "k")
    assert d.allowed and d.remaining == CAPACITY - 1  # a new server: the state is gone


def test_a_frozen_server_answers_by_policy_then_recovers(
    backend: types.SimpleNamespace, own_server: Any
) -> None:
    """SIGSTOP freezes the server mid-run: decisions give up after the
    timeout and answer by policy, the breaker opens; after SIGCONT the
    decisions resume and the state from before the freeze is intact (the
    exhausted key is still denied: nothing was lost or given back)."""
    storage = _own_storage(own_server, on_error="allow")
    limiter = _limiter(backend, "fixed_window", storage, backend.FakeClock(T0), "frozen")
    _exhaust(limiter, "victim")
    proc = own_server.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        for _ in range(6):
            # another key: a request sent to the frozen server may still run after SIGCONT
            d, elapsed = timed(lambda: limiter.allow("during"))
            assert d.allowed and d.degraded and d.reason == "store_unavailable" and elapsed < BOUND
        m = storage.metrics()
        assert m["timeouts"] >= 1 and m["breaker_opened"] >= 1 and m["breaker_open_skips"] >= 1
    finally:
        proc.send_signal(signal.SIGCONT)
    time.sleep(0.25)
    d = until_healthy(limiter, "victim")
    assert not d.allowed and not d.degraded
    assert storage.metrics()["breaker_state"] == "closed"


def test_flushall_gives_the_budget_back(
    backend: types.SimpleNamespace, make_storage: Any, admin: Any
) -> None:
    """docs/redis.md: the state lives in Redis; ``FLUSHALL`` deletes it, so
    every key starts over with its full budget (exactly, no more), and the
    scripts stay loaded."""
    storage = _storage(make_storage)
    limiter = _limiter(backend, "sliding_counter", storage, backend.FakeClock(T0), "flush")
    _exhaust(limiter, "k")
    loads = storage.metrics()["script_loads"]
    admin.flushall()
    _exhaust(limiter, "k")
    m = storage.metrics()
    assert m["degraded"] == 0 and m["script_loads"] == loads


@pytest.mark.parametrize("path", ["single", "batch-script", "batch-pipeline", "compound", "async"])
def test_script_flush_reloads_once_and_never_charges_twice(
    backend: types.SimpleNamespace, redis_server: Any, admin: Any, path: str
) -> None:
    """``SCRIPT FLUSH`` mid-run: ``NOSCRIPT`` means the script did not run, so
    it is loaded and sent once more; counted exactly, capacity 10 admits 10."""
    capacity = 10
    flushes_at = {2, 5, 9}

    if path == "async":
        import redis.asyncio

        async def main() -> tuple[int, dict[str, Any]]:
            client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
            storage = AsyncRedisStorage(client, on_error="deny", timeout=2.0)
            limiter = backend.TokenBucket(capacity, WINDOW, storage, backend.FakeClock(T0), "flush")
            allowed = 0
            try:
                for i in range(capacity + 3):
                    if i in flushes_at:
                        admin.script_flush()
                    allowed += (await limiter.allow_async("k")).allowed
                return allowed, storage.metrics()
            finally:
                await storage.close()
                await client.aclose()

        allowed, m = asyncio.run(main())
    else:
        batch = "pipeline" if path == "batch-pipeline" else "script"
        storage = RedisStorage(redis_server.client(), on_error="deny", timeout=2.0, batch=batch)
        limiter = backend.TokenBucket(capacity, WINDOW, storage, backend.FakeClock(T0), "flush")
        allowed = 0
        for i in range(capacity + 3):
            if i in flushes_at:
                admin.script_flush()
            if path == "single":
                allowed += limiter.allow("k").allowed
            elif path == "compound":
                allowed += storage.allow_all([(limiter, "k")]).allowed
            else:
                allowed += limiter.allow_many(["k"]).allowed_count
        m = storage.metrics()
    assert allowed == capacity
    assert m["script_loads"] == len(flushes_at) + 1  # the first call loads it too
    assert m["degraded"] == 0 and m["errors"] == 0


# --------------------------------------------------------------------------
# B. The clock jumps a year ahead and back


def _drive(mode: str, limiter: Any, storage: Any, key: str, runner: Any) -> Any:
    """One decision of ``key`` by the path under test."""
    if mode == "single":
        return limiter.allow(key)
    if mode == "batch":
        (d,) = list(limiter.allow_many([key]))
        return d
    if mode == "compound":
        (d,) = storage.allow_all([(limiter, key)]).decisions
        return d
    return runner.run(limiter.allow_async(key))


def _same(got: Any, want: Any, where: str) -> None:
    for name in FIELDS:
        g, w = getattr(got, name), getattr(want, name)
        if isinstance(w, float):
            assert math.isclose(g, w, rel_tol=0.0, abs_tol=1e-9), f"{where} {name}: {g!r} != {w!r}"
        else:
            assert g == w, f"{where} {name}: {g!r} != {w!r}"
    assert not got.degraded, where


@pytest.mark.parametrize("mode", ["single", "batch", "async"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_year_ahead_and_back_never_locks_a_key_out(
    backend: types.SimpleNamespace, redis_server: Any, algorithm: str, mode: str
) -> None:
    """An injected clock runs a year ahead (a bad NTP step) and comes back.
    The key's stamp is then a year ahead of the clock: over MAX_CLOCK_LEAD,
    so the script moves the state back with its debt kept. The key is
    denied only as long as its debt says (every Retry-After within the
    window plus the bound, and true: waiting it out admits), never for the
    year. Within the bound (30 s back) the key's time stands still and the
    durations carry the 30 s. Every answer equals the in-memory reference's.
    MAX_CLOCK_LEAD (60 s) is the bound: a lead over it is the clock's error."""
    assert MAX_CLOCK_LEAD == 60.0
    window = 10.0
    clock = backend.FakeClock(T0)
    ref_clock = reference.FakeClock(T0)
    runner = asyncio.Runner() if mode == "async" else None
    client: Any = None
    if mode == "async":
        import redis.asyncio

        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
        storage: Any = AsyncRedisStorage(client, on_error="raise", timeout=2.0)
    else:
        storage = RedisStorage(redis_server.client(), on_error="raise", timeout=2.0)
    limiter = backend.limiters[algorithm](CAPACITY, window, storage, clock, "jump")
    ref_storage = reference.InMemoryStorage()
    ref = reference.LIMITERS[reference.Algorithm(algorithm)](CAPACITY, window, ref_storage, ref_clock, "jump")
    step = [0]

    def both(where: str) -> Any:
        step[0] += 1
        ref_clock.set(clock.now())
        got = _drive(mode, limiter, storage, "k", runner)
        _same(got, ref.allow("k"), f"{where} (step {step[0]}, t={clock.now()!r})")
        return got

    try:
        for _ in range(CAPACITY + 1):
            both("before the jump")
        clock.set(T0 + YEAR)
        spent = [both("a year ahead").allowed for _ in range(CAPACITY + 1)]
        assert spent == [True] * CAPACITY + [False]
        clock.set(T0 + 1.0)  # back: the key is stamped a year ahead of the clock
        d = both("back a year")
        assert not d.allowed, "the debt from a year ahead is kept"
        assert 0.0 < d.retry_after <= window
        assert d.reset_after <= 2 * window
        clock.advance(d.retry_after + EPSILON)
        after = both("after the Retry-After")
        # (a sliding counter's Retry-After is a lower bound: the previous window still weighs)
        assert after.allowed or algorithm == "sliding_counter", "the Retry-After was true"
        clock.advance(2 * window)
        assert both("two windows on").remaining == CAPACITY - 1, "no lockout"
        before = clock.now()
        clock.set(before - 30.0)  # back within the bound: the key's time stands still
        small = [both("30 s back") for _ in range(CAPACITY + 1)]
        denied = [d for d in small if not d.allowed]
        assert denied and all(d.retry_after >= 30.0 for d in denied), "the lead is in the Retry-After"
        assert all(d.retry_after <= window + 30.0 for d in denied)
        clock.advance(denied[-1].retry_after + EPSILON)
        after = both("after that Retry-After")
        assert after.allowed or algorithm == "sliding_counter"
    finally:
        if mode == "async":
            assert runner is not None
            runner.run(storage.close())
            runner.run(client.aclose())
            runner.close()
        else:
            storage.client.close()


def _compound_pair(
    backend: types.SimpleNamespace, make_storage: Any, algorithm: str, window: float
) -> tuple[Any, Callable[[str], Any]]:
    """A compound of one limit on Redis and the same on the in-memory
    reference, on one injected clock; ``decide(where)`` runs both and
    checks they agree."""
    storage = _storage(make_storage, on_error="raise")
    clock = backend.FakeClock(T0)
    ref_clock = reference.FakeClock(T0)
    ref_storage = reference.InMemoryStorage()
    limiter = backend.limiters[algorithm](CAPACITY, window, storage, clock, "jump")
    ref = reference.LIMITERS[reference.Algorithm(algorithm)](CAPACITY, window, ref_storage, ref_clock, "jump")

    def decide(where: str) -> Any:
        ref_clock.set(clock.now())
        got = storage.allow_all([(limiter, "k")])
        want = ref_storage.allow_all([(ref, "k")])
        _same(got.decisions[0], want.decisions[0], f"{where} t={clock.now()!r}")
        return got.decisions[0]

    return clock, decide


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_compounds_follow_the_clock_rule_as_the_reference_does(
    backend: types.SimpleNamespace, make_storage: Any, algorithm: str
) -> None:
    """The compound script applies the same rule: a year ahead and back, the
    answers equal the reference's compound, the debt is kept and every
    Retry-After stays within the window. A denied compound charges nothing,
    but stores a key the rule moved back (see the test below)."""
    window = 10.0
    clock, decide = _compound_pair(backend, make_storage, algorithm, window)
    for _ in range(CAPACITY + 1):
        decide("before the jump")
    clock.set(T0 + YEAR)
    assert [decide("a year ahead").allowed for _ in range(CAPACITY + 1)] == [True] * CAPACITY + [False]
    clock.set(T0 + 1.0)
    d = decide("back a year")
    assert not d.allowed and 0.0 < d.retry_after <= window and d.reset_after <= 2 * window
    clock.advance(window)
    decide("a window later")  # equal to the reference


def test_a_denied_compound_does_not_keep_a_key_locked_out(
    backend: types.SimpleNamespace, make_storage: Any
) -> None:
    """What the clock rule promises, through compounds only: after a year
    ahead and back, waiting out the Retry-After admits."""
    clock, decide = _compound_pair(backend, make_storage, "token_bucket", 10.0)
    clock.set(T0 + YEAR)
    for _ in range(CAPACITY + 1):
        decide("a year ahead")
    clock.set(T0 + 1.0)
    d = decide("back a year")
    clock.advance(d.retry_after + EPSILON)
    assert decide("after the Retry-After").allowed


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_after_a_rebase_on_the_server_clock_the_expiry_follows_the_new_state(
    backend: types.SimpleNamespace, make_storage: Any, admin: Any, algorithm: str
) -> None:
    """A state stamped a year ahead of the server's clock (written while the
    server's clock was a year ahead): the next decision on the server's own
    ``TIME`` moves it back, and the key's expiry is computed from the moved
    state: at least 1 ms, at most the window (never 0, never a year). Then
    the debt refills on the real clock: 1.1 s later a unit is back."""
    storage = _storage(make_storage, on_error="raise")
    window = 2.0
    ahead = backend.FakeClock(time.time() + YEAR)
    writer = backend.limiters[algorithm](2, window, storage, ahead, "srv")
    assert [writer.allow("k").allowed for _ in range(3)] == [True, True, False]
    live = backend.limiters[algorithm](2, window, storage, None, "srv")  # the server's TIME
    d = live.allow("k")
    assert not d.allowed and 0.0 < d.retry_after <= window + 0.01
    state = live.state("k")
    assert state is not None and abs(state.updated_at - time.time()) < 5.0
    ttl = admin.pttl(storage.redis_key(live.config, "k"))
    assert 1 <= ttl <= 2 * window * 1000 + 2  # a sliding counter rests after two windows
    time.sleep(d.retry_after + 0.1)
    again = live.allow("k")
    # (a sliding counter's Retry-After is a lower bound: the previous window still weighs)
    assert again.allowed or (algorithm == "sliding_counter" and again.retry_after < window)


class _LyingInt(int):
    """Says 2 to comparisons, -5 to ``int()`` and ``__index__``."""

    def __int__(self) -> int:
        return -5

    def __index__(self) -> int:
        return -5


def test_a_compound_charges_the_cost_it_checked(backend: types.SimpleNamespace, make_storage: Any) -> None:
    """A cost is converted once and that value is charged, in the compound
    script too: an int subclass that lies to ``int()`` is charged its value."""
    storage = _storage(make_storage, on_error="raise")
    clock = backend.FakeClock(T0)
    limiter = backend.limiters["fixed_window"](5, 60.0, storage, clock, "lying")
    assert storage.allow_all([(limiter, "k", _LyingInt(2))]).allowed
    assert limiter.peek("k").remaining == 5 - 2 - 1


# --------------------------------------------------------------------------
# ACL refusals: a deployment fault, raised under every policy

# How an ACL refuses the limiter: its command, its key (a pattern the limiter's
# prefix is not under; both checked before a script runs), or the SCRIPT LOAD
# that NOSCRIPT asks for.
ACL_RULES = {
    "no-evalsha": ("~*", "+@all", "-evalsha", "-evalsha_ro"),
    "other-keys": ("~other:*", "+@all"),
    "no-script-load": ("~*", "+@all", "-script"),
}
ACL_PATHS = ("single", "peek", "batch-script", "batch-pipeline", "compound", "refund", "async")


@pytest.fixture
def acl_user(redis_server: Any, admin: Any, request: pytest.FixtureRequest) -> Any:
    """``make(rules) -> (username, password)``: an ACL user on the shared
    server, deleted at the end (the server outlives the test)."""
    made: list[str] = []

    def make(rules: tuple[str, ...]) -> tuple[str, str]:
        name = f"nanolimit-acl-{len(made)}"
        admin.execute_command("ACL", "SETUSER", name, "reset", "on", ">pw", *rules)
        made.append(name)
        return name, "pw"

    yield make
    for name in made:
        admin.execute_command("ACL", "DELUSER", name)


@pytest.mark.parametrize("path", ACL_PATHS)
@pytest.mark.parametrize("refusal", list(ACL_RULES))
@pytest.mark.parametrize("policy", ["allow", "deny", "local"])
def test_an_acl_refusal_raises_under_every_policy(
    backend: types.SimpleNamespace,
    redis_server: Any,
    admin: Any,
    acl_user: Any,
    policy: str,
    refusal: str,
    path: str,
) -> None:
    """An ACL that refuses the limiter's command or its keys (``NOPERM``)
    limits nothing: answered by the policy, ``"allow"`` admitted every
    request of every key (8 of 8 against a limit of 3), with no log line and
    the breaker closed. Nobody but the operator can cause it, so it is loud:
    ``RedisKeyError`` with ``code == "NOPERM"`` on every path, whatever the
    policy, and nothing is written."""
    user, password = acl_user(ACL_RULES[refusal])

    def check(call: Callable[[], Any]) -> None:
        for _ in range(CAPACITY + 2):
            with pytest.raises(RedisKeyError) as caught:
                call()
            assert caught.value.code == "NOPERM"

    if path == "async":
        import redis.asyncio

        async def main() -> dict[str, Any]:
            client = redis.asyncio.Redis(
                host="127.0.0.1", port=redis_server.port, username=user, password=password
            )
            storage = AsyncRedisStorage(client, on_error=policy, timeout=2.0)  # type: ignore[arg-type]
            try:
                limiter = _limiter(backend, "token_bucket", storage, backend.FakeClock(T0), "acl")
                many = storage.run_kernel_many_async
                for call in (
                    lambda: limiter.allow_async("k"),
                    lambda: many(limiter.config, ["k", "j"], [1, 1], T0),
                    lambda: limiter.refund_async("k"),
                ):
                    for _ in range(CAPACITY + 2):
                        with pytest.raises(RedisKeyError) as caught:
                            await call()
                        assert caught.value.code == "NOPERM"
                return storage.metrics()
            finally:
                await storage.close()
                await client.aclose()

        m = asyncio.run(main())
    else:
        batch = "pipeline" if path == "batch-pipeline" else "script"
        client = redis_server.client(username=user, password=password)
        storage = RedisStorage(client, on_error=policy, timeout=2.0, batch=batch)  # type: ignore[arg-type]
        limiter = _limiter(backend, "token_bucket", storage, backend.FakeClock(T0), "acl")
        calls: dict[str, Callable[[], Any]] = {
            "single": lambda: limiter.allow("k"),
            "peek": lambda: limiter.peek("k"),
            "batch-script": lambda: limiter.allow_many(["k", "j"]),
            "batch-pipeline": lambda: limiter.allow_many(["k", "j"]),
            "compound": lambda: storage.allow_all([(limiter, "k"), (limiter, "j")]),
            "refund": lambda: limiter.refund("k"),
        }
        try:
            check(calls[path])
        finally:
            client.close()
        m = storage.metrics()
    assert m["decisions"] == 0 and m["breaker_opened"] == 0 and m["key_errors"] > 0
    assert admin.dbsize() == 0  # nothing was written


@pytest.mark.parametrize("policy", ["volatile-lru", "volatile-ttl", "noeviction"])
def test_an_evicting_policy_hands_budgets_back(
    backend: types.SimpleNamespace, server_kind: str, policy: str
) -> None:
    """docs/redis.md, "Expiry": the ``volatile-*`` policies evict only keys
    with an expiry, and every limiter key has one, so when the application's
    own keys fill the memory the limiter's go first and each exhausted key is
    admitted again, exactly, not degraded (the docs once warned only about
    ``allkeys-*``); under ``noeviction`` they stay denied."""
    import redis

    server = Server(
        require_binary(server_kind), server_kind, extra=("--maxmemory", "4mb", "--maxmemory-policy", policy)
    )
    server.start()
    try:
        admin = server.client()
        storage = RedisStorage(server.client(), on_error="deny", timeout=2.0)
        limiter = _limiter(backend, "fixed_window", storage, backend.FakeClock(T0), "evict")
        users = [f"user{i}" for i in range(50)]
        for user in users:
            _exhaust(limiter, user)
        # the application's own keys, no expiry, until the memory is full
        with pytest.raises(redis.exceptions.ResponseError, match="maxmemory"):
            for i in range(400):
                admin.set(f"app:{i}", "x" * 20_000)
        after = [limiter.allow(user) for user in users]
        assert not any(d.degraded for d in after)
        evicted = admin.info("stats")["evicted_keys"]
        if policy == "noeviction":
            assert sum(d.allowed for d in after) == 0 and evicted == 0
        else:
            assert sum(d.allowed for d in after) == len(users) and evicted >= len(users)
        admin.close()
    finally:
        server.stop()


@pytest.mark.parametrize(
    ("algorithm", "label", "plant"),
    GARBAGE_CASES,
    ids=[f"{algo}-{label}" for algo, label, _ in GARBAGE_CASES],
)
def test_the_state_of_a_poisoned_key_is_refused_as_decisions_refuse_it(
    backend: types.SimpleNamespace,
    make_storage: Any,
    redis_server: Any,
    admin: Any,
    algorithm: str,
    label: str,
    plant: Plant,
) -> None:
    """``state()`` (and ``nanolimit inspect``, which prints it and reads
    it to tell whether a reset removed anything) showed a value the
    decisions refuse as ``BADSTATE`` as if it were the key's state (a count
    of -1e308, a level of NaN, a window index of 0.5 shown as 0, a hash of
    another application as "no state"), or failed with a bare ``TypeError``
    or ``ValueError``. It raises the decisions' ``BADSTATE`` now, sync and
    async, and reads nothing more into it; a real state still reads back."""
    import redis.asyncio

    storage = _storage(make_storage)
    limiter = _limiter(backend, algorithm, storage, backend.FakeClock(T0), "inspect")
    assert limiter.allow("honest").allowed
    honest = limiter.state("honest")
    assert honest is not None and honest.updated_at == T0
    rkey = storage.redis_key(limiter.config, "evil")
    plant(admin, rkey)
    before = _frozen(admin, rkey)
    with pytest.raises(RedisKeyError) as caught:
        limiter.state("evil")
    assert caught.value.code == "BADSTATE" and algorithm in str(caught.value)

    async def main() -> None:
        client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
        astorage = AsyncRedisStorage(client, on_error="allow", timeout=2.0)
        try:
            with pytest.raises(RedisKeyError) as caught:
                await astorage.snapshot_async(limiter.config, "evil")
            assert caught.value.code == "BADSTATE"
            assert await astorage.snapshot_async(limiter.config, "honest") == honest
        finally:
            await astorage.close()
            await client.aclose()

    asyncio.run(main())
    assert _frozen(admin, rkey) == before


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
@pytest.mark.parametrize("prefix", ["", "nanolimit:"])
def test_keys_len_and_clear_touch_only_the_limiters_keys(
    backend: types.SimpleNamespace, redis_server: Any, admin: Any, prefix: str, flavour: str
) -> None:
    """``keys()``, ``len()``/``count()`` and ``clear()`` matched the prefix
    alone: with ``prefix=""`` ``clear()`` deleted every key of the database
    (an application's sessions with it: 4 of 4 gone), ``len()`` counted them
    all, and one key name that is not UTF-8 under the prefix made all three
    raise ``UnicodeDecodeError``. Only keys of the limiter's shape
    (``<prefix><algorithm>:...``) are listed, counted and deleted now."""
    import redis.asyncio

    foreign = [b"app:session:1", b"nanolimit:other", b"nanolimitX", prefix.encode() + b"\xff\xfe"]
    for name in foreign:
        admin.set(name, "precious")
    sync_storage = RedisStorage(redis_server.client(), prefix=prefix, timeout=2.0)
    limiter = _limiter(backend, "token_bucket", sync_storage, backend.FakeClock(T0), "r:one")
    for who in ("a", "b", "{c}"):
        assert limiter.allow(who).allowed
    ours = sorted(sync_storage.redis_key(limiter.config, who) for who in ("a", "b", "{c}"))
    if flavour == "sync":
        assert sorted(sync_storage.keys()) == ours and len(sync_storage) == 3
        assert sync_storage.clear() == 3
    else:

        async def main() -> None:
            client = redis.asyncio.Redis(host="127.0.0.1", port=redis_server.port)
            storage = AsyncRedisStorage(client, prefix=prefix, timeout=2.0)
            try:
                assert sorted(await storage.keys()) == ours and await storage.count() == 3
                assert await storage.clear() == 3
            finally:
                await storage.close()
                await client.aclose()

        asyncio.run(main())
    assert sorted(admin.keys("*")) == sorted(foreign)  # every foreign key kept, ours gone


@pytest.mark.parametrize(
    ("field", "text"),
    [("n", "1_0"), ("n", "\uff11"), ("n", "0x2"), ("u", " 1.8e9 "), ("n", "1e"), ("n", "0x"), ("n", "2.")],
    ids=["underscore", "fullwidth-digit", "hex", "spaces", "bare-exponent", "bare-hex", "trailing-dot"],
)
def test_state_reads_a_stored_number_as_the_scripts_do(
    backend: types.SimpleNamespace, make_storage: Any, admin: Any, field: str, text: str
) -> None:
    """``state()`` and the decisions agree on every stored number: the
    scripts read it with Lua's ``tonumber`` (C's ``strtod``: hex, no
    ``_`` separators, ASCII digits only), where Python's ``float`` took
    "1_0" as 10 and a full-width digit as a digit (shown as a state the
    decisions refuse with ``BADSTATE``) and refused "0x2" (which the
    decisions read as 2)."""
    storage = _storage(make_storage, on_error="raise")
    limiter = _limiter(backend, "fixed_window", storage, backend.FakeClock(T0), "numbers")
    assert limiter.allow("k").allowed
    rkey = storage.redis_key(limiter.config, "k")
    admin.hset(rkey, field, text)
    try:
        shown: Any = limiter.state("k")
    except RedisKeyError as exc:
        shown = exc.code
    try:
        decided: Any = limiter.peek("k").allowed
    except RedisKeyError as exc:
        decided = exc.code
    assert (shown == "BADSTATE") == (decided == "BADSTATE"), (shown, decided)
    admin.delete(rkey)
