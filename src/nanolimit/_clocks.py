"""Clocks: where ``now`` comes from (docs/spec.md §1), and the bounds a clock
reading must keep (finite, within ``MAX_TIME``; a key's stamp leads the clock
by at most ``MAX_CLOCK_LEAD``, docs/spec.md §4).
"""

from __future__ import annotations

import math
import time
from typing import Protocol, runtime_checkable

from ._validation import _shown, as_float
from .errors import ValidationError

__all__ = ["MAX_CLOCK_LEAD", "MAX_TIME", "Clock", "FakeClock", "SystemClock", "check_now"]


# GCRA counts integer microseconds; they must stay below 2**53.
MAX_TIME = float(1 << 53) / 1_000_000.0 / 2.0


# How far a key's stamp may run ahead of the clock before the excess is taken
# as the clock's error (a bad NTP step forward and back): within it, per-key
# time stands still; beyond it, the key's state moves back to the clock with
# its debt kept (docs/algorithms.md, "Clock faults").
MAX_CLOCK_LEAD = 60.0


@runtime_checkable
class Clock(Protocol):
    """Anything with ``now() -> float`` seconds."""

    def now(self) -> float: ...


class SystemClock:
    """Wall-clock seconds (``time.time()``).

    Wall time rather than a monotonic clock, because the reset header is a Unix
    time and a shared store compares instances by it; a backward step never
    hands out budget because every key keeps its own monotonic time. The native
    twin recognises this class and reads the same clock in C.
    """

    __slots__ = ()

    def now(self) -> float:
        return time.time()

    def __repr__(self) -> str:
        return "SystemClock()"


class FakeClock:
    """A clock that moves only when told to: for tests, replays and demos."""

    __slots__ = ("_now",)

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def set(self, t: float) -> None:
        self._now = float(t)

    def advance(self, dt: float) -> None:
        self._now += float(dt)

    def __repr__(self) -> str:
        return f"FakeClock({self._now!r})"


def check_now(now: object) -> float:
    """Return ``now`` as a float, or raise if a clock produced nonsense.

    A non-finite time would turn into NaN budgets; an absurdly large one would
    overflow the integer window index and GCRA's microseconds.
    """
    if isinstance(now, bool) or not isinstance(now, (int, float)):
        raise ValidationError(f"clock returned {type(now).__name__}, expected float seconds")
    value = as_float(now)
    if not math.isfinite(value):
        raise ValidationError(f"clock returned a non-finite time: {_shown(now)}")
    if not -MAX_TIME < value < MAX_TIME:
        raise ValidationError(f"clock returned {value!r}, outside ±{MAX_TIME:.0f} s")
    return value
