"""Is it the machine or the code? The two targets that depend on
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
from collections.abc import Callable
from typing import Any

import nanolimit
from nanolimit.cli import bench as engine

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


def cell_timer(cell: engine.Prepared) -> Callable[[], float]:
    """A timer of one of ``nanolimit bench``'s cells: ns per decision."""
    return lambda: engine._timed(cell) / cell.decisions


# the token bucket of ``nanolimit bench``: its limits, its SystemClock
make_token_bucket = engine._nanolimit_makers("nanolimit")()["token_bucket"]


def stored(keys: list[str]) -> engine.Subject:
    subject = make_token_bucket(engine.HIGH_LIMIT, engine.HIGH_WINDOW)
    engine._prefill(subject, keys)  # every key stored before timing
    return subject


def batch_cell(keys: list[str], decisions: int) -> engine.Prepared:
    """``allow_many`` over ``decisions`` requests drawn round-robin from ``keys``."""
    many = stored(keys).allow_many
    assert many is not None
    batch = (keys * (decisions // len(keys) + 1))[:decisions]
    return engine.Prepared(many, lambda: (batch,), decisions)


def measure(rounds: int, keys: int, batch_keys: int, scratch: str) -> dict[str, Any]:
    """Medians over ``rounds`` rounds. Each round runs every timer for a
    block of calls, the first fifth of it untimed: back to back, as a
    workload runs (one call after another of another workload would
    evict its caches), yet every timer still sees the same minutes of a
    noisy machine."""
    million = engine.key_list(keys)
    many = engine.key_list(batch_keys)
    cells = {
        "hot_key": engine._hot_cell("hot_allowed", make_token_bucket, engine.BATCH),
        "million": engine._round_robin(stored(million), million, engine._nothing),
        "batch_cached": batch_cell(many[:CACHED_KEYS], batch_keys),
        "batch_table": batch_cell(many, batch_keys),
    }
    timers = {  # name: (timer, calls per block)
        "hot_key": (cell_timer(cells["hot_key"]), 100),
        "million": (cell_timer(cells["million"]), 100),
        "batch_cached": (cell_timer(cells["batch_cached"]), 10),
        "batch_table": (cell_timer(cells["batch_table"]), 10),
        "miss": (miss_timer(scratch), 1),
    }
    samples: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name, (once, block) in timers.items():
            for i in range(block):
                ns = once()
                if i >= block // 5:  # a block of 1 is timed
                    samples[name].append(ns)
    for cell in cells.values():
        cell.check()  # still the decisions each figure is about (allowed ones)
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
    if args.rounds < 1 or args.keys < engine.BATCH or args.batch_keys < CACHED_KEYS:
        parser.error(f"--rounds >= 1, --keys >= {engine.BATCH}, --batch-keys >= {CACHED_KEYS}")
    with tempfile.TemporaryDirectory() as scratch:
        result = measure(args.rounds, args.keys, args.batch_keys, scratch)
    print(json.dumps(result, indent=2) if args.json else report(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
