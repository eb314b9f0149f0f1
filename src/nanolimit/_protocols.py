"""The protocols a storage and a limiter answer to (docs/spec.md §5), and the
glue both twins share: the async decision path and the hot-path counter.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

from ._clocks import SystemClock, check_now
from ._decision_py import BatchResult, KernelVerdict
from ._limiter_config import LimiterConfig, LimiterState
from ._validation import MAX_KEY_BYTES, check_cost, check_key

__all__ = ["KernelStorage", "LockedCounter", "RateLimiter", "Storage", "decide_async", "event_counter"]


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


def event_counter() -> Any:
    """A counter for a hot path: atomic in C when the native twin is in use,
    a locked Python int otherwise."""
    from ._select import native_core  # late: the twins import this module

    core = native_core()
    return LockedCounter() if core is None else core.EventCounter()
