"""Route-level limits on Starlette and FastAPI apps: their route table,
their router's match, and a FastAPI dependency.

The ASGI middleware (:mod:`nanolimit.asgi`) decides before the app runs,
so it reads the route the way Starlette's router does, on a route-cache
miss only (a hit costs nothing more than a prefix rule). This module reads
Starlette's objects by their public attributes (``routes``, ``path``,
``endpoint``, ``methods``, ``matches``, FastAPI's ``dependencies`` and
``dependant``) and imports Starlette only for the dependency's signature
and to call an app's own 429 handler (``exception_handlers``) with the
``HTTPException(429)`` Starlette would have handed it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import re
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from .request import Request
from .routes import LimitDependency, RouteInfo

# LimitDependency lives in routes
__all__ = [
    "LimitDependency",
    "answer_by_handler",
    "context_for",
    "handler_for_429",
    "resolver_for",
    "routes_by_host",
    "routes_of",
]

Scope = MutableMapping[str, Any]

_NONE, _PARTIAL, _FULL = 0, 1, 2  # starlette.routing.Match values


def _expand(routes: Any) -> list[Any]:
    """Routes as they match: FastAPI's included routers (``_IncludedRouter``
    in recent releases) stand for their flattened routes, each with its full
    path, endpoint, methods and dependencies."""
    out: list[Any] = []
    for route in routes:
        effective = getattr(route, "effective_route_contexts", None)
        if callable(effective):
            out.extend(effective())
        else:
            out.append(route)
    return out


def _app_routes(app: Any) -> list[Any] | None:
    routes = getattr(app, "routes", None)
    if routes is None:
        router = getattr(app, "router", None)
        routes = getattr(router, "routes", None)
    return _expand(routes) if routes is not None else None


def _prefix(route: Any, prefix: str) -> str:
    """The template prefix a Mount or Host adds: a mount's path; a host's
    name as ``//host`` (a network-path reference), so ``/login`` on
    ``api.example.com`` and ``/login`` elsewhere are two routes."""
    host = getattr(route, "host", None)
    if isinstance(host, str) and not hasattr(route, "path"):
        return "//" + host + prefix
    return prefix + (getattr(route, "path", "") or "")


def _dependency_marks(route: Any) -> Iterator[Any]:
    """FastAPI: the limit dependencies of a route (its own, its router's,
    the app's, and those in the endpoint's signature)."""
    for dep in getattr(route, "dependencies", None) or ():
        call = getattr(dep, "dependency", None)
        if isinstance(call, LimitDependency):
            yield call
    stack = list(getattr(getattr(route, "dependant", None), "dependencies", None) or ())
    while stack:
        sub = stack.pop()
        call = getattr(sub, "call", None)
        if isinstance(call, LimitDependency):
            yield call
        stack.extend(getattr(sub, "dependencies", None) or ())


def routes_of(app: Any) -> list[RouteInfo]:
    """Every route of a Starlette or FastAPI app, mounts and hosts
    included, with the routers and dependencies above each route."""
    routes = _app_routes(app)
    if routes is None:
        raise TypeError(
            f"route-level limits need a Starlette or FastAPI app (one with routes), got {type(app).__name__}"
        )
    out: list[RouteInfo] = []

    def walk(routes: list[Any], prefix: str, marked: tuple[Any, ...]) -> None:
        for route in routes:
            here = (*marked, route)
            inner = getattr(route, "routes", None)
            if inner is not None and not hasattr(route, "endpoint"):  # Mount, Host
                sub_app = getattr(route, "app", None)
                if sub_app is not None:
                    here = (*here, sub_app)
                path = _prefix(route, prefix)
                if inner:
                    walk(_expand(inner), path, here)
                else:  # a mounted app without routes (static files): its whole subtree
                    out.append(RouteInfo(path + "/{path:path}", frozenset(), sub_app, here))
                continue
            route_path: str | None = getattr(route, "path", None)
            if route_path is None:
                continue
            methods = frozenset(getattr(route, "methods", None) or ())
            deps = tuple(_dependency_marks(route))
            out.append(
                RouteInfo(prefix + route_path, methods, getattr(route, "endpoint", None), (*here, *deps))
            )

    walk(routes, "", ())
    return out


def _match(routes: list[Any], scope: Scope, prefix: str) -> str | None:
    partial = None
    for route in routes:
        try:
            match, child = route.matches(scope)
        except Exception:  # noqa: BLE001 - a route that cannot read this scope does not match it
            continue
        value = getattr(match, "value", match)
        if value == _NONE:
            continue
        inner = getattr(route, "routes", None)
        if inner is not None and not hasattr(route, "endpoint"):
            if value == _FULL:
                path = _prefix(route, prefix)
                if not inner:
                    return path + "/{path:path}"
                found = _match(_expand(inner), {**scope, **child}, path)
                if found is not None:
                    return found
            continue
        template = prefix + str(route.path)
        if value == _FULL:
            return template
        if partial is None:
            partial = template  # the route exists, for another method
    return partial


def _litestar_formats(routes: list[Any]) -> dict[str, str]:
    """Litestar's matched ``path_template`` (``/items/{item_id}``, its
    ``path_format``) -> the route's template (``/items/{item_id:int}``):
    the route the app declared, converter and all."""
    out: dict[str, str] = {}
    for route in routes:
        fmt, path = getattr(route, "path_format", None), getattr(route, "path", None)
        if isinstance(fmt, str) and isinstance(path, str):
            out[fmt] = path
    return out


# Route classes whose ``matches`` reads only the scope's type, path,
# root_path, method and (a Host) its Host header: what context_for keys by.
_KNOWN_MATCHERS = ("starlette.routing", "fastapi.routing")


def context_for(app: Any) -> Callable[[Request], str] | None:
    """What Starlette's router reads of a request besides its method and
    path, as one str: the scope's type (a websocket is not an HTTP GET),
    its ``root_path`` and, when the app routes by ``Host``, the Host
    header; Litestar's matched template when it put one in the scope. The
    pipeline's route cache keys by it. None when some route is of a class
    whose matching may read more: the pipeline then resolves every request.
    """
    routes = _app_routes(app)
    if routes is None:
        raise TypeError(f"cannot read the routes of {type(app).__name__}")
    formats = _litestar_formats(routes)
    by_host = routes_by_host(app)
    stack = list(routes)
    while stack:
        route = stack.pop()
        matches = getattr(type(route), "matches", None)
        if getattr(matches, "__module__", None) not in _KNOWN_MATCHERS:
            return None
        if not hasattr(route, "endpoint"):
            stack.extend(_expand(getattr(route, "routes", None) or ()))

    def context(request: Request) -> str:
        scope = request.native
        if type(scope) is not dict and not isinstance(scope, MutableMapping):  # the ABC check costs
            return ""
        template = scope.get("path_template")
        if isinstance(template, str):
            return _litestar_route(template, scope.get("route_handler"), formats) or ""
        # the common case, "http" itself: nothing is built per request
        context = str(scope.get("type"))
        root = scope.get("root_path")
        if root:
            context = f"{context}\x00{root}"
        if by_host:
            host = ""
            for name, value in scope.get("headers") or ():
                if name == b"host":
                    host = value.decode("latin-1")
                    break
            context = f"{context}\x01{host}"
        return context

    return context


def routes_by_host(app: Any) -> bool:
    """Whether some route of ``app`` is a ``Host``: its router then reads
    the Host header."""
    stack = list(_app_routes(app) or ())
    while stack:
        route = stack.pop()
        if isinstance(getattr(route, "host", None), str) and not hasattr(route, "path"):
            return True
        if not hasattr(route, "endpoint"):
            stack.extend(_expand(getattr(route, "routes", None) or ()))
    return False


def resolver_for(app: Any) -> Callable[[Request], str | None]:
    """The route template a request reaches, as Starlette's router would
    pick it (the pipeline asks on a route-cache miss only)."""
    routes = _app_routes(app)
    if routes is None:
        raise TypeError(f"cannot read the routes of {type(app).__name__}")
    formats = _litestar_formats(routes)
    litestar_routing = getattr(getattr(app, "asgi_router", None), "handle_routing", None)

    def resolve(request: Request) -> str | None:
        scope = request.native
        if not isinstance(scope, MutableMapping):
            return None
        template = scope.get("path_template")  # Litestar's router has matched already: its template
        if isinstance(template, str):
            return _litestar_route(template, scope.get("route_handler"), formats)
        if callable(litestar_routing):  # a Litestar app wrapped whole: ask its router
            return _litestar_resolve(litestar_routing, scope, formats)
        return _match(routes, scope, "")

    return resolve


def _litestar_route(template: str, handler: Any, formats: dict[str, str]) -> str | None:
    """The route of Litestar's matched ``path_template``: a mount's is
    empty (its router reports the root's), so a mount is its handler's
    one path, and None when it has several (none to tell them by)."""
    if template:
        return formats.get(template, template)
    paths = getattr(handler, "paths", None)
    if paths and len(paths) == 1:
        path = next(iter(paths))
        if isinstance(path, str):
            return formats.get(path, path)
    return None


def _litestar_resolve(routing: Callable[..., Any], scope: Scope, formats: dict[str, str]) -> str | None:
    """The route a Litestar router will match for ``scope``, asked of the
    router itself (its ``handle_routing``, cached by Litestar), as its
    ASGI router reads the scope: the path below ``root_path``,
    normalised, and the method (None for a websocket)."""
    path = str(scope.get("path", ""))
    root_path = scope.get("root_path", "")
    if root_path:
        path = path.split(root_path, maxsplit=1)[-1]
    path = "/" + re.sub("/+", "/", path.strip("/"))
    try:
        _, handler, _, _, template = routing(path=path, method=scope.get("method"))
    except Exception:  # noqa: BLE001 - a 404 or a 405: no route
        return None
    return _litestar_route(template, handler, formats)


def handler_for_429(app: Any) -> Callable[..., Any] | None:
    """The app's own handler of a 429, as Starlette's ``ExceptionMiddleware``
    would pick it for ``HTTPException(429)``: by status code, then by the
    exception's classes. None when the app has none of its own: not a
    Starlette app (Litestar's ``exception_handlers`` are its own), or only
    FastAPI's stock ``HTTPException`` handler, which answers what our
    default 429 answers.
    ``Exception`` and 500 handlers answer only unhandled errors there
    (``ServerErrorMiddleware``), so they are not asked either."""
    try:
        from starlette.applications import Starlette
        from starlette.exceptions import HTTPException
    except ImportError:
        return None
    # Litestar keeps ``exception_handlers`` too (with one for Starlette's
    # HTTPException), but answers nothing through Starlette's middleware.
    if not isinstance(app, Starlette):
        return None
    handlers = getattr(app, "exception_handlers", None)
    if not isinstance(handlers, dict) or not handlers:
        return None
    handler = handlers.get(429)
    if handler is not None:
        return handler  # type: ignore[no-any-return]
    stock: Any = None
    with contextlib.suppress(ImportError):
        from fastapi.exception_handlers import http_exception_handler as stock
    for cls in HTTPException.__mro__:
        if cls is Exception or cls is BaseException or cls is object:
            break
        handler = handlers.get(cls)
        if handler is not None:
            return None if handler is stock else handler
    return None


def _is_async(fn: Any) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(type(fn).__call__)


async def answer_by_handler(
    handler: Callable[..., Any],
    scope: Scope,
    receive: Any,
    send: Any,
    outcome: Any,
    pairs: list[tuple[bytes, bytes]],
) -> None:
    """Answer a denial with the app's own 429 handler, as Starlette would
    have called it had the request raised ``HTTPException(429)``: the
    rate-limit headers on the exception (its ``outcome`` the pipeline's
    :class:`~nanolimit.gateway.middleware.Outcome`), and added to the
    handler's response where it left them out."""
    from starlette.concurrency import run_in_threadpool
    from starlette.datastructures import Headers
    from starlette.exceptions import HTTPException
    from starlette.requests import Request as StarletteRequest

    headers = Headers(raw=list(pairs))  # read in any case, as Starlette reads a request's
    exc = HTTPException(429, detail=f"rate limit exceeded (rule {outcome.rule!r})", headers=headers)
    exc.outcome = outcome  # type: ignore[attr-defined]
    request = StarletteRequest(scope, receive)
    if _is_async(handler):
        response = await handler(request, exc)
    else:
        response = await run_in_threadpool(handler, request, exc)
    if response is None:
        return

    async def send_with_headers(message: MutableMapping[str, Any]) -> None:
        if message["type"] == "http.response.start":
            present = {bytes(name).lower() for name, _ in message.get("headers", ())}
            message["headers"] = [*message.get("headers", ()), *(p for p in pairs if p[0] not in present)]
        await send(message)

    await response(scope, receive, send_with_headers)
