"""``on_error="local"``: while Redis is unreachable, decide in this process.

Why a local store and not a fixed answer: failing open lets an outage
become a free-for-all, failing closed takes the site down with Redis. A
bounded in-process store keeps enforcing each limit, at a share of it, until
the store answers again (docs/redis.md, "Failures").

The rules this module keeps:

- A decision is made either here or in Redis, never both: the storage comes
  here only for calls that failed or were never sent (an open breaker).
- An *episode* is one outage of one server: it begins with the first local
  decision and ends at the handover, when that server's breaker is closed
  again (its recovery complete, see ``_Breaker``). Each episode gets a fresh
  local store; at the handover it is dropped, and nothing admitted here is
  replayed into Redis (the next window would pay for the outage).
- Episodes are per *scope*, the name of the breaker that guards the server
  (``""`` standalone, ``host:port`` for a cluster node): a dead node's keys
  keep one episode, and one share, for as long as that node is down, however
  many answers the other nodes give meanwhile.
- A refund goes where its charge was made: a decision's ``at`` inside the
  span of this key's local decisions (the current episode, or the last one
  after the handover) is a local charge and is refunded here (after the
  handover: with the state it belonged to, never to Redis).
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from ..._decision_py import KernelVerdict
from ..._limiter_config import LIMITER_CLASS_NAMES, LimiterConfig
from ..._select import twin
from ..._validation import MAX_KEYS, as_float, check_int_option
from ...errors import ValidationError
from ._resilience import _Breaker

# Decision.reason of a decision the local store made during an outage.
REASON_STORE_UNAVAILABLE_LOCAL = "store_unavailable_local"

DEFAULT_LOCAL_MAX_KEYS = 100_000


def check_local_options(
    local_share: object, local_instances: object, local_max_keys: object
) -> tuple[float, int | None, int]:
    """The checked options: the share, the instance count it came from
    (None when the share was given), and the store's bound."""
    local_instances = check_int_option("local_instances", local_instances, 1, (1 << 31) - 1)
    # the local store is an InMemoryStorage made at the first decision of an
    # outage: a bound it refuses must be refused here, not then
    local_max_keys = check_int_option("local_max_keys", local_max_keys, 1, MAX_KEYS)
    if local_share is None:
        return 1.0 / local_instances, local_instances, local_max_keys
    if (
        isinstance(local_share, bool)
        or not isinstance(local_share, (int, float))
        or not math.isfinite(as_float(local_share))
        or not 0 < local_share <= 1
    ):
        raise ValidationError(f"local_share must be a number in (0, 1], got {str(local_share)[:60]}")
    return float(local_share), None, local_max_keys


class _LocalClock:
    """The clock of the shadow limiters: each thread's decision sets the
    time it decides at, so concurrent decisions never read another's."""

    __slots__ = ("_now",)

    def __init__(self) -> None:
        self._now = threading.local()

    def now(self) -> float:
        return float(self._now.t)

    def set(self, t: float) -> None:
        self._now.t = t


class _Episode:
    """One outage: its store, the shadow limiters on it, and when each key
    was charged here (for refunds)."""

    __slots__ = ("charged", "lock", "shadows", "store")

    def __init__(self, max_keys: int, max_key_bytes: int) -> None:
        self.store: Any = twin.InMemoryStorage(max_keys=max_keys, max_key_bytes=max_key_bytes)
        self.shadows: dict[LimiterConfig, Any] = {}
        # (config, key) -> (first, last) Decision.at of its admitted local decisions
        self.charged: OrderedDict[tuple[LimiterConfig, str], tuple[float, float]] = OrderedDict()
        self.lock = threading.Lock()


