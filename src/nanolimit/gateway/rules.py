"""Rules: which limit applies to a request, and the registry that finds it.

A :class:`RateLimitRule` is a frozen, self-validating value (docs/spec.md §3, §6). A
:class:`RuleRegistry` answers ``rule_for(method, path)`` from an immutable
:class:`RuleSet` snapshot that ``replace`` swaps in one reference assignment,
so a hot reload is atomic: a request reads one snapshot, never half of two.

Matching is indexed: a trie keyed by path segment whose nodes hold the rules
ending there, pre-sorted by specificity per HTTP method. A lookup walks the
request path's segments (a handful of dict look-ups), whatever the number of
rules, and a bounded per-snapshot cache answers repeated (method, path, tier)
triples in one dict look-up.

Rules match the path the frameworks route, not the bytes a client sent:
:func:`normalize_path` is the one place that turns one into the other
(repeated slashes collapse, a missing leading ``/`` is supplied), and a
``GET`` rule covers ``HEAD`` (HTTP's GET without the body, which Starlette,
Flask and Django answer with the GET handler).
"""

from __future__ import annotations

import enum
import math
import re
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .._limiter_config import Algorithm, LimiterConfig
from ..errors import (
    RuleAlgorithmError,
    RuleNotFoundError,
    RuleValidationError,
    UnknownAlgorithmError,
    ValidationError,
)
from .rates import Rate, parse_rate

__all__ = [
    "KeyScope",
    "Rate",
    "RateLimitRule",
    "RuleRegistry",
    "RuleSet",
    "normalize_path",
    "parse_rate",
]

# The caches on the request path are bounded by entries AND by bytes: a flood
# of unique long paths (or methods) must cost lookups, never memory. A key
# whose strings take more than MAX_CACHED_KEY_BYTES is matched on every
# request and never cached; the keys a cache holds take at most
# CACHE_KEY_BYTES in all (then it starts over).
MAX_CACHED_KEY_BYTES = 1024
CACHE_KEY_BYTES = 1 << 20
_sizeof = sys.getsizeof
_STR_OVERHEAD = _sizeof("")


def key_bytes(method: str, path: str, tier: str | None) -> int:
    """What a cache key's strings take beyond an empty str each (their
    characters as CPython stores them: 1, 2 or 4 bytes each)."""
    n = _sizeof(method) + _sizeof(path) - 2 * _STR_OVERHEAD
    if tier is not None:
        n += _sizeof(tier) - _STR_OVERHEAD
    return n


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
        if not math.isfinite(window) or window <= 0:
            raise RuleValidationError(name, "window_seconds", f"must be finite and > 0, got {window!r}")
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
                )
            ),
        )

    def _check_route_fields(self, setter: Callable[[Any, str, Any], None]) -> None:
        """``cost``, ``routes``, ``count_when`` and ``group``: checked and
        put in the form the matcher compares."""
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
        tier: str | None = None,
        dry_run: bool = False,
        shape: bool = True,
    ) -> RateLimitRule:
        """A rule from a rate string: ``RateLimitRule.from_rate("api", "100/minute")``."""
        try:
            parsed = parse_rate(rate)
        except ValidationError as exc:
            raise RuleValidationError(name, "rate", str(exc)) from None
        return cls(
            name,
            method,
            path_prefix,
            scope,  # type: ignore[arg-type]  # validated and converted in __post_init__
            algorithm,  # type: ignore[arg-type]
            parsed.limit,
            parsed.window_seconds,
            parsed.burst,
            tier=tier,
            dry_run=dry_run,
            shape=shape,
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
    )


def _rank(rule: RateLimitRule) -> tuple[int, int, int]:
    """Sort key, best first when reversed: specificity, then a tiered rule
    before an untiered one of the same specificity."""
    length, exact = rule.specificity()
    return (length, exact, 0 if rule.tier is None else 1)


