"""The Redis stores' near-cache: recent denials, answered without a round
trip while they must still be denials (``near_cache_size``, ``near_cache_ttl``)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any


class _NearCache:
    """Local memory of recent denials:
    ``(rule, key) -> (until, cost, retry_at, reset_at, written)``.

    A request of at least the denied cost before ``until`` is denied without a
    round trip (a smaller cost might pass sooner, so it goes to the store).
    Bounded in size (LRU) and in lifetime (``max_ttl``) so a stale entry can
    only ever shorten, never extend, the wrong answer window. The answer's
    ``retry_after`` counts down from the store's own, not from ``until``:
    the cache's lifetime is ours, the wait is the client's.

    An entry read at a ``now`` earlier than when it was written is dropped:
    the clock stepped back (an injected one that ran ahead), and a denial
    stamped in the future would hold for as long as it ran ahead (a year of
    lockout), where the store's own clock rule answers within a window.
    """

    __slots__ = ("_entries", "_lock", "max_entries", "max_ttl")

    def __init__(self, max_entries: int, max_ttl: float) -> None:
        self.max_entries = max_entries
        self.max_ttl = max_ttl
        self._entries: OrderedDict[Any, tuple[float, int, float, float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, ident: Any, cost: int, now: float) -> tuple[float, float] | None:
        entry = self._entries.get(ident)
        if entry is None:
            return None
        until, min_cost, retry_at, reset_at, written = entry
        if now >= until or now < written:  # expired, or the clock went back past its writing
            with self._lock:
                if self._entries.get(ident) is entry:
                    del self._entries[ident]
            return None
        if cost < min_cost:
            return None
        return retry_at - now, max(0.0, reset_at - now)

    def remember(self, ident: Any, cost: int, now: float, retry_after: float, reset_after: float) -> None:
        ttl = min(retry_after, self.max_ttl)
        if ttl <= 0.0:
            return
        with self._lock:
            self._entries[ident] = (now + ttl, cost, now + retry_after, now + reset_after, now)
            self._entries.move_to_end(ident)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def forget(self, ident: Any) -> None:
        with self._lock:
            self._entries.pop(ident, None)

    def __len__(self) -> int:
        return len(self._entries)
