"""The registry that finds a request's rule, and the index it reads.

A :class:`RuleRegistry` answers ``rule_for(method, path)`` from an immutable
:class:`RuleSet` snapshot that ``replace`` swaps in one reference assignment,
so a hot reload is atomic: a request reads one snapshot, never half of two.

Matching is indexed: a trie keyed by path segment whose nodes hold the rules
ending there, pre-sorted by specificity per HTTP method. A lookup walks the
request path's segments (a handful of dict look-ups), whatever the number of
rules, and a bounded per-snapshot cache answers repeated (method, path, tier)
triples in one dict look-up. The rules themselves, and the path and route
templates they match, are in :mod:`nanolimit.gateway.rules`.
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterable
from typing import Any

from ..errors import RuleNotFoundError, RuleValidationError, ValidationError
from .rules import RateLimitRule, _segments, normalize_path, resolve_route, route_key

__all__ = [
    "CACHE_KEY_BYTES",
    "MAX_CACHED_KEY_BYTES",
    "ExemptRoute",
    "RuleRegistry",
    "RuleSet",
    "exempt_routes",
    "key_bytes",
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

    ``adds``: a route's rules add to what the prefix rules decide instead
    of replacing it (route limits declared beside global rules given
    apart, ``registry=`` and ``limits=`` on one front end).
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
        "adds",
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
        adds: bool = False,
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
        self.adds = bool(adds)
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
        # cache then keys by the route too (RateLimitPipeline)
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
        the route's whole answer (a route's declarations decide together;
        with ``adds``, followed by what the prefix rules decide);
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
        if own and not self.adds:
            return own
        best = self._walk(method, path, tier, True)
        if not best:
            return own if self.default is None else (*own, self.default)
        group = best[0].group
        if group is None:
            return (*own, best[0])
        return (*own, *(r for r in self._walk(method, path, tier, False) if r.group == group))

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

    __slots__ = ("_cache_bytes", "_cache_size", "_declared_exempt", "_writing", "declared", "ruleset")

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
        # replace() and declare() read the current set and assign a new one:
        # one at a time, or a reload racing an app's route limits drops one
        self._writing = threading.Lock()
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
        (see :meth:`declare`) are kept unless given, and so is whether
        route rules add to the prefix rules (:meth:`declare`'s ``adds``)."""
        with self._writing:
            return self._replace(rules, default, stacked, exempt, known_routes)

    def _replace(
        self, rules: Iterable[RateLimitRule], default: Any, stacked: Any, exempt: Any, known_routes: Any
    ) -> RuleSet:
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
            adds=current.adds,
        )
        self.ruleset = new
        return new

    def declare(
        self,
        rules: Iterable[RateLimitRule],
        *,
        exempt: Iterable[ExemptRoute] = (),
        known_routes: Iterable[str] | None = _KEEP,
        adds: bool = _KEEP,
    ) -> RuleSet:
        """Add the rules declared on an app's routes (and its exempt
        routes): kept by every later :meth:`replace`, so a reload of a
        rules file never drops a route's limit. ``known_routes`` is every
        template the app routes: each rule's and exemption's routes are
        then bound to the app's own (:func:`resolve_route`), here and in
        every later :meth:`replace`, and one naming no route is an error.
        ``adds``: route rules add to what the prefix rules decide, even
        unstacked (kept by later calls unless given)."""
        with self._writing:
            return self._declare(rules, exempt, known_routes, adds)

    def _declare(self, rules: Iterable[RateLimitRule], exempt: Any, known_routes: Any, adds: Any) -> RuleSet:
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
            adds=current.adds if adds is _KEEP else adds,
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
