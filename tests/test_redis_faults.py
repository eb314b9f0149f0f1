"""Failures of the shared store: a killed server, a restart, a flushed script
cache, a frozen server (``DEBUG SLEEP``) — the policy answers within the
timeout, nothing raises into the request path under ``allow``/``deny``, the
breaker stops the hammering, and decisions resume by themselves."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
import types
from typing import Any

import pytest
from redis_servers import timed, until_healthy

from nanolimit.errors import CircuitOpenError, RedisUnavailableError, StorageUnavailableError
from nanolimit.storage.redis import RedisStorage

pytest_plugins = ["redis_servers"]  # the server fixtures
# decisions here are bounded in wall time: a full collection of the test
# run's heap must not be what they measure (conftest.steady_heap)
pytestmark = pytest.mark.usefixtures("steady_heap")

TIMEOUT = 0.05
# generous for a loaded 2-core CI box, still far from redis-py's 5 s default
BOUND = 1.0


def _storage(server: Any, **kwargs: Any) -> RedisStorage:
    kwargs.setdefault("timeout", TIMEOUT)
    kwargs.setdefault("breaker_threshold", 3)
    kwargs.setdefault("breaker_cooldown", 0.2)
    return RedisStorage(server.client(), **kwargs)


def test_decision_client_is_short_and_never_retries(own_server: Any) -> None:
    user = own_server.client()
    storage = _storage(own_server)
    kwargs = storage.client.connection_pool.connection_kwargs
    assert kwargs["socket_timeout"] == TIMEOUT and kwargs["socket_connect_timeout"] == TIMEOUT
    assert kwargs["retry"].get_retries() == 0
    assert user.connection_pool.connection_kwargs["socket_timeout"] == 5.0  # the caller's client is untouched


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
@pytest.mark.parametrize(("wait", "expected"), [(0.01, 0.01), (20.0, TIMEOUT), (None, TIMEOUT)])
def test_a_blocking_pool_keeps_its_bounded_wait(
    own_server: Any, wait: float | None, expected: float, flavour: str
) -> None:
    """A BlockingConnectionPool waits for a free connection: the derived
    client's pool waits no longer than the caller's, nor than ``timeout``;
    the caller's ``timeout=None`` (wait for ever) too, which became the
    constructor's default of 20 s."""
    import redis
    import redis.asyncio

    from nanolimit.storage.redis import AsyncRedisStorage

    home: Any = redis if flavour == "sync" else redis.asyncio
    pool = home.BlockingConnectionPool(
        host="127.0.0.1", port=own_server.port, max_connections=2, timeout=wait
    )
    make = RedisStorage if flavour == "sync" else AsyncRedisStorage
    storage: Any = make(home.Redis(connection_pool=pool), timeout=TIMEOUT)
    derived = storage.client.connection_pool
    assert isinstance(derived, home.BlockingConnectionPool)
    assert derived.timeout == expected and derived.max_connections == 2


