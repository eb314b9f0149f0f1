"""Django: the URLconf's routes, the app that registers nanolimit's system
checks, and the check that nanolimit's middleware is there at all.

Why: declarations (``@limit``), ``NANOLIMIT["DEFAULT"]`` and ``RULES`` are
enforced by ``nanolimit.django.RateLimitMiddleware`` alone. Without it in
``settings.MIDDLEWARE`` every one of them silently does nothing, and
``manage.py check`` used to say "no issues". So the missing middleware is
found twice: by the system check :func:`check_middleware` (registered by
:class:`NanolimitConfig` in ``ready()``: ``nanolimit.E004`` when something
would be enforced, ``nanolimit.W001`` when nothing is yet), and, for
servers that never run the checks (gunicorn, uvicorn), at the first request
of the process, which warns once (:class:`UnenforcedLimitWarning`). That
first-request look is armed again when ``MIDDLEWARE``, ``NANOLIMIT`` or
``ROOT_URLCONF`` change (``override_settings``), and costs nothing after.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Iterable, Mapping
from typing import Any

from django.apps import AppConfig  # type: ignore[import-untyped]
from django.conf import settings  # type: ignore[import-untyped]
from django.core import checks  # type: ignore[import-untyped]
from django.core.signals import request_started, setting_changed  # type: ignore[import-untyped]
from django.urls import URLPattern, URLResolver, get_resolver  # type: ignore[import-untyped]
from django.urls.resolvers import LocalePrefixPattern  # type: ignore[import-untyped]
from django.utils.module_loading import import_string  # type: ignore[import-untyped]

from ..errors import UnenforcedLimitWarning
from .routes import RouteInfo, declarations, view_class, view_name

__all__ = ["NanolimitConfig", "check_middleware", "routes_of", "unenforced"]

MIDDLEWARE = "nanolimit.django.RateLimitMiddleware"
_PATHS = frozenset({MIDDLEWARE, "nanolimit.gateway.django.RateLimitMiddleware"})
_HINT = f"add {MIDDLEWARE!r} to settings.MIDDLEWARE (or remove what declares limits)"
_UID = "nanolimit.django.unenforced"
_armed = threading.Lock()  # held while the first-request look is pending


# ---------------------------------------------------------------------------
# The URLconf


def _join(route1: str, route2: str) -> str:
    # as Django's URLResolver._join_route builds ResolverMatch.route
    if not route1:
        return route2
    return route1 + route2.removeprefix("^")


def _language_prefixes(pattern: Any) -> list[str]:
    """Every spelling of an ``i18n_patterns`` prefix in
    ``ResolverMatch.route``: ``str(pattern)`` is the prefix of the language
    active when the request is resolved (``fr/`` for ``/fr/...``, as
    ``LocaleMiddleware`` activates it), and ``""`` for the default language
    without ``prefix_default_language``. Read once, at bind time, it would
    name one language only, and every other prefix of the same view would
    escape its limit."""
    from django.utils.translation import to_language  # type: ignore[import-untyped]

    default = settings.LANGUAGE_CODE
    codes = [to_language(code) for code, _ in getattr(settings, "LANGUAGES", ())]
    codes += [default, to_language(default)]  # what get_language() falls back to
    out: list[str] = []
    for code in codes:
        # as LocalePrefixPattern.language_prefix spells it for that language
        prefix = "" if code == default and not pattern.prefix_default_language else f"{code}/"
        if prefix not in out:
            out.append(prefix)
    return out


def routes_of(resolver: Any = None) -> list[RouteInfo]:
    """Every view of the URLconf (``get_resolver()`` by default), nested
    ``include()``s joined, with templates spelt as ``ResolverMatch.route``
    spells them (``users/<int:id>/avatar``); a view under ``i18n_patterns``
    once per language prefix (``en/quota``, ``fr/quota``)."""
    root = get_resolver() if resolver is None else resolver
    out: list[RouteInfo] = []

    def walk(patterns: Iterable[Any], prefix: str) -> None:
        for p in patterns:
            if isinstance(p, URLResolver) and isinstance(p.pattern, LocalePrefixPattern):
                for language in _language_prefixes(p.pattern):
                    walk(p.url_patterns, _join(prefix, language))
                continue
            route = _join(prefix, str(p.pattern))
            if isinstance(p, URLResolver):
                walk(p.url_patterns, route)
            elif isinstance(p, URLPattern):
                # "" (a root view) is the template "/", as the request reports it
                out.append(RouteInfo(route or "/", frozenset(), p.callback))

    walk(root.url_patterns, "")
    return out


# ---------------------------------------------------------------------------
# A missing middleware


def _middleware_installed() -> bool:
    """Whether ``settings.MIDDLEWARE`` lists nanolimit's middleware (or a
    subclass of it: the class says ``nanolimit_middleware``)."""
    for entry in getattr(settings, "MIDDLEWARE", None) or ():
        if entry in _PATHS:
            return True
        try:
            cls = import_string(entry)
        except ImportError:
            continue  # Django reports that one itself
        if isinstance(cls, type) and getattr(cls, "nanolimit_middleware", False) is True:
            return True
    return False


def _what_is_declared() -> list[str]:
    """What the middleware would enforce: the views of the URLconf that
    declare limits, and the settings that give rules."""
    found: list[str] = []
    try:
        routes = routes_of()
    except Exception:  # noqa: BLE001 - a URLconf that does not import is Django's error to report
        routes = []
    for info in routes:
        view = info.endpoint
        if any(declarations(h) for h in (view, view_class(view)) if h is not None):
            name = view_name(view)
            if name not in found:
                found.append(name)
    conf = getattr(settings, "NANOLIMIT", None)
    if isinstance(conf, Mapping):
        found.extend(f"NANOLIMIT[{key!r}]" for key in ("DEFAULT", "RULES") if conf.get(key))
    return found


def _enabled() -> bool:
    conf = getattr(settings, "NANOLIMIT", None)
    return not (isinstance(conf, Mapping) and conf.get("ENABLED") is False)


def unenforced() -> str | None:
    """Why nothing nanolimit is given is enforced, or None: its middleware
    is not in ``settings.MIDDLEWARE`` while views declare limits or the
    settings give rules (``ENABLED: False`` is off on purpose)."""
    if not _enabled() or _middleware_installed():
        return None
    declared = _what_is_declared()
    if not declared:
        return None
    shown = ", ".join(declared[:5]) + (f" and {len(declared) - 5} more" if len(declared) > 5 else "")
    return (
        f"nanolimit: {shown} declare rate limits, but {MIDDLEWARE!r} is not in settings.MIDDLEWARE: "
        "nothing enforces them"
    )


def check_middleware(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """``manage.py check``: nanolimit is installed, and its middleware is
    missing. An error when views declare limits or ``NANOLIMIT`` gives
    rules (they would silently do nothing), a warning otherwise."""
    if not _enabled() or _middleware_installed():
        return []
    problem = unenforced()
    if problem is not None:
        return [checks.Error(problem, hint=_HINT, id="nanolimit.E004")]
    return [
        checks.Warning(
            f"nanolimit is installed, but {MIDDLEWARE!r} is not in settings.MIDDLEWARE: "
            "no limit declared or configured will be enforced",
            hint=_HINT,
            id="nanolimit.W001",
        )
    ]


def _first_request(sender: Any = None, **kwargs: Any) -> None:
    """The process's first request (since the settings changed): warn once
    if nothing enforces what is declared, then stop looking."""
    request_started.disconnect(dispatch_uid=_UID)
    try:
        _armed.release()
    except RuntimeError:
        return  # a racing thread's request looked already
    problem = unenforced()
    if problem is not None:
        warnings.warn(UnenforcedLimitWarning(problem + ". (Warned once.)"), stacklevel=2)


def _arm(**kwargs: Any) -> None:
    _armed.acquire(blocking=False)  # held already: armed already
    request_started.connect(_first_request, dispatch_uid=_UID)


def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("MIDDLEWARE", "NANOLIMIT", "ROOT_URLCONF"):
        _arm()


_arm()
setting_changed.connect(_on_setting_changed, dispatch_uid="nanolimit.django.unenforced.rearm")


class NanolimitConfig(AppConfig):  # type: ignore[misc]
    """``"nanolimit.django.NanolimitConfig"`` in ``INSTALLED_APPS``: loads
    nanolimit's Django module when Django starts, so the ``nanolimit``
    system checks run in ``manage.py check`` and ``runserver`` (listed in
    ``MIDDLEWARE`` alone, it is imported only when the first handler
    loads), the check for a missing middleware among them."""

    name = "nanolimit.django"
    label = "nanolimit"
    verbose_name = "nanolimit rate limits"
    default = True

    def ready(self) -> None:
        checks.register(check_middleware, "nanolimit")
