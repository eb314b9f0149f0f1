"""What a zone's size costs a working set smaller than it (one process).

The in-memory table grows with its keys; a zone is laid out for ``max_keys``
when it is made. A working set of ``--keys`` keys in a zone sized for many
more spreads over more memory (index slots and arena chunks), so more of its
decisions miss the caches and the TLB. This measures ``allow()`` round-robin
over the working set in ``InMemoryStorage`` and in zones of several sizes,
their rounds interleaved, and prints the medians and the ratio to in-memory.

Usage: ``PYTHONPATH=src python bench/zone_sizing.py [--keys 10000] [--rounds 31]
[--sizes 10000,13000,20000,110000,1000000]``.

A zone of exactly ``--keys`` keys evicts: each of its stripes holds
``max_keys / stripes`` and the hash does not split the keys that evenly, so
the evictions per round are printed too.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from nanolimit import _core


def round_ns(limiter: object, keys: list[str], passes: int) -> float:
    allow = limiter.allow  # type: ignore[attr-defined]
    start = time.perf_counter_ns()
    for _ in range(passes):
        for key in keys:
            allow(key)
    return (time.perf_counter_ns() - start) / (passes * len(keys))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--keys", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=31)
    parser.add_argument("--passes", type=int, default=20)
    parser.add_argument("--sizes", default="10000,13000,20000,110000,1000000")
    args = parser.parse_args()
    keys = [f"user:{i}" for i in range(args.keys)]
    subjects: dict[str, object] = {
        "memory": _core.TokenBucket(1 << 30, 1e6, _core.InMemoryStorage(), rule="r")
    }
    zones: list[_core.SharedMemoryStorage] = []
    for size in (int(s) for s in args.sizes.split(",")):
        zone = _core.SharedMemoryStorage(f"nlsizing-{os.getpid()}-{size}", max_keys=max(size, args.keys))
        zones.append(zone)
        subjects[f"zone {size:,}"] = _core.TokenBucket(1 << 30, 1e6, zone, rule="r")
    for limiter in subjects.values():
        round_ns(limiter, keys, 2)  # every key stored, caches warm
    times: dict[str, list[float]] = {name: [] for name in subjects}
    evicted_before = [_evicted(zone) for zone in zones]
    try:
        for _ in range(args.rounds):
            for name, limiter in subjects.items():
                times[name].append(round_ns(limiter, keys, args.passes))
        passes = args.rounds * args.passes
        evicted = [(_evicted(z) - b) / passes for z, b in zip(zones, evicted_before, strict=True)]
    finally:
        for zone in zones:
            zone.unlink()
    print(f"allow(), {args.keys:,} keys round-robin, token bucket, medians of {args.rounds} rounds")
    for index, (name, values) in enumerate(times.items()):
        median = statistics.median(values)
        paired = statistics.median(v / m for v, m in zip(values, times["memory"], strict=True))
        churn = f", {evicted[index - 1]:,.0f} evictions a pass" if index else ""
        print(f"{name:>16}: {median:7.1f} ns  ({paired:.2f}x in-memory, paired{churn})")


def _evicted(zone: _core.SharedMemoryStorage) -> int:
    stats = zone.stats()
    return int(stats["evicted_at_rest"] + stats["evicted_active"] + stats["evicted_idle"])


if __name__ == "__main__":
    main()
