"""A shared-memory zone left retired, or with bad bytes in it, must not hang
or crash a fresh worker (docs/shared_memory.md, "A zone left retired" and
"A corrupted segment").

Every check starts a real worker process on a real segment whose bytes this
test wrote through ``/dev/shm``: the worker is bounded by a timeout and
killed by pid in ``finally``, so a hang is a failure (not a stuck run) and a
segfault is a negative return code (not a dead pytest).

White-box: the offsets below are layout 2 of ``_zone.pxd``; a test skips if
the segment says another layout.

``NLTEST_WORKER_WRAP``, a command prefix, runs each worker under it (for
example valgrind, to check the repair paths, which run in the worker);
``NLTEST_WORKER_S`` then lengthens the worker's bound.
"""

from __future__ import annotations

import json
import mmap
import os
import shlex
import signal
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from _helpers import needs_shared_memory

from nanolimit._clocks import FakeClock

pytestmark = [pytest.mark.native, needs_shared_memory]

ZONE_MAGIC = 0x314E4F5A4C4E414E
ZONE_RETIRED = 0x444552495445524E
# ZoneHeader fields (byte offset, struct format)
H_STRIPES = (48, "<I")
H_STRIPE_ENTRIES = (52, "<I")
H_INDEX_SLOTS = (56, "<I")
H_TOTAL_BYTES = (32, "<Q")
H_NAMESPACES_OFFSET = (128, "<Q")
H_STRIPES_OFFSET = (136, "<Q")
H_ENTRIES_OFFSET = (144, "<Q")
H_INDEX_OFFSET = (152, "<Q")
H_ARENA_OFFSET = (160, "<Q")
H_REGISTRY_LOCK = (168, "<Q")
STRIPE_BYTES = 128  # ZoneStripe: lock at 0, count at 64, cap at 68
ENTRY_BYTES = 48  # Entry: key_len at 8, ns at 12, key at 16, state at 32 (ZoneLog: ring, head, length)
ARENA_TOP, ARENA_END, ARENA_FREE_HEADS = 8, 16, 40  # ZoneArena, at the arena offset
ALG_SLIDING_LOG = 4

OPTS: dict[str, Any] = {"max_keys": 256, "stripes": 4, "arena_bytes": 1 << 16}
WORKER_S = float(os.environ.get("NLTEST_WORKER_S", "20"))  # a worker needs well under a second
WORKER_WRAP = shlex.split(os.environ.get("NLTEST_WORKER_WRAP", ""))
T0 = 1_000_000.0

# The worker: attach (or make the zone), then decide on every algorithm,
# on present and new keys, alone and in batches and compounds, and look at
# the zone, until one round passes whole. A RuntimeError (a corrupt stripe,
# repaired) is counted and the round tried again; a ValidationError at
# attach is a refusal. It prints one JSON line: {"refused": why} or
# {"created": ..., "errors": [...], "seconds": ...}.
WORKER = r"""
import json, sys, time
import nanolimit._core as c
from nanolimit._clocks import FakeClock
from nanolimit.errors import ValidationError
name, opts = sys.argv[1], eval(sys.argv[2])
started = time.monotonic()
try:
    zone = c.SharedMemoryStorage(name, **opts)
except ValidationError as e:
    print(json.dumps({"refused": str(e)}))
    sys.exit(0)
clock = FakeClock(float(sys.argv[3]))
classes = (c.TokenBucket, c.LeakyBucket, c.FixedWindowCounter, c.SlidingWindowLog,
           c.SlidingWindowCounter, c.GCRA)
limiters = [cls(5, 60.0, zone, clock, rule="r") for cls in classes]

def one_round():
    for lim in limiters:
        for key in ["victim"] + [f"k{i}" for i in range(60)]:
            lim.allow(key)
            lim.peek(key)
        lim.allow_many([f"b{i}" for i in range(60)])
        lim.state("victim")
        lim.refund("victim")
        lim.reset("k1")
    zone.allow_all([(limiters[0], "c1"), (limiters[3], "c2"), (limiters[5], "victim")])
    zone.keys()
    zone.stats()
    len(zone)
    zone.evict_idle(clock.now() - 1e6)

errors = []
for attempt in range(64):
    try:
        one_round()
        break
    except RuntimeError as e:
        errors.append(str(e))
else:
    print(json.dumps({"never_clean": errors[:2]}))
    sys.exit(3)
# a repaired zone decides: a fresh key gets exactly its budget
lim = limiters[2]
admitted = sum(lim.allow("fresh-key").allowed for _ in range(8))
assert admitted == 5, admitted
print(json.dumps({"created": zone.created, "errors": errors, "seconds": time.monotonic() - started}))
"""


