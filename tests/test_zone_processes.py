"""SharedMemoryStorage across real processes: one budget, many deciders.

The zone is a rate-limit table in a named POSIX shared-memory segment that
worker processes attach to; these tests start real processes (``fork`` and
``spawn``) and check what only processes can show:

1. exactness: 8 processes hammering one key on a frozen clock admit exactly
   the capacity, for all six algorithms, one by one and in batches;
2. a moving clock, shared by every process: each step admits exactly what a
   single process on an InMemoryStorage admits on the same clock sequence;
3. SIGKILL mid-decision: siblings keep deciding (bounded stall), and the
   frozen keys' budgets account for every admission: a killed worker's
   in-flight decision is rolled back or completed, never doubled;
3b. the same made certain: the victim is SIGSTOPped until the segment shows
   it holding a stripe lock (white-box, layout 2), then SIGKILLed; the
   in-flight decision must be rolled back exactly; and a dead holder not yet
   reaped (a zombie) is dead to the waiters: they take its lock over at once;
4. lifecycle: attach/close from a child, a mismatched attach, unlink while
   attached, a stale segment left by a killed creator (reuse / reset), a
   multiprocessing Pool given the zone object, gunicorn-style
   fork-after-create, 8 processes racing to create one zone, and more
   short-lived workers than the registry has slots.

The child bodies live in ``zone_workers`` (top-level, so spawn can import
them). Every child is bounded (an alarm, timed waits, joins with a timeout,
killed in ``finally``) and every zone is unlinked in ``finally``.
"""

from __future__ import annotations

import faulthandler
import mmap
import multiprocessing as mp
import os
import queue as queue_mod
import random
import select
import signal
import struct
import sys
import threading
import time
import uuid
from typing import Any

import pytest
import zone_workers as zw
from _helpers import needs_shared_memory
from conftest import ALGORITHM_CLASSES as CLASS_OF_ALGORITHM

pytestmark = [pytest.mark.native, needs_shared_memory]

ALGORITHM_CLASSES = tuple(CLASS_OF_ALGORITHM.values())  # the six limiter class names
OPTS: dict[str, Any] = {"max_keys": 1024}
JOIN_S = 30.0
WATCHDOG_S = 480  # a native hang in this process dumps tracebacks and exits


@pytest.fixture(autouse=True)
def watchdog():
    """The parent decides on the zone too: if that ever hangs (a lock never
    recovered), dump every thread's stack and end the run instead of hanging CI."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture
def zone_cls(native):
    return native.SharedMemoryStorage


@pytest.fixture
def zone_names(zone_cls):
    """``new()`` returns a fresh unique segment name; all are unlinked at teardown."""
    made: list[str] = []

    def new() -> str:
        name = f"nltest-{uuid.uuid4().hex[:12]}"
        made.append(name)
        return name

    yield new
    for name in made:
        zone_cls.unlink_segment(name)


@pytest.fixture
def zone_name(zone_names):
    return zone_names()


class Children:
    """Processes started by a test: killed (if still alive) and reaped at the end."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.pids: list[int] = []  # raw os.fork children

    def start(self, ctx: Any, target: Any, *args: Any) -> Any:
        proc = ctx.Process(target=target, args=args, daemon=True)
        proc.start()
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)
        for pid in self.pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


@pytest.fixture
def children():
    kids = Children()
    yield kids
    kids.close()


def get(q: Any, timeout: float = JOIN_S) -> Any:
    try:
        return q.get(timeout=timeout)
    except queue_mod.Empty:
        pytest.fail(f"no answer from a child within {timeout}s")


def join_all(procs: list[Any], timeout: float = JOIN_S) -> None:
    end = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(0.1, end - time.monotonic()))
    hung = [p.pid for p in procs if p.is_alive()]
    assert not hung, f"children still running after {timeout}s: {hung}"
    bad = [(p.pid, p.exitcode) for p in procs if p.exitcode != 0]
    assert not bad, f"children exited badly (pid, exitcode): {bad}"


def frozen(zone: Any, class_name: str, limit: int, window: float = 60.0) -> Any:
    return zw.limiter(class_name, limit, window, zone, zw.FrozenClock())


# ---------------------------------------------------------------------------
# 1. exactness across processes


