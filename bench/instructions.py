"""A deterministic regression gate: CPU instructions per decision, per algorithm.

Why instructions and not time: a shared CI runner's timings move by tens of
percent with its neighbours, so a timed gate either cries wolf or sleeps
through a real regression. The instruction count of the same program on the
same interpreter is the same on every run, whatever else the machine does, so
a 10 % growth is a real change in the code that runs per decision.

How: for each algorithm and each hot path (``allow`` on a hot key, ``peek`` on
a hot key, ``allow_many`` over 1,000 stored keys) a tiny driver runs twice
under ``valgrind --tool=callgrind``, with N1 and N2 decisions. Interpreter
start-up, imports and set-up are the same in both runs, so

    instructions per decision = (count(N2) - count(N1)) / (N2 - N1)

counts only the per-decision work: our native code, the clock read, the
Decision allocation, and the Python loop that calls it (the ``loop`` row shows
that floor on its own). One interpreter under valgrind imports nanolimit
once and forks a child per run (a child's count includes what its parent
ran before the fork, the same for both runs of a pair but for the parent's
one fork between them, which a calibration pair measures and takes off):
start-up under callgrind cost ~20 times a run's decisions, paid 38 times.
What keeps it repeatable: ``PYTHONHASHSEED=0``, the gc disabled in the
driver, the table's hash seed pinned (the driver replaces ``os.urandom``
before ``nanolimit._core`` draws its seed), and limits and a window (10^9
s) chosen so every decision takes the same branch whatever the wall clock
reads: nothing refills to the brim, drains to empty, expires or
crosses a window.

Usage (from the repository root, with nanolimit importable: installed, or
``PYTHONPATH=src`` with the extension built in place):

    python bench/instructions.py            # compare with the baseline; exit 1 on > 10 % growth
    python bench/instructions.py --update   # rewrite bench/instructions_baseline.json

Update the baseline deliberately, in its own commit, saying why the count moved.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from nanolimit._limiter_config import LIMITER_CLASS_NAMES

HERE = Path(__file__).resolve().parent
BASELINE = HERE / "instructions_baseline.json"
ALGORITHMS = LIMITER_CLASS_NAMES
PATHS = ("allow", "peek", "allow_many")
N1, N2 = 10_000, 110_000
TOLERANCE = 0.10
# One request through nanolimit's ASGI and WSGI middlewares on a plain rule
# (bench/asgi_inprocess.py's apps, called without a server): allowed, denied
# (429) and counted by response (charged, then given back at its 200). They
# guard the request lane: entered once, headers formatted at binding, a
# refund in one call. A request costs ~20 times a decision: fewer of them.
GATEWAY_PATHS = ("asgi_allowed", "asgi_429", "asgi_counted", "wsgi_allowed", "wsgi_429", "wsgi_counted")
GATEWAY_N1, GATEWAY_N2 = 1_000, 6_000

# The driver: as little as possible besides the decisions themselves.
DRIVER = r"""
import gc, json, os, sys
os.urandom = lambda n: bytes(range(1, n + 1))  # pin the table's hash seed: probes repeat
from itertools import repeat
import nanolimit
if nanolimit.IMPLEMENTATION != "native":
    sys.exit("the native twin is not built: nothing to count")
BENCH, GATEWAY_ROWS = sys.argv[3], json.loads(sys.argv[4])


def drive(f, arg, n):  # locals only: the loop costs the same in every run
    for _ in repeat(None, n):
        f(arg)


GATEWAY = {}  # path -> (call, app): one request through a front end (asgi_inprocess's apps)
if GATEWAY_ROWS:
    sys.path.insert(0, BENCH)
    import asgi_inprocess as front
    asgi, wsgi = front.asgi_variants(), front.wsgi_variants()
    for row in GATEWAY_ROWS:
        kind, _, variant = row.partition("_")
        variant = {"allowed": "nanolimit", "429": "nanolimit_denied", "counted": "nanolimit_counted"}[variant]
        call = front.call_asgi if kind == "asgi" else front.call_wsgi
        GATEWAY[row] = (call, (asgi if kind == "asgi" else wsgi)[variant])


