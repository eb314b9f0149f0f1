"""Thread scaling of the native paths: aggregate decisions per second with
1, 2, ... threads, each thread on its own keys.

``allow_many`` releases the GIL for the whole batch, so it can scale with
cores; ``allow`` keeps the GIL (releasing it costs more than a decision), so
on a GIL build it cannot. Usage: python bench/threads.py [max_threads]
"""

from __future__ import annotations

import os
import sys
import sysconfig
import threading
import time

import nanolimit

DURATION = 1.5
BATCH = 10_000


def run(threads: int, mode: str) -> float:
    storage = nanolimit.InMemoryStorage()
    limiter = nanolimit.TokenBucket(1 << 30, 1.0, storage, rule="scale")
    key_sets = [[f"t{t}-user:{i}" for i in range(100_000)] for t in range(threads)]
    for keys in key_sets:
        limiter.allow_many(keys)
    counts = [0] * threads
    stop = threading.Event()
    barrier = threading.Barrier(threads + 1)

    def work(slot: int) -> None:
        keys = key_sets[slot]
        allow = limiter.allow
        many = limiter.allow_many
        n = 0
        barrier.wait()
        while not stop.is_set():
            for start in range(0, len(keys), BATCH):
                chunk = keys[start : start + BATCH]
                if mode == "allow_many":
                    many(chunk)
                else:
                    for k in chunk:
                        allow(k)
                n += len(chunk)
        counts[slot] = n

    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    barrier.wait()
    t0 = time.perf_counter()
    time.sleep(DURATION)
    stop.set()
    for w in workers:
        w.join()
    return sum(counts) / (time.perf_counter() - t0)


def main() -> int:
    most = int(sys.argv[1]) if len(sys.argv) > 1 else (os.cpu_count() or 1)
    gil = "free-threaded" if sysconfig.get_config_var("Py_GIL_DISABLED") else "GIL"
    print(f"{nanolimit.IMPLEMENTATION} core, {sys.version.split()[0]} ({gil}), {os.cpu_count()} CPUs")
    for mode in ("allow_many", "allow"):
        base = None
        for threads in range(1, most + 1):
            rate = run(threads, mode)
            base = base or rate
            print(f"{mode:>10} x{threads}: {rate / 1e6:6.2f} M decisions/s  (scaling {rate / base:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
