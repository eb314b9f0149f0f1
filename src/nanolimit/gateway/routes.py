"""Limits declared where users declare routes: decorators, dependencies,
router- and blueprint-level limits, shared budgets and exempt routes.

A declaration decides nothing by itself. It marks a view (or a router, a
blueprint, a class-based view) with what it asks for; when a front end
binds to the app (:meth:`RouteLimits.bind`, called by the framework
adapters at startup), the app's route table is read and every declaration
becomes an ordinary :class:`RateLimitRule` matching the route's template.
So route limits take the one decision path every other rule takes (the
route cache, the same state namespaces, metrics, shadow mode, tiers,
compound all-or-nothing with global rules, ``nanolimit check-config``),
and a route-level limit costs what a middleware rule costs.

Names: a view's limit is named after the view (``module.function``), with
``:<window>s`` added when it has several rates (the window alone, so a
limit edit keeps the spent budget: :func:`.rates.rate_rule_name`); a shared limit
carries the name it was given. A reload of a rules file keeps every
declared rule (:meth:`nanolimit.gateway.registry.RuleRegistry.replace`).
"""

from __future__ import annotations

import functools
import inspect
import re
import threading
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

from .._limiter_config import Algorithm
from ..errors import RuleValidationError, UnenforcedLimitWarning, ValidationError
from .rates import Rate, parse_rates, rate_rule_name
from .registry import ExemptRoute, RuleRegistry
from .rules import KeyScope, RateLimitRule, key_function_problem, route_key

__all__ = ["Limit", "LimitDependency", "RouteInfo", "RouteLimits"]

T = TypeVar("T")

# where a declaration is kept on the object it marks
MARK = "__nanolimit_limits__"
EXEMPT = "__nanolimit_exempt__"
GUARD = "__nanolimit_guarded__"  # on a view's guard: the view it calls

_UNSAFE = re.compile(r"[^A-Za-z0-9_.:@/+-]")
# the handler methods of class-based views (Django, Flask, aiohttp, Starlette)
_HANDLER_METHODS = ("get", "head", "post", "put", "patch", "delete", "options", "trace", "connect")


@dataclass(frozen=True, slots=True)
class RouteInfo:
    """One route of an app, as a framework adapter reads its route table:
    the template, the methods it answers (empty: all), the view, and the
    objects above it that may carry declarations (a router, a mount, a
    blueprint, FastAPI dependencies)."""

    template: str
    methods: frozenset[str]
    endpoint: Any
    marked: tuple[Any, ...] = ()


@dataclass(frozen=True)
class Limit:
    """One declaration: ``@limits.limit("5/minute")`` on a view, a class,
    a router or a blueprint. Checked when it is written, so a bad rate, an
    unknown algorithm or an impossible cost fails at import with the
    declaration named."""

    rates: tuple[Rate, ...]
    scope: KeyScope
    algorithm: Algorithm
    cost: int | Callable[[Any], int] = 1
    count_when: Any = None
    methods: tuple[str, ...] = ("*",)
    name: str | None = None  # set: one shared budget, whichever routes spend it
    dry_run: bool = False
    tier: str | None = None
    shape: bool = True
    owner: Any = None  # the RouteLimits that made it
    key: Callable[[Any], str] | None = None

    def __call__(self, target: T) -> T:
        """Mark ``target``. A view function comes back behind a guard (its
        signature, name and marks are the view's, so frameworks reading it
        see the view) that warns once if it runs while no front end has
        bound its declarations (:meth:`RouteLimits.guard`); anything else
        (a class, a router, a blueprint) comes back unchanged."""
        _mark(target, MARK, self)
        owner = self.owner
        return owner.guard(target) if owner is not None else target

    def rules(
        self, base: str, routes: tuple[str, ...], methods: tuple[str, ...] | None = None
    ) -> list[RateLimitRule]:
        """The rules this declaration makes for the routes of one view (or,
        shared, of every view that spends it). ``methods``, for a view that
        shares its template with another, stands for ``"*"``: the limit is
        the view's, not the other's."""
        name = self.name or base
        own = self.methods
        if methods is not None:
            own = tuple(
                dict.fromkeys(m for declared in own for m in (methods if declared == "*" else (declared,)))
            )
        several = len(self.rates) > 1 or len(own) > 1
        out = []
        for method in own:
            for rate in self.rates:
                rule_name = name
                if len(own) > 1:
                    rule_name += f"@{method}"
                if len(self.rates) > 1:
                    rule_name = rate_rule_name(rule_name, rate.window_seconds)
                out.append(
                    RateLimitRule(
                        rule_name,
                        method,
                        "/",
                        self.scope,
                        self.algorithm,
                        rate.limit,
                        rate.window_seconds,
                        rate.burst,
                        tier=self.tier,
                        dry_run=self.dry_run,
                        shape=self.shape,
                        cost=self.cost,
                        routes=routes,
                        count_when=self.count_when,
                        group=name if several else None,
                        key=self.key,
                    )
                )
        return out


