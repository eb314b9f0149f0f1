"""A ``/metrics`` endpoint without a metrics library: ASGI and WSGI apps that
answer a scrape with :meth:`Metrics.render_prometheus`.

Mount one where the scraper looks (``/metrics``): the app answers every path
it is given, ``GET`` (and ``HEAD``, the same without a body) with the text
format, any other method with 405 and ``Allow``. A scrape reads the counters
and the watched storages then, and only then.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from ..errors import ValidationError
from .metrics import Metrics

__all__ = ["CONTENT_TYPE", "metrics_app", "metrics_wsgi_app"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_ALLOW = "GET, HEAD"
_NOT_ALLOWED = b"405 Method Not Allowed: a metrics endpoint answers GET\n"

Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


def _check(metrics: Any) -> Metrics:
    if not isinstance(metrics, Metrics):
        raise ValidationError(f"a metrics endpoint serves a nanolimit Metrics, got {type(metrics).__name__}")
    return metrics


def _answer(metrics: Metrics, method: str) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, headers and body for one request: the one place both apps decide."""
    if method not in ("GET", "HEAD"):
        headers = [("Content-Type", "text/plain; charset=utf-8"), ("Allow", _ALLOW)]
        return 405, [*headers, ("Content-Length", str(len(_NOT_ALLOWED)))], _NOT_ALLOWED
    body = metrics.render_prometheus().encode("utf-8")
    headers = [("Content-Type", CONTENT_TYPE), ("Content-Length", str(len(body)))]
    return 200, headers, b"" if method == "HEAD" else body


def metrics_app(metrics: Metrics) -> Callable[[Scope, Receive, Send], Awaitable[None]]:
    """An ASGI app serving ``metrics`` (HTTP; it also completes a lifespan,
    so it can be served on its own: ``uvicorn.run(metrics_app(m))``)."""
    metrics = _check(metrics)

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            raise ValidationError(f"the metrics app serves HTTP, not {scope['type']!r}")
        status, headers, body = _answer(metrics, scope["method"])
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
            }
        )
        await send({"type": "http.response.body", "body": body})

    return app


def metrics_wsgi_app(metrics: Metrics) -> Callable[[dict[str, Any], Callable[..., Any]], Iterable[bytes]]:
    """A WSGI app serving ``metrics``."""
    metrics = _check(metrics)
    reasons = {200: "200 OK", 405: "405 Method Not Allowed"}

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        status, headers, body = _answer(metrics, environ.get("REQUEST_METHOD", "GET"))
        start_response(reasons[status], headers)
        return [body]

    return app
