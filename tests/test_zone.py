"""The shared-memory zone in one process: what a zone has that an
InMemoryStorage has not (a name, a lifecycle, an arena, long keys as
digests, locks a dead holder leaves), and its bad input.

The in-memory suites also run on the zone (``ZONE_SUITE`` modules, the
``zone`` backend in conftest.py); the multi-process and real-server tests
are in test_zone_processes.py and test_zone_servers.py.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import needs_shared_memory

from nanolimit._clocks import FakeClock
from nanolimit._limiter_config import Algorithm, storage_key
from nanolimit.errors import ValidationError

pytestmark = [pytest.mark.native, needs_shared_memory]

T0 = 1_000_000.0


@pytest.fixture
def core(native):
    return native


@pytest.fixture
def name() -> Iterator[str]:
    zone_name = f"nltest-{uuid.uuid4().hex[:16]}"
    yield zone_name
    import nanolimit._core as c

    c.SharedMemoryStorage.unlink_segment(zone_name)


def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


# ---------------------------------------------------------------- lifecycle


def test_the_first_creates_and_the_next_attaches_to_one_budget(core, name):
    first = core.SharedMemoryStorage(name, max_keys=1000)
    second = core.SharedMemoryStorage(name, max_keys=1000)
    assert first.created and not second.created
    a = core.FixedWindowCounter(5, 60.0, first, FakeClock(T0), rule="api")
    b = core.FixedWindowCounter(5, 60.0, second, FakeClock(T0), rule="api")
    admitted = [lim.allow("user").allowed for _ in range(4) for lim in (a, b)]
    assert admitted.count(True) == 5
    assert len(first) == len(second) == 1
    assert first.keys() == second.keys() == [storage_key(Algorithm.FIXED_WINDOW, "api", "user")]


def test_a_mismatched_attach_names_every_difference(core, name):
    core.SharedMemoryStorage(name, max_keys=1000)
    differences = r"max_keys=1000 \(asked 2000\).*on_full='evict' \(asked 'deny_new'\)"
    with pytest.raises(ValidationError, match=differences):
        core.SharedMemoryStorage(name, max_keys=2000, on_full="deny_new")
    with pytest.raises(ValidationError, match=r"arena_bytes"):
        core.SharedMemoryStorage(name, max_keys=1000, arena_bytes=1 << 21)
    with pytest.raises(ValidationError, match=r"stripes=32 \(asked 16\)"):
        core.SharedMemoryStorage(name, max_keys=1000, stripes=16)


def test_close_detaches_and_later_calls_say_so(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=100)
    limiter = core.TokenBucket(3, 60.0, zone, FakeClock(T0))
    assert limiter.allow("k").allowed
    assert os.getpid() in zone.attached_pids()
    zone.close()
    zone.close()  # twice is fine
    assert zone.closed
    for call in (
        lambda: limiter.allow("k"),
        lambda: limiter.allow_many(["k"]),
        lambda: len(zone),
        zone.keys,
        zone.stats,
        lambda: limiter.reset("k"),
        lambda: limiter.state("k"),
    ):
        with pytest.raises(ValidationError, match="closed"):
            call()
    other = core.SharedMemoryStorage(name, max_keys=100)
    assert len(other) == 1  # the zone lives on for the others


def test_unlink_while_attached_keeps_the_attached_and_starts_the_next_afresh(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=100)
    limiter = core.FixedWindowCounter(2, 60.0, zone, FakeClock(T0), rule="r")
    assert limiter.allow("k").allowed
    assert zone.unlink()
    assert not zone.unlink()  # already gone
    assert limiter.allow("k").allowed and not limiter.allow("k").allowed
    fresh = core.SharedMemoryStorage(name, max_keys=100)
    assert fresh.created and len(fresh) == 0
    assert core.FixedWindowCounter(2, 60.0, fresh, FakeClock(T0), rule="r").allow("k").remaining == 1


def test_unlink_segment_without_attaching(core, name):
    assert not core.SharedMemoryStorage.unlink_segment(name)
    core.SharedMemoryStorage(name, max_keys=10)
    assert core.SharedMemoryStorage.unlink_segment(name)
    with pytest.raises(ValidationError, match="name"):
        core.SharedMemoryStorage.unlink_segment("../etc/passwd")


def test_a_zone_pickles_as_an_attach_by_name(core, name):
    import pickle

    zone = core.SharedMemoryStorage(name, max_keys=64, on_full="deny_new")
    core.GCRA(3, 60.0, zone, FakeClock(T0), rule="g").allow("k")
    again = pickle.loads(pickle.dumps(zone))
    assert not again.created and again.on_full == "deny_new" and len(again) == 1


def test_a_segment_that_is_not_ours_is_refused_and_left_alone(core, name):
    path = Path("/dev/shm") / core._zone_segment_name(name).lstrip("/")
    if not path.parent.is_dir():
        pytest.skip("no /dev/shm on this system to plant a foreign segment in")
    path.write_bytes(b"\x7fELF" + b"\x01" * 8188)
    path.chmod(0o600)  # its user's, so refused for its magic, not its mode
    try:
        with pytest.raises(ValidationError, match="not a nanolimit shared-memory zone"):
            core.SharedMemoryStorage(name, max_keys=10)
        assert path.read_bytes()[:4] == b"\x7fELF"
        path.write_bytes(b"tiny")
        with pytest.raises(ValidationError, match="not a nanolimit shared-memory zone"):
            core.SharedMemoryStorage(name, max_keys=10)
    finally:
        path.unlink(missing_ok=True)


def test_a_half_made_segment_whose_creator_died_is_made_again(core, name):
    """A creator killed before it published the magic leaves zeros: the next
    process sees the creator is dead and starts over, never reads it."""
    path = Path("/dev/shm") / core._zone_segment_name(name).lstrip("/")
    if not path.parent.is_dir():
        pytest.skip("no /dev/shm on this system")
    header = bytearray(8192)
    header[16:24] = ((dead_pid() << 32) | 0x80000000).to_bytes(8, "little")  # creator_token
    path.write_bytes(bytes(header))
    path.chmod(0o600)  # as its creator made it
    zone = core.SharedMemoryStorage(name, max_keys=10)
    assert zone.created and len(zone) == 0


def test_a_stale_zone_is_reused_or_reset(core, name):
    """A zone no live process is attached to (its run crashed): kept, with
    its spent budget, by default; made afresh with if_stale='reset'."""
    script = (
        "import sys, nanolimit._core as c\n"
        "from nanolimit._clocks import FakeClock\n"
        f"z = c.SharedMemoryStorage({name!r}, max_keys=100)\n"
        "lim = c.FixedWindowCounter(3, 60.0, z, FakeClock(1e6), rule='r')\n"
        "print(sum(lim.allow('k').allowed for _ in range(5)))\n"
        "import os; os._exit(0)\n"  # exits without close(): as a crash would
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "3", out.stderr
    kept = core.SharedMemoryStorage(name, max_keys=100)
    assert not kept.created
    assert not core.FixedWindowCounter(3, 60.0, kept, FakeClock(T0), rule="r").allow("k").allowed
    kept.close()
    del kept
    reset = core.SharedMemoryStorage(name, max_keys=100, if_stale="reset")
    assert reset.created and len(reset) == 0


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("bad_name", "options", "match"),
    [
        ("", {"max_keys": 10}, "name"),
        ("a/b", {"max_keys": 10}, "name"),
        ("x" * 201, {"max_keys": 10}, "name"),
        (b"bytes", {"max_keys": 10}, "name"),
        ("ok", {"max_keys": 0}, "max_keys"),
        ("ok", {"max_keys": -5}, "max_keys"),
        ("ok", {"max_keys": 1 << 31}, "max_keys"),
        ("ok", {"max_keys": True}, "max_keys"),
        ("ok", {"max_keys": 10.0}, "max_keys"),
        ("ok", {"max_keys": 10, "arena_bytes": -1}, "arena_bytes"),
        ("ok", {"max_keys": 10, "arena_bytes": 1 << 41}, "arena_bytes"),
        ("ok", {"max_keys": 10, "if_stale": "maybe"}, "if_stale"),
        ("ok", {"max_keys": 10, "on_full": "drop"}, "on_full"),
        ("ok", {"max_keys": 10, "stripes": 3}, "stripes"),
        ("ok", {"max_keys": 10, "evict_idle_after": math.nan}, "evict_idle_after"),
    ],
)
def test_bad_options_are_refused_and_create_nothing(core, bad_name, options, match):
    with pytest.raises(ValidationError, match=match):
        core.SharedMemoryStorage(bad_name, **options)
    if isinstance(bad_name, str) and bad_name == "ok":
        assert not core.SharedMemoryStorage.unlink_segment("ok")


def test_max_keys_is_required(core, name):
    with pytest.raises(TypeError):
        core.SharedMemoryStorage(name)


def test_a_zone_too_big_for_dev_shm_is_a_clear_error(core, name):
    if not sys.platform.startswith("linux"):
        pytest.skip("posix_fallocate reserves the space on Linux only")
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(ValidationError, match="/dev/shm"):
        core.SharedMemoryStorage(name, max_keys=100, arena_bytes=min(free * 2, 1 << 40))
    assert not core.SharedMemoryStorage.unlink_segment(name)


def test_apply_is_refused_with_the_reason(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=10)
    with pytest.raises(ValidationError, match="Python object"):
        zone.apply("k", T0, lambda s: (1, None))
    assert len(zone) == 0


def test_bad_cutoffs_change_nothing(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=10)
    core.TokenBucket(3, 60.0, zone, FakeClock(T0)).allow("k")
    for cutoff in (math.nan, "1000.0", None):
        with pytest.raises(ValidationError, match="cutoff"):
            zone.evict_idle(cutoff)
    assert len(zone) == 1
    assert zone.evict_idle(-math.inf) == 0 and len(zone) == 1
    assert zone.evict_idle(math.inf) == 1 and len(zone) == 0


def test_rule_names_and_namespaces_have_bounds(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=10)
    with pytest.raises(ValidationError, match="184 bytes"):
        core.TokenBucket(3, 60.0, zone, rule="r" * 185)
    assert zone.metrics()["namespaces"] == 0


def test_a_compound_of_more_than_sixteen_limits_is_refused(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=100)
    limiters = [core.TokenBucket(3, 60.0, zone, FakeClock(T0), rule=f"r{i}") for i in range(17)]
    with pytest.raises(ValidationError, match="at most 16"):
        zone.allow_all([(lim, "k") for lim in limiters])
    assert len(zone) == 0
    assert zone.allow_all([(lim, "k") for lim in limiters[:16]]).allowed


# ---------------------------------------------------------------- keys and the arena


def test_long_keys_are_distinct_and_listed_by_digest(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=10_000)
    limiter = core.FixedWindowCounter(1, 60.0, zone, FakeClock(T0), rule="r")
    long_keys = [f"2001:db8:85a3::8a2e:370:{i:04x}" for i in range(2000)] + ["ключ" * 50, "x" * 1024]
    assert all(limiter.allow(k).allowed for k in long_keys)
    assert not any(limiter.allow(k).allowed for k in long_keys)
    assert len(zone) == len(long_keys)
    listed = zone.keys()
    assert all(k.startswith("fixed_window:1:r:#") and len(k.split("#")[1]) == 32 for k in listed)
    assert len(set(listed)) == len(long_keys)
    limiter.reset(long_keys[0])
    assert limiter.allow(long_keys[0]).allowed
    assert limiter.state(long_keys[1]).count == 1


def test_a_full_arena_refuses_sliding_logs_with_a_reason_and_corrupts_nothing(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=1000, arena_bytes=64 * 1024, on_full="deny_new")
    clock = FakeClock(T0)
    log = core.SlidingWindowLog(1000, 3600.0, zone, clock, rule="log")
    bucket = core.TokenBucket(5, 60.0, zone, clock, rule="bucket")
    refused = None
    for i in range(1000):
        d = log.allow(f"user{i}", 100)
        if not d.allowed:
            refused = (i, d)
            break
    assert refused is not None, "64 KiB cannot hold a thousand 100-stamp rings"
    i, d = refused
    assert d.reason == "storage_full" and d.degraded and d.retry_after > 0
    assert zone.stats()["denied_arena"] >= 1 and zone.metrics()["arena_failures"] >= 1
    # what was admitted is still exactly there, and other algorithms do not need the arena
    for j in range(i):
        assert len(log.state(f"user{j}").log) == 100
    assert bucket.allow("anyone").allowed
    # a log that exists keeps its ring: stamps that fit in it are admitted,
    # and one that would need a bigger ring is refused, the log unchanged
    assert log.allow("user0", 1).allowed  # 100 stamps sit in a 127-slot block
    refused_growth = log.allow("user0", 100)
    assert not refused_growth.allowed and refused_growth.reason == "storage_full"
    assert len(log.state("user0").log) == 101


def test_an_evicting_zone_frees_rings_for_new_logs(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=64, arena_bytes=16 * 1024, stripes=1)
    clock = FakeClock(T0)
    log = core.SlidingWindowLog(10, 1.0, zone, clock, rule="log")
    for i in range(500):
        clock.set(T0 + i * 2.0)  # every older log is at rest by now
        assert log.allow(f"k{i}", 10).allowed, i
    assert zone.stats()["evicted_at_rest"] > 0
    assert zone.stats()["denied_arena"] == 0


# ---------------------------------------------------------------- locks and dead holders


@pytest.mark.parametrize("algorithm", ["TokenBucket", "SlidingWindowLog", "SlidingWindowCounter", "GCRA"])
def test_a_holder_killed_mid_decision_is_rolled_back(core, name, algorithm):
    zone = core.SharedMemoryStorage(name, max_keys=100, stripes=1)
    clock = FakeClock(T0)
    limiter = getattr(core, algorithm)(10, 60.0, zone, clock, rule="r")
    for key in ("a", "b", "c"):
        limiter.allow(key, 3)
    before = {key: limiter.state(key) for key in ("a", "b", "c")}
    zone._simulate_dead_holder(limiter, "b", dead_pid(), "decision")
    started = time.monotonic()
    decision = limiter.peek("b", 7)  # waits for the dead holder, takes over, repairs
    waited = time.monotonic() - started
    assert waited < 5.0
    assert {key: limiter.state(key) for key in ("a", "b", "c")} == before
    assert decision.allowed and decision.remaining == 0
    stats = zone.stats()
    assert stats["stripes_repaired"] == 1 and stats["lock_recoveries"] == 1


def test_a_deletion_cut_off_mid_move_leaves_no_duplicate(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=100, stripes=1)
    clock = FakeClock(T0)
    limiter = core.FixedWindowCounter(10, 60.0, zone, clock, rule="r")
    keys = [f"k{i}" for i in range(8)]
    for i, key in enumerate(keys):
        limiter.allow(key, i + 1)
    zone._simulate_dead_holder(limiter, "k2", dead_pid(), "move")
    assert len(zone) == 8  # the count was not lowered yet
    assert limiter.allow("k2").remaining == 9  # taken over: k2 was being deleted, so it is fresh
    assert len(zone) == 8 and len(set(zone.keys())) == 8
    for i, key in enumerate(keys):
        if key != "k2":
            assert limiter.state(key).count == i + 1


def test_threads_share_one_exact_budget(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=1000)
    clock = FakeClock(T0)
    limiter = core.SlidingWindowLog(500, 60.0, zone, clock, rule="r")
    admitted = []
    start = threading.Barrier(8)

    def work(i: int) -> None:
        start.wait()
        count = 0
        for j in range(200):
            if j % 4 == 0:
                count += int(sum(limiter.allow_many(["hot"] * 8).allowed))
            else:
                count += limiter.allow("hot").allowed
        admitted.append(count)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert sum(admitted) == 500
    assert len(limiter.state("hot").log) == 500


def test_system_clock_is_wall_time_so_processes_agree(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=10)
    limiter = core.GCRA(10, 1.0, zone, rule="g")
    before = time.time()
    limiter.allow("k")
    assert before <= limiter.state("k").updated_at <= time.time()


def test_a_zone_from_another_pid_namespace_is_refused(core, name):
    """Lock owners are pids: across PID namespaces (containers sharing
    /dev/shm) a live holder could be taken for a dead one. Unshared, a
    process sees another namespace: it must refuse the zone, not attach."""
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("needs Linux and the right to unshare a PID namespace")
    core.SharedMemoryStorage(name, max_keys=10)
    script = (
        "import nanolimit._core as c\n"
        "from nanolimit.errors import ValidationError\n"
        "try:\n"
        f"    c.SharedMemoryStorage({name!r}, max_keys=10)\n"
        "except ValidationError as exc:\n"
        "    print('refused:', exc)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        out = subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", script],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except FileNotFoundError:
        pytest.skip("no unshare(1) here")
    if out.returncode != 0 and "Operation not permitted" in out.stderr:
        pytest.skip("unshare is not permitted in this sandbox")
    assert "refused:" in out.stdout and "PID namespace" in out.stdout, (out.stdout, out.stderr)


def test_the_segment_is_readable_by_its_user_only(core, name):
    """Another user of the host must not read or write the zone: it holds
    the hash secrets (with them, colliding keys could be chosen)."""
    core.SharedMemoryStorage(name, max_keys=10)
    path = Path("/dev/shm") / core._zone_segment_name(name).lstrip("/")
    if not path.exists():
        pytest.skip("this system keeps POSIX segments elsewhere than /dev/shm")
    assert path.stat().st_mode & 0o777 == 0o600


def test_a_segment_another_user_could_write_is_never_attached(core, name):
    """/dev/shm is writable by every user, so anyone can make a zone's name
    first (open to all, or owned by them) and wait: an attacher that took
    it would decide on budgets its maker reads and sets. Before the fix, a
    root worker attached to a zone that uid 65534 made and opened 0666."""
    made = core.SharedMemoryStorage(name, max_keys=10)
    path = Path("/dev/shm") / core._zone_segment_name(name).lstrip("/")
    if not path.exists():
        pytest.skip("this system keeps POSIX segments elsewhere than /dev/shm")
    path.chmod(0o666)
    with pytest.raises(ValidationError, match="mode 0666"):
        core.SharedMemoryStorage(name, max_keys=10)
    with pytest.raises(ValidationError, match="mode 0666"):
        core.SharedMemoryStorage.attach(name)
    path.chmod(0o600)
    core.SharedMemoryStorage(name, max_keys=10).close()  # its user's again: attached
    made.close()
    if os.geteuid() != 0:
        return
    os.chown(path, 65534, 65534)  # another user's (their 0600 stops no root attacher)
    with pytest.raises(ValidationError, match="owned by uid 65534 with mode 0600"):
        core.SharedMemoryStorage(name, max_keys=10)


def test_a_compound_that_cannot_get_a_ring_charges_nothing(core, name):
    zone = core.SharedMemoryStorage(name, max_keys=100, arena_bytes=4096, on_full="deny_new")
    clock = FakeClock(T0)
    bucket = core.TokenBucket(5, 60.0, zone, clock, rule="bucket")
    log = core.SlidingWindowLog(100, 60.0, zone, clock, rule="log")
    while log.allow(f"hog{len(zone)}", 100).allowed:  # 1 KiB rings until the arena is spent
        pass
    decision = zone.allow_all([(bucket, "user"), (log, "user", 50)])
    assert not decision.allowed
    assert [d.reason for d in decision.decisions] == ["", "storage_full"]
    assert bucket.state("user") is None and log.state("user") is None  # no entry left behind
    assert bucket.allow("user", 5).allowed  # the bucket's budget untouched


def test_a_ring_for_a_compound_never_forgets_one_of_its_keys(core, name):
    # The arena holds one ring, "x"'s. A compound's new sliding log needs one:
    # an evict zone forgets another key of the stripe for it, but never one of
    # the compound's own, even at rest ("p"): it forgets "x" and the ring is had.
    zone = core.SharedMemoryStorage(name, max_keys=3, stripes=1, arena_bytes=64)
    clock = FakeClock(T0)
    log = core.SlidingWindowLog(5, 60.0, zone, clock, rule="log")
    window = core.FixedWindowCounter(5, 1.0, zone, clock, rule="fw")
    assert log.allow("x").allowed and window.allow("p").allowed
    clock.advance(1.0)  # "p" is at rest, "x" is not
    decision = zone.allow_all([(window, "p"), (log, "q")])
    assert decision.allowed, [d.reason for d in decision.decisions]
    assert window.state("p") is not None and log.state("q") is not None and log.state("x") is None
    assert len(zone) == 2 and zone.stats()["evicted_active"] == 1


def test_compounds_on_one_thread_do_not_change_decisions_on_another(core, name):
    """allow_all's phases are its own: a thread deciding meanwhile on a
    full deny_new zone is refused as always, never let past the cap."""
    zone = core.SharedMemoryStorage(name, max_keys=64, stripes=1, on_full="deny_new")
    clock = FakeClock(T0)
    a = core.FixedWindowCounter(1000, 60.0, zone, clock, rule="a")
    b = core.FixedWindowCounter(1000, 60.0, zone, clock, rule="b")
    stop = threading.Event()
    assert zone.allow_all([(a, "shared"), (b, "shared")]).allowed  # its two keys are in

    def compounds() -> None:
        while not stop.is_set():
            zone.allow_all([(a, "shared"), (b, "shared")])

    worker = threading.Thread(target=compounds)
    worker.start()
    try:
        admitted_new = sum(a.allow(f"new{i}").allowed for i in range(5000))
    finally:
        stop.set()
        worker.join(timeout=30)
    assert len(zone) <= 64
    assert admitted_new == 64 - 2
