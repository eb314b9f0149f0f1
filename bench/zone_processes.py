"""Multi-process throughput of the shared-memory zone (``SharedMemoryStorage``).

What the zone is for: N worker processes enforcing one budget. This measures
what that costs against one process, and against N processes that each keep
their own ``InMemoryStorage`` (nothing shared: the machine's own scaling).

For each storage (``zone``: one zone every process attaches to; ``own_zone``:
a zone per process, the zone's code path with nothing shared; ``memory``: an
``InMemoryStorage`` per process), key pattern and call:

- ``distinct``: each process decides its own 1,000 keys, round-robin (in the
  zone they spread over all 64 stripes, so both processes take the same
  stripe locks, as workers of one app do);
- ``own_key``: each process decides one key of its own (in the zone, two
  stripes: the same one only if the two keys hash to it, 1 in 64);
- ``hot``: every process decides the same key (in the zone: one entry, one
  stripe lock, its cache lines moving between the cores on every decision);
- ``allow``: a Python loop of ``limiter.allow(key)``; ``allow_many``: batches
  of the same 1,000 keys.

Each process is started (``fork``), pinned to a core of its own, attaches to
the zone by name, stores its keys and warms up. Then each round has two
phases, each started on a ``multiprocessing.Barrier``: one process alone (the
others asleep on the barrier; which one alternates) and every process at
once, in alternating order, each making a fixed number of decisions. A
phase's throughput is its decisions over the span from the first start to
the last end (``time.perf_counter_ns``, one monotonic clock for the host),
and a round's scaling is its all-processes throughput over its one-process
throughput, taken a fraction of a second apart: on a VM whose second core
comes and goes with its neighbours, only such pairs compare. Every
configuration runs in turn, ``--passes`` times (fresh processes and zone).
The figures are medians over every round; "scaling" is the ratio of the
medians, "paired" the median (and quartiles) of the rounds' own ratios. The
CPU time other processes took during each pass is reported with them.

Usage: ``PYTHONPATH=src python bench/zone_processes.py [--decisions N]
[--rounds R] [--passes P] [--procs 2] [--json] [--quick]``.

Targets: two processes on distinct keys ≥ 1.7x the throughput of one; on one
hot key, the contention cost per decision is reported (ns per decision per
process with two, minus one process alone on it). The machine has
``os.cpu_count()`` cores: more processes than that measure the scheduler.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
from typing import Any

HIGH_LIMIT = 1 << 30  # never denied in a run: the allowed path
WINDOW = 1.0
KEYS_PER_PROCESS = 1000
HOT_KEY = "user:42"
JOIN_S = 300.0


def _keys(pattern: str, slot: int) -> list[str]:
    if pattern == "hot":
        return [HOT_KEY] * KEYS_PER_PROCESS
    if pattern == "own_key":
        return [f"p{slot}:{HOT_KEY}"] * KEYS_PER_PROCESS
    return [f"p{slot}:user:{i}" for i in range(KEYS_PER_PROCESS)]


def _worker(
    slot: int,
    cpu: int | None,
    storage: str,
    zone_name: str,
    zone_options: dict[str, Any],
    pattern: str,
    call: str,
    decisions: int,
    rounds: int,
    barrier: Any,
    results: Any,
) -> None:
    """One process: attach, store its keys, warm up, then ``rounds`` rounds
    of two phases, each started on the barrier: one process alone (slot
    ``round % procs``; the others wait on the barrier, asleep) and every
    process at once, in alternating order. Puts ``(slot, solo spans, all
    spans, ok, decisions per phase)``; a solo span is None where another
    slot ran alone."""
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        from nanolimit import SystemClock, _core

        if storage == "zone":
            store: Any = _core.SharedMemoryStorage(zone_name, **zone_options)
        elif storage == "own_zone":
            own = f"{zone_name}-{slot}"
            store = _core.SharedMemoryStorage(own, **zone_options)
            _core.SharedMemoryStorage.unlink_segment(own)  # the mapping lives on until close
        else:
            store = _core.InMemoryStorage()
        limiter = _core.TokenBucket(HIGH_LIMIT, WINDOW, storage=store, rule="procs", clock=SystemClock())
        keys = _keys(pattern, slot)
        allow, many = limiter.allow, limiter.allow_many
        chunks = max(1, decisions // len(keys))

        def body(n: int) -> None:
            if call == "allow_many":
                for _ in range(n):
                    many(keys)
            else:
                for _ in range(n):
                    for k in keys:
                        allow(k)

        def timed() -> tuple[int, int]:
            t0 = time.perf_counter_ns()
            body(chunks)
            return t0, time.perf_counter_ns()

        many(keys)
        t_end = time.perf_counter() + 0.2  # warm-up: caches, the core's clock
        while time.perf_counter() < t_end:
            body(1)
        procs = barrier.parties
        solo: list[tuple[int, int] | None] = []
        every: list[tuple[int, int]] = []
        for r in range(rounds):
            for phase in ("solo", "all") if r % 2 == 0 else ("all", "solo"):
                barrier.wait(timeout=JOIN_S)
                if phase == "all":
                    every.append(timed())
                else:
                    solo.append(timed() if r % procs == slot else None)
        barrier.wait(timeout=JOIN_S)  # the last phase ends for everyone
        ok = bool(limiter.allow(keys[0]).allowed)
        if storage != "memory":
            store.close()
        results.put((slot, solo, every, ok, chunks * len(keys)))
    except BaseException as exc:  # reported to the parent, which fails the run
        results.put((slot, None, None, False, repr(exc)))
        raise


def run_config(
    procs: int,
    storage: str,
    pattern: str,
    call: str,
    decisions: int,
    rounds: int,
    pin: bool,
    serial: list[int],
) -> list[dict[str, float]]:
    """``rounds`` paired rounds of ``procs`` processes. Per round: one
    process's decisions per second alone, the aggregate with all of them,
    the ns per decision of each (the median process's), and their ratio."""
    from nanolimit import _core

    ctx = mp.get_context("fork")
    cpus = sorted(os.sched_getaffinity(0)) if pin and hasattr(os, "sched_getaffinity") else []
    serial[0] += 1
    zone_name = f"nlbench-{os.getpid()}-{serial[0]}"
    zone_options: dict[str, Any] = {"max_keys": 8192}
    zone = _core.SharedMemoryStorage(zone_name, **zone_options) if storage == "zone" else None
    barrier = ctx.Barrier(procs)
    results = ctx.Queue()
    workers = [
        ctx.Process(
            target=_worker,
            args=(
                slot,
                cpus[slot % len(cpus)] if cpus else None,
                storage,
                zone_name,
                zone_options,
                pattern,
                call,
                decisions,
                rounds,
                barrier,
                results,
            ),
        )
        for slot in range(procs)
    ]
    try:
        for w in workers:
            w.start()
        got = sorted(results.get(timeout=JOIN_S) for _ in workers)
        for w in workers:
            w.join(JOIN_S)
    finally:
        for w in workers:
            if w.is_alive():
                w.kill()
                w.join()
        if zone is not None:
            zone.close()
            _core.SharedMemoryStorage.unlink_segment(zone_name)
    for slot, solo, _every, ok, made in got:
        if solo is None:
            raise RuntimeError(f"worker {slot} failed: {made}")
        if not ok:
            raise RuntimeError(f"worker {slot}: a decision was denied (timed on the wrong path)")
    made = got[0][4]
    per_round = []
    for r in range(rounds):
        t0, t1 = next(span for g in got if (span := g[1][r]) is not None)
        spans = [g[2][r] for g in got]
        wall = max(e for _, e in spans) - min(s for s, _ in spans)
        one_per_s = made / (t1 - t0) * 1e9
        many_per_s = made * procs / wall * 1e9
        per_round.append(
            {
                "one_per_s": one_per_s,
                "many_per_s": many_per_s,
                "one_ns": (t1 - t0) / made,
                "many_ns": statistics.median((e - s) / made for s, e in spans),
                "ratio": many_per_s / one_per_s,
            }
        )
    return per_round


Config = tuple[str, str, str]  # storage, key pattern, call


class Interference:
    """What else the machine did while this ran: CPU time of every other
    process (``/proc/stat``'s busy time less this process's and its reaped
    children's) and the hypervisor's steal time, each in CPUs (1.0: one core
    kept busy for the whole span). On a 2-core machine, 0.5 of another's
    CPU already takes a quarter of what two processes need."""

    def __init__(self) -> None:
        self.t0, self.busy0, self.steal0, self.ours0 = self._read()

    @staticmethod
    def _read() -> tuple[float, float, float, float]:
        tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:9]]
        except (OSError, ValueError):
            fields = [0] * 8
        user, nice, system, _idle, _iowait, irq, softirq, steal = fields
        t = os.times()
        ours = t.user + t.system + t.children_user + t.children_system
        return time.monotonic(), (user + nice + system + irq + softirq) / tick, steal / tick, ours

    def read(self) -> dict[str, float]:
        t1, busy1, steal1, ours1 = self._read()
        span = max(t1 - self.t0, 1e-9)
        others = max(0.0, (busy1 - self.busy0) - (ours1 - self.ours0))
        return {"other_cpus": round(others / span, 3), "steal_cpus": round((steal1 - self.steal0) / span, 3)}


