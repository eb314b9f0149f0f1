"""The framework-free request path (SPEC §6).

``RateLimitMiddleware(registry, factory)(request, next_handler)`` finds the
rule(s), builds the key, decides, counts, and answers 429 (SPEC §2 body and
headers) or the handler's response with the headers added. No rule: the
request passes unlimited, by choice. The ASGI and WSGI adapters
(:mod:`nanolimit.asgi`, :mod:`nanolimit.wsgi`) call :meth:`check` and do
their own I/O, so every front end shares this one decision path.

The hot path is written for the interpreter: one ruleset snapshot per
request, a per-rule binding (limiter, pre-rendered constant headers,
counters) found by the rule's identity, this thread's metric shard, and a
header dict built from the decision's numbers. Stacked rulesets decide
several rules at once through ``storage.allow_all`` (all or nothing).
"""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .._shared import Algorithm, ValidationError
from .factory import LimiterFactory
from .headers import deny_body, rate_headers, retry_seconds, rule_pieces
from .keys import DefaultKeyExtractor, KeyExtractor
from .metrics import ALLOWED, DENIED, NEAR_LIMIT, SHADOW_DENIED, Metrics
from .request import Request
from .rules import CACHE_KEY_BYTES, MAX_CACHED_KEY_BYTES, RateLimitRule, RuleRegistry, RuleSet, key_bytes

__all__ = ["Outcome", "RateLimitMiddleware", "Request", "Response", "deny_body"]

_ceil = math.ceil
_MISSING: Any = object()


@dataclass(slots=True)
class Response:
    """A response of the framework-free pipeline."""

    status: int = 200
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""

    def json(self) -> Any:
        return json.loads(self.body)


class Outcome:
    """The verdict on one request, for the front ends.

    ``allowed``: let it through (always true for dry-run rules);
    ``headers``: what to add to the response (or the 429's headers);
    ``delay``: seconds a shaping leaky-bucket rule wants the request to wait;
    ``rule``: the deciding (or denying) rule's name; ``retry_after``: whole
    seconds for the 429 body; ``decision``: the Decision or CompoundDecision.
    """

    __slots__ = ("allowed", "decision", "delay", "headers", "retry_after", "rule")

    def __init__(
        self,
        allowed: bool,
        headers: dict[str, str],
        delay: float,
        rule: str,
        retry_after: int,
        decision: Any,
    ) -> None:
        self.allowed = allowed
        self.headers = headers
        self.delay = delay
        self.rule = rule
        self.retry_after = retry_after
        self.decision = decision

    def body(self) -> bytes:
        """The 429 body (meaningful when not allowed)."""
        return deny_body(self.rule, self.retry_after)

    def __repr__(self) -> str:
        return f"<Outcome allowed={self.allowed} rule={self.rule!r} delay={self.delay!r}>"


class _Binding:
    """A rule bound to its limiter, with its constant header values rendered once."""

    __slots__ = (
        "admitted",
        "allow",
        "dry_run",
        "limit_str",
        "limiter",
        "name",
        "near",
        "policy",
        "r_prefix",
        "rule",
        "scope",
        "shape",
    )

    def __init__(self, rule: RateLimitRule, limiter: Any, metrics: Metrics) -> None:
        near_ratio = metrics.near_ratio
        self.admitted = metrics.admitted(rule.name)
        self.rule = rule
        self.limiter = limiter
        self.allow = limiter.allow
        self.name = rule.name
        self.scope = rule.scope
        self.dry_run = rule.dry_run
        self.shape = rule.shape and rule.algorithm is Algorithm.LEAKY_BUCKET
        capacity = limiter.capacity
        self.near = capacity * near_ratio
        self.limit_str, self.policy, self.r_prefix = rule_pieces(rule.name, capacity, limiter.window_seconds)


