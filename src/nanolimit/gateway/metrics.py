"""Per-rule counters for the gateway, without a lock on the request path.

Each thread counts into its own dict of small lists (one writer per list, so
no lock and no lost increments); ``snapshot`` merges the shards. Only a
thread's first count takes a lock, to register its shard.

Everything exported is described once, by :meth:`Metrics.families`: the
hand-written text format (:meth:`Metrics.render_prometheus`, no dependency),
the ``prometheus_client`` Collector (:meth:`Metrics.collect`, which imports
the library only when a registry asks) and the OpenTelemetry bridge
(``nanolimit.gateway.otel``) all read that one list, so their names, labels
and values cannot drift apart. Storages handed to
:meth:`Metrics.watch_storage` join it at scrape time (docs/metrics.md).
"""

from __future__ import annotations

import math
import re
import threading
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from .._select import native_core
from ..errors import ValidationError
from .headers import MAX_HEADER_SECONDS, rate_headers, retry_seconds

if TYPE_CHECKING:
    from prometheus_client.metrics_core import Metric

__all__ = [
    "ALLOWED",
    "BREAKER_STATES",
    "DENIED",
    "NEAR_LIMIT",
    "OUTCOMES",
    "SHADOW_DENIED",
    "STORAGE_COUNTERS",
    "STORAGE_GAUGES",
    "STORAGE_LABELS",
    "Family",
    "Metrics",
]

# Slots of a rule's counter list.
ALLOWED = 0
DENIED = 1
SHADOW_DENIED = 2
NEAR_LIMIT = 3
OUTCOMES = ("allowed", "denied", "shadow_denied", "near_limit")


def _label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _help(text: str) -> str:
    # as prometheus_client escapes HELP: backslash and newline, not quotes
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    """A sample value as the text format spells it (ints stay ints)."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(value)


Kind = Literal["counter", "gauge"]


@dataclass(frozen=True, slots=True)
class Family:
    """One exported metric family: the single description that the text
    format, the ``prometheus_client`` Collector and the OpenTelemetry bridge
    are all made from.

    ``name`` is the family's name; a counter's samples are named
    ``name + "_total"`` (:attr:`sample_name`), as both the Prometheus text
    format and ``prometheus_client`` spell counters. ``samples`` are
    ``(label values in the order of labels, value)``."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    samples: tuple[tuple[tuple[str, ...], float], ...]

    @property
    def sample_name(self) -> str:
        return self.name + "_total" if self.kind == "counter" else self.name

    def render(self) -> list[str]:
        """This family in the text exposition format (version 0.0.4)."""
        name = self.sample_name
        lines = [f"# HELP {name} {_help(self.help)}", f"# TYPE {name} {self.kind}"]
        for values, value in self.samples:
            labels = ",".join(f'{k}="{_label(v)}"' for k, v in zip(self.labels, values))
            lines.append(f"{name}{{{labels}}} {_number(value)}" if labels else f"{name} {_number(value)}")
        return lines


# -- the storages' numbers ---------------------------------------------------------
# What each storage's metrics()/stats() holds (storage/redis/_base.py,
# storage/two_tier/_storage.py, the twins' InMemoryStorage.stats, the zone's
# stats/metrics): the fields that only ever grow are counters, the rest are
# gauges. A field named in neither (a future storage's) is exported as a gauge.
STORAGE_COUNTERS: dict[str, str] = {
    # RedisStorage / AsyncRedisStorage
    "decisions": "Decisions the storage answered.",
    "errors": "Decision calls that failed (server or connection).",
    "timeouts": "Failed decision calls that timed out.",
    "key_errors": "Error replies about one call's key.",
    "write_refused": "Writes the server refused (OOM, MISCONF).",
    "degraded": "Decisions answered by the failure policy.",
    "script_loads": "Lua scripts loaded into the server.",
    "breaker_open_skips": "Decisions not sent because the circuit breaker was open.",
    "near_cache_hits": "Decisions answered by the near cache.",
    "breaker_opened": "Times the circuit breaker opened.",
    # TwoTierStorage
    "syncs": "Syncs with the shared store.",
    "sync_failures": "Syncs the shared store did not answer.",
    "sync_errors": "Syncs that raised something else.",
    "early_syncs": "Syncs started before their interval.",
    "full_syncs": "Syncs that covered every key.",
    "sync_latency_total": "Seconds spent syncing, in all.",
    "units_pushed": "Units pushed to the shared store.",
    "units_reconciled": "Units reconciled after a partition.",
    "partitions": "Times the shared store became unreachable.",
    "rejoins": "Times the shared store became reachable again.",
    "decisions_native": "Decisions answered in C on the local lease.",
    # InMemoryStorage / SharedMemoryStorage
    "evicted_at_rest": "Keys forgotten at rest to make room.",
    "evicted_active": "Active keys evicted to make room.",
    "evicted_idle": "Keys evicted after idling.",
    "denied_new": "New keys refused by a full table.",
    "denied_arena": "New keys refused by a full arena.",
    "stripes_repaired": "Stripes repaired after a dead lock holder.",
    "lock_recoveries": "Locks recovered from a dead holder.",
    "arena_failures": "Arena allocations that failed.",
}
STORAGE_GAUGES: dict[str, str] = {
    "keys": "Keys held.",
    "keys_tracked": "Keys tracked locally.",
    "keys_synced_last": "Keys covered by the latest sync.",
    "keys_deferred_last": "Keys the latest sync left for their turn in a later one.",
    "sync_spread": "Syncs a key with room in its lease waits for its turn (1: every sync).",
    "sync_latency_last": "Seconds the latest sync took.",
    "sync_latency_max": "Seconds the slowest sync took.",
    "sync_latency_avg": "Mean seconds per sync.",
    "partition": "1 while the shared store is unreachable.",
    "instances": "Live instances sharing the limits.",
    "silent_instances": "Instances whose heartbeat lapsed within the grace period.",
    "heartbeat_ttl_last": "Seconds the latest heartbeat keeps this instance live.",
    "max_keys": "Keys the table holds at most.",
    "segment_bytes": "Bytes of the shared-memory segment.",
    "arena_bytes": "Bytes of the key arena.",
    "arena_used_bytes": "Bytes of the key arena in use.",
    "arena_unused_bytes": "Bytes of the key arena never handed out.",
    "namespaces": "Limiter namespaces in the zone.",
    "processes": "Live processes attached to the zone.",
    "processes_unrecorded": "Processes attached past the zone registry's 128 slots (the zone is live).",
}
STORAGE_LABELS = ("storage", "storage_type")
# a Redis storage's breaker_state, exported one gauge per state (1 for the current)
BREAKER_STATES = ("closed", "half-open", "open")
_RESERVED = frozenset({"scrape_errors", "breaker_state"})
_NAME_RE = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_FIELD_BAD = re.compile(r"[^a-zA-Z0-9_]")


