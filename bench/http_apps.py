"""The apps that ``bench/http_e2e.py`` serves, and the variant table.

Every app answers ``GET /`` with ``200 ok`` (text/plain), nothing more, so
what a variant adds to a request is the limiter and only the limiter.
uvicorn and gunicorn import this module by name, the variant chosen by the
environment (``NANOLIMIT_HTTP_VARIANT``)::

    NANOLIMIT_HTTP_VARIANT=nanolimit uvicorn --app-dir bench --factory http_apps:starlette_app
    NANOLIMIT_HTTP_VARIANT=flask_limiter gunicorn --chdir bench 'http_apps:flask_app()'

**Adding a variant** is one row of ``VARIANTS`` below: the framework, a
name, the function that builds the app (it gets the rule's limit) and the
limit. A new way of building (a route-level declaration, say) is one more
builder function next to the others, named in its row. ``http_e2e.py`` runs
every row, interleaved, and reads the row's ``denied`` (limit 1: nearly every
request is a 429) to report its cost per 429.

The pure ASGI / WSGI pieces (``bare_asgi``, ``HeaderOnlyASGI``, ...) are also
what ``bench/asgi_inprocess.py`` calls directly, with no server at all.

Keep this module importable with only ``src`` and ``bench`` on the path, and
free of any framework import at module level (each builder imports its own).
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from dataclasses import dataclass
from typing import Any, cast

VARIANT_ENV = "NANOLIMIT_HTTP_VARIANT"
# the port of the Redis server the ``store="redis"`` rows talk to (127.0.0.1;
# http_e2e.py starts one and sets it, the tests set it to their fixture's)
REDIS_PORT_ENV = "NANOLIMIT_HTTP_REDIS_PORT"

# Admitted variants: more than any run can spend (7 rounds of ~50k rps for
# seconds each is a few million), within the rule's 2**32 - 1 bound.
HUGE = 1_000_000_000
WINDOW = 3600.0
RULE = "bench"

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]
StartResponse = Callable[..., Any]
WSGIApp = Callable[[dict[str, Any], StartResponse], Iterable[bytes]]

# Five fixed rate-limit headers, the same names and about the same bytes as
# nanolimit's (docs/spec.md §2): what writing headers costs without deciding.
FIXED_HEADERS: tuple[tuple[str, str], ...] = (
    ("X-RateLimit-Limit", "1000000000"),
    ("X-RateLimit-Remaining", "999999999"),
    ("X-RateLimit-Reset", "1796148001"),
    ("RateLimit-Policy", '"bench";q=1000000000;w=3600'),
    ("RateLimit", '"bench";r=999999999;t=3600'),
)
_FIXED_ASGI = tuple((k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in FIXED_HEADERS)
RATE_HEADER_NAMES = tuple(k.lower() for k, _ in FIXED_HEADERS)
# what slowapi and flask-limiter write with headers on (no RateLimit-Policy)
PEER_HEADER_NAMES = ("x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset")


# ---------------------------------------------------------------------------
# Pure ASGI / WSGI pieces


async def bare_asgi(scope: Scope, receive: Receive, send: Send) -> None:
    """The smallest HTTP app: what a framework's own cost is measured against
    in process (a real framework is measured over HTTP)."""
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok", "more_body": False})


class HeaderOnlyASGI:
    """Appends the five fixed headers to every HTTP response, the way
    nanolimit's middleware appends its own (a closure over ``send``), and
    decides nothing: the floor under any limiter that writes headers."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        extra = _FIXED_ASGI

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", ()), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