class RateLimitMiddleware:
    """A pipeline stage ``(request, next_handler) -> Response``.

    ``factory`` defaults to a :class:`LimiterFactory` on a fresh in-memory
    store; ``extractor`` to :class:`DefaultKeyExtractor`; ``metrics`` to a
    new :class:`Metrics` (read it back as ``middleware.metrics``).
    ``wall_clock`` gives the Unix time of ``X-RateLimit-Reset``; ``sleep``
    is how a shaping leaky-bucket rule waits (the ASGI adapter awaits
    instead).
    """

    def __init__(
        self,
        registry: RuleRegistry,
        factory: LimiterFactory | None = None,
        extractor: KeyExtractor | None = None,
        metrics: Metrics | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Any] = time.sleep,
    ) -> None:
        if not isinstance(registry, RuleRegistry):
            raise ValidationError(f"registry must be a RuleRegistry, got {type(registry).__name__}")
        self.registry = registry
        self.factory = factory if factory is not None else LimiterFactory()
        self.extractor: KeyExtractor = extractor if extractor is not None else DefaultKeyExtractor()
        self.metrics = metrics if metrics is not None else Metrics()
        self.wall_clock = wall_clock
        self.sleep = sleep
        fast = getattr(self.extractor, "storage_key_for", None)
        if fast is None:
            extractor_ = self.extractor

            def fast(request: Request, scope: Any) -> str:
                return extractor_.key_for(request, scope).storage_key()

        self._key: Callable[[Request, Any], str] = fast
        self._state: tuple[RuleSet | None, dict[int, _Binding]] = (None, {})
        # (method, path, tier) -> binding (None: no rule), for one snapshot,
        # keyed by the request's own method and path: a hit normalises nothing
        self._routes: tuple[RuleSet | None, dict[tuple[str, str, str | None], _Binding | None]] = (None, {})
        self.route_cache_size = 4096
        # bounded by bytes too: keys over MAX_CACHED_KEY_BYTES are never
        # cached, and the cached keys take at most route_cache_bytes in all
        self.route_cache_bytes = CACHE_KEY_BYTES
        self._route_bytes = 0
        self._local = threading.local()  # this thread's metric shard, cached

    # -- bindings ---------------------------------------------------------------
    def _bind(self, rule: RateLimitRule, ruleset: RuleSet) -> _Binding:
        state = self._state
        if state[0] is not ruleset:
            state = (ruleset, {})
            self._state = state
        binding = _Binding(rule, self.factory.for_rule(rule), self.metrics)
        # keyed by identity: the binding holds the rule, so the id stays unique
        state[1][id(rule)] = binding
        return binding

    def _route(self, request: Request, ruleset: RuleSet, tier: str | None) -> _Binding | None:
        """Resolve and remember the binding of a (method, path, tier); None
        when no rule applies, or, in stacked mode, when several do (the
        stacked path resolves those itself)."""
        if ruleset.stacked:
            rules = ruleset.match_all(request.method, request.path, tier)
            rule = rules[0] if len(rules) == 1 else None
        else:
            rule = ruleset.match(request.method, request.path, tier)
        binding = None
        if rule is not None:
            state = self._state
            binding = state[1].get(id(rule)) if state[0] is ruleset else None
            if binding is None or binding.rule is not rule:
                binding = self._bind(rule, ruleset)
        method = request.method
        path = request.path
        size = key_bytes(method, path, tier)
        if size > MAX_CACHED_KEY_BYTES:
            return binding  # a hostile long path or method: decided, never kept
        routes = self._routes
        if routes[0] is not ruleset:
            routes = (ruleset, {})
            self._routes = routes
            self._route_bytes = 0
        table = routes[1]
        if len(table) >= self.route_cache_size or self._route_bytes + size > self.route_cache_bytes:
            table.clear()  # bounded: unique hostile paths cost a miss, never memory
            self._route_bytes = 0
        table[(method, path, tier)] = binding
        self._route_bytes += size
        return binding

    def _counts(self, shard: dict[str, list[int]], name: str) -> list[int]:
        counts = shard.get(name)
        if counts is None:
            counts = shard[name] = [0, 0, 0, 0]
        return counts

    def _headers(self, b: _Binding, d: Any) -> dict[str, str]:
        return rate_headers(b.limit_str, b.policy, b.r_prefix, d.remaining, d.reset_after, self.wall_clock())

    # -- the decision -----------------------------------------------------------
    def check(self, request: Request) -> Outcome | None:
        """Decide ``request``; None when no rule applies (pass through)."""
        raw = self._decide(request)
        return None if raw is None else Outcome(*raw)

    def _decide(self, request: Request) -> tuple[bool, dict[str, str], float, str, int, Any] | None:
        """:meth:`check` as a plain tuple (the hot path builds no Outcome)."""
        ruleset = self.registry._set
        tier = self.extractor.tier_for(request) if ruleset.has_tiers else None
        routes = self._routes
        if routes[0] is ruleset:
            b = routes[1].get((request.method, request.path, tier), _MISSING)
            if b is _MISSING:
                b = self._route(request, ruleset, tier)
        else:
            b = self._route(request, ruleset, tier)
        if b is None:
            if ruleset.stacked:
                rules = ruleset.match_all(request.method, request.path, tier)
                if rules:
                    return self._check_stacked(request, ruleset, rules)
            return None
        d = b.allow(self._key(request, b.scope))
        if d.allowed:
            if b.dry_run:
                b.admitted.count(d, b.near)
                return (True, {}, 0.0, b.name, 0, d)
            headers: dict[str, str] = {}
            # counts it and writes the five headers in one call (C when built), as __call__ does
            b.admitted.record(d, headers, b.limit_str, b.policy, b.r_prefix, b.near, self.wall_clock())
            return (True, headers, d.delay if b.shape else 0.0, b.name, 0, d)
        if b.dry_run:
            try:
                shard = self._local.shard
            except AttributeError:
                shard = self._local.shard = self.metrics.shard()
            self._counts(shard, b.name)[SHADOW_DENIED] += 1
            return (True, {}, 0.0, b.name, 0, d)
        return self._denied(b, d)

    def _denied(self, b: _Binding, d: Any) -> tuple[bool, dict[str, str], float, str, int, Any]:
        """Count and answer a denial by an enforced rule (the inlined path's tail)."""
        try:
            shard = self._local.shard
        except AttributeError:
            shard = self._local.shard = self.metrics.shard()
        self._counts(shard, b.name)[DENIED] += 1
        return self._refusal(b, d, d.retry_after, d)

    def _refusal(
        self, b: _Binding, d: Any, retry_after: float, answer: Any
    ) -> tuple[bool, dict[str, str], float, str, int, Any]:
        """A 429 by ``b`` (whose decision is ``d``): its headers, and the one
        place ``Retry-After`` is written (``answer`` is what the caller
        gets as the decision: ``d``, or the compound decision)."""
        headers = self._headers(b, d)
        retry = retry_seconds(retry_after)
        headers["Retry-After"] = str(retry)
        return (False, headers, 0.0, b.name, retry, answer)

    def _check_stacked(
        self, request: Request, ruleset: RuleSet, rules: tuple[RateLimitRule, ...]
    ) -> tuple[bool, dict[str, str], float, str, int, Any]:
        """Several rules at once: shadow rules decide on their own; enforced
        rules decide together, all or nothing, through ``storage.allow_all``."""
        state = self._state
        bindings: list[_Binding] = []
        for rule in rules:
            b = state[1].get(id(rule)) if state[0] is ruleset else None
            if b is None or b.rule is not rule:
                b = self._bind(rule, ruleset)
                state = self._state
            bindings.append(b)
        shard = self.metrics.shard()
        enforced: list[tuple[_Binding, str]] = []
        for b in bindings:
            key = self._key(request, b.scope)
            if not b.dry_run:
                enforced.append((b, key))
                continue
            d = b.allow(key)
            counts = self._counts(shard, b.name)
            if d.allowed:
                counts[ALLOWED] += 1
                if d.remaining < b.near:
                    counts[NEAR_LIMIT] += 1
            else:
                counts[SHADOW_DENIED] += 1
        if not enforced:
            return (True, {}, 0.0, bindings[0].name, 0, None)
        if len(enforced) == 1:
            b, key = enforced[0]
            d = b.allow(key)
            decisions = [d]
            summary: Any = d
        else:
            allow_all = getattr(self.factory.storage, "allow_all", None)
            if allow_all is None:
                raise ValidationError(
                    f"{type(self.factory.storage).__name__} cannot decide compound limits "
                    "(it has no allow_all); use an InMemoryStorage or RedisStorage, or an unstacked registry"
                )
            summary = allow_all([(b.limiter, key) for b, key in enforced])
            decisions = list(summary.decisions)
        allowed = bool(summary.allowed)
        delay = 0.0
        for (b, _), d in zip(enforced, decisions):
            counts = self._counts(shard, b.name)
            if allowed:
                counts[ALLOWED] += 1
                if d.remaining < b.near:
                    counts[NEAR_LIMIT] += 1
                if b.shape and d.delay > delay:
                    delay = d.delay
            elif not d.allowed:
                counts[DENIED] += 1
        # the headers describe the binding rule (its own quota, window,
        # remaining and reset): the one the compound decision names
        binding, decision = enforced[0][0], decisions[0]
        if len(enforced) > 1:
            name = summary.rule
            for (b, _), d in zip(enforced, decisions):
                if b.name == name:
                    binding, decision = b, d
                    break
        if allowed:
            return (True, self._headers(binding, decision), delay, binding.name, 0, summary)
        return self._refusal(binding, decision, summary.retry_after, summary)

    # -- the pipeline stage -------------------------------------------------------
    def __call__(self, request: Request, next_handler: Callable[[Request], Response]) -> Response:
        # The common case (one enforced rule, admitted, no shaping) is
        # :meth:`_decide` inlined: no tuple, one call fewer per request.
        # Everything else takes the shared path below it.
        ruleset = self.registry._set
        routes = self._routes
        if routes[0] is ruleset and not ruleset.has_tiers:
            b = routes[1].get((request.method, request.path, None), _MISSING)
            if b is not None and b is not _MISSING and not b.dry_run and not b.shape:
                d = b.allow(self._key(request, b.scope))
                if d.allowed:
                    try:
                        response = next_handler(request)
                    except BaseException:
                        b.admitted.count(d, b.near)  # admitted all the same
                        raise
                    # counts it and writes the five headers in one call (C when built)
                    b.admitted.record(
                        d, response.headers, b.limit_str, b.policy, b.r_prefix, b.near, self.wall_clock()
                    )
                    return response
                return self._respond(request, next_handler, self._denied(b, d))
        return self._respond(request, next_handler, self._decide(request))

    def _respond(
        self,
        request: Request,
        next_handler: Callable[[Request], Response],
        raw: tuple[bool, dict[str, str], float, str, int, Any] | None,
    ) -> Response:
        if raw is None:
            return next_handler(request)
        allowed, headers, delay, name, retry, _ = raw
        if not allowed:
            headers["Content-Type"] = "application/json"
            return Response(429, headers, deny_body(name, retry))
        if delay > 0.0:
            self.sleep(delay)
        response = next_handler(request)
        if headers:
            response.headers.update(headers)
        return response

    def __repr__(self) -> str:
        return f"<RateLimitMiddleware {self.registry!r} {self.factory!r}>"
