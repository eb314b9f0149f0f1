"""What a two-tier fleet admits per window, against the limit (docs/two_tier.md,
"Measured"). Not a timed test: per-window counts from real processes, printed.

    PYTHONPATH=src python bench/two_tier_bounds.py [--fleets 3,5] [--loads paced,full]
        [--scenarios steady,partial,restart] [--window 1.0] [--limit 300] [--cold]

For each fleet size N, load and scenario it starts N worker processes
(``tests/two_tier_worker.py``, each its own ``TwoTierStorage``, a native
``FixedWindowCounter`` of ``--limit`` per ``--window``, ``sync_interval``
0.05, keys "a" and "b") against one loopback redis-server, every worker
through its own TCP proxy (``tests/tcp_proxy.py``). Once every worker is a
fleet member, each decides each key once half a window before the load
starts (not with ``--cold``: then window +0 is the keys' first window on
every instance, the one the bound leaves open), then for 4-5.5 s decides
both keys either paced (1 ms between rounds: ~900 requests per second per
key per worker) or as fast as it can (``full``). Scenarios:

- ``steady``: nothing goes wrong;
- ``partial``: ``N // 3 + (N > 3)`` workers (1 of 3, 2 of 5) are cut off
  from Redis by their proxies 1.3 s into the load and reconnected 3 s later,
  while the others keep Redis;
- ``restart``: the server is SIGKILLed 1.3 s into the load and restarted,
  empty, 1.7 s later.

It prints, per key, each window's fleet total (what every worker says it
admitted there) with the units admitted blind in brackets, and per scenario
the largest total of the windows after the first and the largest of all.
The windows are whole windows of the clock (the load starts on a boundary).

It uses only the public API plus ``metrics()``, so the same script measures
an older checkout too (``PYTHONPATH=<old>/src``).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from redis_servers import Server, require_binary
from tcp_proxy import TcpProxy

WORKER = Path(__file__).resolve().parent.parent / "tests" / "two_tier_worker.py"
SYNC = 0.05
KEYS = ("a", "b")


def run(
    server: Server,
    n: int,
    *,
    load: str,
    scenario: str,
    limit: int,
    window: float,
    cold: bool = False,
) -> tuple[list[dict[str, Any]], float]:
    """One fleet run; returns the workers' reports and the load's first window start."""
    duration = {"steady": 4.0, "partial": 5.5, "restart": 5.0}[scenario]
    proxies = [TcpProxy(server.port) for _ in range(n)]
    cut = proxies[n - (n // 3 + (n > 3)) :] if scenario == "partial" else []
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    procs = []
    for i, proxy in enumerate(proxies):
        args = {
            "port": proxy.port,
            "instance_id": f"inst-{i}",
            "limiter": "FixedWindowCounter",
            "limit": limit,
            "window": window,
            "keys": list(KEYS),
            "duration": duration,
            "sync_interval": SYNC,
            "heartbeat_ttl": 2.0,
            "pace": 0.001 if load == "paced" else 0.0,
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), json.dumps(args)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=env,
            )
        )
    # every worker a fleet member first; then the load starts on a window boundary
    for proc in procs:
        assert proc.stdout is not None and proc.stdin is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError(proc.communicate(timeout=10)[1].decode()[-3000:])
    t0 = math.ceil((time.time() + 0.6) / window) * window
    start = {"t0": t0, "warm_at": None if cold else t0 - window / 2, "converge_at": t0 + duration + 1.0}
    for proc in procs:
        assert proc.stdin is not None
        proc.stdin.write((json.dumps(start) + "\n").encode())
        proc.stdin.flush()

    def at(offset: float, action: Callable[[], None]) -> None:
        time.sleep(max(0.0, t0 + offset - time.time()))
        action()

    try:
        if scenario == "partial":
            at(1.3, lambda: [p.cut() for p in cut])
            at(4.3, lambda: [p.restore() for p in cut])
        elif scenario == "restart":
            at(1.3, server.kill)
            at(3.0, server.start)
        reports = []
        for proc in procs:
            out, err = proc.communicate(timeout=duration + 60)
            if proc.returncode != 0:
                raise RuntimeError(err.decode()[-3000:])
            reports.append(json.loads(out.decode().strip().splitlines()[-1]))
        return reports, t0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        for proxy in proxies:
            proxy.close()


def per_window(reports: list[dict[str, Any]], field: str) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = defaultdict(int)
    for report in reports:
        for key, per in report[field].items():
            for k, units in per.items():
                out[(key, int(k))] += units
    return out


def show(reports: list[dict[str, Any]], t0: float, window: float, limit: int) -> tuple[int, int]:
    admitted = per_window(reports, "admitted")
    blind = per_window(reports, "blind")
    first = math.floor(t0 / window + 0.5)
    windows = sorted({k for _, k in admitted})
    for key in KEYS:
        cells = []
        for k in windows:
            units = admitted.get((key, k), 0)
            mark = f"[{blind[(key, k)]}]" if blind.get((key, k)) else ""
            cells.append(f"{k - first:+d}:{units}{mark}")
        print(f"    key {key}: " + "  ".join(cells))
    later = [v for (_, k), v in admitted.items() if k > first]
    return max(later, default=0), max(admitted.values(), default=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fleets", default="3,5")
    parser.add_argument("--loads", default="paced,full")
    parser.add_argument("--scenarios", default="steady,partial,restart")
    parser.add_argument("--window", type=float, default=1.0)
    parser.add_argument("--limit", type=int, default=300)
    parser.add_argument("--kind", default="redis")
    parser.add_argument("--cold", action="store_true", help="no warm-up: the load starts on new keys")
    opts = parser.parse_args()
    server = Server(require_binary(opts.kind), opts.kind)
    server.start()
    summary = []
    try:
        for n in (int(x) for x in opts.fleets.split(",")):
            for load in opts.loads.split(","):
                for scenario in opts.scenarios.split(","):
                    server.client().flushall()
                    reports, t0 = run(
                        server,
                        n,
                        load=load,
                        scenario=scenario,
                        limit=opts.limit,
                        window=opts.window,
                        cold=opts.cold,
                    )
                    print(f"N={n} {load} {scenario} (L={opts.limit}; window +0 starts the load):")
                    later, worst = show(reports, t0, opts.window, opts.limit)
                    silent = max(r["metrics"].get("silent_instances", 0) for r in reports)
                    print(f"    max after the first window {later}, max {worst} (L={opts.limit})")
                    summary.append((n, load, scenario, later, worst, silent))
    finally:
        server.stop()
    print("\nsummary: N load scenario | max per window after the first | max of all")
    for n, load, scenario, later, worst, _ in summary:
        print(f"  N={n} {load:5} {scenario:8} | {later:4} | {worst:4}")


if __name__ == "__main__":
    main()
