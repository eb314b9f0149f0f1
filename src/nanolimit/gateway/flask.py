"""Flask, the Flask way: ``Limiter(app)`` or ``limiter.init_app(app)``,
``RATELIMIT_*`` config, limits declared on views, ``MethodView`` classes and
blueprints, exempt routes, counting by response, and denials the app's own
error handlers answer.

Why an extension and not the WSGI middleware: Flask routes a request before
its ``before_request`` hooks run, so the matched template
(``request.url_rule.rule``) is known, and limits declared next to routes
(:mod:`nanolimit.gateway.routes`) match it directly; a denial raised as an
HTTP error reaches ``@app.errorhandler(429)``; and the status a
count-by-response rule settles on is the one the response starts with, after
the app's own ``after_request`` hooks (headers and settlement are written in
a ``wsgi_app`` wrapper, :class:`_Answers`). The decision itself is the
pipeline's (:meth:`RateLimitPipeline.decide`), the one every front end
shares.

Each app has its own state (``app.extensions["nanolimit"]``): its config, its
ruleset, its storage and its pipeline, so one ``Limiter`` serves the apps of
an application factory. Declarations live on the views, and become rules of
each app when that app's route table is read: on its first request, or at
:meth:`Limiter.check_routes`, which an app factory calls last so that a rule
naming a route the app lacks fails at startup.
"""

from __future__ import annotations

import contextvars
import importlib
import inspect
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeVar

from flask import Flask, after_this_request, current_app, has_app_context, request_started
from flask import request as flask_request
from flask.wrappers import Response as FlaskResponse
from werkzeug.exceptions import TooManyRequests

from .._limiter_config import Algorithm
from .._protocols import Storage
from ..errors import UnenforcedLimitWarning, ValidationError
from .config import load_rules
from .factory import LimiterFactory
from .headers import RATE_HEADERS
from .keys import DefaultKeyExtractor
from .metrics import Metrics
from .middleware import WSGI_PAIRS, Outcome, RateLimitPipeline
from .rates import parse_rates, rate_rule_name
from .registry import ExemptRoute, RuleRegistry, RuleSet
from .request import Request
from .routes import Limit, RouteInfo, RouteLimits, declarations, refuse_foreign, view_name
from .rules import KeyScope, RateLimitRule
from .wsgi import _status_code

__all__ = ["CONFIG_KEYS", "Limiter", "RateLimitExceeded"]

T = TypeVar("T")

#: Every ``RATELIMIT_*`` key :meth:`Limiter.init_app` reads; any other is an error.
CONFIG_KEYS = (
    "RATELIMIT_ALGORITHM",
    "RATELIMIT_DEFAULT",
    "RATELIMIT_ENABLED",
    "RATELIMIT_HEADERS_ENABLED",
    "RATELIMIT_HEADER_NAMES",
    "RATELIMIT_RULES",
    "RATELIMIT_SCOPE",
    "RATELIMIT_STORAGE_URI",
    "RATELIMIT_TRUSTED_PROXIES",
)
# flask-limiter's spellings, so a migrating config is told what to write
_RENAMED = {
    "RATELIMIT_STORAGE_URL": "RATELIMIT_STORAGE_URI",
    "RATELIMIT_STRATEGY": "RATELIMIT_ALGORITHM",
    "RATELIMIT_DEFAULTS": "RATELIMIT_DEFAULT",
    "RATELIMIT_APPLICATION": "RATELIMIT_DEFAULT",
}
# the constructor argument each key stands for (an explicit argument wins)
_ARGUMENTS = {
    "RATELIMIT_ALGORITHM": "algorithm",
    "RATELIMIT_DEFAULT": "default_limits",
    "RATELIMIT_HEADERS_ENABLED": "headers",
    "RATELIMIT_HEADER_NAMES": "header_names",
    "RATELIMIT_RULES": "rules",
    "RATELIMIT_SCOPE": "key_scope",
    "RATELIMIT_STORAGE_URI": "storage",
    "RATELIMIT_TRUSTED_PROXIES": "trusted_proxies",
}
EXTENSION = "nanolimit"
log = logging.getLogger("nanolimit.flask")
DEFAULT_RULE = "default_limit"

# flask-login is optional: its current_user is the user scope's id when present
_flask_login: Any
try:
    _flask_login = importlib.import_module("flask_login")
except ImportError:  # pragma: no cover - the test extra installs it
    _flask_login = None

# the app's scope and algorithm while its declarations become rules (see _FlaskLimit)
_APP_DEFAULTS: contextvars.ContextVar[tuple[KeyScope, Algorithm] | None] = contextvars.ContextVar(
    "nanolimit_flask_defaults", default=None
)


