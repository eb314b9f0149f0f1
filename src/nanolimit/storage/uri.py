"""Storages named by a URI: ``storage_from_uri("redis://10.0.0.5:6379/0?timeout=0.05")``.

Why one function: every config a user brings names its store as
``storage_uri="redis://..."``, and how a URI maps onto a client (TLS, a Unix
socket, Sentinel, a cluster, Valkey, asyncio) and onto a storage's options
is decided here, once, instead of guessed by each storage or each caller.
docs/storage_uris.md lists every scheme and option.

Options come from the query string and from keywords (a keyword wins over
the query, and the query over the URI's ``user:password@``). Query values
are text, converted to the option's type; keyword values may already have
it. A URI that cannot be used is a :class:`ValidationError` naming the scheme
and the option at fault and listing what is accepted; a password (and the
other secret options) never appears in a message.
"""

from __future__ import annotations

import importlib
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import unquote, unquote_plus

from .._protocols import Storage
from .._validation import MAX_KEYS, MAX_STRIPES, MAX_WINDOW, as_float
from ..errors import ValidationError

__all__ = [
    "DEFAULT_MEMORY_MAX_KEYS",
    "SCHEMES",
    "SECRET_FIELD_NAME",
    "check_storage_uri",
    "redact_uri",
    "storage_from_uri",
    "storage_kind",
]

#: ``memory://``'s bound when none is given: the same as LimiterFactory's
#: default store (a store named in a config must not grow without limit).
DEFAULT_MEMORY_MAX_KEYS: Final = 100_000
_DEFAULT_PORT: Final = 6379
_DEFAULT_SENTINEL_PORT: Final = 26379

_BASES: Final = ("redis", "rediss", "valkey", "valkeys")
_TLS: Final = ("rediss", "valkeys")
_TOPOLOGIES: Final = ("", "unix", "sentinel", "cluster")
#: Every scheme accepted (each Redis/Valkey one also as ``async+<scheme>``).
SCHEMES: Final = (
    "memory",
    "shm",
    "unix",
    *(
        base + ("+" + top if top else "")
        for base in _BASES
        for top in _TOPOLOGIES
        if not (top == "unix" and base in _TLS)  # no TLS over a Unix socket
    ),
)
_ASYNC: Final = "async+"


# -- option values -----------------------------------------------------------------
_TRUE: Final = ("true", "1", "yes", "on")
_FALSE: Final = ("false", "0", "no", "off")
_NONE: Final = ("none", "")
_INT = re.compile(r"[+-]?[0-9]+")
#: the bound of a client's counts (database, connections): what a server takes
_MAX_INT32: Final = (1 << 31) - 1


class _Bad(Exception):
    """An option's value that cannot be used: why."""


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        low = value.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
    raise _Bad(f"must be a bool ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")


def _int(low: int | None = None, high: int | None = None) -> Callable[[Any], int]:
    def convert(value: Any) -> int:
        if isinstance(value, str) and _INT.fullmatch(value.strip()):
            if len(value.strip()) > 40:  # no option takes a number that long (nor has int() one)
                raise _Bad(
                    "must be an int" + (f" in [{low}, {high}]" if high is not None else " of under 40 digits")
                )
            value = int(value.strip())
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad("must be an int")
        if low is not None and value < low:
            raise _Bad(f"must be an int >= {low}")
        if high is not None and value > high:
            raise _Bad(f"must be an int in [{low}, {high}]")
        return value

    return convert


def _float(positive: bool, high: float | None = None) -> Callable[[Any], float]:
    def convert(value: Any) -> float:
        if isinstance(value, str):
            try:
                value = float(value.strip())
            except ValueError:
                raise _Bad("must be a number of seconds") from None
        if (
            isinstance(value, bool)
            or not isinstance(value, (int, float))
            or not math.isfinite(as_float(value))
        ):
            raise _Bad("must be a finite number of seconds")
        if value < 0 or (positive and value == 0):
            raise _Bad("must be a number of seconds " + ("> 0" if positive else ">= 0"))
        if high is not None and value > high:
            raise _Bad(f"must be a number of seconds in {'(' if positive else '['}0, {high:g}]")
        return float(value)

    return convert


def _choice(*accepted: Any) -> Callable[[Any], Any]:
    def convert(value: Any) -> Any:
        for option in accepted:
            if value == option or (isinstance(value, str) and value.strip() == str(option)):
                return option
        raise _Bad("must be one of " + ", ".join(str(a) for a in accepted))

    return convert


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise _Bad("must be a string")
    return value


