"""Is it the machine or the code? The two targets of issue 4 that depend on
memory, set against what this machine's memory allows, measured in the same
minutes.

- ``allow()`` over 1,000,000 keys (≤ 200 ns): a key's state cannot all stay
  in cache at that size, so a call costs at least an in-cache call (a hot
  key) plus one miss to memory (a dependent load over 64 MiB, timed by
  ``memory_latency.c``). If that floor is over the target, no table layout
  meets it here.
- ``allow_many`` over 100,000 keys (≤ 25 ns): its floor is the same batch
  with the table in cache (1,000 keys); what the 100,000-key batch adds is
  the misses its prefetching did not hide.

Usage: python bench/floors.py [--json] [--rounds N] [--keys N] [--batch-keys N]
(needs a C compiler, ``cc``, for the miss timing).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import nanolimit

LOOP = 1000  # calls per timed loop of allow()
HUGE = 1 << 30  # a limit no benchmark reaches: every decision is an allowed one
MILLION_TARGET_NS = 200.0
BATCH_TARGET_NS = 25.0
CACHED_KEYS = 1000
MISS_MIB = 64
HERE = os.path.dirname(os.path.abspath(__file__))


def miss_timer(scratch: str, mib: int = MISS_MIB) -> Callable[[], float]:
    """A timer of one miss to memory: ns per dependent load over ``mib`` MiB,
    from ``memory_latency.c`` built into ``scratch``."""
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise SystemExit("floors.py needs a C compiler (cc) to time a miss to memory")
    program = os.path.join(scratch, "memory_latency")
    subprocess.run([compiler, "-O2", os.path.join(HERE, "memory_latency.c"), "-o", program], check=True)

    def once() -> float:
        out = subprocess.run([program, str(mib)], check=True, capture_output=True, text=True).stdout
        return float(out)

    return once


def allow_loop(limiter: nanolimit.RateLimiter, keys: list[str]) -> Callable[[], float]:
    """A timer of ``allow`` over ``keys`` round-robin, ``LOOP`` calls a time:
    ns per call."""
    allow = limiter.allow
    chunks = [keys[i : i + LOOP] for i in range(0, len(keys), LOOP)]
    cursor = [0]

    def once() -> float:
        chunk = chunks[cursor[0]]
        cursor[0] = (cursor[0] + 1) % len(chunks)
        t0 = time.perf_counter_ns()
        for k in chunk:
            allow(k)
        return (time.perf_counter_ns() - t0) / len(chunk)

    return once


def batch_loop(limiter: nanolimit.RateLimiter, keys: list[str], decisions: int) -> Callable[[], float]:
    """A timer of ``allow_many`` over ``decisions`` requests drawn round-robin
    from ``keys``: ns per decision."""
    batch = (keys * (decisions // len(keys) + 1))[:decisions]
    many = limiter.allow_many

    def once() -> float:
        t0 = time.perf_counter_ns()
        many(batch)
        return (time.perf_counter_ns() - t0) / len(batch)

    return once


def limiter_over(keys: list[str]) -> nanolimit.RateLimiter:
    storage = nanolimit.InMemoryStorage()
    limiter = nanolimit.TokenBucket(HUGE, 1.0, storage=storage, clock=nanolimit.SystemClock())
    limiter.allow_many(keys)  # every key stored before timing
    return limiter


def measure(rounds: int, keys: int, batch_keys: int, scratch: str) -> dict[str, Any]:
    """Medians over ``rounds`` rounds. Each round runs every timer for a
    block of calls, the first fifth of it untimed: back to back, as a
    workload runs (one call after another of another workload would
    evict its caches), yet every timer still sees the same minutes of a
    noisy machine."""
    million = [f"user:{i}" for i in range(keys)]
    many = [f"user:{i}" for i in range(batch_keys)]
    cached = many[:CACHED_KEYS]
    timers = {  # name: (timer, calls per block)
        "hot_key": (allow_loop(limiter_over(cached[:1]), cached[:1] * LOOP), 100),
        "million": (allow_loop(limiter_over(million), million), 100),
        "batch_cached": (batch_loop(limiter_over(cached), cached, batch_keys), 10),
        "batch_table": (batch_loop(limiter_over(many), many, batch_keys), 10),
        "miss": (miss_timer(scratch), 1),
    }
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, (once, block) in timers.items():
            for i in range(block):
                ns = once()
                if i >= block // 5:  # a block of 1 is timed
                    samples[name].append(ns)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    million_floor = medians["hot_key"] + medians["miss"]
    return {
        "implementation": nanolimit.IMPLEMENTATION,
        "keys": keys,
        "batch_keys": batch_keys,
        "rounds": rounds,
        "ns": {name: round(value, 1) for name, value in medians.items()},
        "million": {
            "target": MILLION_TARGET_NS,
            "measured": round(medians["million"], 1),
            "floor": round(million_floor, 1),
            "floor_under_target": million_floor <= MILLION_TARGET_NS,
        },
        "allow_many": {
            "target": BATCH_TARGET_NS,
            "measured": round(medians["batch_table"], 1),
            "floor": round(medians["batch_cached"], 1),
            "unhidden_misses": round(medians["batch_table"] - medians["batch_cached"], 1),
            "headroom": round(BATCH_TARGET_NS - medians["batch_cached"], 1),
        },
    }


def report(r: dict[str, Any]) -> str:
    ns, m, b = r["ns"], r["million"], r["allow_many"]
    return "\n".join(
        [
            f"nanolimit {r['implementation']}, medians over {r['rounds']} rounds, ns per decision",
            "",
            f"allow() over {r['keys']:,} keys: target {m['target']:.0f}, measured {m['measured']}",
            f"  floor {m['floor']} = a hot-key call {ns['hot_key']}"
            f" + one miss over {MISS_MIB} MiB {ns['miss']}",
            "  "
            + (
                "the floor is under the target: a table whose state costs one miss could meet it here"
                if m["floor_under_target"]
                else "the floor is over the target: no table layout meets it here"
            ),
            "",
            f"allow_many over {r['batch_keys']:,} keys: target {b['target']:.0f}, measured {b['measured']}",
            f"  floor {b['floor']} = the same batch with the table in cache ({CACHED_KEYS:,} keys)",
            f"  misses left unhidden {b['unhidden_misses']}, room under the target {b['headroom']}",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print the figures as JSON")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of every timer (default 5)")
    parser.add_argument("--keys", type=int, default=1_000_000, help="keys for allow() (default 1,000,000)")
    parser.add_argument("--batch-keys", type=int, default=100_000, help="keys for allow_many (100,000)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.keys < LOOP or args.batch_keys < CACHED_KEYS:
        parser.error(f"--rounds >= 1, --keys >= {LOOP}, --batch-keys >= {CACHED_KEYS}")
    with tempfile.TemporaryDirectory() as scratch:
        result = measure(args.rounds, args.keys, args.batch_keys, scratch)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
