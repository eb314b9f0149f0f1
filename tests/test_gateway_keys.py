"""Keys: scopes, the anonymous IP fallback, IPv6 prefix keying, trusted proxies."""

from __future__ import annotations

import pytest
from gateway_helpers import gateway, get, ok_handler, rule

from nanolimit._validation import MAX_KEY_BYTES
from nanolimit.errors import ValidationError
from nanolimit.gateway.keys import ClientKey, DefaultKeyExtractor
from nanolimit.gateway.middleware import Request
from nanolimit.gateway.rules import KeyScope


def test_client_key_storage_key_is_scoped_and_bounded() -> None:
    assert ClientKey(KeyScope.USER, "42").storage_key() == "user:42"
    assert ClientKey(KeyScope.IP, "42").storage_key() == "ip:42"
    huge = ClientKey(KeyScope.USER, "é" * 5000).storage_key()
    assert len(huge.encode()) <= 64 and huge.startswith("user#")
    assert huge == ClientKey(KeyScope.USER, "é" * 5000).storage_key()
    assert huge != ClientKey(KeyScope.USER, "é" * 5001).storage_key()
    assert len(ClientKey(KeyScope.USER, "\ud800" * 300).storage_key().encode()) < MAX_KEY_BYTES
    at_bound = ClientKey(KeyScope.USER, "a" * 256).storage_key()
    assert at_bound == "user:" + "a" * 256


def test_scopes_and_the_anonymous_fallback_to_ip() -> None:
    ex = DefaultKeyExtractor()
    anon = Request("GET", "/", {}, "198.51.100.7")
    assert ex.key_for(anon, KeyScope.USER) == ClientKey(KeyScope.IP, "198.51.100.7")
    assert ex.key_for(anon, KeyScope.API_KEY) == ClientKey(KeyScope.IP, "198.51.100.7")
    assert ex.key_for(anon, KeyScope.GLOBAL) == ClientKey(KeyScope.GLOBAL, "*")
    user = Request("GET", "/", {}, "198.51.100.7", user="alice")
    assert ex.key_for(user, KeyScope.USER) == ClientKey(KeyScope.USER, "alice")
    bearer = Request("GET", "/", {"authorization": "Bearer s3cret"}, "198.51.100.7")
    key = ex.key_for(bearer, KeyScope.API_KEY)
    assert key.scope is KeyScope.API_KEY and "s3cret" not in key.value  # secrets are stored hashed
    header = Request("GET", "/", {"x-api-key": "s3cret"}, "198.51.100.8")
    assert ex.key_for(header, KeyScope.API_KEY) == key  # same key, whichever header carried it
    for scope in KeyScope:
        for request in (anon, user, bearer, header):
            assert ex.storage_key_for(request, scope) == ex.key_for(request, scope).storage_key()


def test_tier_defaults_and_custom_tier() -> None:
    ex = DefaultKeyExtractor()
    assert ex.tier_for(Request("GET", "/", {}, "192.0.2.1")) == "anonymous"
    assert ex.tier_for(Request("GET", "/", {}, "192.0.2.1", user="bob")) == "authenticated"
    # an API key is unverified: an invented one must not lift the tier
    assert ex.tier_for(Request("GET", "/", {"x-api-key": "junk"}, "192.0.2.1")) == "anonymous"
    assert ex.tier_for(Request("GET", "/", {"authorization": "Bearer junk"}, "192.0.2.1")) == "anonymous"
    plans = {"k-paid": "paid"}
    custom = DefaultKeyExtractor(tier=lambda req, user, key: plans.get(key or "", "free"))
    assert custom.tier_for(Request("GET", "/", {"x-api-key": "k-paid"}, "192.0.2.1")) == "paid"
    assert custom.tier_for(Request("GET", "/", {}, "192.0.2.1")) == "free"


def test_the_default_tier_never_reads_the_api_key() -> None:
    """The default tier ignores API keys, so it must not run the api_key
    hook (an app's hook may be a database look-up); a custom tier gets it."""
    read: list[str] = []

    def api_key(request: Request) -> str | None:
        read.append(request.path)
        return "k-paid"

    ex = DefaultKeyExtractor(api_key=api_key)
    assert ex.tier_for(Request("GET", "/a", {}, "192.0.2.1", user="bob")) == "authenticated"
    assert ex.tier_for(Request("GET", "/b", {}, "192.0.2.1")) == "anonymous"
    assert read == []
    custom = DefaultKeyExtractor(
        api_key=api_key, tier=lambda req, user, key: "paid" if key == "k-paid" else "free"
    )
    assert custom.tier_for(Request("GET", "/c", {}, "192.0.2.1")) == "paid"
    assert read == ["/c"]


def test_ipv6_clients_are_keyed_by_their_64() -> None:
    ex = DefaultKeyExtractor()
    a = ex.key_for(Request("GET", "/", {}, "2001:db8:1:2:aaaa::1"), KeyScope.IP)
    b = ex.key_for(Request("GET", "/", {}, "2001:db8:1:2:ffff:ffff:ffff:ffff"), KeyScope.IP)
    c = ex.key_for(Request("GET", "/", {}, "2001:db8:1:3::1"), KeyScope.IP)
    assert a == b == ClientKey(KeyScope.IP, "2001:db8:1:2::/64")
    assert c != a
    mapped = ex.key_for(Request("GET", "/", {}, "::ffff:192.0.2.9"), KeyScope.IP)
    assert mapped == ClientKey(KeyScope.IP, "192.0.2.9")
    wide = DefaultKeyExtractor(ipv6_prefix=48, ipv4_prefix=24)
    assert wide.key_for(Request("GET", "/", {}, "2001:db8:1:3::1"), KeyScope.IP).value == "2001:db8:1::/48"
    assert wide.key_for(Request("GET", "/", {}, "192.0.2.77"), KeyScope.IP).value == "192.0.2.0/24"
    with pytest.raises(ValidationError):
        DefaultKeyExtractor(ipv6_prefix=0)


