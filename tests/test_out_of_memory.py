"""Out of memory changes nothing (native twin): a request whose state cannot
be allocated raises MemoryError and leaves every limit as it was — the keys
it names, the other limits of a compound request, and the table's size.

Each case runs in a child process whose address space is capped just above
what it already uses (``RLIMIT_AS``), so the largest sliding log's ring, 128
MiB for a cost of 16,777,216, cannot be allocated while everything else
still can."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = [
    pytest.mark.native,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RLIMIT_AS and /proc are Linux's"),
]

PRELUDE = """
import json, resource
import nanolimit
from nanolimit import FakeClock

LIMIT = 16_777_216  # the largest sliding log: its ring is 128 MiB


def cap_memory():
    vm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + (64 << 20), resource.RLIM_INFINITY))


def raw(limiter, key):
    state = limiter.state(key)
    return None if state is None else [state.updated_at, state.level, state.log]


def out_of_memory(call):
    try:
        call()
    except MemoryError:
        return True
    return False
"""


def run_child(body: str) -> dict:
    script = PRELUDE + textwrap.dedent(body)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=dict(os.environ), timeout=120
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_a_compound_request_out_of_memory_charges_no_limit(native) -> None:
    """The sliding log, second, cannot grow its ring: the token bucket,
    first, must not be charged, and no entry may be left behind."""
    got = run_child(
        """
        clock = FakeClock(100.0)
        storage = nanolimit.InMemoryStorage()
        bucket = nanolimit.TokenBucket(10, 60.0, storage, clock)
        log = nanolimit.SlidingWindowLog(LIMIT, 1.0, storage, clock)
        bucket.allow("k")
        before = [raw(bucket, "k"), raw(log, "k"), len(storage)]
        cap_memory()
        failed = out_of_memory(lambda: storage.allow_all([(bucket, "k"), (log, "k", LIMIT)]))
        after = [raw(bucket, "k"), raw(log, "k"), len(storage)]
        fits = storage.allow_all([(bucket, "k"), (log, "k", 2)]).allowed  # small costs still fit
        print(json.dumps({"failed": failed, "before": before, "after": after, "fits": fits}))
        """
    )
    assert got["failed"]
    assert got["after"] == got["before"]
    assert got["before"][0][1] == 9.0 and got["before"][1] is None
    assert got["fits"]


def test_a_sliding_log_out_of_memory_keeps_its_state(native) -> None:
    """An existing key keeps its stamps, expired ones included, and its
    clock; a new key is not left behind."""
    got = run_child(
        """
        clock = FakeClock(100.0)
        storage = nanolimit.InMemoryStorage()
        log = nanolimit.SlidingWindowLog(LIMIT, 1.0, storage, clock)
        log.allow("old")
        clock.advance(5.0)  # its stamp has expired: a decision now would drop it
        before = [raw(log, "old"), len(storage)]
        cap_memory()
        failed_old = out_of_memory(lambda: log.allow("old", LIMIT))
        failed_new = out_of_memory(lambda: log.allow("new", LIMIT))
        after = [raw(log, "old"), len(storage)]
        print(json.dumps({"failed": [failed_old, failed_new], "before": before, "after": after,
                          "new": raw(log, "new")}))
        """
    )
    assert got["failed"] == [True, True]
    assert got["after"] == got["before"]
    assert got["before"][0] == [100.0, None, [100.0]]
    assert got["new"] is None
