"""Does the background sync keep its interval as the keys per interval grow,
and does any decision wait on it?

One ``TwoTierStorage`` (``sync_interval`` 0.05 unless told) against a
loopback redis-server this script starts on 127.0.0.1, a native
``FixedWindowCounter`` of a limit never reached; a decision thread decides
N distinct keys every interval (paced: it sleeps the rest of each interval)
for ``--seconds``. Reported per N: syncs per second achieved (asked:
1 / interval), the sync's wall time (median, max), µs of sync per key
synced, µs of sync wall time per decided key (the run's sync time over
its decisions), the median keys per sync and spread (docs/two_tier.md,
Keeping the interval), ``allow()`` p99.99 and max, and the calls over 1 ms.
Only the syncs that ran while the decision thread did are counted (not the
final sync ``close()`` makes). Each size also runs the same paced loop on an
``InMemoryStorage`` (no sync, no Redis): its ``allow()`` max and calls over
1 ms are the host's own floor (a shared VM's preemptions), the row to read
the two-tier tail against.
``--compare`` runs each size with spread syncs off too (every key, every
sync), ``--rounds`` times, interleaved.

    PYTHONPATH=src python bench/two_tier_sync.py [--keys 1000,10000,50000] [--algorithm SlidingWindowCounter]

``--vs-memory N``: instead, ``allow()`` back to back over N keys (rounds of
every key, the sync thread running) on the two-tier storage and on an
``InMemoryStorage``, their rounds interleaved: the median ns per call over
the rounds, and the median of the rounds' ratios.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from redis_servers import Server, require_binary

import nanolimit
from nanolimit.storage.two_tier import MAX_SPREAD, TwoTierStorage
from nanolimit.storage.two_tier import _sync as _sync_module


def _decide(limiter: Any, keys: list[str], interval: float, until: float, out: list[int]) -> None:
    clock = time.perf_counter_ns
    allow = limiter.allow
    nxt = time.monotonic()
    while time.monotonic() < until:
        for key in keys:
            t0 = clock()
            allow(key)
            out.append(clock() - t0)
        nxt += interval
        pause = nxt - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        else:
            nxt = time.monotonic()  # behind: decide the next round at once


def run(
    server: Server,
    n: int,
    interval: float,
    seconds: float,
    algorithm: str = "FixedWindowCounter",
    window: float = 3600.0,
) -> dict[str, float]:
    tier = TwoTierStorage(None, server.client(), sync_interval=interval, instance_id=f"bench-sync-{n}")
    walls: list[tuple[float, int]] = []
    spreads: list[int] = []
    sync = tier._sync
    counting = [True]  # off once the decisions end: close()'s final sync is no part of the run

    def timed(full: bool, background: bool = False) -> bool:  # the bench's probe of each sync's wall time
        t0 = time.perf_counter()
        ok = sync(full, background)
        if counting[0]:
            walls.append((time.perf_counter() - t0, tier._stats["keys_synced_last"]))
            spreads.append(tier._stats["sync_spread"])
        return ok

    tier._sync = timed  # type: ignore[method-assign]
    try:
        # an hour's window unless told: --window 1 puts a rollover of every
        # key (its settling syncs send two windows) in each second of the run
        if algorithm == "TokenBucket":  # capacity / rate: the window it is enforced over
            limiter = nanolimit.TokenBucket(1 << 30, (1 << 30) / window, tier)
        else:
            limiter = getattr(nanolimit, algorithm)(1 << 30, window, tier)
        keys = [f"k:{n}:{i}" for i in range(n)]
        for key in keys:  # every key tracked and leased before the run
            limiter.allow(key)
        tier.sync_now()
        time.sleep(2 * interval)
        walls.clear()
        spreads.clear()
        before = tier.metrics()["syncs"]
        lat: list[int] = []
        start = time.monotonic()
        worker = threading.Thread(target=_decide, args=(limiter, keys, interval, start + seconds, lat))
        worker.start()
        worker.join()
        counting[0] = False
        elapsed = time.monotonic() - start
        syncs = tier.metrics()["syncs"] - before
        metrics = tier.metrics()
    finally:
        tier.close()
    wall = [w for w, _ in walls] or [0.0]
    per_key = [w / k for w, k in walls if k] or [0.0]
    out = {
        "keys": n,
        "syncs_per_s": syncs / elapsed,
        "asked_per_s": 1 / interval,
        "sync_wall_ms_median": statistics.median(wall) * 1e3,
        "sync_wall_ms_max": max(wall) * 1e3,
        "us_per_key_synced": statistics.median(per_key) * 1e6,
        # the sync's wall time over the run, per decision the run made
        "us_per_decided_key": sum(w for w, _ in walls) / max(1, len(lat)) * 1e6,
        "keys_per_sync_median": statistics.median(k for _, k in walls) if walls else 0,
        "spread_median": statistics.median(spreads) if spreads else 1,
        **_tail(lat),
    }
    for name in ("sync_period_p50", "sync_behind", "sync_interval_effective"):
        if name in metrics:
            out[name + "_ms"] = metrics[name] * 1e3
    return out


def floor(n: int, interval: float, seconds: float) -> dict[str, float]:
    """The same paced decisions on an ``InMemoryStorage``: what this host's
    scheduler alone does to ``allow()``'s tail, with no sync and no Redis."""
    limiter = nanolimit.FixedWindowCounter(1 << 30, 3600.0, nanolimit.InMemoryStorage())
    keys = [f"f:{n}:{i}" for i in range(n)]
    for key in keys:
        limiter.allow(key)
    lat: list[int] = []
    worker = threading.Thread(target=_decide, args=(limiter, keys, interval, time.monotonic() + seconds, lat))
    worker.start()
    worker.join()
    return _tail(lat)