def test_one_host_cannot_escape_by_rotating_its_64(backend) -> None:
    mw = gateway(backend, [rule("per-ip", 3, 60.0)])
    statuses = [mw(get(client=f"2001:db8:0:1::{i:x}"), ok_handler).status for i in range(1, 6)]
    assert statuses == [200, 200, 200, 429, 429]
    assert mw(get(client="2001:db8:0:2::1"), ok_handler).status == 200


def test_forwarded_for_is_ignored_from_untrusted_peers() -> None:
    ex = DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"])
    spoof = Request("GET", "/", {"x-forwarded-for": "203.0.113.9"}, "198.51.100.7")
    assert ex.client_ip(spoof) == "198.51.100.7"
    no_proxies = DefaultKeyExtractor()
    via = Request("GET", "/", {"x-forwarded-for": "203.0.113.9"}, "10.1.2.3")
    assert no_proxies.client_ip(via) == "10.1.2.3"


def test_forwarded_for_is_walked_from_the_right_through_trusted_proxies() -> None:
    ex = DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8", "2001:db8:ffff::/48"])
    # client-written junk on the left, then the real client, then our proxies
    chain = "1.1.1.1, 203.0.113.9, 10.0.0.2"
    req = Request("GET", "/", {"x-forwarded-for": chain}, "10.0.0.1")
    assert ex.client_ip(req) == "203.0.113.9"
    assert ex.key_for(req, KeyScope.IP) == ClientKey(KeyScope.IP, "203.0.113.9")
    v6 = Request("GET", "/", {"x-forwarded-for": "2001:db8:5:6::7"}, "2001:db8:ffff::1")
    assert ex.key_for(v6, KeyScope.IP).value == "2001:db8:5:6::/64"
    garbage = Request("GET", "/", {"x-forwarded-for": "203.0.113.9, not-an-ip"}, "10.0.0.1")
    assert ex.client_ip(garbage) == "10.0.0.1"  # stop at the last address a proxy vouched for
    all_trusted = Request("GET", "/", {"x-forwarded-for": "10.9.9.9"}, "10.0.0.1")
    assert ex.client_ip(all_trusted) == "10.9.9.9"
    ported = Request("GET", "/", {"x-forwarded-for": "[2001:db8:7::1]:443"}, "10.0.0.1")
    assert ex.key_for(ported, KeyScope.IP).value == "2001:db8:7::/64"
    with pytest.raises(ValidationError):
        DefaultKeyExtractor(trusted_proxies=["not a network"])


def test_trusted_proxy_clients_get_their_own_budgets(backend) -> None:
    ex = DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"])
    mw = gateway(backend, [rule("per-ip", 2, 60.0)], extractor=ex)

    def via_proxy(client: str) -> int:
        return mw(get(client="10.0.0.1", x_forwarded_for=client), ok_handler).status

    assert [via_proxy("203.0.113.1") for _ in range(3)] == [200, 200, 429]
    assert via_proxy("203.0.113.2") == 200


def test_anonymous_callers_never_share_one_key(backend) -> None:
    mw = gateway(backend, [rule("per-user", 2, 60.0, scope="user")])
    assert [mw(get(client="192.0.2.1"), ok_handler).status for _ in range(3)] == [200, 200, 429]
    assert mw(get(client="192.0.2.2"), ok_handler).status == 200
    alice = Request("GET", "/", {}, "192.0.2.1", user="alice")
    assert mw(alice, ok_handler).status == 200  # the user has her own budget


def test_long_api_keys_are_hashed_but_never_cached() -> None:
    """The secret cache is keyed by the secret: 65,536 client-chosen 8 KB
    keys would hold half a gigabyte. Long ones are hashed every time."""
    ex = DefaultKeyExtractor()
    long_key = "k" * 8192
    request = Request("GET", "/", {"x-api-key": long_key}, "192.0.2.1")
    first = ex.storage_key_for(request, KeyScope.API_KEY)
    assert ex.storage_key_for(request, KeyScope.API_KEY) == first  # same key, same bucket
    assert long_key not in ex._secret_cache and len(ex._secret_cache) == 0
    short = Request("GET", "/", {"x-api-key": "short-key"}, "192.0.2.1")
    ex.storage_key_for(short, KeyScope.API_KEY)
    assert list(ex._secret_cache) == ["short-key"]


def test_a_value_utf8_cannot_hold_becomes_a_digest(backend) -> None:
    """A user id or peer address with a lone surrogate has no UTF-8 form: as
    a literal key the storage refuses it (a 500); as a digest it is keyed."""
    ex = DefaultKeyExtractor()
    odd = "bob\udc80"
    request = Request("GET", "/", {}, "192.0.2.1", user=odd)
    key = ex.storage_key_for(request, KeyScope.USER)
    assert key.startswith("user#") and key == ClientKey(KeyScope.USER, odd).storage_key()
    assert ex.storage_key_for(Request("GET", "/", {}, "192.0.2.1", user="bob\udc81"), KeyScope.USER) != key
    assert ClientKey(KeyScope.USER, "zoë").storage_key() == "user:zoë"  # encodable: kept literal
    limiter = backend.TokenBucket(1, 60.0)
    assert limiter.allow(key).allowed and not limiter.allow(key).allowed
