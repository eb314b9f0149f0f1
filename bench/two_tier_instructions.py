"""Instructions per ``allow()`` over N keys: ``InMemoryStorage`` against
``TwoTierStorage`` (sync paused), under callgrind.

Only ``_Limiter.allow`` and what it calls are counted
(``--toggle-collect``), in two runs of 1 and 3 rounds over every key, so

    instructions per call = (count(3 rounds) - count(1 round)) / (2 N)

leaves out start-up, the first (Python path) decision of each key and the
sync. Starts its own redis-server on 127.0.0.1.

    PYTHONPATH=src python bench/two_tier_instructions.py [--keys 10000]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

DRIVER = r"""
import gc, sys
sys.path.insert(0, sys.argv[4])
from itertools import repeat
import nanolimit
kind, rounds, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
keys = [f"m:{i}" for i in range(n)]
server = tier = None
if kind == "memory":
    storage = nanolimit.InMemoryStorage()
else:
    from redis_servers import Server, require_binary
    from nanolimit.storage.two_tier import TwoTierStorage
    server = Server(require_binary("redis"), "redis")
    server.start()
    tier = storage = TwoTierStorage(None, server.client(), instance_id="cg", start=False)
allow = nanolimit.FixedWindowCounter(1 << 30, 60.0, storage).allow
for k in keys:
    allow(k)
if tier is not None:
    tier.sync_now()
gc.disable()
for _ in repeat(None, rounds):
    for k in keys:
        allow(k)
if tier is not None:
    tier.close()
    server.stop()
"""
TOGGLE = "--toggle-collect=__pyx_pw_9nanolimit_5_core_8_Limiter_3allow"
TESTS = str(Path(__file__).resolve().parents[1] / "tests")


def count(kind: str, rounds: int, n: int, scratch: str) -> int:
    out = os.path.join(scratch, f"cg.{kind}.{rounds}")
    command = ["valgrind", "--tool=callgrind", TOGGLE, f"--callgrind-out-file={out}"]
    command += [sys.executable, "-c", DRIVER, kind, str(rounds), str(n), TESTS]
    env = dict(os.environ, PYTHONHASHSEED="0")
    subprocess.run(command, env=env, capture_output=True, check=True)
    with open(out) as f:
        for line in f:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise RuntimeError(f"no total in {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keys", type=int, default=10_000)
    n = parser.parse_args().keys
    with tempfile.TemporaryDirectory() as scratch:
        per = {k: (count(k, 3, n, scratch) - count(k, 1, n, scratch)) / (2 * n) for k in ("memory", "tier")}
    print(
        f"InMemoryStorage {per['memory']:.0f}, TwoTierStorage {per['tier']:.0f} instructions per allow() "
        f"({per['tier'] / per['memory']:.2f}x) over {n:,} keys"
    )


if __name__ == "__main__":
    main()
