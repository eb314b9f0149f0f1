"""Rules: which limit applies to a request, and the paths and route
templates they match.

A :class:`RateLimitRule` is a frozen, self-validating value (docs/spec.md §3, §6).
The registry that finds a request's rule, and the trie it reads, are in
:mod:`nanolimit.gateway.registry`.

Rules match the path the frameworks route, not the bytes a client sent:
:func:`normalize_path` is the one place that turns one into the other
(repeated slashes collapse, a missing leading ``/`` is supplied), and a
``GET`` rule covers ``HEAD`` (HTTP's GET without the body, which Starlette,
Flask and Django answer with the GET handler).
"""

from __future__ import annotations

import enum
import inspect
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .._limiter_config import Algorithm, LimiterConfig
from .._validation import _shown, as_float
from ..errors import (
    RuleAlgorithmError,
    RuleValidationError,
    UnknownAlgorithmError,
    ValidationError,
)
from .rates import Rate, parse_rate

__all__ = [
    "KeyScope",
    "Rate",
    "RateLimitRule",
    "normalize_path",
    "parse_rate",
]


def normalize_path(path: str) -> str:
    """The path as the frameworks route it, which is the path rules match.

    The input is the *decoded* path (ASGI ``scope["path"]``, WSGI
    ``SCRIPT_NAME + PATH_INFO``): servers have already turned ``%2f`` into
    ``/`` and ``%2e`` into ``.``, and frameworks route what they got without
    decoding again, so neither does this. Two changes only:

    - a path that is empty or lacks its leading ``/`` gets one (Werkzeug
      routes ``PATH_INFO = "login"`` to ``/login``);
    - repeated slashes collapse into one: Werkzeug strips every leading
      slash (``//login`` and ``/%2flogin`` run the ``/login`` handler) and
      redirects interior runs to the collapsed path, so ``/a//b`` is the
      ``/a/b`` route wherever it is routed at all.

    Everything else is kept as routed: dot segments (``/x/../login`` is not
    ``/login`` to any server or framework we document, and ``/api/../login``
    reaches an ``/api/{rest:path}`` handler, so it must stay under ``/api``),
    a trailing slash, case, ``;params`` and a literal ``%`` (a ``%25`` on the
    wire).

    The common, already normal path is returned as is after one substring
    check: nothing is allocated.
    """
    if path[:1] == "/" and "//" not in path:
        return path
    if path[:1] != "/":
        path = "/" + path
    while "//" in path:
        path = path.replace("//", "/")
    return path


class KeyScope(str, enum.Enum):
    """Whose budget a request spends: the user's, the API key's, the client
    IP's, or one budget shared by every caller (``global``)."""

    USER = "user"
    API_KEY = "api_key"
    IP = "ip"
    GLOBAL = "global"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def _missing_(cls, value: object) -> KeyScope | None:
        # the spellings users bring: "IP", "api-key", "API Key"
        if isinstance(value, str):
            wanted = value.strip().lower().replace("-", "_").replace(" ", "_")
            for scope in cls:
                if scope.value == wanted:
                    return scope
        return None


# ---------------------------------------------------------------------------
# Route templates

_PLACEHOLDER = re.compile(r"\{[^{}]*\}|<[^<>]*>")
# the converters a placeholder has when it names none (Starlette's str,
# Werkzeug's string, Django's str): spelt or not, the same route
_DEFAULT_CONVERTERS = frozenset({"", "str", "string"})


def _placeholder(match: re.Match[str]) -> str:
    """One placeholder in the canonical spelling: ``{name}`` or
    ``{name:converter}`` (Starlette's order), from ``{name:converter}`` or
    Werkzeug's and Django's ``<converter:name>``."""
    text = match.group(0)
    inner = text[1:-1]
    if text[0] == "{":
        name, _, converter = inner.partition(":")
    else:
        converter, _, name = inner.rpartition(":")
    name, converter = name.strip(), converter.strip()
    if converter in _DEFAULT_CONVERTERS:
        return "{" + name + "}"
    return "{" + name + ":" + converter + "}"


def route_key(template: str) -> str:
    """A framework's route template in the one spelling rules compare, with
    everything that tells two routes apart kept: each placeholder's name and
    converter. Starlette's ``{id:int}``, Werkzeug's and Django's
    ``<int:id>`` are ``{id:int}``; ``{id}``, ``{id:str}``, ``<id>`` and
    ``<string:id>`` are ``{id}``; a leading ``/`` is supplied (Django's
    routes have none). So ``/items/{item_id:int}`` and ``/items/{name}``
    stay two routes: an exemption of one never covers the other.

    A rule may name a route more loosely (``/users/{id}`` for the app's
    ``/users/<int:id>``): :func:`resolve_route` binds it to the app's own
    template when the app's route table is read."""
    if not isinstance(template, str) or not template.strip():
        raise ValidationError(f"a route template must be a non-empty str, got {template!r}")
    text = template.strip()
    if text[:1] == "^":  # a Django re_path pattern, as its resolver reports it
        text = text[1:].rstrip("$")
    if text[:1] != "/":
        text = "/" + text
    return _PLACEHOLDER.sub(_placeholder, text)


