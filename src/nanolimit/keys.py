"""Keys: whose budget a request spends.

:class:`DefaultKeyExtractor` turns a request into a :class:`ClientKey` for a
rule's scope. The client IP comes from the connection; ``X-Forwarded-For`` is
believed only when the connection comes from a configured proxy network (any
client can write that header). IPv6 clients are keyed by their network
prefix (default /64): a single host owns a whole /64 and could otherwise
rotate through 2**64 addresses to escape a per-IP limit. An anonymous caller
under a ``user`` or ``api_key`` rule is keyed by its IP, never by one shared
"anonymous" key that would let one abuser lock everyone out.
"""

from __future__ import annotations

import hashlib
import ipaddress
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol, runtime_checkable

from ._shared import ValidationError
from .rules import KeyScope

if TYPE_CHECKING:
    from .middleware import Request

__all__ = [
    "ANONYMOUS",
    "AUTHENTICATED",
    "ClientKey",
    "DefaultKeyExtractor",
    "KeyExtractor",
    "bearer_or_api_key",
    "request_user",
]

ANONYMOUS = "anonymous"
AUTHENTICATED = "authenticated"

# Values longer than this (UTF-8 bytes) are stored as a digest, so a storage
# key stays far below the 1,024-byte key limit whatever a client sends.
MAX_VALUE_BYTES = 256
_IP_CACHE_SIZE = 65536
_SECRET_CACHE_LENGTH = 256  # longer API keys are hashed on every request, never cached
# Enum attribute access costs ~90 ns on CPython 3.11: compare against locals.
_IP = KeyScope.IP
_GLOBAL = KeyScope.GLOBAL
_USER = KeyScope.USER
_API_KEY = KeyScope.API_KEY


def _digest(value: str) -> str:
    raw = value.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class ClientKey(NamedTuple):
    """A caller's identity inside one scope: ``ClientKey(KeyScope.USER, "42")``."""

    scope: KeyScope
    value: str

    def storage_key(self) -> str:
        """The key handed to the limiter: ``"<scope>:<value>"``; a value over
        256 UTF-8 bytes, or one UTF-8 cannot hold (a lone surrogate), becomes
        ``"<scope>#<blake2b-128 hex>"`` (the ``#`` keeps a digest from
        colliding with a literal value)."""
        value = self.value
        if value.isascii():
            if len(value) <= MAX_VALUE_BYTES:
                return f"{self.scope.value}:{value}"
        else:
            try:
                size = len(value.encode("utf-8"))
            except UnicodeEncodeError:  # a lone surrogate: no UTF-8 key can hold it
                size = MAX_VALUE_BYTES + 1
            if size <= MAX_VALUE_BYTES:
                return f"{self.scope.value}:{value}"
        return f"{self.scope.value}#{_digest(value)}"


def request_user(request: Request) -> str | None:
    """Default user id: what the framework adapter put in ``request.user``
    (Starlette's authenticated ``scope["user"]``, WSGI's ``REMOTE_USER``)."""
    return request.user or None


def bearer_or_api_key(request: Request) -> str | None:
    """Default API key: ``Authorization: Bearer <token>``, else ``X-API-Key``."""
    headers = request.headers
    auth = headers.get("authorization")
    if auth and auth[:7].lower() == "bearer ":
        token = auth[7:].strip()
        if token:
            return token
    key = headers.get("x-api-key")
    return key.strip() or None if key else None


