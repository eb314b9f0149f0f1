"""TwoTierStorage against real servers: a fleet of separate processes, a
partition (the server killed and restarted mid-run), instance churn, and the
refused algorithms.

The fleet tests run on Redis only (each costs several seconds of real time);
the in-process ones on every server kind available.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from tcp_proxy import TcpProxy

pytest_plugins = ["redis_servers"]  # the server fixtures

WORKER = Path(__file__).with_name("two_tier_worker.py")
HASH_NAME = re.compile(rb"\{(.+)\}:tt:(-?\d+)$")

K = 3  # instances
LIMIT = 300
WINDOW = 1.0
SYNC = 0.05


def start_fleet(
    ports: list[int], args: dict[str, Any], *, lead: float = 0.6
) -> tuple[list[subprocess.Popen[bytes]], float]:
    """One worker process per port, ``args`` for all (``instance_id`` set
    per worker); once every one is a fleet member (it printed ``ready``), the
    load starts for all on a window boundary at least ``lead`` seconds away,
    each deciding each key once half a window before it (so the fleet has
    seen the keys: a key's first window on an instance is one the bound
    leaves open). Returns the processes and ``t0``."""
    env = dict(os.environ)
    # the workers import the very nanolimit this process tests (source tree or installed wheel)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, port in enumerate(ports):
            mine = {**args, "port": port, "instance_id": f"inst-{i}"}
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), json.dumps(mine)],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=env,
                )
            )
        for proc in procs:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            if line.strip() != b"ready":
                _, err = proc.communicate(timeout=10)
                raise AssertionError(f"a worker did not start: {line!r} {err.decode()[-2000:]}")
        window = args["window"]
        t0 = math.ceil((time.time() + lead) / window) * window
        start = {"t0": t0, "warm_at": t0 - window / 2, "converge_at": t0 + args["duration"] + 0.8}
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write((json.dumps(start) + "\n").encode())
            proc.stdin.flush()  # communicate() closes it
        return procs, t0
    except BaseException:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise


def finish_fleet(procs: list[subprocess.Popen[bytes]], timeout: float) -> list[dict[str, Any]]:
    """Each worker's report (its last stdout line); every process is ended."""
    try:
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, err.decode()[-2000:]
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
        return reports
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def run_fleet(
    port: int,
    *,
    duration: float,
    schedule: Any = None,
    keys: tuple[str, ...] = ("a", "b"),
    pace: float = 0.001,
    proxies: list[Any] | None = None,
) -> list[dict[str, Any]]:
    """K worker processes against ``port`` (worker i through ``proxies[i]``
    when given), started together (``start_fleet``); ``schedule(t0)`` runs in
    this process meanwhile (kill/restart, cut/restore). Returns each
    worker's report."""
    args = {
        "limiter": "FixedWindowCounter",
        "limit": LIMIT,
        "window": WINDOW,
        "keys": list(keys),
        "duration": duration,
        "sync_interval": SYNC,
        "heartbeat_ttl": 2.0,
        "pace": pace,
    }
    procs, t0 = start_fleet([port] * K if proxies is None else [p.port for p in proxies], args)
    try:
        if schedule is not None:
            schedule(t0)
    finally:
        reports = finish_fleet(procs, duration + 20)
    return reports


def totals(reports: list[dict[str, Any]], field: str = "admitted") -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = defaultdict(int)
    for report in reports:
        for key, per in report[field].items():
            for k, n in per.items():
                out[(key, int(k))] += n
    return out


def redis_fields(client: Any) -> dict[tuple[str, int], dict[str, int]]:
    """Every two-tier hash in the server: (key, window) -> instance -> units."""
    out: dict[tuple[str, int], dict[str, int]] = {}
    for name in client.scan_iter(match="*:tt:*"):
        match = HASH_NAME.search(name)
        if match is None:
            continue
        fields = client.hgetall(name)
        out[(match.group(1).decode(), int(match.group(2)))] = {f.decode(): int(v) for f, v in fields.items()}
    return out


def check_redis_matches(reports: list[dict[str, Any]], stored: dict[tuple[str, int], dict[str, int]]) -> int:
    """Every stored per-instance count equals what that instance says it
    admitted: nothing lost, nothing counted twice. Returns windows checked."""
    for (key, k), fields in stored.items():
        for report in reports:
            admitted = report["admitted"].get(key, {}).get(str(k), 0)
            assert fields.get(report["instance_id"], 0) == admitted, (key, k, report["instance_id"])
    return len(stored)


def check_views_agree(reports: list[dict[str, Any]], per_window: dict[tuple[str, int], int]) -> None:
    """One view after a sync: every instance sees the same fleet counts, and
    they are exact. Only the windows every instance still holds are compared:
    an instance whose last decision fell just past the load's end (its loop
    checks the time before it decides) has moved on to that window."""
    for key in ("a", "b"):
        views = [r["view"][key] for r in reports]
        held = set.intersection(*(set(v) for v in views))
        assert held, views
        for k in held:
            assert {v[k] for v in views} == {per_window[(key, int(k))]}, (k, views)


def run_cut_fleet(server: Any, *, pace: float) -> tuple[list[dict[str, Any]], int]:
    """K workers, each through its own proxy; the last one is cut off from
    Redis 1.3 s into the load and reconnected 1.7 s later, while the others
    keep it. Returns the reports and the load's first window."""
    proxies = [TcpProxy(server.port) for _ in range(K)]

    def schedule(t0: float) -> None:
        time.sleep(max(0.0, t0 + 1.3 - time.time()))
        proxies[-1].cut()
        time.sleep(max(0.0, t0 + 3.0 - time.time()))
        proxies[-1].restore()

    try:
        reports = run_fleet(server.port, duration=3.6, schedule=schedule, pace=pace, proxies=proxies)
    finally:
        for proxy in proxies:
            proxy.close()
    return reports, math.floor(reports[0]["t0"] / WINDOW + 0.5)


