"""Apps for the real-server tests of the shared-memory zone (test_zone_servers).

Each worker process of a multi-process server (``gunicorn -w 4``,
``uvicorn --workers 4``) builds its app here: the app factory constructs the
storage, so every worker opens the zone when it loads the app (the first
creates the segment, the others attach; under ``gunicorn --preload`` the
master builds it once and the workers inherit it through ``fork``).

The environment chooses what is served, so one module covers every run:

``NANOLIMIT_ZONE_STORAGE``
    ``zone``: a :class:`nanolimit._core.SharedMemoryStorage` named by
    ``NANOLIMIT_ZONE_NAME``, one budget for all workers; ``memory``: the
    factory's default per-process :class:`InMemoryStorage` (the N-times
    over-admission the zone removes).
``NANOLIMIT_ZONE_ALGORITHM`` / ``NANOLIMIT_ZONE_LIMIT``
    the ``api`` rule: ``limit`` per hour on ``/api``, one ``global`` key,
    so every request spends the same budget.

Every response, 429s included, carries ``X-Worker-Pid`` (added outside the
rate-limit middleware), so a test can count what each worker admitted.
``/health`` is outside every rule: it answers ``{"pid", "created", "keys"}``
for the readiness probe and never spends budget.

gunicorn and uvicorn import this module by name (``zone_apps:flask_app()``,
``--factory zone_apps:starlette_app``): keep it importable with only ``src``
and ``tests`` on the path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from nanolimit import Algorithm
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import KeyScope, RateLimitRule

ZONE_ENV = "NANOLIMIT_ZONE_NAME"
STORAGE_ENV = "NANOLIMIT_ZONE_STORAGE"
ALGORITHM_ENV = "NANOLIMIT_ZONE_ALGORITHM"
LIMIT_ENV = "NANOLIMIT_ZONE_LIMIT"
MAX_KEYS = 10_000
WINDOW = 3600.0
PID_HEADER = "X-Worker-Pid"

# What this process opened, kept alive for the life of the worker (the
# factory holds it too; this is for /health and for a reader of the module).
_storages: list[Any] = []


def registry() -> RuleRegistry:
    """One rule, ``api``: ``LIMIT`` per hour on ``/api``, a single global key."""
    algorithm = Algorithm.parse(os.environ.get(ALGORITHM_ENV, "fixed_window"))
    limit = int(os.environ.get(LIMIT_ENV, "1000"))
    return RuleRegistry([RateLimitRule("api", "*", "/api", KeyScope.GLOBAL, algorithm, limit, WINDOW)])


def factory() -> LimiterFactory:
    """The storage the environment names, opened in this process."""
    kind = os.environ.get(STORAGE_ENV, "zone")
    if kind == "memory":
        made = LimiterFactory()  # a fresh per-process InMemoryStorage
    elif kind == "zone":
        from nanolimit._core import SharedMemoryStorage

        made = LimiterFactory(storage=SharedMemoryStorage(os.environ[ZONE_ENV], max_keys=MAX_KEYS))
    else:
        raise ValueError(f"{STORAGE_ENV} must be 'zone' or 'memory', got {kind!r}")
    _storages.append(made.storage)
    return made


def health() -> bytes:
    """``{"pid", "created", "keys"}`` of this worker (``created``: None on
    InMemoryStorage; ``keys``: how many keys its storage holds)."""
    store = _storages[-1] if _storages else None
    created = getattr(store, "created", None)
    keys = len(store) if store is not None and hasattr(store, "__len__") else None
    return json.dumps({"pid": os.getpid(), "created": created, "keys": keys}).encode()


# ---------------------------------------------------------------------------
# Flask under gunicorn (sync workers)

WSGIApp = Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]


def _pid_wsgi(app: WSGIApp) -> WSGIApp:
    """``app`` with ``X-Worker-Pid`` on every response (read per request: a
    ``--preload`` app is built in the master, before the fork)."""

    def wrapped(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            headers = [*headers, (PID_HEADER, str(os.getpid()))]
            if exc_info is not None:
                return start_response(status, headers, exc_info)
            return start_response(status, headers)

        return app(environ, start)

    return wrapped


def flask_app() -> Any:
    """Flask with ``/api/<path>`` (limited by the ``api`` rule) and ``/health``."""
    from flask import Flask, Response

    from nanolimit.wsgi import RateLimitMiddleware

    app = Flask("zone")

    @app.get("/api/<path:rest>")
    def api(rest: str) -> Response:
        return Response("ok", mimetype="text/plain")

    @app.get("/health")
    def healthz() -> Response:
        return Response(health(), mimetype="application/json")

    app.wsgi_app = _pid_wsgi(  # type: ignore[method-assign,assignment]
        RateLimitMiddleware(app.wsgi_app, registry(), factory())
    )
    return app


# ---------------------------------------------------------------------------
# Starlette under uvicorn

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class _PidASGI:
    """``app`` with ``x-worker-pid`` on every HTTP response."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        pid = (PID_HEADER.lower().encode(), str(os.getpid()).encode())

        async def send_with_pid(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = dict(message)
                message["headers"] = [*message.get("headers", ()), pid]
            await send(message)

        await self.app(scope, receive, send_with_pid)


def starlette_app() -> Any:
    """Starlette with the same routes (``uvicorn --factory``)."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    from nanolimit.asgi import RateLimitMiddleware

    async def api(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    async def healthz(request: Request) -> Response:
        return Response(health(), media_type="application/json")

    app = Starlette(
        routes=[Route("/api/{rest:path}", api), Route("/health", healthz)],
        middleware=[Middleware(RateLimitMiddleware, registry=registry(), factory=factory())],
    )
    return _PidASGI(app)