def _prefix(value: Any) -> str:
    """A Redis key prefix: braces would make a hash tag of it (as the storage refuses)."""
    if not isinstance(value, str) or "{" in value or "}" in value:
        raise _Bad("must be a str without '{' or '}' (they would become a hash tag)")
    return value


def _share(value: Any) -> float:
    """A local fallback's share of the limit: (0, 1], as the storage refuses otherwise."""
    try:
        share = _float(True, 1)(value)
    except _Bad:
        raise _Bad("must be a number in (0, 1], or none") from None
    return share


def _optional(convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def optional(value: Any) -> Any:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE):
            return None
        return convert(value)

    return optional


def _as_is(value: Any) -> Any:
    return value  # checked by the storage itself


@dataclass(frozen=True)
class _Option:
    convert: Callable[[Any], Any]
    secret: bool = False  # never shown, not even its type
    keyword_only: bool = False  # not text: a keyword of storage_from_uri only


def _policies() -> tuple[str, ...]:
    """The failure policies the Redis storages accept: their own tuple, so a
    policy added there is accepted here with no second list to edit."""
    from .redis import ON_ERROR_POLICIES

    return tuple(ON_ERROR_POLICIES)


#: the Redis storages' bound of a count option (storage/redis/_base.py's MAX_COUNT)
MAX_COUNT: Final = (1 << 31) - 1


def _redis_options() -> dict[str, _Option]:
    """What the Redis storages take."""
    return {
        "timeout": _Option(_float(True, 60)),
        "connect_timeout": _Option(_float(True, 60)),
        "on_error": _Option(_choice(*_policies())),
        "prefix": _Option(_prefix),
        "breaker_threshold": _Option(_int(1, MAX_COUNT)),
        "breaker_cooldown": _Option(_float(False, 86_400)),
        "near_cache": _Option(_as_bool),
        "near_cache_size": _Option(_int(1, MAX_COUNT)),
        "near_cache_ttl": _Option(_float(True, 86_400)),
        "keep_connections": _Option(_int(0, 1 << 16)),
        "local_share": _Option(_optional(_share)),
        "local_instances": _Option(_int(1, _MAX_INT32)),
        "local_max_keys": _Option(_int(1, MAX_KEYS)),
        "batch": _Option(_choice("script", "pipeline")),
        "deny_retry_after": _Option(_float(True, MAX_WINDOW)),
        "clock": _Option(_choice("server", "client")),
        "hash_identities": _Option(_as_bool),
        "max_identity_bytes": _Option(_int(1, 1 << 20)),
        "max_key_bytes": _Option(_int(1, 1 << 20)),
        "rule_on_error": _Option(_as_is, keyword_only=True),
        "secret_rules": _Option(_as_is, keyword_only=True),
        "key_salt": _Option(_as_is, secret=True, keyword_only=True),
    }


# What the client takes, passed to redis-py (valkey-py) by the same names.
_CLIENT_OPTIONS: Final = {
    "username": _Option(_text),
    "password": _Option(_text, secret=True),
    "db": _Option(_int(0, _MAX_INT32)),
    "client_name": _Option(_text),
    "max_connections": _Option(_int(1, _MAX_INT32)),
    "health_check_interval": _Option(_float(False, 86_400)),
    "socket_keepalive": _Option(_as_bool),
    "protocol": _Option(_choice(2, 3)),
}
_TLS_OPTIONS: Final = {
    "ssl_cert_reqs": _Option(_choice("none", "optional", "required")),
    "ssl_ca_certs": _Option(_text),
    "ssl_ca_path": _Option(_text),
    "ssl_certfile": _Option(_text),
    "ssl_keyfile": _Option(_text),
    "ssl_password": _Option(_text, secret=True),
    "ssl_check_hostname": _Option(_as_bool),
}
_SENTINEL_OPTIONS: Final = {
    "sentinel_username": _Option(_text),
    "sentinel_password": _Option(_text, secret=True),
}
_TABLE_OPTIONS: Final = {
    "max_keys": _Option(_optional(_int(1, MAX_KEYS))),
    "stripes": _Option(_int(1, MAX_STRIPES)),
    "on_full": _Option(_choice("evict", "deny_new")),
    "evict_idle_after": _Option(_optional(_float(True))),
    "max_key_bytes": _Option(_int(1, 1 << 20)),
}
_ZONE_OPTIONS: Final = {
    **_TABLE_OPTIONS,
    "max_keys": _Option(_int(1, 1 << 30)),  # the zone's ZONE_MAX_KEYS (_core_zone.pxi)
    "arena_bytes": _Option(_int(0, 1 << 40)),  # as the zone checks it
    "if_stale": _Option(_choice("reuse", "reset")),
}
# redis-py's names for what the storage sets itself: said in the error
_INSTEAD: Final = {
    "socket_timeout": "timeout",
    "socket_connect_timeout": "connect_timeout",
    "retry_on_timeout": "nothing: decisions are never retried",
    "ssl": "the rediss:// scheme",
}
#: What a field's name says about its value: shown as ``***`` by
#: :func:`redact_uri` (``password``, ``sentinel_password``, ``ssl_password``,
#: and the misspellings and inventions an operator may bring).
SECRET_FIELD_NAME = re.compile(r"pass|pwd|secret|salt|token|auth|cred", re.IGNORECASE)


