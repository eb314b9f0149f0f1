"""Hostile input against the core API, fourth round: ``str`` subclasses as
keys (a key is its characters, whatever its type says about equality) and
rule names that would break the rate-limit headers. Every test runs on both
twins; the reference is the oracle, so the two must answer alike.
"""

from __future__ import annotations

import itertools
import re
import types
from typing import Any

import pytest
from _helpers import EqualsEverything

START = 1_800_000_000.0

_fresh_hashes = itertools.count()


class EqualsNothing(str):
    """A key that never equals anything, itself included, with a new hash each time."""

    def __eq__(self, other: object) -> bool:
        return False

    def __ne__(self, other: object) -> bool:
        return True

    def __hash__(self) -> int:
        return next(_fresh_hashes)


def test_str_subclass_keys_are_their_characters(backend: types.SimpleNamespace, limiter_cls: type) -> None:
    """A key that claims to equal every other neither reads another key's
    state nor is stored under its ``__format__`` text; one that equals
    nothing is still found by ``state``, ``peek`` and ``reset``. Before the
    fix the reference denied "b" on "a"'s spent budget and kept it as
    "formatted", where the native table (keyed by UTF-8 bytes) did neither."""
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage()
    limiter = limiter_cls(2, 60.0, storage, clock, rule="r")
    assert [limiter.allow(EqualsEverything("a")).allowed for _ in range(3)] == [True, True, False]
    assert limiter.allow(EqualsEverything("b")).allowed  # a budget of its own
    assert sorted(storage.keys()) == sorted(
        backend.storage_key(limiter.config.algorithm, "r", k) for k in ("a", "b")
    )
    assert limiter.state(EqualsNothing("a")) == limiter.state("a") is not None
    assert not limiter.peek(EqualsNothing("a")).allowed
    limiter.reset(EqualsNothing("a"))
    assert limiter.state("a") is None and limiter.allow("a").allowed


def test_compound_sees_a_str_subclass_duplicate(backend: types.SimpleNamespace) -> None:
    """The same key twice in one compound is refused however its type
    compares; before the fix the reference charged "c" twice in one request."""
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage()
    limiter = backend.TokenBucket(5, 60.0, storage, clock, rule="r")
    with pytest.raises(backend.ValidationError, match="twice"):
        storage.allow_all([(limiter, "c"), (limiter, EqualsNothing("c"))])
    assert len(storage) == 0


def test_batch_of_str_subclass_keys_matches_single_calls(backend: types.SimpleNamespace) -> None:
    clock = backend.FakeClock(START)
    limiter = backend.FixedWindowCounter(2, 60.0, backend.InMemoryStorage(), clock, rule="r")
    result = limiter.allow_many([EqualsEverything("x"), EqualsEverything("y"), EqualsNothing("x"), "x"])
    assert list(result.allowed) == [1, 1, 1, 0]


# ------------------------------------------------------------ header rendering

# RFC 8941 sf-string: printable ASCII, with only \" and \\ escaped
_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"')
HOSTILE_RULES = [
    'a"\r\nSet-Cookie: session=attacker',
    "tenant\nX-Injected: 1",
    'quote"inside',
    "back\\slash",
    "nul\x00byte",
    "naïve",
    "中文",
    "lone\udc80surrogate",
    "100%",
    "tab\there",
]


@pytest.mark.parametrize("rule", HOSTILE_RULES)
def test_headers_are_valid_for_any_rule_name(backend: types.SimpleNamespace, rule: str) -> None:
    """A bare limiter's rule is any str, and ``Decision.headers`` must still
    be valid header values: printable ASCII only (no CR/LF to split the
    response, nothing a Latin-1 server cannot encode), the name a
    well-formed sf-string. Before the fix the CR LF went into the header
    as is, so a tenant named in a rule could add a Set-Cookie."""
    limiter = backend.TokenBucket(1, 60.0, clock=backend.FakeClock(START), rule=rule)
    limiter.allow("k")
    headers = limiter.allow("k").headers(START)
    for value in headers.values():
        assert value.isascii() and value.isprintable(), value
    policy = _SF_STRING.match(headers["RateLimit-Policy"])
    assert policy is not None and headers["RateLimit-Policy"] == f'"{policy.group(1)}";q=1;w=60'
    ratelimit = _SF_STRING.match(headers["RateLimit"])
    assert ratelimit is not None and ratelimit.group(1) == policy.group(1)


