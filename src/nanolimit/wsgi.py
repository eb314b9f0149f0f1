"""The WSGI middleware: Flask, Django or any WSGI app, as a plain WSGI wrapper.

The public path users type. The code lives in ``nanolimit.gateway.wsgi``, with
the other adapters above the pipeline (docs/architecture.md); this facade
names what it exports, nothing more."""

from .gateway.wsgi import (
    RateLimitMiddleware,
    WSGIApp,
    request_from_environ,
)

__all__ = [
    "RateLimitMiddleware",
    "WSGIApp",
    "request_from_environ",
]
