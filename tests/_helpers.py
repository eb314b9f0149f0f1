"""Small helpers shared by the test modules (not a twin: plain Python)."""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

# Set by .ci/memcheck.py: the tests run under valgrind, about 50x slower.
UNDER_MEMCHECK = os.environ.get("NANOLIMIT_MEMCHECK") == "1"


def rounds(full: int, memcheck: int) -> int:
    """How many times a test repeats one path: ``full`` in the suite, fewer
    under memcheck, which looks for a bad read or a leak on each path and
    finds it in the first few rounds as surely as in the last (the suite
    still runs every round)."""
    return memcheck if UNDER_MEMCHECK else full


class EqualsEverything(str):
    """A key claiming to equal every other one, with one shared hash."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    def __hash__(self) -> int:
        return 1

    def __format__(self, spec: str) -> str:
        return "formatted"


FIELDS = (
    "allowed",
    "limit",
    "remaining",
    "retry_after",
    "reset_after",
    "rule",
    "window",
    "delay",
)


def fields(decision: Any) -> tuple[Any, ...]:
    """A Decision as a plain tuple, so twins' Decisions compare by value."""
    return tuple(getattr(decision, name) for name in FIELDS)


def assert_same_decisions(got: Any, want: Any, tolerance: float = 1e-9) -> None:
    """Decisions field by field: exact, but floats to ``tolerance``."""
    got, want = list(got), list(want)
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        for name, a, b in zip(FIELDS, fields(g), fields(w)):
            if isinstance(a, float) and not isinstance(a, bool):
                assert abs(a - b) <= tolerance, (i, name, a, b)
            else:
                assert a == b, (i, name, a, b)


def batch_fields(result: Any) -> list[tuple[Any, ...]]:
    return [fields(d) for d in result]


class DictStorage:
    """A user-written Storage: a dict behind one lock, nothing else.

    It implements only the protocol of docs/spec.md §5, so a limiter given it must
    go through the generic ``apply`` seam.
    """

    def __init__(self) -> None:
        self._data: dict[str, tuple[float, Any]] = {}
        self._lock = threading.Lock()
        self.calls = 0

    def apply(self, key: str, now: float, mutate: Callable[[Any], tuple[Any, Any]]) -> Any:
        with self._lock:
            self.calls += 1
            old = self._data.get(key)
            state, result = mutate(None if old is None else old[1])
            if state is None:
                self._data.pop(key, None)
            else:
                stamp = now if old is None else max(now, old[0])
                self._data[key] = (stamp, state)
            return result

    def evict_idle(self, cutoff: float) -> int:
        with self._lock:
            stale = [k for k, (stamp, _) in self._data.items() if stamp < cutoff]
            for k in stale:
                del self._data[k]
            return len(stale)

    def __len__(self) -> int:
        with self._lock:
            return len(self._data)


class SettableClock:
    """A clock that returns whatever it is told to, nonsense included."""

    def __init__(self, value: Any = 0.0) -> None:
        self.value = value

    def now(self) -> Any:
        return self.value


# SharedMemoryStorage needs POSIX shared memory: on Windows it refuses to
# start (test_zone.py checks the message), so its tests do not apply there.
needs_shared_memory = pytest.mark.skipif(
    sys.platform == "win32", reason="Windows has no POSIX shared memory: SharedMemoryStorage refuses to start"
)


def two_tier_fleet(server: Any, prefix: str, n: int, **kwargs: Any) -> list[Any]:
    """``n`` TwoTierStorage members of one fleet on ``server``, no background
    syncs (the test calls ``sync_now``). A sync waits up to 5 s for its
    reply unless told otherwise: under valgrind on a busy host the default
    0.25 s could lapse and turn a sync the test compares into a partition."""
    from nanolimit.storage.two_tier import TwoTierStorage

    kwargs.setdefault("timeout", 5.0)

    return [
        TwoTierStorage(None, server.client(), instance_id=f"i{i}", prefix=prefix, start=False, **kwargs)
        for i in range(n)
    ]


def cut_off_switch(tiers: Any) -> list[bool]:
    """A switch for the members' Redis round trips: while ``switch[0]`` is
    true each ``_exchange`` raises ``ConnectionError``, as an unreachable
    server would."""
    down = [False]
    for tier in tiers:
        real = tier._exchange

        def exchange(*args: Any, real: Any = real) -> Any:
            if down[0]:
                raise ConnectionError("redis unreachable (simulated)")
            return real(*args)

        tier._exchange = exchange
    return down


def clear_of_window_edge(window: float, margin: float) -> None:
    """Sleep past the next wall-clock window boundary when it is under
    ``margin`` seconds away: a fixed window on the real clock restarts
    there, and a test counting to its limit would see a fresh budget."""
    left = window - time.time() % window
    if left < margin:
        time.sleep(left + 0.5)


def from_window(counts: dict[int, int], k: int) -> dict[int, int]:
    """``fleet_counts`` from window ``k`` on: which older windows a track
    still holds differs between the C and Python paths (C drops what it
    rolled past, the Python plan at the key's next sync)."""
    return {w: n for w, n in counts.items() if w >= k}
