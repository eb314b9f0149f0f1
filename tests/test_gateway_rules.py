"""Rules, rate strings, the indexed registry and the limiter factory (docs/spec.md §3, §6)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from gateway_helpers import rule
from hypothesis import given, settings
from hypothesis import strategies as st

from nanolimit._limiter_config import Algorithm
from nanolimit.errors import RuleNotFoundError, RuleValidationError, UnknownAlgorithmError, ValidationError
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import KeyScope, Rate, RateLimitRule, parse_rate

# -- rate strings ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5/minute", Rate(5, 60.0)),
        ("100 per 10 seconds", Rate(100, 10.0)),
        ("1000/hour", Rate(1000, 3600.0)),
        ("10/s burst 20", Rate(10, 1.0, 20)),
        ("10/s burst=20", Rate(10, 1.0, 20)),
        ("60 per hour", Rate(60, 3600.0)),
        ("5000/h", Rate(5000, 3600.0)),
        ("3/2m", Rate(3, 120.0)),
        ("1 PER DAY", Rate(1, 86400.0)),
        ("7/500ms", Rate(7, 0.5)),
        ("  42 / 1.5 min ", Rate(42, 90.0)),
    ],
)
def test_parse_rate_accepts_what_users_write(text: str, expected: Rate) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "5",
        "five/minute",
        "5/fortnight",
        "0/minute",
        "5/0 seconds",
        "-5/s",
        "5/s burst 0",
        "5/s burst",
        "5 minute",
        "5/s extra",
    ],
)
def test_parse_rate_rejects_anything_else_clearly(text: str) -> None:
    with pytest.raises(ValidationError, match="rate"):
        parse_rate(text)


def test_parse_rate_error_lists_the_forms() -> None:
    with pytest.raises(ValidationError) as info:
        parse_rate("lots per minute")
    assert "5/minute" in str(info.value) and "per" in str(info.value)


# -- rule validation ----------------------------------------------------------------


def test_rule_is_frozen_normalised_and_hashable() -> None:
    r = RateLimitRule("api", "get", "/api", "user", "gcra", 10, 60, 20)
    assert r.method == "GET" and r.scope is KeyScope.USER and r.algorithm is Algorithm.GCRA
    assert isinstance(r.window_seconds, float) and r.capacity == 20
    with pytest.raises(AttributeError):
        r.limit = 11  # type: ignore[misc]
    same = RateLimitRule("api", "GET", "/api", KeyScope.USER, Algorithm.GCRA, 10, 60.0, 20)
    assert same == r and hash(same) == hash(r)
    assert (
        RateLimitRule.from_rate(
            "api", "10/minute burst 20", method="GET", path_prefix="/api", scope="user", algorithm="gcra"
        )
        == r
    )


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"limit": 0}, "limit"),
        ({"limit": -3}, "limit"),
        ({"limit": 2.5}, "limit"),
        ({"limit": True}, "limit"),
        ({"window_seconds": 0}, "window_seconds"),
        ({"window_seconds": float("inf")}, "window_seconds"),
        ({"window_seconds": float("nan")}, "window_seconds"),
        ({"window_seconds": 10**400}, "window_seconds"),  # float() of it raises OverflowError
        ({"window_seconds": -(10**400)}, "window_seconds"),
        ({"window_seconds": "60"}, "window_seconds"),
        ({"burst": 0}, "burst"),
        ({"burst": 5, "algorithm": "fixed_window"}, "burst"),
        # faults only the limiter configuration finds: charged to the field
        # whose value made it fail, whatever its message says
        ({"limit": 1 << 32}, "limit"),
        ({"limit": (1 << 24) + 1, "algorithm": "sliding_log"}, "limit"),
        ({"window_seconds": 1e10}, "window_seconds"),
        ({"window_seconds": 1e-7}, "window_seconds"),
        ({"burst": 1 << 32}, "burst"),
        ({"limit": 1, "window_seconds": 1e9, "burst": 10, "algorithm": "gcra"}, "burst"),
        ({"limit": 1, "window_seconds": 1e9, "algorithm": "gcra"}, None),
        ({"path_prefix": "api"}, "path_prefix"),
        ({"path_prefix": "/api?x=1"}, "path_prefix"),
        ({"method": "GE T"}, "method"),
        ({"scope": "tenant"}, "scope"),
        ({"name": ""}, "name"),
        ({"name": 'bad"name'}, "name"),
        ({"tier": ""}, "tier"),
        ({"dry_run": "yes"}, "dry_run"),
    ],
)
def test_bad_rules_name_the_rule_and_the_field(kwargs: dict[str, object], field: str | None) -> None:
    args: dict[str, object] = {
        "name": "orders",
        "method": "POST",
        "path_prefix": "/orders",
        "scope": "user",
        "algorithm": "token_bucket",
        "limit": 5,
        "window_seconds": 60.0,
        "burst": None,
    }
    extra = {k: kwargs.pop(k) for k in ("tier", "dry_run") if k in kwargs}
    args.update(kwargs)
    if field is None:  # the same values without the fault build
        RateLimitRule(*args.values(), **extra)  # type: ignore[arg-type]
        return
    with pytest.raises(RuleValidationError) as info:
        RateLimitRule(*args.values(), **extra)  # type: ignore[arg-type]
    assert isinstance(info.value, ValidationError)
    assert info.value.field == field
    assert field in str(info.value)
    if field != "name":
        assert info.value.rule == "orders" and "'orders'" in str(info.value)


def test_unknown_algorithm_is_an_unknown_algorithm_error() -> None:
    with pytest.raises(UnknownAlgorithmError) as info:
        RateLimitRule("r", "*", "/", "ip", "leaky_faucet", 5, 1.0)
    assert "'r'" in str(info.value) and "algorithm" in str(info.value)


# -- matching -------------------------------------------------------------------------


def test_prefix_matches_at_segment_boundaries() -> None:
    r = rule("api", path_prefix="/api")
    assert r.matches("GET", "/api") and r.matches("get", "/api/users") and r.matches("GET", "/api/")
    assert not r.matches("GET", "/apiary") and not r.matches("GET", "/")
    slash = rule("api-slash", path_prefix="/api/")
    assert slash.matches("GET", "/api/x") and slash.matches("GET", "/api/")
    assert not slash.matches("GET", "/api")
    root = rule("root")
    assert root.matches("DELETE", "/") and root.matches("GET", "/anything/at/all")


def test_method_and_tier_filter() -> None:
    post = rule("post", method="POST")
    assert post.matches("POST", "/x") and post.matches("post", "/x") and not post.matches("GET", "/x")
    free = rule("free", tier="free")
    assert free.matches("GET", "/x", "free") and not free.matches("GET", "/x", "paid")
    assert not free.matches("GET", "/x")


def test_most_specific_rule_wins() -> None:
    rules = [
        rule("all"),
        rule("api", path_prefix="/api"),
        rule("api-post", method="POST", path_prefix="/api"),
        rule("users", path_prefix="/api/users"),
        rule("users-slash", path_prefix="/api/users/"),
    ]
    reg = RuleRegistry(rules)
    assert reg.rule_for("GET", "/").name == "all"
    assert reg.rule_for("GET", "/api").name == "api"
    assert reg.rule_for("POST", "/api/orders").name == "api-post"
    assert reg.rule_for("post", "/api/orders").name == "api-post"
    assert reg.rule_for("GET", "/api/users").name == "users"
    assert reg.rule_for("GET", "/api/users/7").name == "users-slash"
    # a longer prefix beats an exact method
    assert reg.rule_for("POST", "/api/users/7").name == "users-slash"
    assert reg.rule_for("GET", "/apiary").name == "all"


def test_default_and_rule_not_found() -> None:
    reg = RuleRegistry([rule("api", path_prefix="/api")])
    with pytest.raises(RuleNotFoundError):
        reg.rule_for("GET", "/other")
    fallback = rule("fallback", 1000, 3600.0)
    reg = RuleRegistry([rule("api", path_prefix="/api")], default=fallback)
    assert reg.rule_for("GET", "/other") is fallback
    assert reg.rule_for("GET", "/api/x").name == "api"
    assert RuleRegistry([], default=fallback).rule_for("PATCH", "/") is fallback


def test_tiers_give_one_route_a_limit_per_tier() -> None:
    rules = [
        rule("anon", 60, 3600.0, tier="anonymous"),
        rule("auth", 5000, 3600.0, tier="authenticated"),
        rule("search-anon", 10, 60.0, path_prefix="/search", tier="anonymous"),
        rule("login", 5, 60.0, path_prefix="/login"),
        rule("login-paid", 50, 60.0, path_prefix="/login", tier="paid"),
    ]
    reg = RuleRegistry(rules)
    assert reg.rule_for("GET", "/repos", "anonymous").name == "anon"
    assert reg.rule_for("GET", "/repos", "authenticated").name == "auth"
    assert reg.rule_for("GET", "/search/code", "anonymous").name == "search-anon"
    assert reg.rule_for("GET", "/search/code", "authenticated").name == "auth"
    # the tier filters first; then specificity; a tiered rule wins a tie
    assert reg.rule_for("POST", "/login", "anonymous").name == "login"
    assert reg.rule_for("POST", "/login", "paid").name == "login-paid"
    with pytest.raises(RuleNotFoundError):
        reg.rule_for("GET", "/repos", "enterprise")


def test_stacked_mode_returns_every_match_most_specific_first() -> None:
    rules = [
        rule("global", 1000, 60.0, scope="global"),
        rule("per-ip", 100, 60.0),
        rule("orders-user", 5, 60.0, method="POST", path_prefix="/orders", scope="user"),
    ]
    reg = RuleRegistry(rules, stacked=True)
    assert [r.name for r in reg.rules_for("POST", "/orders/1")] == ["orders-user", "global", "per-ip"]
    assert [r.name for r in reg.rules_for("GET", "/orders/1")] == ["global", "per-ip"]
    flat = RuleRegistry(rules)
    assert [r.name for r in flat.rules_for("POST", "/orders")] == ["orders-user"]


def test_duplicate_names_are_refused() -> None:
    with pytest.raises(RuleValidationError, match="share"):
        RuleRegistry([rule("a"), rule("a", path_prefix="/x")])


def test_a_default_named_like_a_rule_is_refused() -> None:
    # the name is the state namespace: a default "api" would spend rule "api"'s budget
    with pytest.raises(RuleValidationError, match="share"):
        RuleRegistry([rule("api", path_prefix="/api")], default=rule("api"))
    reg = RuleRegistry([rule("api", path_prefix="/api")], default=rule("fallback"))
    snap = reg.snapshot()
    with pytest.raises(RuleValidationError, match="share"):
        reg.replace([rule("fallback", path_prefix="/x")])  # the kept default clashes
    assert reg.snapshot() is snap
    fallback = rule("fallback")
    both = RuleRegistry([rule("api", path_prefix="/api"), fallback], default=fallback)  # the same rule: fine
    assert both.rule_for("GET", "/other") is fallback


def test_replace_swaps_the_whole_ruleset_and_keeps_the_old_on_error() -> None:
    reg = RuleRegistry([rule("old", path_prefix="/a")], default=rule("fallback"))
    before = reg.snapshot()
    reg.replace([rule("new", path_prefix="/a"), rule("b", path_prefix="/b")])
    assert reg.rule_for("GET", "/a").name == "new"
    assert reg.rule_for("GET", "/c").name == "fallback"  # default kept
    assert before.match("GET", "/a").name == "old"  # type: ignore[union-attr]  # a snapshot never changes
    snap = reg.snapshot()
    with pytest.raises(RuleValidationError):
        reg.replace([rule("x"), rule("x")])
    assert reg.snapshot() is snap
    reg.replace([], default=None)
    with pytest.raises(RuleNotFoundError):
        reg.rule_for("GET", "/a")


def test_a_reload_racing_a_declaration_loses_neither() -> None:
    """declare() (an app binding its route limits) and replace() (a rules
    file reloaded) each read the current set and assign a new one. One
    interleaved with the other assigned a set built on the old one: the
    reloaded file's rules vanished behind the declaration's. They take turns."""
    reg = RuleRegistry([rule("file-v1", path_prefix="/a")])
    started, go = threading.Event(), threading.Event()

    def slow_routes() -> Iterator[str]:  # declare() reads these while it builds its set
        started.set()
        assert go.wait(5)
        yield "/b"

    declaring = threading.Thread(
        target=reg.declare, args=([rule("route", path_prefix="/b")],), kwargs={"known_routes": slow_routes()}
    )
    declaring.start()
    assert started.wait(5)
    reloading = threading.Thread(target=reg.replace, args=([rule("file-v2", path_prefix="/a")],))
    reloading.start()
    reloading.join(0.3)
    go.set()
    declaring.join(5)
    reloading.join(5)
    assert {r.name for r in reg.rules()} == {"file-v2", "route"}


def test_replace_is_atomic_under_concurrent_lookups() -> None:
    # Two rulesets that differ in every rule: a reader must see all of one or
    # all of the other, never a mix.
    set_a = [rule(f"a{i}", path_prefix=f"/r{i}") for i in range(50)]
    set_b = [rule(f"b{i}", path_prefix=f"/r{i}") for i in range(50)]
    reg = RuleRegistry(set_a)
    stop = threading.Event()
    mixed: list[set[str]] = []

    def reader() -> None:
        for _ in range(2000):
            snap = reg.snapshot()
            seen = {snap.match("GET", f"/r{i}").name[0] for i in range(0, 50, 7)}  # type: ignore[union-attr]
            if len(seen) != 1:
                mixed.append(seen)

    def writer() -> None:
        n = 0
        while not stop.is_set() and n < 500:
            reg.replace(set_b if n % 2 == 0 else set_a)
            n += 1

    readers = [threading.Thread(target=reader) for _ in range(3)]
    w = threading.Thread(target=writer)
    for t in (*readers, w):
        t.start()
    for t in readers:
        t.join()
    stop.set()
    w.join()
    assert mixed == []


def test_thousand_rule_registry_matches_like_a_linear_scan() -> None:
    rules = [
        rule(f"r{i}", method=("GET", "POST", "*")[i % 3], path_prefix=f"/svc{i % 40}/res{i}")
        for i in range(1000)
    ]
    rules.append(rule("svc", path_prefix="/svc7"))
    reg = RuleRegistry(rules, cache_size=0)
    assert len(reg) == 1001
    for i in range(0, 1000, 37):
        for method in ("GET", "POST", "PUT"):
            path = f"/svc{i % 40}/res{i}/items/9"
            expected = _linear(rules, method, path)
            got = reg.snapshot().match(method, path)
            assert got is expected
    assert reg.rule_for("GET", "/svc7/nothing").name == "svc"
    assert reg.snapshot().match("GET", "/svc8/nothing") is None


def _linear(
    rules: list[RateLimitRule], method: str, path: str, tier: str | None = None
) -> RateLimitRule | None:
    best = None
    for r in rules:
        if r.matches(method, path, tier):
            key = (*r.specificity(), 0 if r.tier is None else 1)
            if best is None or key > best[0]:
                best = (key, r)
    return None if best is None else best[1]


_segment = st.sampled_from(["a", "b", "ab", "api", ""])
_prefix = st.lists(_segment, min_size=0, max_size=3).map(lambda s: "/" + "/".join(s))
_path = st.lists(_segment, min_size=0, max_size=4).map(lambda s: "/" + "/".join(s))


@settings(max_examples=150, deadline=None)
@given(
    specs=st.lists(
        st.tuples(_prefix, st.sampled_from(["GET", "POST", "*"]), st.sampled_from([None, "free", "paid"])),
        max_size=12,
    ),
    probes=st.lists(
        st.tuples(st.sampled_from(["GET", "POST", "DELETE"]), _path, st.sampled_from([None, "free"])),
        min_size=1,
        max_size=8,
    ),
)
def test_index_agrees_with_linear_scan(
    specs: list[tuple[str, str, str | None]], probes: list[tuple[str, str, str | None]]
) -> None:
    rules = [rule(f"r{i}", method=m, path_prefix=p, tier=t) for i, (p, m, t) in enumerate(specs)]
    for cache in (0, 16):
        reg = RuleRegistry(rules, cache_size=cache, stacked=True)
        for method, path, tier in probes * 2:  # twice: the cached answer too
            expected = _linear(rules, method, path, tier)
            assert reg.snapshot().match(method, path, tier) is expected
            every = [r for r in rules if r.matches(method, path, tier)]
            assert set(reg.rules_for(method, path, tier) if every else ()) == set(every)
            if every:
                assert reg.rules_for(method, path, tier)[0] is expected


# -- the factory ------------------------------------------------------------------------


def test_factory_caches_by_rule_value_and_prunes(backend) -> None:
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
    r = rule("orders", 5, 60.0, algorithm="sliding_counter")
    limiter = factory.for_rule(r)
    assert isinstance(limiter, backend.SlidingWindowCounter)
    assert limiter.rule == "orders" and limiter.limit == 5
    assert factory.for_rule(rule("orders", 5, 60.0, algorithm="sliding_counter")) is limiter
    raised = factory.for_rule(rule("orders", 10, 60.0, algorithm="sliding_counter"))
    assert raised is not limiter and raised.limit == 10
    assert len(factory) == 2
    assert factory.prune([rule("orders", 10, 60.0, algorithm="sliding_counter")]) == 1
    assert (
        len(factory) == 1
        and factory.for_rule(rule("orders", 10, 60.0, algorithm="sliding_counter")) is raised
    )


def test_an_edited_limit_keeps_spent_budget(backend) -> None:
    """docs/spec.md §6: raising a limit changes the ceiling, not the budget already spent."""
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))
    small = factory.for_rule(rule("api", 5, 60.0, algorithm="fixed_window"))
    for _ in range(5):
        assert small.allow("ip:1").allowed
    assert not small.allow("ip:1").allowed
    bigger = factory.for_rule(rule("api", 8, 60.0, algorithm="fixed_window"))
    assert [bigger.allow("ip:1").allowed for _ in range(4)] == [True, True, True, False]


def test_thousand_rules_cost_about_what_one_rule_costs() -> None:
    """The index, not a scan: uncached lookups over 1,000 rules stay within a
    small factor of one rule (a linear scan is ~100x slower). The bound is
    loose so that a busy machine cannot fail it."""
    import timeit

    one = RuleRegistry([rule("svc", path_prefix="/svc7")], cache_size=0)
    many_rules = [rule(f"r{i}", path_prefix=f"/svc{i % 40}/res{i}") for i in range(999)]
    many = RuleRegistry([*many_rules, rule("svc", path_prefix="/svc7")], cache_size=0)
    paths = [f"/svc7/res{(i * 40 + 7) % 999}/items/{i}" for i in range(500)]
    for reg in (one, many):
        assert all(reg.rule_for("GET", p) is not None for p in paths)

    def cost(reg: RuleRegistry) -> float:
        lookup = reg.rule_for
        return min(timeit.repeat(lambda: [lookup("GET", p) for p in paths], number=4, repeat=7))

    assert cost(many) < 4.0 * cost(one)


def test_rules_pickle_and_copy_by_value() -> None:
    import copy
    import pickle

    r = rule("api", 7, 30.0, method="POST", path_prefix="/api", scope="user", tier="paid", dry_run=True)
    for clone in (pickle.loads(pickle.dumps(r)), copy.deepcopy(r), copy.copy(r)):
        assert clone == r and hash(clone) == hash(r) and clone.tier == "paid" and clone.dry_run