def _option_names() -> frozenset[str]:
    """Every option name a query may hold (and redis-py's that are refused)."""
    names = set(_redis_options()) | set(_INSTEAD)
    for table in (_CLIENT_OPTIONS, _TLS_OPTIONS, _SENTINEL_OPTIONS, _ZONE_OPTIONS):
        names.update(table)
    return frozenset(names)


def _query_start(rest: str) -> int:
    """Where the query of ``rest`` (what follows ``scheme://``) begins: the
    first ``?`` followed by a known option's ``name=``, or -1. A ``?`` that
    is not is taken for part of a password written unencoded (base64
    secrets hold ``/``, ``+`` and ``=``; generated ones ``?``, ``#``, ``@``)."""
    names = _option_names()
    at = rest.find("?")
    while at != -1:
        name, eq, _ = rest[at + 1 :].partition("=")
        if eq and unquote_plus(name.partition("&")[0]) in names:
            return at
        at = rest.find("?", at + 1)
    return -1


def _userinfo(rest: str, socket_path: bool) -> tuple[str | None, str]:
    """``(userinfo, the rest after it)`` of what follows ``scheme://``.

    The userinfo ends at the last ``@`` before the query, so a password may
    hold any character, written raw or percent-encoded: ``/ ? # @ :`` too
    (RFC 3986 wants them encoded; secrets are pasted as they are). A Unix
    socket's URI (``unix://[[USER]:PASSWORD@]/PATH``) is the exception: its
    path may hold an ``@``, so its userinfo ends at the last ``@/``, and a
    URI whose rest starts with ``/`` has none."""
    if socket_path:
        if rest.startswith("/"):
            return None, rest
        query = _query_start(rest)
        at = rest.rfind("@/", 0, len(rest) if query == -1 else query)
    else:
        query = _query_start(rest)
        at = rest.rfind("@", 0, len(rest) if query == -1 else query)
    if at == -1:
        return None, rest
    return rest[:at], rest[at + 1 :]


def _redact_query(query: str) -> str:
    """A query's fields with every secret value as ``***``. A field that does
    not begin with a known option's ``name=`` continues the value before it
    (a password holding a raw ``&``): after a secret field it is masked too."""
    names = _option_names()
    out: list[str] = []
    masking = False
    for field in query.split("&"):
        name, eq, _ = field.partition("=")
        decoded = unquote_plus(name)
        if eq and decoded in names:
            masking = bool(SECRET_FIELD_NAME.search(decoded))
        elif masking:
            # the secret value's continuation, its name too (password=ab&passX=1
            # is the password 'ab&passX=1'): folded into its ***
            continue
        elif eq and SECRET_FIELD_NAME.search(decoded):
            masking = True  # an unknown secret-looking name: refused, but not shown
        out.append(f"{name}=***" if masking else field)
    return "&".join(out)