PROCESSES = 8
PER_PHASE = 2_000
RUN_LIMITS = (500, 4_000, 1_009)  # three runs, every algorithm in each
BATCHES = (0, 0, 0, 0, 0, 25, 50, 100)  # three of the eight ask in allow_many batches


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_one_key_exact_across_processes(zone_cls, zone_name, children, method):
    ctx = mp.get_context(method)
    zone = zone_cls(zone_name, **OPTS)
    assert zone.created
    plan = [
        (cls, limit, f"{cls}-run{run}") for run, limit in enumerate(RUN_LIMITS) for cls in ALGORITHM_CLASSES
    ]
    barrier = ctx.Barrier(PROCESSES)
    q = ctx.Queue()
    t0 = time.perf_counter()
    procs = [
        children.start(
            ctx, zw.exact_worker, zone_name, OPTS, barrier, q, slot, plan, PER_PHASE, BATCHES[slot]
        )
        for slot in range(PROCESSES)
    ]
    answers = [get(q, 60) for _ in procs]
    join_all(procs)
    elapsed = time.perf_counter() - t0
    errors = [a[2] for a in answers if a[1] is None]
    assert not errors, "\n".join(errors)
    per_key: dict[str, list[int]] = {key: [0] * PROCESSES for _, _, key in plan}
    for slot, admitted, info in answers:
        assert info["created"] is False  # the parent made it: every child attached
        for key, n in admitted.items():
            per_key[key][slot] = n
    wrong = {
        key: (limit, sum(per_key[key]), per_key[key]) for _, limit, key in plan if sum(per_key[key]) != limit
    }
    assert not wrong, f"admitted != capacity (capacity, admitted, per process): {wrong}"
    # the zone holds one entry per key, and a fresh ask in the parent is denied
    assert len(zone) == len(plan)
    for cls, limit, key in plan:
        assert not frozen(zone, cls, limit).peek(key).allowed, key
    spread = {key: sum(1 for n in per_key[key] if n) for key in per_key}
    print(
        f"\n[{method}] {PROCESSES} processes x {PER_PHASE} x {len(plan)} phases in {elapsed:.2f}s; "
        f"processes that won budget per key: min {min(spread.values())} max {max(spread.values())}; "
        f"stats {zone.stats()}"
    )
    zone.close()


# ---------------------------------------------------------------------------
# 2. a moving clock shared by every process


CLOCK_PROCESSES = 4
PER_STEP = 60  # x 4 processes = 240 asks per step, over the limit of 100
CLOCK_LIMIT = 100
CLOCK_WINDOW = 10.0
STEP_OFFSETS = (0.0, 0.0, 1.0, 2.5, 5.0, 9.999, 10.0, 10.0, 12.5, 19.0, 20.0, 31.7, 45.0, 45.01, 60.0, 61.0)


class MovableClock:
    def __init__(self, now: float) -> None:
        self.t = now

    def now(self) -> float:
        return self.t


