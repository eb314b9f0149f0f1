"""``python -m nanolimit``: the command line.

``demo`` replays the reference scenarios of SPEC §7 on the in-memory default
store with a fake clock and prints what each limiter answered, so a new user
sees the whole contract (decisions, retry times, headers) in one screen.
It exits non-zero if any answer differs from the SPEC: the demo is also a
smoke test of an installation.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Sequence

import nanolimit
from nanolimit import FakeClock, InMemoryStorage

LIMITER_TYPES = (
    nanolimit.TokenBucket,
    nanolimit.LeakyBucket,
    nanolimit.FixedWindowCounter,
    nanolimit.SlidingWindowLog,
    nanolimit.SlidingWindowCounter,
    nanolimit.GCRA,
)


def _scenario_token_bucket_429() -> tuple[bool, list[str]]:
    clock = FakeClock(0.0)
    limiter = nanolimit.TokenBucket(5, 60.0, clock=clock, rule="demo")
    decisions = [limiter.allow("client-1") for _ in range(7)]
    admitted = sum(d.allowed for d in decisions)
    headers = decisions[-1].headers(wall_now=1_700_000_000.0)
    lines = [
        "1. token bucket, 5 per 60 s, 7 requests at once",
        f"   allowed {admitted}, denied {7 - admitted}",
        "   429 headers: " + json.dumps(headers),
    ]
    ok = admitted == 5 and headers.get("Retry-After") == "12" and headers["X-RateLimit-Remaining"] == "0"
    return ok, lines


def _scenario_five_per_second() -> tuple[bool, list[str]]:
    lines = ["2. limit 5 per second, 7 requests at t = 0"]
    expected_retry = {
        "TokenBucket": 0.2,
        "LeakyBucket": 0.2,
        "GCRA": 0.2,
        "FixedWindowCounter": 1.0,
        "SlidingWindowLog": 1.0,
        "SlidingWindowCounter": 1.0,
    }
    ok = True
    for cls in LIMITER_TYPES:
        limiter = cls(5, 1.0, clock=FakeClock(0.0))
        decisions = [limiter.allow("k") for _ in range(7)]
        admitted = sum(d.allowed for d in decisions)
        retry = decisions[5].retry_after
        ok &= admitted == 5 and abs(retry - expected_retry[cls.__name__]) < 1e-9
        lines.append(f"   {cls.__name__:<22} allowed {admitted}, 6th retry_after {retry:.3f} s")
    return ok, lines


def _scenario_boundary_burst() -> tuple[bool, list[str]]:
    lines = ["3. boundary burst, 5 per second: 5 at t=1,000,000.9 and 5 at t=1,000,001.0"]
    ok = True
    for cls, expected in ((nanolimit.FixedWindowCounter, (5, 5)), (nanolimit.SlidingWindowCounter, (5, 0))):
        clock = FakeClock(1_000_000.9)
        limiter = cls(5, 1.0, clock=clock)
        first = sum(limiter.allow("k").allowed for _ in range(5))
        clock.set(1_000_001.0)
        second = sum(limiter.allow("k").allowed for _ in range(5))
        ok &= (first, second) == expected
        lines.append(f"   {cls.__name__:<22} allowed {first} then {second}")
    return ok, lines


def _scenario_threads() -> tuple[bool, list[str]]:
    lines = ["4. 8 threads x 50 requests, one key, frozen clock, capacity 100"]
    ok = True
    for cls in LIMITER_TYPES:
        limiter = cls(100, 60.0, storage=InMemoryStorage(), clock=FakeClock(0.0))
        counts = [0] * 8
        barrier = threading.Barrier(8)

        def work(slot: int, limiter: nanolimit.RateLimiter = limiter) -> None:
            barrier.wait()
            counts[slot] = sum(limiter.allow("shared").allowed for _ in range(50))

        threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        ok &= sum(counts) == 100
        lines.append(f"   {cls.__name__:<22} allowed {sum(counts)} of 400")
    return ok, lines


def demo() -> int:
    print(f"nanolimit {nanolimit.__version__} ({nanolimit.IMPLEMENTATION} core), SPEC §7 scenarios\n")
    all_ok = True
    for scenario in (
        _scenario_token_bucket_429,
        _scenario_five_per_second,
        _scenario_boundary_burst,
        _scenario_threads,
    ):
        ok, lines = scenario()
        all_ok &= ok
        print("\n".join(lines))
        print("   -> " + ("as specified" if ok else "DIFFERS FROM THE SPEC") + "\n")
    return 0 if all_ok else 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nanolimit", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo", help="replay SPEC §7 on the in-memory default store")
    commands.add_parser("info", help="print which core is loaded")
    args = parser.parse_args(argv)
    if args.command == "info":
        print(json.dumps({"version": nanolimit.__version__, "implementation": nanolimit.IMPLEMENTATION}))
        return 0
    return demo()


if __name__ == "__main__":
    sys.exit(main())
