"""The background sync's cadence and the metrics that say how far behind it
is (docs/two_tier.md, Metrics): syncs start every ``sync_interval`` start to
start, and ``metrics()`` reports the achieved period and the ``I`` that the
error bound's ``r · I`` term then uses."""

from __future__ import annotations

import time
from typing import Any

from tcp_proxy import TcpProxy

import nanolimit
from nanolimit.storage.two_tier import TwoTierStorage

pytest_plugins = ["redis_servers"]  # the server fixtures

INTERVAL = 0.05


def test_syncs_start_every_interval_and_the_lag_metrics_agree(redis_server: Any) -> None:
    tier = TwoTierStorage(None, redis_server.client(), sync_interval=INTERVAL, instance_id="cadence")
    try:
        limiter = nanolimit.FixedWindowCounter(1_000_000, 60.0, tier)
        keys = [f"k{i}" for i in range(20)]
        before = tier.metrics()["syncs"]
        start = time.monotonic()
        while time.monotonic() - start < 1.0:
            for key in keys:
                assert limiter.allow(key).allowed
            time.sleep(0.002)
        elapsed = time.monotonic() - start
        m = tier.metrics()
    finally:
        tier.close()
    syncs = m["syncs"] - before
    # asked 20 per second; a sync waiting a whole interval after the last one
    # ended (the old loop) managed ~12 with a loaded host
    assert syncs >= 15 * elapsed - 1, syncs
    assert 0 < m["sync_period_p50"] <= 1.5 * INTERVAL, m["sync_period_p50"]
    assert m["sync_period_last"] > 0
    assert 0 < m["sync_duration_last"] < m["sync_period_p50"] + INTERVAL
    assert m["sync_behind"] >= 0
    assert m["sync_interval_effective"] >= max(INTERVAL, m["sync_period_p50"])
    assert 0 < m["keys_per_sync"] <= len(keys)


def test_a_sync_that_overruns_starts_the_next_at_once_and_reports_it(redis_server: Any) -> None:
    """Each sync behind a link that adds 2 intervals to its round trip: the
    next starts right after it (no idle wait, no backlog), and the metrics
    show the stretched period, the lateness and the effective interval."""
    import redis

    slow_link = TcpProxy(redis_server.port, delay=2 * INTERVAL)
    tier = TwoTierStorage(
        None,
        redis.Redis(host="127.0.0.1", port=slow_link.port),
        sync_interval=INTERVAL,
        instance_id="overrun",
        timeout=1.0,
    )
    try:
        nanolimit.FixedWindowCounter(10, 60.0, tier).allow("k")
        time.sleep(0.7)
        m = tier.metrics()
    finally:
        tier.close()
        slow_link.close()
    assert m["syncs"] >= 4, m
    # back to back: one round trip (2 intervals) each, not a round trip plus an interval
    assert 2 * INTERVAL <= m["sync_period_p50"] < 3 * INTERVAL, m
    assert m["sync_duration_last"] >= 2 * INTERVAL
    assert m["sync_behind"] > 0  # due one interval after its start, it started later
    assert m["sync_interval_effective"] >= m["sync_period_p50"] > INTERVAL
