"""Instructions per request of the Django rows of ``asgi_inprocess.py
--frameworks``, under callgrind: the stable figure the wall-clock medians
of a shared machine are not.

    python bench/django_instructions.py            # every row, 1,000 and 2,000 requests
    python bench/django_instructions.py --n1 200 --n2 400 nanolimit bare

Each row runs twice in a fresh interpreter (``PYTHONHASHSEED=0``, the gc
off, the same warm-up), with N1 and N2 requests, counted only around the
requests (the start-up is not instrumented), so what the switch itself
costs cancels out:

    instructions per request = (count(N2) - count(N1)) / (N2 - N1)

Rows: ``bare`` (no middleware), ``nanolimit`` (the middleware, the view's
``@limit``), ``nanolimit_denied`` (its 429s), ``nanolimit_wsgi`` and
``nanolimit_wsgi_denied`` (nanolimit's WSGI middleware around the bare
handler, one prefix rule: the same decision without Django's hooks).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROWS = ("bare", "nanolimit", "nanolimit_denied", "nanolimit_wsgi", "nanolimit_wsgi_denied")

# Instrumented only around the timed loop (``--instr-atstart=no``, then
# callgrind_control from the driver itself): start-up runs at full speed.
DRIVER = r"""
import gc, os, subprocess, sys
sys.path.insert(0, sys.argv[1])
import warnings
warnings.simplefilter("ignore")
import asgi_inprocess
call = getattr(asgi_inprocess, sys.argv[4])()[sys.argv[2]]
for _ in range(3):  # the first request binds; the denied rows spend their one admission
    call()
def instrument(state):
    subprocess.run(["callgrind_control", "-i", state, str(os.getpid())], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
gc.collect()
gc.disable()
instrument("on")
for _ in range(int(sys.argv[3])):
    call()
instrument("off")
"""


def count(row: str, requests: int, calls: str = "_django_calls") -> int:
    """Instructions of one driver run (callgrind's ``summary``): ``row`` of
    ``asgi_inprocess``'s ``calls()`` (``_django_calls``, ``_flask_calls``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        driver = Path(tmp) / "driver.py"
        driver.write_text(DRIVER)
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        run = subprocess.run(
            [
                "valgrind",
                "--tool=callgrind",
                "--instr-atstart=no",
                f"--callgrind-out-file={out}",
                sys.executable,
                str(driver),
                str(HERE),
                row,
                str(requests),
                calls,
            ],
            check=True,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        for line in run.stderr.splitlines():
            if "Collected :" in line:
                return int(line.split(":")[-1].replace(",", ""))
    raise RuntimeError(f"{row}: callgrind reported no count:\n{run.stderr[-2000:]}")


def main(
    argv: list[str] | None = None, rows: tuple[str, ...] = ROWS, calls: str = "_django_calls", doc: str = ""
) -> int:
    """The command line of this script and of ``flask_instructions.py``
    (``rows`` of ``asgi_inprocess``'s ``calls()``)."""
    parser = argparse.ArgumentParser(description=(doc or __doc__ or "").split("\n\n")[0])
    parser.add_argument("rows", nargs="*", help=f"of {', '.join(rows)} (default: all)")
    parser.add_argument("--n1", type=int, default=1000)
    parser.add_argument("--n2", type=int, default=2000)
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    if shutil.which("valgrind") is None:
        print("valgrind is not installed", file=sys.stderr)
        return 2
    if not 0 < args.n1 < args.n2:
        parser.error("need 0 < n1 < n2")
    unknown = sorted(set(args.rows) - set(rows))
    if unknown:
        parser.error(f"unknown rows {unknown}: choose from {', '.join(rows)}")
    args.rows = args.rows or list(rows)
    jobs = [(row, n) for row in args.rows for n in (args.n1, args.n2)]
    with ThreadPoolExecutor(args.jobs) as pool:
        counts = dict(zip(jobs, pool.map(lambda job: count(*job, calls), jobs)))
    per = {
        row: round((counts[row, args.n2] - counts[row, args.n1]) / (args.n2 - args.n1)) for row in args.rows
    }
    print(json.dumps(per, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
