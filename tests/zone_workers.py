"""Child-process bodies for ``test_zone_processes`` (SharedMemoryStorage).

Everything here is a top-level function or class, so the ``spawn`` start
method can import it by name (``tests/`` is on the parent's ``sys.path``,
which spawn hands to its children). Every body bounds itself: an
``alarm`` ends the process even when it is stuck in native code, barriers
and events wait with a timeout, and the long-running hammer stops at its
deadline or as soon as its parent is gone.

Results travel back through queues and shared ``RawArray`` slots that only
the owning process writes.
"""

from __future__ import annotations

import os
import random
import signal
import time
import traceback
from typing import Any

FROZEN_NOW = 1_000_000.0
# no child outlives this, whatever happens to the test that started it
CHILD_ALARM_S = 400  # a bound, not a pace: the kill test takes 10-15 s here, ~200 s on 3.13t with 2 cores
WAIT_S = 60.0

# the hammer's keys and budgets (test_zone_processes reads the same names)
DEEP_KEY = "deep"  # TokenBucket, frozen clock, never exhausted: exact accounting
DEEP_CAP = 1_000_000_000
SHALLOW_KEY = "shallow"  # FixedWindowCounter, frozen clock, exhausted during the run
SHALLOW_CAP = 20_000
SHALLOW_MAX_COST = 3
HOT_KEYS = tuple(f"hot-{i}" for i in range(4))  # GCRA on the wall clock


class FrozenClock:
    """A clock that never moves: the same reading in every process."""

    def __init__(self, now: float = FROZEN_NOW) -> None:
        self._now = now

    def now(self) -> float:
        return self._now


class SharedClock:
    """One clock for every process: a shared double the test advances."""

    def __init__(self, value: Any) -> None:
        self.value = value  # a multiprocessing RawValue('d')

    def now(self) -> float:
        return float(self.value.value)


def bound_self(seconds: int = CHILD_ALARM_S) -> None:
    """SIGALRM's default action ends the process, even inside a C call."""
    signal.signal(signal.SIGALRM, signal.SIG_DFL)
    signal.alarm(seconds)


def open_zone(name: str, opts: dict[str, Any]) -> Any:
    from nanolimit._core import SharedMemoryStorage

    return SharedMemoryStorage(name, **opts)