def test_escaped_rule_names_stay_distinct(backend: types.SimpleNamespace) -> None:
    names = [*HOSTILE_RULES, "a%0D", "a\r", "%25", "%", "plain"]
    policies = [backend.Decision(False, 1, 0, 1.0, 1.0, n, 60.0).headers(START) for n in names]
    seen = {headers["RateLimit-Policy"] for headers in policies}
    assert len(seen) == len(names)


def test_valid_rule_names_render_unchanged(backend: types.SimpleNamespace) -> None:
    """Every name a RateLimitRule accepts needs no escaping: its header text is the name."""
    for name in ("api", "api:3600s", "user@v1/items+x-y.z"):
        headers = backend.Decision(True, 5, 4, 0.0, 12.0, name, 60.0).headers(START)
        assert headers["RateLimit-Policy"] == f'"{name}";q=5;w=60'
        assert headers["RateLimit"] == f'"{name}";r=4;t=12'


# ------------------------------------------------------------ batches


@pytest.mark.parametrize("keys", ["user42", b"user42", bytearray(b"user42")])
def test_one_key_is_not_a_batch_of_its_characters(backend: types.SimpleNamespace, keys: object) -> None:
    """``allow_many("user42")`` used to decide "u", "s", "e", "r", "4", "2"
    (six charges to six wrong keys, "user42" never limited); it is refused
    and nothing is stored."""
    storage = backend.InMemoryStorage()
    limiter = backend.TokenBucket(5, 60.0, storage, backend.FakeClock(START), rule="r")
    with pytest.raises(backend.ValidationError, match="sequence of keys"):
        limiter.allow_many(keys)
    with pytest.raises(backend.ValidationError, match="sequence of keys"):
        limiter.allow_many(5)
    assert len(storage) == 0


def test_batches_still_take_any_iterable_of_keys(backend: types.SimpleNamespace) -> None:
    limiter = backend.TokenBucket(2, 60.0, backend.InMemoryStorage(), backend.FakeClock(START), rule="r")
    assert list(limiter.allow_many(("a", "a")).allowed) == [1, 1]
    assert list(limiter.allow_many(k for k in ["a", "b"]).allowed) == [0, 1]
    assert list(limiter.allow_many({"b": 1}).allowed) == [1]
    assert len(limiter.allow_many([])) == 0


# ------------------------------------------------------------ rule names


def test_str_subclass_rule_is_its_characters(backend: types.SimpleNamespace) -> None:
    """A rule named by a str subclass that equals every other name keeps
    its own state. Before the fix the reference let rule "b" spend rule
    "a"'s budget (one namespace, picked by the subclass's __eq__/__hash__,
    stored under its __format__ text) and the native core raised TypeError."""
    storage = backend.InMemoryStorage()
    clock = backend.FakeClock(START)
    a = backend.TokenBucket(2, 60.0, storage, clock, rule="a")
    b = backend.TokenBucket(2, 60.0, storage, clock, rule=EqualsEverything("b"))
    assert a.allow("k").allowed and a.allow("k").allowed and not a.allow("k").allowed
    assert b.allow("k").allowed
    assert type(b.rule) is str and b.rule == "b" and b.allow("k").rule == "b"
    assert sorted(storage.keys()) == ["token_bucket:1:a:k", "token_bucket:1:b:k"]


# ------------------------------------------------------------ refunds


def test_refunds_are_trusted_below_a_fresh_budget(backend: types.SimpleNamespace, limiter_cls: type) -> None:
    """docs/algorithms.md, Refunds: a refund of a denied decision, repeated,
    hands back what it names (it once said it "cannot buy budget"), never
    more than a fresh key's budget."""
    limiter = limiter_cls(5, 60.0, backend.InMemoryStorage(), backend.FakeClock(START + 0.5), rule="r")
    assert sum(limiter.allow("k").allowed for _ in range(5)) == 5
    denied = limiter.allow("k")
    assert not denied.allowed
    for _ in range(3):
        limiter.refund("k", 1, at=denied.at)
    assert sum(limiter.allow("k").allowed for _ in range(6)) == 3
    for _ in range(20):
        limiter.refund("k", 5, at=denied.at)
    assert sum(limiter.allow("k").allowed for _ in range(10)) <= 5