class RateLimitExceeded(TooManyRequests):
    """A request the limiter refused: an ``HTTPException`` (429), so the
    app's ``@app.errorhandler(429)`` or ``errorhandler(RateLimitExceeded)``
    answers it. ``outcome`` is the pipeline's :class:`Outcome` (the rule,
    ``retry_after``, the headers). Unhandled, it answers the docs/spec.md §2
    JSON body with the rate-limit headers and ``Retry-After``."""

    def __init__(self, outcome: Outcome) -> None:
        self.outcome = outcome
        retry = outcome.retry_after
        super().__init__(
            f"rate limit exceeded (rule {outcome.rule!r})", retry_after=retry if retry > 0 else None
        )

    def get_response(self, environ: Any = None, scope: Any = None) -> FlaskResponse:
        cls = current_app.response_class if has_app_context() else FlaskResponse
        return cls(self.outcome.body(), 429, dict(self.outcome.headers), mimetype="application/json")


@dataclass(frozen=True)
class _FlaskLimit(Limit):
    """A declaration made through a :class:`Limiter`: it remembers whether
    its scope and algorithm were given, so one left out takes each app's
    ``RATELIMIT_SCOPE`` / ``RATELIMIT_ALGORITHM`` (the decorator runs at
    import, before any app's config is read)."""

    inherit_scope: bool = False
    inherit_algorithm: bool = False

    def rules(
        self, base: str, routes: tuple[str, ...], methods: tuple[str, ...] | None = None
    ) -> list[RateLimitRule]:
        app = _APP_DEFAULTS.get()
        target: Limit = self
        if app is not None and (self.inherit_scope or self.inherit_algorithm):
            target = replace(
                self,
                scope=app[0] if self.inherit_scope else self.scope,
                algorithm=app[1] if self.inherit_algorithm else self.algorithm,
                inherit_scope=False,
                inherit_algorithm=False,
            )
        return Limit.rules(target, base, routes, methods)


class _AppRoutes(RouteLimits):
    """One app's binding: the Limiter's declarations (read through
    ``declared``, which owns them) made rules of this app's registry, with
    the app's defaults and its default limits."""

    def __init__(
        self,
        declared: RouteLimits,
        registry: RuleRegistry,
        scope: KeyScope,
        algorithm: Algorithm,
        defaults: Sequence[RateLimitRule],
    ) -> None:
        super().__init__(registry, scope=scope, algorithm=algorithm)
        self.declared = declared
        self.defaults = tuple(defaults)

    def rules_for(self, routes: Iterable[RouteInfo]) -> tuple[list[RateLimitRule], list[ExemptRoute]]:
        token = _APP_DEFAULTS.set((self.scope, self.algorithm))
        try:
            rules, exempt = self.declared.rules_for(routes)
        finally:
            _APP_DEFAULTS.reset(token)
        # declared too, so a rules-file reload keeps them (RuleRegistry.declare)
        return [*rules, *self.defaults], exempt


class _Headers(Mapping[str, str]):
    """Werkzeug's headers as the lower-case mapping a :class:`Request`
    carries (Werkzeug iterates pairs, and looks names up in any case)."""

    __slots__ = ("_headers",)

    def __init__(self, headers: Any) -> None:
        self._headers = headers

    def __getitem__(self, key: str) -> str:
        value: str = self._headers[key]
        return value

    def get(self, key: str, default: Any = None) -> Any:
        return self._headers.get(key, default)

    def __iter__(self) -> Iterator[str]:
        return (name.lower() for name, _ in self._headers.items())

    def __len__(self) -> int:
        return len(self._headers)


@dataclass(slots=True)
class _AppState:
    """What one app's limiter holds: its pipeline and its binding."""

    pipeline: RateLimitPipeline
    routes: _AppRoutes
    enabled: bool
    deny: Callable[[Request, Outcome], Any] | None
    ready: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)
    user_for: tuple[RuleSet | None, bool] = (None, False)  # (ruleset, whether it needs a user id)
    handlers: dict[str | None, Any] = field(default_factory=dict)  # blueprint -> its 429 handler

    def handler(self, app: Flask, native: Any) -> Any:
        """The app's own handler of a ``RateLimitExceeded`` raised in the
        request ``native`` (``errorhandler(429)``, or of a class above it):
        ``_UNHANDLED`` when it has none, None when Flask must raise it to
        decide (``TRAP_HTTP_EXCEPTIONS``, an app class handling HTTP errors
        its own way). Handlers are fixed once an app serves (Flask refuses
        new ones then), so each blueprint's is looked up once."""
        if app.config.get("TRAP_HTTP_EXCEPTIONS"):
            return None
        blueprint = native.blueprint
        found = self.handlers.get(blueprint, _UNSEEN)
        if found is _UNSEEN:
            cls = type(app)
            if not all(getattr(cls, name) is getattr(Flask, name) for name in _ERROR_HOOKS):
                found = None
            else:  # Flask's own look-up (by code, then the class's MRO, blueprints first)
                probe = RateLimitExceeded.__new__(RateLimitExceeded)
                found = app._find_error_handler(probe, native.blueprints) or _UNHANDLED
            if len(self.handlers) < 4096:
                self.handlers[blueprint] = found
        return found