def _mark(target: Any, attr: str, value: Any) -> None:
    try:
        marks = target.__dict__.get(attr)
    except AttributeError:
        marks = getattr(target, attr, None)
    if marks is None:
        marks = []
        try:
            setattr(target, attr, marks)
        except (AttributeError, TypeError):
            raise ValidationError(
                f"cannot declare a limit on {target!r}: it takes no attributes "
                "(declare it on the view function, class, router or blueprint)"
            ) from None
    marks.append(value)


def declarations(target: Any) -> list[Limit]:
    """The declarations on ``target`` itself (not inherited from a base class)."""
    try:
        own = vars(target)
    except TypeError:
        return list(getattr(target, MARK, ()) or ())
    return list(own.get(MARK, ()) or ())


def is_exempt(target: Any) -> bool:
    try:
        return bool(vars(target).get(EXEMPT))
    except TypeError:
        return bool(getattr(target, EXEMPT, False))


def view_class(endpoint: Any) -> type | None:
    """The class of a class-based view: the endpoint itself (aiohttp's
    ``web.View``, Starlette's ``HTTPEndpoint``), or the class its
    ``as_view()`` function names: ``view_class`` (Django, Flask, DRF's
    ``APIView``), or ``cls`` alone (DRF's ``ViewSet.as_view(actions)``). Each
    ``as_view()`` call makes a new function; the class is the view."""
    if isinstance(endpoint, type):
        return endpoint
    for attr in ("view_class", "cls"):
        cls = getattr(endpoint, attr, None)
        if isinstance(cls, type):
            return cls
    return None


def _view_id(endpoint: Any) -> int:
    """One id per view: a class routed through several ``as_view()``
    functions is one view, with one budget, as a function on several
    routes is."""
    return id(view_class(endpoint) or endpoint)


def view_name(endpoint: Any) -> str:
    """A rule name for a view: ``module.qualname``, in the characters rule
    names allow, at most 96 of them (room for a rate suffix)."""
    target = view_class(endpoint) or endpoint  # as_view()'s class
    module = getattr(target, "__module__", None) or "view"
    qual = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    name = _UNSAFE.sub("_", f"{module}.{qual}".replace("<", "").replace(">", ""))
    return name[-96:].lstrip(".:@/+-") or "view"