# ------------------------------------------------------------ the idle sweep


def test_idle_sweep_keeps_a_key_in_debt(backend: types.SimpleNamespace, limiter_cls: type) -> None:
    """docs/limits_of_the_design.md: ``evict_idle_after`` shorter than a
    window forgets an idle key only once it is at rest. A spent 5-a-day
    key, idle 31 s under ``evict_idle_after=30``, had been forgotten and
    admitted 5 more; it now stays spent, and goes once it has refilled."""
    clock = backend.FakeClock(START)
    storage = backend.InMemoryStorage(stripes=1, evict_idle_after=30.0)
    limiter = limiter_cls(5, 86_400.0, storage, clock, rule="r")
    assert sum(limiter.allow("victim").allowed for _ in range(10)) == 5
    clock.advance(31.0)
    for i in range(20):  # other clients' new keys drive the sweep
        limiter.allow(f"other{i}")
    assert storage.stats()["evicted_idle"] == 0 and limiter.state("victim") is not None
    assert sum(limiter.allow("victim").allowed for _ in range(10)) == 0
    clock.advance(2 * 86_400.0)  # refilled (every algorithm): at rest, and idle
    for i in range(20, 40):
        limiter.allow(f"other{i}")
    assert limiter.state("victim") is None and storage.stats()["evicted_idle"] >= 1


class KeyTypeKernelStore:
    """A KernelStorage that records the type of every key it is handed and
    keeps its state in a dict by that key, as a Python store would."""

    def __init__(self) -> None:
        self.seen: list[type] = []
        self.spent: dict[str, int] = {}

    def run_kernel(
        self, config: Any, key: str, cost: int, now: float | None, commit: bool
    ) -> tuple[Any, ...]:
        self.seen.append(type(key))
        left = config.capacity - self.spent.get(key, 0)
        allowed = cost <= left
        if allowed and commit:
            self.spent[key] = self.spent.get(key, 0) + cost
        return (allowed, float(left - cost if allowed else left), 0.0 if allowed else 1.0, 1.0, 0.0)

    def run_kernel_many(self, config: Any, keys: Any, costs: Any, now: float | None) -> list[Any]:
        return [self.run_kernel(config, k, c, now, True) for k, c in zip(keys, costs)]

    def run_kernel_all(self, items: Any, now: float | None) -> list[Any]:
        return [self.run_kernel(cfg, k, c, now, True) for cfg, k, c in items]

    def forget(self, config: Any, key: str) -> None:
        self.seen.append(type(key))
        self.spent.pop(key, None)

    def snapshot(self, config: Any, key: str, now: float | None) -> Any:
        return None

    def apply(self, key: str, now: float, mutate: Any) -> Any:
        raise NotImplementedError("a kernel store")

    def evict_idle(self, cutoff: float) -> int:
        return 0

    def __len__(self) -> int:
        return len(self.spent)


def test_kernel_storage_is_handed_exact_str_keys(backend: types.SimpleNamespace) -> None:
    """A KernelStorage (Redis) names and stores a key in Python: the
    limiter hands it the key's characters, never the caller's subclass.
    Before the fix the native twin passed the subclass through, so a key
    equal to everything spent another key's budget in the store's dict
    (the reference already handed over a plain str)."""
    store = KeyTypeKernelStore()
    limiter = backend.TokenBucket(2, 60.0, store, backend.FakeClock(START), rule="r")
    assert limiter.allow("a", 2).allowed
    assert limiter.allow(EqualsEverything("b")).allowed and limiter.peek(EqualsEverything("b")).allowed
    limiter.allow_many([EqualsEverything("c")])
    limiter.reset(EqualsEverything("c"))
    assert store.seen and set(store.seen) == {str}
    assert store.spent == {"a": 2, "b": 1}