def measure(
    configs: list[Config],
    procs: int,
    decisions: int,
    rounds: int,
    passes: int,
    pin: bool,
    interference: list[dict[str, float]],
) -> list[dict[str, Any]]:
    """Every configuration in turn, ``passes`` times (fresh processes and a
    fresh zone each time), so a change in the machine's load moves every
    row alike instead of sinking one. Appends each pass's
    :class:`Interference` to ``interference``."""
    serial = [0]
    seen_rounds: dict[Config, list[dict[str, float]]] = {c: [] for c in configs}
    med = statistics.median
    for n in range(passes):
        seen = Interference()
        for config in configs:
            print(f"  pass {n + 1}/{passes}: {' '.join(config)}", file=sys.stderr, flush=True)
            seen_rounds[config] += run_config(procs, *config, decisions, rounds, pin, serial)
        busy = seen.read()
        interference.append(busy)
        print(
            f"  pass {n + 1}: other processes {busy['other_cpus']:.2f} CPUs, steal {busy['steal_cpus']:.2f}",
            file=sys.stderr,
            flush=True,
        )
    rows = []
    for config in configs:
        storage, pattern, call = config
        got = seen_rounds[config]
        ratios = sorted(r["ratio"] for r in got)
        q1, _, q3 = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else (ratios[0],) * 3
        row: dict[str, Any] = {
            "storage": storage,
            "keys": pattern,
            "call": call,
            "procs": procs,
            "one_per_s": med(r["one_per_s"] for r in got),
            "many_per_s": med(r["many_per_s"] for r in got),
            "one_ns": med(r["one_ns"] for r in got),
            "many_ns": med(r["many_ns"] for r in got),
            "rounds": len(got),
            "paired_scaling": med(ratios),
            "paired_q1": q1,
            "paired_q3": q3,
        }
        row["scaling"] = row["many_per_s"] / row["one_per_s"]
        row["extra_ns"] = row["many_ns"] - row["one_ns"]
        rows.append(row)
    return rows


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{os.cpu_count()} CPUs ({model}), {platform.python_implementation()} {platform.python_version()}"


