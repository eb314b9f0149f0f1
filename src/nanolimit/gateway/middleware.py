"""The framework-free request path (docs/spec.md §6).

``RateLimitPipeline(registry, factory)(request, next_handler)`` finds the
rule(s), builds the key, decides, counts, and answers 429 (docs/spec.md §2
body and headers) or the handler's response with the headers added. No rule:
the request passes unlimited, by choice.

:meth:`RateLimitPipeline.check` decides a :class:`Request`;
:meth:`RateLimitPipeline.decide` is what every adapter (ASGI, WSGI,
Flask, Django, aiohttp) calls: the same decision from the request's method,
path, peer and route, its Request built only when a rule or a hook needs
one. Both do their own I/O nowhere, so every front end shares one decision
path. A request takes one ruleset snapshot, one route-cache look-up (the
only cache of its route: misses walk the ruleset uncached) and one entry
into the core: for a plain rule its native lane (``RuleLane``: decide,
count and write the headers in one C call, one clock read), else
``limiter.allow`` (or ``storage.allow_all`` for stacked rules) and the
headers rendered in Python. The :class:`Outcome` carries the headers in
the form the front end writes (a dict, ASGI's or WSGI's pairs).
``__call__`` inlines the common case (one enforced rule, admitted) and
writes the headers straight into the handler's response.
"""

from __future__ import annotations

import re
import threading
import time
import warnings
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from .._limiter_config import Algorithm
from .._select import native_core
from ..errors import ValidationError
from .charges import Charges, Counted
from .factory import LimiterFactory
from .headers import RATE_HEADERS, deny_body, rate_headers, retry_seconds, rule_pieces
from .keyfuncs import call_key
from .keys import DefaultKeyExtractor, KeyExtractor
from .metrics import ALLOWED, DENIED, NEAR_LIMIT, SHADOW_DENIED, Metrics
from .outcome import CostTooHigh, Outcome, Response, _DenialLog, _outcome, render_body
from .registry import CACHE_KEY_BYTES, MAX_CACHED_KEY_BYTES, RuleRegistry, RuleSet, key_bytes
from .request import Request, public_path
from .rules import KeyScope, RateLimitRule

__all__ = ["CostTooHigh", "Outcome", "RateLimitPipeline", "Request", "Response", "deny_body", "render_body"]

_SETTLE = getattr(native_core(), "settle_outcome", None)