def redact_uri(uri: str) -> str:
    """``uri`` with every password shown as ``***``: the userinfo's
    (``user:password@``, ``:password@``), and the query's ``password=``,
    ``sentinel_password=``, ``ssl_password=`` (any name that looks secret),
    in any spelling a URI allows: raw ``/ ? # @ : &``, percent-encoded,
    ``+`` for a space. What cannot be read as a URI is ``***`` whole."""
    if not isinstance(uri, str):
        return repr(type(uri))
    scheme, sep, rest = uri.partition("://")
    if not sep or not scheme.replace("+", "").replace("-", "").replace(".", "").isalnum():
        return "***" if ("@" in uri or SECRET_FIELD_NAME.search(uri)) else uri
    low = scheme.lower()
    userinfo, rest = _userinfo(rest, low.endswith("unix"))
    shown = ""
    if userinfo is not None:
        user, colon, _ = userinfo.partition(":")
        # USER@ without a colon is shown as ***@ too: a user alone cannot log
        # in, so it is most often a password written without its colon
        shown = f"{user}:***@" if colon else "***@"
    query = _query_start(rest)
    if query == -1:
        query = rest.find("?")
    head, tail = (rest, "") if query == -1 else (rest[:query], rest[query + 1 :])
    if userinfo is None and "@" in head and not head.startswith("/"):
        # no userinfo found but an @ before the query: whatever it is, it
        # is not shown
        head = "***@" + head.rpartition("@")[2]
    out = f"{scheme}://{shown}{head}"
    if query != -1:
        out += "?" + _redact_query(tail)
    return out


# -- the URI's parts ---------------------------------------------------------------
@dataclass
class _Parts:
    scheme: str  # as written, lower case
    asyncio: bool
    base: str  # memory, shm, redis, rediss, valkey, valkeys
    topology: str  # "", unix, sentinel, cluster
    username: str | None
    password: str | None
    authority: str  # the host part as written (shm's name)
    path: str
    query: dict[str, str]
    #: query names that follow a secret field and are no option: likely the
    #: rest of a password holding a raw ``&``, so never shown in a message
    hidden: frozenset[str] = frozenset()


def _authority(head: str) -> tuple[str, str]:
    """What follows the userinfo, up to the query, split where the path starts."""
    host, slash, path = head.partition("/")
    return host, slash + path


def _schemes_line() -> str:
    shown = ", ".join(f"{s}://" for s in SCHEMES)
    return f"accepted schemes: {shown} (each Redis/Valkey one also as async+<scheme>://)"


def _split(uri: str) -> _Parts:
    if not isinstance(uri, str):
        raise ValidationError(f"a storage URI must be a str, got {type(uri).__name__}")
    scheme, sep, rest = uri.strip().partition("://")
    if not sep or not scheme:
        raise ValidationError(f"not a storage URI (no scheme://); {_schemes_line()}")
    scheme = scheme.lower()
    name = scheme[len(_ASYNC) :] if scheme.startswith(_ASYNC) else scheme
    asyncio = name != scheme
    if name == "unix":
        name = "redis+unix"
    base, _, topology = name.partition("+")
    known = name in SCHEMES and not (asyncio and base in ("memory", "shm"))
    if not known:
        shown = (
            _shown(scheme) if re.fullmatch(r"[a-z0-9+.-]+", scheme) else "(not shown: it is no scheme name)"
        )
        raise ValidationError(f"unknown storage scheme {shown}://; {_schemes_line()}")
    userinfo, rest = _userinfo(rest, topology == "unix")
    query = _query_start(rest)
    if query == -1 and "?" in rest:
        # a query of no known option: split at its first '?' (and refuse its options, by name)
        query = rest.find("?")
    head, query_text = (rest, "") if query == -1 else (rest[:query], rest[query + 1 :])
    hostpart, path = _authority(head)
    username = password = None
    if userinfo is not None:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    fields, hidden = _query(query_text, scheme)
    return _Parts(scheme, asyncio, base, topology, username, password, hostpart, path, fields, hidden)


def _query(text: str, scheme: str) -> tuple[dict[str, str], frozenset[str]]:
    out: dict[str, str] = {}
    hidden: set[str] = set()
    if not text:
        return out, frozenset()
    names = _option_names()
    after_secret = False
    for i, field in enumerate(text.split("&")):
        if not field:
            continue
        name, eq, value = field.partition("=")
        name = unquote_plus(name)
        if name in names:
            after_secret = bool(SECRET_FIELD_NAME.search(name))
        elif after_secret or SECRET_FIELD_NAME.search(name):
            hidden.add(name)
        if not eq:
            raise ValidationError(
                f"{scheme}://: query field #{i + 1} has no '=' (write name=value; "
                "a raw '&' in a password is written %26)"
            )
        if name in out:
            shown = "a field" if name in hidden else f"option {_shown(name)}"
            raise ValidationError(f"{scheme}://: {shown} is given twice in the query")
        out[name] = unquote_plus(value)
    return out, frozenset(hidden)