class RouteLimits:
    """Route-level limits for one app: declare them with :meth:`limit`,
    :meth:`shared` and :meth:`exempt`; a framework adapter calls
    :meth:`bind` with the app's routes at startup.

    ``registry`` is where the declared rules go, next to any rules you
    give it (a rules file, global limits): the default is a new, unstacked
    one, where a route's own limits replace the global ones; pass
    ``RuleRegistry(global_rules, stacked=True)`` for global limits that
    apply as well, decided together with the route's, all or nothing.
    ``scope``, ``algorithm`` and ``key`` (a key function, see
    :meth:`limit`) are the defaults of every declaration.

    A declared view function that runs before any front end has bound the
    declarations (``enforced``: the middleware is missing, or was given no
    ``limits=``) warns once, :class:`UnenforcedLimitWarning`, instead of
    running silently unlimited.
    """

    #: whether declared view functions come back behind the guard (front
    #: ends that watch for a missing setup themselves turn it off)
    guards: bool = True
    #: what :meth:`bind` hands ``RuleRegistry.declare`` besides the rules
    _declare_options: ClassVar[Mapping[str, Any]] = {}

    def __init__(
        self,
        registry: RuleRegistry | None = None,
        *,
        scope: KeyScope | str = KeyScope.IP,
        algorithm: Algorithm | str = Algorithm.TOKEN_BUCKET,
        key: Callable[[Any], str] | None = None,
        **foreign: Any,
    ) -> None:
        if foreign:
            refuse_foreign("RouteLimits()", foreign)
        if registry is not None and not isinstance(registry, RuleRegistry):
            raise ValidationError(f"registry must be a RuleRegistry, got {type(registry).__name__}")
        self.registry = registry if registry is not None else RuleRegistry()
        self.scope = _scope(scope)
        self.algorithm = Algorithm.parse(algorithm)
        self.key = _key(key)
        self._lock = threading.Lock()
        self.bound = False
        # a front end has read the declarations (or is off on purpose): the
        # guard of a declared view then calls it straight away
        self.enforced = False
        self._warned = False

    # -- declarations -----------------------------------------------------------
    def limit(
        self,
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
        """A limit for the routes of the view (class, router, blueprint) it
        decorates. ``rate`` may be a list (``"5/minute;100/hour"``): all its
        limits apply together. ``cost`` is what a request spends (or
        ``cost(request) -> int``, given the gateway's :class:`Request`,
        whose ``native`` is the framework's request); ``count_when`` counts
        only responses with these statuses (or passing the predicate);
        ``methods`` restricts it (each method then has its own budget).
        ``name`` makes it a shared budget (see :meth:`shared`).
        ``key(request) -> str`` names whose budget a request spends, in
        place of ``scope``: it is handed the framework's own request
        (:func:`nanolimit.gateway.keyfuncs.key_argument`) and returns a
        non-empty str of at most 256 UTF-8 bytes. flask-limiter's and
        slowapi's spellings (``key_func``, ``deduct_when``, ...) are
        refused naming nanolimit's."""
        if foreign:
            refuse_foreign("limit()", foreign)
        try:
            rates = parse_rates(rate)
        except ValidationError as exc:
            raise ValidationError(f"limit {rate!r}: {exc}") from None
        if methods is None:
            method_list: tuple[str, ...] = ("*",)
        elif isinstance(methods, str):
            method_list = (methods.upper(),)
        else:
            method_list = tuple(dict.fromkeys(m.upper() for m in methods)) or ("*",)
        declared = Limit(
            rates,
            _scope(scope) if scope is not None else self.scope,
            Algorithm.parse(algorithm) if algorithm is not None else self.algorithm,
            cost,
            count_when,
            method_list,
            name,
            dry_run,
            tier,
            shape,
            self,
            _key(key) if key is not None else self.key,
        )
        try:  # every field checked now, at import, not at the first request
            declared.rules(name or "declared", ("/",))
        except RuleValidationError as exc:
            raise ValidationError(f"limit {rate!r}: {exc.field}: {exc.message}") from None
        return declared

    def shared(self, rate: str | Sequence[str], *, name: str, **options: Any) -> Limit:
        """One budget, ``name``, spent by every route it decorates (flask-
        limiter's ``shared_limit``): a search and an export that share 100
        requests an hour between them."""
        if not isinstance(name, str) or not name:
            raise ValidationError(f"a shared limit needs a name, got {name!r}")
        return self.limit(rate, name=name, **options)

    def depends(self, rate: str | Sequence[str], **options: Any) -> Any:
        """A FastAPI dependency form of :meth:`limit`:
        ``@app.get("/x", dependencies=[Depends(limits.depends("5/minute"))])``,
        or on an ``APIRouter(dependencies=[...])`` for every route of it."""
        return LimitDependency(self.limit(rate, **options))

    def exempt(self, target: T) -> T:
        """No limit at all for the routes of ``target`` (not even global
        rules): health checks, webhooks from a trusted peer. Returned
        unchanged."""
        try:
            setattr(target, EXEMPT, True)
        except (AttributeError, TypeError):
            raise ValidationError(f"cannot exempt {target!r}: it takes no attributes") from None
        return target

    # -- binding ------------------------------------------------------------------
    def rules_for(self, routes: Iterable[RouteInfo]) -> tuple[list[RateLimitRule], list[ExemptRoute]]:
        """The declared rules and exempt routes of an app's routes. An
        exempt route is its template; when another view of the app shares
        the template, only the methods the exempt view alone answers (one
        view of ``/x`` exempt is not the other's, and where both answer a
        method, which serves depends on the router's order: none exempt).
        Called by the front ends as they bind: the declarations are then
        ``enforced``."""
        self.enforced = True
        routes = list(routes)
        # a view's (or a shared name's) templates, each with the methods its
        # limits cover there (None: every method)
        per_view: dict[int, tuple[Any, dict[str, tuple[str, ...] | None], list[Limit]]] = {}
        shared: dict[str, tuple[Limit, dict[str, tuple[str, ...] | None]]] = {}
        exempt: list[ExemptRoute] = []
        # template -> view -> the methods it answers (None: every method)
        answers: dict[str, dict[int, frozenset[str] | None]] = {}
        for info in routes:
            views = answers.setdefault(route_key(info.template), {})
            view = _view_id(info.endpoint)
            before = views.get(view, frozenset())
            views[view] = None if before is None or not info.methods else before | info.methods
        for info in routes:
            self._refuse_method_declarations(info.endpoint)
            template = route_key(info.template)
            found: list[Limit] = []
            skip = False
            cls = view_class(info.endpoint)
            for holder in (*info.marked, info.endpoint, cls if cls is not info.endpoint else None):
                if holder is None:
                    continue
                if is_exempt(holder):
                    skip = True
                found.extend(d for d in declarations(holder) if d.owner is self or d.owner is None)
            if skip:
                exemption = _exemption(template, _view_id(info.endpoint), answers[template])
                if exemption is not None:
                    exempt.append(exemption)
                continue
            if not found:
                continue
            methods = _alone(_view_id(info.endpoint), answers[template])
            for d in found:
                if d.name is not None:
                    held = shared.setdefault(d.name, (d, {}))
                    if held[0] != d:
                        raise ValidationError(
                            f"shared limit {d.name!r} is declared twice with different rates or options"
                        )
                    if held[1].setdefault(template, methods) != methods:
                        held[1][template] = None  # views sharing the template spend it alike
                    continue
                entry = per_view.setdefault(_view_id(info.endpoint), (info.endpoint, {}, []))
                entry[1].setdefault(template, methods)
                if d not in entry[2]:
                    entry[2].append(d)
        rules: list[RateLimitRule] = []
        for endpoint, templates, limits in per_view.values():
            base = view_name(endpoint)
            several = len(limits) > 1
            for i, d in enumerate(limits):
                rules.extend(_rules_by_methods(d, f"{base}.{i + 1}" if several else base, templates))
        for d, templates in shared.values():
            rules.extend(_rules_by_methods(d, d.name or "shared", templates))
        return rules, exempt

    def _refuse_method_declarations(self, endpoint: Any) -> None:
        """A declaration on a handler method of a class-based view (``def
        post`` of a Django ``View``, a Flask ``MethodView``, an aiohttp
        ``web.View``, a Starlette ``HTTPEndpoint``) is an error: only the
        class and the route's view are read, so it would bind to nothing
        and the method would run unlimited without a word (flask-limiter
        and django-ratelimit users write it there)."""
        cls = view_class(endpoint)
        if cls is None:
            return
        handlers = [(method, method) for method in _HANDLER_METHODS]
        actions = getattr(endpoint, "actions", None)  # DRF's ViewSet: {"get": "list"}
        if isinstance(actions, dict):
            handlers += [(a, m) for m, a in actions.items() if isinstance(a, str) and isinstance(m, str)]
        for attr, method in handlers:
            handler = getattr(cls, attr, None)
            if handler is None:
                continue
            if any(d.owner is self or d.owner is None for d in declarations(handler)):
                raise ValidationError(
                    f"{view_name(cls)}.{attr} declares a limit on a method of a "
                    "class-based view, where it would be enforced nowhere: declare it on the "
                    f"class (or its as_view()) with methods=[{method.upper()!r}]"
                )

    def bind(
        self, routes: Iterable[RouteInfo], *, known: Iterable[str] | None = None
    ) -> tuple[RateLimitRule, ...]:
        """Turn the declarations on an app's routes into rules of the
        registry (once; later calls only re-check). ``known`` is every
        template the app routes (default: those of ``routes``): a rule of
        the registry that names a route the app does not have is an error
        naming both, so a typo fails at startup, not silently."""
        routes = list(routes)
        templates = {route_key(r.template) for r in routes}
        if known is not None:
            templates |= {route_key(t) for t in known}
        with self._lock:
            if not self.bound:
                rules, exempt = self.rules_for(routes)
                # every rule's routes bound to the app's own templates (a
                # rule naming none is an error naming both, raised here)
                self.registry.declare(rules, exempt=exempt, known_routes=templates, **self._declare_options)
                self.bound = True
            elif self.registry.ruleset.known_routes != frozenset(templates):
                registry = self.registry
                registry.declare(
                    registry.declared,
                    exempt=registry.declared_exempt,
                    known_routes=templates,
                    **self._declare_options,
                )
            ruleset = self.registry.ruleset
        return ruleset.rules

    # -- the guard ------------------------------------------------------------------
    def guard(self, target: T) -> T:
        """``target`` behind a guard that warns once when it runs while
        these declarations are not ``enforced``, for a plain or ``async``
        view function (``functools.wraps``: the view's signature, name and
        marks); anything else, or with ``guards`` off, unchanged."""
        if not self.guards or getattr(target, GUARD, None) is not None:
            return target
        if not inspect.isfunction(target) or inspect.isgeneratorfunction(target):
            return target
        if inspect.isasyncgenfunction(target):
            return target
        view: Any = target
        limits = self
        if inspect.iscoroutinefunction(view):

            @functools.wraps(view)
            async def guarded_async(*args: Any, **kwargs: Any) -> Any:
                if not limits.enforced:
                    limits.unenforced(view)
                return await view(*args, **kwargs)

            guarded: Any = guarded_async
        else:

            @functools.wraps(view)
            def guarded_sync(*args: Any, **kwargs: Any) -> Any:
                if not limits.enforced:
                    limits.unenforced(view)
                return view(*args, **kwargs)

            guarded = guarded_sync
        setattr(guarded, GUARD, view)
        return guarded  # type: ignore[no-any-return]

    def unenforced(self, view: Any) -> None:
        """A declared view ran with nothing enforcing its limits: warn,
        once per RouteLimits (a warning filter may make it an error)."""
        with self._lock:
            if self._warned or self.enforced:
                return
            self._warned = True
        warnings.warn(
            UnenforcedLimitWarning(
                f"nanolimit: {view_name(view)} declares a rate limit, but nothing enforces it: no "
                "front end has bound this RouteLimits. Add nanolimit.asgi.RateLimitMiddleware "
                "(app.add_middleware(RateLimitMiddleware, limits=limits)) or "
                "nanolimit.aiohttp.setup(app, limits=limits). (Warned once.)"
            ),
            stacklevel=3,
        )


class _Onto(RouteLimits):
    """``registry=`` and ``limits=`` on one front end: the declarations of
    ``limits`` bound into ``registry``, where they add to its rules (a
    route's limits and the rules the registry alone would apply decide the
    request together, all or nothing), whether it is stacked or not."""

    _declare_options: ClassVar[Mapping[str, Any]] = {"adds": True}

    def __init__(self, declared: RouteLimits, registry: RuleRegistry) -> None:
        super().__init__(registry, scope=declared.scope, algorithm=declared.algorithm, key=declared.key)
        self.declared = declared

    def rules_for(self, routes: Iterable[RouteInfo]) -> tuple[list[RateLimitRule], list[ExemptRoute]]:
        self.enforced = True
        return self.declared.rules_for(routes)


# What a view that answers every method is exempt for, when another view of
# its template answers some: the methods it is known alone to answer.
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})


