"""Per-rule counters for the gateway, without a lock on the request path.

Each thread counts into its own dict of small lists (one writer per list, so
no lock and no lost increments); ``snapshot`` merges the shards. Only a
thread's first count takes a lock, to register its shard. The text
exposition format is written by hand: no dependency on a metrics library.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from .._select import native_core
from .headers import rate_headers

__all__ = ["ALLOWED", "DENIED", "NEAR_LIMIT", "OUTCOMES", "SHADOW_DENIED", "Metrics"]

# Slots of a rule's counter list.
ALLOWED = 0
DENIED = 1
SHADOW_DENIED = 2
NEAR_LIMIT = 3
OUTCOMES = ("allowed", "denied", "shadow_denied", "near_limit")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


class _ShardOwner:
    """Lives in a thread's locals next to its shard; when the thread ends
    and its locals go, hands the shard's counts back to the Metrics."""

    __slots__ = ("metrics", "shard")

    def __init__(self, metrics: Metrics, shard: dict[str, list[int]]) -> None:
        self.metrics = weakref.ref(metrics)
        self.shard = shard

    def __del__(self) -> None:
        metrics = self.metrics()
        if metrics is not None:
            metrics._retire(self.shard)


class Metrics:
    """Counts per rule: ``allowed``, ``denied``, ``shadow_denied`` (a
    dry-run rule would have denied) and ``near_limit`` (admitted with less
    than ``near_ratio`` of the limit left, default 20 %)."""

    def __init__(self, near_ratio: float = 0.2, *, namespace: str = "nanolimit") -> None:
        if not 0.0 <= near_ratio <= 1.0:
            raise ValueError(f"near_ratio must be within [0, 1], got {near_ratio!r}")
        self.near_ratio = float(near_ratio)
        self.namespace = namespace
        self._local = threading.local()
        self._shards: list[dict[str, list[int]]] = []
        self._retired: dict[str, list[int]] = {}  # the counts of threads that have ended
        # reentrant: a thread's shard is folded in when its locals go, which
        # can happen while this thread holds the lock
        self._lock = threading.RLock()
        self._admitted: dict[str, Any] = {}  # rule -> AdmittedRequests (the middleware's fast lane)
        core = native_core()
        if core is not None:
            self._lane_type: Any = core.AdmittedRequests
        else:
            self._lane_type = lambda rule: _ShardedAdmitted(self, rule)

    def admitted(self, rule: str) -> Any:
        """The counter-and-header writer for ``rule``'s admitted requests
        (one per rule name, shared by every binding of it)."""
        lane = self._admitted.get(rule)
        if lane is None:
            with self._lock:
                lane = self._admitted.get(rule)
                if lane is None:
                    lane = self._admitted[rule] = self._lane_type(rule)
        return lane

    def shard(self) -> dict[str, list[int]]:
        """This thread's counters: ``shard()[rule][slot] += 1`` from this
        thread only. The middleware caches it per call, not per rule."""
        try:
            return self._local.shard  # type: ignore[no-any-return]
        except AttributeError:
            shard: dict[str, list[int]] = {}
            with self._lock:
                self._shards.append(shard)
            self._local.shard = shard
            self._local.owner = _ShardOwner(self, shard)  # folds the shard in when the thread ends
            return shard

    def _retire(self, shard: dict[str, list[int]]) -> None:
        """A thread has ended: keep its counts, drop its shard (a server that
        starts a thread per request would otherwise grow one per request)."""
        with self._lock:
            for rule, counts in shard.items():
                total = self._retired.setdefault(rule, [0, 0, 0, 0])
                for i, value in enumerate(counts):
                    total[i] += value
            self._shards = [s for s in self._shards if s is not shard]

    def counters(self, rule: str) -> list[int]:
        """This thread's counter list for ``rule`` (created on first use)."""
        shard = self.shard()
        counts = shard.get(rule)
        if counts is None:
            counts = shard[rule] = [0, 0, 0, 0]
        return counts

    def record(self, rule: str, allowed: bool, remaining: int, limit: int, *, shadow: bool = False) -> None:
        """Count one decision of ``rule`` (the middleware inlines this)."""
        counts = self.counters(rule)
        if allowed:
            counts[ALLOWED] += 1
            if remaining < limit * self.near_ratio:
                counts[NEAR_LIMIT] += 1
        elif shadow:
            counts[SHADOW_DENIED] += 1
        else:
            counts[DENIED] += 1

    def snapshot(self) -> dict[str, dict[str, int]]:
        """``{rule: {"allowed": n, "denied": n, "shadow_denied": n, "near_limit": n}}``."""
        with self._lock:
            shards = [*self._shards, {rule: list(c) for rule, c in self._retired.items()}]
            lanes = list(self._admitted.values())
        out: dict[str, dict[str, int]] = {}
        for shard in shards:
            for rule, counts in list(shard.items()):
                total = out.get(rule)
                if total is None:
                    total = out[rule] = dict.fromkeys(OUTCOMES, 0)
                for name, value in zip(OUTCOMES, list(counts)):
                    total[name] += value
        for lane in lanes:
            allowed, near = lane.allowed, lane.near_limit
            if allowed or lane.rule in out:
                total = out.setdefault(lane.rule, dict.fromkeys(OUTCOMES, 0))
                total["allowed"] += allowed
                total["near_limit"] += near
        return dict(sorted(out.items()))

    def render_prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        snap = self.snapshot()
        ns = self.namespace
        lines = [
            f"# HELP {ns}_requests_total Requests decided by a rate-limit rule, by outcome.",
            f"# TYPE {ns}_requests_total counter",
        ]
        for rule, counts in snap.items():
            for outcome in OUTCOMES[:3]:
                lines.append(
                    f'{ns}_requests_total{{rule="{_label(rule)}",outcome="{outcome}"}} {counts[outcome]}'
                )
        lines += [
            f"# HELP {ns}_near_limit_total Admitted requests left under {self.near_ratio:.0%} of the limit.",
            f"# TYPE {ns}_near_limit_total counter",
        ]
        for rule, counts in snap.items():
            lines.append(f'{ns}_near_limit_total{{rule="{_label(rule)}"}} {counts["near_limit"]}')
        return "\n".join(lines) + "\n"

    def __repr__(self) -> str:
        return f"<Metrics rules={len(self.snapshot())}>"

    def __getstate__(self) -> Any:
        raise TypeError("Metrics cannot be pickled (it holds per-thread counters)")


class _ShardedAdmitted:
    """The pure-Python twin of ``nanolimit._core.AdmittedRequests``: counts
    go to the calling thread's shard (Python has no atomic increment)."""

    allowed = 0  # counted in the shards
    near_limit = 0

    def __init__(self, metrics: Metrics, rule: str) -> None:
        self.metrics = metrics
        self.rule = rule

    def count(self, decision: Any, near: float) -> None:
        counts = self.metrics.counters(self.rule)
        counts[ALLOWED] += 1
        if decision.remaining < near:
            counts[NEAR_LIMIT] += 1

    def record(
        self,
        decision: Any,
        headers: Any,
        limit_str: str,
        policy: str,
        r_prefix: str,
        near: float,
        wall_now: float,
    ) -> None:
        headers.update(
            rate_headers(limit_str, policy, r_prefix, decision.remaining, decision.reset_after, wall_now)
        )
        self.count(decision, near)  # counted once the headers are written