def _shown(name: str) -> str:
    return repr(name if len(name) <= 40 else name[:40] + "...")


def _hosts(parts: _Parts, several: bool, default_port: int, form: str) -> list[tuple[str, int]]:
    text = parts.authority
    if not text:
        raise ValidationError(f"{parts.scheme}:// needs a host: {form}")
    items = text.split(",")
    if len(items) > 1 and not several:
        raise ValidationError(
            f"{parts.scheme}:// takes one host (several are for the +sentinel and +cluster schemes): {form}"
        )
    hosts = []
    for n, item in enumerate(items, 1):
        item = unquote(item)
        if item.startswith("["):  # [IPv6]:port
            host, close, after = item[1:].partition("]")
            if not close or (after and not after.startswith(":")):
                raise ValidationError(f"{parts.scheme}://: host #{n} is not [IPv6] or [IPv6]:PORT")
            port_text = after[1:] if after else ""
        else:
            host, _, port_text = item.partition(":")
        if not host:
            raise ValidationError(f"{parts.scheme}://: host #{n} is empty: {form}")
        port = default_port
        if port_text:
            if not (
                port_text.isascii()
                and port_text.isdigit()
                and len(port_text) <= 5
                and 1 <= int(port_text) <= 65535
            ):
                raise ValidationError(
                    f"{parts.scheme}://: the port of host #{n} must be a number in 1..65535"
                )
            port = int(port_text)
        hosts.append((host, port))
    return hosts


# -- options -----------------------------------------------------------------------
def _options(
    parts: _Parts, table: Mapping[str, _Option], keywords: Mapping[str, Any], why_not: Mapping[str, str]
) -> dict[str, Any]:
    """The query's and the keywords' options, converted; a keyword wins."""
    merged: dict[str, tuple[Any, bool]] = {name: (value, False) for name, value in parts.query.items()}
    merged.update({name: (value, True) for name, value in keywords.items()})
    out: dict[str, Any] = {}
    for name, (value, keyword) in merged.items():
        option = table.get(name)
        if option is None:
            hint = why_not.get(name) or (f" (use {_INSTEAD[name]})" if name in _INSTEAD else "")
            accepted = ", ".join(sorted(n for n in table if keyword or not table[n].keyword_only))
            shown = (
                "option named by a field that follows a secret one (a raw '&' in a password is written %26)"
                if name in parts.hidden
                else f"option {_shown(name)}{hint}"
            )
            raise ValidationError(f"{parts.scheme}:// has no {shown}; it accepts: {accepted}")
        if option.keyword_only and not keyword:
            raise ValidationError(
                f"{parts.scheme}://: option {name!r} is given as a keyword only, not in the query"
            )
        try:
            out[name] = option.convert(value)
        except _Bad as exc:
            got = (
                ""
                if option.secret
                else f", got {_shown(value) if isinstance(value, str) else repr(value)[:60]}"
            )
            raise ValidationError(f"{parts.scheme}://: option {name!r} {exc}{got}") from None
    return out


def _no_path(parts: _Parts, form: str) -> None:
    if parts.path not in ("", "/"):
        raise ValidationError(f"{parts.scheme}:// takes no path: {form}")


# -- the storages ------------------------------------------------------------------
def storage_from_uri(uri: str, **options: Any) -> Storage:
    """The storage ``uri`` names, with its options.

    ``memory://`` — an ``InMemoryStorage`` of this process (bounded at
    ``DEFAULT_MEMORY_MAX_KEYS`` unless ``max_keys`` says otherwise, ``none``
    for unbounded). ``shm://NAME`` — the shared-memory zone ``NAME``:
    created or joined with ``max_keys``, attached with the zone's own
    parameters without it (never created then). ``redis://``,
    ``rediss://`` (TLS), ``redis+unix:///path.sock`` (``unix://``),
    ``redis+sentinel://HOST:PORT[,HOST:PORT]/SERVICE[/DB]``,
    ``redis+cluster://HOST:PORT[,HOST:PORT]``, the same with ``valkey``
    (valkey-py when installed, else redis-py), each also as
    ``async+<scheme>://`` for an ``AsyncRedisStorage``: a ``RedisStorage``
    over a client made for it, which the storage owns (``close()`` closes
    it). See docs/storage_uris.md for every option.
    """
    parts = _split(uri)
    if parts.base == "memory":
        storage = _memory(parts, options)
    elif parts.base == "shm":
        storage = _zone(parts, options)
    else:
        storage = _redis(parts, options)
        storage.address = redact_uri(uri.strip())  # what its outage log names
    return storage  # type: ignore[no-any-return]


