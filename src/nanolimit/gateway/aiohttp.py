"""aiohttp: a new-style middleware, and ``setup(app)`` that wires it in.

Why a middleware of aiohttp's own and not the ASGI one: aiohttp is not an
ASGI framework. Its middlewares run after the router, so the matched
template (``request.match_info.route.resource.canonical``) is known before
the decision, and limits declared next to routes
(:mod:`nanolimit.gateway.routes`) match it directly, with no route resolver.
The handler's response (or the ``web.HTTPException`` it raises, which
aiohttp turns into the response) gives the status count-by-response rules
settle on. The decision itself is the pipeline's
(:meth:`RateLimitPipeline.check`), the one every front end shares.

The event loop never waits on the network here, as in the ASGI middleware:
an ``AsyncRedisStorage`` is awaited (the pipeline's ``check_async`` and
``settle_async``), a synchronous ``RedisStorage`` decides in a worker thread
(``asyncio.to_thread``), and the in-process stores (``InMemoryStorage``,
``SharedMemoryStorage``, ``TwoTierStorage``'s local leases) decide inline,
in about a microsecond. ``decide="inline"`` or ``"thread"`` overrides the
choice.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import weakref
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

from aiohttp import hdrs, web
from aiohttp.typedefs import Handler

from ..errors import ValidationError
from .factory import LimiterFactory
from .keys import KeyExtractor
from .metrics import Metrics
from .middleware import AWAIT, INLINE, Outcome, decide_mode
from .middleware import RateLimitPipeline as Core
from .registry import RuleRegistry
from .request import Request
from .routes import RouteInfo, RouteLimits, registry_and_limits

__all__ = [
    "RateLimitMiddleware",
    "decide_mode",
    "rate_limit_middleware",
    "request_from_aiohttp",
    "routes_of",
    "setup",
]

# on the aiohttp request: headers still to write when the handler prepares its own response
# (a RequestKey where aiohttp has them: a str key warns there)
_PENDING: Any = (
    web.RequestKey("nanolimit_pending_headers", dict) if hasattr(web, "RequestKey") else "nanolimit_pending"
)

Deny = Callable[[Request, Outcome], "web.StreamResponse | Awaitable[web.StreamResponse | None] | None"]


class _Headers(Mapping[str, str]):
    """aiohttp's case-insensitive multidict as the lower-case mapping a
    :class:`Request` carries; a repeated header reads as one comma-joined
    value, as ASGI gives it (so an ``X-Forwarded-For`` split over two
    lines is read whole)."""

    __slots__ = ("_headers",)

    def __init__(self, headers: Any) -> None:
        self._headers = headers

    def __getitem__(self, key: str) -> str:
        values = self._headers.getall(key, None)
        if not values:
            raise KeyError(key)
        return values[0] if len(values) == 1 else ",".join(values)

    def get(self, key: str, default: Any = None) -> Any:
        values = self._headers.getall(key, None)
        if not values:
            return default
        return values[0] if len(values) == 1 else ",".join(values)

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(name.lower() for name in self._headers))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def request_from_aiohttp(request: web.Request) -> Request:
    """The gateway's view of an aiohttp request: the client is the
    transport peer (``request.remote``), never a header (a trusted proxy's
    header is the extractor's to read, ``trusted_proxies=``); the route is
    the matched resource's template, None when nothing matched (a 404),
    under its domain as ``//domain/path`` when a domain's sub-app
    (``app.add_domain``) matched it."""
    return Request(
        request.method,
        request.path,
        _Headers(request.headers),
        request.remote or None,
        None,
        1,
        route_of(request),
        request,
    )


def route_of(request: web.Request) -> str | None:
    """The matched route of an aiohttp request, as :func:`request_from_aiohttp` names it."""
    info = request.match_info
    resource = info.route.resource
    if resource is None:
        return None
    route = _template(resource)
    if _DOMAINS:
        for app in reversed(info.apps):
            domains = _DOMAINS.get(app)
            if domains:
                return _domain(domains, request) + route
    return route


def _template(resource: Any) -> str:
    """A resource's route id: its ``canonical``, with the regex of each
    placeholder that has one kept (``/items/{id:\\d+}``): aiohttp's
    canonical drops it, and ``/items/{id:\\d+}`` and ``/items/{id}`` are two
    routes (an exemption of one must not cover the other)."""
    canonical: str = resource.canonical
    orig = getattr(resource, "_orig_path", None)
    if isinstance(resource, web.DynamicResource) and isinstance(orig, str) and ":" in orig:
        return _with_regexes(canonical, orig)
    return canonical


@functools.lru_cache(maxsize=1024)
def _with_regexes(canonical: str, orig: str) -> str:
    # canonical is the sub-apps' prefix + the formatter of the path as added
    own = web.DynamicResource(orig).canonical
    return canonical[: len(canonical) - len(own)] + orig


# the sub-apps of app.add_domain -> {"//domain": its rule}, filled by routes_of
_DOMAINS: weakref.WeakKeyDictionary[web.Application, dict[str, Any]] = weakref.WeakKeyDictionary()


def _domain(domains: dict[str, Any], request: web.Request) -> str:
    """The domain a request reached a domain's sub-app under: the one, or,
    for one sub-app added under several, the first whose rule takes the
    Host (as aiohttp tries them), so each domain stays its own route."""
    if len(domains) > 1:
        host = request.headers.get(hdrs.HOST)
        if host:
            for domain, rule in domains.items():
                if rule.match_domain(host):
                    return domain
    return next(iter(domains))


def routes_of(app: web.Application) -> list[RouteInfo]:
    """Every route of an aiohttp app, sub-apps included (their templates
    carry the sub-app's prefix, and a domain's sub-app its domain as
    ``//domain/path``: ``/login`` there is not the app's own ``/login``),
    with its view: a handler function or a ``web.View`` class."""
    out: list[RouteInfo] = []

    def walk(app: web.Application, domain: str) -> None:
        for resource in app.router.resources():
            sub = getattr(resource, "_app", None)
            if isinstance(sub, web.Application):  # a sub-app: by prefix, or by domain
                if type(resource).__name__ == "MatchedSubAppResource":
                    inner = "//" + resource.canonical
                    _DOMAINS.setdefault(sub, {})[inner] = getattr(resource, "_rule", None)
                    walk(sub, inner)
                else:
                    walk(sub, domain)
                continue
            claimed = {route.method.upper() for route in resource} - {"*"}
            for route in resource:
                method = route.method.upper()
                if method != "*":
                    methods = frozenset({method})
                elif claimed:  # a web.View beside handlers of its path: what they leave it
                    methods = frozenset(hdrs.METH_ALL) - claimed
                else:
                    methods = frozenset()
                out.append(RouteInfo(domain + _template(resource), methods, route.handler))

    walk(app, "")
    return out


class RateLimitMiddleware:
    """A new-style aiohttp middleware (``async (request, handler) ->
    response``): what :func:`rate_limit_middleware` returns, and what
    :func:`setup` appends to ``app.middlewares``.

    ``core`` is the framework-free pipeline, ``metrics`` its metrics;
    ``limits`` the route-level declarations, bound from the app's router
    by :meth:`bind` (at ``on_startup`` under :func:`setup`, else on the
    first request); ``decide``: ``"inline"``, ``"thread"`` or ``"await"``,
    how each decision keeps off the event loop (:func:`decide_mode`).
    """

    __middleware_version__ = 1  # new-style: aiohttp calls it with (request, handler)

    def __init__(
        self,
        core: Core,
        *,
        limits: RouteLimits | None = None,
        deny: Deny | None = None,
        request_factory: Callable[[web.Request], Request] = request_from_aiohttp,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        decide: str | None = None,
    ) -> None:
        mode = decide_mode(core.factory.storage, decide)
        if deny is not None and not callable(deny):
            raise ValidationError(f"deny must be callable, got {deny!r}")
        if not callable(request_factory):
            raise ValidationError(f"request_factory must be callable, got {request_factory!r}")
        self.core = core
        self.metrics = core.metrics
        self.limits = limits
        self.deny = deny
        self.request_factory = request_factory
        self.sleep = sleep
        self.decide = mode
        self.streams = False  # set by setup(): on_response_prepare writes headers of streamed responses
        self._unbound = limits is not None
        # the pipeline's decide() on the request's fields: in process, the
        # stock request view, the pipeline's own check() and decide()
        self._lane = (
            mode is INLINE
            and request_factory is request_from_aiohttp
            and type(core).check is Core.check
            and type(core).decide is Core.decide
        )

    def bind(self, app: web.Application) -> None:
        """Read ``app``'s router into the declared rules (once); a rule
        naming a template no route has raises ``RuleValidationError``
        naming the rule."""
        if self.limits is not None:
            self.limits.bind(routes_of(app))
        self._unbound = False

    async def on_startup(self, app: web.Application) -> None:
        """``app.on_startup``: bind before the first request, so a bad
        declaration stops the server instead of failing requests."""
        self.bind(app)

    async def on_response_prepare(self, request: web.Request, response: web.StreamResponse) -> None:
        """``app.on_response_prepare``: the headers of an admitted request
        whose handler prepares (streams) its response itself, before the
        middleware sees it."""
        pending = request.pop(_PENDING, None)
        if pending:
            response.headers.update(pending)

    async def _check(self, request: Request) -> Outcome | None:
        mode = self.decide
        if mode is INLINE:
            return self.core.check(request)
        if mode is AWAIT:
            return await self.core.check_async(request)
        return await asyncio.to_thread(self.core.check, request)

    async def _settle(self, outcome: Outcome, status: int) -> None:
        mode = self.decide  # a refund crosses the network too
        if mode is INLINE:
            self.core.settle(outcome, status)
        elif mode is AWAIT:
            await self.core.settle_async(outcome, status)
        else:
            await asyncio.to_thread(self.core.settle, outcome, status)

    async def _denied(self, request: Request | None, outcome: Outcome) -> web.StreamResponse:
        if self.deny is not None and request is not None:
            custom: Any = self.deny(request, outcome)
            if inspect.isawaitable(custom):
                custom = await custom
            if custom is not None:
                if not isinstance(custom, web.StreamResponse):
                    raise TypeError(
                        f"deny(request, outcome) must return an aiohttp response or None, got {custom!r}"
                    )
                for name, value in outcome.headers.items():  # Retry-After above all
                    if name not in custom.headers:
                        custom.headers[name] = value
                return custom
        return web.Response(
            status=429, body=outcome.body(), headers=outcome.headers, content_type="application/json"
        )

    async def __call__(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if self._unbound:
            self.bind(request.app)
        gateway_request: Request | None = None
        core = self.core
        if self._lane:
            # the pipeline's decide(): no Request built unless a rule needs one
            outcome = core.decide(
                request,
                request.method,
                request.path,
                request.remote or None,
                route_of(request) if core.registry.ruleset.routed else None,
                request_from_aiohttp,
            )
        else:
            gateway_request = self.request_factory(request)
            outcome = await self._check(gateway_request)
        if outcome is None:
            return await handler(request)
        if not outcome.allowed:
            if gateway_request is None and self.deny is not None:
                gateway_request = self.request_factory(request)
            return await self._denied(gateway_request, outcome)
        if outcome.delay > 0.0:
            await self.sleep(outcome.delay)
        headers = outcome.headers
        if headers and self.streams:
            request[_PENDING] = headers
        try:
            response = await handler(request)
        except web.HTTPException as exc:  # aiohttp answers it as the response
            request.pop(_PENDING, None)
            if outcome.charge is not None:
                await self._settle(outcome, exc.status)
            if headers:
                exc.headers.update(headers)
            raise
        except BaseException:
            request.pop(_PENDING, None)
            if outcome.charge is not None:
                await self._settle(outcome, 500)  # the handler failed: the client sees a 500
            raise
        request.pop(_PENDING, None)
        if outcome.charge is not None:
            await self._settle(outcome, response.status)
        if headers and not response.prepared:
            response.headers.update(headers)
        return response

    def __repr__(self) -> str:
        return f"<nanolimit.aiohttp.RateLimitMiddleware {self.core!r}>"


def rate_limit_middleware(
    registry: RuleRegistry | None = None,
    factory: LimiterFactory | None = None,
    extractor: KeyExtractor | None = None,
    metrics: Metrics | None = None,
    *,
    limits: RouteLimits | None = None,
    deny: Deny | None = None,
    request_factory: Callable[[web.Request], Request] = request_from_aiohttp,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    decide: str | None = None,
    **pipeline_options: Any,
) -> RateLimitMiddleware:
    """The middleware, for ``web.Application(middlewares=[...])``.

    ``registry``, ``factory``, ``extractor``, ``metrics`` and
    ``pipeline_options`` (``headers``, ``header_names``, ``on_breach``,
    ``log_denials``) build the pipeline as
    :class:`nanolimit.gateway.middleware.RateLimitPipeline` takes them.
    ``limits`` brings route-level declarations (its registry is the
    registry); a registry whose rules name routes (a rules file) is bound
    to the app's routes too. ``deny(request, outcome)`` (sync or async,
    given the gateway :class:`Request`, whose ``native`` is aiohttp's)
    answers a denial: return a response, or None for the stock 429.
    ``request_factory`` turns aiohttp's request into the gateway's
    (override it to give rules a user id); ``sleep`` is how a shaping
    leaky-bucket rule waits (awaited: the loop serves others meanwhile);
    ``decide`` overrides how a decision keeps off the loop (``"inline"``
    or ``"thread"``; an async store is always awaited)."""
    registry, limits = registry_and_limits(registry, limits)
    if registry is None:
        raise ValidationError("rate_limit_middleware needs a registry (or limits)")
    core = Core(registry, factory, extractor, metrics, **pipeline_options)
    return RateLimitMiddleware(
        core, limits=limits, deny=deny, request_factory=request_factory, sleep=sleep, decide=decide
    )


def setup(
    app: web.Application,
    registry: RuleRegistry | None = None,
    factory: LimiterFactory | None = None,
    extractor: KeyExtractor | None = None,
    metrics: Metrics | None = None,
    *,
    limits: RouteLimits | None = None,
    deny: Deny | None = None,
    request_factory: Callable[[web.Request], Request] = request_from_aiohttp,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    decide: str | None = None,
    **pipeline_options: Any,
) -> RateLimitMiddleware:
    """Limit ``app``: the middleware appended to ``app.middlewares``,
    route-level declarations bound at ``app.on_startup`` (a template that
    matches no route fails the startup, naming the rule), and the headers
    of responses a handler streams itself written at
    ``app.on_response_prepare``. Returns the middleware (its ``metrics``).
    Call it before the app starts, after its routes are added or not: the
    routes are read at startup."""
    if not isinstance(app, web.Application):
        raise ValidationError(f"setup needs an aiohttp web.Application, got {type(app).__name__}")
    middleware = rate_limit_middleware(
        registry,
        factory,
        extractor,
        metrics,
        limits=limits,
        deny=deny,
        request_factory=request_factory,
        sleep=sleep,
        decide=decide,
        **pipeline_options,
    )
    middleware.streams = True
    app.middlewares.append(middleware)
    app.on_response_prepare.append(middleware.on_response_prepare)
    if middleware.limits is not None:
        app.on_startup.append(middleware.on_startup)
    return middleware