def run_worker(name: str, timeout: float = WORKER_S) -> tuple[dict[str, Any], float]:
    """Run WORKER on ``name`` in a fresh interpreter; what it printed and how
    long it took. Fails on a hang (timeout) or a crash (killed by a signal)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PYTHONFAULTHANDLER": "1"}
    args = [*WORKER_WRAP, sys.executable, "-c", WORKER, name, repr(OPTS), repr(T0)]
    started = time.monotonic()
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the worker hung: no answer in {timeout:g} s")
        took = time.monotonic() - started
        if proc.returncode < 0:
            pytest.fail(f"the worker crashed: {signal.Signals(-proc.returncode).name}\n{err[-3000:]}")
        assert proc.returncode == 0, f"worker exited {proc.returncode}:\n{out}\n{err[-3000:]}"
        return json.loads(out.strip().splitlines()[-1]), took
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture
def core(native):
    return native


@pytest.fixture
def name(core) -> Iterator[str]:
    zone_name = f"nltest-{uuid.uuid4().hex[:16]}"
    yield zone_name
    core.SharedMemoryStorage.unlink_segment(zone_name)


class Segment:
    """A writable mapping of a zone's segment, through /dev/shm."""

    def __init__(self, zone: Any) -> None:
        path = "/dev/shm" + zone.segment_name
        if not os.path.exists(path):
            pytest.skip("no /dev/shm view of the segment on this platform")
        with open(path, "r+b") as f:
            self.map = mmap.mmap(f.fileno(), 0)
        magic, version = struct.unpack_from("<QI", self.map, 0)
        if magic != ZONE_MAGIC or version != 2:
            self.map.close()
            pytest.skip(f"zone layout {version} (magic {magic:#x}): this white-box test writes layout 2")

    def get(self, field: tuple[int, str], base: int = 0) -> int:
        return int(struct.unpack_from(field[1], self.map, base + field[0])[0])

    def put(self, field: tuple[int, str], value: int, base: int = 0) -> None:
        struct.pack_into(field[1], self.map, base + field[0], value)

    def stripe(self, i: int) -> int:
        return self.get(H_STRIPES_OFFSET) + STRIPE_BYTES * i

    def entries(self) -> Iterator[tuple[int, int, bytes]]:
        """(offset, ns, key) of every entry in use in every stripe."""
        per_stripe = self.get(H_STRIPE_ENTRIES)
        first = self.get(H_ENTRIES_OFFSET)
        for i in range(self.get(H_STRIPES)):
            count = self.get((64, "<I"), self.stripe(i))
            for j in range(count):
                at = first + (i * per_stripe + j) * ENTRY_BYTES
                key_len, ns = struct.unpack_from("<II", self.map, at + 8)
                yield at, ns, bytes(self.map[at + 16 : at + 16 + min(key_len, 16)])

    def entry_of(self, key: bytes, algorithm: int) -> int:
        found = [at for at, ns, k in self.entries() if k == key and ns & 7 == algorithm]
        assert len(found) == 1, found
        return found[0]

    def close(self) -> None:
        self.map.close()


def populated(core: Any, name: str) -> Any:
    """A zone with keys of every algorithm in it (a sliding log's ring among
    them)."""
    zone = core.SharedMemoryStorage(name, **OPTS)
    clock = FakeClock(T0)
    for cls in ("TokenBucket", "FixedWindowCounter", "SlidingWindowLog", "GCRA"):
        lim = getattr(core, cls)(5, 60.0, zone, clock, rule="r")
        for i in range(40):
            lim.allow(f"k{i}")
        lim.allow("victim", 3)
    return zone


def detached_segment(core: Any, name: str) -> Segment:
    """A populated zone this process has closed (as a worker that exited
    would have), mapped for writing: the bad bytes go in after this process
    is done with the zone, so only the fresh worker meets them."""
    zone = populated(core, name)
    zone.close()
    seg = Segment(zone)
    del zone
    return seg