# a RateLimitExceeded no handler of the app's own answers (see _AppState.handler)
_UNHANDLED: Any = object()
_UNSEEN: Any = object()  # a blueprint whose handler is not looked up yet
# the Flask methods that decide how an HTTP error is answered
_ERROR_HOOKS = ("handle_http_exception", "handle_user_exception", "trap_http_exception")


class Limiter:
    """Rate limits for Flask apps.

    ``Limiter(app)``, or ``limiter = Limiter()`` at import and
    ``limiter.init_app(app)`` in the app factory (one limiter, any number of
    apps, each with its own config, rules and storage).

    ``rules``: a rules file's path, or a :class:`RuleRegistry` (the app's
    live ruleset: one app's, since declared rules are added to it);
    ``storage``: a :class:`Storage`, or a URI (``"redis://10.0.0.5/0"``);
    ``default_limits``: a rate or rates (``"100/hour;10/second"``) for
    every route without limits of its own, one budget per client;
    ``key_scope`` (default ``"ip"``) and ``algorithm`` (default
    ``"token_bucket"``): the defaults of every declaration and of the
    default limits; ``headers``, ``header_names``, ``on_breach``,
    ``log_denials``, ``metrics``: as :class:`RateLimitPipeline` takes
    them; ``trusted_proxies``: networks whose ``X-Forwarded-For`` is
    believed (docs/proxies.md); ``deny(request, outcome) -> response``
    answers a denial instead of raising :class:`RateLimitExceeded`.
    ``key``: a key function, the default of every declaration and of the
    default limits (see :meth:`limit`); flask-limiter's
    ``Limiter(get_remote_address, app=app)`` passes it first.

    Every one left out (None) is read from the app's ``RATELIMIT_*`` config
    at :meth:`init_app` (see :data:`CONFIG_KEYS`), then the stock default.
    flask-limiter's keywords (``storage_uri``, ``strategy``, ...) are
    refused naming nanolimit's.

    Declarations of a Limiter that no app has been initialised with warn
    once (:class:`UnenforcedLimitWarning`) when one of their views runs:
    a forgotten ``init_app`` is loud, not silently unlimited.
    """

    def __init__(
        self,
        app_or_key: Flask | Callable[..., str] | None = None,
        /,
        *,
        app: Flask | None = None,
        key: Callable[..., str] | None = None,
        rules: str | RuleRegistry | None = None,
        storage: Storage | str | None = None,
        default_limits: str | Sequence[str] | None = None,
        key_scope: KeyScope | str | None = None,
        algorithm: Algorithm | str | None = None,
        headers: bool | None = None,
        header_names: Mapping[str, str] | None = None,
        trusted_proxies: Iterable[str] | None = None,
        deny: Callable[[Request, Outcome], Any] | None = None,
        on_breach: Callable[[Request, Outcome], Any] | None = None,
        log_denials: float | None = 1.0,
        metrics: Metrics | None = None,
        **foreign: Any,
    ) -> None:
        if foreign:
            refuse_foreign("Limiter()", foreign)
        if isinstance(app_or_key, Flask):
            if app is not None:
                raise TypeError("Limiter(app, app=...): give the app once")
            app = app_or_key
        elif app_or_key is not None:
            if key is not None:
                raise TypeError("Limiter(key_func, key=...): give the key function once")
            key = app_or_key  # flask-limiter's Limiter(key_func, app=app)
        if app is not None and not isinstance(app, Flask):
            raise ValidationError(f"app must be a Flask app, got {type(app).__name__}")
        if rules is not None and not isinstance(rules, (str, RuleRegistry)):
            raise ValidationError(f"rules must be a rules file's path or a RuleRegistry, got {rules!r}")
        if storage is not None and not isinstance(storage, (str, Storage)):
            raise ValidationError(f"storage must be a Storage or a URI string, got {type(storage).__name__}")
        if default_limits is not None:
            try:  # a bad rate fails here, not at init_app
                parse_rates(default_limits)
            except ValidationError as exc:
                raise ValidationError(f"default_limits: {exc}") from None
        for hook_name, hook in (("deny", deny), ("on_breach", on_breach)):
            if hook is not None and not callable(hook):
                raise ValidationError(f"{hook_name} must be callable, got {hook!r}")
        self._rules = rules
        self._storage = storage
        self._default_limits = default_limits
        self._scope = key_scope
        self._algorithm = algorithm
        self._headers = headers
        self._header_names = header_names
        self._trusted = trusted_proxies
        self._deny = deny
        self._on_breach = on_breach
        self._log_denials = log_denials
        self._metrics = metrics
        # the declarations' owner; its own registry is never used
        self._limits = RouteLimits(
            scope=key_scope if key_scope is not None else KeyScope.IP,
            algorithm=algorithm if algorithm is not None else Algorithm.TOKEN_BUCKET,
            key=flask_key(key),
        )
        self._limits.guards = False  # a missing init_app is watched for below, whatever is declared on
        self._apps = 0  # the apps initialised with this limiter
        self._watching = False
        self._warned = False
        # Flask's static files are never limited: a sentinel marked exempt
        # stands above their routes when the route table is read
        self._static = _Marker()
        self._limits.exempt(self._static)
        self._registries: list[RuleRegistry] = []  # claimed by an app (identity, not value)
        if app is not None:
            self.init_app(app)

    # -- declarations -------------------------------------------------------------
    def limit(
        self,
        rate: str | Sequence[str],
        *,
        scope: KeyScope | str | None = None,
        algorithm: Algorithm | str | None = None,
        cost: int | Callable[[Request], int] = 1,
        count_when: Iterable[int] | Callable[[int], bool] | None = None,
        methods: str | Sequence[str] | None = None,
        dry_run: bool = False,
        tier: str | None = None,
        shape: bool = True,
        name: str | None = None,
        key: Callable[..., str] | None = None,
        **foreign: Any,
    ) -> Limit:
        """A limit on the view function, ``MethodView`` class or blueprint
        it decorates (a blueprint's: each of its routes, nested blueprints
        included, has its own budget). Checked now: a bad rate, algorithm
        or cost raises :class:`ValidationError` naming the rate. See
        :meth:`RouteLimits.limit` for the options; ``cost(request)`` gets
        the gateway's :class:`Request`, whose ``native`` is
        ``flask.request``. ``key``: a key function given ``flask.request``,
        or given nothing (flask-limiter's ``get_remote_address`` reads the
        request itself); default: the Limiter's."""
        if foreign:
            refuse_foreign("limit()", foreign)
        declared = self._limits.limit(
            rate,
            scope=scope,
            algorithm=algorithm,
            cost=cost,
            count_when=count_when,
            methods=methods,
            dry_run=dry_run,
            tier=tier,
            shape=shape,
            name=name,
            key=flask_key(key),
        )
        values = {f.name: getattr(declared, f.name) for f in fields(Limit)}
        self._watch()
        return _FlaskLimit(**values, inherit_scope=scope is None, inherit_algorithm=algorithm is None)

    def shared(self, rate: str | Sequence[str], *, name: str, **options: Any) -> Limit:
        """One budget, ``name``, spent by every route it decorates
        (flask-limiter's ``shared_limit``)."""
        if not isinstance(name, str) or not name:
            raise ValidationError(f"a shared limit needs a name, got {name!r}")
        return self.limit(rate, name=name, **options)

    def exempt(self, target: T) -> T:
        """No limit at all (not the default limits, not a rules file's) for
        the routes of a view, class or blueprint."""
        return self._limits.exempt(target)

    # -- a missing init_app ---------------------------------------------------------
    def _watch(self) -> None:
        """Watch requests for a declared view running while no app has
        been initialised with this limiter (``request_started``, weakly:
        the watch costs nothing once ``init_app`` ends it)."""
        if not self._apps and not self._watching and not self._warned:
            request_started.connect(self._unenforced)
            self._watching = True

    def _unwatch(self) -> None:
        if self._watching:
            request_started.disconnect(self._unenforced)
            self._watching = False

    def _unenforced(self, sender: Any, **extra: Any) -> None:
        """A request of an app this limiter was never initialised with:
        warn once if its view (or its class, or a blueprint above it)
        carries one of this limiter's declarations."""
        if self._warned or not isinstance(sender, Flask):
            return
        native = flask_request._get_current_object()  # type: ignore[attr-defined]
        view = sender.view_functions.get(native.endpoint) if native.endpoint else None
        holders = [view, getattr(view, "view_class", None)]
        holders.extend(sender.blueprints.get(name) for name in native.blueprints)
        for holder in holders:
            if holder is not None and any(d.owner is self._limits for d in declarations(holder)):
                break
        else:
            return
        self._warned = True
        self._unwatch()
        warnings.warn(
            UnenforcedLimitWarning(
                f"nanolimit: {view_name(view)} declares a rate limit, but its Limiter was never "
                f"initialised with app {sender.name!r}: nothing enforces it. Call "
                "limiter.init_app(app) (or Limiter(app=app)). (Warned once.)"
            ),
            stacklevel=2,
        )

    # -- apps ---------------------------------------------------------------------------
    def init_app(self, app: Flask) -> None:
        """Read ``app.config``'s ``RATELIMIT_*`` keys, build the app's
        ruleset, storage and pipeline, and install the hooks. Routes may be
        added afterwards: they are read on the first request (or by
        :meth:`check_routes`)."""
        if EXTENSION in app.extensions:
            raise ValidationError(f"nanolimit's Limiter is already initialised on app {app.name!r}")
        config = _config(app)
        enabled = config.get("RATELIMIT_ENABLED", True)
        if not isinstance(enabled, bool):
            raise ValidationError(f"RATELIMIT_ENABLED must be a bool, got {enabled!r}")
        scope = _setting(config, "RATELIMIT_SCOPE", self._scope, KeyScope.IP, _key_scope)
        algorithm = _setting(
            config, "RATELIMIT_ALGORITHM", self._algorithm, Algorithm.TOKEN_BUCKET, Algorithm.parse
        )
        headers = _setting(config, "RATELIMIT_HEADERS_ENABLED", self._headers, True, _bool)
        names = _setting(config, "RATELIMIT_HEADER_NAMES", self._header_names, None, _names)
        trusted = _setting(config, "RATELIMIT_TRUSTED_PROXIES", self._trusted, (), _networks)
        rates = _setting(config, "RATELIMIT_DEFAULT", self._default_limits, (), parse_rates)
        rules_source = self._rules if self._rules is not None else config.get("RATELIMIT_RULES")
        storage = self._storage if self._storage is not None else config.get("RATELIMIT_STORAGE_URI")

        registry, factory = self._ruleset(rules_source, storage)
        defaults = [
            RateLimitRule(
                DEFAULT_RULE if len(rates) == 1 else rate_rule_name(DEFAULT_RULE, r.window_seconds),
                "*",
                "/",
                scope,
                algorithm,
                r.limit,
                r.window_seconds,
                r.burst,
                group=DEFAULT_RULE if len(rates) > 1 else None,
                key=self._limits.key,
            )
            for r in rates
        ]
        try:
            extractor = DefaultKeyExtractor(trusted_proxies=trusted)
        except ValidationError as exc:
            raise ValidationError(f"RATELIMIT_TRUSTED_PROXIES: {exc}") from None
        pipeline = RateLimitPipeline(
            registry,
            factory,
            extractor,
            self._metrics,
            headers=headers,
            header_names=names,
            on_breach=self._on_breach,
            log_denials=self._log_denials,
        )
        if isinstance(rules_source, RuleRegistry):
            self._registries.append(rules_source)
        state = _AppState(
            pipeline, _AppRoutes(self._limits, registry, scope, algorithm, defaults), enabled, self._deny
        )
        app.extensions[EXTENSION] = state
        self._apps += 1
        self._unwatch()
        if not enabled:
            return  # no limits at all: no hook, nothing around the app
        slot = f"nanolimit.flask.{id(state):x}"  # this app's outcome, in the environ of each request
        app.before_request(self._decider(app, state, slot))
        # the headers and the settlement at start_response, around whatever
        # the app's wsgi_app is now (middleware added later wraps this)
        app.wsgi_app = _Answers(app.wsgi_app, slot, pipeline, _names_written(pipeline))  # type: ignore[method-assign]

    def _ruleset(
        self, source: str | RuleRegistry | None, storage: Storage | str | None
    ) -> tuple[RuleRegistry, LimiterFactory]:
        """The app's registry and factory: its rules (a file, a registry or
        none) on its storage (explicit, a URI, the file's ``[storage]``, or
        a bounded in-memory store)."""
        if storage is not None and not isinstance(storage, (str, Storage)):
            raise ValidationError(
                f"RATELIMIT_STORAGE_URI must be a URI string or a Storage, got {type(storage).__name__}"
            )
        made = _storage(storage) if storage is not None else None
        if isinstance(source, RuleRegistry):
            if any(held is source for held in self._registries):
                raise ValidationError(
                    "this RuleRegistry already serves another app (its declared rules are that app's): "
                    "give each app its own, or a rules file's path"
                )
            return source, LimiterFactory(made)
        if source is None:
            return RuleRegistry(), LimiterFactory(made)
        if not isinstance(source, str):
            raise ValidationError(f"RATELIMIT_RULES must be a rules file's path, got {source!r}")
        loaded = load_rules(source)
        return loaded.registry(), (LimiterFactory(made) if made is not None else loaded.factory())

    def _state(self, app: Flask | None = None) -> _AppState:
        target = app if app is not None else current_app
        state = target.extensions.get(EXTENSION)
        if not isinstance(state, _AppState):
            raise ValidationError(f"call limiter.init_app(app) first (app {target.name!r} has no limiter)")
        return state

    def pipeline(self, app: Flask | None = None) -> RateLimitPipeline:
        """The app's pipeline (default: the current app's): its
        ``registry``, ``factory`` and ``metrics``."""
        return self._state(app).pipeline

    def check_routes(self, app: Flask | None = None) -> tuple[RateLimitRule, ...]:
        """Read the app's route table now and make its declarations rules:
        call it at the end of the app factory, once every route is added,
        so that a rule naming a route the app lacks raises
        (:class:`RuleValidationError`, naming the rule and the route) at
        startup instead of at the first request. Returns the app's rules."""
        target = app if app is not None else current_app._get_current_object()  # type: ignore[attr-defined]
        state = self._state(target)
        with state.lock:
            rules = state.routes.bind(self._route_infos(target), known=_templates(target))
            state.ready = True
        return rules

    def _route_infos(self, app: Flask) -> list[RouteInfo]:
        """The app's routes, each with the blueprints above its view
        (outermost first) as the objects that may carry declarations."""
        infos = []
        for rule in app.url_map.iter_rules():
            endpoint = rule.endpoint
            view = app.view_functions.get(endpoint)
            parts = endpoint.split(".")[:-1]
            marked: list[Any] = []
            for i in range(1, len(parts) + 1):
                bp = app.blueprints.get(".".join(parts[:i]))
                if bp is not None:
                    marked.append(bp)
            if endpoint == "static" or endpoint.endswith(".static"):
                marked.append(self._static)
            infos.append(RouteInfo(_template(rule), frozenset(rule.methods or ()), view, tuple(marked)))
        return infos

    # -- the request hooks ---------------------------------------------------------------
    def _decider(self, app: Flask, state: _AppState, slot: str) -> Callable[[], Any]:
        """The app's one ``before_request`` hook: a plain function over the
        app and its state (Flask's ``ensure_sync`` checks a plain function
        cheapest, and no proxy is asked which app this is). It decides,
        and leaves the outcome in the request's slot (``environ[slot]``),
        where :class:`_Answers` writes its headers and settles its charge
        as the response starts."""
        pipeline = state.pipeline
        route_infos = self._route_infos

        def request_of(native: Any) -> Request:
            """The gateway's view of Flask's request (its user read only
            when a rule asks for one)."""
            url_rule = native.url_rule
            return Request(
                native.method,
                (native.root_path + native.path) or "/",
                _Headers(native.headers),
                native.remote_addr or None,
                self._user(app, state, native) if _needs_user(state, pipeline.registry.ruleset) else None,
                route=_template(url_rule) if url_rule is not None else None,
                native=native,
            )

        def nanolimit_before_request() -> Any:
            if not state.ready:
                with state.lock:
                    if not state.ready:
                        state.routes.bind(route_infos(app), known=_templates(app))
                        state.ready = True
            native = flask_request._get_current_object()  # type: ignore[attr-defined]
            url_rule = native.url_rule
            if url_rule is None:
                route = None
            elif url_rule.host or url_rule.subdomain:
                route = _template(url_rule)
            else:
                route = url_rule.rule  # _template() of a rule on no host, in line
            # the pipeline's decide(): the Request is built only if a rule needs it
            outcome = pipeline.decide(
                native,
                native.method,
                (native.root_path + native.path) or "/",
                native.remote_addr or None,
                route,
                request_of,
                WSGI_PAIRS,
            )
            if outcome is None:
                return None
            held: list[Outcome] | None = native.environ.get(slot)
            if type(held) is not list:  # no _Answers around this request: Flask writes them
                held = _written_by_flask(pipeline)
            if outcome[0]:  # allowed
                held.append(outcome)
                delay = outcome[2]
                if delay > 0.0:
                    time.sleep(delay)  # a shaping leaky bucket: this worker waits its turn
                return None
            if state.deny is not None:
                outcome = _with_dict(outcome)
                held.append(outcome)
                return state.deny(request_of(native), outcome)
            handler = state.handler(app, native)
            if handler is _UNHANDLED:
                # no handler of the app's own: the 429 as RateLimitExceeded
                # answers it, without raising through Flask's error handling
                held.append(outcome)
                return app.response_class(outcome.body(), 429, mimetype="application/json")
            outcome = _with_dict(outcome)
            held.append(outcome)
            exc = RateLimitExceeded(outcome)
            if handler is None:
                raise exc  # trapped, or an app that handles HTTP errors its own way: as Flask raises them
            return app.ensure_sync(handler)(exc)  # the app's errorhandler, as Flask would call it

        return nanolimit_before_request

    @staticmethod
    def _user(app: Flask, state: _AppState, native: Any) -> str | None:
        """The user scope's id: flask-login's authenticated user, else the
        server's ``REMOTE_USER``; never a header, which any client writes."""
        if _flask_login is not None and getattr(app, "login_manager", None) is not None:
            user = _flask_login.current_user
            if user is not None and getattr(user, "is_authenticated", False):
                uid = user.get_id()
                if uid is not None and uid != "":
                    return str(uid)
        remote: str | None = native.environ.get("REMOTE_USER") or None
        return remote

    def __repr__(self) -> str:
        return f"<nanolimit.flask.Limiter rules={self._rules!r}>"