def test_moving_clock_matches_one_process(native, zone_cls, zone_name, children):
    ctx = mp.get_context("spawn")
    zone = zone_cls(zone_name, **OPTS)
    value = ctx.RawValue("d", zw.FROZEN_NOW)
    counts = ctx.RawArray("q", CLOCK_PROCESSES)
    errors = ctx.RawArray("b", CLOCK_PROCESSES)
    barrier = ctx.Barrier(CLOCK_PROCESSES + 1)
    plan = [(cls, CLOCK_LIMIT, CLOCK_WINDOW, f"clock-{cls}", len(STEP_OFFSETS)) for cls in ALGORITHM_CLASSES]
    batches = (0, 0, 20, 30)
    procs = [
        children.start(
            ctx,
            zw.clock_worker,
            zone_name,
            OPTS,
            value,
            barrier,
            counts,
            errors,
            slot,
            plan,
            PER_STEP,
            batches[slot],
        )
        for slot in range(CLOCK_PROCESSES)
    ]
    got: dict[str, list[int]] = {}
    want: dict[str, list[int]] = {}
    for cls, limit, window, key, _steps in plan:
        ref_clock = MovableClock(zw.FROZEN_NOW)
        ref = getattr(native, cls)(limit, window, storage=native.InMemoryStorage(), clock=ref_clock, rule=cls)
        got[cls], want[cls] = [], []
        for offset in STEP_OFFSETS:
            t = zw.FROZEN_NOW + offset
            value.value = t
            barrier.wait(timeout=60)
            barrier.wait(timeout=60)
            got[cls].append(sum(counts))
            ref_clock.t = t
            want[cls].append(sum(ref.allow(key).allowed for _ in range(PER_STEP * CLOCK_PROCESSES)))
    join_all(procs)
    assert not any(errors)
    mismatched = {cls: (got[cls], want[cls]) for cls in got if got[cls] != want[cls]}
    assert not mismatched, f"per step (zone across processes, one process): {mismatched}"
    # fixed_window, stated plainly: every window admits exactly the limit
    windows: dict[int, int] = {}
    for offset, n in zip(STEP_OFFSETS, got["FixedWindowCounter"]):
        w = int((zw.FROZEN_NOW + offset) // CLOCK_WINDOW)
        windows[w] = windows.get(w, 0) + n
    assert set(windows.values()) == {CLOCK_LIMIT}, windows
    print(f"\nper-step admitted across {CLOCK_PROCESSES} processes: {got}")
    zone.close()


# ---------------------------------------------------------------------------
# 3. SIGKILL mid-decision


KILLS = 20
HAMMERS = 4
NEXT_DECISIONS = 1_000
STALL_BOUND_S = 5.0


@pytest.mark.parametrize("mode", ["spawn-attach", "fork-inherit"])
def test_sigkill_mid_decision(zone_cls, zone_name, children, mode):
    """Kill one of 4 hammering workers at random moments, 20 times, and start
    a new one each time. ``fork-inherit`` children use the parent's own zone
    object (gunicorn style: a lock identity inherited across fork must not
    make a dead child's lock look alive)."""
    ctx = mp.get_context("spawn" if mode == "spawn-attach" else "fork")
    rng = random.Random(20240601)
    zone = zone_cls(zone_name, **OPTS)
    inherited = zone if mode == "fork-inherit" else None
    slots = HAMMERS + KILLS
    progress = ctx.RawArray("q", slots)
    deep = ctx.RawArray("q", slots)
    shallow = ctx.RawArray("q", slots)
    worst = ctx.RawArray("d", slots)
    deadline = ctx.RawValue("d", time.time() + 300)  # a bound, not a pace: 10-15 s here, slower on 3.13t
    live: dict[int, Any] = {}
    next_slot = 0

    def spawn_one() -> None:
        nonlocal next_slot
        started = ctx.Event()
        slot = next_slot
        next_slot += 1
        proc = children.start(
            ctx,
            zw.hammer_worker,
            zone_name,
            OPTS,
            slot,
            progress,
            deep,
            shallow,
            worst,
            started,
            deadline,
            inherited,
        )
        assert started.wait(30), f"hammer {slot} never started"
        live[slot] = proc

    t_start = time.perf_counter()
    for _ in range(HAMMERS):
        spawn_one()
    stalls: list[float] = []
    stuck: list[tuple[int, int, int]] = []
    for k in range(KILLS):
        time.sleep(rng.uniform(0.02, 0.2))
        victim = rng.choice(sorted(live))
        proc = live.pop(victim)
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        assert proc.exitcode == -signal.SIGKILL
        before = {s: progress[s] for s in live}
        t0 = time.perf_counter()
        pending = set(live)
        while pending and time.perf_counter() - t0 < STALL_BOUND_S:
            for s in list(pending):
                if progress[s] >= before[s] + NEXT_DECISIONS:
                    pending.discard(s)
                    stalls.append(time.perf_counter() - t0)
            time.sleep(0.0005)
        stuck.extend((k, s, progress[s] - before[s]) for s in pending)
        if stuck:
            break
        spawn_one()
    # stop the survivors cleanly (no more kills), then count what the zone holds
    deadline.value = 0.0
    survivors = list(live.values())
    join_all(survivors, 15)
    elapsed = time.perf_counter() - t_start
    assert not stuck, (
        f"survivors made fewer than {NEXT_DECISIONS} decisions within {STALL_BOUND_S}s after a kill "
        f"(kill #, slot, decisions made): {stuck}"
    )
    q = mp.get_context("spawn").Queue()
    reporter = children.start(mp.get_context("spawn"), zw.zone_report, zone_name, OPTS, q)
    status, report = get(q, 30)
    join_all([reporter])
    assert status == "ok", report
    observed_deep, observed_shallow = sum(deep), sum(shallow)
    spent_deep, spent_shallow = report["deep_spent"], report["shallow_spent"]
    # every admission seen by a worker is charged; at most one in-flight
    # decision per kill is charged without its worker seeing the answer
    assert observed_deep <= spent_deep <= observed_deep + KILLS, (observed_deep, spent_deep)
    assert observed_shallow <= spent_shallow <= observed_shallow + KILLS * zw.SHALLOW_MAX_COST, (
        observed_shallow,
        spent_shallow,
    )
    assert observed_shallow <= zw.SHALLOW_CAP
    assert report["len"] == 2 + len(zw.HOT_KEYS)
    recoveries = {k: v for k, v in {**report["stats"], **report["metrics"]}.items() if "recover" in k}
    print(
        f"\n[{mode}] {KILLS} kills in {elapsed:.1f}s, {sum(progress)} decisions; "
        f"worst stall to {NEXT_DECISIONS} more decisions {max(stalls) * 1e3:.1f} ms "
        f"(median {sorted(stalls)[len(stalls) // 2] * 1e3:.1f} ms); "
        f"worst single call {max(worst) * 1e3:.1f} ms; deep admitted {observed_deep} charged {spent_deep}; "
        f"shallow admitted {observed_shallow} charged {spent_shallow} of {zw.SHALLOW_CAP}; "
        f"recoveries {recoveries}\n  stats {report['stats']}\n  metrics {report['metrics']}"
    )
    zone.close()


# ---------------------------------------------------------------------------
# 3b. SIGKILL while holding a stripe lock, made certain
#
# A random kill rarely lands inside a lock (the lock is held for well under a
# microsecond of each decision). These tests stop the victim with SIGSTOP at
# random moments until the segment shows it holding a stripe lock, and only
# then SIGKILL it, so the takeover-and-repair path runs every time. They read
# the segment's layout (version 2, _zone.pxd): the stripes' offset in the
# header, then per 128-byte stripe the lock word (the owner's pid in its high
# half) and the undo flag (a decision in flight under the lock).

ZONE_MAGIC = 0x314E4F5A4C4E414E
STRIPE_BYTES = 128


class StripeLocks:
    """A read-only mapping of a zone's segment: who holds which stripe lock."""

    def __init__(self, zone: Any) -> None:
        path = "/dev/shm" + zone.segment_name
        if not os.path.exists(path):
            pytest.skip("no /dev/shm view of the segment on this platform")
        with open(path, "rb") as f:
            self.map = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
        magic, version = struct.unpack_from("<QI", self.map, 0)
        if magic != ZONE_MAGIC or version != 2:
            self.map.close()
            pytest.skip(f"zone layout {version} (magic {magic:#x}): this white-box test reads layout 2")
        self.stripes = struct.unpack_from("<I", self.map, 48)[0]
        self.offset = struct.unpack_from("<Q", self.map, 136)[0]
        assert self.stripes == zone.stripes
        assert self.offset == 4096 + 1024 * 256  # header, then 1,024 namespaces of 256 bytes

    def held_by(self, pid: int) -> list[tuple[int, int]]:
        """(stripe, undo_valid) of every stripe lock ``pid`` holds."""
        held = []
        for i in range(self.stripes):
            at = self.offset + STRIPE_BYTES * i
            if struct.unpack_from("<Q", self.map, at)[0] >> 32 == pid:
                held.append((i, struct.unpack_from("<I", self.map, at + 8)[0]))  # ZoneStripe.undo_valid
        return held

    def close(self) -> None:
        self.map.close()


def stop_while_holding(proc: Any, locks: StripeLocks, rng: random.Random, in_flight: bool) -> tuple[int, Any]:
    """SIGSTOP ``proc`` at random moments until it is stopped holding a stripe
    lock (``in_flight``: with its undo copy armed, a decision half made);
    returns (tries, what it holds) and leaves it stopped."""
    end = time.monotonic() + 20.0
    tries = 0
    while time.monotonic() < end:
        tries += 1
        time.sleep(rng.uniform(0.0, 0.002))
        os.kill(proc.pid, signal.SIGSTOP)
        os.waitpid(proc.pid, os.WUNTRACED)
        held = locks.held_by(proc.pid)
        if held and (not in_flight or any(undo for _, undo in held)):
            return tries, held
        os.kill(proc.pid, signal.SIGCONT)
    pytest.fail(f"never caught the victim holding a stripe lock in {tries} tries")


ROLLBACK_ROUNDS = 3


@pytest.mark.parametrize("class_name", ["FixedWindowCounter", "TokenBucket", "SlidingWindowLog"])
def test_sigkill_with_a_decision_in_flight_is_rolled_back(zone_cls, zone_name, children, class_name):
    """Killed with its undo copy armed, the victim's decision was never
    answered: whoever takes the lock over rolls it back, so the key is
    charged exactly what the victims saw admitted, plus the parent's asks."""
    ctx = mp.get_context("spawn")
    rng = random.Random(class_name)
    opts = {**OPTS, "arena_bytes": 32 << 20}  # a sliding log of 10**6 stamps, doubling as it grows
    cap = 1_000_000 if class_name == "SlidingWindowLog" else 10**9
    zone = zone_cls(zone_name, **opts)
    locks = StripeLocks(zone)
    lim = frozen(zone, class_name, cap, 3600.0)
    observed = asked = 0
    tries = []
    try:
        for _ in range(ROLLBACK_ROUNDS):
            admitted, started = ctx.RawArray("q", 1), ctx.Event()
            victim = children.start(
                ctx, zw.one_key_victim, zone_name, opts, class_name, cap, admitted, started
            )
            assert started.wait(30)
            n, held = stop_while_holding(victim, locks, rng, in_flight=True)
            tries.append(n)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(5)
            observed += admitted[0]
            repaired = zone.stats()["stripes_repaired"]  # takes every lock: the repair happens here
            assert repaired >= len(tries), (repaired, held)
            assert lim.allow("victim").allowed or zw.spent(lim, "victim") == cap
            asked += 1
            assert zw.spent(lim, "victim") == min(cap, observed + asked), (observed, asked, held)
        stats = zone.stats()
        assert stats["lock_recoveries"] >= ROLLBACK_ROUNDS
        assert len(zone) == 1
    finally:
        locks.close()
    print(
        f"\n[{class_name}] {ROLLBACK_ROUNDS} victims killed mid-decision (caught after {tries} stops); "
        f"charged {zw.spent(lim, 'victim')} = admitted {observed} + parent {asked}; stats {stats}"
    )
    zone.close()


REAP_AFTER_S = 1.0


@pytest.mark.skipif(
    not sys.platform.startswith("linux"),
    reason="zombies are told from /proc (docs/shared_memory.md: elsewhere a waiter waits until the reap)",
)
def test_a_dead_holder_not_yet_reaped_does_not_stall_the_others(zone_cls, zone_name, children):
    ctx = mp.get_context("spawn")
    cap = 10**9
    zone = zone_cls(zone_name, **OPTS)
    locks = StripeLocks(zone)
    admitted, started, go, q = ctx.RawArray("q", 1), ctx.Event(), ctx.Event(), ctx.Queue()
    victim = children.start(
        ctx, zw.one_key_victim, zone_name, OPTS, "FixedWindowCounter", cap, admitted, started
    )
    sibling = children.start(ctx, zw.timed_decision, zone_name, OPTS, "FixedWindowCounter", cap, go, q)
    assert started.wait(30)
    try:
        stop_while_holding(victim, locks, random.Random(7), in_flight=False)
    finally:
        locks.close()
    os.kill(victim.pid, signal.SIGKILL)  # dead, and left unreaped for REAP_AFTER_S
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        with open(f"/proc/{victim.pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break
        time.sleep(0.001)
    go.set()
    time.sleep(REAP_AFTER_S)  # the sibling waits on the dead holder's lock meanwhile
    victim.join(5)
    status, elapsed = get(q)
    join_all([sibling])
    assert status == "ok", elapsed
    print(f"\nthe sibling's one decision took {elapsed:.3f}s while the dead holder was unreaped")
    assert elapsed < REAP_AFTER_S / 2, f"a waiter stalled {elapsed:.3f}s behind a dead (zombie) lock holder"
    zone.close()


# ---------------------------------------------------------------------------
# 4. lifecycle


def test_child_attaches_and_closes_while_parent_decides(zone_cls, zone_name, children):
    """A spawned child attaches, spends from the shared key and closes while
    the parent keeps deciding; the parent's zone is untouched by the child
    leaving, and the two spent one budget."""
    ctx = mp.get_context("spawn")
    zone = zone_cls(zone_name, **OPTS)
    assert zone.created and zone.name == zone_name
    limit, parent_share, child_asks = 3_000, 1_000, 2_000
    lim = frozen(zone, "FixedWindowCounter", limit)
    busy = frozen(zone, "TokenBucket", 10**9)
    go, q = ctx.Event(), ctx.Queue()
    child = children.start(ctx, zw.attach_decide_close, zone_name, OPTS, "k", limit, child_asks, go, q)
    assert get(q) == ("attached", False)
    assert sorted(zone.attached_pids()) == sorted([os.getpid(), child.pid])
    go.set()
    mine = asked = other = 0
    answer = None
    deadline = time.monotonic() + JOIN_S
    while answer is None and time.monotonic() < deadline:
        if asked < parent_share:  # at most parent_share asks of the shared key before the child is done
            mine += sum(lim.allow("k").allowed for _ in range(50))
            asked += 50
        other += sum(busy.allow("p").allowed for _ in range(50))
        try:
            answer = q.get_nowait()
        except queue_mod.Empty:
            pass
    assert answer is not None and answer[0] == "done", answer
    join_all([child])
    # the child has closed and gone: the parent's mapping keeps working
    mine += sum(lim.allow("k").allowed for _ in range(limit))
    assert answer[1] == child_asks  # the budget had room for every one of its asks
    assert mine + answer[1] == limit, (mine, answer[1])
    assert zone.attached_pids() == [os.getpid()]
    assert len(zone) == 2 and not lim.allow("k").allowed
    assert other > 0 and sum(frozen(zone, "GCRA", 10).allow("fresh").allowed for _ in range(20)) == 10
    print(
        f"\nparent admitted {mine} (and {other} on its own key), child {answer[1]}; "
        f"a limiter of the child's used after close: {answer[2]}"
    )
    zone.close()


@pytest.mark.parametrize(
    ("param", "value"),
    [("max_keys", 2048), ("stripes", 32), ("max_key_bytes", 2048), ("on_full", "deny_new")],
)
def test_mismatched_attach_from_another_process(zone_cls, zone_name, children, param, value):
    import nanolimit

    ctx = mp.get_context("spawn")
    zone = zone_cls(zone_name, **OPTS)
    q = ctx.Queue()
    same = children.start(ctx, zw.try_attach, zone_name, OPTS, q)
    assert get(q) == ("attached", False)
    join_all([same])
    other = children.start(ctx, zw.try_attach, zone_name, {**OPTS, param: value}, q)
    answer = get(q)
    join_all([other])
    error = nanolimit.ValidationError
    assert answer[:2] == ("raised", f"{error.__module__}.{error.__qualname__}"), answer
    assert param in answer[2], answer
    # the refused attach changed nothing: the zone still works for everyone
    lim = frozen(zone, "GCRA", 5)
    assert sum(lim.allow("x").allowed for _ in range(10)) == 5
    zone.close()


def test_unlink_while_attached(zone_cls, zone_name, children):
    ctx = mp.get_context("spawn")
    limit = 1_000
    old = zone_cls(zone_name, **OPTS)
    go, q = ctx.Event(), ctx.Queue()
    child = children.start(ctx, zw.attach_decide_close, zone_name, OPTS, "k", limit, 1_500, go, q)
    assert get(q) == ("attached", False)
    old.unlink()
    assert zone_cls.unlink_segment(zone_name) is False  # already gone
    go.set()
    # parent and child are both still attached to the unlinked segment: one budget
    lim_old = frozen(old, "FixedWindowCounter", limit)
    mine = sum(lim_old.allow("k").allowed for _ in range(1_500))
    answer = get(q)
    assert answer[0] == "done", answer
    join_all([child])
    assert mine + answer[1] == limit, (mine, answer[1])
    # the name is free again: a new zone is created fresh and empty
    new = zone_cls(zone_name, **OPTS)
    assert new.created
    assert len(new) == 0 and new.keys() == []
    lim_new = frozen(new, "FixedWindowCounter", limit)
    assert sum(lim_new.allow("k").allowed for _ in range(1_500)) == limit
    # and a process attaching now gets the new segment, not the unlinked one
    q2, go2 = ctx.Queue(), ctx.Event()
    late = children.start(ctx, zw.attach_decide_close, zone_name, OPTS, "k", limit, 10, go2, q2)
    assert get(q2) == ("attached", False)
    go2.set()
    answer2 = get(q2)
    join_all([late])
    assert answer2[:2] == ("done", 0), answer2
    assert not lim_old.allow("k").allowed  # the old segment still works for the parent
    old.close()
    new.close()


@pytest.mark.parametrize("if_stale", ["reuse", "reset"])
def test_stale_segment_of_a_killed_creator(zone_cls, zone_name, children, if_stale):
    ctx = mp.get_context("spawn")
    limit, spend = 500, 300
    ready = ctx.Event()
    creator = children.start(ctx, zw.stale_creator, zone_name, OPTS, "spent", limit, spend, ready)
    assert ready.wait(30), "the creator never got ready"
    time.sleep(0.05)  # let it decide on its busy keys for a while
    os.kill(creator.pid, signal.SIGKILL)
    creator.join(5)
    assert creator.exitcode == -signal.SIGKILL
    zone = zone_cls(zone_name, **OPTS, if_stale=if_stale)
    stats = zone.stats()
    lim = frozen(zone, "FixedWindowCounter", limit)
    got = sum(lim.allow("spent").allowed for _ in range(2 * limit))
    if if_stale == "reuse":
        assert zone.created is False
        assert len(zone) >= 1
        assert got == limit - spend  # the dead creator's spending is still there
        # every stripe the creator used answers again: no lock is left held
        busy = zw.limiter("TokenBucket", 50, 1.0, zone, None, rule="busy")
        assert all(busy.allow(f"busy-{i}").limit == 50 for i in range(8))
        assert len(busy.allow_many([f"busy-{i}" for i in range(8)] * 4)) == 32
    else:
        assert zone.created is True
        assert len(zone) == 1  # only what this test just asked for
        assert got == limit
    print(f"\nif_stale={if_stale!r}: admitted {got} after the creator's death; stats at attach {stats}")
    zone.close()


def test_closing_a_second_object_keeps_the_process_registered(zone_cls, zone_name, children):
    """The registry holds one slot per process. A second object of a
    deciding process (an ``attach`` to read metrics), closed, had cleared
    it: a later ``if_stale="reset"`` then took the live zone for stale and
    made a new one, and the key was admitted twice its limit (10 + 10)."""
    zone = zone_cls(zone_name, **OPTS)
    lim = frozen(zone, "FixedWindowCounter", 10)
    assert sum(lim.allow("k").allowed for _ in range(4)) == 4
    probe = zone_cls.attach(zone_name)
    probe.close()
    assert os.getpid() in zone.attached_pids()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    join_all([children.start(ctx, zw.reset_and_spend, zone_name, OPTS, "k", 10, queue)])
    assert get(queue) == (False, 6)  # the live zone kept, and its budget
    assert not lim.allow("k").allowed
    zone.close()  # the last object of this process: it leaves, and the zone is stale now
    join_all([children.start(ctx, zw.reset_and_spend, zone_name, OPTS, "k", 10, queue)])
    assert get(queue) == (True, 10)


def test_a_second_object_never_resets_its_own_process_zone(zone_cls, zone_name):
    """``if_stale="reset"`` twice in one process (two apps, a factory built
    again): the first object is attached and deciding, so the zone is live,
    not stale (each object had admitted the whole limit on its own zone)."""
    first = zone_cls(zone_name, **OPTS, if_stale="reset")
    assert sum(frozen(first, "FixedWindowCounter", 10).allow("k").allowed for _ in range(20)) == 10
    second = zone_cls(zone_name, **OPTS, if_stale="reset")
    assert second.created is False
    assert sum(frozen(second, "FixedWindowCounter", 10).allow("k").allowed for _ in range(20)) == 0
    second.close()
    first.close()


@pytest.mark.parametrize(("max_keys", "stripes", "wanted"), [(64 * 0xFFFFFE + 1, 64, 128), (0xFFFFFF, 1, 2)])
def test_more_keys_a_stripe_than_it_can_index_is_refused(zone_cls, zone_name, max_keys, stripes, wanted):
    """A stripe's index holds 24-bit positions: 2**30 keys over the default
    64 stripes had put 2**24 in each, and the last position wrapped to 0
    (a corrupt stripe, a key dropped). Refused, naming the stripes to ask for."""
    from nanolimit import ValidationError

    with pytest.raises(ValidationError, match=f"stripes={wanted} or more"):
        zone_cls(zone_name, max_keys=max_keys, stripes=stripes)


def test_pool_workers_share_one_budget(zone_cls, zone_name):
    ctx = mp.get_context("spawn")
    zone = zone_cls(zone_name, **OPTS)
    limit = 1_500
    tasks = [("pooled", limit, 300)] * 8  # 450 asks each, 3,600 in all
    # the zone object itself goes to the workers: it pickles as (name, options)
    pool = ctx.Pool(4, initializer=zw.pool_init, initargs=(zone, ctx.Barrier(4)))
    try:
        results = pool.map_async(zw.pool_decide, tasks, chunksize=1).get(timeout=60)
    finally:
        pool.terminate()
        pool.join()
    assert sum(got for _, got, _ in results) == limit
    assert not any(created for _, _, created in results)
    assert len({pid for pid, _, _ in results}) == 4
    assert not frozen(zone, "SlidingWindowLog", limit).peek("pooled").allowed
    zone.close()


def test_fork_after_create_shares_one_budget(zone_cls, zone_name, children):
    """gunicorn's model: the master creates the zone and its limiter, then
    forks; every worker decides on the inherited objects."""
    zone = zone_cls(zone_name, **OPTS)
    limit, per_process, workers = 2_000, 1_500, 4
    lim = frozen(zone, "GCRA", limit)
    go_r, go_w = os.pipe()
    res_r, res_w = os.pipe()
    for _ in range(workers):
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                zw.bound_self(60)
                os.close(go_w)
                os.close(res_r)
                os.read(go_r, 1)
                got = 0
                for i in range(per_process // 10):
                    if i % 2:
                        got += lim.allow_many(["forked"] * 10).allowed_count
                    else:
                        got += sum(lim.allow("forked").allowed for _ in range(10))
                os.write(res_w, f"{os.getpid()} {got}\n".encode())
                code = 0
            finally:
                os._exit(code)
        children.pids.append(pid)
    os.close(go_r)
    os.close(res_w)
    os.write(go_w, b"g" * workers)
    mine = sum(lim.allow("forked").allowed for _ in range(per_process))
    data = b""
    end = time.monotonic() + JOIN_S
    while data.count(b"\n") < workers and time.monotonic() < end:
        ready, _, _ = select.select([res_r], [], [], 0.5)
        if ready:
            chunk = os.read(res_r, 4096)
            if not chunk:
                break
            data += chunk
    os.close(go_w)
    os.close(res_r)
    lines = data.decode().split()
    assert len(lines) == 2 * workers, f"answers from forked workers: {data!r}"
    theirs = [int(n) for n in lines[1::2]]
    assert mine + sum(theirs) == limit, (mine, theirs)
    for pid in list(children.pids):
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        children.pids.remove(pid)
    zone.close()


def test_fork_while_a_thread_registers_a_rule_leaves_the_child_free(zone_cls, zone_name, children):
    """gunicorn --preload with a thread in the master: a fork while a thread
    is registering a rule (holding the zone's per-process namespace lock,
    here while it waits on the registry lock) must not leave that lock held
    in the child, where no thread will ever release it. Before the fix the
    child's first new rule hung until its alarm killed it."""
    from nanolimit import FixedWindowCounter

    zone = zone_cls(zone_name, **OPTS)
    with open("/dev/shm" + zone.segment_name, "r+b") as f:
        seg = mmap.mmap(f.fileno(), 0)
    try:
        me = struct.unpack_from("<Q", seg, 392)[0]  # processes[0]: this process's token
        assert me >> 32 == os.getpid()
        struct.pack_into("<Q", seg, 168, me)  # the registry lock, held as if by another thread
        registering = threading.Thread(target=FixedWindowCounter, args=(5, 60, zone), kwargs={"rule": "t"})
        registering.start()
        time.sleep(0.3)  # it waits on the registry lock, holding the namespace lock
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never return into pytest
            code = 1
            try:
                zw.bound_self(20)
                os.close(r)
                lim = FixedWindowCounter(5, 60, zone, rule="child")
                os.write(w, str(sum(lim.allow("k").allowed for _ in range(10))).encode())
                code = 0
            finally:
                os._exit(code)
        children.pids.append(pid)
        os.close(w)
        struct.pack_into("<Q", seg, 168, 0)  # the registry lock let go
        registering.join(10)
        ready, _, _ = select.select([r], [], [], 15)
        answer = os.read(r, 64) if ready else b""
        os.close(r)
        assert answer == b"5", f"the forked child answered {answer!r} (hung on the namespace lock)"
    finally:
        seg.close()
    zone.close()


def test_concurrent_first_attach_creates_one_zone(zone_cls, zone_names, children):
    """8 processes call SharedMemoryStorage(name) at the same moment on a
    name nobody made yet (a large zone: its creation takes a while): exactly
    one creates it, all share its budget."""
    ctx = mp.get_context("spawn")
    opts = {"max_keys": 200_000}
    for _ in range(2):
        name = zone_names()
        barrier, q = ctx.Barrier(PROCESSES), ctx.Queue()
        procs = [
            children.start(ctx, zw.create_race, name, opts, barrier, "raced", 1_000, 500, q)
            for _ in range(PROCESSES)
        ]
        answers = [get(q, 60) for _ in procs]
        join_all(procs)
        errors = [a[1] for a in answers if a[0] != "ok"]
        assert not errors, "\n".join(errors)
        assert sum(created for _, created, _ in answers) == 1, answers
        assert sum(got for _, _, got in answers) == 1_000, answers


def test_processes_the_full_registry_cannot_record_keep_the_zone_live(zone_cls, zone_name, children):
    """130 workers attached at once: the registry records 128, and counts the
    other 2. Once the 128 have closed, the 2 still decide, so an
    ``if_stale="reset"`` attach must keep the zone (it had reset it, and the
    two kept spending a budget the new zone handed out again)."""
    zone_cls(zone_name, **OPTS).close()  # made, then left: forked workers inherit no open zone
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    leave_recorded, leave_all = ctx.Event(), ctx.Event()
    try:
        workers = [
            children.start(ctx, zw.hold_attached, zone_name, OPTS, q, leave_recorded, leave_all)
            for _ in range(130)
        ]
        said = dict(get(q, 60.0) for _ in workers)
        assert all(isinstance(recorded, bool) for recorded in said.values()), said
        unrecorded = sorted(pid for pid, recorded in said.items() if not recorded)
        assert len(unrecorded) == 2, unrecorded
        leave_recorded.set()
        join_all([w for w in workers if w.pid not in unrecorded], 60.0)
        reset = {**OPTS, "if_stale": "reset"}
        answers = mp.get_context("spawn").Queue()
        child = children.start(mp.get_context("spawn"), zw.try_attach, zone_name, reset, answers)
        assert get(answers) == ("attached", False)  # kept: two processes still decide on it
        join_all([child])
        zone = zone_cls(zone_name, **OPTS)
        assert zone.metrics()["processes_unrecorded"] == 2
        assert zw.spent(frozen(zone, "FixedWindowCounter", 1_000_000, 3600.0), "visits") == 130
        zone.close()
    finally:
        leave_recorded.set()
        leave_all.set()
    join_all(workers, 60.0)
    # all gone, each closed: nothing counted, and the zone is stale again
    child = children.start(mp.get_context("spawn"), zw.try_attach, zone_name, reset, answers)
    assert get(answers) == ("attached", True)
    join_all([child])


def test_registry_outlives_many_short_lived_workers(zone_cls, zone_name, children):
    """More workers come and go than the registry has slots (128): the dead
    ones' slots are reused, and staleness still follows the live ones."""
    ctx = mp.get_context("fork")
    zone = zone_cls(zone_name, **OPTS)
    workers = 140
    for first in range(0, workers, 10):
        group = [
            children.start(ctx, zw.attach_once, zone_name, OPTS, i % 2 == 0) for i in range(first, first + 10)
        ]
        join_all(group)
    assert zone.attached_pids() == [os.getpid()]
    lim = frozen(zone, "FixedWindowCounter", 1_000_000, 3600.0)
    assert zw.spent(lim, "visits") == workers
    q = mp.get_context("spawn").Queue()
    reset = {**OPTS, "if_stale": "reset"}
    # the parent is attached and alive: the zone is not stale, a reset attach keeps it
    child = children.start(mp.get_context("spawn"), zw.try_attach, zone_name, reset, q)
    assert get(q) == ("attached", False)
    join_all([child])
    assert zw.spent(lim, "visits") == workers
    zone.close()  # now no live process is attached: stale, and a reset attach starts afresh
    child = children.start(mp.get_context("spawn"), zw.try_attach, zone_name, reset, q)
    assert get(q) == ("attached", True)
    join_all([child])
