"""The Flask extension: ``Limiter(app)``.

The public path users type. The code lives in ``nanolimit.gateway.flask``, with
the other adapters above the pipeline (docs/architecture.md); this facade
names what it exports, nothing more."""

from .gateway.flask import (
    CONFIG_KEYS,
    Limiter,
    RateLimitExceeded,
)

__all__ = [
    "CONFIG_KEYS",
    "Limiter",
    "RateLimitExceeded",
]
