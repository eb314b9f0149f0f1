"""Django, the Django way: a ``settings.MIDDLEWARE`` class configured from
``settings.NANOLIMIT``, view decorators (function and class-based views),
``request.user`` as the user scope, and a system check.

Why ``process_view``: by then Django has resolved the URL, so the request
carries its route template (``request.resolver_match.route``), the view
(with ``view_class`` for class-based views) and, whatever the middleware
order, the user that ``AuthenticationMiddleware`` attached. The decision is
the pipeline's (:meth:`nanolimit.gateway.middleware.RateLimitPipeline.check`), one
per request, on one pipeline per process: this module builds it once from
the settings and shares it between threads and between the sync and async
handlers. A request that never reaches a view (a 404 from the resolver, a
response from a middleware after this one) is decided after its response,
with the route its path resolves to, so a flood of unknown paths spends
budget too, and a view's limit covers what such a middleware answers for
it; its denial replaces the response.

Declarations (:func:`limit`, :func:`shared`, :func:`exempt`) go to one
module-level :class:`~nanolimit.gateway.routes.RouteLimits` (or the one the
``LIMITS`` setting names) and become ordinary rules when the URLconf is
bound: on the first request, and in the ``nanolimit`` system check, so a
route template that matches no URL fails ``manage.py check`` and
``runserver`` at startup (list ``NanolimitConfig`` in ``INSTALLED_APPS``
for the check to be registered before Django runs it). A missing
middleware is caught there too, and at the first request
(:mod:`nanolimit.gateway.django_checks`).

Async: in-process stores answer in microseconds and are called in-line on
the event loop; a network store (Redis, the two-tier store) is called
through ``sync_to_async(thread_sensitive=False)``, so the loop never waits
on a socket.
"""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from asgiref.sync import async_to_sync, iscoroutinefunction, markcoroutinefunction, sync_to_async
from django.conf import settings  # type: ignore[import-untyped]
from django.core import checks  # type: ignore[import-untyped]
from django.core.exceptions import (  # type: ignore[import-untyped]
    ImproperlyConfigured,
    MiddlewareNotUsed,
    PermissionDenied,
)
from django.core.signals import setting_changed  # type: ignore[import-untyped]
from django.http import HttpResponse  # type: ignore[import-untyped]
from django.urls import Resolver404, resolve  # type: ignore[import-untyped]
from django.utils.module_loading import import_string  # type: ignore[import-untyped]

from .._limiter_config import Algorithm
from .._protocols import Storage
from ..errors import ValidationError
from .django_checks import NanolimitConfig, routes_of
from .factory import LimiterFactory
from .headers import RATE_HEADERS
from .keys import DefaultKeyExtractor
from .middleware import DICT, WSGI_PAIRS, CostTooHigh, Outcome, render_body
from .middleware import RateLimitPipeline as Pipeline
from .registry import RuleSet
from .request import Request
from .routes import Limit, RouteLimits, refuse_foreign
from .rules import KeyScope, RateLimitRule
from .wsgi import _EnvironHeaders

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

T = TypeVar("T")

#: The keys of ``settings.NANOLIMIT`` and their defaults.
SETTINGS: Mapping[str, Any] = {
    "RULES": None,  # a rules file (TOML or JSON)
    "STORAGE": None,  # a storage URI (or a Storage); None: in memory, this process
    "DEFAULT": None,  # a rate or a rate list for requests no rule covers
    "SCOPE": "ip",  # the default scope of DEFAULT and of declarations
    "ALGORITHM": "token_bucket",
    "HEADERS": True,
    "HEADER_NAMES": None,
    "TRUSTED_PROXIES": (),
    "DENY": None,  # dotted path to callable(request, outcome) -> HttpResponse
    "RAISE": False,  # raise Ratelimited (a PermissionDenied): handler403 answers
    "ON_BREACH": None,  # dotted path to callable(nanolimit Request, outcome)
    "LOG_DENIALS": 1.0,
    "ENABLED": True,
    "LIMITS": None,  # dotted path to a RouteLimits of your own
}