def report(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    procs = rows[0]["procs"] if rows else 2
    lines = [
        f"zone_processes: {meta['machine']}; {meta['decisions']:,} decisions per process per round, "
        f"median of {rows[0]['rounds'] if rows else 0} rounds; load average before {meta['load_before']}",
        "other processes' CPU during each pass (in CPUs): "
        + ", ".join(
            f"{p['other_cpus']:.2f} (steal {p['steal_cpus']:.2f})" for p in meta.get("interference", [])
        ),
        "",
        f"| storage | keys | call | 1 process | {procs} processes | scaling | paired rounds (q1-q3) | "
        f"ns/decision, 1 → {procs} (per process) | extra ns per decision |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['storage']} | {r['keys']} | {r['call']} | {r['one_per_s'] / 1e6:.2f} M/s | "
            f"{r['many_per_s'] / 1e6:.2f} M/s | {r['scaling']:.2f}x | "
            f"{r['paired_scaling']:.2f}x ({r['paired_q1']:.2f}-{r['paired_q3']:.2f}) | "
            f"{r['one_ns']:.1f} → {r['many_ns']:.1f} | {r['extra_ns']:+.1f} |"
        )
    by = {(r["storage"], r["keys"], r["call"]): r for r in rows}
    for call in ("allow", "allow_many"):
        hot = by.get(("zone", "hot", call))
        for pattern in ("distinct", "own_key"):
            distinct = by.get(("zone", pattern, call))
            if distinct is None:
                continue
            met = "met" if distinct["scaling"] >= 1.7 else "NOT met"
            line = (
                f"\nzone, {call}: {procs} processes on {pattern} keys {distinct['scaling']:.2f}x one ({met})"
            )
            if hot:
                line += (
                    f"; on one hot key {hot['scaling']:.2f}x, contention {hot['extra_ns']:+.1f} ns per "
                    f"decision against one process alone, {hot['many_ns'] - distinct['many_ns']:+.1f} ns "
                    f"against {procs} processes on {pattern} keys"
                )
            lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--decisions", type=int, default=2_000_000, help="per process per round")
    parser.add_argument("--rounds", type=int, default=8, help="paired rounds per pass")
    parser.add_argument("--passes", type=int, default=3, help="every configuration, this many times")
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--storages", default="zone,own_zone,memory")
    parser.add_argument("--patterns", default="distinct,own_key,hot")
    parser.add_argument("--calls", default="allow,allow_many")
    parser.add_argument("--no-pin", action="store_true", help="leave the processes unpinned")
    parser.add_argument("--quick", action="store_true", help="200,000 decisions, 2 rounds, 1 pass")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.decisions, args.rounds, args.passes = 200_000, 2, 1
    if args.decisions < KEYS_PER_PROCESS or args.rounds < 1 or args.passes < 1 or args.procs < 2:
        parser.error("--decisions >= 1000, --rounds >= 1, --passes >= 1, --procs >= 2")
    meta = {
        "machine": _machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "decisions": args.decisions,
        "load_before": " ".join(f"{x:.2f}" for x in os.getloadavg()),
        "pinned": not args.no_pin,
    }
    configs = [
        (storage, pattern, call)
        for storage in args.storages.split(",")
        for pattern in args.patterns.split(",")
        for call in args.calls.split(",")
    ]
    interference: list[dict[str, float]] = []
    rows = measure(
        configs, args.procs, args.decisions, args.rounds, args.passes, not args.no_pin, interference
    )
    meta["interference"] = interference
    meta["load_after"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if args.json:
        print(json.dumps({"meta": meta, "rows": rows}, indent=2))
    else:
        print(report(rows, meta))
        print(f"\nload average after {meta['load_after']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
