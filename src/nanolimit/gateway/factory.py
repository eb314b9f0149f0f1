"""LimiterFactory: one limiter per rule value, on one storage.

Limiters are cheap, but building one per request would re-validate the
configuration every time; the factory caches them by the rule *value*. An
edited rule is a different value and gets a fresh limiter, which still finds
its keys' state, because the storage namespaces state by (algorithm, rule
name): raising a limit changes the ceiling, it never hands back budget
already spent (docs/spec.md §6). ``prune`` drops limiters of retired rules.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from typing import Any

from .._clocks import Clock
from .._limiter_config import Algorithm
from .._protocols import RateLimiter, Storage
from .._select import twin, twin_of
from ..errors import ValidationError
from .rules import RateLimitRule

__all__ = ["DEFAULT_MAX_KEYS", "LimiterFactory"]


def _limiter_classes(storage: object) -> Mapping[Algorithm, Any]:
    """The limiter classes that run on ``storage``'s fast path."""
    return twin_of(storage).LIMITERS  # type: ignore[no-any-return]


# The default store's bound: a copy-pasted ``LimiterFactory()`` must not grow
# without limit under one-off clients (rotating IPv6 /64s, invented tokens).
# About 6 MB of table at 62 bytes a key; keys at rest go first when it is full,
# and a key in debt is never forgotten to make room (docs/limits_of_the_design.md).
DEFAULT_MAX_KEYS = 100_000


class LimiterFactory:
    """Builds and caches the limiter of each rule.

    ``storage`` defaults to a fresh :class:`nanolimit.InMemoryStorage` bounded
    at ``DEFAULT_MAX_KEYS`` keys (pass a storage of your own to tune it); a
    ``str`` is a storage URI (``"redis://10.0.0.5/0"``,
    ``"shm://api?max_keys=100000"``), made by :func:`nanolimit.storage_from_uri`;
    ``clock`` to the limiters' default (wall time, or the server's clock on
    Redis). ``limiters`` maps an :class:`Algorithm` to a limiter class, for a
    storage whose twin cannot be told from its type.
    """

    def __init__(
        self,
        storage: Storage | str | None = None,
        clock: Clock | None = None,
        *,
        limiters: Mapping[Algorithm, Any] | None = None,
    ) -> None:
        if storage is None:
            storage = twin.InMemoryStorage(max_keys=DEFAULT_MAX_KEYS)
        elif isinstance(storage, str):
            from ..storage.uri import storage_from_uri  # Redis and the zone load on first use

            storage = storage_from_uri(storage)
        if not isinstance(storage, Storage):
            raise ValidationError(f"storage must implement Storage, got {type(storage).__name__}")
        self.storage: Storage = storage
        self.clock = clock
        self._classes = dict(limiters) if limiters is not None else dict(_limiter_classes(storage))
        self._limiters: dict[RateLimitRule, RateLimiter] = {}
        self._lock = threading.Lock()

    def for_rule(self, rule: RateLimitRule) -> RateLimiter:
        """The limiter of ``rule``, built once per rule value."""
        limiter = self._limiters.get(rule)
        if limiter is not None:
            return limiter
        if not isinstance(rule, RateLimitRule):
            raise ValidationError(f"expected RateLimitRule, got {type(rule).__name__}")
        with self._lock:
            limiter = self._limiters.get(rule)
            if limiter is None:
                cls = self._classes[rule.algorithm]
                limiter = cls(
                    rule.limit, rule.window_seconds, self.storage, self.clock, rule.name, burst=rule.burst
                )
                self._limiters[rule] = limiter
        return limiter

    def prune(self, active: Iterable[RateLimitRule]) -> int:
        """Forget the limiters of rules not in ``active``; returns how many.
        Their keys' state stays in the storage (a rule brought back under the
        same name and algorithm finds it again) until ``evict_idle``, or until
        the storage runs out of namespaces and reclaims those of rules no live
        limiter uses: call it after every hot reload, so renamed rules never
        pile up (the rules-file reloader does)."""
        keep = set(active)
        with self._lock:
            retired = [rule for rule in self._limiters if rule not in keep]
            for rule in retired:
                del self._limiters[rule]
        return len(retired)

    def __len__(self) -> int:
        return len(self._limiters)

    def __repr__(self) -> str:
        return f"<LimiterFactory limiters={len(self._limiters)} storage={type(self.storage).__name__}>"