# the outcome of a request, kept on Django's request between the hooks
_ATTR = "_nanolimit_outcome"
_DENIED = "_nanolimit_denied"
_USER = "_nanolimit_user"
_ROUTE = "_nanolimit_route"  # the route of a request no view was resolved for
_UNDECIDED: Any = object()
# stores whose operations cross the network: the async path calls them in a thread
_NETWORK_MODULES = ("nanolimit.storage.redis", "nanolimit.storage.two_tier")

#: The declarations of every app that does not name its own ``LIMITS``.
limits = RouteLimits()
limits.guards = False  # a missing middleware is found from the settings (django_checks)


class Ratelimited(PermissionDenied):  # type: ignore[misc]
    """Raised instead of answering 429 when ``NANOLIMIT["RAISE"]`` is true. A
    ``PermissionDenied``, as django-ratelimit's is, so the app's
    ``handler403`` (or a middleware of its own that catches it) answers;
    ``outcome`` is the pipeline's answer (rule, ``retry_after``, headers)."""

    def __init__(self, outcome: Outcome) -> None:
        super().__init__(f"rate limit exceeded: rule {outcome.rule!r}")
        self.outcome = outcome


# ---------------------------------------------------------------------------
# Settings


def _bad(key: str, message: str) -> ImproperlyConfigured:
    return ImproperlyConfigured(f"NANOLIMIT[{key!r}]: {message}")