def _head_rank(rule: RateLimitRule) -> tuple[int, int, int]:
    """:func:`_rank` for a HEAD request: at equal prefix length an explicit
    ``HEAD`` rule beats the ``GET`` rule (which covers HEAD), which beats ``*``."""
    length, exact = rule.specificity()
    return (length, exact + (rule.method == "HEAD"), 0 if rule.tier is None else 1)


# ---------------------------------------------------------------------------
# The index


class _Node:
    """One path segment of the trie. ``ends[method]`` lists, best first, the
    rules whose prefix ends here and that cover ``method`` (the ``"*"`` entry
    serves every method without its own list)."""

    __slots__ = ("children", "ends")

    def __init__(self) -> None:
        self.children: dict[str, _Node] = {}
        self.ends: dict[str, tuple[tuple[RateLimitRule, bool], ...]] = {}


_MISSING: Any = object()

# An exempt route: a template (every method), or a template and the methods
# its route answers, when another route shares the template (Flask's
# ``/x`` GET and POST bound to two views): exempting one is not the other.
ExemptRoute = str | tuple[str, frozenset[str]]


def exempt_routes(exempt: Iterable[ExemptRoute] | str) -> frozenset[ExemptRoute]:
    """Exempt routes in canonical form (:func:`route_key`, methods upper-cased)."""
    if isinstance(exempt, str):
        exempt = (exempt,)
    out: set[ExemptRoute] = set()
    for entry in exempt:
        if isinstance(entry, tuple):
            template, methods = entry
            if isinstance(methods, str) or not all(isinstance(m, str) for m in methods):
                raise ValidationError(f"exempt: the methods of {template!r} must be strs, got {methods!r}")
            out.add((route_key(template), frozenset(m.upper() for m in methods)))
        else:
            out.add(route_key(entry))
    return frozenset(out)


def _by_method(
    by_method: dict[str, list[tuple[RateLimitRule, bool]]],
) -> dict[str, tuple[tuple[RateLimitRule, bool], ...]]:
    """One trie node's (or route's) rules per method, best first: ``*``
    rules join every method's list, and HEAD is GET without the body,
    answered by the GET handler, so a GET rule covers HEAD and both spend
    the same budget."""
    ends: dict[str, tuple[tuple[RateLimitRule, bool], ...]] = {}
    star = by_method.get("*", [])
    for method, entries in by_method.items():
        if method == "HEAD":
            continue  # merged with GET below
        merged = entries if method == "*" else entries + star
        merged.sort(key=lambda e: _rank(e[0]), reverse=True)
        ends[method] = tuple(merged)
    if "GET" in by_method or "HEAD" in by_method:
        head = by_method.get("HEAD", []) + by_method.get("GET", []) + star
        head.sort(key=lambda e: _head_rank(e[0]), reverse=True)
        ends["HEAD"] = tuple(head)
    return ends


