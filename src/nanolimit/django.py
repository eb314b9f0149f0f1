"""The Django adapter: ``"nanolimit.django.RateLimitMiddleware"`` in
``settings.MIDDLEWARE``, ``"nanolimit.django.NanolimitConfig"`` in ``INSTALLED_APPS``.

The public path users type. The code lives in ``nanolimit.gateway.django``, with
the other adapters above the pipeline (docs/architecture.md); this facade
names what it exports, nothing more."""

from .gateway.django import (
    SETTINGS,
    NanolimitConfig,
    Ratelimited,
    RateLimitMiddleware,
    check_limits,
    exempt,
    limit,
    limits,
    pipeline,
    reset,
    routes_of,
    shared,
)

__all__ = [
    "SETTINGS",
    "NanolimitConfig",
    "RateLimitMiddleware",
    "Ratelimited",
    "check_limits",
    "exempt",
    "limit",
    "limits",
    "pipeline",
    "reset",
    "routes_of",
    "shared",
]
