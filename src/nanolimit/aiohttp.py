"""The aiohttp middleware: ``setup(app)``.

The public path users type. The code lives in ``nanolimit.gateway.aiohttp``, with
the other adapters above the pipeline (docs/architecture.md); this facade
names what it exports, nothing more."""

from .gateway.aiohttp import (
    RateLimitMiddleware,
    decide_mode,
    rate_limit_middleware,
    request_from_aiohttp,
    routes_of,
    setup,
)

__all__ = [
    "RateLimitMiddleware",
    "decide_mode",
    "rate_limit_middleware",
    "request_from_aiohttp",
    "routes_of",
    "setup",
]