class _Binding:
    """A rule bound to its limiter, with its constant header text rendered once.

    ``simple``: one enforced rule that never shapes, the case the hot paths
    decide inline (a route-cache value answers it with one attribute read)."""

    __slots__ = (
        "admitted",
        "allow",
        "capacity",
        "cost",
        "counted",
        "counted_lane",
        "dry_run",
        "fixed_key",
        "key_fn",
        "lane",
        "limit_str",
        "limiter",
        "name",
        "near",
        "peer",
        "policy",
        "r_prefix",
        "rule",
        "scope",
        "shape",
        "simple",
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
        self.cost = rule.cost
        self.counted = rule.count_when is not None  # charged on entry, settled on the response
        self.key_fn = rule.key  # names the key instead of the scope: check() calls it
        plain = not self.dry_run and not self.shape and self.cost == 1 and rule.key is None
        self.simple = plain and not self.counted
        self.counted_lane = plain and self.counted  # the simple lane, keeping a charge
        capacity = self.capacity = limiter.capacity
        self.near = capacity * near_ratio
        self.limit_str, self.policy, self.r_prefix = rule_pieces(rule.name, capacity, limiter.window_seconds)
        # set by the pipeline: the native lane (RuleLane) of a simple or
        # counted-lane rule, and how decide() keys it without a Request
        self.lane: Any = None
        self.peer = False  # an IP scope: keyed by the connection peer
        self.fixed_key: str | None = None  # a global scope's one key


class _Stack:
    """The route of a request that several rules of a stacked ruleset cover:
    their bindings, most specific first (one per distinct set of rules, so a
    flood of paths shares a few)."""

    __slots__ = ("bindings",)
    simple = False
    counted_lane = False
    lane = None

    def __init__(self, bindings: tuple[_Binding, ...]) -> None:
        self.bindings = bindings


class _NoRoute:
    """A route-cache sentinel; ``simple`` is false, so the hot path's one
    attribute test also turns these away."""

    __slots__ = ()
    simple = False
    counted_lane = False
    lane = None


_MISSING = _NoRoute()  # not in the route cache
_UNLIMITED = _NoRoute()  # cached: no rule applies
_Route = _Binding | _Stack | _NoRoute


_HOOK_NAMES = ("on_breach", "route_resolver", "route_context")
# The fast lanes test ``request.cost is _ONE``: the int 1 is one object in
# CPython, and anything else (True included, refused there) takes check().
_ONE = 1
_TOKEN = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")  # an RFC 9110 header name


# The forms of an Outcome's headers decide() writes (RuleLane.admit's).
DICT, ASGI_PAIRS, WSGI_PAIRS = 0, 1, 2


# How a front end on an event loop decides on a store (ASGI, aiohttp).
INLINE, AWAIT, THREAD = "inline", "await", "thread"


def decide_mode(storage: Any, decide: str | None = None) -> str:
    """How a decision on ``storage`` keeps off the loop: ``"await"`` for a
    store with async kernels, ``"thread"`` for a synchronous Redis store,
    ``"inline"`` for in-process ones; ``decide`` chooses between the last
    two."""
    if getattr(storage, "run_kernel_async", None) is not None:
        if decide not in (None, AWAIT):
            raise ValidationError(f"an {type(storage).__name__} is awaited; decide={decide!r} does not apply")
        return AWAIT
    if decide is None:
        try:
            from ..storage.redis import RedisStorage
        except ImportError:  # no Redis client installed: no Redis store either
            return INLINE
        return THREAD if isinstance(storage, RedisStorage) else INLINE
    if decide not in (INLINE, THREAD):
        raise ValidationError(f"decide must be 'inline' or 'thread', got {decide!r}")
    return INLINE if decide == INLINE else THREAD  # the constants: the request path compares by identity


class RateLimitPipeline:
    """A pipeline stage ``(request, next_handler) -> Response``, and the
    decision every front end shares (:meth:`check`).

    ``factory`` defaults to a :class:`LimiterFactory` on a fresh in-memory
    store; ``extractor`` to :class:`DefaultKeyExtractor`; ``metrics`` to a
    new :class:`Metrics` (read it back as ``pipeline.metrics``).
    ``wall_clock`` gives the Unix time of ``X-RateLimit-Reset`` (read at
    most once per request); ``sleep`` is how a shaping leaky-bucket rule
    waits (the ASGI adapter awaits instead).

    Denials the app controls: ``headers=False`` sends no rate-limit headers
    (a 429 keeps ``Retry-After``); ``header_names`` renames them
    (``{"X-RateLimit-Limit": "X-Limit"}``); ``on_breach(request, outcome)``
    is called on every denial; ``log_denials`` seconds between
    ``nanolimit.denials`` records per rule (None: no records).
    ``route_resolver(request) -> template | None`` finds the matched route
    of a request that does not carry one, on a route-cache miss only (the
    framework adapters install it); ``route_context(request) -> str`` is
    everything that resolver reads besides the method and the path (the
    scope's type, the Host), which the route cache then keys by. A
    resolver without one is asked on every request of a ruleset with route
    rules, and the cache keys by its answer.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> RateLimitPipeline:
        # Handed an app (as Starlette's Middleware(...) and
        # app.add_middleware do), this is the wrong import (most often the
        # old name, nanolimit.RateLimitMiddleware), and must say so when
        # the app is built, not as a TypeError on every request.
        first = args[0] if args else kwargs.get("registry")
        if (args and "registry" in kwargs) or (
            first is not None and not isinstance(first, RuleRegistry) and callable(first)
        ):
            raise TypeError(
                "nanolimit.RateLimitPipeline is the framework-free pipeline and takes a RuleRegistry "
                "first; it was handed an app. For Starlette, FastAPI or any ASGI app use "
                "'from nanolimit.asgi import RateLimitMiddleware'; for Flask, Django or any WSGI app "
                "'from nanolimit.wsgi import RateLimitMiddleware'."
            )
        return super().__new__(cls)

    def __init__(
        self,
        registry: RuleRegistry,
        factory: LimiterFactory | None = None,
        extractor: KeyExtractor | None = None,
        metrics: Metrics | None = None,
        *,
        wall_clock: Callable[[], float] = time.time,
        sleep: Callable[[float], Any] = time.sleep,
        headers: bool = True,
        header_names: Mapping[str, str] | None = None,
        on_breach: Callable[[Request, Outcome], Any] | None = None,
        log_denials: float | None = 1.0,
        route_resolver: Callable[[Request], str | None] | None = None,
        route_context: Callable[[Request], str] | None = None,
    ) -> None:
        if not isinstance(registry, RuleRegistry):
            raise ValidationError(f"registry must be a RuleRegistry, got {type(registry).__name__}")
        if not isinstance(headers, bool):
            raise ValidationError(f"headers must be a bool, got {headers!r}")
        renames = dict(header_names or {})
        for old, new in renames.items():
            if old not in (*RATE_HEADERS, "Retry-After"):
                raise ValidationError(
                    f"header_names: {old!r} is not a header nanolimit writes; "
                    f"expected one of {', '.join((*RATE_HEADERS, 'Retry-After'))}"
                )
            if not isinstance(new, str) or not _TOKEN.match(new):
                raise ValidationError(f"header_names: {new!r} is not a valid header name")
        if log_denials is not None and (
            isinstance(log_denials, bool) or not isinstance(log_denials, (int, float)) or not log_denials >= 0
        ):
            raise ValidationError(f"log_denials must be seconds >= 0 or None, got {log_denials!r}")
        for hook_name, hook in zip(_HOOK_NAMES, (on_breach, route_resolver, route_context)):
            if hook is not None and not callable(hook):
                raise ValidationError(f"{hook_name} must be callable, got {hook!r}")
        self.registry = registry
        self.factory = factory if factory is not None else LimiterFactory()
        self.extractor: KeyExtractor = extractor if extractor is not None else DefaultKeyExtractor()
        self.metrics = metrics if metrics is not None else Metrics()
        self.wall_clock = wall_clock
        self.sleep = sleep
        self.headers = headers
        self.header_names = renames
        self._on_breach = on_breach
        self.route_resolver = route_resolver
        self.route_context = route_context
        self._log = None if log_denials is None else _DenialLog(float(log_denials))
        fast = getattr(self.extractor, "storage_key_for", None)
        if fast is None:
            extractor_ = self.extractor

            def fast(request: Request, scope: Any) -> str:
                return extractor_.key_for(request, scope).storage_key()

        self._key: Callable[[Request, Any], str] = fast
        # one snapshot's bindings (by rule identity) and stacks (by the rules' identities)
        self._state: tuple[RuleSet | None, dict[int, _Binding], dict[tuple[int, ...], _Stack]] = (
            None,
            {},
            {},
        )
        # The route cache, the only one on the request path: (method, path,
        # tier) -> route, for one snapshot, keyed by the request's own method
        # and path, so a hit normalises nothing. A miss walks the ruleset
        # uncached (RuleSet.lookup_route): the route is never cached twice.
        # A ruleset whose rules or exemptions name routes (``routed``) is
        # decided by the matched route as well, so its key has a fourth
        # part, the route (see _routed_key): a websocket, another Host or a
        # request that matched no route is then cached apart, and never
        # decides the next request. (Values are _Route; typed Any so that
        # the hot paths read a value's attributes after the one ``simple``
        # test, without a narrowing call.)
        self._routes: tuple[RuleSet | None, dict[tuple[Any, ...], Any]] = (None, {})
        self.route_cache_size = 4096
        # bounded by bytes too: keys over MAX_CACHED_KEY_BYTES are never
        # cached, and the cached keys take at most route_cache_bytes in all
        self.route_cache_bytes = CACHE_KEY_BYTES
        self._route_bytes = 0
        self._local = threading.local()  # this thread's metric shard, cached
        # __call__ inlines check(); a subclass that overrides check() gets it
        # called for every request instead, as the adapters call it. The
        # inline lane writes the five headers as they are: off or renamed
        # headers take check().
        self._inline = type(self).check is RateLimitPipeline.check and headers and not renames
        self._plain = headers and not renames
        # the native lanes (RuleLane, one per simple binding), and what keys
        # them with no Request: the stock extractor's cache of peer keys
        core = native_core()
        self._lanes: Any = None if core is None else core.rule_lane
        self._wall: Any = None if wall_clock is time.time else wall_clock  # None: read in C
        stock = type(self.extractor) is DefaultKeyExtractor
        self._peer_keys: Any = self.extractor.peer_keys() if stock else None  # type: ignore[attr-defined]
        self._global_key = "global:*" if stock else None
        # The native twin's decide() and decide_scope(): the same lookups in
        # C, bound per pipeline (a subclass overriding either keeps its own).
        if core is not None:
            lanes = core.PipelineLanes(self, registry, self._peer_keys, _UNLIMITED)
            if type(self).decide is RateLimitPipeline.decide:
                self.decide = lanes.decide  # type: ignore[method-assign]
            if type(self).decide_scope is RateLimitPipeline.decide_scope:
                self.decide_scope = lanes.decide_scope  # type: ignore[method-assign]

    @property
    def on_breach(self) -> Callable[[Request, Outcome], Any] | None:
        """Called with ``(request, outcome)`` on every denial."""
        return self._on_breach

    @on_breach.setter
    def on_breach(self, hook: Callable[[Request, Outcome], Any] | None) -> None:
        if hook is not None and not callable(hook):
            raise ValidationError(f"on_breach must be callable, got {hook!r}")
        self._on_breach = hook
        self._state = (None, {}, {})  # rebound: each binding's lane holds the hook
        self._routes = (None, {})

    # -- routes -----------------------------------------------------------------
    def _binding(self, rule: RateLimitRule, ruleset: RuleSet) -> _Binding:
        state = self._state
        if state[0] is not ruleset:
            state = (ruleset, {}, {})
            self._state = state
        binding = state[1].get(id(rule))
        if binding is None or binding.rule is not rule:
            binding = _Binding(rule, self.factory.for_rule(rule), self.metrics)
            if not self._plain:
                binding.simple = binding.counted_lane = False  # headers off or renamed: check() shapes them
            elif self._lanes is not None and (binding.simple or binding.counted_lane):
                log, hook = self._log, self._on_breach
                binding.lane = self._lanes(
                    binding.limiter,
                    binding.admitted,
                    Outcome,
                    binding.limit_str,
                    binding.policy,
                    binding.r_prefix,
                    binding.near,
                    self._wall,
                    rule.count_when,
                    self._lane_breach if log is not None or hook is not None else None,
                    hook is not None,
                    log.interval if log is not None else -1.0,
                )
                binding.peer = binding.scope is KeyScope.IP and self._peer_keys is not None
                binding.fixed_key = self._global_key if binding.scope is KeyScope.GLOBAL else None
            # keyed by identity: the binding holds the rule, so the id stays unique
            state[1][id(rule)] = binding
        return binding

    def _stack(self, rules: tuple[RateLimitRule, ...], ruleset: RuleSet) -> _Stack:
        bindings = tuple(self._binding(rule, ruleset) for rule in rules)
        stacks = self._state[2]
        key = tuple(id(rule) for rule in rules)
        stack = stacks.get(key)
        if stack is None or stack.bindings != bindings:
            stack = stacks[key] = _Stack(bindings)
        return stack

    def _routed_key(self, request: Request, tier: str | None) -> tuple[Any, ...]:
        """The route-cache key of a request under a ``routed`` ruleset:
        method, path, tier and what decides the matched route: the route
        the front end matched, else what the resolver reads
        (``route_context``), else the resolver's answer itself."""
        route = request.route
        if route is None:
            if self.route_context is not None:
                route = self.route_context(request)
            elif self.route_resolver is not None:
                route = self.route_resolver(request)
        return (request.method, request.path, tier, route)

    def _cache_key(self, request: Request, ruleset: RuleSet, tier: str | None) -> tuple[Any, ...]:
        if ruleset.routed:
            return self._routed_key(request, tier)
        return (request.method, request.path, tier)

    def _route(self, request: Request, ruleset: RuleSet, tier: str | None, key: tuple[Any, ...]) -> _Route:
        """Resolve and remember the route of a request under its cache
        ``key``: a binding, a stack of them (stacked mode, a rate list, a
        route's declarations), or ``_UNLIMITED``."""
        method = request.method
        path = request.path
        route_template = request.route
        if route_template is None and self.route_resolver is not None:
            if len(key) > 3 and self.route_context is None:
                route_template = key[3]  # _routed_key asked the resolver already
            else:
                route_template = self.route_resolver(request)
        rules = ruleset.lookup_route(method, path, tier, route_template)
        route: _Route
        if not rules:
            route = _UNLIMITED
        elif len(rules) == 1:
            route = self._binding(rules[0], ruleset)
        else:
            route = self._stack(rules, ruleset)
        size = key_bytes(method, path, tier)
        if len(key) > 3 and key[3] is not None:
            size += key_bytes("", key[3], None)
        if size > MAX_CACHED_KEY_BYTES:
            return route  # a hostile long path, method or Host: decided, never kept
        routes = self._routes
        if routes[0] is not ruleset:
            routes = (ruleset, {})
            self._routes = routes
            self._route_bytes = 0
        table = routes[1]
        if len(table) >= self.route_cache_size or self._route_bytes + size > self.route_cache_bytes:
            table.clear()  # bounded: unique hostile paths cost a miss, never memory
            self._route_bytes = 0
        table[key] = route
        self._route_bytes += size
        return route

    def rules_for(self, request: Request) -> tuple[RateLimitRule, ...]:
        """The rules that decide ``request`` (for tools and tests: the
        request path reads its route cache instead)."""
        ruleset = self.registry.ruleset
        tier = self.extractor.tier_for(request) if ruleset.has_tiers else None
        route_template = request.route
        if route_template is None and self.route_resolver is not None:
            route_template = self.route_resolver(request)
        return ruleset.lookup_route(request.method, request.path, tier, route_template)

    def _shard(self) -> dict[str, list[int]]:
        try:
            return self._local.shard  # type: ignore[no-any-return]
        except AttributeError:
            shard = self._local.shard = self.metrics.shard()
            return shard

    @staticmethod
    def _counts(shard: dict[str, list[int]], name: str) -> list[int]:
        counts = shard.get(name)
        if counts is None:
            counts = shard[name] = [0, 0, 0, 0]
        return counts

    @staticmethod
    def _cost(b: _Binding, request: Request) -> int:
        """What ``request`` spends under ``b``: the rule's cost (or its
        ``cost(request)``) times the request's own."""
        cost: Any = b.cost
        if type(cost) is not int:
            cost = cost(request)
            if isinstance(cost, bool) or not isinstance(cost, int) or cost <= 0:
                raise ValidationError(f"rule {b.name!r}: cost(request) must return an int >= 1, got {cost!r}")
        n = request.cost
        if n is not _ONE:
            if type(n) is not int or n <= 0:
                raise ValidationError(f"Request.cost must be an int >= 1, got {n!r}")
            cost *= n
        return int(cost)

    def _lookup(self, request: Request) -> Any:
        """The route of ``request``: from the route cache, else resolved
        (and remembered) by :meth:`_route`."""
        ruleset = self.registry.ruleset
        tier = self.extractor.tier_for(request) if ruleset.has_tiers else None
        key = self._cache_key(request, ruleset, tier)
        routes = self._routes
        if routes[0] is ruleset:
            b = routes[1].get(key, _MISSING)
            if b is not _MISSING:
                return b
        return self._route(request, ruleset, tier, key)

    # -- the decision -----------------------------------------------------------
    def check(self, request: Request) -> Outcome | None:
        """Decide ``request``: the pipeline's public decision, for any front end.

        None when no rule applies (pass it through unlimited); otherwise the
        :class:`Outcome`, counted in the metrics, with the headers to send.
        Nothing is sent or slept here: a front end writes the outcome out
        (and sleeps or awaits ``delay``) in its own I/O, and hands the
        response status to :meth:`settle` when the outcome has a charge."""
        # _lookup inlined: a method call is a tenth of this path
        ruleset = self.registry.ruleset
        tier = self.extractor.tier_for(request) if ruleset.has_tiers else None
        where = self._routed_key(request, tier) if ruleset.routed else (request.method, request.path, tier)
        routes = self._routes
        b: Any = routes[1].get(where, _MISSING) if routes[0] is ruleset else _MISSING
        if b is _MISSING:
            b = self._route(request, ruleset, tier, where)
        lane = b.lane
        if lane is not None and request.cost is _ONE:
            # decided, counted and its headers written in one native call
            return lane.admit(self._key(request, b.scope), DICT, request, None)  # type: ignore[no-any-return]
        if b.simple and request.cost is _ONE:
            d = b.allow(self._key(request, b.scope))
            if d.allowed:
                headers: dict[str, str] = {}
                # counts it and writes the five headers in one call (C when built)
                b.admitted.record(d, headers, b.limit_str, b.policy, b.r_prefix, b.near, self.wall_clock())
                return _outcome(Outcome, (True, headers, 0.0, b.name, 0, d, None))
            return self._denied(request, b, d)
        if b is _UNLIMITED:
            return None
        if b.counted_lane and request.cost is _ONE:
            key = self._key(request, b.scope)
            d = b.allow(key)
            if d.allowed:
                headers = {}
                b.admitted.record(d, headers, b.limit_str, b.policy, b.r_prefix, b.near, self.wall_clock())
                return _outcome(Outcome, (True, headers, 0.0, b.name, 0, d, Counted((b, key, 1, d))))
            return self._denied(request, b, d)
        if type(b) is _Stack:
            return self._check_stacked(request, b.bindings)
        return self._check_one(request, b)

    def decide(
        self,
        native: Any,
        method: str,
        path: str,
        client: str | None,
        route: Any,
        request_factory: Callable[[Any], Request],
        form: int = 0,
    ) -> Outcome | None:
        """:meth:`check` for a front end that has not built its
        :class:`Request`: what every adapter calls.

        ``native`` is the framework's request (the ASGI scope, the WSGI
        environ, Flask's or Django's request); ``method``, ``path`` and
        ``client`` are what its Request would carry; ``route`` is what
        decides its matched route (the framework's template, or the ASGI
        adapter's scope context; None: not known here); the request costs 1.
        ``request_factory(native)`` builds the Request, only when a rule or
        a hook needs more than these (a user or API-key scope, trusted
        proxies, tiers, a route-cache miss, a denial to log): a plain rule
        on a cached route is decided from these alone, in one native call.
        ``form``: the headers as a dict (``DICT``), or, where the native
        lane answers and no ``on_breach`` reads them, as a fresh list of
        ASGI's lower-case bytes pairs (``ASGI_PAIRS``) or of WSGI's str
        pairs (``WSGI_PAIRS``), for the front end to write out as it is."""
        ruleset = self.registry.ruleset
        routes = self._routes
        if routes[0] is ruleset and not ruleset.has_tiers:
            if not ruleset.routed:
                b: Any = routes[1].get((method, path, None), _MISSING)
            elif route is not None:
                b = routes[1].get((method, path, None, route), _MISSING)
            else:
                b = _MISSING
            lane = b.lane
            if lane is not None:
                key = self._peer_keys.get(client) if b.peer else b.fixed_key
                if key is not None:
                    return lane.admit(key, form, native, request_factory)  # type: ignore[no-any-return]
                request = request_factory(native)
                return lane.admit(self._key(request, b.scope), form, request, None)  # type: ignore[no-any-return]
            if b is _UNLIMITED:
                return None
        return self.check(request_factory(native))

    def decide_scope(
        self,
        scope: Mapping[str, Any],
        context: str | None,
        request_factory: Callable[[Any], Request],
        form: int = 0,
    ) -> Outcome | None:
        """:meth:`decide` for an ASGI HTTP ``scope``: its method, path (under
        its ``root_path``, as :func:`nanolimit.asgi.request_from_scope` joins
        them) and peer read from the scope; ``context`` is the adapter's
        route context (None: no routes known), to which a ``root_path`` is
        added, since the same path under another mount is another route."""
        path = scope.get("path", "/") or "/"
        root = scope.get("root_path")
        if root:
            path = public_path(root, path)
            if context is not None:
                context = f"{context}\x00{root}"
        client = scope.get("client")
        return self.decide(
            scope,
            scope.get("method", "GET"),
            path,
            client[0] if client else None,
            context,
            request_factory,
            form,
        )

    def _lane_breach(
        self,
        outcome: Outcome,
        native: Any,
        factory: Callable[[Any], Request] | None,
        log_due: bool,
        more: int,
    ) -> None:
        """A lane's denial to log (``log_due``, with ``more`` since the last
        record) or to hand to ``on_breach``: its Request built now, from
        ``native`` (a Request already when ``factory`` is None)."""
        request = native if factory is None else factory(native)
        if log_due and self._log is not None:
            self._log.write(request, outcome.rule, outcome.retry_after, more)
        if self._on_breach is not None:
            self._on_breach(request, outcome)

    def _check_one(self, request: Request, b: _Binding) -> Outcome:
        """One rule that costs more than 1, shadows (dry run), shapes (a
        leaky bucket's delay), counts by response, or writes its headers
        off or renamed."""
        cost = self._cost(b, request)
        if cost > b.capacity:
            return self._too_costly(request, b, cost)
        key = self._key(request, b.scope) if b.key_fn is None else call_key(b.key_fn, request, b.name)
        return self._answer(request, b, key, cost, b.allow(key, cost))

    async def check_async(self, request: Request) -> Outcome | None:
        """:meth:`check` on a store that waits on the network
        (``AsyncRedisStorage``): the one decision is awaited, so the event
        loop keeps serving other requests meanwhile. Routes resolve as in
        :meth:`check` (no I/O). Compound decisions need a store with
        ``allow_all``, which an async store has not: they are refused."""
        b = self._lookup(request)
        if b is _UNLIMITED:
            return None
        if type(b) is _Stack:
            raise ValidationError(
                f"{type(self.factory.storage).__name__} cannot decide compound limits (several rules "
                f"on one request: {', '.join(x.name for x in b.bindings)}); use an unstacked registry "
                "without rate lists, or the synchronous RedisStorage"
            )
        cost = self._cost(b, request)
        if cost > b.capacity:
            return self._too_costly(request, b, cost)
        key = self._key(request, b.scope) if b.key_fn is None else call_key(b.key_fn, request, b.name)
        return self._answer(request, b, key, cost, await b.limiter.allow_async(key, cost))

    async def settle_async(self, outcome: Outcome | None, status: int) -> int:
        """:meth:`settle` awaiting the store's refunds."""
        if outcome is None or outcome.charge is None:
            return 0
        return await outcome.charge.settle_async(status)  # type: ignore[no-any-return]

    def _answer(self, request: Request, b: _Binding, key: str, cost: int, d: Any) -> Outcome:
        """The outcome of one rule's decision ``d``: counted, its headers
        written, its charge kept for :meth:`settle`."""
        if d.allowed:
            charge = Counted((b, key, cost, d)) if b.counted else None
            if b.dry_run:
                b.admitted.count(d, b.near)
                return _outcome(Outcome, (True, {}, 0.0, b.name, 0, d, charge))
            headers: dict[str, str] = {}
            if self.headers:
                b.admitted.record(d, headers, b.limit_str, b.policy, b.r_prefix, b.near, self.wall_clock())
                if self.header_names:
                    headers = self._renamed(headers)
            else:
                b.admitted.count(d, b.near)
            return _outcome(Outcome, (True, headers, d.delay if b.shape else 0.0, b.name, 0, d, charge))
        if b.dry_run:
            self._counts(self._shard(), b.name)[SHADOW_DENIED] += 1
            return _outcome(Outcome, (True, {}, 0.0, b.name, 0, d, None))
        return self._denied(request, b, d)

    def _renamed(self, headers: dict[str, str]) -> dict[str, str]:
        names = self.header_names
        return {names.get(k, k): v for k, v in headers.items()}

    def _too_costly(self, request: Request, b: _Binding, cost: int) -> Outcome:
        """A cost no wait would admit: a 429 that says so (never a 500 from
        the core's cost check)."""
        if b.dry_run:
            self._counts(self._shard(), b.name)[SHADOW_DENIED] += 1
            return _outcome(Outcome, (True, {}, 0.0, b.name, 0, CostTooHigh(cost, b.capacity), None))
        self._counts(self._shard(), b.name)[DENIED] += 1
        outcome = _outcome(Outcome, (False, {}, 0.0, b.name, 0, CostTooHigh(cost, b.capacity), None))
        self._breached(request, outcome)
        return outcome

    def _count_denied(self, b: _Binding) -> None:
        try:
            shard = self._local.shard
        except AttributeError:
            shard = self._shard()
        self._counts(shard, b.name)[DENIED] += 1

    def _denied(self, request: Request, b: _Binding, d: Any) -> Outcome:
        """Count and answer a denial by one enforced rule."""
        self._count_denied(b)
        outcome = self._refusal(b, d, d.retry_after, d)
        if self._log is not None or self._on_breach is not None:
            self._breached(request, outcome)
        return outcome

    def _breached(self, request: Request, outcome: Outcome) -> None:
        if self._log is not None:
            self._log(request, outcome)
        if self._on_breach is not None:
            self._on_breach(request, outcome)

    def _refusal(self, b: _Binding, d: Any, retry_after: float, answer: Any) -> Outcome:
        """A 429 by ``b`` (whose decision is ``d``): its headers, and the one
        place ``Retry-After`` is written (``answer`` is what the caller
        gets as the decision: ``d``, or the compound decision)."""
        headers: dict[str, str] = {}
        if self.headers:
            # the six headers in one call (C when built)
            retry = b.admitted.refusal(
                d, headers, b.limit_str, b.policy, b.r_prefix, retry_after, self.wall_clock()
            )
        else:
            retry = retry_seconds(retry_after)
            headers["Retry-After"] = str(retry)
        if self.header_names:
            headers = self._renamed(headers)
        return _outcome(Outcome, (False, headers, 0.0, b.name, retry, answer, None))

    def _check_stacked(self, request: Request, bindings: tuple[_Binding, ...]) -> Outcome:
        """Several rules at once: shadow rules decide on their own; enforced
        rules decide together, all or nothing, through ``storage.allow_all``
        (one entry into the core for all of them)."""
        shard = self.metrics.shard()
        enforced: list[tuple[_Binding, str, int]] = []
        charged: list[tuple[_Binding, str, int, Any]] = []
        for b in bindings:
            cost = self._cost(b, request)
            if cost > b.capacity:
                if b.dry_run:
                    self._counts(shard, b.name)[SHADOW_DENIED] += 1
                    continue
                return self._too_costly(request, b, cost)
            key = self._key(request, b.scope) if b.key_fn is None else call_key(b.key_fn, request, b.name)
            if not b.dry_run:
                enforced.append((b, key, cost))
                continue
            d = b.allow(key, cost)
            counts = self._counts(shard, b.name)
            if d.allowed:
                counts[ALLOWED] += 1
                if d.remaining < b.near:
                    counts[NEAR_LIMIT] += 1
                if b.counted:
                    charged.append((b, key, cost, d))
            else:
                counts[SHADOW_DENIED] += 1
        if not enforced:
            charge = Charges(charged) if charged else None
            return _outcome(Outcome, (True, {}, 0.0, bindings[0].name, 0, None, charge))
        if len(enforced) == 1:
            b, key, cost = enforced[0]
            d = b.allow(key, cost)
            decisions = [d]
            summary: Any = d
        else:
            allow_all = getattr(self.factory.storage, "allow_all", None)
            if allow_all is None:
                raise ValidationError(
                    f"{type(self.factory.storage).__name__} cannot decide compound limits "
                    "(it has no allow_all); use an InMemoryStorage or RedisStorage, or an unstacked registry"
                )
            summary = allow_all([(b.limiter, key, cost) for b, key, cost in enforced])
            decisions = list(summary.decisions)
        allowed = bool(summary.allowed)
        delay = 0.0
        for (b, key, cost), d in zip(enforced, decisions):
            counts = self._counts(shard, b.name)
            if allowed:
                counts[ALLOWED] += 1
                if d.remaining < b.near:
                    counts[NEAR_LIMIT] += 1
                if b.shape and d.delay > delay:
                    delay = d.delay
                if b.counted:
                    charged.append((b, key, cost, d))
            elif not d.allowed:
                counts[DENIED] += 1
        # the headers describe the binding rule (its own quota, window,
        # remaining and reset): the one the compound decision names
        binding, decision = enforced[0][0], decisions[0]
        if len(enforced) > 1:
            name = summary.rule
            for (b, _, _), d in zip(enforced, decisions):
                if b.name == name:
                    binding, decision = b, d
                    break
        if allowed:
            headers = (
                rate_headers(
                    binding.limit_str,
                    binding.policy,
                    binding.r_prefix,
                    decision.remaining,
                    decision.reset_after,
                    self.wall_clock(),
                )
                if self.headers
                else {}
            )
            if self.header_names:
                headers = self._renamed(headers)
            charge = Charges(charged) if charged else None
            return _outcome(Outcome, (True, headers, delay, binding.name, 0, summary, charge))
        if charged:
            Charges(charged).refund()  # the shadow rules' charges: the request never ran
        outcome = self._refusal(binding, decision, summary.retry_after, summary)
        self._breached(request, outcome)
        return outcome

    def settle(self, outcome: Outcome | None, status: int) -> int:
        """The response of an admitted request was ``status``: give back
        what its ``count_when`` rules do not count (e.g. a successful
        login under a failed-logins limit). Returns the units given back;
        a no-op for outcomes without a charge, and at most once."""
        charge = outcome.charge if outcome is not None else None
        if charge is None:
            return 0
        return charge.settle(status)  # type: ignore[no-any-return]

    if not TYPE_CHECKING and _SETTLE is not None:
        settle = staticmethod(_SETTLE)  # the same in C: a refund costs one call from the front end

    # -- the pipeline stage -------------------------------------------------------
    def __call__(self, request: Request, next_handler: Callable[[Request], Response]) -> Response:
        # The common case (one enforced rule, admitted, no shaping) is
        # :meth:`check` inlined, its headers written straight into the
        # handler's response: no Outcome, no header dict, one call fewer.
        # Everything else takes check() and _respond.
        ruleset = self.registry.ruleset
        routes = self._routes
        if routes[0] is ruleset and self._inline and not ruleset.has_tiers and request.cost is _ONE:
            b: Any = routes[1].get(
                (request.method, request.path, None)
                if not ruleset.routed
                else self._routed_key(request, None),
                _MISSING,
            )
            if b.simple:
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
                return self._respond(request, next_handler, self._denied(request, b, d))
        return self._respond(request, next_handler, self.check(request))

    def _respond(
        self, request: Request, next_handler: Callable[[Request], Response], outcome: Outcome | None
    ) -> Response:
        if outcome is None:
            return next_handler(request)
        headers = outcome.headers
        if not outcome.allowed:
            headers["Content-Type"] = "application/json"
            return Response(429, headers, outcome.body())
        if outcome.delay > 0.0:
            self.sleep(outcome.delay)
        try:
            response = next_handler(request)
        except BaseException:
            self.settle(outcome, 500)  # the handler failed: it answers 500
            raise
        if outcome.charge is not None:
            self.settle(outcome, response.status)
        if headers:
            response.headers.update(headers)
        return response

    def __repr__(self) -> str:
        return f"<RateLimitPipeline {self.registry!r} {self.factory!r}>"


if TYPE_CHECKING:
    RateLimitMiddleware = RateLimitPipeline  # the deprecated name, for code not yet renamed


def _renamed() -> type[RateLimitPipeline]:
    """The pipeline under its old name, with one ``DeprecationWarning``
    pointing at the line that used it (whichever module path it took): the
    name now means only the classes that wrap an app."""
    warnings.warn(
        "the framework-free pipeline is renamed RateLimitPipeline (nanolimit.RateLimitPipeline); "
        "its old name, RateLimitMiddleware, will be removed. To wrap an app use "
        "nanolimit.asgi.RateLimitMiddleware or nanolimit.wsgi.RateLimitMiddleware.",
        DeprecationWarning,
        stacklevel=3,
    )
    return RateLimitPipeline


def __getattr__(name: str) -> Any:
    if name == "RateLimitMiddleware":
        return _renamed()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