def _callable(key: str, value: Any) -> Callable[..., Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = import_string(value)
        except ImportError as exc:
            raise _bad(key, f"cannot import {value!r}: {exc}") from None
    if not callable(value):
        raise _bad(key, f"must be a dotted path to a callable, got {value!r}")
    return value  # type: ignore[no-any-return]


@dataclass(frozen=True)
class _Config:
    """``settings.NANOLIMIT``, checked: every fault an ``ImproperlyConfigured``
    naming the key, raised when the middleware loads (at startup)."""

    rules: str | None
    storage: Any
    default: tuple[str, ...] | str | None
    scope: KeyScope
    algorithm: Algorithm
    headers: bool
    header_names: dict[str, str]
    trusted_proxies: tuple[str, ...]
    deny: Callable[..., Any] | None
    raise_: bool
    on_breach: Callable[..., Any] | None
    log_denials: float | None
    enabled: bool
    limits: RouteLimits | None

    @classmethod
    def read(cls) -> _Config:
        raw = getattr(settings, "NANOLIMIT", None)
        if raw is None:
            raw = {}
        if not isinstance(raw, Mapping):
            raise ImproperlyConfigured(f"settings.NANOLIMIT must be a dict, got {type(raw).__name__}")
        unknown = sorted(str(k) for k in raw if k not in SETTINGS)
        if unknown:
            raise ImproperlyConfigured(
                f"settings.NANOLIMIT: unknown key(s) {', '.join(map(repr, unknown))}; "
                f"accepted: {', '.join(SETTINGS)}"
            )
        conf = {**SETTINGS, **raw}
        rules = conf["RULES"]
        if rules is not None and not isinstance(rules, (str, os.PathLike)):
            raise _bad("RULES", f"must be the path of a rules file or None, got {rules!r}")
        storage = conf["STORAGE"]
        if storage is not None and not isinstance(storage, (str, Storage)):
            # its type only: a tuple (a trailing comma) or bytes still holds the URI's password
            raise _bad(
                "STORAGE",
                f"must be a storage URI (e.g. 'redis://host/0') or None, got {type(storage).__name__}",
            )
        default = conf["DEFAULT"]
        if default is not None:
            if isinstance(default, str):
                pass
            elif isinstance(default, Sequence) and default and all(isinstance(r, str) for r in default):
                default = tuple(default)
            else:
                raise _bad(
                    "DEFAULT", f"must be a rate ('100/minute'), a list of rates or None, got {default!r}"
                )
        try:
            scope = KeyScope(conf["SCOPE"])
        except ValueError:
            known = ", ".join(s.value for s in KeyScope)
            raise _bad("SCOPE", f"unknown scope {conf['SCOPE']!r}; expected one of: {known}") from None
        try:
            algorithm = Algorithm.parse(conf["ALGORITHM"])
        except ValidationError as exc:
            raise _bad("ALGORITHM", str(exc)) from None
        for key in ("HEADERS", "RAISE", "ENABLED"):
            if not isinstance(conf[key], bool):
                raise _bad(key, f"must be True or False, got {conf[key]!r}")
        names = conf["HEADER_NAMES"] or {}
        if not isinstance(names, Mapping):
            raise _bad("HEADER_NAMES", f"must be a dict of header renames, got {names!r}")
        proxies = conf["TRUSTED_PROXIES"] or ()
        if isinstance(proxies, str) or not all(isinstance(p, str) for p in proxies):
            raise _bad("TRUSTED_PROXIES", f"must be a list of networks ('10.0.0.0/8'), got {proxies!r}")
        log = conf["LOG_DENIALS"]
        if log is not None and (isinstance(log, bool) or not isinstance(log, (int, float)) or not log >= 0):
            raise _bad("LOG_DENIALS", f"must be seconds >= 0 between records, or None, got {log!r}")
        deny = _callable("DENY", conf["DENY"])
        if deny is not None and conf["RAISE"]:
            raise _bad("RAISE", "give DENY or RAISE, not both: each decides what a denial answers")
        own = conf["LIMITS"]
        if isinstance(own, str):
            try:
                own = import_string(own)
            except ImportError as exc:
                raise _bad("LIMITS", f"cannot import {own!r}: {exc}") from None
        if own is not None and not isinstance(own, RouteLimits):
            raise _bad("LIMITS", f"must name a nanolimit RouteLimits, got {own!r}")
        return cls(
            None if rules is None else os.fspath(rules),
            storage,
            default,
            scope,
            algorithm,
            conf["HEADERS"],
            {str(k): v for k, v in names.items()},
            tuple(proxies),
            deny,
            conf["RAISE"],
            _callable("ON_BREACH", conf["ON_BREACH"]),
            None if log is None else float(log),
            conf["ENABLED"],
            own,
        )

    def default_rules(self) -> tuple[RateLimitRule, ...]:
        """DEFAULT as rules: one rate is the registry's default; a list is
        one group of ``/`` rules, decided together (every route, all or
        nothing), which any more specific rule replaces as a default would."""
        if self.default is None:
            return ()
        try:
            declared = limits.limit(self.default, scope=self.scope, algorithm=self.algorithm)
        except ValidationError as exc:
            raise _bad("DEFAULT", str(exc)) from None
        return tuple(declared.rules("default", ()))


# ---------------------------------------------------------------------------
# The one pipeline of the process


class _Live:
    """What the settings built: the pipeline, the declarations it binds,
    and how denials are answered."""

    def __init__(self, conf: _Config) -> None:
        self.conf = conf
        self.limits = conf.limits if conf.limits is not None else limits
        registry = self.limits.registry
        defaults = conf.default_rules()
        loaded = None
        if conf.rules is not None:
            from .config import load_rules

            try:
                loaded = load_rules(conf.rules)
            except ValidationError as exc:
                raise _bad("RULES", str(exc)) from None
            if defaults and loaded.default is not None:
                raise _bad("DEFAULT", f"{conf.rules} has a [default] already: give one of them")
            if loaded.storage is not None and conf.storage is not None:
                raise _bad("STORAGE", f"{conf.rules} has a [storage] section already: give one of them")
        rules: tuple[RateLimitRule, ...] = loaded.rules if loaded is not None else ()
        default = loaded.default if loaded is not None else None
        if len(defaults) == 1:
            default = defaults[0]
        elif defaults:
            rules = (*rules, *defaults)
        try:
            if loaded is not None and loaded.storage is not None:
                factory = loaded.factory()
            else:
                factory = LimiterFactory(conf.storage)
        except ValidationError as exc:
            raise _bad("STORAGE" if conf.storage is not None else "RULES", str(exc)) from None
        try:
            extractor = DefaultKeyExtractor(user_id=_lazy_user, trusted_proxies=conf.trusted_proxies)
        except ValidationError as exc:
            raise _bad("TRUSTED_PROXIES", str(exc)) from None
        try:
            self.core = Pipeline(
                registry,
                factory,
                extractor,
                headers=conf.headers,
                header_names=conf.header_names,
                on_breach=conf.on_breach,
                log_denials=conf.log_denials,
            )
        except ValidationError as exc:
            raise _bad("HEADER_NAMES", str(exc)) from None  # the one check left to the pipeline
        # last, once everything else stood: a bad setting changes no registry
        if conf.limits is None or loaded is not None or defaults:
            # our own registry always follows the settings; one you pass
            # keeps its rules unless RULES or DEFAULT replace them
            # known_routes: bound to this URLconf's routes by _bind, which
            # names a rule whose route it lacks (the system check's E002)
            replace: dict[str, Any] = {
                "default": default,
                "exempt": getattr(loaded, "exempt", ()),
                "known_routes": None,
            }
            if loaded is not None:
                replace["stacked"] = loaded.stacked
            try:
                registry.replace(rules, **replace)
            except ValidationError as exc:
                raise _bad("RULES" if loaded is not None else "DEFAULT", str(exc)) from None
        storage = factory.storage
        self.network = any(type(storage).__module__.startswith(m) for m in _NETWORK_MODULES)
        # the native lane's headers as (name, value) pairs, written into the
        # response as they are; a dict where a DENY hook or a handler403
        # (RAISE) reads ``outcome.headers``
        self.form = WSGI_PAIRS if conf.deny is None and not conf.raise_ else DICT
        self.bound = False
        self._users: tuple[RuleSet | None, bool] = (None, False)

    def needs_user(self) -> bool:
        """Does any rule read the user (a user scope, or tiers)? Only then
        does the async path read ``await request.auser()`` before deciding
        (the sync path reads ``request.user`` when a rule asks for it)."""
        ruleset = self.core.registry.ruleset
        seen = self._users
        if seen[0] is not ruleset:
            every = ruleset.rules if ruleset.default is None else (*ruleset.rules, ruleset.default)
            seen = (ruleset, ruleset.has_tiers or any(r.scope is KeyScope.USER for r in every))
            self._users = seen
        return seen[1]


_lock = threading.RLock()
_live: _Live | None = None


def _state() -> _Live:
    live = _live
    if live is None:
        with _lock:
            live = _live
            if live is None:
                live = _build()
    if not live.bound:
        _bind(live)
    return live


def _build() -> _Live:
    global _live
    live = _Live(_Config.read())
    _live = live
    return live


def _bind(live: _Live) -> None:
    """Turn the declarations on the URLconf's views into rules (once per
    pipeline: a rebuilt one, under ``override_settings``, binds afresh)."""
    with _lock:
        if live.bound:
            return
        routes = routes_of()
        with live.limits._lock:
            live.limits.bound = False  # this pipeline's URLconf: declare again
        live.limits.bind(routes)
        live.bound = True


def pipeline() -> Pipeline:
    """The process's pipeline (built from the settings on first use): its
    ``metrics``, its ``registry``, its ``factory``."""
    return _state().core


def reset() -> None:
    """Forget the pipeline: the next request builds it from the settings
    again, with fresh state on an in-memory store. ``override_settings`` of
    ``NANOLIMIT`` or ``ROOT_URLCONF`` does this by itself."""
    global _live
    with _lock:
        _live = None


def _on_setting_changed(*, setting: str, **kwargs: Any) -> None:
    if setting in ("NANOLIMIT", "ROOT_URLCONF"):
        reset()


setting_changed.connect(_on_setting_changed, dispatch_uid="nanolimit.django.reset")


# ---------------------------------------------------------------------------
# Declarations


def _defaults(options: dict[str, Any]) -> dict[str, Any]:
    """SCOPE and ALGORITHM as the defaults of a declaration, when the
    settings are loaded (a project's views are imported after them)."""
    if settings.configured:
        conf = getattr(settings, "NANOLIMIT", None) or {}
        if isinstance(conf, Mapping):
            if options.get("scope") is None and conf.get("SCOPE") is not None:
                options["scope"] = conf["SCOPE"]
            if options.get("algorithm") is None and conf.get("ALGORITHM") is not None:
                options["algorithm"] = conf["ALGORITHM"]
    return options


def limit(
    rate: str | Sequence[str],
    *,
    scope: KeyScope | str | None = None,
    algorithm: Algorithm | str | None = None,
    cost: int | Callable[[Any], int] = 1,
    count_when: Iterable[int] | Callable[[int], bool] | None = None,
    methods: str | Sequence[str] | None = None,
    dry_run: bool = False,
    tier: str | None = None,
    shape: bool = True,
    name: str | None = None,
    key: Callable[[Any], str] | None = None,
    **foreign: Any,
) -> Limit:
    """``@limit("5/minute")`` on a function view, a class-based view (the
    class, or ``limit(...)(View.as_view())`` in ``urls.py``): see
    :meth:`nanolimit.gateway.routes.RouteLimits.limit`. ``cost(request)``
    gets nanolimit's :class:`Request`; Django's request is its ``native``.
    ``key(request) -> str`` is handed Django's ``HttpRequest``."""
    if foreign:
        refuse_foreign("limit()", foreign)
    options = _defaults({"scope": scope, "algorithm": algorithm})
    return limits.limit(
        rate,
        scope=options["scope"],
        algorithm=options["algorithm"],
        cost=cost,
        count_when=count_when,
        methods=methods,
        dry_run=dry_run,
        tier=tier,
        shape=shape,
        name=name,
        key=key,
    )


def shared(rate: str | Sequence[str], *, name: str, **options: Any) -> Limit:
    """One budget, ``name``, spent by every view it decorates."""
    return limits.shared(rate, name=name, **_defaults(options))


def exempt(target: T) -> T:
    """No limit at all for the views of ``target`` (not even ``DEFAULT``)."""
    return limits.exempt(target)


# ---------------------------------------------------------------------------
# The middleware


def _user_id(user: Any) -> str | None:
    if user is None or not getattr(user, "is_authenticated", False):
        return None
    pk = getattr(user, "pk", None)
    return None if pk is None else str(pk)


def _lazy_user(request: Request) -> str | None:
    """The extractor's user: read from Django's ``request.user`` only when a
    rule asks for it (reading it may load the session and the user), once
    per request, and kept in ``Request.user`` for the hooks."""
    user = request.user
    if user is not None:
        return user
    native = request.native
    user = getattr(native, _USER, _UNDECIDED)
    if user is _UNDECIDED:
        user = _user_id(getattr(native, "user", None))
        setattr(native, _USER, user)
    request.user = user
    return user


# ``request.META`` is a WSGI environ (or ASGI's translation of one): its
# ``HTTP_*`` keys are read through the WSGI adapter's lazy header view, one
# at a time (``request.headers`` would copy every header of every request).
_MetaHeaders = _EnvironHeaders


def _route(request: Any) -> str | None:
    """The route template of Django's ``request``: the one it was resolved
    to, or, for a request that never reached ``process_view`` (a
    middleware after nanolimit's answered it: an API-key check's 401, a
    maintenance 503), the one its path resolves to, looked up once. Left
    unknown, such a request spent ``DEFAULT`` alone, so a view's limit
    (say, on failed logins) never saw the requests the middleware answered.
    None: the path resolves to no view (a 404)."""
    match = getattr(request, "resolver_match", None)
    if match is not None:
        return match.route or "/"
    route = getattr(request, _ROUTE, _UNDECIDED)
    if route is _UNDECIDED:
        try:
            found = resolve(request.path_info, getattr(request, "urlconf", None))
        except Resolver404:
            found = None
        route = None if found is None else found.route or "/"
        setattr(request, _ROUTE, route)
    return route  # type: ignore[no-any-return]


def _request(request: Any, user: str | None = None) -> Request:
    return Request(
        request.method or "GET",
        request.path,
        _MetaHeaders(request.META),
        request.META.get("REMOTE_ADDR") or None,
        user if user is not None else getattr(request, _USER, None),  # read already: async, or a rule
        route=_route(request),
        native=request,
    )


def _decide(live: _Live, request: Any) -> Outcome | None:
    """The pipeline's decision on Django's ``request``: from its method,
    path, peer and route, a Request built only if a rule needs one."""
    return live.core.decide(
        request,
        request.method or "GET",
        request.path,
        request.META.get("REMOTE_ADDR") or None,
        _route(request),
        _request,
        live.form,
    )


def _json_denial(outcome: Outcome) -> Any:
    decision = outcome.decision
    body = (
        decision.body(outcome.rule)
        if type(decision) is CostTooHigh
        else render_body(outcome.rule, outcome.retry_after)
    )
    response = HttpResponse(body, status=429, content_type="application/json")
    _set_headers(response, outcome.headers)
    # nanolimit's denial log (one record per rule per interval) has it:
    # django.request need not log every 429 of a flood again
    response._has_been_logged = True
    return response


def _header_store() -> bool:
    """Whether Django's response headers are the ``_store`` of ``lower
    name -> (name, value)`` that they read: then headers nanolimit rendered
    (and checked) go straight in, not through the charset checks Django
    makes of each value (~7,000 instructions a header)."""
    try:
        from django.http.response import ResponseHeaders  # type: ignore[import-untyped]

        headers = ResponseHeaders({"A": "1"})
        headers._store["b"] = ("B", "2")
        return headers["b"] == "2" and list(headers.items()) == [("A", "1"), ("B", "2")]
    except Exception:  # noqa: BLE001 - another Django: its public API, then
        return False


class _Lower(dict[str, str]):
    """Header name -> its store key: nanolimit's own names looked up, any
    other (a rename) lower-cased."""

    def __missing__(self, name: str) -> str:
        return name.lower()


_STORE = _header_store()
_LOWER = _Lower({name: name.lower() for name in (*RATE_HEADERS, "Retry-After")})
_Headers = Mapping[str, str] | list[tuple[str, str]]


def _set_headers(response: Any, headers: _Headers) -> None:
    """An outcome's headers on Django's response: the lane's pairs (or a
    dict's items) straight into the header store, each pair the
    ``(name, value)`` the store keeps."""
    store = response.headers._store if _STORE else None
    if type(store) is not dict:
        for name, value in headers if isinstance(headers, list) else headers.items():
            response[name] = value
        return
    lower = _LOWER
    if isinstance(headers, list):
        for pair in headers:
            store[lower[pair[0]]] = pair
        return
    for name, value in headers.items():
        store[lower[name]] = (name, value)


def _add_missing(response: Any, headers: _Headers) -> None:
    for name, value in headers if isinstance(headers, list) else headers.items():
        if name not in response:
            response[name] = value


def _finish(request: Any, response: Any, outcome: Outcome) -> Any:
    """The admitted outcome's headers on the response (settled first by the
    caller); a ``Ratelimited`` answered by handler403 still says when to
    come back."""
    if outcome.allowed:
        _set_headers(response, outcome.headers)
    elif getattr(request, _DENIED, None) is outcome:
        _add_missing(response, outcome.headers)
    return response


class RateLimitMiddleware:
    """``"nanolimit.django.RateLimitMiddleware"`` in ``settings.MIDDLEWARE``.

    Sync and async (Django picks the mode of the chain it sits in): the
    decision is in ``process_view``; the response gets the headers, and its
    status settles ``count_when`` rules, in ``__call__``: the status Django
    sends, so a view that raised is settled by the 500 (or the 403, 404 or
    400 of the exceptions Django maps) it answers, and no
    ``process_exception`` is needed. Settings problems are
    ``ImproperlyConfigured`` when Django loads the middleware; ``ENABLED:
    False`` takes it out of the chain (``MiddlewareNotUsed``).
    """

    sync_capable = True
    async_capable = True
    #: what the missing-middleware check looks for (django_checks), subclasses included
    nanolimit_middleware = True

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response
        with _lock:
            live = _live if _live is not None else _build()
        if not live.conf.enabled:
            live.limits.enforced = True  # off on purpose: not a limit silently missing
            raise MiddlewareNotUsed("NANOLIMIT['ENABLED'] is False")
        self.is_async = iscoroutinefunction(get_response)
        if self.is_async:
            markcoroutinefunction(self)
            # Django awaits a coroutine process_view in its async handler
            self.process_view = self._aprocess_view  # type: ignore[method-assign]

    # -- sync ---------------------------------------------------------------
    def __call__(self, request: Any) -> Any:
        if self.is_async:
            return self.__acall__(request)
        try:
            response = self.get_response(request)
        except BaseException:
            # Django turns a view's exception into its 500 (or 403, 404, 400)
            # response, which is settled below; one that still propagates
            # (DEBUG_PROPAGATE_EXCEPTIONS) is a 500 that never went out
            self._settle_raised(request)
            raise
        outcome = getattr(request, _ATTR, _UNDECIDED)
        if outcome is _UNDECIDED:  # never reached a view: decide now
            live = _state()
            outcome = _decide(live, request)
            if outcome is not None and not outcome.allowed:
                setattr(request, _ATTR, outcome)
                return self._deny(live, request, outcome)
        if outcome is None:
            return response
        if outcome.charge is not None:
            _state().core.settle(outcome, response.status_code)
        headers = outcome.headers
        if type(headers) is list and outcome.allowed and _STORE:
            # _set_headers in line, unrolled: the lane's five pairs come in
            # RATE_HEADERS' order (tests/test_django_limiter.py holds it to
            # that), each the (name, value) the header store keeps
            store = response.headers._store
            if type(store) is dict and len(headers) == 5:
                limit, remaining, reset, policy, rate = headers
                store["x-ratelimit-limit"] = limit
                store["x-ratelimit-remaining"] = remaining
                store["x-ratelimit-reset"] = reset
                store["ratelimit-policy"] = policy
                store["ratelimit"] = rate
                return response
        return _finish(request, response, outcome)

    def process_view(self, request: Any, view: Any, args: Any, kwargs: Any) -> Any:
        live = _live
        if live is None or not live.bound:
            live = _state()
        # _decide in line: Django has resolved the request by now
        match = request.resolver_match
        try:
            outcome = live.core.decide(
                request,
                request.method or "GET",
                request.path,
                request.META.get("REMOTE_ADDR") or None,
                match.route or "/",
                _request,
                live.form,
            )
        except BaseException:
            # what a key function raised becomes Django's answer: __call__
            # must not decide again (the function would run twice, and the
            # error be logged twice)
            request._nanolimit_outcome = None
            raise
        request._nanolimit_outcome = outcome  # _ATTR
        if outcome is None:
            return None
        if not outcome.allowed:
            return self._deny(live, request, outcome)
        if outcome.delay > 0.0:
            time.sleep(outcome.delay)
        return None

    def _deny(self, live: _Live, request: Any, outcome: Outcome) -> Any:
        conf = live.conf
        if conf.raise_:
            setattr(request, _DENIED, outcome)
            raise Ratelimited(outcome)
        if conf.deny is not None:
            deny = conf.deny
            response = (async_to_sync(deny) if iscoroutinefunction(deny) else deny)(request, outcome)
            _add_missing(response, outcome.headers)
            return response
        return _json_denial(outcome)

    # -- async --------------------------------------------------------------
    async def __acall__(self, request: Any) -> Any:
        try:
            response = await self.get_response(request)
        except BaseException:
            await sync_to_async(self._settle_raised, thread_sensitive=False)(request)
            raise
        outcome = getattr(request, _ATTR, _UNDECIDED)
        if outcome is _UNDECIDED:
            live = _state()
            outcome = await self._acheck(live, request)
            if outcome is not None and not outcome.allowed:
                setattr(request, _ATTR, outcome)
                return await self._adeny(live, request, outcome)
        if outcome is None:
            return response
        if outcome.charge is not None:
            live = _state()
            if live.network:  # a refund crosses the network too
                await sync_to_async(live.core.settle, thread_sensitive=False)(outcome, response.status_code)
            else:
                live.core.settle(outcome, response.status_code)
        return _finish(request, response, outcome)

    async def _acheck(self, live: _Live, request: Any) -> Outcome | None:
        user = None
        if live.needs_user():  # read before deciding: the loop must not touch the database
            auser = getattr(request, "auser", None)  # Django 5's async user
            if auser is not None:
                user = _user_id(await auser())
            elif hasattr(request, "user"):
                user = await sync_to_async(_user_id)(request.user)
            setattr(request, _USER, user)
        if live.network:
            req = _request(request, user)
            return await sync_to_async(live.core.check, thread_sensitive=False)(req)
        return _decide(live, request)  # the user read above is on the request

    async def _aprocess_view(self, request: Any, view: Any, args: Any, kwargs: Any) -> Any:
        live = _state()
        try:
            outcome = await self._acheck(live, request)
        except BaseException:
            # as in process_view: Django answers what the key function
            # raised, and __acall__ must not decide (and run it) again
            setattr(request, _ATTR, None)
            raise
        setattr(request, _ATTR, outcome)
        if outcome is None:
            return None
        if not outcome.allowed:
            return await self._adeny(live, request, outcome)
        if outcome.delay > 0.0:
            await asyncio.sleep(outcome.delay)
        return None

    async def _adeny(self, live: _Live, request: Any, outcome: Outcome) -> Any:
        conf = live.conf
        if conf.raise_:
            setattr(request, _DENIED, outcome)
            raise Ratelimited(outcome)
        if conf.deny is not None:
            deny = conf.deny
            response = await deny(request, outcome) if iscoroutinefunction(deny) else deny(request, outcome)
            _add_missing(response, outcome.headers)
            return response
        return _json_denial(outcome)

    @staticmethod
    def _settle_raised(request: Any) -> None:
        outcome = getattr(request, _ATTR, None)
        if outcome is not None and outcome.charge is not None:
            _state().core.settle(outcome, 500)


# ---------------------------------------------------------------------------
# The system check (the app that registers it at startup, and the check
# for a missing middleware, are in django_checks)


def check_limits(app_configs: Any = None, **kwargs: Any) -> list[Any]:
    """``manage.py check`` (and ``runserver``, before it serves): the
    settings, and every declaration bound to the URLconf; a route template
    that matches no URL is an error naming the rule."""
    from ..errors import RuleValidationError

    try:
        live = _state()
    except ImproperlyConfigured as exc:
        return [checks.Error(str(exc), id="nanolimit.E001")]
    except RuleValidationError as exc:
        return [
            checks.Error(
                str(exc),
                hint="fix the rule's routes: every template must match a URL of the URLconf",
                obj=exc.rule,
                id="nanolimit.E002",
            )
        ]
    except ValidationError as exc:
        return [checks.Error(f"a nanolimit declaration: {exc}", id="nanolimit.E003")]
    del live
    return []


checks.register(check_limits, "nanolimit")