def assert_survived(result: dict[str, Any], name: str) -> dict[str, Any]:
    """The worker refused with a clear reason, or decided (after clear
    errors, each naming the zone and a stripe, repaired); returns ``result``."""
    if "refused" in result:
        assert "corrupt" in result["refused"] and repr(name) in result["refused"], result
    else:
        for error in result["errors"]:
            assert f"shared-memory zone {name!r}" in error, error
            assert "corrupt" in error and "repaired" in error, error
    return result


def assert_made_again(result: dict[str, Any]) -> None:
    assert result.get("created") is True and result["errors"] == [], result


# ---------------------------------------------------------------- a zone left retired


def test_a_zone_left_retired_by_a_killed_unlinker_is_made_again(core, name):
    """``unlink()`` killed between marking the zone retired and removing its
    name: a fresh worker must not wait on it forever, but make the zone again."""
    seg = detached_segment(core, name)
    try:
        seg.put((0, "<Q"), ZONE_RETIRED)  # what unlink() writes first
    finally:
        seg.close()
    result, took = run_worker(name)
    assert_made_again(result)  # it created the zone afresh
    assert WORKER_WRAP or took < 10.0, took  # (valgrind around the worker is slower)


def test_a_retired_zone_still_mapped_by_a_live_worker_is_made_again_and_left_to_it(core, name):
    """A live worker still deciding on the retired segment (its name was never
    removed) does not keep new workers out; and that worker's late ``unlink``
    never removes the newer live zone made under the same name."""
    old = populated(core, name)
    seg = Segment(old)
    try:
        seg.put((0, "<Q"), ZONE_RETIRED)
    finally:
        seg.close()
    assert_made_again(run_worker(name)[0])
    old_limiter = core.FixedWindowCounter(5, 60.0, old, FakeClock(T0), rule="r")
    assert old_limiter.allow("k0").remaining == 3  # the old segment is still whole for the old worker
    assert not old.unlink()  # its name now names another segment: left alone
    fresh = core.SharedMemoryStorage(name, **OPTS)
    assert not fresh.created  # the newer zone is still there
    assert len(fresh) > 0


def test_a_retired_zone_whose_unlinker_holds_the_registry_lock_dead_is_made_again(core, name):
    """``if_stale="reset"`` killed between retiring and unlinking: the zone is
    retired and its registry lock still names the dead process."""
    seg = detached_segment(core, name)
    try:
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait(timeout=30)
        seg.put(H_REGISTRY_LOCK, (child.pid << 32) | 0x80000000)
        seg.put((0, "<Q"), ZONE_RETIRED)
    finally:
        seg.close()
    assert_made_again(run_worker(name)[0])


# ---------------------------------------------------------------- a corrupted segment


@pytest.mark.parametrize(
    ("field", "value"),
    [
        pytest.param(H_STRIPES_OFFSET, 1 << 40, id="stripes_offset-beyond-segment"),
        pytest.param(H_ENTRIES_OFFSET, 1 << 40, id="entries_offset-beyond-segment"),
        pytest.param(H_INDEX_OFFSET, 1 << 40, id="index_offset-beyond-segment"),
        pytest.param(H_ARENA_OFFSET, 1 << 40, id="arena_offset-beyond-segment"),
        pytest.param(H_NAMESPACES_OFFSET, 1 << 40, id="namespaces_offset-beyond-segment"),
        pytest.param(H_STRIPE_ENTRIES, 1 << 30, id="stripe_entries-beyond-layout"),
        pytest.param(H_INDEX_SLOTS, 1 << 30, id="index_slots-beyond-layout"),
        pytest.param(H_TOTAL_BYTES, 1 << 40, id="total_bytes-beyond-segment"),
    ],
)
def test_a_header_that_names_what_is_not_there_is_refused_at_attach(core, name, field, value):
    seg = detached_segment(core, name)
    try:
        seg.put(field, value)
    finally:
        seg.close()
    result = assert_survived(run_worker(name)[0], name)
    assert "refused" in result, result


