"""The ASGI middleware: Starlette, FastAPI, Litestar, Quart or any ASGI app.

The public path users type. The code lives in ``nanolimit.gateway.asgi``, with
the other adapters above the pipeline (docs/architecture.md); this facade
names what it exports, nothing more."""

from .gateway.asgi import (
    ASGIApp,
    RateLimitMiddleware,
    request_from_scope,
)

__all__ = [
    "ASGIApp",
    "RateLimitMiddleware",
    "request_from_scope",
]
