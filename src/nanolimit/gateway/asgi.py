"""Pure ASGI 3 middleware: Starlette, FastAPI, Litestar or a bare ASGI app.

Imports nothing from any framework (Starlette only to call an app's own 429
handler). HTTP requests are decided before the app runs: a denial answers 429
with the docs/spec.md §2 JSON body and headers and never reaches the app (a
Starlette or FastAPI app with a 429 handler of its own has that handler
answer it); an admitted request gets the headers added to its
``http.response.start``. A shaping leaky-bucket rule makes the admitted
request ``await asyncio.sleep(delay)`` first (the event loop keeps serving
others meanwhile). WebSockets are limited at connect (``websocket="limit"``,
the default: a denied handshake is refused with a 429 where the server
supports the ``websocket.http.response`` extension, else closed with code
1008) or passed untouched (``websocket="pass"``). Lifespan passes through.

Route-level limits (``limits=RouteLimits``, :mod:`nanolimit.gateway.routes`)
are bound from ``scope["app"]``'s route table when the server starts (a
declaration naming no route fails the startup, and uvicorn exits with the
message) or on the first request; the matched route is read as Starlette's
router reads it, on a route-cache miss only. A rule counting by response
is settled when the app sends its status.

The event loop never waits on the network here: an ``AsyncRedisStorage`` is
awaited (``check_async``), a synchronous network store (``RedisStorage``)
decides in a worker thread (``asyncio.to_thread``), and the in-process
stores (``InMemoryStorage``, ``SharedMemoryStorage``, ``TwoTierStorage``'s
leases) decide inline, in about a microsecond. ``decide="inline"`` or
``"thread"`` overrides the choice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator, Mapping, MutableMapping
from typing import Any
from urllib.parse import unquote

from .._select import native_core
from .factory import LimiterFactory
from .headers import RATE_HEADERS
from .keys import KeyExtractor
from .metrics import Metrics
from .middleware import ASGI_PAIRS, AWAIT, DICT, INLINE, CostTooHigh, Outcome, decide_mode, render_body
from .middleware import RateLimitPipeline as Core
from .registry import RuleRegistry
from .request import Request, public_path
from .routes import RouteLimits, registry_and_limits

__all__ = ["ASGIApp", "RateLimitMiddleware", "request_from_scope"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class _Headers(Mapping[str, str]):
    """ASGI's header list as a lower-case mapping, built on first use (most
    requests under an IP rule never read a header)."""

    __slots__ = ("_map", "_pairs")

    def __init__(self, pairs: Any) -> None:
        self._pairs = pairs
        self._map: dict[str, str] | None = None

    def _build(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for name, value in self._pairs or ():
            key = name.decode("latin-1").lower()
            text = value.decode("latin-1")
            out[key] = f"{out[key]},{text}" if key in out else text
        self._map = out
        return out

    def __getitem__(self, key: str) -> str:
        m = self._map if self._map is not None else self._build()
        return m[key]

    def get(self, key: str, default: Any = None) -> Any:
        m = self._map if self._map is not None else self._build()
        return m.get(key, default)

    def __iter__(self) -> Iterator[str]:
        m = self._map if self._map is not None else self._build()
        return iter(m)

    def __len__(self) -> int:
        m = self._map if self._map is not None else self._build()
        return len(m)


def _scope_user(scope: Scope) -> str | None:
    """An authenticated user id from ``scope["user"]`` (Starlette's
    AuthenticationMiddleware): ``identity``, else ``display_name``."""
    user = scope.get("user")
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    for attr in ("identity", "display_name", "username"):
        try:
            value = getattr(user, attr)
        except (AttributeError, NotImplementedError):
            continue
        if value:
            return str(value)
    return None


def request_from_scope(scope: Scope) -> Request:
    """The gateway's view of an ASGI connection scope: the client is the
    transport peer (``scope["client"]``), never a header.

    The path is ``scope["path"]`` as the server decoded it (with
    ``root_path`` in front when the server left it out); the ruleset
    normalises it when it matches (:func:`nanolimit.gateway.rules.normalize_path`),
    the one place ASGI, WSGI and the framework-free pipeline share."""
    client = scope.get("client")
    root = scope.get("root_path", "") or ""
    path = scope.get("path", "/") or "/"
    if scope.get("path_template") is not None:
        # Litestar has routed, and rewrote a mount's path to the part below
        # it ("/a/" for /static/a): rules are written against the request's
        raw = scope.get("raw_path")
        if isinstance(raw, bytes):
            path = unquote(raw.decode("latin-1")) or "/"
    if root:
        path = public_path(root, path)
    return Request(
        scope.get("method", "GET") if scope["type"] == "http" else "GET",
        path,
        _Headers(scope.get("headers")),
        client[0] if client else None,
        _scope_user(scope),
        1,
        None,
        scope,
    )


# The names the pipeline writes, lower-cased and encoded once (HTTP/2 and
# HTTP/3 require lower case; ASGI servers pass the bytes through).
_NAMES = {name: name.lower().encode("latin-1") for name in (*RATE_HEADERS, "Retry-After", "Content-Type")}


def _encode(headers: Mapping[str, str]) -> list[tuple[bytes, bytes]]:
    """The outcome's headers as ASGI writes them: the second and last
    reshape of the answer (Decision -> Outcome -> these pairs)."""
    names = _NAMES
    return [(names.get(k) or k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers.items()]


def _pairs(headers: Any) -> list[tuple[bytes, bytes]]:
    """An outcome's headers as ASGI pairs: the native lane wrote them so
    (a list, fresh per request), anything else wrote a dict."""
    return headers if type(headers) is list else _encode(headers)


def _header_send_py(send: Send, pairs: list[tuple[bytes, bytes]], charge: Any = None) -> Send:
    """``send`` adding ``pairs`` to the response start's headers and, with a
    ``charge``, settling it by the status the app sends (made apart: a
    closure in ``__call__`` would make its names cells on every request)."""

    async def send_with_headers(message: Message) -> None:
        if message["type"] == "http.response.start":
            if charge is not None:
                charge.settle(int(message.get("status", 200)))
            if pairs:
                message["headers"] = [*message.get("headers", ()), *pairs]
        await send(message)

    return send_with_headers


# The native twin's: a callable handing back the inner send's awaitable, so
# no coroutine is made per message
_header_send: Callable[..., Send] = getattr(native_core(), "header_send", None) or _header_send_py


_JSON = (b"content-type", b"application/json")


# Content-Length by body size: 429 bodies come in a few sizes
_LENGTHS: dict[int, tuple[bytes, bytes]] = {}


async def _send_429(send: Send, headers: list[tuple[bytes, bytes]], body: bytes) -> None:
    """A 429 with its JSON ``body``, after ``headers`` (the rate-limit ones)."""
    size = len(body)
    length = _LENGTHS.get(size)
    if length is None:
        length = (b"content-length", b"%d" % size)
        if len(_LENGTHS) < 1024:
            _LENGTHS[size] = length
    headers += (_JSON, length)
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RateLimitMiddleware:
    """``app = RateLimitMiddleware(app, registry, factory)``, or with
    Starlette ``Middleware(RateLimitMiddleware, registry=..., factory=...)``.

    Pass ``core`` to share one framework-free
    :class:`nanolimit.gateway.middleware.RateLimitPipeline` (and its metrics)
    between front ends; otherwise one is built from the other arguments
    (``pipeline`` holds the pipeline's own options: ``headers``,
    ``header_names``, ``on_breach``, ``log_denials``).
    ``request_factory`` turns a scope into a :class:`Request` (override it to
    read the user id from somewhere else). ``limits`` brings route-level
    declarations (its registry is the registry). ``deny(request, outcome)``
    builds the 429 itself: return any ASGI app (a Starlette ``Response``
    is one), or None for the next answer: a Starlette or FastAPI app's own
    handler of a 429 (``exception_handlers[429]``, or of ``HTTPException``
    other than FastAPI's stock one), called as Starlette calls it, then the
    default JSON 429, sent without raising.
    """

    def __init__(
        self,
        app: ASGIApp,
        registry: RuleRegistry | None = None,
        factory: LimiterFactory | None = None,
        extractor: KeyExtractor | None = None,
        metrics: Metrics | None = None,
        *,
        core: Core | None = None,
        websocket: str = "limit",
        request_factory: Callable[[Scope], Request] = request_from_scope,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        limits: RouteLimits | None = None,
        deny: Callable[[Request, Outcome], ASGIApp | None] | None = None,
        decide: str | None = None,
        **pipeline: Any,
    ) -> None:
        if not callable(app):
            raise TypeError(f"RateLimitMiddleware wraps an ASGI app, got {app!r}")
        if isinstance(app, (RuleRegistry, RouteLimits)):
            raise TypeError("RateLimitMiddleware(app, registry, ...): the app comes first")
        registry, limits = registry_and_limits(registry, limits)
        if core is None:
            if registry is None:
                raise TypeError("RateLimitMiddleware needs a registry (or a core, or limits)")
            core = Core(registry, factory, extractor, metrics, **pipeline)
        elif pipeline:
            raise TypeError(f"pipeline options {sorted(pipeline)} go to the core you passed, not here")
        if websocket not in ("limit", "pass"):
            raise ValueError(f"websocket must be 'limit' or 'pass', got {websocket!r}")
        if deny is not None and not callable(deny):
            raise TypeError(f"deny must be callable, got {deny!r}")
        self.app = app
        self.core = core
        self.metrics = core.metrics
        self.websocket = websocket
        self.request_factory = request_factory
        self.sleep = sleep
        self.limits = limits
        self.deny = deny
        self._form = ASGI_PAIRS if deny is None else DICT  # a deny hook reads a dict
        self._unbound = limits is not None  # bound from scope["app"] at startup or first request
        self._handler: tuple[Any, Any] | None = None  # (app, its own 429 handler or None)
        self._http_context: str | None = None
        self.decide = decide_mode(core.factory.storage, decide)
        # in process, through the pipeline's own settle(): a charge is settled in place
        self._settle_inline = self.decide is INLINE and type(core).settle is Core.settle
        # the pipeline's decide() on the scope's fields: in process, the
        # stock request view, the pipeline's own check() and decide()
        self._lane = (
            self.decide is INLINE
            and request_factory is request_from_scope
            and type(core).check is Core.check
            and type(core).decide is Core.decide
            and type(core).decide_scope is Core.decide_scope
        )

    def _bind(self, app: Any) -> None:
        """Read the app's routes into the declared rules, and install the
        route resolver (once)."""
        from .starlette import context_for, resolver_for, routes_by_host, routes_of

        limits = self.limits
        assert limits is not None
        if app is None:
            raise TypeError(
                "route-level limits need the app in scope['app'] (Starlette and FastAPI put it there)"
            )
        limits.bind(routes_of(app))
        self.core.route_resolver = resolver_for(app)
        context = self.core.route_context = context_for(app)
        # what that context is for an HTTP scope not routed by Litestar, of
        # an app that routes by no Host: the scope's type, "http" (and its
        # root_path), so decide() keys by it without a call
        self._http_context = "http" if context is not None and not routes_by_host(app) else None
        self._unbound = False

    async def _lifespan(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Bind at startup, so a bad declaration stops the server with its
        message (``lifespan.startup.failed``) instead of failing requests."""
        message = await receive()
        if message.get("type") == "lifespan.startup" and self._unbound:
            try:
                self._bind(scope.get("app") or self.app)
            except Exception as exc:  # noqa: BLE001 - any failure must fail the startup, with its message
                await send({"type": "lifespan.startup.failed", "message": f"nanolimit: {exc}"})
                return
        first: list[Message] = [message]

        async def replay() -> Message:
            return first.pop() if first else await receive()

        await self.app(scope, replay, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind != "http" and (kind != "websocket" or self.websocket == "pass"):
            if kind == "lifespan" and self._unbound:
                await self._lifespan(scope, receive, send)
                return
            await self.app(scope, receive, send)
            return
        if self._unbound:
            self._bind(scope.get("app") or self.app)
        core = self.core
        request: Request | None = None
        outcome: Outcome | None
        if self._lane and kind == "http" and "path_template" not in scope:
            # The pipeline's decide(): a plain rule on a cached route is
            # decided from the scope's method, path and peer in one native
            # call, its headers written as ASGI's bytes pairs (a dict where
            # a hook reads them), and no Request is built.
            outcome = core.decide_scope(scope, self._http_context, request_from_scope, self._form)
        else:
            request = self.request_factory(scope)
            mode = self.decide
            if mode is INLINE:
                outcome = core.check(request)
            elif mode is AWAIT:
                outcome = await core.check_async(request)
            else:
                outcome = await asyncio.to_thread(core.check, request)
        if self.limits is not None:
            scope["nanolimit"] = outcome  # what the limit dependencies check
        if outcome is None:
            await self.app(scope, receive, send)
            return
        headers: Any  # the lane's ASGI pairs, or check()'s dict
        allowed, headers, delay, rule, retry_after, decision, charge = outcome  # one unpacking
        if not allowed:
            if self.deny is not None:
                custom = self.deny(request if request is not None else self.request_factory(scope), outcome)
                if custom is not None:
                    await custom(scope, receive, send)
                    return
            if kind == "http":
                pairs = headers if type(headers) is list else _encode(headers)
                handler = self._handler_for(scope)
                if handler is not None:
                    from .starlette import answer_by_handler

                    await answer_by_handler(handler, scope, receive, send, outcome, pairs)
                    return
                # outcome.body(), without its call and lookups
                body = outcome.body() if type(decision) is CostTooHigh else render_body(rule, retry_after)
                await _send_429(send, pairs, body)
            else:
                await self._deny_websocket(scope, receive, send, outcome)
            return
        if delay > 0.0:
            await self.sleep(delay)
        if charge is not None:
            if kind != "http" or not self._settle_inline:
                await self._counted(scope, receive, send, outcome)
                return
            # in process: the charge settled in place, once, by the status
            # the app sends (a charge settled again gives nothing back)
            pairs = headers if type(headers) is list else _encode(headers)
            try:
                await self.app(scope, receive, _header_send(send, pairs, charge))
            finally:
                charge.settle(500)  # no status sent (it raised, or sent nothing): the client saw an error
            return
        if not headers or kind != "http":
            await self.app(scope, receive, send)
            return
        pairs = headers if type(headers) is list else _encode(headers)
        await self.app(scope, receive, _header_send(send, pairs))

    def _handler_for(self, scope: Scope) -> Any:
        """The app's own 429 handler (a Starlette or FastAPI app's
        ``exception_handlers``), or None: looked up once per app, as
        Starlette fixes its handlers when it starts serving."""
        app = scope.get("app", self.app)
        seen = self._handler
        if seen is not None and seen[0] is app:
            return seen[1]
        handler = None
        if isinstance(getattr(app, "exception_handlers", None), dict):
            from .starlette import handler_for_429

            handler = handler_for_429(app)
        self._handler = (app, handler)
        return handler

    async def _counted(self, scope: Scope, receive: Receive, send: Send, outcome: Outcome) -> None:
        """An admitted request under ``count_when`` rules: settled by the
        status the app sends (500 if it raises before sending one). A
        websocket handshake settles by its answer: 101 accepted, a denial
        response's own status, 403 closed before accept."""
        extra = _pairs(outcome.headers) if scope["type"] == "http" else []
        settled = False

        async def send_settling(message: Message) -> None:
            nonlocal settled
            kind = message["type"]
            if kind == "http.response.start":
                # read the status first: one int() rejects leaves the charge
                # open, so the app's error settles it as 500 (as inline does)
                status = int(message.get("status", 200))
                settled = True
                await self._settle(outcome, status)
                if extra:
                    message["headers"] = [*message.get("headers", ()), *extra]
            elif not settled and kind[:10] == "websocket.":
                # a handshake's answer is what the client saw: 101 when
                # accepted, the denial response's own status, and 403 for a
                # close before accept (the ASGI spec's answer to it); settling
                # those as 500 gave every failed handshake back
                if kind == "websocket.accept":
                    settled = True
                    await self._settle(outcome, 101)
                elif kind == "websocket.http.response.start":
                    status = int(message.get("status", 200))
                    settled = True
                    await self._settle(outcome, status)
                elif kind == "websocket.close":
                    settled = True
                    await self._settle(outcome, 403)
            await send(message)

        try:
            await self.app(scope, receive, send_settling)
        except BaseException:
            if not settled:
                await self._settle(outcome, 500)
            raise
        if not settled:
            await self._settle(outcome, 500)  # no response at all: the client saw an error

    async def _settle(self, outcome: Outcome, status: int) -> None:
        mode = self.decide
        if mode is INLINE:
            self.core.settle(outcome, status)
        elif mode is AWAIT:
            await self.core.settle_async(outcome, status)
        else:
            await asyncio.to_thread(self.core.settle, outcome, status)

    async def _deny_websocket(self, scope: Scope, receive: Receive, send: Send, outcome: Outcome) -> None:
        message = await receive()  # websocket.connect
        if message.get("type") != "websocket.connect":
            return
        if "websocket.http.response" in (scope.get("extensions") or {}):
            body = outcome.body()
            out = _pairs(outcome.headers)
            out.append((b"content-type", b"application/json"))
            out.append((b"content-length", str(len(body)).encode()))
            await send({"type": "websocket.http.response.start", "status": 429, "headers": out})
            await send({"type": "websocket.http.response.body", "body": body, "more_body": False})
        else:
            await send({"type": "websocket.close", "code": 1008, "reason": "rate_limit_exceeded"})