def test_a_pool_that_waits_for_ever_still_answers_within_the_timeout(
    backend: types.SimpleNamespace, own_server: Any
) -> None:
    """40 threads deciding through a ``BlockingConnectionPool(timeout=None)``
    of one connection while ``DEBUG SLEEP`` freezes the server: each gives
    up on its own wait after ``timeout`` and is answered by the policy. The
    derived pool used to wait up to 20 s (redis-py's default): the last
    thread waited for each of the 39 before it, about 2 s."""
    import redis

    pool = redis.BlockingConnectionPool(
        host="127.0.0.1", port=own_server.port, max_connections=1, timeout=None
    )
    storage = RedisStorage(
        redis.Redis(connection_pool=pool), timeout=TIMEOUT, on_error="allow", breaker_threshold=1000
    )
    limiter = backend.TokenBucket(100, 60.0, storage, rule="blocking")
    assert not limiter.allow("warm").degraded
    admin = own_server.client()
    sleeper = threading.Thread(target=lambda: admin.execute_command("DEBUG", "SLEEP", "3"))
    sleeper.start()
    time.sleep(0.1)
    waits: list[float] = []

    def decide() -> None:
        d, elapsed = timed(lambda: limiter.allow("k"))
        assert d.degraded and d.allowed
        waits.append(elapsed)

    threads = [threading.Thread(target=decide) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    sleeper.join(timeout=10)
    admin.close()
    assert len(waits) == 40
    assert max(waits) < BOUND, max(waits)


@pytest.mark.parametrize("policy", ["allow", "deny", "raise"])
def test_kill_then_restart(backend: types.SimpleNamespace, own_server: Any, policy: str) -> None:
    storage = _storage(own_server, on_error=policy, deny_retry_after=2.0, breaker_cooldown=0.5)
    limiter = backend.TokenBucket(100, 60.0, storage, rule="kill")
    assert not limiter.allow("k").degraded
    own_server.kill()
    for _ in range(6):  # past the breaker threshold: open, then answered without a round trip
        if policy == "raise":
            start = time.monotonic()
            with pytest.raises(RedisUnavailableError):
                limiter.allow("k")
            elapsed = time.monotonic() - start
        else:
            d, elapsed = timed(lambda: limiter.allow("k"))
            assert d.degraded
            if policy == "allow":
                assert d.allowed
            else:
                assert not d.allowed and d.retry_after == 2.0
                assert d.headers(wall_now=0.0)["Retry-After"] == "2"
        assert elapsed < BOUND
    m = storage.metrics()
    # 3 failures open the breaker; the rest are answered without a round trip
    # (on a very loaded machine the cooldown may pass and one more probe fail)
    assert m["errors"] >= 3 and m["errors"] + m["breaker_open_skips"] == 6
    assert m["breaker_open_skips"] >= 1 and m["breaker_opened"] >= 1
    assert m["breaker_state"] in ("open", "half-open")
    assert m["degraded"] == (0 if policy == "raise" else 6)
    own_server.start()
    time.sleep(0.5)  # the cooldown: then one probe goes through
    d = until_healthy(limiter, "k")
    assert d.allowed and d.remaining == 99  # a new server: fresh state
    assert storage.metrics()["breaker_state"] == "closed"


def test_raise_policy_classes(own_server: Any) -> None:
    assert issubclass(RedisUnavailableError, StorageUnavailableError)
    assert issubclass(CircuitOpenError, RedisUnavailableError)
    storage = _storage(own_server, on_error="raise", breaker_threshold=1, breaker_cooldown=30.0)
    from nanolimit.reference import GCRA

    limiter = GCRA(5, 1.0, storage, rule="r")
    own_server.kill()
    with pytest.raises(RedisUnavailableError):
        limiter.allow("k")
    with pytest.raises(CircuitOpenError):
        limiter.allow("k")


def test_per_rule_policy_and_batches_and_compounds(backend: types.SimpleNamespace, own_server: Any) -> None:
    storage = _storage(own_server, on_error="allow", rule_on_error={"login": "deny"}, breaker_threshold=100)
    login = backend.FixedWindowCounter(5, 60.0, storage, rule="login")
    search = backend.SlidingWindowCounter(5, 60.0, storage, rule="search")
    storage.load_scripts()
    own_server.kill()
    d = login.allow("u")
    assert d.degraded and not d.allowed and d.reason == "store_unavailable"
    d = search.allow("u")
    assert d.degraded and d.allowed and d.reason == "store_unavailable"
    assert login.peek("u").reason == "store_unavailable"
    batch, elapsed = timed(lambda: search.allow_many(["a", "b", "c"]))
    assert batch.degraded and batch.allowed_count == 3 and elapsed < BOUND
    assert [(d.degraded, d.reason) for d in batch] == [(True, "store_unavailable")] * 3
    batch = login.allow_many(["a", "b"])
    assert batch.degraded and batch.allowed_count == 0
    compound = storage.allow_all([(search, "u"), (login, "u")])
    assert compound.degraded and not compound.allowed and compound.denied_by == "login"
    assert {d.reason for d in compound.decisions} == {"store_unavailable"}
    compound = storage.allow_all([(search, "u")])
    assert compound.degraded and compound.allowed


def test_script_flush_is_transparent(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    limiter = backend.GCRA(5, 60.0, storage, backend.FakeClock(0.0), rule="f")
    assert limiter.allow("k").remaining == 4
    loads = storage.metrics()["script_loads"]
    storage.client.script_flush()
    d = limiter.allow("k")
    assert not d.degraded and d.remaining == 3
    assert storage.metrics()["script_loads"] == loads + 1
    storage.client.script_flush()
    assert storage.allow_all([(limiter, "k")]).remaining == 2


def test_frozen_server_timeout_holds(backend: types.SimpleNamespace, own_server: Any) -> None:
    """``DEBUG SLEEP`` freezes the server: the decision gives up after the
    socket timeout instead of waiting (redis-py's default would block for
    seconds and retry)."""
    storage = _storage(own_server, on_error="deny", breaker_threshold=100)
    limiter = backend.LeakyBucket(100, 60.0, storage, rule="frozen")
    assert not limiter.allow("k").degraded
    admin = own_server.client(socket_timeout=10.0)
    sleeper = threading.Thread(target=lambda: admin.execute_command("DEBUG", "SLEEP", "0.8"))
    from redis_servers import _ping

    sleeper.start()
    deadline = time.monotonic() + 5.0
    while _ping(own_server.port, timeout=0.05) and time.monotonic() < deadline:
        time.sleep(0.01)  # until the server is really asleep
    try:
        for _ in range(3):
            d, elapsed = timed(lambda: limiter.allow("k"))
            assert d.degraded and not d.allowed
            assert elapsed < BOUND
        assert storage.metrics()["timeouts"] >= 1
    finally:
        sleeper.join(timeout=10)
    d = until_healthy(limiter, "k")
    assert d.allowed


def test_nothing_listening(backend: types.SimpleNamespace) -> None:
    """A refused connection is an error like any other: no hang, no raise."""
    import redis
    from redis_servers import free_port

    storage = RedisStorage(redis.Redis(host="127.0.0.1", port=free_port()), timeout=TIMEOUT)
    limiter = backend.TokenBucket(5, 1.0, storage, rule="none")
    d, elapsed = timed(lambda: limiter.allow("k"))
    assert d.allowed and d.degraded and elapsed < BOUND


def test_kill_and_restart_under_concurrent_load(backend: types.SimpleNamespace, own_server: Any) -> None:
    """Four threads keep deciding while the server dies and comes back:
    nothing raises into the request path, no call outlives the bound, and
    healthy decisions resume after the restart."""
    storage = _storage(own_server, on_error="allow", breaker_threshold=3, breaker_cooldown=0.1)
    limiter = backend.SlidingWindowCounter(1_000_000, 60.0, storage, rule="load")
    stop = threading.Event()
    problems: list[str] = []
    slowest = [0.0]
    seen = {"degraded": 0, "healthy_after": 0}
    restarted = threading.Event()

    def work(slot: int) -> None:
        while not stop.is_set():
            try:
                d, elapsed = timed(lambda: limiter.allow(f"k{slot}"))
            except Exception as exc:  # the point: nothing may escape
                problems.append(repr(exc))
                return
            slowest[0] = max(slowest[0], elapsed)
            if d.degraded:
                seen["degraded"] += 1
            elif restarted.is_set():
                seen["healthy_after"] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.1)
        own_server.kill()
        time.sleep(0.3)
        own_server.start()
        restarted.set()
        deadline = time.monotonic() + 5.0
        while seen["healthy_after"] < 20 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
    assert not problems
    assert seen["degraded"] > 0 and seen["healthy_after"] >= 20
    assert slowest[0] < BOUND


def test_a_probe_that_never_reports_does_not_hold_the_breaker_open() -> None:
    """Half-open lets one caller probe. A probe that ends without reporting
    (a cancelled task, an interrupt) must not leave every later decision
    behind an open breaker: after another cooldown the next caller probes."""
    from nanolimit.storage.redis._resilience import _Breaker

    breaker = _Breaker(threshold=2, cooldown=0.05)
    breaker.failure()
    breaker.failure()
    assert not breaker.allow_call()  # open
    time.sleep(0.06)
    assert breaker.allow_call()  # the probe
    assert not breaker.allow_call()  # one probe at a time
    time.sleep(0.06)  # the probe was cancelled: it never reports
    assert breaker.allow_call()  # a new probe
    breaker.success()
    assert breaker.state == "closed" and breaker.allow_call()


def test_each_failed_probe_counts_as_an_opening(backend: types.SimpleNamespace, own_server: Any) -> None:
    """A frozen server (SIGSTOP) across several cooldowns: each half-open
    probe fails and opens the breaker again, and ``breaker_opened`` counts
    every one (it read 1 after a dozen failed probes). Decisions refused
    while it is open are no openings."""
    storage = _storage(own_server, on_error="deny", breaker_threshold=2, breaker_cooldown=0.6)
    limiter = backend.FixedWindowCounter(100, 60.0, storage, rule="probe")
    assert not limiter.allow("k").degraded
    assert own_server.proc is not None
    own_server.proc.send_signal(signal.SIGSTOP)
    try:
        assert limiter.allow("k").degraded and limiter.allow("k").degraded  # the threshold
        assert storage.metrics()["breaker_opened"] == 1
        for probes in range(1, 5):
            time.sleep(0.7)  # past the cooldown: the next decision probes, and fails
            assert limiter.allow("k").degraded and limiter.allow("k").degraded  # the probe, a skip
            m = storage.metrics()
            assert m["breaker_opened"] == 1 + probes and m["breaker_state"] == "open", m
        assert storage.metrics()["breaker_open_skips"] >= 4
    finally:
        own_server.proc.send_signal(signal.SIGCONT)
    assert until_healthy(limiter, "k").allowed
    storage.client.close()


# ---------------------------------------------------------------------------
# The outage is logged: once per episode, at WARNING, the address redacted

SECRET = "s3cret-pw-not-in-logs"


def _outage_records(caplog: pytest.LogCaptureFixture) -> tuple[list[str], list[str]]:
    records = [r for r in caplog.records if r.name == "nanolimit.storage.redis"]
    warned = [r.getMessage() for r in records if r.levelname == "WARNING"]
    recovered = [m for r in records if r.levelname == "INFO" and "answers again" in (m := r.getMessage())]
    return warned, recovered


def test_each_outage_is_one_warning_naming_the_store_without_its_password(
    server_kind: str, caplog: pytest.LogCaptureFixture
) -> None:
    from redis_servers import Server, require_binary

    import nanolimit
    from nanolimit.storage.uri import storage_from_uri

    server = Server(require_binary(server_kind), server_kind)

    def start() -> None:  # the helper pings without a password: set it once the server answers
        server.start()
        admin = server.client()
        admin.config_set("requirepass", SECRET)
        admin.close()

    start()
    try:
        uri = f"redis://:{SECRET}@127.0.0.1:{server.port}/0?breaker_threshold=3&breaker_cooldown=0.1"
        storage = storage_from_uri(uri)
        limiter = nanolimit.TokenBucket(100, 60.0, storage, rule="outage")
        caplog.set_level(logging.INFO, logger="nanolimit.storage.redis")
        assert not limiter.allow("k").degraded
        for episode in (1, 2):
            server.kill()
            for _ in range(8):  # failures, the breaker opening, probes failing: one outage
                assert limiter.allow("k").degraded
                time.sleep(0.03)
            warned, recovered = _outage_records(caplog)
            assert len(warned) == episode and len(recovered) == episode - 1
            start()
            until_healthy(limiter, "k")
            for _ in range(3):  # the recovery the breaker asks for: threshold answers in a row
                assert not limiter.allow("k").degraded
            warned, recovered = _outage_records(caplog)
            assert len(warned) == episode and len(recovered) == episode
        shown = f"redis://:***@127.0.0.1:{server.port}/0"
        assert all(shown in m and "on_error='allow'" in m for m in warned)
        assert all(shown in m for m in recovered)
        assert SECRET not in caplog.text
        storage.close()
    finally:
        server.stop()


def test_a_flask_app_on_a_dead_store_uri_logs_the_outage_once(caplog: pytest.LogCaptureFixture) -> None:
    """What the issue saw: RATELIMIT_STORAGE_URI at nothing, the default
    on_error="allow", every request admitted with Remaining 0, and now one
    WARNING saying why."""
    from flask import Flask
    from redis_servers import free_port

    from nanolimit.flask import Limiter

    port = free_port()  # nothing listens there
    app = Flask(__name__)
    app.config["RATELIMIT_STORAGE_URI"] = f"redis://:{SECRET}@127.0.0.1:{port}/0"
    app.config["RATELIMIT_DEFAULT"] = "100/hour"
    Limiter(app=app)

    @app.get("/")
    def index() -> str:
        return "ok"

    caplog.set_level(logging.WARNING, logger="nanolimit.storage.redis")
    client = app.test_client()
    answers = [client.get("/") for _ in range(10)]
    assert [a.status_code for a in answers] == [200] * 10
    assert {a.headers["X-RateLimit-Remaining"] for a in answers} == {"0"}
    warned, _ = _outage_records(caplog)
    assert len(warned) == 1
    assert f"redis://:***@127.0.0.1:{port}/0" in warned[0] and "ConnectionError" in warned[0]
    assert SECRET not in caplog.text


def test_a_storage_made_from_a_client_names_its_address(own_server: Any) -> None:
    storage = RedisStorage(own_server.client(password=None))
    assert storage.address == f"redis://127.0.0.1:{own_server.port}/0"


@pytest.mark.parametrize("flavour", ["sync", "asyncio"])
@pytest.mark.parametrize("batch", ["script", "pipeline"])
@pytest.mark.parametrize("policy", ["allow", "deny"])
def test_degraded_counts_every_request_a_policy_answers_in_a_batch(
    backend: types.SimpleNamespace, own_server: Any, policy: str, batch: str, flavour: str
) -> None:
    """``metrics()["degraded"]`` is the number of requests the policy
    answered. A batch of 10 whose round trip failed, or that the open
    breaker answered, counted 1 under ``"allow"``/``"deny"`` (10 under
    ``"local"``, and 10 degraded answers in the result): an operator's
    degraded/decisions ratio was off by the batch size."""
    import redis
    import redis.asyncio

    from nanolimit.storage.redis import AsyncRedisStorage

    keys = [f"k{i}" for i in range(10)]
    options: dict[str, Any] = {
        "timeout": TIMEOUT,
        "on_error": policy,
        "batch": batch,
        "breaker_threshold": 1,
        "breaker_cooldown": 60.0,
    }
    if flavour == "sync":
        storage: Any = RedisStorage(own_server.client(), **options)
    else:
        storage = AsyncRedisStorage(redis.asyncio.Redis(host="127.0.0.1", port=own_server.port), **options)
    limiter = backend.TokenBucket(5, 60.0, storage, rule="degraded")

    own_server.kill()
    config, costs = limiter.config, [1] * 10
    if flavour == "sync":
        failed = storage.run_kernel_many(config, keys, costs, None)  # fails: the breaker opens
        skipped = storage.run_kernel_many(config, keys, costs, None)  # the open breaker answers
    else:

        async def both() -> tuple[list[Any], list[Any]]:
            try:
                first = await storage.run_kernel_many_async(config, keys, costs, None)
                return first, await storage.run_kernel_many_async(config, keys, costs, None)
            finally:
                await storage.close()

        failed, skipped = asyncio.run(both())
    for verdicts in (failed, skipped):
        assert len(verdicts) == 10 and all(v[5] for v in verdicts)  # every one degraded
        assert all(v[0] is (policy == "allow") for v in verdicts)
    m = storage.metrics()
    assert m["breaker_open_skips"] == 1 and m["errors"] == 1
    assert m["degraded"] == 20
    if flavour == "sync":
        storage.close()