def route_shape(template: str) -> str:
    """A template with every placeholder as ``{}``: what two spellings of
    one route share, and what two different routes may share too (so it
    only ever finds candidates, in :func:`resolve_route`)."""
    return _PLACEHOLDER.sub("{}", route_key(template))


def _placeholder_names(key: str) -> tuple[str, ...]:
    return tuple(m.group(0)[1:-1].partition(":")[0] for m in _PLACEHOLDER.finditer(key))


def _path_part(key: str) -> str:
    """A route's path without the host a ``//host/path`` route names."""
    if key[:2] != "//":
        return key
    cut = key.find("/", 2)
    return "/" if cut < 0 else key[cut:]


def resolve_route(template: str, known: Iterable[str]) -> tuple[str, ...]:
    """The app's routes (canonical, :func:`route_key`) that a rule's
    ``template`` names: the one spelt the same, name and converter; else
    the one route of the same shape and placeholder names (``/users/{id}``
    for ``/users/<int:id>``); else the one route of the same shape. A
    template without a host may name a route under one (Starlette's
    ``Host``, Flask's subdomains: ``//api.example.com/login``) the same
    ways. Empty when none matches; two candidates at the deciding step are
    an error naming both, so a loose name never silently covers a second
    route."""
    key = route_key(template)
    known = frozenset(known)
    if key in known:
        return (key,)
    found = _candidates(key, known, route_key)
    if not found and key[:2] != "//":
        found = _candidates(key, {k for k in known if k[:2] == "//"}, _path_part)
    if len(found) > 1:
        raise ValidationError(
            f"{template!r} could name any of the routes {', '.join(map(repr, found))}: "
            "spell the one meant as the app does, converter and host included"
        )
    return tuple(found)


def _candidates(key: str, known: Iterable[str], part: Callable[[str], str]) -> list[str]:
    """The routes whose ``part`` is ``key`` spelt the same, else of its
    shape with its placeholder names, else of its shape."""
    exact = sorted(k for k in known if part(k) == key)
    if exact:
        return exact
    shape = route_shape(key)
    same_shape = sorted(k for k in known if route_shape(part(k)) == shape)
    names = _placeholder_names(key)
    return [k for k in same_shape if _placeholder_names(part(k)) == names] or same_shape


def key_function_problem(key: Any) -> str | None:
    """What is wrong with ``key`` as a rule's key function, or None: it
    must be callable with one argument, the request (a rule names whose
    budget a request spends once per request, so a wrong signature must
    fail where the rule is written, not as a 500 on the first request)."""
    if not callable(key) or isinstance(key, (str, bytes)):
        return f"must be a callable key(request) -> str, got {key!r}"
    try:
        signature = inspect.signature(key)
    except (TypeError, ValueError):  # a builtin without a signature: it is the caller's word
        return None
    try:
        signature.bind(None)
    except TypeError:
        return f"{_callable_name(key)}{signature} must take one argument, the request"
    return None


def _callable_name(fn: Any) -> str:
    return str(getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or type(fn).__name__)


def _status_set(value: Any) -> frozenset[int]:
    statuses = frozenset(value)
    for status in statuses:
        if isinstance(status, bool) or not isinstance(status, int) or not 100 <= status <= 599:
            raise ValidationError(f"a response status must be an int within 100-599, got {status!r}")
    if not statuses:
        raise ValidationError("count_when must name at least one status")
    return statuses


# ---------------------------------------------------------------------------
# Rules

# Rule names travel into headers (a structured-field string), JSON bodies and
# Prometheus labels: keep them to characters none of those need to escape.
_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.:@/+-]{0,127}\Z")  # \Z: "$" would accept a final newline
# An HTTP method is an RFC 9110 token; rules compare it upper-cased.
_METHOD_RE = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+\Z")


def _segments(prefix: str) -> tuple[tuple[str, ...], bool]:
    """A path prefix as (segments, needs_more): ``/api`` is (("api",), False)
    and matches ``/api`` and ``/api/...``; ``/api/`` is (("api",), True) and
    matches only ``/api/...``; ``/`` matches every path."""
    parts = prefix.split("/")[1:]
    if parts and parts[-1] == "":
        return tuple(parts[:-1]), True
    return tuple(parts), False


