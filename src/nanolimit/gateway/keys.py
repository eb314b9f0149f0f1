"""Keys: whose budget a request spends.

:class:`DefaultKeyExtractor` turns a request into a :class:`ClientKey` for a
rule's scope. The client IP comes from the connection; a forwarding header
(``X-Forwarded-For`` or RFC 7239 ``Forwarded``) is believed only when the
connection comes from a configured proxy network (any client can write that
header), and only as far as it parses strictly: an entry that is not an
address stops the walk, so padding or junk can neither pick an identity nor
sit in a cache. IPv6 clients are keyed by their network prefix (default
/64): a single host owns a whole /64 and could otherwise rotate through
2**64 addresses to escape a per-IP limit. An anonymous caller under a
``user`` or ``api_key`` rule is keyed by its IP, never by one shared
"anonymous" key that would let one abuser lock everyone out.

Every cache here is bounded twice, by entries and by bytes, and never holds
an input longer than a short limit: the inputs are client-chosen, so an
unbounded cache is a memory-exhaustion switch handed to every client. The
parsing rules and what each malformed entry means are in ``docs/proxies.md``.
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Generic, NamedTuple, Protocol, TypeVar, runtime_checkable

from ..errors import ValidationError
from .request import Request
from .rules import KeyScope

__all__ = [
    "ANONYMOUS",
    "AUTHENTICATED",
    "FORWARDED_HEADERS",
    "ClientKey",
    "DefaultKeyExtractor",
    "KeyExtractor",
    "RewrittenClientWarning",
    "bearer_or_api_key",
    "request_user",
]

ANONYMOUS = "anonymous"
AUTHENTICATED = "authenticated"

# Values longer than this (UTF-8 bytes) are stored as a digest, so a storage
# key stays far below the 1,024-byte key limit whatever a client sends.
MAX_VALUE_BYTES = 256
_IP_CACHE_SIZE = 65536  # entries per cache
# Bytes per cache (keys and values as sys.getsizeof counts them, plus a slot):
# 65,536 ordinary IPv6 entries fit; client-chosen long or non-ASCII ones
# cannot push a cache past this.
CACHE_BYTES = 8 * 1024 * 1024
_SLOT_BYTES = 64  # a dict entry (hash, key, value) and its share of the index
_SECRET_CACHE_LENGTH = 256  # longer API keys are hashed on every request, never cached
# The longest node a forwarding header may name: "[v6]:port" with an embedded
# IPv4 tail is 54 characters; anything longer is not an address.
MAX_NODE_CHARS = 64
_MAX_CACHED_CHARS = 64  # a raw peer or X-Forwarded-For entry longer than this is never cached
MAX_ELEMENT_CHARS = 256  # one RFC 7239 element (for=...;proto=...;by=...;host=...)
_MAX_CACHED_ELEMENT_CHARS = 128
# Entries walked from the right before giving up: a real chain has a handful
# of proxies; a client-written list of thousands must not cost thousands of
# steps (the walk stops at the last address it accepted).
MAX_HOPS = 32
_REWRITE_SCAN = 8  # X-Forwarded-For entries compared with the peer by the rewrite check

# Header names whose syntax the extractor parses: a comma-separated list of
# addresses (X-Forwarded-For and the single-address headers CDNs and proxies
# set), or RFC 7239 ``Forwarded``. Anything else is refused at construction:
# a misspelt name would silently key every client as the proxy.
_XFF_SYNTAX = frozenset(
    {
        "x-forwarded-for",
        "x-real-ip",
        "true-client-ip",
        "cf-connecting-ip",
        "fastly-client-ip",
        "x-client-ip",
        "x-cluster-client-ip",
    }
)
_RFC7239 = "forwarded"
#: In ``trusted_proxies``: a connection with no peer address (a Unix socket).
UNIX = "unix"
FORWARDED_HEADERS = frozenset(_XFF_SYNTAX | {_RFC7239})

# Enum attribute access costs ~90 ns on CPython 3.11: compare against locals.
_IP = KeyScope.IP
_GLOBAL = KeyScope.GLOBAL
_USER = KeyScope.USER
_API_KEY = KeyScope.API_KEY

# What one forwarding-header entry turned out to be.
_UNTRUSTED = 0  # an address outside trusted_proxies: the client
_TRUSTED = 1  # a trusted proxy's address: keep walking left
_BAD = 2  # not an address: stop, keep the last accepted hop
_EMPTY = 3  # an empty list element (allowed by the list syntax): skip it
_UNKNOWN = 4  # RFC 7239 ``for=unknown`` (or no ``for``): the writer could not say
_OBFUSCATED = 5  # RFC 7239 ``for=_token``: the writer's chosen identifier

_Hop = tuple[str, int]
_BAD_HOP: _Hop = ("", _BAD)
_EMPTY_HOP: _Hop = ("", _EMPTY)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network

V = TypeVar("V")


class RewrittenClientWarning(UserWarning):
    """The server seems to have replaced the connection's address with one
    read from ``X-Forwarded-For`` before nanolimit saw it (uvicorn does so by
    default for connections from 127.0.0.1): whoever may send through that
    path picks its own rate-limit identity. See ``docs/proxies.md``."""


def digest_key(value: str) -> str:
    """A fixed-length stand-in for a value too long (or not UTF-8) to key
    by: blake2b-128, hex (32 characters)."""
    raw = value.encode("utf-8", "surrogatepass")
    return hashlib.blake2b(raw, digest_size=16).hexdigest()


class _Cache(Generic[V]):
    """A dict bounded by entries and by bytes, emptied whole when either
    bound would be passed (cheap, and a flood of distinct inputs gains
    nothing over a steady client). ``data`` is the plain dict: hot paths call
    ``data.get`` directly, so a hit costs what a dict lookup costs; only a
    miss pays for the accounting."""

    __slots__ = ("data", "max_bytes", "used")

    def __init__(self, max_bytes: int) -> None:
        self.data: dict[str, V] = {}
        self.max_bytes = max_bytes
        self.used = 0

    def put(self, key: str, value: V, size: int) -> None:
        data = self.data
        if len(data) >= _IP_CACHE_SIZE or self.used + size > self.max_bytes:
            data.clear()  # in place: hot paths hold a reference to this dict
            self.used = 0
        data[key] = value
        self.used += size


def _size(key: str, value: str) -> int:
    return sys.getsizeof(key) + sys.getsizeof(value) + _SLOT_BYTES


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
        return f"{self.scope.value}#{digest_key(value)}"


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


class DefaultKeyExtractor:
    """The stock extractor.

    - ``user_id(request)``: default :func:`request_user`.
    - ``api_key(request)``: default :func:`bearer_or_api_key`; stored hashed,
      so secrets never sit in a shared store.
    - ``tier(request, user, api_key)``: default ``"anonymous"`` without a
      user id, ``"authenticated"`` with one. An API key alone does not count:
      it comes from a header, and an invented one would lift any client to
      the authenticated tier; pass ``tier=`` to map keys you have verified.
    - ``trusted_proxies``: networks whose forwarding header is believed.
      The client is the right-most address not in those networks (entries
      to its left were written by the client and prove nothing). ``"unix"``
      trusts a connection with no peer address: a reverse proxy on a Unix
      socket (gunicorn's ``--bind unix:...``, uvicorn's ``--uds``), whose
      every request otherwise carries no address and shares one budget.
    - ``forwarded_header``: ``"x-forwarded-for"`` (default), another
      address-list header (``x-real-ip``, ``true-client-ip``,
      ``cf-connecting-ip``, ...), or ``"forwarded"`` (RFC 7239). Other
      names are refused: they would be misread.
    - ``ipv6_prefix`` (default 64) and ``ipv4_prefix`` (default 32): how
      much of an address identifies one client.
    - ``cache_bytes``: the most bytes each of the extractor's caches holds.
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
        cache_bytes: int = CACHE_BYTES,
    ) -> None:
        for name, value, top in (("ipv6_prefix", ipv6_prefix, 128), ("ipv4_prefix", ipv4_prefix, 32)):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= top:
                raise ValidationError(f"{name} must be an int in [1, {top}], got {value!r}")
        if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
            raise ValidationError(f"cache_bytes must be a non-negative int, got {cache_bytes!r}")
        if not isinstance(forwarded_header, str):
            raise ValidationError(f"forwarded_header must be a str, got {forwarded_header!r}")
        header = forwarded_header.strip().lower()
        if header not in FORWARDED_HEADERS:
            raise ValidationError(
                f"forwarded_header {forwarded_header!r} has no parser here: use 'forwarded' "
                f"(RFC 7239) or one of the address-list headers {sorted(_XFF_SYNTAX)}"
            )
        self.user_id = user_id
        self.api_key = api_key
        self._tier = tier
        self.ipv6_prefix = ipv6_prefix
        self.ipv4_prefix = ipv4_prefix
        self.forwarded_header = header
        self._rfc7239 = header == _RFC7239
        networks: list[Network] = []
        trust_unix = False
        for net in trusted_proxies:
            if isinstance(net, str) and net.strip().lower() == UNIX:
                trust_unix = True
                continue
            try:
                network = net if not isinstance(net, str) else ipaddress.ip_network(net, strict=False)
            except ValueError as exc:
                raise ValidationError(f"trusted_proxies: {exc}") from None
            networks.append(_unmapped_network(network))
        self.trusted_proxies: tuple[Network, ...] = tuple(networks)
        self.trust_unix = trust_unix
        # whether a forwarding header may decide a key (else the peer alone does)
        self._reads_header = bool(networks) or trust_unix
        self.cache_bytes = cache_bytes
        # address (a peer, or the canonical client a header walk found) -> storage key
        self._ip_cache: _Cache[str] = _Cache(cache_bytes)
        self._ip_keys = self._ip_cache.data
        self._trusted_budget: _Cache[bool] = _Cache(cache_bytes)  # raw peer -> trusted?
        self._trusted_cache = self._trusted_budget.data
        self._hop_cache: _Cache[_Hop] = _Cache(cache_bytes)  # raw header entry -> (address, kind)
        self._hops = self._hop_cache.data
        self._secret_budget: _Cache[str] = _Cache(cache_bytes)
        self._secret_cache = self._secret_budget.data
        self._rewrite_warned = False

    # -- the client address ---------------------------------------------------
    def _trusts(self, ip: IPAddress) -> bool:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip in net for net in self.trusted_proxies)

    def _is_trusted(self, address: str) -> bool:
        hit = self._trusted_cache.get(address)
        if hit is not None:
            return hit
        ip = _parse_node(address.strip(" \t"), zone_ok=True)
        trusted = ip is not None and self._trusts(ip)
        if len(address) <= _MAX_CACHED_CHARS:
            self._trusted_budget.put(address, trusted, sys.getsizeof(address) + _SLOT_BYTES)
        return trusted

    def client_ip(self, request: Request) -> str | None:
        """The client's address: the connection's peer, or, when the peer is
        a trusted proxy, what the forwarding header says about the client
        (the right-most entry outside ``trusted_proxies``, in canonical text).
        The walk stops at the first entry that is not an address and keeps
        the last one it accepted: the view of the last trusted hop. A
        connection with no peer address (a Unix socket) is a trusted hop
        only under ``"unix"``."""
        peer = request.client
        if not peer:
            if not self.trust_unix:
                return None
            peer = ""
        elif not self.trusted_proxies or not self._is_trusted(peer):
            return peer
        header = request.headers.get(self.forwarded_header)
        if not header:
            return peer or None
        if self._rfc7239:
            return self._walk_forwarded(header, peer) or None
        return self._walk_xff(header, peer) or None

    def _walk_xff(self, header: str, peer: str) -> str:
        """Right to left through a comma-separated address list, slicing one
        entry at a time (the client-written left part may be long and is
        usually never reached)."""
        hops = self._hops
        client = peer
        end = len(header)
        steps = 0
        while end >= 0 and steps < MAX_HOPS:
            start = header.rfind(",", 0, end) + 1
            raw = header[start:end]
            end = start - 1
            steps += 1
            info = hops.get(raw)
            if info is None:
                info = self._xff_hop(raw)
            kind = info[1]
            if kind == _EMPTY:
                continue
            if kind == _BAD:
                break
            client = info[0]
            if kind == _UNTRUSTED:
                break
        return client

    def _xff_hop(self, raw: str) -> _Hop:
        text = raw.strip(" \t")
        if not text:
            info = _EMPTY_HOP
        else:
            ip = _parse_node(text)
            trusted = ip is not None and self._trusts(ip)
            info = _BAD_HOP if ip is None else (ip.compressed, _TRUSTED if trusted else _UNTRUSTED)
        if len(raw) <= _MAX_CACHED_CHARS:
            self._hop_cache.put(raw, info, _size(raw, info[0]) + sys.getsizeof(info))
        return info

    def _walk_forwarded(self, header: str, peer: str) -> str:
        """Right to left through RFC 7239 elements. Element boundaries are
        found from the right with quoted strings honoured, so a client's
        unbalanced quote far to the left cannot swallow the elements our
        proxies appended after it."""
        hops = self._hops
        client = peer
        end = len(header)
        steps = 0
        while end >= 0 and steps < MAX_HOPS:
            start = _element_start(header, end)
            if start < 0:
                break  # a quote that never opens: malformed from here on
            raw = header[start:end]
            end = start - 1
            steps += 1
            info = hops.get(raw)
            if info is None:
                info = self._forwarded_element(raw)
            kind = info[1]
            if kind == _EMPTY:
                continue
            if kind == _BAD:
                break
            if kind == _UNKNOWN:
                # The writer (a trusted hop) did not know its peer: one bucket
                # per writer, apart from the writer's own address.
                return "unknown@" + (client or UNIX)
            client = info[0]
            if kind != _TRUSTED:  # an untrusted address or an obfuscated identifier
                break
        return client

    def _forwarded_element(self, raw: str) -> _Hop:
        info = _parse_forwarded_element(raw)
        if info[1] == _UNTRUSTED:  # an address, for this extractor to judge
            ip = ipaddress.ip_address(info[0])
            info = (info[0], _TRUSTED if self._trusts(ip) else _UNTRUSTED)
        if len(raw) <= _MAX_CACHED_ELEMENT_CHARS:
            self._hop_cache.put(raw, info, _size(raw, info[0]) + sys.getsizeof(info))
        return info

    def ip_value(self, address: str | None) -> str:
        """The key value of an address: the /``ipv4_prefix`` or
        /``ipv6_prefix`` network it belongs to. IPv4 carried in IPv6
        (IPv4-mapped ``::ffff:a.b.c.d``, 6to4 ``2002:AABB:CCDD::/48``,
        Teredo's client address) counts as that IPv4, so one host cannot hold
        two budgets, nor a 6to4 host 65,536 of them. A zone id is dropped. An
        unparsable or missing address is keyed as itself or ``"unknown"``."""
        if not address:
            return "unknown"
        ip = _parse_node(address.strip(" \t"), zone_ok=True)
        if ip is None:
            return address
        if isinstance(ip, ipaddress.IPv6Address):
            embedded = _embedded_ipv4(ip)
            if embedded is None:
                if self.ipv6_prefix == 128:
                    return ip.compressed
                return ipaddress.IPv6Network((ip, self.ipv6_prefix), strict=False).with_prefixlen
            ip = embedded
        if self.ipv4_prefix == 32:
            return ip.compressed
        return ipaddress.IPv4Network((ip, self.ipv4_prefix), strict=False).with_prefixlen

    def _ip_storage_key(self, request: Request) -> str:
        address = self.client_ip(request) or ""
        cached = self._ip_keys.get(address)
        if cached is None:
            if not self._rewrite_warned:
                self._check_rewritten(request)
            cached = ClientKey(KeyScope.IP, self.ip_value(address)).storage_key()
            if len(address) <= _MAX_CACHED_CHARS:
                self._ip_cache.put(address, cached, _size(address, cached))
        return cached

    def _check_rewritten(self, request: Request) -> None:
        """Warn once if the connection's address is one the request's own
        ``X-Forwarded-For`` names while that header is not ours to believe:
        the mark of a server that already rewrote the client from the header
        (uvicorn's proxy headers, on by default for 127.0.0.1). Runs on cache
        misses only, so a steady client never pays for it."""
        peer = request.client
        if not peer or (self.trusted_proxies and self._is_trusted(peer)):
            return
        header = request.headers.get("x-forwarded-for")
        if not header:
            return
        peer_ip = _parse_node(peer.strip(" \t"), zone_ok=True)
        end = len(header)
        for _ in range(_REWRITE_SCAN):
            if end < 0:
                return
            start = header.rfind(",", 0, end) + 1
            text = header[start:end].strip(" \t")
            end = start - 1
            if not text:
                continue
            if text == peer or (peer_ip is not None and _parse_node(text, zone_ok=True) == peer_ip):
                break
        else:
            return
        self._rewrite_warned = True
        shown = peer if len(peer) <= MAX_NODE_CHARS else peer[:MAX_NODE_CHARS] + "..."
        warnings.warn(
            RewrittenClientWarning(
                f"nanolimit: the connection's address {shown!r} is also in the request's "
                "X-Forwarded-For, which nanolimit does not trust here: the server probably "
                "rewrote the client from that header (uvicorn does by default for 127.0.0.1, "
                "--forwarded-allow-ips), so a client on that path picks its own rate-limit "
                "identity. Run uvicorn with --no-proxy-headers and list the proxies in "
                "trusted_proxies instead; see nanolimit's docs/proxies.md. "
                "(Warned once per extractor.)"
            ),
            stacklevel=2,
        )

    def _secret_value(self, secret: str) -> str:
        if len(secret) > _SECRET_CACHE_LENGTH:
            return digest_key(secret)  # a client's 8 KB "key" must not sit in the cache
        value = self._secret_cache.get(secret)
        if value is None:
            value = digest_key(secret)
            self._secret_budget.put(secret, value, _size(secret, value))
        return value

    # -- the protocol -----------------------------------------------------------
    def tier_for(self, request: Request) -> str:
        user = self.user_id(request)
        if self._tier is not None:
            return self._tier(request, user, self.api_key(request))
        # An API key from a header is unverified here: any invented one would
        # do, so the default tier never reads it. Only a user id (set by the
        # app's authentication) lifts the tier; ``tier=`` maps keys the
        # gateway has checked.
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

    def peer_keys(self) -> Mapping[str, str] | None:
        """The IP scope's storage keys of the connection peers seen so far, by
        peer address: a live view, read by the pipeline so that a cached peer
        is keyed with no :class:`Request` built. None with trusted proxies
        (the key then depends on a header)."""
        return None if self._reads_header else self._ip_keys

    def storage_key_for(self, request: Request, scope: KeyScope) -> str:
        """``key_for(request, scope).storage_key()`` without the ClientKey
        (the middleware's hot path)."""
        if scope is _IP:
            if not self._reads_header:
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