def _alone(view: int, views: dict[int, frozenset[str] | None]) -> tuple[str, ...] | None:
    """The methods a limit on one view of a template covers: every one
    (None, ``"*"``) when the view is the template's only one; else those no
    other view answers, as :func:`_exemption` reads them, so a limited POST
    view never limits (or is spent by) the GET view beside it. HEAD goes
    with GET, as a GET rule covers it. None too when no method, or more
    than one, is the view's alone: a rule covers one method or all, and one
    budget over the template errs on the side of the limit."""
    others = [methods for other, methods in views.items() if other != view]
    if not others or any(methods is None for methods in others):
        return None
    own = views[view]
    alone = (_METHODS if own is None else own).difference(*(m for m in others if m is not None))
    if "GET" in alone:
        alone = alone - {"HEAD"}  # the GET rule covers HEAD
    # one method alone: that method's rule. Several keep "*" (one budget):
    # a rule per method would give each its own, the view's limit times over
    return tuple(alone) if len(alone) == 1 else None


def _rules_by_methods(
    d: Limit, base: str, templates: dict[str, tuple[str, ...] | None]
) -> list[RateLimitRule]:
    """``d``'s rules for its templates: their one method where every
    template agrees on it (the common case: a POST view beside a GET view);
    else every method (``"*"``). The rule's name is its one budget (its
    state's namespace): rules per method or per template would each have
    the whole limit, so where they would differ the limit keeps one budget
    over every template, erring on the side of the limit."""
    methods = set(templates.values())
    return d.rules(base, tuple(templates), methods.pop() if len(methods) == 1 else None)