def test_a_layout_1_zone_is_refused_not_misread(core, name):
    # layout 1 gave each stripe's array 16 entries of compound slack: a zone
    # an older nanolimit made is refused by its version, before any offset
    seg = detached_segment(core, name)
    try:
        seg.put((8, "<I"), 1)  # ZoneHeader.layout_version
        seg.put(H_STRIPE_ENTRIES, seg.get(H_STRIPE_ENTRIES) + 16)
    finally:
        seg.close()
    result = run_worker(name)[0]
    assert "layout version 1 (this nanolimit writes 2)" in result.get("refused", ""), result


def test_an_arena_header_beyond_the_segment_is_refused_at_attach(core, name):
    seg = detached_segment(core, name)
    try:
        arena = seg.get(H_ARENA_OFFSET)
        seg.put((ARENA_TOP, "<Q"), 1 << 40, arena)
    finally:
        seg.close()
    result = assert_survived(run_worker(name)[0], name)
    assert "refused" in result and "arena" in result["refused"], result


@pytest.mark.parametrize("count", [0xFFFFFFF0, 1 << 20, 81, 65])  # 65: one past a stripe's array (its cap)
def test_a_stripe_count_beyond_its_capacity_is_an_error_then_a_repair(core, name, count):
    seg = detached_segment(core, name)
    try:
        for i in range(seg.get(H_STRIPES)):
            seg.put((64, "<I"), count, seg.stripe(i))  # ZoneStripe.count
    finally:
        seg.close()
    assert_survived(run_worker(name)[0], name)


@pytest.mark.parametrize("cap", [65, 0xFFFFFFFF])
def test_a_stripe_cap_beyond_its_array_is_an_error_then_a_repair(core, name, cap):
    # a stripe's array holds its cap and no more (layout 2): a cap past it
    # would let inserts run off the array, so it is found, not used
    seg = detached_segment(core, name)
    try:
        for i in range(seg.get(H_STRIPES)):
            seg.put((68, "<I"), cap, seg.stripe(i))  # ZoneStripe.cap
    finally:
        seg.close()
    result = assert_survived(run_worker(name)[0], name)
    assert result.get("errors"), result
    zone = core.SharedMemoryStorage(name, **OPTS)
    try:
        assert len(zone) <= OPTS["max_keys"]
    finally:
        zone.close()


