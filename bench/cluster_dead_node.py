"""A cluster master SIGKILLed: what a dead node costs (docs/redis.md,
"Cluster failures"). Medians and ratios from one run, printed; not a timed test.

    PYTHONPATH=src python bench/cluster_dead_node.py [--kind redis|valkey] [--seconds 2]

A 3-master loopback cluster (``cluster-require-full-coverage no``, node
timeout 2 s), one RedisStorage (timeout 50 ms, breaker threshold 5,
cooldown 1 s, ``on_error="allow"``) and a single thread deciding keys
round-robin over all three masters. It prints:

- the healthy decision rate, and the rate of the live masters' keys;
- the same with master 0 SIGKILLed (measured after its breaker opened);
- p50/p99/max of every decision in the first 4 s after the kill (the
  window before and while the cluster marks the node failed);
- the median decision for a dead node's key once its breaker is open.

It uses only the public API plus ``metrics()``, so the same script measures
an older checkout too (``PYTHONPATH=<old>/src``).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_servers import Cluster, require_binary

from nanolimit import FakeClock, reference
from nanolimit.storage.redis import RedisStorage

Keys = list[tuple[str, bool]]  # (key, on a live master)


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _run(limiter: Any, keys: Keys, seconds: float) -> tuple[int, int, list[float]]:
    """Decisions made in ``seconds`` (whole rounds over ``keys``): all,
    the live masters' ones, and each one's time, in order."""
    n = live = 0
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for key, is_live in keys:
            t = time.perf_counter()
            limiter.allow(key)
            times.append(time.perf_counter() - t)
            n += 1
            live += is_live
    return n, live, times


def _rates(limiter: Any, keys: Keys, seconds: float) -> tuple[float, float, list[float]]:
    """Median rates (all decisions, the live masters' keys) over 0.25 s slices."""
    slices = [_run(limiter, keys, 0.25) for _ in range(max(1, int(seconds / 0.25)))]
    times = [t for _, _, ts in slices for t in ts]
    return statistics.median(s[0] * 4 for s in slices), statistics.median(s[1] * 4 for s in slices), times


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--kind", default="redis", choices=("redis", "valkey"))
    parser.add_argument("--seconds", type=float, default=2.0)
    args = parser.parse_args()
    cluster = Cluster(require_binary(args.kind), args.kind)
    for node in cluster.nodes:
        node.extra = (*node.extra, "--cluster-require-full-coverage", "no")
    cluster.start()
    try:
        client = cluster.client()
        storage = RedisStorage(
            client, timeout=0.05, on_error="allow", breaker_threshold=5, breaker_cooldown=1.0
        )
        clock = FakeClock(1e6)
        limiter = reference.FixedWindowCounter(10**9, 3600.0, storage=storage, clock=clock, rule="b")
        dead_port = cluster.nodes[0].port
        by_port: dict[int, list[str]] = {}
        for i in range(200):
            rkey = storage.redis_key(limiter.config, f"k{i}")
            by_port.setdefault(int(client.get_node_from_key(rkey).port), []).append(f"k{i}")
        grouped = [(k, n.port != dead_port) for n in cluster.nodes for k in by_port[n.port][:4]]
        keys = [grouped[i] for j in range(4) for i in range(j, len(grouped), 4)]  # the masters in turn
        _run(limiter, keys, 1.0)  # warm: connections, scripts
        healthy, healthy_live, healthy_times = _rates(limiter, keys, args.seconds)
        cluster.nodes[0].kill()
        killed = time.perf_counter()
        outage: list[float] = []
        while time.perf_counter() - killed < 4.0:
            outage += _run(limiter, keys, 0.25)[2]
        dead_rate, dead_live, times = _rates(limiter, keys, args.seconds)
        cycle = keys * (len(times) // len(keys) + 1)
        dead_times = [t for t, (_, is_live) in zip(times, cycle) if not is_live]
        m = storage.metrics()
        print(f"server: {args.kind}; {len(keys)} keys over 3 masters, in turn; one thread")
        print(f"healthy: {healthy:,.0f} decisions/s, live masters' keys {healthy_live:,.0f}/s")
        print(
            f"healthy, every decision: p50 {_pct(healthy_times, 0.5) * 1e3:.3f} ms, "
            f"p99 {_pct(healthy_times, 0.99) * 1e3:.3f} ms, max {max(healthy_times) * 1e3:.1f} ms"
        )
        print(f"one master dead: {dead_rate:,.0f} decisions/s, live masters' keys {dead_live:,.0f}/s")
        print(f"live masters' keys' rate, dead/healthy (0.25 s slices): {dead_live / healthy_live:.2f}x")
        hcycle = keys * (len(healthy_times) // len(keys) + 1)
        live_before = statistics.median(t for t, (_, ok) in zip(healthy_times, hcycle) if ok)
        live_after = statistics.median(t for t, (_, ok) in zip(times, cycle) if ok)
        print(
            f"a live master's key, median decision: healthy {live_before * 1e6:.0f} us, one master dead "
            f"{live_after * 1e6:.0f} us: rate ratio {live_before / live_after:.2f}x"
        )
        print(
            f"first 4 s after the kill, every decision: p50 {_pct(outage, 0.5) * 1e3:.3f} ms, "
            f"p99 {_pct(outage, 0.99) * 1e3:.3f} ms, max {max(outage) * 1e3:.1f} ms "
            f"({len(outage):,} decisions)"
        )
        print(
            f"dead node's key, after 4 s (breaker open): median {statistics.median(dead_times) * 1e6:.1f} us"
        )
        node = m.get("nodes", {}).get(f"127.0.0.1:{dead_port}", {})
        state = node.get("breaker_state", m["breaker_state"])
        print(f"metrics: breaker_state {m['breaker_state']}, dead node's {state}, errors {m['errors']}")
        storage.close()
        client.close()
    finally:
        cluster.stop()


if __name__ == "__main__":
    main()