def _exemption(template: str, view: int, views: dict[int, frozenset[str] | None]) -> ExemptRoute | None:
    """The exemption of one view's route: the template, or the methods no
    other view of the template answers (None when there are none)."""
    others = [methods for other, methods in views.items() if other != view]
    if not others:
        return template
    if any(methods is None for methods in others):
        return None  # another view answers every method
    own = views[view]
    alone = (_METHODS if own is None else own).difference(*(m for m in others if m is not None))
    return (template, alone) if alone else None


def registry_and_limits(
    registry: RuleRegistry | None, limits: RouteLimits | None
) -> tuple[RuleRegistry | None, RouteLimits | None]:
    """What a front end decides from and what it binds to the app's routes:
    ``limits`` brings its own registry; a registry whose rules name routes
    (a rules file) is bound as declarations are, so a typo fails the start.
    Both (global rules and route limits): the declarations are bound into
    ``registry``, adding to its rules (:class:`_Onto`)."""
    if limits is not None:
        if not isinstance(limits, RouteLimits):
            raise ValidationError(f"limits must be a RouteLimits, got {type(limits).__name__}")
        if registry is not None and registry is not limits.registry:
            if not isinstance(registry, RuleRegistry):
                raise ValidationError(f"registry must be a RuleRegistry, got {type(registry).__name__}")
            return registry, _Onto(limits, registry)
        return limits.registry, limits
    if isinstance(registry, RuleRegistry) and (registry.ruleset.routes() or registry.ruleset.exempt):
        return registry, RouteLimits(registry)
    return registry, None