def bare_wsgi(environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
    """The WSGI twin of ``bare_asgi``."""
    start_response("200 OK", [("Content-Type", "text/plain"), ("Content-Length", "2")])
    return [b"ok"]


class HeaderOnlyWSGI:
    """The WSGI twin of ``HeaderOnlyASGI``."""

    def __init__(self, app: WSGIApp) -> None:
        self.app = app

    def __call__(self, environ: dict[str, Any], start_response: StartResponse) -> Iterable[bytes]:
        def start_with_headers(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            headers = [*headers, *FIXED_HEADERS]
            if exc_info is not None:
                return start_response(status, headers, exc_info)
            return start_response(status, headers)

        return self.app(environ, start_with_headers)


def nanolimit_registry(limit: int, count_when: frozenset[int] | None = None) -> Any:
    """One rule over every path, one key per client IP, fixed window (the
    strategy slowapi and flask-limiter default to), ``limit`` per hour.
    ``count_when``: only answers with these statuses are counted (each
    request is charged on entry and refunded when its status is not one)."""
    from nanolimit import Algorithm
    from nanolimit.gateway.registry import RuleRegistry
    from nanolimit.gateway.rules import KeyScope, RateLimitRule

    rule = RateLimitRule(
        RULE, "*", "/", KeyScope.IP, Algorithm.FIXED_WINDOW, limit, WINDOW, count_when=count_when
    )
    return RuleRegistry([rule])


def redis_port() -> int:
    """The Redis rows' server port, from the environment: a row that needs a
    server it was not given fails at build time, not mid-measurement."""
    raw = os.environ.get(REDIS_PORT_ENV, "")
    if not raw.isdigit():
        raise RuntimeError(f"{REDIS_PORT_ENV} must name the port of a Redis server on 127.0.0.1, got {raw!r}")
    return int(raw)


# A Redis failure must fail the row (a 500 the harness refuses), never pass
# as an admitted request decided nowhere (the default on_error="allow"); a
# second of timeout, not 50 ms, so a busy shared core is not read as an outage.
_REDIS_OPTIONS: dict[str, Any] = {"on_error": "raise", "timeout": 1.0}


def nanolimit_asgi(app: ASGIApp, limit: int) -> ASGIApp:
    from nanolimit.asgi import RateLimitMiddleware
    from nanolimit.gateway.factory import LimiterFactory

    return RateLimitMiddleware(app, nanolimit_registry(limit), LimiterFactory())


def nanolimit_wsgi(app: WSGIApp, limit: int) -> WSGIApp:
    from nanolimit.gateway.factory import LimiterFactory
    from nanolimit.wsgi import RateLimitMiddleware

    return RateLimitMiddleware(app, nanolimit_registry(limit), LimiterFactory())


def peer_rate(limit: int) -> str:
    """The same rule in the ``limits`` spelling slowapi and flask-limiter read."""
    return f"{limit}/hour"


# ---------------------------------------------------------------------------
# Starlette and FastAPI (under uvicorn)


def _starlette(
    middleware: list[Any], limiter: Any = None, decorate: Callable[[Any], Any] | None = None
) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    async def index(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    view = decorate(index) if decorate is not None else index
    app = Starlette(routes=[Route("/", view)], middleware=middleware)
    if limiter is not None:
        _attach_slowapi(app, limiter)
    return app


def _fastapi(middleware: list[Any], limiter: Any = None, decorate: Callable[[Any], Any] | None = None) -> Any:
    from fastapi import FastAPI
    from fastapi.responses import PlainTextResponse

    app = FastAPI(middleware=middleware, openapi_url=None, docs_url=None, redoc_url=None)

    async def index() -> PlainTextResponse:
        return PlainTextResponse("ok")

    # ``decorate`` (a route-level limit) marks the view before it is routed
    app.get("/", response_class=PlainTextResponse)(decorate(index) if decorate is not None else index)

    if limiter is not None:
        _attach_slowapi(app, limiter)
    return app


_ASGI_FRAMEWORKS: dict[str, Callable[..., Any]] = {"starlette": _starlette, "fastapi": _fastapi}


def _slowapi_limiter(limit: int, **options: Any) -> Any:
    """slowapi's documented set-up: default in-memory storage (``options``
    may name another), a default limit for every route, headers on
    (nanolimit always writes them)."""
    from slowapi import Limiter
    from slowapi.util import get_remote_address

    return Limiter(
        key_func=get_remote_address, default_limits=[peer_rate(limit)], headers_enabled=True, **options
    )


def _attach_slowapi(app: Any, limiter: Any) -> None:
    from slowapi import _rate_limit_exceeded_handler
    from slowapi.errors import RateLimitExceeded

    app.state.limiter = limiter
    app.add_exception_handler(RateLimitExceeded, _rate_limit_exceeded_handler)


def asgi_bare(framework: str, limit: int) -> Any:
    return _ASGI_FRAMEWORKS[framework]([])


def asgi_headers(framework: str, limit: int) -> Any:
    from starlette.middleware import Middleware

    return _ASGI_FRAMEWORKS[framework]([Middleware(HeaderOnlyASGI)])


def _nanolimit_middleware(registry: Any, storage: Any = None) -> Any:
    from starlette.middleware import Middleware

    from nanolimit.asgi import RateLimitMiddleware
    from nanolimit.gateway.factory import LimiterFactory

    # (cast: Starlette's Middleware types its factory's arguments, and they grow)
    return Middleware(cast(Any, RateLimitMiddleware), registry=registry, factory=LimiterFactory(storage))


def asgi_nanolimit(framework: str, limit: int) -> Any:
    return _ASGI_FRAMEWORKS[framework]([_nanolimit_middleware(nanolimit_registry(limit))])


def asgi_nanolimit_counted(framework: str, limit: int) -> Any:
    """The prefix rule counting only 401s: the app answers 200, so every
    request is charged on entry and refunded on its response (the dearest
    way through ``count_when``)."""
    registry = nanolimit_registry(limit, count_when=frozenset({401}))
    return _ASGI_FRAMEWORKS[framework]([_nanolimit_middleware(registry)])


def asgi_nanolimit_route(framework: str, limit: int) -> Any:
    """The same limit declared on the view (``RouteLimits``), the middleware
    added the way its docs show: the rule is made from the route table when
    the middleware binds to the app."""
    from nanolimit.asgi import RateLimitMiddleware
    from nanolimit.gateway.routes import RouteLimits

    limits = RouteLimits()
    declared = limits.limit(peer_rate(limit), algorithm="fixed_window")
    app = _ASGI_FRAMEWORKS[framework]([], decorate=declared)
    app.add_middleware(cast(Any, RateLimitMiddleware), limits=limits)
    return app


def asgi_nanolimit_async_redis(framework: str, limit: int) -> Any:
    """State in Redis through ``AsyncRedisStorage``: the middleware awaits
    each decision on the event loop (the client binds to the server's loop
    at its first request)."""
    import redis.asyncio

    from nanolimit.storage.redis import AsyncRedisStorage

    client = redis.asyncio.Redis(host="127.0.0.1", port=redis_port())
    storage = AsyncRedisStorage(client, prefix=f"bench:{framework}:async:", **_REDIS_OPTIONS)
    return _ASGI_FRAMEWORKS[framework]([_nanolimit_middleware(nanolimit_registry(limit), storage)])


def asgi_nanolimit_sync_redis(framework: str, limit: int) -> Any:
    """State in Redis through the blocking ``RedisStorage``: the middleware
    decides in a worker thread, so the event loop is never blocked."""
    import redis

    from nanolimit.storage.redis import RedisStorage

    client = redis.Redis(host="127.0.0.1", port=redis_port())
    storage = RedisStorage(client, prefix=f"bench:{framework}:sync:", **_REDIS_OPTIONS)
    return _ASGI_FRAMEWORKS[framework]([_nanolimit_middleware(nanolimit_registry(limit), storage)])


def asgi_slowapi_asgi(framework: str, limit: int) -> Any:
    from slowapi.middleware import SlowAPIASGIMiddleware
    from starlette.middleware import Middleware

    return _ASGI_FRAMEWORKS[framework]([Middleware(SlowAPIASGIMiddleware)], _slowapi_limiter(limit))


def asgi_slowapi_redis(framework: str, limit: int) -> Any:
    """slowapi's ASGI middleware on its documented Redis storage (``limits``'
    redis-py backend), its own key prefix."""
    from slowapi.middleware import SlowAPIASGIMiddleware
    from starlette.middleware import Middleware

    limiter = _slowapi_limiter(
        limit, storage_uri=f"redis://127.0.0.1:{redis_port()}", key_prefix=f"slowapi-bench-{framework}"
    )
    return _ASGI_FRAMEWORKS[framework]([Middleware(SlowAPIASGIMiddleware)], limiter)


def asgi_slowapi_base(framework: str, limit: int) -> Any:
    from slowapi.middleware import SlowAPIMiddleware
    from starlette.middleware import Middleware

    return _ASGI_FRAMEWORKS[framework]([Middleware(SlowAPIMiddleware)], _slowapi_limiter(limit))


# ---------------------------------------------------------------------------
# Flask (under gunicorn, sync worker)


def _flask(decorate: Callable[[Any], Any] | None = None) -> Any:
    from flask import Flask, Response

    app = Flask("bench")

    def index() -> Response:
        return Response("ok", mimetype="text/plain")

    app.get("/")(decorate(index) if decorate is not None else index)
    return app


def wsgi_bare(framework: str, limit: int) -> Any:
    return _flask()


def wsgi_headers(framework: str, limit: int) -> Any:
    app = _flask()
    app.wsgi_app = HeaderOnlyWSGI(app.wsgi_app)
    return app


def wsgi_nanolimit(framework: str, limit: int) -> Any:
    app = _flask()
    app.wsgi_app = nanolimit_wsgi(app.wsgi_app, limit)
    return app


def wsgi_nanolimit_flask(framework: str, limit: int, count_when: frozenset[int] | None = None) -> Any:
    """nanolimit's Flask extension (``nanolimit.flask.Limiter``), the same
    rule as a default limit: decided in ``before_request``, its headers
    written at ``start_response``, a 429 answered without Flask's error
    handling (the app has no handler of its own). ``count_when``: the
    same rule declared on the view, counting only those statuses."""
    from nanolimit.flask import Limiter

    if count_when is None:
        app = _flask()
        Limiter(app, default_limits=peer_rate(limit), algorithm="fixed_window", log_denials=None)
        return app
    limiter = Limiter(algorithm="fixed_window", log_denials=None)
    app = _flask(limiter.limit(peer_rate(limit), count_when=count_when))
    limiter.init_app(app)
    return app


def wsgi_flask_limiter(framework: str, limit: int) -> Any:
    """flask-limiter's documented set-up: in-memory storage, a default limit,
    headers on."""
    from flask_limiter import Limiter
    from flask_limiter.util import get_remote_address

    app = _flask()
    Limiter(
        get_remote_address,
        app=app,
        default_limits=[peer_rate(limit)],
        storage_uri="memory://",
        headers_enabled=True,
    )
    return app


# ---------------------------------------------------------------------------
# Django (under gunicorn, sync worker). Settings are per process, so one
# variant per process: the server's, or a test's subprocess.


def _django(middleware: list[str], view: Callable[[Any], Any], extra: dict[str, Any] | None = None) -> Any:
    import django
    from django.conf import settings
    from django.urls import path

    settings.configure(
        DEBUG=False,
        SECRET_KEY="bench",
        ALLOWED_HOSTS=["*"],
        ROOT_URLCONF=__name__,
        MIDDLEWARE=middleware,
        INSTALLED_APPS=[],
        USE_TZ=True,
        CACHES={"default": {"BACKEND": "django.core.cache.backends.locmem.LocMemCache"}},
        **(extra or {}),
    )
    django.setup()
    global urlpatterns
    urlpatterns = [path("", view)]
    from django.core.wsgi import get_wsgi_application

    return get_wsgi_application()


urlpatterns: list[Any] = []  # ROOT_URLCONF of the Django variants


def _django_ok(request: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse("ok", content_type="text/plain")


def django_bare(framework: str, limit: int) -> Any:
    return _django([], _django_ok)


def django_headers(framework: str, limit: int) -> Any:
    app = _django([], _django_ok)
    return HeaderOnlyWSGI(app)


def django_nanolimit(framework: str, limit: int) -> Any:
    """nanolimit's Django integration as its docs set it up: the middleware,
    and the limit declared on the view with ``@limit``."""
    from nanolimit.django import limit as declare

    view = declare(peer_rate(limit), algorithm="fixed_window")(_django_ok)
    return _django(["nanolimit.django.RateLimitMiddleware"], view, {"NANOLIMIT": {"LOG_DENIALS": None}})


def django_ratelimit(framework: str, limit: int) -> Any:
    """django-ratelimit's documented decorator (``block=True``: a 429 through
    its ``Ratelimited`` exception and ``RATELIMIT_VIEW``), in the local
    memory cache."""
    from django_ratelimit.decorators import ratelimit

    view = ratelimit(key="ip", rate=peer_rate(limit).replace("/hour", "/h"), block=True)(_django_ok)
    return _django(
        ["django_ratelimit.middleware.RatelimitMiddleware"],
        view,
        {"RATELIMIT_VIEW": f"{__name__}._django_429", "SILENCED_SYSTEM_CHECKS": ["django_ratelimit.E003"]},
    )


def _django_429(request: Any, exception: Any) -> Any:
    from django.http import HttpResponse

    return HttpResponse("rate limited", status=429, content_type="text/plain")


# ---------------------------------------------------------------------------
# The variant table


@dataclass(frozen=True)
class Variant:
    """One served app: ``build(framework, limit)`` returns it."""

    framework: str
    name: str
    build: Callable[[str, int], Any]
    limit: int = HUGE
    headers: tuple[str, ...] = ()  # lower-case names an admitted answer must carry
    peer: tuple[str, ...] = ()  # what the builder imports beyond the framework and server
    store: str | None = None  # "redis": the row needs a Redis server (REDIS_PORT_ENV)

    @property
    def denied(self) -> bool:
        """Limit 1: the first request is admitted, every later one is a 429."""
        return self.limit == 1

    @property
    def server(self) -> str:
        return "gunicorn" if self.framework in ("flask", "django") else "uvicorn"

    @property
    def needs(self) -> tuple[str, ...]:
        """The modules serving this row imports (``http_e2e.py`` installs them)."""
        return (
            self.server,
            self.framework,
            *(("starlette",) if self.framework == "fastapi" else ()),
            *self.peer,
            *(("redis",) if self.store == "redis" else ()),  # redis-py, for either limiter
        )


# framework, name, builder, limit, headers, peer. "bare" is each framework's baseline.
OURS, PEER = RATE_HEADER_NAMES, PEER_HEADER_NAMES
SLOWAPI, FLASK_LIMITER, DJANGO_RATELIMIT = ("slowapi",), ("flask_limiter",), ("django_ratelimit",)
REDIS = "redis"
VARIANTS: tuple[Variant, ...] = (
    *(
        row
        for fw in ("starlette", "fastapi")
        for row in (
            Variant(fw, "bare", asgi_bare),
            Variant(fw, "headers_only", asgi_headers, headers=OURS),
            Variant(fw, "nanolimit", asgi_nanolimit, headers=OURS),
            Variant(fw, "nanolimit_denied", asgi_nanolimit, limit=1, headers=OURS),
            Variant(fw, "slowapi_asgi", asgi_slowapi_asgi, headers=PEER, peer=SLOWAPI),
            Variant(fw, "slowapi_asgi_denied", asgi_slowapi_asgi, limit=1, headers=PEER, peer=SLOWAPI),
            Variant(fw, "slowapi_base", asgi_slowapi_base, headers=PEER, peer=SLOWAPI),
            Variant(fw, "slowapi_base_denied", asgi_slowapi_base, limit=1, headers=PEER, peer=SLOWAPI),
        )
    ),
    Variant("starlette", "nanolimit_async_redis", asgi_nanolimit_async_redis, headers=OURS, store=REDIS),
    Variant("starlette", "nanolimit_sync_redis", asgi_nanolimit_sync_redis, headers=OURS, store=REDIS),
    Variant("starlette", "slowapi_redis", asgi_slowapi_redis, headers=PEER, peer=SLOWAPI, store=REDIS),
    Variant("fastapi", "nanolimit_route", asgi_nanolimit_route, headers=OURS),
    Variant("fastapi", "nanolimit_counted", asgi_nanolimit_counted, headers=OURS),
    Variant("flask", "bare", wsgi_bare),
    Variant("flask", "headers_only", wsgi_headers, headers=OURS),
    Variant("flask", "nanolimit", wsgi_nanolimit, headers=OURS),
    Variant("flask", "nanolimit_denied", wsgi_nanolimit, limit=1, headers=OURS),
    Variant("flask", "flask_limiter", wsgi_flask_limiter, headers=PEER, peer=FLASK_LIMITER),
    Variant("flask", "flask_limiter_denied", wsgi_flask_limiter, limit=1, headers=PEER, peer=FLASK_LIMITER),
    Variant("flask", "nanolimit_ext", wsgi_nanolimit_flask, headers=OURS),
    Variant("flask", "nanolimit_ext_denied", wsgi_nanolimit_flask, limit=1, headers=OURS),
    Variant("django", "bare", django_bare),
    Variant("django", "headers_only", django_headers, headers=OURS),
    Variant("django", "nanolimit", django_nanolimit, headers=OURS),
    Variant("django", "nanolimit_denied", django_nanolimit, limit=1, headers=OURS),
    Variant("django", "django_ratelimit", django_ratelimit, peer=DJANGO_RATELIMIT),
    Variant("django", "django_ratelimit_denied", django_ratelimit, limit=1, peer=DJANGO_RATELIMIT),
)


def variant(framework: str, name: str) -> Variant:
    for row in VARIANTS:
        if row.framework == framework and row.name == name:
            return row
    known = ", ".join(f"{r.framework}/{r.name}" for r in VARIANTS)
    raise LookupError(f"no variant {framework}/{name}; known: {known}")


def _from_env(framework: str) -> Any:
    row = variant(framework, os.environ.get(VARIANT_ENV, "bare"))
    return row.build(framework, row.limit)


def starlette_app() -> Any:
    """``uvicorn --factory http_apps:starlette_app``."""
    return _from_env("starlette")


def fastapi_app() -> Any:
    """``uvicorn --factory http_apps:fastapi_app``."""
    return _from_env("fastapi")


def flask_app() -> Any:
    """``gunicorn 'http_apps:flask_app()'``."""
    return _from_env("flask")


def django_app() -> Any:
    """``gunicorn 'http_apps:django_app()'``."""
    return _from_env("django")