class RuleSet:
    """An immutable, indexed set of rules: what one request reads.

    ``match`` returns the most specific rule (or the default, or None);
    ``match_all`` returns every matching rule, most specific first (stacked
    mode). Both cost O(path segments), not O(rules).
    """

    __slots__ = (
        "_cache",
        "_cache_all",
        "_cache_all_bytes",
        "_cache_bytes",
        "_cache_max_bytes",
        "_cache_size",
        "_exempt",
        "_root",
        "_route_index",
        "default",
        "exempt",
        "has_tiers",
        "known_routes",
        "routed",
        "rules",
        "stacked",
    )

    def __init__(
        self,
        rules: Iterable[RateLimitRule] = (),
        default: RateLimitRule | None = None,
        *,
        stacked: bool = False,
        cache_size: int = 4096,
        cache_bytes: int = CACHE_KEY_BYTES,
        exempt: Iterable[ExemptRoute] = (),
        known_routes: Iterable[str] | None = None,
    ) -> None:
        if isinstance(rules, RateLimitRule):
            rules = (rules,)  # RuleRegistry(rule): one rule is a ruleset of one
        rules = tuple(rules)
        self.known_routes = None if known_routes is None else frozenset(map(route_key, known_routes))
        self.exempt = exempt_routes(exempt)
        # exempt route -> the methods it is exempt for (None: every method)
        self._exempt: dict[str, frozenset[str] | None] = {}
        for entry in self.exempt:
            template, methods = (entry, None) if isinstance(entry, str) else entry
            try:
                keys = self._bind_route(template)
            except ValidationError as exc:
                raise ValidationError(f"exempt: {exc}") from None
            for key in keys:
                held = self._exempt.get(key, frozenset())
                self._exempt[key] = None if methods is None or held is None else held | methods
        seen: set[str] = set()
        # The default counts once: listing it among the rules as well is
        # harmless, but a different rule under its name would share its state.
        extra = () if default is None or any(r is default for r in rules) else (default,)
        for rule in (*rules, *extra):
            if not isinstance(rule, RateLimitRule):
                raise ValidationError(f"expected RateLimitRule, got {type(rule).__name__}")
            if rule.name in seen:
                raise RuleValidationError(
                    rule.name, "name", "two rules share this name (it is their state namespace)"
                )
            seen.add(rule.name)
        self.rules = rules
        self.default = default
        self.stacked = bool(stacked)
        self.has_tiers = any(r.tier is not None for r in rules)
        self._cache_size = cache_size
        self._cache_max_bytes = cache_bytes
        self._cache_bytes = 0
        self._cache_all_bytes = 0
        self._cache: dict[tuple[str, str, str | None], RateLimitRule | None] = {}
        self._cache_all: dict[tuple[str, str, str | None], tuple[RateLimitRule, ...]] = {}
        root = _Node()
        pending: dict[int, dict[str, list[tuple[RateLimitRule, bool]]]] = {}
        nodes: dict[int, _Node] = {}
        by_route: dict[str, dict[str, list[tuple[RateLimitRule, bool]]]] = {}
        for rule in rules:
            if rule.routes:  # declared on routes: matched by route, never by prefix
                for template in rule.routes:
                    try:
                        keys = self._bind_route(template)
                    except ValidationError as exc:
                        raise RuleValidationError(rule.name, "routes", str(exc)) from None
                    for key in keys:
                        by_route.setdefault(key, {}).setdefault(rule.method, []).append((rule, False))
                continue
            segs, needs_more = _segments(rule.path_prefix)
            node = root
            for seg in segs:
                child = node.children.get(seg)
                if child is None:
                    child = node.children[seg] = _Node()
                node = child
            nodes[id(node)] = node
            pending.setdefault(id(node), {}).setdefault(rule.method, []).append((rule, needs_more))
        for node_id, by_method in pending.items():
            nodes[node_id].ends = _by_method(by_method)
        self._root = root
        self._route_index = {template: _by_method(entries) for template, entries in by_route.items()}
        # whether the matched route decides anything: the pipeline's route
        # cache then keys by the route too (RateLimitMiddleware)
        self.routed = bool(self._route_index or self._exempt)

    def _bind_route(self, template: str) -> tuple[str, ...]:
        """The app's routes that a rule or exemption names: itself, when no
        route table is known; else as :func:`resolve_route` finds them, and
        one that names no route of the app is an error."""
        known = self.known_routes
        if known is None:
            return (route_key(template),)
        found = resolve_route(template, known)
        if not found:
            raise ValidationError(f"{template!r} matches no route of the app")
        return found

    def _walk(self, method: str, path: str, tier: str | None, first: bool) -> list[RateLimitRule]:
        """Every matching rule, most specific first (or only the best one),
        for an upper-cased method, on the :func:`normalize_path` of ``path``.

        The normal path pays nothing for normalisation: no node has an empty
        segment as a child (prefixes are normalised too), so the walk of a
        path with ``//`` stops at an empty segment; only then, or when the
        leading ``/`` is missing, is the path normalised and walked again."""
        found: list[RateLimitRule] = []
        segs = path.split("/")
        n = len(segs) - 1  # segments after the leading "/"
        if segs[0] or not n:  # no leading "/" (or the empty path)
            return self._walk(method, normalize_path(path), tier, first)
        node: _Node | None = self._root
        depth = 0
        while node is not None:
            ends = node.ends
            if ends:
                entries = ends.get(method)
                if entries is None:
                    entries = ends.get("*")
                if entries:
                    for rule, needs_more in entries:
                        if needs_more and n <= depth:
                            continue
                        if rule.tier is not None and rule.tier != tier:
                            continue
                        if first:
                            found = [rule]  # deeper nodes are more specific
                            break
                        found.append(rule)
            depth += 1
            if depth > n:
                break
            node = node.children.get(segs[depth])
        if depth < n and not segs[depth]:
            # stopped at an empty segment that is not the trailing slash: "//"
            return self._walk(method, normalize_path(path), tier, first)
        if not first:
            found.sort(key=_head_rank if method == "HEAD" else _rank, reverse=True)
        return found

    def route_rules(self, route: str) -> tuple[RateLimitRule, ...]:
        """The rules declared on a route template (any method or tier)."""
        ends = self._route_index.get(route_key(route))
        if not ends:
            return ()
        return tuple(dict.fromkeys(rule for entries in ends.values() for rule, _ in entries))

    def routes(self) -> frozenset[str]:
        """Every route template a rule names (canonical, :func:`route_key`)."""
        return frozenset(self._route_index)

    def lookup_route(
        self, method: str, path: str, tier: str | None = None, route: str | None = None
    ) -> tuple[RateLimitRule, ...]:
        """Every rule that decides a request, uncached: the pipeline's one
        lookup (it caches the answer by the request's method, path and tier).

        ``route`` is the framework's matched template. An exempt route gets
        none. Rules declared on the route come first and, unstacked, are
        the route's whole answer (a route's declarations decide together);
        otherwise the most specific prefix rule decides, with the rest of
        its ``group`` (a rate list); stacked, every match applies."""
        method = method.upper()
        own: tuple[RateLimitRule, ...] = ()
        if route is not None and self.routed:
            key = route_key(route)
            exempt = self._exempt.get(key, _MISSING)
            if exempt is not _MISSING and (exempt is None or method in exempt):
                return ()
            ends = self._route_index.get(key)
            if ends:
                entries = ends.get(method)
                if entries is None:
                    entries = ends.get("*", ())
                own = tuple(r for r, _ in entries if r.tier is None or r.tier == tier)
        if self.stacked:
            found = own + tuple(self._walk(method, path, tier, False))
            return found if found else (() if self.default is None else (self.default,))
        if own:
            return own
        best = self._walk(method, path, tier, True)
        if not best:
            return () if self.default is None else (self.default,)
        group = best[0].group
        if group is None:
            return (best[0],)
        return tuple(r for r in self._walk(method, path, tier, False) if r.group == group)

    def lookup(self, method: str, path: str, tier: str | None = None) -> RateLimitRule | None:
        """:meth:`match` without the cache, for a caller that keeps its own
        (the pipeline's route cache): a route is then cached once, not in
        both. Walks the normalised path (:meth:`_walk`)."""
        found = self._walk(method.upper(), path, tier, True)
        return found[0] if found else self.default

    def lookup_all(self, method: str, path: str, tier: str | None = None) -> tuple[RateLimitRule, ...]:
        """:meth:`match_all` without the cache (see :meth:`lookup`)."""
        found = self._walk(method.upper(), path, tier, False)
        return tuple(found) if found else (() if self.default is None else (self.default,))

    def match(self, method: str, path: str, tier: str | None = None) -> RateLimitRule | None:
        """The most specific rule covering the request, else the default, else None.

        Cached by the request's own ``(method, path, tier)``, so a hit costs
        one dict look-up and no normalisation; a miss is a :meth:`lookup`."""
        key = (method, path, tier)
        hit = self._cache.get(key, _MISSING)
        if hit is not _MISSING:
            return hit  # type: ignore[no-any-return]
        rule = self.lookup(method, path, tier)
        if self._cache_size:
            size = key_bytes(method, path, tier)
            if size <= MAX_CACHED_KEY_BYTES:
                cache = self._cache
                if len(cache) >= self._cache_size or self._cache_bytes + size > self._cache_max_bytes:
                    cache.clear()  # bounded: hostile unique paths cost a miss, never memory
                    self._cache_bytes = 0
                cache[key] = rule
                self._cache_bytes += size
        return rule

    def match_all(self, method: str, path: str, tier: str | None = None) -> tuple[RateLimitRule, ...]:
        """Every rule covering the request, most specific first; the default
        alone when none does; empty when there is no default either."""
        key = (method, path, tier)
        hit = self._cache_all.get(key)
        if hit is not None:
            return hit
        rules = self.lookup_all(method, path, tier)
        if self._cache_size:
            size = key_bytes(method, path, tier)
            if size <= MAX_CACHED_KEY_BYTES:
                cache = self._cache_all
                if len(cache) >= self._cache_size or self._cache_all_bytes + size > self._cache_max_bytes:
                    cache.clear()
                    self._cache_all_bytes = 0
                cache[key] = rules
                self._cache_all_bytes += size
        return rules

    def cached_key_bytes(self) -> int:
        """What the keys of both lookup caches take now (see :func:`key_bytes`)."""
        return self._cache_bytes + self._cache_all_bytes

    def __len__(self) -> int:
        return len(self.rules)

    def __repr__(self) -> str:
        default = None if self.default is None else self.default.name
        return f"<RuleSet rules={len(self.rules)} default={default!r} stacked={self.stacked}>"