def _key(key: Any) -> Callable[[Any], str] | None:
    if key is None:
        return None
    problem = key_function_problem(key)
    if problem is not None:
        raise ValidationError(f"key: {problem}")
    return key  # type: ignore[no-any-return]


# flask-limiter's and slowapi's keywords, and what nanolimit says instead
FOREIGN_KEYWORDS: Mapping[str, str] = {
    "key_func": "key=: key(request) -> str, handed the framework's own request",
    "deduct_when": (
        "count_when=: the response statuses that count ({401, 403}), or count_when(status) -> bool; "
        "it is charged on entry and refunded when the response does not count"
    ),
    "exempt_when": "exempt=... on the view (limits.exempt(view)), or a tier= for the requests let off",
    "per_method": "methods=[...]: each method listed has a budget of its own",
    "error_message": "the front end's deny= (or an error handler for 429) to shape the denial",
    "override_defaults": (
        "nothing: a route's own limits replace the default ones; for both, a stacked "
        "RuleRegistry(rules, stacked=True) or registry= beside limits="
    ),
    "storage_uri": "storage= (a Storage, or a URI such as 'redis://10.0.0.5/0')",
    "strategy": "algorithm= ('fixed_window', 'sliding_window', 'token_bucket', ...)",
    "headers_enabled": "headers=",
    "swallow_errors": "the storage's on_error= ('allow', 'deny', 'raise', 'local')",
    "application_limits": "default_limits= or a rules file's global rules",
}


