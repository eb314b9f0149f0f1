"""RedisStorage beyond the kernels: key names and hashing, expiry, the
Storage protocol, pipelined batches, compound limits (all-or-nothing in one
script), the near-cache and the metrics — on Redis 7 and Valkey 9."""

from __future__ import annotations

import threading
import time
import types
from typing import Any

import pytest
from _helpers import assert_same_decisions, fields
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nanolimit import reference
from nanolimit._limiter_config import LimiterConfig
from nanolimit._protocols import KernelStorage, Storage
from nanolimit.errors import ValidationError
from nanolimit.storage.redis import RedisStorage
from nanolimit.storage.redis._scripts import INJECTED_EXPIRY_FLOOR_MS

pytest_plugins = ["redis_servers"]  # the server fixtures

# --------------------------------------------------------------------------
# Keys


def test_protocols_and_key_layout(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    assert isinstance(storage, Storage) and isinstance(storage, KernelStorage)
    limiter = backend.TokenBucket(5, 60.0, storage, backend.FakeClock(0.0), rule="orders:user")
    limiter.allow("alice")
    assert storage.keys() == ["nanolimit:token_bucket:orders:user:{alice}"]
    assert len(storage) == 1


def test_hostile_and_secret_identities_are_hashed(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage(secret_rules={"api"}, key_salt=b"pepper")
    clock = backend.FakeClock(0.0)
    plain = backend.GCRA(5, 60.0, storage, clock, rule="plain")
    api = backend.GCRA(5, 60.0, storage, clock, rule="api")
    long_key = "x" * 500
    for key in (long_key, "evil}{tag", "#looks-hashed"):
        plain.allow(key)
    api.allow("sk_live_SECRET")
    names = storage.keys()
    assert len(names) == 4
    for name in names:
        identity = name[name.index("{") + 1 : -1]
        assert identity.startswith("#") and len(identity) == 33, name
        assert name.count("{") == 1 and name.count("}") == 1
        assert len(name) < 80
    assert not any("SECRET" in n or "evil" in n or "xxxx" in n for n in names)
    # the same identity maps to the same key: state is found again
    assert plain.allow(long_key).remaining == 3
    assert api.peek("sk_live_SECRET").remaining == 3


def test_rule_with_braces_and_bad_prefix(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    limiter = backend.FixedWindowCounter(5, 60.0, storage, backend.FakeClock(0.0), rule="{weird}")
    limiter.allow("bob")
    (name,) = storage.keys()
    assert name.endswith(":{bob}") and "weird" not in name
    with pytest.raises(ValidationError):
        RedisStorage(storage.user_client, prefix="a{b}:")


def test_prefixes_isolate_and_len_counts_only_its_own(
    backend: types.SimpleNamespace, make_storage: Any
) -> None:
    one = make_storage(prefix="app*1:")
    two = make_storage(prefix="app?2:")
    clock = backend.FakeClock(0.0)
    for i in range(30):
        backend.TokenBucket(5, 60.0, one, clock, rule="r").allow(f"k{i}")
    backend.TokenBucket(5, 60.0, two, clock, rule="r").allow("k0")
    assert len(one) == 30 and len(two) == 1
    assert one.evict_idle(float("inf")) == 0  # documented no-op: keys expire themselves
    assert len(one) == 30
    assert one.clear() == 30 and len(one) == 0 and len(two) == 1


# --------------------------------------------------------------------------
# Expiry


def test_expiry_is_reset_after_rounded_up(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    client = storage.client
    tb = backend.TokenBucket(10, 10.0, storage, rule="e")  # server clock
    tb.allow("k")  # one token short: reset_after = 1.0 s
    ttl = client.pttl(storage.keys()[0])
    assert 500 <= ttl <= 1001  # 1000 ms + 1 ms slack, minus the time since (generous: loaded CI)
    leaky = backend.LeakyBucket(1000, 1.0, storage, rule="tiny")
    leaky.allow("k")  # level 1 / rate 1000 = 1 ms: ceil(1.0) + 1 ms slack
    name = storage.redis_key(leaky.config, "k")
    # -2: already gone, as it should be (a loaded machine may take longer than the 2 ms)
    assert client.pttl(name) in (0, 1, 2, -2)
    time.sleep(0.01)
    assert client.exists(name) == 0
    # after its expiry a key answers like one never seen
    assert fields(leaky.allow("k")) == fields(leaky.allow("fresh"))


def test_expiry_never_below_one_ms_and_keys_vanish(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    fixed = backend.FixedWindowCounter(2, 0.05, storage, rule="w")
    fixed.allow("k")
    fixed.allow("k")
    assert not fixed.allow("k").allowed or True  # may straddle a boundary
    time.sleep(0.2)
    assert len(storage) == 0
    assert fixed.allow("k").allowed


def test_injected_clock_gets_an_hour_floor(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    clock = backend.FakeClock(0.0)
    backend.GCRA(1000, 1.0, storage, clock, rule="g").allow("k")  # reset_after 1 ms of fake time
    ttl = storage.client.pttl(storage.keys()[0])
    assert INJECTED_EXPIRY_FLOOR_MS - 5000 < ttl <= INJECTED_EXPIRY_FLOOR_MS
    backend.TokenBucket(1, 86400.0 * 7, storage, clock, rule="long").allow("k")
    long_name = next(n for n in storage.keys() if "long" in n)
    assert storage.client.pttl(long_name) > 86400_000 * 6


# --------------------------------------------------------------------------
# Batches


@pytest.mark.parametrize("batch", ["script", "pipeline"])
@pytest.mark.parametrize("algorithm", ["token_bucket", "sliding_log", "gcra"])
def test_allow_many_is_one_round_trip_and_equals_one_by_one(
    backend: types.SimpleNamespace, make_storage: Any, algorithm: str, batch: str
) -> None:
    storage = make_storage(batch=batch)
    storage.load_scripts()
    clock = backend.FakeClock(100.0)
    limiter = backend.limiters[algorithm](3, 10.0, storage, clock, rule="m")
    ref = reference.LIMITERS[reference.Algorithm(algorithm)](3, 10.0, None, clock, rule="m")
    keys = [f"k{i % 7}" for i in range(40)]  # duplicates: order inside the batch matters
    costs = [1 + i % 2 for i in range(40)]
    pipelines: list[int] = []
    original = storage.client.pipeline

    def counting_pipeline(*args: Any, **kwargs: Any) -> Any:
        pipelines.append(1)
        return original(*args, **kwargs)

    storage.client.pipeline = counting_pipeline  # type: ignore[method-assign]
    got = limiter.allow_many(keys, costs)
    assert len(pipelines) == 1
    want = ref.allow_many(keys, costs)
    assert [fields(d) for d in got] == [fields(d) for d in want]
    assert not got.degraded and got.allowed_count == want.allowed_count
    storage.client.script_flush()  # NOSCRIPT inside a pipeline: load once, resend only those
    got = limiter.allow_many(keys, costs)
    want = ref.allow_many(keys, costs)
    assert [fields(d) for d in got] == [fields(d) for d in want]
    assert limiter.allow_many([]).allowed_count == 0
    many = [f"u{i}" for i in range(450)]  # over BATCH_CHUNK: several scripts, one pipeline
    got = limiter.allow_many(many)
    assert [fields(d) for d in got] == [fields(d) for d in ref.allow_many(many)]


# --------------------------------------------------------------------------
# Compound limits


def _three(backend: types.SimpleNamespace, storage: Any, clock: Any) -> tuple[Any, Any, Any]:
    per_user = backend.TokenBucket(5, 60.0, storage, clock, rule="orders-user")
    per_ip = backend.FixedWindowCounter(3, 60.0, storage, clock, rule="all-ip")
    ceiling = backend.GCRA(100, 60.0, storage, clock, rule="global")
    return per_user, per_ip, ceiling


def test_compound_denial_by_the_last_rule_charges_nobody(
    backend: types.SimpleNamespace, make_storage: Any
) -> None:
    storage = make_storage()
    clock = backend.FakeClock(0.0)
    per_user, per_ip, ceiling = _three(backend, storage, clock)
    for _ in range(3):
        assert storage.allow_all([(per_user, "u1"), (ceiling, "*"), (per_ip, "10.0.0.1")]).allowed
    before = [per_user.state("u1"), ceiling.state("*"), per_ip.state("10.0.0.1")]
    denied = storage.allow_all([(per_user, "u1"), (ceiling, "*"), (per_ip, "10.0.0.1")])
    assert not denied.allowed and denied.denied_by == "all-ip"
    assert denied.retry_after == pytest.approx(60.0)
    assert [d.allowed for d in denied.decisions] == [True, True, False]
    assert [type(d) for d in denied.decisions] == [backend.Decision] * 3
    assert [per_user.state("u1"), ceiling.state("*"), per_ip.state("10.0.0.1")] == before
    assert per_user.peek("u1").remaining == 1


def test_compound_costs_and_headers(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    per_user, per_ip, ceiling = _three(backend, storage, backend.FakeClock(10.0))
    result = storage.allow_all([(per_user, "u1", 2), (per_ip, "ip", 1), (ceiling, "*", 3)])
    assert result.allowed and result.denied_by is None
    assert [d.remaining for d in result.decisions] == [3, 2, 97]
    assert result.headers(wall_now=1000.0)["X-RateLimit-Remaining"] == "2"


def test_compound_with_the_server_clock(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    a = backend.SlidingWindowLog(2, 3600.0, storage, rule="a")
    b = backend.SlidingWindowCounter(5, 3600.0, storage, rule="b")
    assert storage.allow_all([(a, "k"), (b, "k")]).allowed
    assert storage.allow_all([(a, "k"), (b, "k")]).allowed
    denied = storage.allow_all([(a, "k"), (b, "k")])
    assert not denied.allowed and denied.denied_by == "a"
    assert b.peek("k").remaining == 2  # 2 spent, the denied one was not charged


def test_compound_validation_changes_nothing(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    clock = backend.FakeClock(0.0)
    per_user, per_ip, _ = _three(backend, storage, clock)
    other = backend.TokenBucket(5, 60.0, backend.InMemoryStorage(), clock, rule="elsewhere")
    bad = [
        [],
        [(per_user, "u1"), (other, "u1")],
        [(per_user, "u1"), (per_ip, "ip", 0)],
        [(per_user, "u1"), (per_ip, 42)],
        [(per_user, "u1"), (per_user, "u1")],
        ["not a tuple"],
    ]
    for requests in bad:
        with pytest.raises(ValidationError):
            storage.allow_all(requests)
    assert len(storage) == 0


def test_compound_under_eight_threads(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    clock = backend.FakeClock(0.0)
    a = backend.SlidingWindowLog(50, 60.0, storage, clock, rule="a")
    b = backend.FixedWindowCounter(80, 60.0, storage, clock, rule="b")
    counts = [0] * 8
    barrier = threading.Barrier(8)

    def work(slot: int) -> None:
        barrier.wait()
        for _ in range(40):
            if storage.allow_all([(b, "shared"), (a, f"pair{slot // 2}")]).allowed:
                counts[slot] += 1

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert sum(counts) == 80
    assert b.state("shared").count == 80
    # each pair's log holds exactly what its two threads were admitted; a pair
    # whose threads came last may have none, and then no state at all
    for p in range(4):
        state = a.state(f"pair{p}")
        assert (len(state.log or ()) if state is not None else 0) == counts[2 * p] + counts[2 * p + 1]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    trace=st.lists(
        st.tuples(st.sets(st.integers(0, 2), min_size=1), st.integers(1, 3), st.floats(0, 2.0)),
        min_size=1,
        max_size=25,
    )
)
def test_compound_equals_in_memory_compound(
    backend: types.SimpleNamespace, make_storage: Any, trace: Any
) -> None:
    """The one-script compound on Redis answers what the in-memory compound answers."""
    storage = make_storage()
    storage.client.flushdb()
    clock = backend.FakeClock(100.0)
    memory = reference.InMemoryStorage()
    specs = [("TokenBucket", 4, 1.0), ("FixedWindowCounter", 5, 2.0), ("GCRA", 3, 1.0)]
    on_redis = [
        getattr(backend, c)(lim, w, storage, clock, rule=f"r{i}") for i, (c, lim, w) in enumerate(specs)
    ]
    in_memory = [
        getattr(reference, c)(lim, w, memory, clock, rule=f"r{i}") for i, (c, lim, w) in enumerate(specs)
    ]
    for chosen, cost, dt in trace:
        clock.advance(dt)
        picked = sorted(chosen)
        got = storage.allow_all([(on_redis[i], "k", cost) for i in picked])
        want = memory.allow_all([(in_memory[i], "k", cost) for i in picked])
        assert_same_decisions(got.decisions, want.decisions)
        assert got.allowed == want.allowed
    for r, m in zip(on_redis, in_memory):
        assert r.state("k") == m.state("k")
    storage.client.close()


def test_run_kernel_all_seam(make_storage: Any) -> None:
    storage = make_storage()
    a = LimiterConfig.build("token_bucket", 2, 10.0, rule="a")
    b = LimiterConfig.build("gcra", 1, 10.0, rule="b")
    first = storage.run_kernel_all([(a, "k", 1), (b, "k", 1)], 5.0)
    assert [v[0] for v in first] == [True, True]
    second = storage.run_kernel_all([(a, "k", 1), (b, "k", 1)], 5.0)
    assert [v[0] for v in second] == [True, False]
    assert storage.snapshot(a, "k", 5.0).level == 1.0  # the denied compound spent nothing


# --------------------------------------------------------------------------
# Near-cache and metrics


def _spent_bucket(
    backend: types.SimpleNamespace, make_storage: Any, window: float, ttl: float, key: str
) -> Any:
    """A near-caching storage and a 2-token bucket whose ``key`` was just
    spent and then denied once: (storage, clock, limiter, that denial)."""
    storage = make_storage(near_cache=True, near_cache_ttl=ttl)
    clock = backend.FakeClock(0.0)
    limiter = backend.TokenBucket(2, window, storage, clock, rule="nc")
    assert limiter.allow(key, 2).allowed
    first = limiter.allow(key)
    assert not first.allowed
    return storage, clock, limiter, first


def test_near_cache_denies_a_hot_key_without_a_round_trip(
    backend: types.SimpleNamespace, make_storage: Any
) -> None:
    storage, clock, limiter, first = _spent_bucket(backend, make_storage, 10.0, 5.0, "abuser")
    decisions_before = storage.metrics()["decisions"]
    for _ in range(100):
        d = limiter.allow("abuser")
        assert not d.allowed and d.retry_after <= first.retry_after
    m = storage.metrics()
    assert m["decisions"] == decisions_before and m["near_cache_hits"] == 100
    clock.advance(first.retry_after)  # until retry_after: then the store is asked again
    assert limiter.allow("abuser").allowed
    # per cost: a cheaper request than the one denied still goes to the store
    clock.set(100.0)
    limiter.allow("other", 2)
    clock.advance(5.0)  # one token back
    assert not limiter.allow("other", 2).allowed
    assert limiter.allow("other", 1).allowed
    limiter.reset("abuser")  # a reset clears the local denial too
    assert limiter.allow("abuser", 2).allowed


def test_near_cache_reports_the_stores_wait_not_its_own_lifetime(
    backend: types.SimpleNamespace, make_storage: Any
) -> None:
    # the cache keeps a denial for at most near_cache_ttl (1 s); the client
    # must still be told the store's wait, counting down, or it retries early
    storage, clock, limiter, first = _spent_bucket(backend, make_storage, 100.0, 1.0, "k")
    assert first.retry_after == pytest.approx(50.0)
    clock.advance(0.25)
    hits = storage.metrics()["near_cache_hits"]
    cached = limiter.allow("k")
    assert storage.metrics()["near_cache_hits"] == hits + 1
    assert not cached.allowed and cached.retry_after == pytest.approx(49.75)
    assert cached.headers(wall_now=0.0)["Retry-After"] == "50"


@pytest.mark.parametrize("near", [False, True], ids=["plain", "near-cache"])
def test_a_clock_that_ran_ahead_and_came_back_is_not_a_year_of_lockout(
    backend: types.SimpleNamespace, make_storage: Any, near: bool
) -> None:
    # an injected clock a year ahead spends the key, then comes back: Redis's
    # MAX_CLOCK_LEAD rule answers within a window; a near-cache denial stamped
    # a year ahead had denied the key for a year (retry_after: a year)
    storage = make_storage(near_cache=near, prefix=f"jump{near}:")
    clock = backend.FakeClock(1_000_000.0)
    limiter = backend.TokenBucket(5, 10.0, storage, clock, rule="jump")
    clock.set(1_000_000.0 + 365 * 86400.0)
    assert [limiter.allow("k").allowed for _ in range(6)] == [True] * 5 + [False]
    clock.set(1_000_001.0)  # back: the clock's error is over
    back = limiter.allow("k")
    assert back.retry_after <= 10.0, back
    clock.advance(back.retry_after + 0.01)
    assert limiter.allow("k").allowed


def test_near_cache_is_bounded(make_storage: Any) -> None:
    storage = make_storage(near_cache=True, near_cache_size=10)
    cfg = LimiterConfig.build("gcra", 1, 60.0, rule="b")
    for i in range(50):
        storage.run_kernel(cfg, f"k{i}", 1, 1.0, True)
        storage.run_kernel(cfg, f"k{i}", 1, 1.0, True)
    assert len(storage._near) == 10


def test_metrics_count_decisions(backend: types.SimpleNamespace, make_storage: Any) -> None:
    storage = make_storage()
    limiter = backend.GCRA(5, 1.0, storage, backend.FakeClock(0.0), rule="m")
    for _ in range(3):
        limiter.allow("k")
    limiter.allow_many(["a", "b"])
    m = storage.metrics()
    assert m["decisions"] == 5 and m["errors"] == 0 and m["degraded"] == 0
    assert m["breaker_state"] == "closed"


def test_missing_server_skips_loudly_or_fails_under_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    import redis_servers

    monkeypatch.setattr(redis_servers, "find_binary", lambda kind: None)
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="NOT FOUND"):
        redis_servers.require_binary("redis")
    monkeypatch.setenv("CI", "")
    with pytest.raises(pytest.skip.Exception, match="NOT FOUND"):
        redis_servers.require_binary("valkey")


def test_a_client_that_decodes_responses(backend: types.SimpleNamespace, redis_server: Any) -> None:
    """``decode_responses=True`` clients answer str instead of bytes: same decisions."""
    storage = RedisStorage(redis_server.client(decode_responses=True), on_error="raise")
    clock = backend.FakeClock(0.0)
    for algorithm in ("token_bucket", "sliding_log", "gcra", "sliding_counter"):
        limiter = backend.limiters[algorithm](2, 10.0, storage, clock, rule="s")
        assert [limiter.allow("k").allowed for _ in range(3)] == [True, True, False]
        assert limiter.state("k") is not None
        assert limiter.allow_many(["k", "j"]).allowed_count == 1
        assert storage.allow_all([(limiter, "j")]).allowed
    assert len(storage) == 8


def test_a_valkey_py_client(backend: types.SimpleNamespace, redis_server: Any) -> None:
    """valkey-py (a redis-py fork) works by duck typing, derived client included."""
    import valkey  # in the test extra

    client = valkey.Valkey(host="127.0.0.1", port=redis_server.port)
    storage = RedisStorage(client, on_error="raise", timeout=1.0)
    assert type(storage.client) is valkey.Valkey and storage.client is not client
    assert storage.client.connection_pool.connection_kwargs["retry"]._retries == 0
    limiter = backend.GCRA(2, 10.0, storage, backend.FakeClock(0.0), rule="v")
    assert [limiter.allow("k").allowed for _ in range(3)] == [True, True, False]
    assert limiter.allow_many(["a", "b", "a", "a"]).allowed_count == 3
    storage.client.script_flush()
    assert limiter.allow("b").allowed and storage.metrics()["errors"] == 0
    derived_off = RedisStorage(client, derive=False)
    assert derived_off.client is client


def test_client_clock_mode(backend: types.SimpleNamespace, make_storage: Any) -> None:
    """``clock="client"`` sends the local wall clock instead of reading TIME."""
    storage = make_storage(clock="client")
    limiter = backend.SlidingWindowLog(2, 3600.0, storage, rule="c")
    before = time.time()
    assert [limiter.allow("k").allowed for _ in range(3)] == [True, True, False]
    state = limiter.state("k")
    assert before <= state.updated_at <= time.time()
    assert all(before <= t <= state.updated_at for t in state.log)
    with pytest.raises(ValidationError):
        make_storage(clock="gps")
    with pytest.raises(ValidationError):
        make_storage(on_error="ignore")
    with pytest.raises(ValidationError):
        make_storage(batch="turbo")