class LocalFallback:
    """The local side of ``on_error="local"`` for one Redis storage."""

    def __init__(
        self, share: float, instances: int | None, max_keys: int, max_key_bytes: int, deny_retry_after: float
    ) -> None:
        self.share = share
        self.instances = instances
        self.max_keys = max_keys
        self.max_key_bytes = max_key_bytes
        self.deny_retry_after = deny_retry_after
        self.clock = _LocalClock()
        self._episodes: dict[str, _Episode] = {}  # by scope: the outages going on
        self._lasts: dict[str, _Episode] = {}  # the episode before each handover, for refunds only
        self._lock = threading.Lock()
        self._counts = {"local_decisions": 0, "local_denials": 0, "local_refunds": 0, "local_episodes": 0}

    # -- episodes --------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Whether any scope's outage is being decided here."""
        return bool(self._episodes)

    @property
    def _episode(self) -> _Episode | None:
        """The standalone server's episode (scope ``""``)."""
        return self._episodes.get("")

    def _begin(self, scope: str, route: _Breaker | None = None) -> _Episode:
        """``scope``'s episode, begun now if none is going on. A decision
        whose ``route`` was retired (its cluster node left the map while the
        decision was under way) is stale: it is decided in that node's last
        episode, its share spent as it was, and begins no outage that nothing
        would end."""
        with self._lock:
            episode = self._episodes.get(scope)
            if episode is None and route is not None and route.retired:
                episode = self._lasts.get(scope)
                if episode is None:
                    episode = self._lasts[scope] = _Episode(self.max_keys, self.max_key_bytes)
                    self._counts["local_episodes"] += 1
            elif episode is None:
                episode = self._episodes[scope] = _Episode(self.max_keys, self.max_key_bytes)
                self._lasts.pop(scope, None)  # the previous outage's state is gone for good
                self._counts["local_episodes"] += 1
            return episode

    def _episode_of(self, route: _Breaker | None) -> _Episode:
        """The episode a decision routed by ``route`` is decided in (None:
        the standalone server's)."""
        scope = "" if route is None else route.name
        return self._episodes.get(scope) or self._begin(scope, route)

    def handover(self, scope: str = "") -> None:
        """``scope``'s server recovered: new decisions go there; this
        episode's state is dropped, never replayed (what is kept is only when
        keys were charged here, so that their refunds do not reach Redis)."""
        if scope not in self._episodes:
            return
        with self._lock:
            episode = self._episodes.pop(scope, None)
            if episode is not None:
                self._lasts[scope] = episode

    # -- shares ------------------------------------------------------------------
    def _part(self, n: int) -> int:
        """This instance's part of ``n`` units: ``n // N`` when the share is
        ``1 / local_instances`` (exact), else ``floor(n * share)``."""
        if self.instances is not None:
            return n // self.instances
        return math.floor(round(n * self.share, 9))  # 0.1 * 30 is 3, not 2.9999...

    def _shadow(self, episode: _Episode, cfg: LimiterConfig) -> Any:
        """The limiter of ``cfg``'s share on the episode's store, or None when
        the share rounds to nothing (then every request is denied here)."""
        try:
            return episode.shadows[cfg]
        except KeyError:
            pass
        with episode.lock:
            if cfg not in episode.shadows:
                limit = self._part(cfg.limit)
                burst = None if cfg.burst is None else self._part(cfg.burst)
                shadow = None
                if limit >= 1 and burst != 0:
                    cls = getattr(twin, LIMITER_CLASS_NAMES[cfg.algorithm.value])
                    shadow = cls(limit, cfg.window_seconds, episode.store, self.clock, cfg.rule, burst=burst)
                episode.shadows[cfg] = shadow
            return episode.shadows[cfg]

    # -- decisions -----------------------------------------------------------------
    def _denied(self) -> KernelVerdict:
        wait = self.deny_retry_after
        return (False, 0.0, wait, wait, 0.0, True, REASON_STORE_UNAVAILABLE_LOCAL, 0.0)

    @staticmethod
    def _verdict(d: Any) -> KernelVerdict:
        return (
            bool(d.allowed),
            float(d.remaining),
            float(d.retry_after),
            float(d.reset_after),
            float(d.delay),
            True,
            REASON_STORE_UNAVAILABLE_LOCAL,
            float(d.at),
        )

    def _note(self, episode: _Episode, cfg: LimiterConfig, key: str, at: float) -> None:
        ident = (cfg, key)
        with episode.lock:
            span = episode.charged.get(ident)
            episode.charged[ident] = (at, at) if span is None else (min(span[0], at), max(span[1], at))
            episode.charged.move_to_end(ident)
            while len(episode.charged) > self.max_keys:
                episode.charged.popitem(last=False)

    def _count(self, verdicts: Sequence[KernelVerdict]) -> None:
        with self._lock:
            self._counts["local_decisions"] += len(verdicts)
            self._counts["local_denials"] += sum(1 for v in verdicts if not v[0])

    def decide(
        self,
        cfg: LimiterConfig,
        key: str,
        cost: int,
        now: float | None,
        commit: bool,
        route: _Breaker | None = None,
    ) -> KernelVerdict:
        """One decision at ``cfg``'s share (``now``: None for this host's
        wall clock, as Redis's ``TIME`` would be, else the injected reading),
        in the episode of the outage of ``route``, the breaker the decision
        was routed by (None: the standalone server; see :meth:`_begin`)."""
        episode = self._episode_of(route)
        shadow = self._shadow(episode, cfg)
        if shadow is None or cost > shadow.capacity:
            verdict = self._denied()
        else:
            self.clock.set(time.time() if now is None else now)
            d = shadow.allow(key, cost) if commit else shadow.peek(key, cost)
            verdict = self._verdict(d)
            if commit and verdict[0]:
                self._note(episode, cfg, key, verdict[7])  # type: ignore[misc]
        self._count((verdict,))
        return verdict

    def decide_all(
        self,
        items: Sequence[tuple[LimiterConfig, str, int, float | None]],
        commit: bool,
        route: _Breaker | None = None,
    ) -> list[KernelVerdict]:
        """A compound's limits, all-or-nothing in the local store (its
        ``allow_all``); ``commit=False`` (another limit of the compound was
        denied by its own policy) only looks."""
        episode = self._episode_of(route)
        shadows = [self._shadow(episode, cfg) for cfg, _, _, _ in items]
        if not commit or any(s is None or cost > s.capacity for s, (_, _, cost, _) in zip(shadows, items)):
            out = [
                self._denied() if s is None or cost > s.capacity else self._peek(s, key, cost, now)
                for s, (_, key, cost, now) in zip(shadows, items)
            ]
            self._count(out)
            return out
        # one clock for every shadow: the compound's first limit's reading
        # (the limits of one compound are read at the same moment)
        first = items[0][3]
        self.clock.set(time.time() if first is None else first)
        compound = episode.store.allow_all([(s, key, cost) for s, (_, key, cost, _) in zip(shadows, items)])
        out = [self._verdict(d) for d in compound.decisions]
        if all(v[0] for v in out):
            for (cfg, key, _, _), v in zip(items, out):
                self._note(episode, cfg, key, v[7])  # type: ignore[misc]
        self._count(out)
        return out

    def _peek(self, shadow: Any, key: str, cost: int, now: float | None) -> KernelVerdict:
        self.clock.set(time.time() if now is None else now)
        return self._verdict(shadow.peek(key, cost))

    # -- refunds ---------------------------------------------------------------------
    def refund(
        self, cfg: LimiterConfig, key: str, units: int, at: float | None, now: float | None, scope: str = ""
    ) -> bool:
        """Refund here when the charge was made here; False when it was not
        (then it is Redis's). During an outage ``at=None`` names the key's
        latest local decision; after the handover only a named ``at`` in the
        last episode's span is known to be local (and is given back with
        that episode's state: to nothing)."""
        ident = (cfg, key)
        episode = self._episodes.get(scope)
        if episode is not None:
            span = episode.charged.get(ident)
            if span is not None and (at is None or span[0] <= at <= span[1]):
                shadow = self._shadow(episode, cfg)
                if shadow is not None:
                    self.clock.set(time.time() if now is None else now)
                    shadow.refund(key, min(units, shadow.capacity), at=at)
                self._refunded()
                return True
            return False
        last = self._lasts.get(scope)
        if last is not None and at is not None:
            span = last.charged.get(ident)
            if span is not None and span[0] <= at <= span[1]:
                self._refunded()
                return True
        return False

    def _refunded(self) -> None:
        with self._lock:
            self._counts["local_refunds"] += 1

    def metrics(self) -> dict[str, int]:
        with self._lock:
            out = dict(self._counts)
        out["local_active"] = len(self._episodes)  # the outages (servers, nodes) decided here
        return out