def refuse_foreign(where: str, given: Mapping[str, Any]) -> None:
    """Keywords a call does not take: flask-limiter's and slowapi's are
    named with nanolimit's spelling; any other is a plain unknown one."""
    for name in given:
        instead = FOREIGN_KEYWORDS.get(name)
        if instead is not None:
            raise TypeError(f"{where} takes no {name}= (a flask-limiter and slowapi keyword); use {instead}")
    raise TypeError(f"{where} got unexpected keyword argument(s): {', '.join(sorted(given))}")


def _scope(scope: KeyScope | str) -> KeyScope:
    try:
        return KeyScope(scope)
    except ValueError:
        known = ", ".join(s.value for s in KeyScope)
        raise ValidationError(f"unknown scope {scope!r}; expected one of: {known}") from None


class LimitDependency:
    """``Depends(limits.depends("5/minute"))`` on a FastAPI route, router
    (``APIRouter(dependencies=[...])``) or app: the limit is read from the
    route table when the middleware binds, and decided there, before the
    app. Called by FastAPI, it checks the middleware really did, so a
    forgotten middleware fails loudly instead of limiting nothing."""

    annotated: ClassVar[bool] = False  # its request parameter names Starlette's Request (_annotate)

    def __init__(self, limit: Limit) -> None:
        if not LimitDependency.annotated:
            _annotate()
        self.limit = limit
        setattr(self, MARK, [limit])

    async def __call__(self, request: Any) -> None:
        if "nanolimit" not in request.scope:
            raise RuntimeError(
                "a nanolimit limit dependency ran without the middleware: add "
                "nanolimit.asgi.RateLimitMiddleware(app, limits=...) (app.add_middleware) to the app"
            )

    def __repr__(self) -> str:
        return f"<LimitDependency {self.limit.rates!r}>"


def _annotate() -> None:
    # FastAPI injects by annotation: the request parameter must name
    # Starlette's Request class itself. Imported when the first dependency
    # is made (FastAPI reads it only after), not with nanolimit: it was a
    # third of ``import nanolimit``'s time.
    try:
        from starlette.requests import Request as StarletteRequest
    except ImportError:  # pragma: no cover - Starlette is what this module serves
        return
    LimitDependency.__call__.__annotations__["request"] = StarletteRequest
    LimitDependency.annotated = True