class _Answers:
    """The app's ``wsgi_app``, wrapped: each request gets a slot in its
    environ, where the ``before_request`` hook leaves its outcome; when the
    response starts, the outcome's headers go straight into the WSGI
    header list (after Werkzeug has checked and copied the app's own, and
    not where the app set one itself), and a ``count_when`` charge is
    settled with the status the response starts with, or as a 500 if the
    app raises before it starts (past every error handler)."""

    __slots__ = ("app", "clean", "names", "pipeline", "slot")

    def __init__(self, app: Any, slot: str, pipeline: RateLimitPipeline, names: frozenset[str]) -> None:
        self.app = app  # the wsgi_app it wraps
        self.slot = slot
        self.pipeline = pipeline
        self.names = names  # every header name the pipeline may write, lower-cased
        self.clean: set[str] = set()  # names seen on responses that are none of those, as spelt

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        held: list[Any] = []
        environ[self.slot] = held
        try:
            return self.app(environ, _starting(start_response, held, self.pipeline, self.names, self.clean))
        except BaseException:
            if len(held) == 1:  # decided, and the response never started
                outcome = held[0]
                held.append(None)
                if outcome[0] and outcome[6] is not None:
                    _settle(self.pipeline, outcome, 500)
            raise


def _starting(
    start_response: Callable[..., Any],
    held: list[Any],
    pipeline: RateLimitPipeline,
    names: frozenset[str],
    clean: set[str],
) -> Callable[..., Any]:
    """``start_response`` writing the held outcome's headers and settling
    its charge (made apart from ``__call__``: a closure there would make
    its names cells on every request)."""

    def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
        if held:
            outcome = held[0]
            if outcome[6] is not None and len(held) == 1:
                held.append(None)  # settled once: a restart after an error refunds nothing more
                if outcome[0]:
                    _settle(pipeline, outcome, _status_code(status))
            ours = outcome[1]
            if ours:
                if type(ours) is not list:
                    ours = list(ours.items())
                for name, _ in headers:  # usually two: Content-Type, Content-Length
                    if name not in clean:
                        if name.lower() in names:
                            ours = _missing(headers, ours)
                            break
                        if len(clean) < 256:
                            clean.add(name)
                headers = headers + ours  # a new list: the app's may be one it reuses
        if exc_info is not None:
            return start_response(status, headers, exc_info)
        return start_response(status, headers)

    return start