class _Watched:
    """A storage whose numbers are exported, and how its scrapes went."""

    __slots__ = ("name", "read", "scrape_errors", "storage", "type_name")

    def __init__(self, storage: Any, name: str, read: Any) -> None:
        self.storage = storage
        self.name = name
        self.type_name = type(storage).__name__
        self.read = read
        self.scrape_errors = 0


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
        if not isinstance(namespace, str) or not _NAME_RE.match(namespace):
            raise ValidationError(
                f"namespace must be a Prometheus metric name ([a-zA-Z_:][a-zA-Z0-9_:]*), got {namespace!r}"
            )
        self.near_ratio = float(near_ratio)
        self.namespace = namespace
        self._watched: list[_Watched] = []
        # called with each newly watched storage (the OpenTelemetry bridge adds its instruments)
        self._on_watch: list[Any] = []
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
            allowed, near, denied = lane.allowed, lane.near_limit, lane.denied
            if allowed or denied or lane.rule in out:
                total = out.setdefault(lane.rule, dict.fromkeys(OUTCOMES, 0))
                total["allowed"] += allowed
                total["near_limit"] += near
                total["denied"] += denied
        return dict(sorted(out.items()))

    # -- storages ---------------------------------------------------------------
    def watch_storage(self, storage: Any, name: str | None = None) -> None:
        """Export ``storage``'s own numbers with the rule counters: each
        numeric field of its ``metrics()`` (else ``stats()``) as
        ``<namespace>_storage_<field>``, labelled ``storage=name`` (default:
        its type's name) and ``storage_type``. Read at scrape time only, so
        the request path does nothing more. A storage whose read raises is
        counted in ``<namespace>_storage_scrape_errors_total`` and skipped
        for that scrape; the others are still exported."""
        read = getattr(storage, "metrics", None)
        if not callable(read):
            read = getattr(storage, "stats", None)
        if not callable(read):
            raise ValidationError(
                f"{type(storage).__name__} has neither metrics() nor stats(): nothing to export"
            )
        if name is None:
            name = type(storage).__name__
        if not isinstance(name, str) or not name or len(name) > 128 or not name.isprintable():
            raise ValidationError(f"storage name must be 1 to 128 printable characters, got {name!r}")
        watched = _Watched(storage, name, read)
        with self._lock:
            for other in self._watched:
                if other.storage is storage:
                    raise ValidationError(f"storage {other.name!r} is already watched")
                if other.name == name:
                    raise ValidationError(
                        f"a storage named {name!r} is already watched: pass watch_storage(storage, name=...)"
                    )
            self._watched.append(watched)
            listeners = list(self._on_watch)
        for listener in listeners:
            listener()

    def unwatch_storage(self, storage: Any) -> bool:
        """Stop exporting ``storage``; False when it was not watched."""
        with self._lock:
            kept = [w for w in self._watched if w.storage is not storage]
            found = len(kept) != len(self._watched)
            self._watched = kept
        return found

    def _storage_families(self) -> list[Family]:
        """The watched storages' numbers, read now (outside our lock: a
        storage's read takes its own locks, and may be slow or fail)."""
        ns = self.namespace
        with self._lock:
            watched = list(self._watched)
        if not watched:
            return []
        fields: dict[str, list[tuple[tuple[str, ...], float]]] = {}
        breaker: list[tuple[tuple[str, ...], float]] = []
        errors: list[tuple[tuple[str, ...], float]] = []
        for w in watched:
            labels = (w.name, w.type_name)
            try:
                numbers = dict(w.read())
            except Exception:  # noqa: BLE001 - Redis down, a closed zone: the scrape goes on without it
                with self._lock:
                    w.scrape_errors += 1
                numbers = None
            errors.append((labels, w.scrape_errors))
            if numbers is None:
                continue
            state = numbers.get("breaker_state")
            if isinstance(state, str):
                breaker.extend(((*labels, s), int(s == state)) for s in BREAKER_STATES)
            for field, value in numbers.items():
                if field in _RESERVED or isinstance(value, str) or not isinstance(value, int | float):
                    continue  # only numbers are exported (bools as 0/1)
                if isinstance(value, bool):
                    value = int(value)
                fields.setdefault(field, []).append((labels, value))
        out = [
            Family(
                f"{ns}_storage_scrape_errors",
                "counter",
                "Reads of a watched storage's metrics that raised.",
                STORAGE_LABELS,
                tuple(errors),
            )
        ]
        if breaker:
            out.append(
                Family(
                    f"{ns}_storage_breaker_state",
                    "gauge",
                    "The circuit breaker's state: 1 for the current one.",
                    (*STORAGE_LABELS, "state"),
                    tuple(breaker),
                )
            )
        for field in sorted(fields):
            base = _FIELD_BAD.sub("_", field)
            if field in STORAGE_COUNTERS:
                kind: Kind = "counter"
                help_text = STORAGE_COUNTERS[field]
                base = base.removesuffix("_total")  # the sample name adds it back
            else:
                kind = "gauge"
                help_text = STORAGE_GAUGES.get(field, f"The storage's {field!r}, as it reports it.")
            out.append(Family(f"{ns}_storage_{base}", kind, help_text, STORAGE_LABELS, tuple(fields[field])))
        out.sort(key=lambda f: f.name)
        return out

    # -- exposition ---------------------------------------------------------------
    def families(self) -> list[Family]:
        """Every exported family, read now: the rule counters from
        :meth:`snapshot`, then the watched storages' numbers."""
        snap = self.snapshot()
        ns = self.namespace
        requests = tuple(
            ((rule, outcome), counts[outcome]) for rule, counts in snap.items() for outcome in OUTCOMES[:3]
        )
        near = tuple(((rule,), counts["near_limit"]) for rule, counts in snap.items())
        return [
            Family(
                f"{ns}_requests",
                "counter",
                "Requests decided by a rate-limit rule, by outcome.",
                ("rule", "outcome"),
                requests,
            ),
            Family(
                f"{ns}_near_limit",
                "counter",
                f"Admitted requests left under {self.near_ratio:.0%} of the limit.",
                ("rule",),
                near,
            ),
            *self._storage_families(),
        ]

    def render_prometheus(self) -> str:
        """The Prometheus text exposition format (version 0.0.4)."""
        lines: list[str] = []
        for family in self.families():
            lines += family.render()
        return "\n".join(lines) + "\n"

    def collect(self) -> Iterator[Metric]:
        """The ``prometheus_client`` Collector protocol: register with
        ``prometheus_client.REGISTRY.register(metrics)``. The library is
        imported here, when a registry scrapes, so nanolimit never needs it."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        for family in self.families():
            cls = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            metric = cls(family.name, family.help, labels=family.labels)
            for values, value in family.samples:
                metric.add_metric(list(values), value)
            yield metric

    def describe(self) -> list[Metric]:
        """Empty, so that registering does not scrape (a registry then
        calls :meth:`collect` only when it is read)."""
        return []

    def __repr__(self) -> str:
        return f"<Metrics rules={len(self.snapshot())}>"

    def __getstate__(self) -> Any:
        raise TypeError("Metrics cannot be pickled (it holds per-thread counters)")


class _ShardedAdmitted:
    """The pure-Python twin of ``nanolimit._core.AdmittedRequests``: counts
    go to the calling thread's shard (Python has no atomic increment)."""

    allowed = 0  # counted in the shards
    near_limit = 0
    denied = 0

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

    def refusal(
        self,
        decision: Any,
        headers: dict[str, str],
        limit_str: str,
        policy: str,
        r_prefix: str,
        retry_after: float,
        wall_now: float,
    ) -> int:
        """A 429's headers and its ``Retry-After`` (what the native lane
        writes in C); counts nothing."""
        if not retry_after < MAX_HEADER_SECONDS:  # NaN and infinity too
            raise ValidationError(f"cannot write headers for retry_after={retry_after!r}")
        headers.update(
            rate_headers(limit_str, policy, r_prefix, decision.remaining, decision.reset_after, wall_now)
        )
        retry = retry_seconds(retry_after)
        headers["Retry-After"] = str(retry)
        return retry