@pytest.mark.parametrize(
    "garbage",
    [
        pytest.param(b"\x01\x00\x00\x00", id="every-slot-taken"),  # a probe never meets an empty slot
        pytest.param(b"\xff\xff\xff\xff", id="positions-beyond-the-stripe"),
        pytest.param(bytes(range(256)) * 4, id="mixed-garbage"),
    ],
)
def test_garbage_index_slots_never_probe_forever(core, name, garbage):
    seg = detached_segment(core, name)
    try:
        start = seg.get(H_INDEX_OFFSET)
        size = seg.get(H_STRIPES) * seg.get(H_INDEX_SLOTS) * 4
        seg.map[start : start + size] = (garbage * (size // len(garbage) + 1))[:size]
    finally:
        seg.close()
    assert_survived(run_worker(name)[0], name)


@pytest.mark.parametrize(
    ("ring", "head", "length"),
    [
        pytest.param(1 << 40, None, None, id="ring-beyond-the-segment"),
        pytest.param("arena-end", None, None, id="ring-at-the-arena-end"),
        pytest.param("header", None, None, id="ring-in-the-header"),
        pytest.param(None, None, 0xFFFFFFFF, id="length-beyond-the-ring"),
        pytest.param(None, 0xFFFFFFF0, None, id="head-beyond-the-ring"),
    ],
)
def test_a_sliding_log_ring_outside_the_arena_is_never_followed(core, name, ring, head, length):
    """Not followed, and not taken for a ring either: the worker reports the
    stripe corrupt (and repairs it), and a ring offset that names the header
    never has stamps written over the header."""
    seg = detached_segment(core, name)
    try:
        at = seg.entry_of(b"victim", ALG_SLIDING_LOG) + 32  # its ZoneLog
        if ring == "arena-end":
            ring = seg.get((ARENA_END, "<Q"), seg.get(H_ARENA_OFFSET)) - 64
        elif ring == "header":
            ring = 64
        if ring is not None:
            struct.pack_into("<Q", seg.map, at, ring)
        if head is not None:
            struct.pack_into("<I", seg.map, at + 8, head)
        if length is not None:
            struct.pack_into("<I", seg.map, at + 12, length)
        header = bytes(seg.map[:392])  # up to the registry of processes
    finally:
        seg.close()
    result = assert_survived(run_worker(name)[0], name)
    assert result.get("errors"), result  # found corrupt, not used as a ring
    seg = Segment(core.SharedMemoryStorage(name, **OPTS))
    try:
        after = bytes(seg.map[:392])
    finally:
        seg.close()
    # the header is as it was but for the counters and locks the worker moves
    # (namespace_count, registry_lock, lock_recoveries)
    for start, end in ((0, 68), (72, 168), (184, 392)):
        assert after[start:end] == header[start:end], (start, end)


def test_an_arena_free_list_pointing_outside_the_arena_is_never_followed(core, name):
    seg = detached_segment(core, name)
    try:
        arena = seg.get(H_ARENA_OFFSET)
        for k in range(48):
            seg.put((ARENA_FREE_HEADS + 8 * k, "<Q"), (1 << 40) + 64 * k, arena)
    finally:
        seg.close()
    assert_survived(run_worker(name)[0], name)


def test_entries_with_garbage_namespaces_and_keys_are_dropped_not_followed(core, name):
    seg = detached_segment(core, name)
    try:
        for at, _, _ in list(seg.entries())[::3]:
            struct.pack_into("<II", seg.map, at + 8, 0xFFFFFFFF, 0xFFFFFFFF)  # key_len, ns
    finally:
        seg.close()
    assert_survived(run_worker(name)[0], name)


def test_a_garbage_stripe_lock_word_is_taken_over_not_waited_on(core, name):
    """A lock word that names no process (here pid -1, which ``kill`` reads
    as "every process") is a dead owner, not a live one to wait for."""
    seg = detached_segment(core, name)
    try:
        for i in range(seg.get(H_STRIPES)):
            seg.put((0, "<Q"), 0xFFFFFFFFFFFFFFFF, seg.stripe(i))
        seg.put(H_REGISTRY_LOCK, 0xFFFFFFFFFFFFFFFF)
    finally:
        seg.close()
    assert_survived(run_worker(name)[0], name)


def test_a_holder_killed_as_a_log_s_ring_grows_leaves_the_log_exact(core, name):
    """Growing a full, wrapped sliding log's ring must switch the entry to
    the new ring in one store: a holder killed after it names the new ring,
    before the decision (so no undo copy yet), leaves the log as it was.
    Before the fix the growth reset the head in a second store, and a kill
    between the two left the new ring read from the old head: here that
    state (new ring, old head and length) read 5 zeros for its 4 oldest
    stamps, which never expired: 85 admitted of the 89 left."""
    zone = core.SharedMemoryStorage(name, **OPTS)
    clock = FakeClock(T0)
    limit = 100
    lim = core.SlidingWindowLog(limit, 60.0, zone, clock, rule="g")
    assert lim.allow("victim").allowed
    seg = Segment(zone)
    try:
        at = seg.entry_of(b"victim", ALG_SLIDING_LOG) + 32  # its ZoneLog
        ring = struct.unpack_from("<Q", seg.map, at)[0]
        size = struct.unpack_from("<I", seg.map, ring)[0]  # the first ring's slots
        for i in range(1, size - 5):  # never full before it wraps: a full one grows first
            clock.set(T0 + i)
            assert lim.allow("victim").allowed
        clock.set(T0 + 65.5)  # 6 expire (head 6), and 11 more fill it, wrapped
        assert sum(lim.allow("victim").allowed for _ in range(11)) == 11
        assert struct.unpack_from("<QII", seg.map, at) == (ring, 6, size)
        assert lim.allow("victim").allowed  # one more stamp: the ring grows
        grown, head_after, length_after = struct.unpack_from("<QII", seg.map, at)
        assert grown != ring and length_after == size + 1
        # what a holder killed just after naming the new ring leaves: the
        # new ring, with the head and length from before that decision
        struct.pack_into("<II", seg.map, at + 8, 6, size)
    finally:
        seg.close()
    # the 4 stamps from before T0 + 10 have gone out of the window; the 11 of
    # T0 + 65.5 are in it: exactly the rest of the limit
    clock.set(T0 + 70.0)
    assert sum(lim.allow("victim").allowed for _ in range(limit)) == limit - 11
    assert head_after == 6  # the growth moved no stamp from its place
    zone.close()