def main(alg, path, n):
    key = "user:42"
    if alg == "loop":
        return drive(len, key, n)
    if alg == "gateway":
        call, app = GATEWAY[path]
        return drive(call, app, n)
    # 16M units per 10^9 s: never refills to capacity, never drains, never expires
    limiter = getattr(nanolimit, alg)(1 << 24, 1e9, clock=nanolimit.SystemClock())
    if path == "allow":
        return drive(limiter.allow, key, n)
    if path == "peek":
        limiter.allow(key)
        return drive(limiter.peek, key, n)
    keys = ["user:%d" % i for i in range(1000)]
    limiter.allow_many(keys)
    return drive(limiter.allow_many, keys, n // 1000)


gc.disable()
# argv: the runs as JSON pairs of [index, [name, path, n]] (each pair forked
# back to back from the same state), and how many children run at once.
# Prints {"children": {pid: index}, "failed": [index]} once all have exited.
pairs, jobs = json.loads(sys.argv[1]), int(sys.argv[2])
children, failed, order = {}, [], {}
batch = max(1, jobs // 2)
for first in range(0, len(pairs), batch):
    for pair in pairs[first:first + batch]:
        for index, (name, path, n) in pair:
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    main(name, path, n)
                except BaseException:
                    import traceback
                    traceback.print_exc()
                    code = 1
                os._exit(code)
            children[pid] = index
    while children:
        pid, status = os.wait()
        order[pid] = children.pop(pid)
        if status != 0:
            failed.append(order[pid])
print(json.dumps({"children": order, "failed": failed}))
"""


def count_runs(runs: list[tuple[str, str, int]], jobs: int, scratch: str) -> list[int]:
    """Instructions executed by each run's child (callgrind's ``summary``),
    from one parent under valgrind that forks the runs two by two."""
    pairs = [[[i, list(runs[i])], [i + 1, list(runs[i + 1])]] for i in range(0, len(runs), 2)]
    env = dict(os.environ, PYTHONHASHSEED="0")
    command = [
        "valgrind",
        "--tool=callgrind",
        f"--callgrind-out-file={os.path.join(scratch, 'cg.%p')}",
        sys.executable,
        "-c",
        DRIVER,
        json.dumps(pairs),
        str(max(2, jobs)),
        str(HERE),
        json.dumps(sorted({path for name, path, _n in runs if name == "gateway"})),
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    try:
        report = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        report = None
    if proc.returncode != 0 or report is None or report["failed"]:
        failed = [runs[i] for i in (report or {}).get("failed", [])]
        raise RuntimeError(f"driver failed {failed or ''}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    counts = [0] * len(runs)
    for pid, index in report["children"].items():
        with open(os.path.join(scratch, f"cg.{pid}")) as f:
            for line in f:
                if line.startswith("summary:") or line.startswith("totals:"):
                    counts[index] = int(line.split()[1])
                    break
            else:
                raise RuntimeError(f"no instruction total for {runs[index]}")
    return counts


def measure(algorithms: list[str], jobs: int, gateway: bool = True) -> dict[str, dict[str, float]]:
    """Instructions per decision for every algorithm and path, plus the bare
    loop, and per request through the front ends' middlewares."""
    rows: list[tuple[str, str, str, int, int]] = [("loop", "loop", "allow", N1, N2)]
    rows += [(alg, ALGORITHMS[alg], path, N1, N2) for alg in algorithms for path in PATHS]
    if gateway:
        rows += [("gateway", "gateway", path, GATEWAY_N1, GATEWAY_N2) for path in GATEWAY_PATHS]
    # the calibration pair first: two runs of N1, whose difference is what the
    # parent runs between a pair's two forks (its count lands in the second)
    runs: list[tuple[str, str, int]] = [("loop", "allow", N1), ("loop", "allow", N1)]
    runs += [(driven, path, n) for _name, driven, path, n1, n2 in rows for n in (n1, n2)]
    with tempfile.TemporaryDirectory() as scratch:
        counts = count_runs(runs, jobs, scratch)
    between = counts[1] - counts[0]
    results: dict[str, dict[str, float]] = {}
    for i, (name, _driven, path, n1, n2) in enumerate(rows):
        low, high = counts[2 + 2 * i], counts[3 + 2 * i]
        results.setdefault(name, {})[path] = round((high - low - between) / (n2 - n1), 1)
    return results


def extension_digest() -> str:
    """sha256 of the native extension the drivers import: the counts belong to
    that build, and a digest that changes mid-run (a rebuild in a working tree)
    means the N1 and N2 runs measured different code."""
    where = subprocess.run(
        [sys.executable, "-c", "import nanolimit._core as c; print(c.__file__)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if where.returncode != 0:
        return "unavailable"
    return hashlib.sha256(Path(where.stdout.strip()).read_bytes()).hexdigest()


def environment() -> dict[str, str]:
    version = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=False)
    return {
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
        "machine": platform.machine(),
        "valgrind": version.stdout.strip(),
    }


def table(current: dict[str, dict[str, float]], baseline: dict[str, dict[str, float]] | None) -> list[str]:
    lines = [f"{'algorithm':<16} {'path':<11} {'instr/decision':>15} {'baseline':>10} {'change':>8}"]
    lines.append("-" * len(lines[0]))
    for alg, paths in current.items():
        for path, value in paths.items():
            base = (baseline or {}).get(alg, {}).get(path)
            change = f"{(value - base) / base:+.1%}" if base else ""
            shown = f"{base:,.1f}" if base else "-"
            lines.append(f"{alg:<16} {path:<11} {value:>15,.1f} {shown:>10} {change:>8}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--update", action="store_true", help=f"write {BASELINE.name} instead of comparing")
    parser.add_argument("--tolerance", type=float, default=TOLERANCE, help="allowed growth (default 0.10)")
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS), help="comma-separated subset")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="valgrind runs in parallel")
    parser.add_argument("--json", metavar="PATH", help="also write the measured counts here")
    parser.add_argument(
        "--baseline",
        type=Path,
        default=BASELINE,
        help="compare with this record instead (CI: counts of the base commit, same runner)",
    )
    parser.add_argument("--measure-only", action="store_true", help="print and --json the counts; no verdict")
    parser.add_argument("--no-gateway", action="store_true", help="the core's rows only, no middleware rows")
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("instructions: valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = [a for a in algorithms if a not in ALGORITHMS]
    if unknown:
        parser.error(f"unknown algorithm(s): {', '.join(unknown)}")
    before = extension_digest()
    current = measure(algorithms, max(1, args.jobs), gateway=not args.no_gateway)
    env = environment()
    env["extension_sha256"] = extension_digest()
    if env["extension_sha256"] != before:
        print("instructions: the extension was rebuilt during the measurement; run again", file=sys.stderr)
        return 2
    record = {"environment": env, "n1": N1, "n2": N2, "instructions_per_decision": current}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    if args.measure_only:
        print("\n".join(table(current, None)))
        return 0
    if args.update:
        BASELINE.write_text(json.dumps(record, indent=2) + "\n")
        print("\n".join(table(current, None)))
        print(f"\ninstructions: baseline written to {BASELINE.relative_to(HERE.parent)}")
        return 0
    if not args.baseline.exists():
        print("\n".join(table(current, None)))
        print(
            f"\ninstructions: no baseline at {args.baseline}; run with --update to record one",
            file=sys.stderr,
        )
        return 1
    saved = json.loads(args.baseline.read_text())
    baseline = saved["instructions_per_decision"]
    print("\n".join(table(current, baseline)))
    if saved["environment"].get("python", "").rsplit(".", 1)[0] != env["python"].rsplit(".", 1)[0]:
        print(
            f"\ninstructions: warning: baseline recorded on Python {saved['environment'].get('python')}, "
            f"this is {env['python']}; the interpreter's share of each count differs between versions"
        )
    grown = [
        f"{alg} {path}: {base:,.1f} -> {current[alg][path]:,.1f}"
        for alg, paths in baseline.items()
        if alg in current and alg != "loop"
        for path, base in paths.items()
        if path in current[alg] and current[alg][path] > base * (1 + args.tolerance)
    ]
    if grown:
        print(f"\ninstructions: FAILED, grew more than {args.tolerance:.0%}:\n  " + "\n  ".join(grown))
        print("If the growth is deliberate, run `python bench/instructions.py --update` and commit the")
        print("baseline on its own, saying why.")
        return 1
    shrunk = [
        f"{alg} {path}"
        for alg, paths in baseline.items()
        if alg in current and alg != "loop"
        for path, base in paths.items()
        if path in current[alg] and current[alg][path] < base * (1 - args.tolerance)
    ]
    if shrunk:
        print(f"\ninstructions: faster than the baseline ({', '.join(shrunk)}): consider --update")
    print(f"\ninstructions: OK, no algorithm grew more than {args.tolerance:.0%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