def check_cut_fleet(server: Any, reports: list[dict[str, Any]], first: int) -> None:
    """Every window within the limit, the first ones after the cut included
    (before the cut instance's heartbeat lapses), windows inside the load
    used, and the fleet converged on exactly what was admitted."""
    per_window = totals(reports)
    blind = totals(reports, "blind")
    print("\nadmitted per (key, window):", dict(sorted(per_window.items())), "first", first)
    print("admitted blind per (key, window):", dict(sorted(blind.items())))
    for (key, k), admitted in per_window.items():
        each = {r["instance_id"]: r["admitted"].get(key, {}).get(str(k), 0) for r in reports}
        assert admitted <= LIMIT, (key, k, admitted, each)
    last = max(k for _, k in per_window)
    inside = [v for (_, k), v in per_window.items() if first <= k < last]
    assert len(inside) >= 6 and min(inside) >= LIMIT // 2, inside  # used, not starved
    *kept, cut = reports
    assert sum(sum(per.values()) for per in cut["blind"].values()) > 0, "the cut instance never noticed"
    for per in cut["blind"].values():
        assert all(n <= LIMIT // K for n in per.values())  # its share, at most
    assert cut["metrics"]["partitions"] >= 1 and not any(r["metrics"]["partitions"] for r in kept)
    assert all(r["metrics"]["partition"] is False for r in reports)
    check_views_agree(reports, per_window)
    client = server.client()
    assert check_redis_matches(reports, redis_fields(client)) >= 2
    client.close()


@pytest.mark.parametrize("server_kind", ["redis"])
def test_a_paced_fleet_stays_within_the_limit_through_a_partial_partition(redis_server: Any) -> None:
    """Three processes, each ~900 requests per second per key (9x the limit
    across the fleet), one cut off from Redis for 1.7 s: every window holds
    at most L (it held L plus the cut instance's share until its heartbeat
    lapsed, 400 of 300)."""
    reports, first = run_cut_fleet(redis_server, pace=0.001)
    check_cut_fleet(redis_server, reports, first)
    for report in reports:
        assert 3 in report["instances_seen"]
        assert report["metrics"]["syncs"] > 10


@pytest.mark.parametrize("server_kind", ["redis"])
def test_a_fleet_at_full_speed_stays_within_the_limit_through_a_partial_partition(redis_server: Any) -> None:
    """The same with every process deciding as fast as it can: every window
    at most L, the steady ones before and after the cut too (each window
    admitted 378 of 300 when what the others had spent of their default
    shares before their first sync of a window was not reserved)."""
    import nanolimit

    reports, first = run_cut_fleet(redis_server, pace=0.0)
    check_cut_fleet(redis_server, reports, first)
    if nanolimit.IMPLEMENTATION == "native":  # the workers' twin is this process's
        assert all(r["metrics"]["decisions_native"] > r["metrics"]["decisions"] // 2 for r in reports)


@pytest.mark.parametrize("server_kind", ["redis"])
def test_partition_falls_back_to_share_and_reconciles(own_server: Any) -> None:
    duration = 5.0

    def schedule(t0: float) -> None:
        time.sleep(max(0.0, t0 + 1.3 - time.time()))
        own_server.kill()
        time.sleep(max(0.0, t0 + 3.0 - time.time()))
        own_server.start()

    reports = run_fleet(own_server.port, duration=duration, schedule=schedule)
    per_window = totals(reports)
    blind = totals(reports, "blind")
    print("\nadmitted per (key, window):", dict(sorted(per_window.items())))
    print("admitted blind per (key, window):", dict(sorted(blind.items())))
    assert sum(blind.values()) > 0, "no instance noticed the partition"
    for (key, k), admitted in blind.items():
        assert admitted <= LIMIT, (key, k, admitted)  # the fleet, while blind
    for report in reports:
        for per in report["blind"].values():
            assert all(n <= LIMIT // K for n in per.values())  # each instance: its share
        metrics = report["metrics"]
        assert metrics["partitions"] >= 1 and metrics["partition"] is False
        assert metrics["units_reconciled"] == sum(sum(per.values()) for per in report["blind"].values())
    for (key, k), admitted in per_window.items():
        # the window Redis returns in too: the first instances back reserve the
        # others' blind shares until those have re-written their counts
        assert admitted <= LIMIT, (key, k, admitted)
    # the restarted (empty) server holds exactly what each instance admitted
    client = own_server.client()
    assert check_redis_matches(reports, redis_fields(client)) >= 2
    client.close()
    check_views_agree(reports, per_window)


def make_tier(server: Any, instance_id: str, **kwargs: Any) -> Any:
    from nanolimit.storage.two_tier import TwoTierStorage

    kwargs.setdefault("sync_interval", SYNC)
    return TwoTierStorage(None, server.client(), instance_id=instance_id, **kwargs)


@contextlib.contextmanager
def synced(server: Any, *instance_ids: str) -> Iterator[list[Any]]:
    """Tiers without the background thread, each synced twice in turn (so
    every one counts all the others), closed at the end."""
    tiers = [make_tier(server, instance_id, start=False) for instance_id in instance_ids]
    try:
        for tier in tiers + tiers:
            tier.sync_now()
        yield tiers
    finally:
        for tier in tiers:
            tier.close()


def test_dead_instance_stops_counting_after_ttl(redis_server: Any) -> None:
    import nanolimit

    a = make_tier(redis_server, "a", heartbeat_ttl=0.4)
    b = make_tier(redis_server, "b", heartbeat_ttl=0.4)
    try:
        clock = nanolimit.FakeClock(1000.0)  # one window for the whole test
        limiter_b = nanolimit.FixedWindowCounter(100, 30.0, storage=b, clock=clock)
        assert sum(limiter_b.allow("k").allowed for _ in range(5)) == 5
        b.sync_now()
        a.sync_now()
        assert a.instances == 2 and b.instances == 2
        b.close(deregister=False)  # dies: no more heartbeats
        deadline = time.monotonic() + 3.0
        while a.instances != 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert a.instances == 1
        limiter_a = nanolimit.FixedWindowCounter(100, 30.0, storage=a, clock=clock)
        limiter_a.allow("k")
        a.sync_now()
        assert a.fleet_counts(limiter_a.config, "k") == {33: 6}  # b's units stay
    finally:
        a.close()


@pytest.mark.parametrize("server_kind", ["redis"])
def test_silence_follows_each_instances_own_sync_period(redis_server: Any) -> None:
    """A heartbeat lasts HEARTBEAT_GAPS of the instance's own longest recent
    gaps between syncs (within [2 * sync_interval, heartbeat_ttl]). One whose
    every sync takes 0.15 s longer (a slow link here; a busy host or many
    keys alike) stays live between its syncs, where an expiry of four sync
    intervals would take it for silent; cut off, it is silent to the others
    within a few of its own periods, not after heartbeat_ttl (3 s here)."""
    import redis

    from nanolimit.storage.two_tier import HEARTBEAT_GAPS, TwoTierStorage

    slow_link = TcpProxy(redis_server.port, delay=0.15)
    watcher = make_tier(redis_server, "watcher", heartbeat_ttl=3.0)
    slow = TwoTierStorage(
        None,
        redis.Redis(host="127.0.0.1", port=slow_link.port),
        instance_id="slow",
        sync_interval=SYNC,
        heartbeat_ttl=3.0,
        timeout=1.0,
    )
    try:
        deadline = time.monotonic() + 3.0
        while watcher.instances != 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        seen = set()
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline:
            seen.add((watcher.instances, watcher.metrics()["silent_instances"]))
            time.sleep(0.01)
        assert seen == {(2, 0)}  # live all along
        ttl_slow = slow.metrics()["heartbeat_ttl_last"]
        ttl_fast = watcher.metrics()["heartbeat_ttl_last"]
        assert HEARTBEAT_GAPS * 0.15 < ttl_slow < 3.0 and ttl_fast < min(1.0, ttl_slow), (ttl_fast, ttl_slow)
        slow_link.cut()
        cut = time.monotonic()
        while watcher.metrics()["silent_instances"] == 0 and time.monotonic() < cut + 3.0:
            time.sleep(0.01)
        waited = time.monotonic() - cut
        assert watcher.metrics()["silent_instances"] == 1 and watcher.instances == 1
        assert waited < ttl_slow + 0.3, (waited, ttl_slow)
    finally:
        watcher.close()
        slow_link.close()  # the sync in flight fails at once: nothing left to wait for
        slow.close(deregister=False)


def test_windows_only_read_are_dropped_two_behind(backend: Any, redis_server: Any) -> None:
    """A key refused window after window (none of its units anywhere) reads
    a window's total each sync: the windows two behind the key's own go,
    read or not, so a blocked client's key holds no more each window (each
    one only read was kept for good before). Units not yet pushed stay."""
    from nanolimit.storage.two_tier._sync import _FleetSync

    clock = backend.FakeClock(1000.5)
    tier = make_tier(redis_server, f"prune-{backend.name}", start=False)
    try:
        limiter = backend.SlidingWindowCounter(10, 1.0, storage=tier, clock=clock)
        limiter.peek("k")
        track = tier._tracks[(limiter.config, "k")]
        for w in range(990, 1001):  # read, none of ours
            track.seen_total[w] = track.settled[w] = 3
            track.seen_own[w] = track.pushed[w] = track.acked[w] = 0
        track.own[995] = 2  # units Redis has not seen yet
        _FleetSync._prune(track, 1000)
        assert set(track.seen_total) == {995, 999, 1000}
        assert set(track.settled) == set(track.pushed) == {995, 999, 1000}
        track.pushed[995] = 2  # now pushed: it goes too
        _FleetSync._prune(track, 1000)
        assert set(track.seen_total) == {999, 1000} and not track.own
    finally:
        tier.close()


def test_single_instance_is_exact(backend: Any, redis_server: Any) -> None:
    clock = backend.FakeClock(1000.0)
    tier = make_tier(redis_server, "solo", start=False)
    try:
        tier.sync_now()
        for cls, limit in (("FixedWindowCounter", 10), ("SlidingWindowCounter", 10), ("TokenBucket", 10)):
            limiter = getattr(backend, cls)(limit, 1.0, storage=tier, clock=clock, rule=cls)
            assert not limiter.peek("k").degraded
            got = [limiter.allow("k").allowed for _ in range(limit + 2)]
            assert got == [True] * limit + [False, False], cls
            tier.sync_now()
            assert (
                tier.fleet_counts(limiter.config, "k")[math.floor(1000.0 / limiter.window_seconds)] == limit
            )
        clock.advance(2.0)
        fixed = backend.FixedWindowCounter(10, 1.0, storage=tier, clock=clock, rule="FixedWindowCounter")
        assert fixed.allow("k").allowed
        batch = fixed.allow_many(["k"] * 12)
        assert batch.allowed_count == 9
        metrics = tier.metrics()
        for name in ("syncs", "sync_latency_avg", "keys_tracked", "units_reconciled", "partition"):
            assert name in metrics
        assert metrics["keys_tracked"] == 3 and metrics["partition"] is False
    finally:
        tier.close()


@pytest.mark.parametrize("cls", ["SlidingWindowLog", "GCRA", "LeakyBucket"])
def test_unsupported_algorithms_are_refused(backend: Any, redis_server: Any, cls: str) -> None:
    tier = make_tier(redis_server, "x", start=False)
    try:
        limiter = getattr(backend, cls)(10, 1.0, storage=tier)
        with pytest.raises(backend.ValidationError, match="cannot be summed"):
            limiter.allow("k")
    finally:
        tier.close()


def test_decisions_never_wait_for_a_dead_server(own_server: Any) -> None:
    """Kill the server: decisions keep answering at local speed, degraded,
    within the share; the thread notices within a sync."""
    import nanolimit

    tier = make_tier(own_server, "lonely")
    try:
        limiter = nanolimit.FixedWindowCounter(1000, 60.0, storage=tier)
        assert limiter.allow("k").allowed
        own_server.kill()
        deadline = time.monotonic() + 3.0
        while not tier.partitioned and time.monotonic() < deadline:
            time.sleep(0.02)
        assert tier.metrics()["partition"] is True
        began = time.perf_counter()
        decisions = [limiter.allow("k") for _ in range(200)]
        assert time.perf_counter() - began < 0.5
        assert all(d.degraded for d in decisions)
        own_server.start()
        deadline = time.monotonic() + 3.0
        while tier.partitioned and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not tier.partitioned
        assert tier.metrics()["units_reconciled"] == 200
    finally:
        done = threading.Event()
        threading.Thread(target=lambda: (tier.close(), done.set()), daemon=True).start()
        assert done.wait(5.0)


@pytest.mark.parametrize("cls", ["FixedWindowCounter", "SlidingWindowCounter", "TokenBucket"])
def test_leases_between_syncs_are_deterministic(backend: Any, redis_server: Any, cls: str) -> None:
    """Two instances, explicit syncs, one injected clock: each spends at most
    its lease between syncs; only units spent before an instance's first sync
    of a window can overshoot, and once both have synced the fleet lands
    exactly on the limit."""
    clock = backend.FakeClock(5000.0)
    a = make_tier(redis_server, "a", start=False)
    b = make_tier(redis_server, "b", start=False)
    try:
        lim_a = getattr(backend, cls)(10, 1.0, storage=a, clock=clock)
        lim_b = getattr(backend, cls)(10, 1.0, storage=b, clock=clock)
        a.sync_now()
        b.sync_now()
        a.sync_now()
        assert a.instances == b.instances == 2

        def admit(limiter: Any, n: int) -> int:
            return sum(limiter.allow("k").allowed for _ in range(n))

        # window 5000: before any sync of it, an even share ceil(10 / 2) = 5 each
        assert admit(lim_a, 8) == 5
        refused = lim_a.allow("k")
        assert not refused.allowed and refused.retry_after <= SYNC  # out of lease, not of budget
        assert a.metrics()["early_syncs"] >= 1
        assert admit(lim_b, 3) == 3  # b's default share, not yet visible to anyone
        a.sync_now()  # counts 5, no leases: lease ceil(5 / 2) = 3
        assert admit(lim_a, 5) == 3
        b.sync_now()  # counts 5 + 3, a's lease 3: nothing left
        assert admit(lim_b, 5) == 0
        a.sync_now()
        b.sync_now()
        # b's 3 units spent before its first sync of the window are the overshoot
        assert a.fleet_counts(lim_a.config, "k")[5000] == b.fleet_counts(lim_b.config, "k")[5000] == 11
        assert 11 <= 10 + (2 - 1) * 5  # L + (N - 1) * ceil(L / N)

        # window 5002 (5001 empty, so the sliding estimate starts clean)
        clock.set(5002.0)
        assert admit(lim_a, 1) == 1 and admit(lim_b, 1) == 1
        a.sync_now()  # counts 1: lease ceil(9 / 2) = 5
        # counts 2, a's lease 5: lease ceil(3 / 2) = 2; but until b's next sync
        # Redis holds 4 for it, the rest of its default share 5, its ceiling
        # while this sync was in flight
        b.sync_now()
        [name] = redis_server.client().keys("*{k}*:5002")
        assert int(redis_server.client().hget(name, "lease:b")) == 4
        assert admit(lim_a, 9) == 5 and admit(lim_b, 9) == 2  # 9 in all, 1 left
        a.sync_now()  # counts 6 + 1, b holds 4: lease 0
        b.sync_now()  # counts 6 + 3, b's ceiling now 3: lease ceil(1 / 2) = 1
        a.sync_now()  # counts 9, b's lease 1: lease 0
        assert admit(lim_a, 9) == 0 and admit(lim_b, 9) == 1
        for tier in (a, b, a, b):
            tier.sync_now()
        assert a.fleet_counts(lim_a.config, "k")[5002] == b.fleet_counts(lim_b.config, "k")[5002] == 10
        assert admit(lim_a, 3) + admit(lim_b, 3) == 0
    finally:
        a.close()
        b.close()


def test_reset_state_and_eviction(backend: Any, redis_server: Any) -> None:
    clock = backend.FakeClock(7000.0)
    tier = make_tier(redis_server, "solo", start=False)
    try:
        limiter = backend.SlidingWindowCounter(5, 1.0, storage=tier, clock=clock)
        assert sum(limiter.allow("k").allowed for _ in range(7)) == 5
        tier.sync_now()
        state = limiter.state("k")
        assert state is not None and state.window_index == 7000 and state.count == 5 and state.previous == 0
        limiter.reset("k")  # fleet-wide: the Redis hashes go too
        assert limiter.state("k") is None
        assert not list(redis_server.client().scan_iter(match="*}:tt:*"))
        assert sum(limiter.allow("k").allowed for _ in range(7)) == 5
        tier.sync_now()
        assert tier.evict_idle(7000.5) == 0  # its windows still count (the sliding estimate's too)
        assert tier.evict_idle(7002.0) == 1 and len(tier) == 0
    finally:
        tier.close()


def test_reset_while_blind_gives_the_key_its_share_back(backend: Any, own_server: Any) -> None:
    with synced(own_server, "blind-reset") as (tier,):
        clock = backend.FakeClock(70_000.0)
        limiter = backend.FixedWindowCounter(10, 60.0, storage=tier, clock=clock)
        own_server.kill()
        tier.sync_now()
        assert tier.partitioned
        assert sum(limiter.allow("k").allowed for _ in range(12)) == 10  # the whole share (one instance)
        limiter.reset("k")
        assert sum(limiter.allow("k").allowed for _ in range(12)) == 10


def test_units_pushed_counts_each_unit_once_across_a_partition(backend: Any, own_server: Any) -> None:
    with synced(own_server, "metric") as (tier,):
        clock = backend.FakeClock(95_000.0)
        limiter = backend.FixedWindowCounter(100, 60.0, storage=tier, clock=clock)
        assert sum(limiter.allow("k").allowed for _ in range(10)) == 10
        tier.sync_now()
        assert tier.metrics()["units_pushed"] == 10
        own_server.kill()
        tier.sync_now()
        assert tier.partitioned
        own_server.start()
        assert sum(limiter.allow("k").allowed for _ in range(5)) == 5
        tier.sync_now()  # re-writes all 15 (the server came back empty); 5 of them are new
        metrics = tier.metrics()
        assert metrics["partition"] is False and metrics["units_pushed"] == 15
        assert tier.fleet_counts(limiter.config, "k")[95_000 // 60] == 15


def test_a_cost_above_the_even_share_passes_after_a_sync(backend: Any, redis_server: Any) -> None:
    """docs/spec.md §3: a cost the limit admits must not be denied forever. With
    N = 2 and L = 10 the even lease is 5; a request of 8 asks the next sync
    for a lease that size, and the fleet still never passes the limit."""
    with synced(redis_server, "big-a", "big-b") as (a, b):
        assert a.instances == b.instances == 2
        clock = backend.FakeClock(50_000.0)
        on_a = backend.FixedWindowCounter(10, 60.0, storage=a, clock=clock, rule="big")
        on_b = backend.FixedWindowCounter(10, 60.0, storage=b, clock=clock, rule="big")
        assert on_b.peek("k").allowed  # b tracks the key: its syncs lease it too
        first = on_a.allow("k", 8)
        assert not first.allowed and first.retry_after <= a.sync_interval  # out of lease, not of budget
        a.sync_now()
        assert on_a.allow("k", 8).allowed
        b.sync_now()  # a's lease of 8 leaves b 1 of the 2 remaining
        # b's default share stays held for it until its next sync (it could have
        # spent it while that sync was in flight): then a gets the last unit
        b.sync_now()
        a.sync_now()
        more = sum(on_b.allow("k").allowed for _ in range(5)) + sum(on_a.allow("k").allowed for _ in range(5))
        assert 8 + more == 10


def test_a_reload_keeps_the_units_spent(backend: Any, redis_server: Any) -> None:
    """docs/spec.md §6: a reload that keeps a rule's name and algorithm keeps the
    budget spent under it. The new config's limiter writes the same hashes,
    so it takes over the key's counts instead of starting from zero."""
    with synced(redis_server, "reload") as (tier,):
        clock = backend.FakeClock(80_010.0)
        before = backend.FixedWindowCounter(10, 60.0, storage=tier, clock=clock, rule="api")
        assert sum(before.allow("u").allowed for _ in range(15)) == 10
        tier.sync_now()
        after = backend.FixedWindowCounter(12, 60.0, storage=tier, clock=clock, rule="api")
        admitted = sum(after.allow("u").allowed for _ in range(15))
        tier.sync_now()
        admitted += sum(after.allow("u").allowed for _ in range(15))
        tier.sync_now()
        assert admitted == 2
        assert tier.fleet_counts(after.config, "u")[80_010 // 60] == 12


def test_evict_idle_keeps_keys_whose_window_is_current(backend: Any, redis_server: Any) -> None:
    with synced(redis_server, "evict") as (tier,):
        clock = backend.FakeClock(50_000.0)  # window [49980, 50040)
        limiter = backend.FixedWindowCounter(10, 60.0, storage=tier, clock=clock, rule="ev")
        assert sum(limiter.allow("k").allowed for _ in range(12)) == 10
        tier.sync_now()
        clock.advance(5.0)
        assert tier.evict_idle(clock.now() - 1.0) == 0  # dropped now, it would hand its 10 out again
        assert sum(limiter.allow("k").allowed for _ in range(3)) == 0
        tier.sync_now()
        assert tier.evict_idle(50_040.0) == 1  # its window is over


def test_a_flushed_server_gets_every_count_back_at_the_next_sync(backend: Any, redis_server: Any) -> None:
    """redis-py reconnects through a restart (or a FLUSHALL) silently, so no
    partition is seen; the heartbeat notices the instance's membership gone
    and the next sync re-writes every count, idle keys' included."""
    client = redis_server.client()
    with synced(redis_server, "flushed") as (tier,):
        clock = backend.FakeClock(60_000.0)
        limiter = backend.FixedWindowCounter(10, 60.0, storage=tier, clock=clock, rule="fl")
        assert sum(limiter.allow("idle").allowed for _ in range(10)) == 10
        tier.sync_now()
        client.flushall()
        assert limiter.allow("busy").allowed
        tier._sync(full=False)  # a background sync: only the key decided since
        assert tier.metrics()["rejoins"] == 1
        # the lease that sync granted is not used: the server had no member list
        # to reserve the others' shares from
        assert not limiter.allow("busy").allowed
        tier._sync(full=False)
        assert sum(limiter.allow("busy").allowed for _ in range(12)) == 9
        stored = {int(k.rsplit(b":", 1)[1]): client.hgetall(k) for k in client.scan_iter(match="*{idle}*")}
        # the count, and the claim on the next window made again
        assert stored == {1000: {b"flushed": b"10", b"lease:flushed": b"0"}, 1001: {b"lease:flushed": b"10"}}
        assert sum(limiter.allow("idle").allowed for _ in range(3)) == 0


def test_blind_shares_add_up_to_the_limit(backend: Any, own_server: Any) -> None:
    """Each instance's share is L // N, plus one unit of the remainder for
    the lowest ranks by id, so the shares add up to L even when L < N (they
    added up to N with a floor of 1, and to N * ceil(L / N) before a first
    lease): what each admits in a window before its first sync there, and
    while Redis is unreachable."""
    with synced(own_server, "share-a", "share-b", "share-c", "share-d") as tiers:
        assert [t.instances for t in tiers] == [4] * 4
        clock = backend.FakeClock(60_000.0)
        fresh = [backend.FixedWindowCounter(2, 60.0, storage=t, clock=clock, rule="d2") for t in tiers]
        assert [sum(lim.allow("k").allowed for _ in range(5)) for lim in fresh] == [1, 1, 0, 0]
        for limit in (2, 7):
            cls = backend.FixedWindowCounter
            limiters = [cls(limit, 60.0, storage=t, clock=clock, rule=f"s{limit}") for t in tiers]
            if limit == 2:
                own_server.kill()
                cut_at = time.monotonic()
                for tier in tiers:
                    tier.sync_now()
                assert all(t.partitioned for t in tiers)
                for tier in tiers:
                    _wait_out_heartbeat(tier, cut_at)
                clock.advance(60.0)  # a window begun once every instance is silent
            got = [sum(lim.allow("k").allowed for _ in range(5)) for lim in limiters]
            assert sum(got) == limit, got
            assert got == sorted(got, reverse=True)  # ranks by id: share-a first


def _drain(limiter: Any, tier: Any, key: str = "k") -> int:
    """Admit on ``tier`` until its leases run dry: allow until denied, sync,
    and again, until a round admits nothing."""
    admitted = 0
    for _ in range(50):
        got = 0
        while limiter.allow(key).allowed:
            got += 1
        admitted += got
        tier.sync_now()
        if got == 0:
            return admitted
    raise AssertionError("leases kept coming")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_interval": 0}, "sync_interval"),
        ({"heartbeat_ttl": 0.05}, "heartbeat_ttl"),
        ({"partition_grace": 1.0}, "partition_grace"),  # under heartbeat_ttl (2 s)
        ({"partition_grace": True}, "partition_grace"),
        ({"partition_grace": "30"}, "partition_grace"),
        ({"partition_grace": 10**6}, "partition_grace"),
        ({"instances": 0}, "instances"),
        ({"prefix": "a{b}"}, "prefix"),
        ({"instance_id": 7}, "instance_id"),
        ({"instance_id": b"host-1"}, "instance_id"),
        ({"instance_id": "host\udc80"}, "instance_id"),  # a lone surrogate: no UTF-8 for Redis
        ({"instance_id": "host\n1"}, "instance_id"),
        ({"instance_id": "x" * 300}, "instance_id"),
        ({"instance_id": "lease:x"}, "instance_id"),
    ],
)
def test_bad_settings_are_refused(redis_server: Any, kwargs: dict[str, Any], message: str) -> None:
    from nanolimit import ValidationError
    from nanolimit.storage.two_tier import TwoTierStorage

    with pytest.raises(ValidationError, match=message):
        TwoTierStorage(None, redis_server.client(), start=False, **kwargs)


def test_a_cut_instance_admits_what_the_others_keep_out_for_it(backend: Any, own_server: Any) -> None:
    """Cut off from Redis, an instance admits per window what the instances
    still reaching Redis keep out of their leases for it. Where Redis holds a
    ceiling for it, that ceiling: in the window of the cut its count plus its
    lease (30 + 35, so 35 more), in the next one the default share it claimed
    there (50). In a window begun before its heartbeat lapsed, nothing more:
    the others were leasing it with no share kept out for it (a key it had
    not synced yet: 30, then none; it took 20 more, which the others may
    have leased). In a window begun after, its blind share."""
    client = own_server.client()
    with synced(own_server, "cut-a", "cut-b") as (a, b):
        clock = backend.FakeClock(6_000.0)  # window 200 of 30 s
        on_b = backend.FixedWindowCounter(100, 30.0, storage=b, clock=clock, rule="pre")
        assert sum(on_b.allow("k").allowed for _ in range(30)) == 30
        b.sync_now()  # count 30, lease ceil((100 - 30) / 2) = 35, and 50 claimed in window 201
        held = {int(name.rsplit(b":", 1)[1]): client.hgetall(name) for name in client.scan_iter("*{k}*")}
        assert held == {200: {b"cut-b": b"30", b"lease:cut-b": b"35"}, 201: {b"lease:cut-b": b"50"}}
        assert sum(on_b.allow("fresh").allowed for _ in range(30)) == 30  # its default share, not synced
        own_server.kill()
        cut_at = time.monotonic()
        assert not b.sync_now() and b.partitioned
        assert sum(on_b.allow("k").allowed for _ in range(60)) == 35
        assert sum(on_b.allow("fresh").allowed for _ in range(60)) == 0
        clock.advance(30.0)
        assert sum(on_b.allow("k").allowed for _ in range(60)) == 50
        _wait_out_heartbeat(b, cut_at)
        clock.advance(30.0)  # begun after: the blind share, which the others reserve for silent b
        assert sum(on_b.allow("k").allowed for _ in range(60)) == 50


def test_a_blind_sliding_counter_weighs_its_previous_window(backend: Any, own_server: Any) -> None:
    """A sliding counter cut off at the start of a window weighs what it
    admitted in the window before: against its blind share where Redis holds
    nothing for it there (40 of its 50 then, so 10 now; it admitted 50 when
    its blind state started empty), and in a window it claimed its share of
    (a key it synced), against the limit: 40 weighted + 50 claimed."""
    with synced(own_server, "slide-a", "slide-b") as (a, b):
        clock = backend.FakeClock(9_000.0)
        on_b = backend.SlidingWindowCounter(100, 10.0, storage=b, clock=clock, rule="sw")
        assert sum(on_b.allow("k").allowed for _ in range(40)) == 40
        b.sync_now()  # "k" claims b's share of window 901
        assert sum(on_b.allow("fresh").allowed for _ in range(40)) == 40
        clock.set(9_010.0)  # the next window's first instant: window 900 weighs 1.0
        own_server.kill()
        cut_at = time.monotonic()
        assert not b.sync_now() and b.partitioned
        _wait_out_heartbeat(b, cut_at)  # the window, on the fake clock, begins once b is silent
        assert sum(on_b.allow("fresh").allowed for _ in range(60)) == 10
        assert sum(on_b.allow("k").allowed for _ in range(60)) == 50


def _keep_syncing(tier: Any, seconds: float) -> None:
    """What the background thread would do meanwhile (so ``tier`` stays live)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        tier.sync_now()
        time.sleep(SYNC)
    tier.sync_now()


def _wait_out_heartbeat(tier: Any, cut_at: float) -> None:
    """Until the heartbeat of ``tier``, cut off at ``cut_at`` (monotonic), has
    lapsed for the others with the margin for the fleet's clocks (its
    timeout): a window begun after that is one they reserve its share in.
    Meanwhile it keeps trying to sync, as its background thread would; each
    attempt fails, and none may push the lapse further out."""
    lapse = cut_at + tier.metrics()["heartbeat_ttl_last"] + tier.timeout + 0.05
    while time.monotonic() < lapse:
        assert not tier.sync_now()
        time.sleep(min(SYNC, max(0.0, lapse - time.monotonic())))
    assert not tier.sync_now()


@contextlib.contextmanager
def _pair_with_a_cut(server: Any, **timing: float) -> Iterator[tuple[Any, Any, Any]]:
    """Tiers "a" and "b" (no background thread), each synced twice, and
    ``cut()``: b reaches Redis as an ACL user that it switches off, its
    connections dropped, while a keeps Redis (``cut(restore=True)`` switches
    it on again). Both closed at the end, b without leaving."""
    from nanolimit.storage.two_tier import TwoTierStorage

    admin = server.client()
    admin.execute_command("ACL", "SETUSER", "cut", "on", ">pw", "~*", "&*", "+@all")
    a = make_tier(server, "a", start=False, **timing)
    b = TwoTierStorage(
        None,
        server.client(username="cut", password="pw"),
        instance_id="b",
        sync_interval=SYNC,
        start=False,
        **timing,
    )

    def cut(restore: bool = False) -> None:
        admin.execute_command("ACL", "SETUSER", "cut", "on" if restore else "off")
        if not restore:
            admin.execute_command("CLIENT", "KILL", "USER", "cut")

    try:
        for tier in (a, b, a, b):
            assert tier.sync_now()
        yield a, b, cut
    finally:
        a.close()
        b.close(deregister=False)
        admin.close()


def test_a_partial_partition_keeps_the_fleet_within_the_limit(backend: Any, own_server: Any) -> None:
    """One of two instances loses Redis (its ACL user is switched off) while
    the other keeps it. The cut one admits its blind share, 50 of 100; once
    its heartbeat lapses the other reserves that share, so a window begun
    after that holds 100 (it held 150 when a silent member simply stopped
    counting).
    After ``partition_grace`` the silent member is dropped and its share is
    handed out again."""
    with _pair_with_a_cut(own_server, heartbeat_ttl=0.3, partition_grace=1.2) as (a, b, cut):
        assert a.instances == b.instances == 2
        cut()
        assert not b.sync_now() and b.partitioned and not a.partitioned
        _keep_syncing(a, 0.6)  # past b's heartbeat and timeout: a counts it silent, no longer live
        assert (a.instances, a.metrics()["silent_instances"]) == (1, 1)
        clock = backend.FakeClock(3_000.0)  # a window neither instance has seen
        on_a = backend.FixedWindowCounter(100, 30.0, storage=a, clock=clock, rule="pp")
        on_b = backend.FixedWindowCounter(100, 30.0, storage=b, clock=clock, rule="pp")
        blind = sum(on_b.allow("k").allowed for _ in range(120))
        leased = _drain(on_a, a)
        assert (blind, leased) == (50, 50)
        _keep_syncing(a, 1.3)  # past b's grace: dropped, its share free again
        assert (a.instances, a.metrics()["silent_instances"]) == (1, 0)
        clock.advance(30.0)
        assert _drain(on_a, a) == 100


def test_a_first_lease_weighs_the_previous_window(backend: Any, redis_server: Any) -> None:
    """A sliding counter's lease must leave room for the previous window's
    weight even on a track's first sync, when the instance has never read
    that window: the script weighs its fresh total in the same call."""
    with synced(redis_server, "prev-a", "prev-b") as (a, b):
        clock = backend.FakeClock(20_000.2)
        on_a = backend.SlidingWindowCounter(100, 1.0, storage=a, clock=clock, rule="pv")
        on_b = backend.SlidingWindowCounter(100, 1.0, storage=b, clock=clock, rule="pv")
        for _ in range(20):  # b spends the whole window 20000 (its lease halves what remains)
            sum(on_b.allow("k").allowed for _ in range(100))
            b.sync_now()
        assert b.fleet_counts(on_b.config, "k")[20_000] == 100
        clock.set(20_001.5)  # the previous window weighs 50: room for 50 at most
        assert on_a.allow("k").allowed  # a's first decision of the key: its default share
        a.sync_now()
        assert sum(on_a.allow("k").allowed for _ in range(60)) <= math.ceil((100 - 50 - 1) / 2)


def test_long_windows_outlive_the_hour(backend: Any, redis_server: Any) -> None:
    """A daily window's hash must outlive its window (docs: two windows
    after it), not a fixed hour: else an instance restarted an hour later
    finds the day's count gone and admits the limit again."""
    tier = make_tier(redis_server, "daily", start=False)
    client = redis_server.client()
    try:
        tier.sync_now()
        limiter = backend.FixedWindowCounter(1000, 86400.0, storage=tier, rule="daily")  # the system clock
        assert limiter.allow("user:42").allowed
        tier.sync_now()
        now = time.time()
        window_end = (math.floor(now / 86400.0) + 1) * 86400.0
        hashes = [k for k in client.scan_iter(match="*daily*") if client.type(k) == b"hash"]
        assert hashes
        for key in hashes:
            assert client.pttl(key) / 1000.0 >= window_end - now + 86400.0 - 5.0, key
    finally:
        tier.close()
        for key in client.scan_iter(match="*daily*"):
            client.delete(key)


def test_a_hash_gets_its_expiry_when_it_is_made(backend: Any, redis_server: Any) -> None:
    """A window of the wall clock has one end, so its hash's expiry is
    written once, when the hash is made (not by every sync: that was a tenth
    of the script's time); a window of an injected clock has none on the
    wall's, so its hash's expiry is refreshed by every sync, as before."""
    import nanolimit

    tier = make_tier(redis_server, "expiry", start=False)
    client = redis_server.client()
    try:
        tier.sync_now()
        wall = backend.FixedWindowCounter(1000, 600.0, storage=tier, rule="wallexp")  # the system clock
        clock = nanolimit.FakeClock(1000.0)
        fake = backend.FixedWindowCounter(1000, 600.0, storage=tier, rule="fakeexp", clock=clock)
        assert wall.allow("k").allowed and fake.allow("k").allowed
        tier.sync_now()
        now = time.time()
        window_end = (math.floor(now / 600.0) + 1) * 600.0

        def current(match: str, k: int) -> bytes:  # the window's hash, not the next one's claim
            (name,) = [n for n in client.scan_iter(match=match) if n.endswith(b":tt:%d" % k)]
            return bytes(name)

        made = current("*wallexp*", math.floor(now / 600.0))
        injected = current("*fakeexp*", 1)
        assert client.pttl(made) / 1000.0 >= window_end - now + 600.0 - 5.0
        assert client.pttl(injected) >= 3_590_000  # two windows, with the hour's floor
        client.pexpire(made, 120_000)
        client.pexpire(injected, 120_000)
        assert wall.allow("k").allowed and fake.allow("k").allowed
        tier.sync_now()
        assert 0 < client.pttl(made) <= 120_000  # written when it was made: kept
        assert client.pttl(injected) >= 3_590_000  # refreshed
        assert client.hget(made, "expiry") == b"2"  # the count still written
        client.delete(made)  # the server lost it: the next sync makes it, and its expiry, again
        assert wall.allow("k").allowed
        tier.sync_now()
        assert client.hget(made, "expiry") == b"3"
        assert client.pttl(made) / 1000.0 >= window_end - time.time() + 600.0 - 5.0
    finally:
        tier.close()
        for key in [*client.scan_iter(match="*wallexp*"), *client.scan_iter(match="*fakeexp*")]:
            client.delete(key)


def test_a_flushed_script_cache_costs_no_partition(redis_server: Any) -> None:
    """A server that lost its scripts (restart, failover, SCRIPT FLUSH) answers
    NOSCRIPT: the sync loads the script and sends again (the reconcile writes
    absolute values, so a second send counts nothing twice)."""
    import nanolimit

    tier = make_tier(redis_server, "solo", start=False)
    try:
        tier.sync_now()
        limiter = nanolimit.FixedWindowCounter(10, 60.0, storage=tier, clock=nanolimit.FakeClock(600.0))
        assert sum(limiter.allow("k").allowed for _ in range(4)) == 4
        redis_server.client().script_flush()
        assert tier.sync_now()
        metrics = tier.metrics()
        assert metrics["partitions"] == 0 and metrics["sync_failures"] == 0
        assert tier.fleet_counts(limiter.config, "k") == {10: 4}
        assert tier.sync_now() and tier.fleet_counts(limiter.config, "k") == {10: 4}
    finally:
        tier.close()


def test_fleet_on_a_cluster(backend: Any, redis_cluster: Any) -> None:
    """Two instances on a three-master cluster: keys hash to different nodes,
    the sync pipelines per node, leases split the limit as on one server, and
    a script cache flushed on every node is reloaded without a partition."""
    from nanolimit.storage.two_tier import TwoTierStorage

    clock = backend.FakeClock(8000.0)
    tiers = [
        TwoTierStorage(None, redis_cluster.client(), instance_id=name, sync_interval=SYNC, start=False)
        for name in ("a", "b")
    ]
    try:
        limiters = [backend.FixedWindowCounter(10, 1.0, storage=t, clock=clock) for t in tiers]
        for tier in (*tiers, *tiers):
            tier.sync_now()
        assert [t.instances for t in tiers] == [2, 2]
        keys = [f"user-{i}" for i in range(12)]
        for limiter in limiters:
            for key in keys:
                assert sum(limiter.allow(key).allowed for _ in range(7)) == 5  # ceil(10 / 2) each
        for tier in (*tiers, *tiers):
            tier.sync_now()
        for key in keys:
            assert tiers[0].fleet_counts(limiters[0].config, key) == {8000: 10}
            assert tiers[1].fleet_counts(limiters[1].config, key) == {8000: 10}
            assert not limiters[0].allow(key).allowed
        per_node = [server.client().dbsize() for server in redis_cluster.nodes]
        assert sum(1 for n in per_node if n) >= 2, per_node  # the keys really are spread
        for server in redis_cluster.nodes:
            server.client().script_flush()
        clock.advance(1.0)
        assert all(limiters[0].allow(key).allowed for key in keys)
        assert tiers[0].sync_now()
        assert tiers[0].metrics()["partitions"] == 0
        assert tiers[0].fleet_counts(limiters[0].config, keys[0])[8001] == 1
    finally:
        for tier in tiers:
            tier.close()


def test_closing_hands_back_the_lease(backend: Any, redis_server: Any) -> None:
    """An instance that leaves (close) sets its leases to zero on the way out,
    and its claims on the next window: the others may spend the whole
    remainder at their next sync, instead of waiting for the hashes to
    expire."""
    clock = backend.FakeClock(6000.0)
    a = make_tier(redis_server, "a", start=False)
    b = make_tier(redis_server, "b", start=False)
    try:
        lim_a = backend.FixedWindowCounter(100, 10.0, storage=a, clock=clock)
        lim_b = backend.FixedWindowCounter(100, 10.0, storage=b, clock=clock)
        for tier in (a, b, a):
            tier.sync_now()
        assert lim_a.allow("k").allowed
        a.sync_now()  # a: count 1, lease ceil(99 / 2) = 50
        assert lim_b.allow("k").allowed
        b.sync_now()  # b: counts 2, a's lease 50: lease ceil(48 / 2) = 24
        a.close()  # pushes, hands its 50 back, leaves the fleet
        b.sync_now()  # learns N = 1 (this sync still divided by 2)
        b.sync_now()  # counts 2, no other lease (a's would be 50 unreturned): lease 98
        assert b.instances == 1
        assert sum(lim_b.allow("k").allowed for _ in range(120)) == 98
        # a had claimed its share of the next window: handed back too
        [name] = redis_server.client().keys("*{k}*:601")
        assert redis_server.client().hget(name, "lease:a") == b"0"
    finally:
        a.close()
        b.close()


def test_forget_waits_for_the_sync_in_flight(backend: Any, redis_server: Any) -> None:
    """A reset during a sync's round trip: the sync carries the key's counts,
    so a delete sent first would be undone by them. The forget waits for the
    round trip and deletes after it, so no hash outlives the reset."""
    tier = make_tier(redis_server, "solo", start=False)
    entered, release = threading.Event(), threading.Event()
    exchange = tier._exchange

    def paused(*args: Any) -> Any:
        entered.set()
        release.wait(10)
        return exchange(*args)

    tier._exchange = paused  # type: ignore[method-assign]
    try:
        limiter = backend.FixedWindowCounter(10, 60.0, storage=tier, clock=backend.FakeClock(600.0))
        assert sum(limiter.allow("k").allowed for _ in range(3)) == 3
        sync = threading.Thread(target=tier.sync_now)
        sync.start()
        assert entered.wait(10)
        reset = threading.Thread(target=limiter.reset, args=("k",))
        reset.start()
        reset.join(0.3)
        assert reset.is_alive()  # held until the round trip is back
        release.set()
        sync.join(10)
        reset.join(10)
        assert not reset.is_alive() and not sync.is_alive()
        assert not list(redis_server.client().scan_iter(match="*}:tt:*"))
        assert limiter.state("k") is None
        assert sum(limiter.allow("k").allowed for _ in range(12)) == 10
    finally:
        release.set()
        tier.close()


@pytest.mark.parametrize("when", ["during", "after"])
def test_the_window_after_a_cut_instance_comes_back_holds_the_limit(
    backend: Any, own_server: Any, when: str
) -> None:
    """The hole behind another 334-of-300 window in the fleet test: the cut
    instance's first sync back is planned in window w, and its heartbeat
    makes it live to the others again. What it admits in w + 1 (blind while
    that round trip is in flight, or its default share after it) then has no
    field of its own there, and a live member is not reserved: the others
    leased all of w + 1 on top (150 of 100). That sync claims its share of
    w + 1, as every sync of a live instance does."""
    with _pair_with_a_cut(own_server, heartbeat_ttl=0.3, partition_grace=5.0) as (a, b, cut):
        cut_at = time.monotonic()
        cut()
        assert not b.sync_now() and b.partitioned
        _wait_out_heartbeat(b, cut_at)
        clock = backend.FakeClock(6_000.0)  # a window begun after b lapsed
        on_a = backend.FixedWindowCounter(100, 30.0, storage=a, clock=clock, rule="back")
        on_b = backend.FixedWindowCounter(100, 30.0, storage=b, clock=clock, rule="back")
        assert sum(on_b.allow("k").allowed for _ in range(60)) == 50  # its blind share
        assert _drain(on_a, a) == 50  # a reserves it
        cut(restore=True)
        late: list[int] = []
        exchange = b._exchange

        def crossing(*args: Any) -> Any:
            # the first sync back was planned in w; the next window begins
            # before its reply lands, and b, still blind, admits there
            clock.advance(30.0)
            late.append(sum(on_b.allow("k").allowed for _ in range(60)))
            return exchange(*args)

        if when == "during":
            b._exchange = crossing  # type: ignore[method-assign]
        assert b.sync_now() and not b.partitioned
        b._exchange = exchange  # type: ignore[method-assign]
        if when == "after":
            clock.advance(30.0)
            late.append(sum(on_b.allow("k").allowed for _ in range(60)))  # its default share
        assert late == [50]
        a.sync_now()  # a's heartbeat sees b live again: b is no longer reserved
        leased = _drain(on_a, a)
        b.sync_now()
        a.sync_now()
        assert leased == 50
        assert a.fleet_counts(on_a.config, "k")[6_030 // 30] == 100


def test_a_window_that_begins_before_a_cut_instance_lapses_holds_the_limit(
    backend: Any, own_server: Any
) -> None:
    """The hole behind a 334-of-300 window in the fleet test: an instance
    cut off before it claimed the next window is still live to the others
    when that window begins, so they lease all of it, and its blind share
    there would come on top (150 of 100). It admits nothing in a window that
    began before the others are sure to reserve its share, and its blind
    share in one that began after; a member the others' last heartbeat still
    saw live is reserved as soon as the server's clock passes its expiry."""
    with _pair_with_a_cut(own_server, heartbeat_ttl=2.0, partition_grace=5.0) as (a, b, cut):
        cut_at = time.monotonic()
        ttl = b.metrics()["heartbeat_ttl_last"]
        assert ttl >= 1.0  # no sync gap measured yet: four of (sync_interval + timeout)
        cut()
        assert not b.sync_now() and b.partitioned
        clock = backend.FakeClock(6_000.0)  # a fresh window, begun while b is live to a
        on_a = backend.FixedWindowCounter(100, 30.0, storage=a, clock=clock, rule="early")
        on_b = backend.FixedWindowCounter(100, 30.0, storage=b, clock=clock, rule="early")
        blind = sum(on_b.allow("k").allowed for _ in range(120))
        leased = _drain(on_a, a)
        assert time.monotonic() < cut_at + ttl, "too slow to drain before b lapsed"
        assert (a.instances, a.metrics()["silent_instances"]) == (2, 0)
        assert (blind, leased) == (0, 100)
        _wait_out_heartbeat(b, cut_at)
        clock.advance(30.0)  # a window begun after b lapsed
        blind = sum(on_b.allow("k").allowed for _ in range(120))
        # a's last heartbeat still saw b live; its reconcile reserves b's share
        # once the server's clock is past b's expiry all the same
        leased = _drain(on_a, a)
        assert (blind, leased) == (50, 50)


def test_no_decision_spends_a_lease_that_close_hands_back(backend: Any, redis_server: Any) -> None:
    """``close()`` hands every lease back with its last sync. A decision
    served while that round trip is in flight spent a lease Redis then gave
    to the others (a's 50 + b's 99 of 100 before), and one after close, in
    a new window, a default share nobody reserved; neither was ever pushed.
    Decisions end when close begins: they raise, and the fleet lands on L."""
    from nanolimit.errors import ValidationError

    clock = backend.FakeClock(9000.1)
    a = make_tier(redis_server, "leaving-a", start=False)
    b = make_tier(redis_server, "leaving-b", start=False)
    try:
        on_a = backend.FixedWindowCounter(100, 1.0, storage=a, clock=clock, rule="leave")
        on_b = backend.FixedWindowCounter(100, 1.0, storage=b, clock=clock, rule="leave")
        assert on_a.allow("k").allowed and on_b.allow("k").allowed
        for tier in (a, b, a, b):
            assert tier.sync_now()  # each: 1 admitted, a lease of 49 held for it
        refused: list[Exception] = []
        leaked = []
        exchange = a._exchange

        def in_flight(*args: Any) -> Any:
            if a._leaving:  # close()'s last round trip: requests keep coming
                for _ in range(60):
                    try:
                        leaked.append(on_a.allow("k").allowed)
                    except ValidationError as error:
                        refused.append(error)
            return exchange(*args)

        a._exchange = in_flight
        a.close()
        assert leaked == [] and len(refused) == 60 and "is closed" in str(refused[0])
        assert a.fleet_counts(on_a.config, "k")[9000] == 2  # b's 1 and a's: all a admitted was pushed
        admitted_b = 1
        for _ in range(4):
            b.sync_now()
            admitted_b += sum(on_b.allow("k").allowed for _ in range(200))
        assert 1 + admitted_b == 100  # before: a spent 49-50 in close's round trip, b its lease too
        clock.set(9001.1)
        with pytest.raises(ValidationError, match="is closed"):
            on_a.allow("k")  # a new window: no share to spend, nothing would push it
        with pytest.raises(ValidationError, match="is closed"):
            on_a.refund("k")
    finally:
        a.close()
        b.close()


def test_a_window_claimed_before_a_member_left_is_spent_at_its_claim(backend: Any, redis_server: Any) -> None:
    """Three members claim 100 each of the next window (L=300). One leaves;
    the others' share becomes 150, but Redis still holds 100 for each of
    them there. Before their first sync of that window they admit what they
    claimed, not the new share (150 each, then a lease computed around the
    other's 100: 325 before), so the fleet lands on L in every window."""
    clock = backend.FakeClock(5000.2)
    tiers = {name: make_tier(redis_server, f"shrink-{name}", start=False) for name in "abc"}
    try:
        limiters = {
            name: backend.FixedWindowCounter(300, 1.0, storage=tier, clock=clock, rule="shrink")
            for name, tier in tiers.items()
        }
        for tier in [*tiers.values()] * 2:
            assert tier.sync_now()
        for name in "abc":
            assert limiters[name].allow("k").allowed
        for tier in tiers.values():
            assert tier.sync_now()  # each claims its 100 of window 5001
        tiers["c"].close()
        for name in "ab":
            assert tiers[name].sync_now()
            assert tiers[name].instances == 2 and tiers[name]._share(300) == 150
        clock.set(5001.1)
        first = {name: sum(limiters[name].allow("k").allowed for _ in range(400)) for name in "ab"}
        assert first == {"a": 100, "b": 100}  # the claims, before any sync of the window
        total = sum(first.values())
        for _ in range(4):
            for name in "ab":
                assert tiers[name].sync_now()
                total += sum(limiters[name].allow("k").allowed for _ in range(400))
        assert total == 300
    finally:
        for tier in tiers.values():
            tier.close()