@dataclass(frozen=True, slots=True)
class RateLimitRule:
    """One limit: which requests (``method``, ``path_prefix``, ``tier``), whose
    budget (``scope``) and how much (``algorithm``, ``limit`` per
    ``window_seconds``, ``burst``).

    ``path_prefix`` matches at segment boundaries: ``/api`` covers ``/api``
    and ``/api/users`` but not ``/apiary`` (a plain string prefix would let
    an unrelated route share a budget). ``tier`` restricts the rule to
    requests of that tier (None: every tier). ``dry_run`` is shadow mode:
    decide and count, never reject. ``shape`` makes an admitted leaky-bucket
    request wait its ``delay`` instead of running at once.

    The rule's ``name`` is the limiter's state namespace: a reload that keeps
    name and algorithm keeps every key's spent budget (docs/spec.md §6).

    Declared next to routes, a rule matches ``routes`` (route templates, see
    :func:`route_key`) instead of its prefix. ``cost`` is what a request
    spends (an int, or ``cost(request) -> int`` for the adapters; the
    request's own ``cost`` multiplies it). ``count_when`` counts a request
    only if its response status is one of a set (or passes
    ``count_when(status) -> bool``): it is charged on entry, so concurrent
    requests never overspend, and refunded when the response does not
    count. Rules of one ``group`` (a rate list, a route's declarations)
    decide together, all or nothing.

    ``key(request) -> str`` names whose budget a request spends instead of
    ``scope`` (an API key's tenant, a session): it gets the framework's own
    request (:func:`nanolimit.gateway.keyfuncs.key_argument` says which)
    and must return a non-empty str of at most 256 UTF-8 bytes
    (:func:`nanolimit.gateway.keyfuncs.call_key`). It is checked when the
    rule is made: a callable that takes one argument.
    """

    name: str
    method: str
    path_prefix: str
    scope: KeyScope
    algorithm: Algorithm
    limit: int
    window_seconds: float
    burst: int | None = None
    tier: str | None = field(default=None, kw_only=True)
    dry_run: bool = field(default=False, kw_only=True)
    shape: bool = field(default=True, kw_only=True)
    cost: int | Callable[[Any], int] = field(default=1, kw_only=True)
    routes: tuple[str, ...] = field(default=(), kw_only=True)
    count_when: frozenset[int] | Callable[[int], bool] | None = field(default=None, kw_only=True)
    group: str | None = field(default=None, kw_only=True)
    key: Callable[[Any], str] | None = field(default=None, kw_only=True)
    _hash: int = field(default=0, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        name = self.name
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise RuleValidationError(
                str(name),
                "name",
                "must be 1-128 characters of letters, digits and _ . : @ / + - "
                "(it appears in headers, JSON and metric labels)",
            )
        setter = object.__setattr__
        method = self.method
        if not isinstance(method, str) or not _METHOD_RE.match(method):
            raise RuleValidationError(name, "method", f"must be an HTTP method or '*', got {method!r}")
        setter(self, "method", method.upper())
        prefix = self.path_prefix
        if not isinstance(prefix, str) or not prefix.startswith("/"):
            raise RuleValidationError(name, "path_prefix", f"must start with '/', got {prefix!r}")
        if "?" in prefix or "#" in prefix:
            raise RuleValidationError(
                name, "path_prefix", f"must be a path without query or fragment, got {prefix!r}"
            )
        if "//" in prefix:
            # requests are matched with repeated slashes collapsed
            # (normalize_path): so is the prefix, or it could never match
            prefix = normalize_path(prefix)
            setter(self, "path_prefix", prefix)
        try:
            setter(self, "scope", KeyScope(self.scope))
        except ValueError:
            known = ", ".join(s.value for s in KeyScope)
            raise RuleValidationError(
                name, "scope", f"unknown scope {self.scope!r}; expected one of: {known}"
            ) from None
        try:
            algorithm = Algorithm.parse(self.algorithm)
        except UnknownAlgorithmError as exc:
            raise RuleAlgorithmError(name, "algorithm", str(exc)) from None
        setter(self, "algorithm", algorithm)
        for fname in ("limit", "burst"):
            value = getattr(self, fname)
            if value is None and fname == "burst":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise RuleValidationError(name, fname, f"must be an int, got {type(value).__name__}")
            if value <= 0:
                raise RuleValidationError(name, fname, f"must be >= 1, got {value}")
        window = self.window_seconds
        if isinstance(window, bool) or not isinstance(window, (int, float)):
            raise RuleValidationError(
                name, "window_seconds", f"must be a number, got {type(window).__name__}"
            )
        # as_float: an int too large for a float (10**400) is inf, refused here
        if not math.isfinite(as_float(window)) or window <= 0:
            raise RuleValidationError(name, "window_seconds", f"must be finite and > 0, got {_shown(window)}")
        setter(self, "window_seconds", float(window))
        if self.tier is not None and (not isinstance(self.tier, str) or not self.tier):
            raise RuleValidationError(name, "tier", f"must be a non-empty str or None, got {self.tier!r}")
        for fname in ("dry_run", "shape"):
            if not isinstance(getattr(self, fname), bool):
                raise RuleValidationError(name, fname, f"must be a bool, got {getattr(self, fname)!r}")
        self._check_route_fields(setter)
        # LimiterConfig checks the fields together (ranges, and what each
        # algorithm can count). Built in stages, a fault is charged to the
        # field whose addition made it fail: the limit alone (a one-second
        # window and no burst fit every valid limit), then the window, then
        # the burst.
        stages: tuple[tuple[str, float, int | None], ...] = (
            ("limit", 1.0, None),
            ("window_seconds", self.window_seconds, None),
        )
        if self.burst is not None:
            stages += (("burst", self.window_seconds, self.burst),)
        for fname, window_, burst_ in stages:
            try:
                LimiterConfig.build(algorithm, self.limit, window_, burst_, name)
            except ValidationError as exc:
                raise RuleValidationError(name, fname, str(exc)) from None
        if type(self.cost) is int and self.cost > self.capacity:
            raise RuleValidationError(
                name, "cost", f"{self.cost} exceeds the capacity {self.capacity}: no request could pass"
            )
        setter(
            self,
            "_hash",
            hash(
                (
                    name,
                    self.method,
                    prefix,
                    self.scope,
                    algorithm,
                    self.limit,
                    self.window_seconds,
                    self.burst,
                    self.tier,
                    self.dry_run,
                    self.shape,
                    self.cost,
                    self.routes,
                    self.count_when,
                    self.group,
                    self.key,
                )
            ),
        )

    def _check_route_fields(self, setter: Callable[[Any, str, Any], None]) -> None:
        """``cost``, ``routes``, ``count_when``, ``group`` and ``key``:
        checked and put in the form the matcher compares."""
        name = self.name
        cost = self.cost
        if isinstance(cost, bool) or not (isinstance(cost, int) or callable(cost)):
            raise RuleValidationError(name, "cost", f"must be an int or a callable, got {cost!r}")
        if isinstance(cost, int) and cost <= 0:
            raise RuleValidationError(name, "cost", f"must be >= 1, got {cost}")
        routes = self.routes
        if isinstance(routes, str):
            routes = (routes,)
        try:
            keys = tuple(dict.fromkeys(route_key(r) for r in routes))
        except (TypeError, ValidationError) as exc:
            raise RuleValidationError(name, "routes", str(exc)) from None
        setter(self, "routes", keys)
        when = self.count_when
        if when is not None and not callable(when):
            try:
                setter(self, "count_when", _status_set(when if not isinstance(when, int) else (when,)))
            except (TypeError, ValidationError) as exc:
                raise RuleValidationError(
                    name, "count_when", f"must be response statuses or a callable: {exc}"
                ) from None
        group = self.group
        if group is not None and (not isinstance(group, str) or not group):
            raise RuleValidationError(name, "group", f"must be a non-empty str or None, got {group!r}")
        if self.key is not None:
            problem = key_function_problem(self.key)
            if problem is not None:
                raise RuleValidationError(name, "key", problem)

    def counts(self, status: int) -> bool:
        """Does a response of ``status`` spend this rule's budget?"""
        when = self.count_when
        if when is None:
            return True
        if type(when) is frozenset:
            return status in when
        return bool(when(status))  # type: ignore[operator]

    def __hash__(self) -> int:
        # Cached: rules are dict keys on the request path (the limiter cache).
        return self._hash

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuild through __init__: the cached hash of str fields differs
        # between processes (hash randomisation), so it must not be pickled.
        return (
            _restore_rule,
            (
                self.name,
                self.method,
                self.path_prefix,
                self.scope,
                self.algorithm,
                self.limit,
                self.window_seconds,
                self.burst,
                self.tier,
                self.dry_run,
                self.shape,
                self.cost,
                self.routes,
                self.count_when,
                self.group,
                self.key,
            ),
        )

    @classmethod
    def from_rate(
        cls,
        name: str,
        rate: str,
        *,
        method: str = "*",
        path_prefix: str = "/",
        scope: KeyScope | str = KeyScope.IP,
        algorithm: Algorithm | str = Algorithm.TOKEN_BUCKET,
        burst: int | None = None,
        tier: str | None = None,
        dry_run: bool = False,
        shape: bool = True,
        cost: int | Callable[[Any], int] = 1,
        routes: Iterable[str] | str = (),
        count_when: Iterable[int] | int | Callable[[int], bool] | None = None,
        group: str | None = None,
        key: Callable[[Any], str] | None = None,
    ) -> RateLimitRule:
        """A rule from a rate string: ``RateLimitRule.from_rate("api", "100/minute")``.
        Every other field of the rule is a keyword of the same name; ``burst``
        is the rate's own (``"100/minute burst 20"``) or the keyword, not both."""
        try:
            parsed = parse_rate(rate)
        except ValidationError as exc:
            raise RuleValidationError(name, "rate", str(exc)) from None
        if burst is not None and parsed.burst is not None:
            raise RuleValidationError(
                name, "burst", f"given twice: {rate!r} has a burst, and burst={burst!r}; give one"
            )
        return cls(
            name,
            method,
            path_prefix,
            scope,  # type: ignore[arg-type]  # validated and converted in __post_init__
            algorithm,  # type: ignore[arg-type]
            parsed.limit,
            parsed.window_seconds,
            parsed.burst if burst is None else burst,
            tier=tier,
            dry_run=dry_run,
            shape=shape,
            cost=cost,
            routes=routes,  # type: ignore[arg-type]  # a str or any iterable: made a tuple in __post_init__
            count_when=count_when,  # type: ignore[arg-type]  # made a frozenset in __post_init__
            group=group,
            key=key,
        )

    @property
    def capacity(self) -> int:
        """What one request is measured against (docs/spec.md §1)."""
        if self.burst is not None and self.algorithm in (Algorithm.TOKEN_BUCKET, Algorithm.GCRA):
            return self.burst
        return self.limit

    def matches(self, method: str, path: str, tier: str | None = None) -> bool:
        """Does this rule cover the request? Method ``*`` covers every method
        and ``GET`` covers ``HEAD`` too; the prefix matches the normalised
        path (:func:`normalize_path`) at segment boundaries; a tiered rule
        covers only requests of its tier."""
        wanted = method.upper()
        if self.method != "*" and self.method != wanted and not (self.method == "GET" and wanted == "HEAD"):
            return False
        if self.tier is not None and self.tier != tier:
            return False
        path = normalize_path(path)
        prefix = self.path_prefix
        if path == prefix:
            return True
        if not path.startswith(prefix):
            return False
        return prefix.endswith("/") or path[len(prefix)] == "/"

    def specificity(self) -> tuple[int, int]:
        """docs/spec.md §6: a longer prefix first; at equal length an exact method beats ``*``."""
        return (len(self.path_prefix), 0 if self.method == "*" else 1)

    def to_dict(self) -> dict[str, Any]:
        """The rule as a config-file table (the inverse of the loader)."""
        out: dict[str, Any] = {
            "name": self.name,
            "method": self.method,
            "path_prefix": self.path_prefix,
            "scope": self.scope.value,
            "algorithm": self.algorithm.value,
            "limit": self.limit,
            "window_seconds": self.window_seconds,
        }
        if self.burst is not None:
            out["burst"] = self.burst
        if self.tier is not None:
            out["tier"] = self.tier
        if self.dry_run:
            out["dry_run"] = True
        if not self.shape:
            out["shape"] = False
        if type(self.cost) is int and self.cost != 1:
            out["cost"] = self.cost
        if self.routes:
            out["routes"] = list(self.routes)
        if type(self.count_when) is frozenset:
            out["count_when"] = sorted(self.count_when)
        if self.group is not None:
            out["group"] = self.group
        return out


def _restore_rule(
    name: str,
    method: str,
    path_prefix: str,
    scope: KeyScope,
    algorithm: Algorithm,
    limit: int,
    window_seconds: float,
    burst: int | None,
    tier: str | None,
    dry_run: bool,
    shape: bool,
    cost: Any = 1,
    routes: tuple[str, ...] = (),
    count_when: Any = None,
    group: str | None = None,
    key: Any = None,
) -> RateLimitRule:
    return RateLimitRule(
        name,
        method,
        path_prefix,
        scope,
        algorithm,
        limit,
        window_seconds,
        burst,
        tier=tier,
        dry_run=dry_run,
        shape=shape,
        cost=cost,
        routes=routes,
        count_when=count_when,
        group=group,
        key=key,
    )