def spend(lim: Any, key: str, requests: int, batch: int) -> int:
    """Ask ``requests`` times for ``key`` (in ``allow_many`` batches of
    ``batch`` when it is positive); returns how many were admitted."""
    if batch > 0:
        keys = [key] * batch
        return sum(lim.allow_many(keys).allowed_count for _ in range(requests // batch))
    return sum(1 for _ in range(requests) if lim.allow(key).allowed)


def limiter(class_name: str, limit: int, window: float, zone: Any, clock: Any, rule: str = "") -> Any:
    import nanolimit._core as core

    return getattr(core, class_name)(limit, window, storage=zone, clock=clock, rule=rule or class_name)


# ---------------------------------------------------------------------------
# 1. exactness: many processes, one key, a frozen clock


def exact_worker(
    name: str,
    opts: dict[str, Any],
    barrier: Any,
    queue: Any,
    slot: int,
    plan: list[tuple[str, int, str]],
    per_phase: int,
    batch: int,
) -> None:
    """For each (class, limit, key) of ``plan``: wait for every sibling at
    ``barrier``, then ask ``per_phase`` times for ``key`` (one by one, or
    ``allow_many`` batches of ``batch`` when batch > 0). Puts
    ``(slot, {key: admitted}, info)`` on ``queue``, or ``(slot, None, error)``."""
    bound_self()
    try:
        zone = open_zone(name, opts)
        clock = FrozenClock()
        admitted: dict[str, int] = {}
        for class_name, limit, key in plan:
            lim = limiter(class_name, limit, 60.0, zone, clock)
            barrier.wait(timeout=WAIT_S)
            admitted[key] = spend(lim, key, per_phase, batch)
        info = {"created": zone.created, "pid": os.getpid()}
        zone.close()
        queue.put((slot, admitted, info))
    except BaseException:
        queue.put((slot, None, traceback.format_exc()))


# ---------------------------------------------------------------------------
# 2. a moving clock shared by every process


def clock_worker(
    name: str,
    opts: dict[str, Any],
    value: Any,
    barrier: Any,
    counts: Any,
    errors: Any,
    slot: int,
    plan: list[tuple[str, int, float, str, int]],
    per_step: int,
    batch: int,
) -> None:
    """For each (class, limit, window, key, steps) of ``plan`` and each step:
    wait at ``barrier`` (the test has set the clock), ask ``per_step`` times,
    write what was admitted to ``counts[slot]``, wait at ``barrier`` again
    (the test reads the counts, then moves the clock)."""
    bound_self()
    try:
        zone = open_zone(name, opts)
        clock = SharedClock(value)
        for class_name, limit, window, key, steps in plan:
            lim = limiter(class_name, limit, window, zone, clock)
            for _ in range(steps):
                barrier.wait(timeout=WAIT_S)
                counts[slot] = spend(lim, key, per_step, batch)
                barrier.wait(timeout=WAIT_S)
        zone.close()
    except BaseException:
        errors[slot] = 1
        traceback.print_exc()
        barrier.abort()


# ---------------------------------------------------------------------------
# 3. hammering a zone while siblings are SIGKILLed


def hammer_worker(
    name: str,
    opts: dict[str, Any],
    slot: int,
    progress: Any,
    deep_admitted: Any,
    shallow_admitted: Any,
    worst: Any,
    started: Any,
    deadline: Any,
    zone: Any = None,
) -> None:
    """Decide as fast as possible until ``deadline.value`` (wall time, a shared
    double the test sets to 0 to stop everyone) or until the
    parent is gone: the deep key, the shallow key (costs 1..3) and the hot
    keys (one by one and in ``allow_many`` batches). ``progress[slot]`` counts
    decisions; ``*_admitted[slot]`` what was admitted on the frozen keys,
    written right after each decision (a SIGKILL in between loses at most one
    decision's worth); ``worst[slot]`` the longest single call, in seconds.
    ``zone`` is the parent's own object when the child was forked with it
    (gunicorn style); otherwise the child attaches by name."""
    bound_self()
    parent = os.getppid()
    if zone is None:
        zone = open_zone(name, opts)
    frozen = FrozenClock()
    deep = limiter("TokenBucket", DEEP_CAP, 3600.0, zone, frozen, rule="deep")
    shallow = limiter("FixedWindowCounter", SHALLOW_CAP, 3600.0, zone, frozen, rule="shallow")
    hot = limiter("GCRA", 1000, 1.0, zone, None, rule="hot")
    batch = list(HOT_KEYS) * 4
    rng = random.Random(slot)
    perf = time.perf_counter
    longest = 0.0
    started.set()
    i = 0
    while True:
        i += 1
        if (i & 255) == 0:
            if os.getppid() != parent or time.time() > deadline.value:
                return
            worst[slot] = longest
        t0 = perf()
        if deep.allow(DEEP_KEY).allowed:
            deep_admitted[slot] += 1
        t1 = perf()
        cost = 1 + (i % SHALLOW_MAX_COST)
        if shallow.allow(SHALLOW_KEY, cost).allowed:
            shallow_admitted[slot] += cost
        t2 = perf()
        if (i & 15) == 0:
            hot.allow_many(batch)
            n = 2 + len(batch)
        else:
            hot.allow(HOT_KEYS[rng.randrange(len(HOT_KEYS))])
            n = 3
        t3 = perf()
        progress[slot] += n
        longest = max(longest, t1 - t0, t2 - t1, t3 - t2)


def spent(lim: Any, key: str) -> int:
    """Units of ``key``'s budget charged so far on a frozen clock, read from
    its state (``peek().remaining`` would count the peeked request too)."""
    state = lim.state(key)
    if state is None:
        return 0
    if state.level is not None:  # a token bucket: level is what is left (not for LeakyBucket)
        return lim.capacity - round(state.level)
    if state.log is not None:
        return len(state.log)
    return int(state.count)


def zone_report(name: str, opts: dict[str, Any], queue: Any) -> None:
    """Attach (a fresh process, so a fresh lock identity) and report what the
    hammered zone holds: what the frozen keys were charged, stats, metrics."""
    bound_self()
    try:
        zone = open_zone(name, opts)
        frozen = FrozenClock()
        deep = limiter("TokenBucket", DEEP_CAP, 3600.0, zone, frozen, rule="deep")
        shallow = limiter("FixedWindowCounter", SHALLOW_CAP, 3600.0, zone, frozen, rule="shallow")
        out = {
            "deep_spent": spent(deep, DEEP_KEY),
            "shallow_spent": spent(shallow, SHALLOW_KEY),
            "len": len(zone),
            "stats": dict(zone.stats()),
            "metrics": dict(zone.metrics()),
        }
        zone.close()
        queue.put(("ok", out))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def one_key_victim(
    name: str, opts: dict[str, Any], class_name: str, cap: int, admitted: Any, started: Any
) -> None:
    """Ask for one key on a frozen clock as fast as possible, forever;
    ``admitted[0]`` counts every admission as soon as ``allow`` returns (the
    test stops and kills this process in the middle of a decision)."""
    bound_self()
    zone = open_zone(name, opts)
    lim = limiter(class_name, cap, 3600.0, zone, FrozenClock())
    allow = lim.allow
    started.set()
    while True:
        if allow("victim").allowed:
            admitted[0] += 1


def timed_decision(name: str, opts: dict[str, Any], class_name: str, cap: int, go: Any, queue: Any) -> None:
    """Attach, wait for ``go``, then time one decision on the victim's key."""
    bound_self()
    try:
        zone = open_zone(name, opts)
        lim = limiter(class_name, cap, 3600.0, zone, FrozenClock())
        if not go.wait(WAIT_S):
            raise TimeoutError("never told to go")
        t0 = time.perf_counter()
        lim.allow("victim")
        queue.put(("ok", time.perf_counter() - t0))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def create_race(
    name: str, opts: dict[str, Any], barrier: Any, key: str, limit: int, n: int, queue: Any
) -> None:
    """Every sibling calls ``SharedMemoryStorage(name)`` at the same moment;
    then all ask ``n`` times for ``key``. Puts (created, admitted)."""
    bound_self()
    try:
        barrier.wait(timeout=WAIT_S)
        zone = open_zone(name, opts)
        barrier.wait(timeout=WAIT_S)
        lim = limiter("GCRA", limit, 60.0, zone, FrozenClock())
        got = sum(lim.allow(key).allowed for _ in range(n))
        queue.put(("ok", zone.created, got))
    except BaseException:
        queue.put(("error", traceback.format_exc(), 0))


def attach_once(name: str, opts: dict[str, Any], close: bool) -> None:
    """A short-lived worker: attach, decide once, leave (closing or not)."""
    bound_self(30)
    zone = open_zone(name, opts)
    limiter("FixedWindowCounter", 1_000_000, 3600.0, zone, FrozenClock()).allow("visits")
    if close:
        zone.close()


def hold_attached(name: str, opts: dict[str, Any], queue: Any, leave_recorded: Any, leave_all: Any) -> None:
    """Attach, spend one ``visits``, say ``(pid, recorded in the registry)``,
    stay attached until told to leave (a recorded worker at
    ``leave_recorded``, the others at ``leave_all``), then close."""
    bound_self(60)
    try:
        zone = open_zone(name, opts)
        limiter("FixedWindowCounter", 1_000_000, 3600.0, zone, FrozenClock()).allow("visits")
        recorded = os.getpid() in zone.attached_pids()
        queue.put((os.getpid(), recorded))
        (leave_recorded if recorded else leave_all).wait(50)
        zone.close()
    except BaseException:
        queue.put((os.getpid(), traceback.format_exc()))


# ---------------------------------------------------------------------------
# 4. lifecycle


def attach_decide_close(
    name: str, opts: dict[str, Any], key: str, limit: int, n: int, go: Any, queue: Any
) -> None:
    """Attach, say so, wait for ``go``, ask ``n`` times for ``key``, close."""
    bound_self()
    try:
        zone = open_zone(name, opts)
        queue.put(("attached", zone.created))
        if not go.wait(WAIT_S):
            raise TimeoutError("never told to go")
        lim = limiter("FixedWindowCounter", limit, 60.0, zone, FrozenClock())
        got = sum(lim.allow(key).allowed for _ in range(n))
        zone.close()
        after_close = "no error"
        try:
            lim.allow(key)
        except Exception as exc:
            after_close = type(exc).__name__
        queue.put(("done", got, after_close))
    except BaseException:
        queue.put(("error", traceback.format_exc()))


def try_attach(name: str, opts: dict[str, Any], queue: Any) -> None:
    """Attach with ``opts`` and report what happened: ``("attached", created)``
    or ``("raised", module.qualname, message)``."""
    bound_self()
    try:
        zone = open_zone(name, opts)
    except Exception as exc:
        queue.put(("raised", f"{type(exc).__module__}.{type(exc).__qualname__}", str(exc)))
        return
    queue.put(("attached", zone.created))
    zone.close()


def reset_and_spend(name: str, opts: dict[str, Any], key: str, limit: int, queue: Any) -> None:
    """Open with ``if_stale="reset"`` and spend all of ``key``'s budget;
    report ``(created, admitted)``."""
    bound_self()
    zone = open_zone(name, {**opts, "if_stale": "reset"})
    lim = limiter("FixedWindowCounter", limit, 60.0, zone, FrozenClock())
    queue.put((zone.created, sum(lim.allow(key).allowed for _ in range(2 * limit))))
    zone.close()


def stale_creator(name: str, opts: dict[str, Any], key: str, limit: int, spend: int, ready: Any) -> None:
    """Create the zone, spend ``spend`` of ``key``'s budget, set ``ready``,
    then keep deciding on other keys until SIGKILLed (never closes)."""
    bound_self()
    zone = open_zone(name, opts)
    assert zone.created
    lim = limiter("FixedWindowCounter", limit, 60.0, zone, FrozenClock())
    got = sum(lim.allow(key).allowed for _ in range(spend))
    assert got == spend, got
    busy = limiter("TokenBucket", 50, 1.0, zone, None, rule="busy")
    keys = [f"busy-{i}" for i in range(8)]
    ready.set()
    parent = os.getppid()
    i = 0
    while os.getppid() == parent:
        i += 1
        busy.allow(keys[i & 7])
        if (i & 31) == 0:
            busy.allow_many(keys)


_POOL: dict[str, Any] = {}


def pool_init(zone: Any, barrier: Any) -> None:
    """Pool initializer: ``zone`` arrives pickled, so unpickling attached
    this worker by name."""
    bound_self()
    _POOL["zone"], _POOL["barrier"] = zone, barrier


def pool_decide(args: tuple[str, int, int]) -> tuple[int, int, bool]:
    """One Pool task: wait for three siblings (so the tasks spread over every
    worker), then ask ``n`` times for ``key``; (pid, admitted, created)."""
    key, limit, n = args
    zone = _POOL["zone"]
    _POOL["barrier"].wait(timeout=WAIT_S)
    lim = limiter("SlidingWindowLog", limit, 60.0, zone, FrozenClock())
    got = 0
    for i in range(n):
        if i % 2:
            got += lim.allow_many([key, key]).allowed_count
        elif lim.allow(key).allowed:
            got += 1
    return os.getpid(), got, bool(zone.created)