_KEEP: Any = object()


class RuleRegistry:
    """The live ruleset of a gateway; ``replace`` swaps it atomically.

    In ``stacked`` mode every matching rule applies to a request (compound
    limits); otherwise the most specific one does (docs/spec.md §6).
    """

    __slots__ = ("_cache_bytes", "_cache_size", "_declared_exempt", "declared", "ruleset")

    # what the declared exemptions are kept as (see :func:`exempt_routes`)
    _declared_exempt: frozenset[ExemptRoute]

    def __init__(
        self,
        rules: Iterable[RateLimitRule] | RateLimitRule = (),
        default: RateLimitRule | None = None,
        *,
        stacked: bool = False,
        cache_size: int = 4096,
        cache_bytes: int = CACHE_KEY_BYTES,
        exempt: Iterable[ExemptRoute] = (),
    ) -> None:
        if isinstance(cache_size, bool) or not isinstance(cache_size, int) or cache_size < 0:
            raise ValidationError(f"cache_size must be an int >= 0, got {cache_size!r}")
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValidationError(f"cache_bytes must be an int >= 0, got {cache_bytes!r}")
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        # rules declared on routes (nanolimit.gateway.routes): every replace() keeps them
        self.declared: tuple[RateLimitRule, ...] = ()
        self._declared_exempt = frozenset()
        # The current snapshot: read it once per request (the pipeline does);
        # assign it only through replace(), which validates first.
        self.ruleset = RuleSet(
            rules,  # type: ignore[arg-type]  # one rule is accepted too (RuleSet wraps it)
            default,
            stacked=stacked,
            cache_size=cache_size,
            cache_bytes=cache_bytes,
            exempt=exempt,
        )

    def snapshot(self) -> RuleSet:
        """The current ruleset; read it once per request."""
        return self.ruleset

    @property
    def default(self) -> RateLimitRule | None:
        return self.ruleset.default

    @property
    def stacked(self) -> bool:
        return self.ruleset.stacked

    def rules(self) -> tuple[RateLimitRule, ...]:
        """The current rules (without the default)."""
        return self.ruleset.rules

    def rule_for(self, method: str, path: str, tier: str | None = None) -> RateLimitRule:
        """The most specific rule for the request (docs/spec.md §6); the default when
        none matches; :class:`RuleNotFoundError` when there is no default."""
        rule = self.ruleset.match(method, path, tier)
        if rule is None:
            raise RuleNotFoundError(
                f"no rule matches {method} {path} (tier {tier!r}) and there is no default"
            )
        return rule

    def rules_for(self, method: str, path: str, tier: str | None = None) -> tuple[RateLimitRule, ...]:
        """Every rule that applies to the request: all matches in stacked
        mode, the most specific one otherwise. Raises like :meth:`rule_for`."""
        ruleset = self.ruleset
        if ruleset.stacked:
            rules = ruleset.match_all(method, path, tier)
        else:
            one = ruleset.match(method, path, tier)
            rules = () if one is None else (one,)
        if not rules:
            raise RuleNotFoundError(
                f"no rule matches {method} {path} (tier {tier!r}) and there is no default"
            )
        return rules

    def replace(
        self,
        rules: Iterable[RateLimitRule],
        *,
        default: RateLimitRule | None = _KEEP,
        stacked: bool = _KEEP,
        exempt: Iterable[ExemptRoute] = _KEEP,
        known_routes: Iterable[str] | None = _KEEP,
    ) -> RuleSet:
        """Swap in a new ruleset in one assignment (hot reload). The new set
        is built and validated first, so a bad ruleset changes nothing.
        ``default``, ``stacked``, ``exempt`` and the app's ``known_routes``
        (see :meth:`declare`) are kept unless given."""
        current = self.ruleset
        declared = set(self.declared)
        if isinstance(rules, RateLimitRule):
            rules = (rules,)
        new = RuleSet(
            (*(r for r in rules if r not in declared), *self.declared),
            current.default if default is _KEEP else default,
            stacked=current.stacked if stacked is _KEEP else stacked,
            cache_size=self._cache_size,
            cache_bytes=self._cache_bytes,
            exempt=current.exempt if exempt is _KEEP else exempt_routes(exempt) | self._declared_exempt,
            known_routes=current.known_routes if known_routes is _KEEP else known_routes,
        )
        self.ruleset = new
        return new

    def declare(
        self,
        rules: Iterable[RateLimitRule],
        *,
        exempt: Iterable[ExemptRoute] = (),
        known_routes: Iterable[str] | None = _KEEP,
    ) -> RuleSet:
        """Add the rules declared on an app's routes (and its exempt
        routes): kept by every later :meth:`replace`, so a reload of a
        rules file never drops a route's limit. ``known_routes`` is every
        template the app routes: each rule's and exemption's routes are
        then bound to the app's own (:func:`resolve_route`), here and in
        every later :meth:`replace`, and one naming no route is an error."""
        rules = tuple(rules)
        keys = exempt_routes(exempt)
        current = self.ruleset
        kept = [r for r in current.rules if r not in set(self.declared)]
        new = RuleSet(
            (*kept, *rules),
            current.default,
            stacked=current.stacked,
            cache_size=self._cache_size,
            cache_bytes=self._cache_bytes,
            exempt=(current.exempt - self._declared_exempt) | keys,
            known_routes=current.known_routes if known_routes is _KEEP else known_routes,
        )
        self.declared = rules
        self._declared_exempt = keys
        self.ruleset = new
        return new

    @property
    def declared_exempt(self) -> frozenset[ExemptRoute]:
        """The exempt routes declared on an app's routes (kept by :meth:`replace`)."""
        return self._declared_exempt

    def __len__(self) -> int:
        return len(self.ruleset.rules)

    def __repr__(self) -> str:
        return f"<RuleRegistry {self.ruleset!r}>"
