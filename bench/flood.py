"""Key-flood soak: 10,000,000 distinct keys into a bounded native storage.

Prints resident memory before, during and after, throughput per million
keys, and whether an active key kept its debt throughout. Figures go to
docs/reliability.md. Usage: python bench/flood.py [total_keys] [max_keys]
"""

from __future__ import annotations

import resource
import sys
import time

import nanolimit
from nanolimit import FakeClock


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def main() -> int:
    total = int(sys.argv[1]) if len(sys.argv) > 1 else 10_000_000
    max_keys = int(sys.argv[2]) if len(sys.argv) > 2 else 100_000
    clock = FakeClock(1_000_000.0)
    storage = nanolimit.InMemoryStorage(max_keys=max_keys)
    limiter = nanolimit.TokenBucket(10, 3600.0, storage, clock, rule="flood")
    assert limiter.allow("victim", 10).allowed
    batch = 100_000
    print(f"implementation={nanolimit.IMPLEMENTATION} total={total:,} max_keys={max_keys:,}")
    print(f"rss before: {rss_mib():.1f} MiB")
    victim_refilled = 0
    rates = []
    for start in range(0, total, batch):
        keys = [f"flood-{i}" for i in range(start, start + batch)]
        clock.advance(0.001)
        t0 = time.perf_counter()
        limiter.allow_many(keys)
        rates.append(batch / (time.perf_counter() - t0))
        victim_refilled += limiter.allow("victim").allowed
        if (start + batch) % 1_000_000 == 0:
            print(
                f"{(start + batch) / 1e6:4.0f} M keys: rss {rss_mib():7.1f} MiB, len {len(storage):,}, "
                f"{rates[-1] / 1e6:5.2f} M decisions/s, storage {storage.memory_bytes() / 2**20:.1f} MiB"
            )
    print(f"rss after: {rss_mib():.1f} MiB; stats {storage.stats()}")
    print(f"victim got budget back {victim_refilled} times (must be 0)")
    first, last = sum(rates[:10]) / 10 / 1e6, sum(rates[-10:]) / 10 / 1e6
    print(f"throughput: first million {first:.2f} M/s, last million {last:.2f} M/s")
    return 1 if victim_refilled else 0


if __name__ == "__main__":
    sys.exit(main())
