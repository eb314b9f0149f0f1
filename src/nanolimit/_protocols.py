"""The protocols a storage and a limiter answer to (docs/spec.md §5), and the
glue both twins share: the async decision path and the locked counter.
"""

from __future__ import annotations

import math
import numbers
import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ._clocks import MAX_TIME, SystemClock, check_now
from ._decision_py import BatchResult, KernelVerdict
from ._limiter_config import LimiterConfig, LimiterState
from ._validation import MAX_KEY_BYTES, _shown, as_float, check_cost, check_key
from .errors import ValidationError

__all__ = [
    "KernelStorage",
    "LockedCounter",
    "RateLimiter",
    "Storage",
    "check_at",
    "decide_async",
    "refund_async",
]


@runtime_checkable
class Storage(Protocol):
    """Per-key state with one contract: read, decide and write are one atomic
    step per key (docs/spec.md §5)."""

    def apply(self, key: str, now: float, mutate: Callable[[Any], tuple[Any, Any]]) -> Any: ...

    def evict_idle(self, cutoff: float) -> int: ...

    def __len__(self) -> int: ...


@runtime_checkable
class KernelStorage(Storage, Protocol):
    """A storage that runs the built-in kernels itself, next to its data (a
    Lua script in Redis), so limiters never hand it a Python closure.

    ``now`` is the limiter's clock reading, or ``None`` when the limiter uses
    the default :class:`SystemClock` and the storage should use its own clock
    (Redis: the server's ``TIME``, one clock for every gateway instance).
    """

    def run_kernel(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict: ...

    def run_kernel_many(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> list[KernelVerdict]: ...

    def run_kernel_all(
        self, items: Sequence[tuple[LimiterConfig, str, int]], now: float | None
    ) -> list[KernelVerdict]:
        """All-or-nothing: every item is committed only if every item allows."""
        ...

    def forget(self, config: LimiterConfig, key: str) -> None: ...

    def snapshot(self, config: LimiterConfig, key: str, now: float | None) -> LimiterState | None: ...

    # Optional, and so not part of the runtime check (a store written before
    # refunds stays a KernelStorage): ``refund_kernel(config, key, cost, at,
    # now) -> None`` gives back ``cost`` units a decision made at ``at``
    # (None: the key's latest) charged, and ``refund_kernel_async`` the same
    # awaitable. ``_Limiter.refund`` calls them.


def check_at(at: object) -> float | None:
    """A refund's ``at``: None (the key's latest decision) or a finite real
    number of seconds, as a float. Bounded like a clock reading, since no
    decision is ever made outside those bounds, and a stamp beyond them
    would overflow a window index in the kernels."""
    if at is None:
        return None
    if isinstance(at, bool) or not isinstance(at, numbers.Real):
        raise ValidationError(f"at must be a Decision.at time in seconds or None, got {type(at).__name__}")
    value = as_float(at)
    if not math.isfinite(value):
        raise ValidationError(f"at must be a finite time, got {_shown(at)}")
    if not -MAX_TIME < value < MAX_TIME:
        raise ValidationError(f"at {value!r} is outside ±{MAX_TIME:.0f} s")
    return value


def refund_kernel_of(storage: Any) -> Callable[..., None]:
    """The ``refund_kernel`` of a KernelStorage, or a clear error when it has
    none: its kernels run where this process cannot reach them."""
    run = getattr(storage, "refund_kernel", None)
    if run is None:
        raise TypeError(
            f"{type(storage).__name__} runs its own kernels but has no refund_kernel(): it cannot refund"
        )
    return run  # type: ignore[no-any-return]


def _characters(key: str) -> str:
    """A checked key as an exact ``str`` of its characters, as the
    synchronous paths hand a storage (a subclass's ``__hash__``/``__eq__``
    would pick another key's near-cache entry)."""
    return key if type(key) is str else str.__str__(key)


async def refund_async(limiter: Any, key: str, cost: int, at: float | None) -> None:
    """``refund_async`` of either twin: a storage with ``refund_kernel_async``
    (``AsyncRedisStorage``) is awaited, checked first exactly as ``refund``
    checks; any other is refunded at once through ``refund``."""
    storage = limiter.storage
    run = getattr(storage, "refund_kernel_async", None)
    if run is None:
        limiter.refund(key, cost, at=at)
        return
    check_key(key, getattr(storage, "max_key_bytes", MAX_KEY_BYTES))
    key = _characters(key)
    cost = check_cost(cost, limiter.capacity)
    stamp = check_at(at)
    clock = limiter.clock
    now = None if type(clock) is SystemClock else check_now(clock.now())
    await run(limiter.config, key, cost, stamp, now)


async def decide_async(limiter: Any, key: str, cost: int, commit: bool) -> Any:
    """``allow_async`` / ``peek_async`` of either twin.

    A storage with ``run_kernel_async`` (``AsyncRedisStorage``) is awaited;
    any other answers at once through the synchronous path (the in-memory
    store decides in well under a microsecond and does no I/O, so it never
    blocks the event loop).
    """
    storage = limiter.storage
    run = getattr(storage, "run_kernel_async", None)
    if run is None:
        return limiter.allow(key, cost) if commit else limiter.peek(key, cost)
    check_key(key, getattr(storage, "max_key_bytes", MAX_KEY_BYTES))
    key = _characters(key)
    cost = check_cost(cost, limiter.capacity)
    clock = limiter.clock
    now = None if type(clock) is SystemClock else check_now(clock.now())
    verdict = await run(limiter.config, key, cost, now, commit)
    return limiter._decision(verdict)


@runtime_checkable
class RateLimiter(Protocol):
    """What every limiter answers, whichever twin and algorithm."""

    @property
    def limit(self) -> int: ...

    @property
    def capacity(self) -> int: ...

    @property
    def window_seconds(self) -> float: ...

    @property
    def rule(self) -> str: ...

    def allow(self, key: str, cost: int = 1) -> Any: ...

    def peek(self, key: str, cost: int = 1) -> Any: ...

    def reset(self, key: str) -> None: ...

    def allow_many(self, keys: Sequence[str], costs: Sequence[int] | None = None) -> BatchResult: ...


class LockedCounter:
    """The pure-Python stand-in for ``nanolimit._core.EventCounter``."""

    __slots__ = ("_lock", "value")

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, amount: int = 1) -> None:
        with self._lock:
            self.value += amount