def storage_kind(uri: str) -> str:
    """``"memory"``, ``"shm"``, ``"redis"`` or ``"async"`` (a Redis/Valkey
    scheme under ``async+``): what ``uri`` names, read from its scheme alone
    (so a tool can choose options before anything is made)."""
    parts = _split(uri)
    if parts.asyncio:
        return "async"
    return parts.base if parts.base in ("memory", "shm") else "redis"


def _memory(parts: _Parts, keywords: Mapping[str, Any], dry: bool = False) -> Any:
    form = "memory://[?max_keys=N&stripes=N&on_full=evict|deny_new&evict_idle_after=SECONDS]"
    if parts.authority or parts.username or parts.password is not None:
        raise ValidationError(f"memory:// names no host: {form}")
    _no_path(parts, form)
    opts = _options(parts, _TABLE_OPTIONS, keywords, {})
    opts.setdefault("max_keys", DEFAULT_MEMORY_MAX_KEYS)
    from .._select import twin
    from .._validation import check_storage_options

    try:
        if dry:
            return check_storage_options(
                opts.get("stripes", 64),
                opts.get("max_key_bytes", 1024),
                opts["max_keys"],
                opts.get("on_full", "evict"),
                opts.get("evict_idle_after"),
            )
        return twin.InMemoryStorage(**opts)
    except ValidationError as exc:
        raise ValidationError(f"memory://: {exc}") from None


def _zone(parts: _Parts, keywords: Mapping[str, Any], dry: bool = False) -> Any:
    form = "shm://NAME[?max_keys=N&...] (without max_keys: attach to the zone NAME that exists)"
    if parts.username or parts.password is not None:
        raise ValidationError(f"shm:// takes no user or password: {form}")
    _no_path(parts, form)
    name = unquote(parts.authority)
    if not name:
        raise ValidationError(f"shm:// needs the zone's name: {form}")
    opts = _options(parts, _ZONE_OPTIONS, keywords, {})
    if dry:
        if opts and "max_keys" not in opts:
            raise ValidationError(f"shm://: {', '.join(sorted(opts))} need max_keys")
        from .._validation import check_zone_name, check_zone_options

        try:  # the zone's own checks (name, stripes, ...): what making it would refuse
            check_zone_options(name, opts) if opts else check_zone_name(name)
        except ValidationError as exc:
            raise ValidationError(f"shm://: {exc}") from None
        return None
    from .shared_memory import SharedMemoryStorage

    try:
        if "max_keys" in opts:
            return SharedMemoryStorage(name, **opts)
        if opts:
            raise ValidationError(
                f"{', '.join(sorted(opts))} need max_keys: without it the zone is attached "
                "with its own parameters"
            )
        return SharedMemoryStorage.attach(name)
    except ValidationError as exc:
        raise ValidationError(f"shm://: {exc}") from None


@dataclass(frozen=True)
class _Library:
    name: str  # redis or valkey
    client: Any  # Redis / Valkey
    cluster: Any
    node: Any  # ClusterNode
    sentinel: Any


def _library(base: str, asyncio: bool) -> _Library:
    """valkey-py for the valkey schemes when it is installed, else redis-py."""
    names = ("valkey", "redis") if base.startswith("valkey") else ("redis",)
    for top in names:
        home = top + (".asyncio" if asyncio else "")
        try:
            client_mod = importlib.import_module(home)
            cluster_mod = importlib.import_module(home + ".cluster")
            sentinel_mod = importlib.import_module(home + ".sentinel")
        except ImportError:
            continue
        prefix = "Valkey" if top == "valkey" else "Redis"
        return _Library(
            top,
            getattr(client_mod, prefix),
            getattr(cluster_mod, prefix + "Cluster"),
            cluster_mod.ClusterNode,
            sentinel_mod.Sentinel,
        )
    raise ValidationError(f"the {base}:// schemes need redis-py: pip install 'nanolimit[redis]'")


def _check_taken(parts: _Parts, cls: Any, kwargs: Mapping[str, Any]) -> None:
    """Refuse a client option this client class does not take (the asyncio
    cluster has no ``ssl_ca_path``), by name, before it fails inside."""
    import inspect

    params = inspect.signature(cls.__init__).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for name in kwargs:
        if name not in params:
            raise ValidationError(
                f"{parts.scheme}://: option {name!r} is not taken by {cls.__module__}.{cls.__name__}"
            )