def _missing(headers: list[tuple[str, str]], ours: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """``ours``, but those a response's ``headers`` set already."""
    present = {name.lower() for name, _ in headers}
    return [(name, value) for name, value in ours if name.lower() not in present]


def _names_written(pipeline: RateLimitPipeline) -> frozenset[str]:
    """Every header name the pipeline may write, lower-cased (renames
    applied): a response carrying none of them takes all of an outcome's
    headers in one ``extend``."""
    renames = pipeline.header_names
    return frozenset(renames.get(name, name).lower() for name in (*RATE_HEADERS, "Retry-After"))


def _with_dict(outcome: Outcome) -> Outcome:
    """The outcome as a hook or handler of the app's own is given it: its
    headers a dict (the native lane answers WSGI's pairs)."""
    headers: Any = outcome[1]  # typed a dict: the pairs are decide()'s WSGI_PAIRS form
    if type(headers) is list:
        return outcome._replace(headers=dict(headers))
    return outcome


def _written_by_flask(pipeline: RateLimitPipeline) -> list[Any]:
    """A request the app's ``wsgi_app`` did not carry through
    :class:`_Answers` (a request context pushed by hand, an app whose
    ``wsgi_app`` was replaced after ``init_app``): the held outcome's
    headers and settlement go through ``after_this_request``, on the
    response object, as Flask finalises it."""
    held: list[Any] = []

    def nanolimit_after_request(response: FlaskResponse) -> FlaskResponse:
        if held:
            outcome = held[0]
            if outcome[0] and outcome[6] is not None:
                _settle(pipeline, outcome, response.status_code)
            ours = outcome[1]
            if ours:
                present = {name.lower() for name, _ in response.headers.items()}
                for name, value in ours if type(ours) is list else ours.items():
                    if name.lower() not in present:
                        response.headers.add(name, value)
        return response

    after_this_request(nanolimit_after_request)
    return held


def _settle(pipeline: RateLimitPipeline, outcome: Outcome, status: int) -> None:
    """Settle a count-by-response charge. A refund that fails (the store
    down) leaves the request counted, the safe side: it is logged, and the
    response the view made still goes out."""
    if outcome.charge is None:
        return
    try:
        pipeline.settle(outcome, status)
    except Exception:
        log.exception("could not settle rule %r for a %d response: it stays counted", outcome.rule, status)


class _Marker:
    """An object that can carry a declaration (the static files' exemption)."""


class _NoArgs:
    """A key function that takes no argument (flask-limiter's way: it
    reads ``flask.request`` itself), called as one that takes the request."""

    def __init__(self, fn: Callable[[], str]) -> None:
        self.fn = fn
        self.__qualname__ = getattr(fn, "__qualname__", None) or type(fn).__name__

    def __call__(self, request: Any) -> str:
        return self.fn()

    def __eq__(self, other: object) -> bool:
        return type(other) is _NoArgs and other.fn == self.fn

    def __hash__(self) -> int:
        return hash(self.fn)

    def __repr__(self) -> str:
        return f"<key {self.__qualname__}()>"


def flask_key(key: Callable[..., str] | None) -> Callable[[Any], str] | None:
    """A Flask key function as rules call it: given ``flask.request``, or,
    written flask-limiter's way with no parameter, called with nothing."""
    if key is None or not callable(key) or isinstance(key, _NoArgs):
        return key  # None, or a non-callable the rule refuses with its message
    try:
        inspect.signature(key).bind()
    except (TypeError, ValueError):
        return key
    return _NoArgs(key)


def _needs_user(state: _AppState, ruleset: RuleSet) -> bool:
    """Whether the app's rules ask who the user is (a ``user`` scope, or
    tiers): only then is flask-login asked, which may load the user."""
    held, needed = state.user_for
    if held is not ruleset:
        needed = ruleset.has_tiers or any(
            r.scope is KeyScope.USER
            for r in (*ruleset.rules, *((ruleset.default,) if ruleset.default else ()))
        )
        state.user_for = (ruleset, needed)
    return needed


def _templates(app: Flask) -> list[str]:
    return [_template(rule) for rule in app.url_map.iter_rules()]


def _template(rule: Any) -> str:
    """A Werkzeug rule as the route it is: its path, under its host
    (``host_matching``) or subdomain as ``//host/path``, so ``/login`` of
    the ``api`` subdomain and the app's own ``/login`` are two routes."""
    host = rule.host or rule.subdomain
    return f"//{host}{rule.rule}" if host else str(rule.rule)


def _config(app: Flask) -> dict[str, Any]:
    """The app's ``RATELIMIT_*`` keys; an unknown one is an error naming it
    and the accepted ones (a typo must not silently leave a limit off)."""
    found = {k: v for k, v in app.config.items() if isinstance(k, str) and k.startswith("RATELIMIT_")}
    for key in sorted(found):
        if key not in CONFIG_KEYS:
            hint = f" (did you mean {_RENAMED[key]}?)" if key in _RENAMED else ""
            raise ValidationError(
                f"unknown config key {key}{hint}; nanolimit.flask reads: {', '.join(CONFIG_KEYS)}"
            )
    return found


def _setting(
    config: Mapping[str, Any], key: str, given: Any, default: Any, check: Callable[[Any], Any]
) -> Any:
    """The constructor's value, else the config's, else ``default``: checked,
    an error naming the config key (or the argument) that was wrong."""
    if given is not None:
        value, source = given, f"the Limiter's {_ARGUMENTS[key]} argument"
    elif key in config:
        value, source = config[key], key
    else:
        return default
    try:
        return check(value)
    except ValidationError as exc:
        raise ValidationError(f"{source}: {exc}") from None


def _key_scope(value: Any) -> KeyScope:
    try:
        return KeyScope(value)
    except ValueError:
        raise ValidationError(
            f"unknown scope {value!r}; expected one of: {', '.join(s.value for s in KeyScope)}"
        ) from None


def _bool(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(f"must be a bool, got {value!r}")
    return value


def _names(value: Any) -> dict[str, str]:
    if not isinstance(value, Mapping):
        raise ValidationError(f"must be a mapping of header names, got {value!r}")
    return dict(value)


def _networks(value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    try:
        networks = tuple(value)
    except TypeError:
        raise ValidationError(f"must be a list of networks, got {value!r}") from None
    return networks


def _storage(storage: Storage | str) -> Storage:
    """A Storage as given, or the one a URI names (``nanolimit.storage.uri``)."""
    if not isinstance(storage, str):
        return storage
    try:
        uri = importlib.import_module("nanolimit.storage.uri")
    except ImportError:  # pragma: no cover - the URI module ships with the storage layer
        raise ValidationError(
            "a storage URI needs nanolimit.storage.uri; pass a Storage object instead"
        ) from None
    made: Storage = uri.storage_from_uri(storage)
    return made