def _tail(lat: list[int]) -> dict[str, float]:
    """``allow()``'s p99.99, max and calls over 1 ms, from ns latencies."""
    lat.sort()
    return {
        "allow_p9999_us": lat[min(len(lat) - 1, int(len(lat) * 0.9999))] / 1e3,
        "allow_max_ms": lat[-1] / 1e6,
        "calls_over_1ms": sum(1 for v in lat if v > 1_000_000),
        "calls": len(lat),
    }


def vs_memory(server: Server, n: int, interval: float, rounds: int = 30) -> None:
    keys = [f"m:{i}" for i in range(n)]
    tier = TwoTierStorage(None, server.client(), sync_interval=interval, instance_id="bench-vs-memory")
    try:
        allows = {}
        for name, storage in (("InMemoryStorage", nanolimit.InMemoryStorage()), ("TwoTierStorage", tier)):
            allow = nanolimit.FixedWindowCounter(1 << 30, 60.0, storage).allow
            for key in keys:  # tracked (and leased) before the timing
                allow(key)
            allows[name] = allow
        tier.sync_now()
        # interleaved rounds: a noisy neighbour slows both storages alike
        per_round: dict[str, list[float]] = {name: [] for name in allows}
        for _ in range(rounds):
            for name, allow in allows.items():
                t0 = time.perf_counter_ns()
                for key in keys:
                    allow(key)
                per_round[name].append((time.perf_counter_ns() - t0) / n)
        results = {name: statistics.median(v) for name, v in per_round.items()}
        ratios = [t / m for m, t in zip(per_round["InMemoryStorage"], per_round["TwoTierStorage"])]
        print("| keys | InMemoryStorage | TwoTierStorage | ratio (median of rounds) |")
        print("| ---: | ---: | ---: | ---: |")
        mem, two = results["InMemoryStorage"], results["TwoTierStorage"]
        print(f"| {n:,} | {mem:.0f} ns | {two:.0f} ns | {statistics.median(ratios):.2f}x |")
    finally:
        tier.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", default="1000,10000,50000")
    parser.add_argument("--interval", type=float, default=0.05)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--window", type=float, default=3600.0, help="the limiter's window, seconds")
    parser.add_argument("--vs-memory", type=int, default=0, metavar="N")
    parser.add_argument(
        "--rounds", type=int, default=1, help="rounds, spread and not (--compare) interleaved in each"
    )
    parser.add_argument("--compare", action="store_true", help="each size also with spread syncs off")
    parser.add_argument(
        "--algorithm",
        default="FixedWindowCounter",
        choices=("FixedWindowCounter", "SlidingWindowCounter", "TokenBucket"),
        help="the limiter decided on (the floor row stays a fixed window in memory)",
    )
    args = parser.parse_args()
    server = Server(require_binary("redis"), "redis")
    server.start()
    if args.vs_memory:
        try:
            vs_memory(server, args.vs_memory, args.interval)
        finally:
            server.stop()
        return
    try:
        print(
            "| keys | syncs/s (asked) | sync wall median / max | keys per sync (spread) | µs per key synced "
            "| µs of sync per decided key | allow() p99.99 | allow() max | calls > 1 ms |"
        )
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        variants = [True, False] if args.compare else [True]
        sizes = [int(v) for v in args.keys.split(",")]
        for n, spread in ((n, s) for _ in range(args.rounds) for n in sizes for s in variants):
            _sync_module.MAX_SPREAD = MAX_SPREAD if spread else 1  # off: every key, every sync
            r = run(server, n, args.interval, args.seconds, args.algorithm, args.window)
            label = "" if not args.compare else (" spread" if spread else " every key")
            print(
                f"| {n:,}{label} | {r['syncs_per_s']:.1f} ({r['asked_per_s']:.0f}) "
                f"| {r['sync_wall_ms_median']:.1f} / {r['sync_wall_ms_max']:.1f} ms "
                f"| {r['keys_per_sync_median']:,.0f} ({r['spread_median']:.0f}) "
                f"| {r['us_per_key_synced']:.1f} | {r['us_per_decided_key']:.2f} "
                f"| {r['allow_p9999_us']:.0f} µs "
                f"| {r['allow_max_ms']:.2f} ms | {r['calls_over_1ms']} of {r['calls']:,} |",
                flush=True,
            )
            extra = {k: round(v, 1) for k, v in r.items() if k.endswith("_ms") and k.startswith("sync_")}
            if extra:
                print(f"<!-- {extra} -->", flush=True)
            if spread:
                f = floor(n, args.interval, args.seconds)
                print(
                    f"| {n:,} InMemoryStorage (the host's floor) | | | | | "
                    f"| {f['allow_p9999_us']:.0f} µs | {f['allow_max_ms']:.2f} ms "
                    f"| {f['calls_over_1ms']} of {f['calls']:,} |",
                    flush=True,
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