def _redis_table(parts: _Parts) -> tuple[dict[str, _Option], dict[str, str]]:
    """The options a Redis/Valkey scheme takes, and why the others are not."""
    tls = parts.base in _TLS
    top = parts.topology
    table: dict[str, _Option] = {**_redis_options(), **_CLIENT_OPTIONS}
    why_not: dict[str, str] = {}
    if tls:
        table.update(_TLS_OPTIONS)
    else:
        why_not.update({n: " (TLS options need a rediss:// or valkeys:// scheme)" for n in _TLS_OPTIONS})
    if top == "sentinel":
        table.update(_SENTINEL_OPTIONS)
    else:
        why_not.update({n: " (for the +sentinel schemes)" for n in _SENTINEL_OPTIONS})
    if top == "cluster":
        del table["db"]
        why_not["db"] = " (a cluster has database 0 only)"
    return table, why_not


def check_storage_uri(uri: str, **options: Any) -> str:
    """Check ``uri`` and its options as :func:`storage_from_uri` does, with
    nothing made or connected (``nanolimit check-config`` reads a rules
    file's ``[storage]`` with it): a :class:`ValidationError` naming the
    option and its bounds, or the URI's kind (:func:`storage_kind`)."""
    parts = _split(uri)
    if parts.base == "memory":
        _memory(parts, options, dry=True)
        return "memory"
    if parts.base == "shm":
        _zone(parts, options, dry=True)
        return "shm"
    _redis(parts, options, dry=True)
    return "async" if parts.asyncio else "redis"