# -- parsing ---------------------------------------------------------------------
def _port_ok(text: str) -> bool:
    return 0 < len(text) <= 5 and text.isdigit() and int(text) <= 65535


def _parse_node(text: str, zone_ok: bool = False) -> IPAddress | None:
    """One address, strictly: ``a.b.c.d``, ``a.b.c.d:port``, a bare IPv6
    address (no port: its colons would be ambiguous), ``[v6]`` or
    ``[v6]:port``. Nothing else: no padding after ``]``, no whitespace or
    junk inside, no leading-zero IPv4 octets, no IPv4 in brackets, at most
    ``MAX_NODE_CHARS`` ASCII characters. A zone id (``fe80::1%eth0``) is
    refused, except on the connection's own address (``zone_ok``), where it
    is dropped."""
    if not text or len(text) > MAX_NODE_CHARS or not text.isascii():
        return None
    if text[0] == "[":
        close = text.find("]")
        if close < 0:
            return None
        host = text[1:close]
        rest = text[close + 1 :]
        if rest and not (rest[0] == ":" and _port_ok(rest[1:])):
            return None
        v6 = True
    else:
        colons = text.count(":")
        if colons == 1:
            host, _, port = text.partition(":")
            if not _port_ok(port):
                return None
            v6 = False
        else:
            host = text
            v6 = colons > 1
    if "%" in host:
        if not (zone_ok and v6):
            return None
        host, _, zone = host.partition("%")
        if not zone:
            return None
    try:
        return ipaddress.IPv6Address(host) if v6 else ipaddress.IPv4Address(host)
    except ValueError:
        return None


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 host an IPv6 address stands for, when it is one: mapped,
    6to4 (the relay-routed /48 of one IPv4 address), or Teredo (the client's
    public IPv4)."""
    mapped = ip.ipv4_mapped
    if mapped is not None:
        return mapped
    six = ip.sixtofour
    if six is not None:
        return six
    teredo = ip.teredo
    return teredo[1] if teredo is not None else None


def _unmapped_network(net: Network) -> Network:
    """``::ffff:10.0.0.0/104`` trusts what ``10.0.0.0/8`` trusts: addresses
    are compared as IPv4 once unmapped."""
    if isinstance(net, ipaddress.IPv6Network) and net.prefixlen >= 96:
        mapped = net.network_address.ipv4_mapped
        if mapped is not None:
            return ipaddress.IPv4Network((mapped, net.prefixlen - 96))
    return net


def _element_start(value: str, end: int) -> int:
    """Where the RFC 7239 element that ends at ``end`` starts (just after its
    comma, or 0), scanning leftwards with quoted strings honoured: a quote is
    escaped when an odd run of backslashes precedes it. -1: a closing quote
    whose opening quote is missing."""
    i = end
    while True:
        comma = value.rfind(",", 0, i)
        quote = value.rfind('"', comma + 1, i)
        if quote < 0:
            return comma + 1
        j = quote
        while True:
            j = value.rfind('"', 0, j)
            if j < 0:
                return -1
            k = j
            while k > 0 and value[k - 1] == "\\":
                k -= 1
            if (j - k) % 2 == 0:
                break
        i = j


_TCHARS = r"!#$%&'*+\-.^_`|~0-9A-Za-z"
# An unquoted value may also hold ':' '[' ']' (proxies that forget RFC 7239's
# quotes around "[v6]:port"); none of them can start a new pair or element.
_VALUE = rf'(?:[{_TCHARS}:\[\]]+|"(?:[\t !#-\[\]-~\x80-\xff]|\\[\t -~\x80-\xff])*")'
_PAIR = rf"[{_TCHARS}]+={_VALUE}"
_ELEMENT_RE = re.compile(rf"[ \t]*(?:{_PAIR})?(?:[ \t]*;[ \t]*(?:{_PAIR})?)*[ \t]*")
_PAIR_RE = re.compile(rf"([{_TCHARS}]+)=({_VALUE})")
_OBF_RE = re.compile(r"_[A-Za-z0-9._-]+")
_UNESCAPE_RE = re.compile(r"\\(.)", re.DOTALL)


def _parse_forwarded_element(raw: str) -> _Hop:
    """One RFC 7239 element: ``pair *( ";" pair )``, each pair ``token "="
    ( token / quoted-string )``. Returns the ``for=`` node as (canonical
    address, _UNTRUSTED) for the caller to judge, (identifier, _OBFUSCATED),
    ("", _UNKNOWN) for ``unknown`` or no ``for``, or _BAD / _EMPTY. Two
    ``for`` pairs in one element are _BAD (the RFC forbids repeats)."""
    if len(raw) > MAX_ELEMENT_CHARS:
        return _BAD_HOP
    if not raw.strip(" \t"):
        return _EMPTY_HOP
    if _ELEMENT_RE.fullmatch(raw) is None:
        return _BAD_HOP
    node: str | None = None
    for name, value in _PAIR_RE.findall(raw):
        if name.lower() != "for":
            continue
        if node is not None:
            return _BAD_HOP
        node = _UNESCAPE_RE.sub(r"\1", value[1:-1]) if value[0] == '"' else value
    if node is None:
        return ("", _UNKNOWN)
    return _parse_forwarded_node(node)


def _forwarded_port_ok(text: str) -> bool:
    return _port_ok(text) or _OBF_RE.fullmatch(text) is not None


def _parse_forwarded_node(node: str) -> _Hop:
    """``nodename [":" node-port]``: IPv4, ``[IPv6]``, ``unknown``, or an
    obfuscated ``_identifier``; the port a number or ``_identifier``. A bare
    IPv6 address without brackets is accepted (no port then)."""
    if not node or len(node) > MAX_NODE_CHARS or not node.isascii():
        return _BAD_HOP
    ip: IPAddress | None
    if node[0] == "[":
        close = node.find("]")
        if close < 0:
            return _BAD_HOP
        rest = node[close + 1 :]
        if rest and not (rest[0] == ":" and _forwarded_port_ok(rest[1:])):
            return _BAD_HOP
        ip = _parse_node(node[: close + 1])
        if ip is None:
            return _BAD_HOP
        return (ip.compressed, _UNTRUSTED)
    if node.count(":") > 1:
        ip = _parse_node(node)  # bare IPv6
        return _BAD_HOP if ip is None else (ip.compressed, _UNTRUSTED)
    name, colon, port = node.partition(":")
    if colon and not _forwarded_port_ok(port):
        return _BAD_HOP
    if name.lower() == "unknown":
        return ("", _UNKNOWN)
    if name[:1] == "_":
        return (name, _OBFUSCATED) if _OBF_RE.fullmatch(name) else _BAD_HOP
    ip = _parse_node(name)
    if ip is None or not isinstance(ip, ipaddress.IPv4Address):
        return _BAD_HOP
    return (ip.compressed, _UNTRUSTED)