@runtime_checkable
class KeyExtractor(Protocol):
    """What the middleware asks of an extractor.

    ``key_for`` builds the key for a rule's scope; ``tier_for`` names the
    request's tier (rules may be restricted to one). An extractor may also
    offer ``storage_key_for(request, scope) -> str``: the middleware uses it
    instead of ``key_for(...).storage_key()`` to skip building a ClientKey.
    """

    def key_for(self, request: Request, scope: KeyScope) -> ClientKey: ...

    def tier_for(self, request: Request) -> str: ...


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class DefaultKeyExtractor:
    """The stock extractor.

    - ``user_id(request)``: default :func:`request_user`.
    - ``api_key(request)``: default :func:`bearer_or_api_key`; stored hashed,
      so secrets never sit in a shared store.
    - ``tier(request, user, api_key)``: default ``"anonymous"`` without a
      user id, ``"authenticated"`` with one. An API key alone does not count:
      it comes from a header, and an invented one would lift any client to
      the authenticated tier; pass ``tier=`` to map keys you have verified.
    - ``trusted_proxies``: networks whose ``X-Forwarded-For`` is believed.
      The client is the right-most address not in those networks (entries
      to its left were written by the client and prove nothing).
    - ``ipv6_prefix`` (default 64) and ``ipv4_prefix`` (default 32): how
      much of an address identifies one client.
    """

    def __init__(
        self,
        *,
        user_id: Callable[[Request], str | None] = request_user,
        api_key: Callable[[Request], str | None] = bearer_or_api_key,
        tier: Callable[[Request, str | None, str | None], str] | None = None,
        trusted_proxies: Iterable[str | Network] = (),
        ipv6_prefix: int = 64,
        ipv4_prefix: int = 32,
        forwarded_header: str = "x-forwarded-for",
    ) -> None:
        for name, value, top in (("ipv6_prefix", ipv6_prefix, 128), ("ipv4_prefix", ipv4_prefix, 32)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ValidationError(f"{name} must be an int in [1, {top}], got {value!r}")
        self.user_id = user_id
        self.api_key = api_key
        self._tier = tier
        self.ipv6_prefix = ipv6_prefix
        self.ipv4_prefix = ipv4_prefix
        self.forwarded_header = forwarded_header.lower()
        networks: list[Network] = []
        for net in trusted_proxies:
            try:
                networks.append(net if not isinstance(net, str) else ipaddress.ip_network(net, strict=False))
            except ValueError as exc:
                raise ValidationError(f"trusted_proxies: {exc}") from None
        self.trusted_proxies: tuple[Network, ...] = tuple(networks)
        # peer address string -> storage key "ip:<network>" (bounded)
        self._ip_keys: dict[str, str] = {}
        self._trusted_cache: dict[str, bool] = {}
        self._secret_cache: dict[str, str] = {}

    # -- the client address ---------------------------------------------------
    def _is_trusted(self, address: str) -> bool:
        hit = self._trusted_cache.get(address)
        if hit is not None:
            return hit
        try:
            ip = ipaddress.ip_address(address.strip())
        except ValueError:
            trusted = False
        else:
            if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            trusted = any(ip in net for net in self.trusted_proxies)
        if len(self._trusted_cache) >= _IP_CACHE_SIZE:
            self._trusted_cache.clear()
        self._trusted_cache[address] = trusted
        return trusted

    def client_ip(self, request: Request) -> str | None:
        """The client's address: the connection's peer, or, when the peer is
        a trusted proxy, the right-most untrusted ``X-Forwarded-For`` entry."""
        peer = request.client
        if not self.trusted_proxies or not peer or not self._is_trusted(peer):
            return peer or None
        forwarded = request.headers.get(self.forwarded_header)
        if not forwarded:
            return peer
        client = peer
        for hop in reversed(forwarded.split(",")):
            hop = hop.strip()
            if not hop:
                continue
            if _parse_ip(hop) is None:
                break  # garbage: stop at the last address a proxy vouched for
            client = hop
            if not self._is_trusted(hop):
                break
        return client

    def ip_value(self, address: str | None) -> str:
        """The key value of an address: the /``ipv4_prefix`` or
        /``ipv6_prefix`` network it belongs to (IPv4-mapped IPv6 counts as
        IPv4); an unparsable or missing address is keyed as itself or
        ``"unknown"``."""
        if not address:
            return "unknown"
        ip = _parse_ip(address)
        if ip is None:
            return address
        if isinstance(ip, ipaddress.IPv6Address):
            if ip.ipv4_mapped is not None:
                ip = ip.ipv4_mapped
            else:
                if self.ipv6_prefix == 128:
                    return ip.compressed
                return ipaddress.IPv6Network((ip, self.ipv6_prefix), strict=False).with_prefixlen
        if self.ipv4_prefix == 32:
            return ip.compressed
        return ipaddress.IPv4Network((ip, self.ipv4_prefix), strict=False).with_prefixlen

    def _ip_storage_key(self, request: Request) -> str:
        address = self.client_ip(request) or ""
        cached = self._ip_keys.get(address)
        if cached is None:
            cached = ClientKey(KeyScope.IP, self.ip_value(address)).storage_key()
            if len(self._ip_keys) >= _IP_CACHE_SIZE:
                self._ip_keys.clear()
            self._ip_keys[address] = cached
        return cached

    def _secret_value(self, secret: str) -> str:
        if len(secret) > _SECRET_CACHE_LENGTH:
            return _digest(secret)  # a client's 8 KB "key" must not sit in the cache
        value = self._secret_cache.get(secret)
        if value is None:
            value = _digest(secret)
            if len(self._secret_cache) >= _IP_CACHE_SIZE:
                self._secret_cache.clear()
            self._secret_cache[secret] = value
        return value

    # -- the protocol -----------------------------------------------------------
    def tier_for(self, request: Request) -> str:
        user = self.user_id(request)
        key = self.api_key(request)
        if self._tier is not None:
            return self._tier(request, user, key)
        # An API key from a header is unverified here: any invented one would
        # do. Only a user id (set by the app's authentication) lifts the tier;
        # ``tier=`` maps keys the gateway has checked.
        return AUTHENTICATED if user else ANONYMOUS

    def key_for(self, request: Request, scope: KeyScope) -> ClientKey:
        if scope is _GLOBAL:
            return ClientKey(KeyScope.GLOBAL, "*")
        if scope is _USER:
            user = self.user_id(request)
            if user:
                return ClientKey(KeyScope.USER, user)
        elif scope is _API_KEY:
            key = self.api_key(request)
            if key:
                return ClientKey(KeyScope.API_KEY, self._secret_value(key))
        return ClientKey(KeyScope.IP, self.ip_value(self.client_ip(request)))

    def storage_key_for(self, request: Request, scope: KeyScope) -> str:
        """``key_for(request, scope).storage_key()`` without the ClientKey
        (the middleware's hot path)."""
        if scope is _IP:
            if not self.trusted_proxies:
                hit = self._ip_keys.get(request.client)  # type: ignore[arg-type]
                if hit is not None:
                    return hit
            return self._ip_storage_key(request)
        if scope is _GLOBAL:
            return "global:*"
        if scope is _USER:
            user = self.user_id(request)
            if user:
                if len(user) <= MAX_VALUE_BYTES and user.isascii():
                    return "user:" + user
                return ClientKey(KeyScope.USER, user).storage_key()
        else:
            key = self.api_key(request)
            if key:
                return "api_key:" + self._secret_value(key)
        return self._ip_storage_key(request)


def _parse_ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    text = text.strip()
    if text.startswith("[") and "]" in text:  # "[2001:db8::1]:443"
        text = text[1 : text.index("]")]
    elif text.count(":") == 1:  # "192.0.2.1:8080"
        text = text.split(":", 1)[0]
    if "%" in text:  # zone index
        text = text.split("%", 1)[0]
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        return None


def headers_of(pairs: Iterable[tuple[str, str]]) -> Mapping[str, str]:
    """Lower-cased header mapping; repeated headers are joined with ``,``."""
    out: dict[str, str] = {}
    for name, value in pairs:
        name = name.lower()
        out[name] = f"{out[name]},{value}" if name in out else value
    return out