class _Dry:
    """A client library that makes nothing: ``check_storage_uri`` runs the
    URI's own checks (hosts, path, database) through it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def master_for(self, service: str) -> _Dry:
        return self


_DRY: Final = _Library("dry", _Dry, _Dry, _Dry, _Dry)


def _redis(parts: _Parts, keywords: Mapping[str, Any], dry: bool = False) -> Any:
    tls = parts.base in _TLS
    storage_table = _redis_options()
    table, why_not = _redis_table(parts)
    opts = _options(parts, table, keywords, why_not)
    storage_opts = {n: v for n, v in opts.items() if n in storage_table}
    client_opts = {n: v for n, v in opts.items() if n not in storage_table}
    if parts.username is not None:
        client_opts.setdefault("username", parts.username)
    if parts.password is not None:
        client_opts.setdefault("password", parts.password)
    elif parts.username is not None and "password" not in client_opts:
        # redis://s3cret@host read s3cret as a user name: every decision
        # failed to log in (degraded: allowed under on_error=allow) and the
        # outage log named the store with the password in it
        raise ValidationError(
            f"{parts.scheme}://: the URI names a user but no password (USER@HOST): a password "
            "alone is written :PASSWORD@HOST, a user with one USER:PASSWORD@HOST, a user "
            "without one USER:@HOST"
        )
    timeout = storage_opts.get("timeout", 0.05)
    connect = storage_opts.pop("connect_timeout", None)
    # the client we make is bounded too: a cluster and a Sentinel are asked on their own
    client_opts["socket_timeout"] = timeout
    client_opts["socket_connect_timeout"] = timeout if connect is None else connect
    if tls:
        client_opts["ssl"] = True
    if dry:
        _make_client(parts, _DRY, client_opts)
        try:
            real = _library(parts.base, parts.asyncio)
        except ValidationError:
            return None  # no client library here: the start says so
        # the options the client class itself refuses by name (the asyncio
        # cluster has no ssl_ca_path): imported, nothing made
        cls = real.cluster if parts.topology == "cluster" else real.client
        _check_taken(parts, cls, {n: v for n, v in client_opts.items() if not n.startswith("sentinel_")})
        return None
    lib = _library(parts.base, parts.asyncio)
    client = _make_client(parts, lib, client_opts)
    from .redis import AsyncRedisStorage, RedisStorage, connect_timeout

    cls = AsyncRedisStorage if parts.asyncio else RedisStorage
    try:
        with connect_timeout(connect):
            storage = cls(client, **storage_opts)
    except ValidationError as exc:
        _close_unused(client, parts.asyncio)
        raise ValidationError(f"{parts.scheme}://: {exc}") from None
    except BaseException:
        _close_unused(client, parts.asyncio)
        raise
    if storage.client is not client:
        # decisions go through the derived client; ours served only to make it
        _close_unused(client, parts.asyncio)
    return storage


def _make_client(parts: _Parts, lib: _Library, opts: dict[str, Any]) -> Any:
    top = parts.topology
    if top == "unix":
        form = f"{parts.scheme}:///PATH/TO.sock[?db=N]"
        if parts.authority:
            raise ValidationError(f"{parts.scheme}:// takes a socket path, not a host: {form}")
        path = unquote(parts.path)
        if path in ("", "/"):
            raise ValidationError(f"{parts.scheme}:// needs the socket's path: {form}")
        _check_taken(parts, lib.client, opts)
        return lib.client(unix_socket_path=path, **opts)
    if top == "sentinel":
        form = f"{parts.scheme}://HOST[:PORT][,HOST[:PORT]...]/SERVICE_NAME[/DB]"
        hosts = _hosts(parts, True, _DEFAULT_SENTINEL_PORT, form)
        pieces = [unquote(p) for p in parts.path.split("/")[1:]]
        if not pieces or not pieces[0]:
            raise ValidationError(f"{parts.scheme}:// needs the service name the Sentinels watch: {form}")
        if len(pieces) > 2 or (len(pieces) == 2 and not _db_number(pieces[1])):
            raise ValidationError(f"{parts.scheme}://: after the service name only a database number: {form}")
        if len(pieces) == 2:
            opts.setdefault("db", int(pieces[1]))
        watchers = {
            "socket_timeout": opts["socket_timeout"],
            "socket_connect_timeout": opts["socket_connect_timeout"],
        }
        for name in ("username", "password"):
            value = opts.pop("sentinel_" + name, None)
            if value is not None:
                watchers[name] = value
        service = pieces[0]
        _check_taken(parts, lib.client, opts)
        manager = lib.sentinel(hosts, sentinel_kwargs=watchers, **opts)
        return manager.master_for(service)
    if top == "cluster":
        form = f"{parts.scheme}://HOST[:PORT][,HOST[:PORT]...]"
        hosts = _hosts(parts, True, _DEFAULT_PORT, form)
        if parts.path not in ("", "/", "/0"):
            raise ValidationError(f"{parts.scheme}:// takes no path (a cluster has database 0 only): {form}")
        _check_taken(parts, lib.cluster, opts)
        nodes = [lib.node(host, port) for host, port in hosts]
        try:
            return lib.cluster(startup_nodes=nodes, **opts)
        except (TypeError, ValueError) as exc:
            raise ValidationError(f"{parts.scheme}://: {exc}") from None
        except _failures(lib) as exc:  # the synchronous cluster asks its nodes at once
            from ..errors import RedisUnavailableError

            shown = ",".join(f"{h}:{p}" for h, p in hosts)
            raise RedisUnavailableError(
                f"{parts.scheme}://: no node of {shown} answered: {type(exc).__name__}: {exc}"
            ) from None
    form = f"{parts.scheme}://[[USER]:PASSWORD@]HOST[:PORT][/DB]"
    [(host, port)] = _hosts(parts, False, _DEFAULT_PORT, form)
    path = parts.path.strip("/")
    if path:
        if not _db_number(path):
            raise ValidationError(f"{parts.scheme}://: the path is the database number: {form}")
        opts.setdefault("db", int(path))
    _check_taken(parts, lib.client, opts)
    return lib.client(host=host, port=port, **opts)


def _db_number(text: str) -> bool:
    """A database number as a path holds it: digits, within an int32."""
    return text.isascii() and text.isdigit() and len(text) <= 10 and int(text) <= _MAX_INT32


def _failures(lib: _Library) -> tuple[type[BaseException], ...]:
    """What a client library raises when a server cannot be reached (its
    cluster's own exception is not under its base error)."""
    exceptions = importlib.import_module(lib.name + ".exceptions")
    found: list[type[BaseException]] = [OSError]
    for name in ("RedisError", "ValkeyError", "RedisClusterException", "ValkeyClusterException"):
        cls = getattr(exceptions, name, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


def _close_unused(client: Any, asyncio: bool) -> None:
    """Close a client we made that nothing will use: only the synchronous
    cluster holds connections by then (it asks its nodes at construction);
    an asyncio client has opened none before its first command."""
    if not asyncio:
        client.close()
