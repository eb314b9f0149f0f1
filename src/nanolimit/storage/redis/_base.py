"""What the synchronous and the asyncio storage share: options, key layout,
argument caches, verdict parsing, the failure policy, the near-cache and the
metrics, plus the limiter glue of ``allow_all``.

Why a private module: none of it does I/O, so both storages (in this
package's ``__init__``) build on it, each sending what it prepares.
"""

from __future__ import annotations

import functools
import hashlib
import re
import threading
import time
import weakref
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar, Final, Literal, NoReturn

from ..._clocks import MAX_CLOCK_LEAD, MAX_TIME, SystemClock, check_now
from ..._decision_py import REASON_STORE_ERROR, REASON_STORE_UNAVAILABLE, KernelVerdict, decision_from_verdict
from ..._limiter_config import Algorithm, LimiterConfig, LimiterState
from ..._select import event_counter, twin_of
from ..._validation import (
    MAX_KEY_BYTES,
    MAX_LIMIT,
    MAX_WINDOW,
    check_cutoff,
    check_int_option,
    check_seconds_option,
)
from ...errors import CircuitOpenError, RedisKeyError, RedisUnavailableError, ValidationError
from ._cluster import NodeRoutes
from ._connections import (
    _AsyncSpareConnections,
    _SyncSpareConnections,
    address_of,
    check_client,
    client_package,
    connection_args,
    derive_client,
    direct_path,
    is_asyncio_client,
    is_cluster_client,
)
from ._local import DEFAULT_LOCAL_MAX_KEYS, LocalFallback, check_local_options
from ._near_cache import _NearCache
from ._resilience import (
    ON_ERROR_POLICIES,
    PERMISSION_CODES,
    SERVER_ERROR_CODES,
    WRITE_REFUSED_CODES,
    OnError,
    _Breaker,
    _code_of_text,
    error_code,
    is_noscript,
    log_outage,
    log_recovery,
)
from ._scripts import (
    BATCH_CHUNK,
    BATCH_SCRIPTS,
    INJECTED_EXPIRY_FLOOR_MS,
    REFUND_SCRIPTS,
    SCRIPTS,
    LuaScript,
    _params,
    _parse_verdict,
)

#: The bound of a count option (breaker threshold, near-cache entries): an
#: int32, so no count is ever a number no table or counter could hold.
MAX_COUNT = (1 << 31) - 1  # storage/uri.py names the same bound

# --------------------------------------------------------------------------
# The storages: what the synchronous and the asyncio one share, then each one's I/O


def _digest(text: str, salt: bytes) -> str:
    return "#" + hashlib.blake2b(text.encode("utf-8"), digest_size=16, key=salt).hexdigest()


# One script call of a batch: script, its keys, its arguments, the batch positions it decides.
_Call = tuple[LuaScript, list[str], list[str], list[int]]
_REDIRECT_CODES = frozenset({"MOVED", "ASK"})


_MAX_EXACT: Final = float(1 << 53)  # the scripts' MAX_EXACT: window indices and TATs below it


def _text(raw: Any) -> str:
    return raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)


# What the scripts' ``tonumber`` (Lua 5.1: C's ``strtod``) reads as a number:
# ASCII digits, a decimal or hex (``0x``) form, inf/nan, C whitespace around.
# Python's ``float`` differs both ways ("1_0" and full-width digits taken,
# "0x2" refused), and state() must refuse exactly what the decisions refuse.
_LUA_NUMBER = re.compile(
    r"[ \t\n\v\f\r]*([-+]?(?:(0[xX])(?:[0-9a-fA-F]+\.?[0-9a-fA-F]*|\.[0-9a-fA-F]+)(?:[pP][-+]?[0-9]+)?"
    r"|(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?|(?i:inf(?:inity)?|nan)))[ \t\n\v\f\r]*",
    re.ASCII,
)


def _number(algo: Algorithm, raw: Any) -> float:
    """A stored field as a number, read as the scripts' ``tonumber`` reads
    it; one that is none is a foreign state."""
    found = _LUA_NUMBER.fullmatch(_text(raw))
    if found is None:
        raise _bad_state(algo)
    number = found.group(1)
    return float.fromhex(number) if found.group(2) else float(number)


def _whole(x: float, bound: float) -> bool:
    return -bound < x < bound and x == int(x)


def _count(x: float) -> bool:
    return 0.0 <= x <= MAX_LIMIT and x == int(x)


def _stamp(x: float) -> bool:
    return -MAX_TIME < x < MAX_TIME


def _bad_state(algo: Algorithm) -> RedisKeyError:
    """What a snapshot of a foreign value raises: the scripts' own ``BADSTATE``."""
    return RedisKeyError(
        f"BADSTATE {algo.value}: the stored state is not one this limiter writes "
        '(docs/redis.md, "Foreign values")',
        "BADSTATE",
    )


class _RedisBase:
    """Everything but the I/O, shared by :class:`RedisStorage` and
    :class:`AsyncRedisStorage`: options, key layout, argument caches, verdict
    parsing, the failure policy, the circuit breaker, the near-cache and the
    metrics. A subclass sends what these methods prepare and hands the
    replies back; see :class:`RedisStorage` for the options."""

    _asyncio: ClassVar[bool] = False

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "nanolimit:",
        clock: Literal["server", "client"] = "server",
        on_error: OnError = "allow",
        rule_on_error: Mapping[str, OnError] | None = None,
        timeout: float = 0.05,
        derive: bool = True,
        deny_retry_after: float = 1.0,
        breaker_threshold: int = 5,
        breaker_cooldown: float = 1.0,
        batch: Literal["script", "pipeline"] = "script",
        near_cache: bool = False,
        near_cache_size: int = 10_000,
        near_cache_ttl: float = 1.0,
        secret_rules: Collection[str] = (),
        hash_identities: bool = False,
        max_identity_bytes: int = 64,
        key_salt: bytes = b"",
        max_key_bytes: int = MAX_KEY_BYTES,
        keep_connections: int = 8,
        local_share: float | None = None,
        local_instances: int = 1,
        local_max_keys: int = DEFAULT_LOCAL_MAX_KEYS,
    ) -> None:
        # every option is checked here, where it is given, and never later:
        # a value that only fails when it is first used (a local fallback's
        # bound at the first decision of an outage) fails now instead
        keep_connections = check_int_option("keep_connections", keep_connections, 0, 1 << 16)
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ValidationError("prefix must be a str without '{' or '}' (they would become a hash tag)")
        if batch not in ("script", "pipeline"):
            raise ValidationError(f"batch must be 'script' or 'pipeline', got {batch!r}")
        if clock not in ("server", "client"):
            raise ValidationError(f"clock must be 'server' or 'client', got {clock!r}")
        for policy in (on_error, *(rule_on_error or {}).values()):
            if policy not in ON_ERROR_POLICIES:
                raise ValidationError(f"on_error must be one of {ON_ERROR_POLICIES}, got {policy!r}")
        timeout = check_seconds_option("timeout", timeout, 0, 60)
        deny_retry_after = check_seconds_option("deny_retry_after", deny_retry_after, 0, MAX_WINDOW)
        breaker_threshold = check_int_option("breaker_threshold", breaker_threshold, 1, MAX_COUNT)
        breaker_cooldown = check_seconds_option(
            "breaker_cooldown", breaker_cooldown, 0, 86_400, low_open=False
        )
        near_cache_size = check_int_option("near_cache_size", near_cache_size, 1, MAX_COUNT)
        near_cache_ttl = check_seconds_option("near_cache_ttl", near_cache_ttl, 0, 86_400)
        max_identity_bytes = check_int_option("max_identity_bytes", max_identity_bytes, 1, 1 << 20)
        max_key_bytes = check_int_option("max_key_bytes", max_key_bytes, 1, 1 << 20)
        share, instances, local_keys = check_local_options(local_share, local_instances, local_max_keys)
        if not isinstance(key_salt, (bytes, bytearray, memoryview)) or len(key_salt) > 64:
            raise ValidationError("key_salt must be bytes, at most 64 of them (a BLAKE2b key)")
        check_client(client)
        if is_asyncio_client(client) is not self._asyncio:
            want, other = (
                ("an asyncio", "RedisStorage") if self._asyncio else ("a synchronous", "AsyncRedisStorage")
            )
            raise ValidationError(
                f"{type(self).__name__} needs {want} client, got {type(client).__module__}."
                f"{type(client).__name__} (use {other} for that one)"
            )
        self.user_client = client
        #: where the store is, for the outage log: the URI redacted when
        #: storage_from_uri made it, else read from the client (no credential)
        self.address = address_of(client)
        self.client = derive_client(client, float(timeout)) if derive else client
        self.cluster = is_cluster_client(client)
        self.prefix = prefix
        algorithms = "|".join(re.escape(a.value) for a in Algorithm)
        # what every key of this storage starts with (a two-tier store's
        # hashes too: they extend a limiter key)
        self._key_shape = re.compile(re.escape(prefix) + f"(?:{algorithms}):")
        self.clock = clock
        self.batch = batch
        self.on_error: OnError = on_error
        self.rule_on_error: dict[str, OnError] = dict(rule_on_error or {})
        self.timeout = float(timeout)
        self.deny_retry_after = float(deny_retry_after)
        self.secret_rules = frozenset(secret_rules)
        self.hash_identities = hash_identities
        self.max_identity_bytes = max_identity_bytes
        self.key_salt = bytes(key_salt)
        self.max_key_bytes = max_key_bytes
        self._breaker = _Breaker(breaker_threshold, breaker_cooldown)
        # a cluster: one breaker per node, decisions sent to the owning node's
        # connection, the node map refreshed off the decision path (``_cluster``)
        self._routes: NodeRoutes | None = None
        if self.cluster:
            self._routes = NodeRoutes(self.client, breaker_threshold, breaker_cooldown, self._asyncio)
        # the local store of on_error="local", made only when a rule uses it
        self._local: LocalFallback | None = None
        if "local" in (on_error, *self.rule_on_error.values()):
            self._local = LocalFallback(share, instances, local_keys, max_key_bytes, self.deny_retry_after)
            if self._routes is not None:
                self._routes.on_gone = self._local.handover
        self._setup_direct(keep_connections)
        self._near = _NearCache(near_cache_size, near_cache_ttl) if near_cache else None
        self._counts = {
            "decisions": 0,
            "errors": 0,
            "degraded": 0,
            "timeouts": 0,
            "key_errors": 0,
            "write_refused": 0,
            "script_loads": 0,
            "breaker_open_skips": 0,
            "refunds": 0,
            "refunds_dropped": 0,
        }
        self._count_lock = threading.Lock()
        self._near_hits = event_counter()  # counted on the near-cache's hot path: no lock
        self._decisions = event_counter()  # and this one on every decision's
        self._prefixes: dict[tuple[Algorithm, str], str] = {}
        self._param_cache: dict[LimiterConfig, tuple[str, str]] = {}
        # the last config asked for: a limiter passes the same object every
        # time, and an identity test is cheaper than hashing the dataclass
        self._last_params: tuple[LimiterConfig | None, tuple[str, str]] = (None, ("", ""))
        # What counts as "the store failed": the client library's base error
        # (redis-py's RedisError, valkey-py's ValkeyError) and socket errors;
        # anything unknown is caught broadly rather than raised into a request.
        self._errors: tuple[type[BaseException], ...] = (Exception,)
        # The server's error replies (redis-py's ResponseError): the ones
        # about a key answer that key alone (see ``_error_verdict``).
        self._reply_errors: tuple[type[BaseException], ...] = ()
        self._connect_error: tuple[type[BaseException], ...] = ()
        # What counts in ``timeouts``: the client's own TimeoutError (redis-py's
        # is not the builtin one) and the builtin (socket and asyncio timeouts).
        self._timeout_errors: tuple[type[BaseException], ...] = (TimeoutError,)
        try:
            exceptions = client_package(client).exceptions
            base = getattr(exceptions, "RedisError", None) or getattr(exceptions, "ValkeyError", None)
            if isinstance(base, type) and issubclass(base, BaseException):
                self._errors = (base, OSError)
            # a cluster client's own failures (no node answered, slots not
            # covered) are not RedisErrors: an outage all the same
            cluster = getattr(exceptions, "RedisClusterException", None) or getattr(
                exceptions, "ValkeyClusterException", None
            )
            if isinstance(cluster, type) and issubclass(cluster, BaseException):
                self._errors = (*self._errors, cluster)
            reply = getattr(exceptions, "ResponseError", None)
            if isinstance(reply, type) and issubclass(reply, BaseException):
                self._reply_errors = (reply,)
            connect = getattr(exceptions, "ConnectionError", None)
            if isinstance(connect, type) and issubclass(connect, BaseException):
                self._connect_error = (connect,)
            timed_out = getattr(exceptions, "TimeoutError", None)
            if isinstance(timed_out, type) and issubclass(timed_out, BaseException):
                self._timeout_errors = (TimeoutError, timed_out)
        except (ImportError, AttributeError):
            pass

    def _setup_direct(self, keep: int) -> None:
        """Decide whether single calls may talk to a pooled connection directly.

        redis-py 8 wraps every ``execute_command`` in retry and observability
        machinery that costs about 25 µs on this machine — most of what a
        decision costs above a ``PING``. The decision call needs none of it
        (it must not be retried), so on a standalone client we take a
        connection from the client's pool, send, read and give it back, as
        redis-py itself does underneath (the asyncio client alike, awaiting
        each step). Only for the client and pool types the library itself
        defines (:func:`direct_path`): clusters (routing), single-connection
        clients and any subclass or unknown pool go through the public
        ``execute_command``.
        """
        self._pool: Any = None
        self._conn_args: tuple[str, ...] = ()
        self._spares: Any = None  # _SyncSpareConnections or _AsyncSpareConnections
        path = direct_path(self.client)
        if path == "public":
            return
        pool = self.client.connection_pool
        if not (hasattr(pool, "get_connection") and hasattr(pool, "release")):
            return
        conn_args = connection_args(pool)
        if conn_args is None:
            return
        self._conn_args = conn_args
        self._pool = pool
        if path == "kept":
            self._keep_spares(pool, keep)

    def _keep_spares(self, pool: Any, keep: int) -> None:
        """Let single calls keep up to ``keep`` connections out of the
        derived client's pool between calls (see :class:`_SpareConnections`):
        never the caller's pool, which may have other users waiting, nor a
        blocking one, and fewer than half of a bounded one."""
        limit = getattr(pool, "max_connections", None)
        if isinstance(limit, int):
            keep = min(keep, limit // 2)
        if (
            keep <= 0
            or self.client is self.user_client
            or isinstance(getattr(pool, "timeout", None), (int, float))
        ):
            return
        exceptions = getattr(client_package(self.client), "exceptions", None)
        if self._asyncio:
            self._spares = _AsyncSpareConnections(pool, self._conn_args, keep, exceptions)
            return
        spares = _SyncSpareConnections(pool, self._conn_args, keep, exceptions)
        self._spares = spares
        weakref.finalize(self, spares.release_all)

    # -- keys -------------------------------------------------------------------
    def _rule_prefix(self, cfg: LimiterConfig) -> str:
        ident = (cfg.algorithm, cfg.rule)
        found = self._prefixes.get(ident)
        if found is None:
            rule = cfg.rule
            if "{" in rule or "}" in rule or rule.startswith("#") or len(rule.encode("utf-8")) > 128:
                rule = _digest(rule, self.key_salt)
            found = f"{self.prefix}{cfg.algorithm.value}:{rule}:"
            self._prefixes[ident] = found
        return found

    def redis_key(self, cfg: LimiterConfig, key: str) -> str:
        """The Redis key holding ``key``'s state under ``cfg``."""
        identity = key
        if (
            self.hash_identities
            or cfg.rule in self.secret_rules
            or "{" in key
            or "}" in key
            or key.startswith("#")
            or len(key) > self.max_identity_bytes
            or (not key.isascii() and len(key.encode("utf-8")) > self.max_identity_bytes)
        ):
            identity = _digest(key, self.key_salt)
        return self._rule_prefix(cfg) + "{" + identity + "}"

    def _scan_match(self) -> str:
        special = "*?[]\\"
        return "".join("\\" + c if c in special else c for c in self.prefix) + "*"

    def _limiter_key(self, raw: Any) -> str | None:
        """A key ``SCAN`` found under the prefix, if it is one of this
        storage's (``<prefix><algorithm>:...``, UTF-8), else None. Why:
        ``keys()``, ``len()`` and ``clear()`` act on the limiter's keys only;
        by the prefix alone ``clear()`` with ``prefix=""`` deleted every key
        of the database, and a key that is not UTF-8 made each of them raise."""
        if isinstance(raw, bytes):
            try:
                raw = raw.decode("utf-8")
            except UnicodeDecodeError:
                return None
        name = str(raw)
        return name if self._key_shape.match(name) else None

    # -- metrics ------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[name] += n

    def metrics(self) -> dict[str, Any]:
        """Counters since construction: ``decisions`` (answered by the store),
        ``errors`` (the server or the connection failed: what feeds the
        breaker), ``timeouts`` (of those), ``key_errors`` (error replies about
        one call's key: a foreign value, a bad state, a refused write),
        ``write_refused`` (of those, ``OOM``/``MISCONF``), ``degraded``
        (answered by the failure policy), ``script_loads``,
        ``breaker_open_skips``, ``near_cache_hits``, ``refunds`` (made by
        the store; one of a key it does not hold is a no-op) and
        ``refunds_dropped`` (failed, or skipped by the open breaker, and
        dropped by the policy), plus the breaker's
        ``breaker_state`` and how often it ``breaker_opened``. On a cluster
        there is one breaker per node: ``breaker_state`` is the worst
        node's, ``breaker_opened`` the sum, ``breakers_open`` how many nodes'
        breakers are not closed (open, half-open, or still recovering),
        ``topology_refreshes`` the background refreshes of the node map,
        ``nodes_dropped`` the nodes a refresh found owning no slot any more
        (a replica took over: their breakers and local episodes end), and
        ``nodes`` maps each node (``host:port``) to its own
        ``breaker_state``, ``breaker_opened`` and ``recovering``.
        Under
        ``on_error="local"`` also ``local_decisions`` (of ``degraded``: made
        by the local store), ``local_denials`` (of those), ``local_refunds``
        (of local charges), ``local_episodes`` (outages begun) and
        ``local_active`` (how many outages, servers or cluster nodes, a
        local store decides for now)."""
        with self._count_lock:
            out: dict[str, Any] = dict(self._counts)
        out["decisions"] += self._decisions.value
        out["near_cache_hits"] = self._near_hits.value
        routes = self._routes
        if routes is None:
            out["breaker_state"] = self._breaker.state
            out["breaker_opened"] = self._breaker.opened
        else:
            # the worst node's state, every node's openings, and each node's own
            breakers = routes.breakers()
            states = {b.state for b in breakers}
            out["breaker_state"] = next((s for s in ("open", "half-open") if s in states), "closed")
            out["breaker_opened"] = sum(b.opened for b in breakers)
            out["breakers_open"] = sum(1 for b in breakers if not b.closed)
            out["topology_refreshes"] = routes.refreshes
            out["nodes_dropped"] = routes.pruned
            out["nodes"] = routes.metrics()
        if self._local is not None:
            out.update(self._local.metrics())
        return out

    # -- what a decision sends, and what it makes of the answer --------------------
    def _loaded(self, script: LuaScript, sha: Any) -> None:
        """Check the SHA a ``SCRIPT LOAD`` answered."""
        if isinstance(sha, bytes):
            sha = sha.decode()
        if sha != script.sha:  # pragma: no cover - a server that hashes differently
            raise RedisUnavailableError(f"server computed SHA {sha} for a script we know as {script.sha}")
        self._count("script_loads")

    def _params(self, cfg: LimiterConfig) -> tuple[str, str]:
        """The kernel constants of ``cfg`` as exact strings, formatted once."""
        last = self._last_params  # one read: another thread may replace it
        if last[0] is cfg:
            return last[1]
        found = self._param_cache.get(cfg)
        if found is None:
            found = self._param_cache[cfg] = _params(cfg)
        self._last_params = (cfg, found)
        return found

    def _policy(self, rule: str) -> OnError:
        return self.rule_on_error.get(rule, self.on_error)

    def _unavailable(
        self,
        cfg: LimiterConfig,
        key: str,
        cost: int,
        now: float | None,
        commit: bool,
        exc: BaseException | None,
        breaker: _Breaker | None = None,
    ) -> KernelVerdict:
        """The store is unreachable (``exc`` failed; None: the breaker did
        not ask): the local store decides under ``"local"`` (in the episode
        of ``breaker``'s server: one per cluster node), else the policy."""
        local = self._local
        if local is None or self._policy(cfg.rule) != "local":
            return self._fallback(cfg, exc)
        self._count("degraded")
        return local.decide(cfg, key, cost, now, commit, breaker or self._breaker)

    def _route(self, rkey: str) -> tuple[_Breaker, Any]:
        """The breaker guarding ``rkey``'s server, and its cluster node
        (None standalone: the storage's one breaker and client)."""
        routes = self._routes
        if routes is None:
            return self._breaker, None
        return routes.route(rkey)

    def _up(self, breaker: _Breaker | None = None) -> None:
        """The server answered: its breaker counts the answer, and once it
        is closed again (the recovery complete) that server's outage ends:
        its local store hands new decisions back to Redis."""
        b = breaker or self._breaker
        if b.success():
            log_recovery(self.address, b)
        local = self._local
        if local is not None and local.active and b.closed:
            local.handover(b.name)

    def _fallback(
        self,
        cfg: LimiterConfig,
        exc: BaseException | None,
        reason: str = REASON_STORE_UNAVAILABLE,
        answers: int = 1,
    ) -> KernelVerdict:
        """The failure policy's verdict (or raise). ``"local"`` reaches here
        only for what the local store does not decide (a key's error reply,
        a compound's erring limit): denied, as ``"deny"``. ``answers``: how
        many requests this one verdict answers (a batch's), each counted in
        ``degraded``."""
        policy = self._policy(cfg.rule)
        if policy == "raise":
            self._raise(exc, "decision")
        self._count("degraded", answers)
        if policy == "allow":
            return (True, 0.0, 0.0, 0.0, 0.0, True, reason, 0.0)
        wait = self.deny_retry_after
        return (False, 0.0, wait, wait, 0.0, True, reason, 0.0)

    @staticmethod
    def _raise(exc: BaseException | None, what: str) -> NoReturn:
        """What ``on_error="raise"`` raises for a failed ``what`` (a
        decision, a refund): ``exc`` itself when it is ours already,
        :class:`CircuitOpenError` when the breaker did not ask (``None``)."""
        if isinstance(exc, RedisUnavailableError):
            raise exc
        if exc is None:
            raise CircuitOpenError("circuit breaker open: Redis is not being asked")
        # redis-py's repr of its errors drops the message: name and text
        raise RedisUnavailableError(f"Redis {what} failed: {type(exc).__name__}: {exc}") from exc

    def _failed(self, exc: BaseException, breaker: _Breaker | None = None) -> None:
        """The server or the connection failed: count it, feed the breaker
        (of that node, on a cluster, whose node map is then refreshed in
        the background)."""
        self._count("errors")
        if isinstance(exc, self._timeout_errors):
            self._count("timeouts")
        b = breaker or self._breaker
        if b.failure():
            log_outage(self.address, b, exc, (self.on_error, *self.rule_on_error.values()))
        if self._routes is not None:
            self._routes.refresh_soon()

    def _key_error(self, exc: BaseException) -> RedisKeyError | None:
        """``exc`` as an error about one call's key, or None when it says the
        server or the connection failed. By the reply's error code (never its
        text): a reply that is not an error reply (a timeout, a reset socket,
        ``LOADING``, which redis-py raises as a connection error) or whose
        code is in :data:`SERVER_ERROR_CODES` is the server's; any other
        error reply (``WRONGTYPE``, ``BADSTATE``, ``OOM``, ``MISCONF``,
        ``NOPERM``, a script's ``ERR``) came from a server able to answer,
        about this call."""
        if isinstance(exc, RedisKeyError):
            return exc
        if not isinstance(exc, self._reply_errors):
            return None
        code = error_code(exc)
        if code in SERVER_ERROR_CODES:
            return None
        key_error = RedisKeyError(f"Redis answered this key with an error: {code}: {exc}", code)
        key_error.__cause__ = exc
        return key_error

    def _key_error_verdict(
        self, cfg: LimiterConfig, error: RedisKeyError, breaker: _Breaker | None = None
    ) -> KernelVerdict:
        """One key's error reply: counted on its own, never the breaker's
        business (the server answered, so it is up: a half-open breaker
        closes), answered by that key's policy, nothing written to it."""
        self._count_key_error(error, breaker)
        self._raise_if_refused(error)
        return self._fallback(cfg, error, REASON_STORE_ERROR)

    @staticmethod
    def _raise_if_refused(error: RedisKeyError) -> None:
        """An ACL refusal (``NOPERM``) raises whatever the policy: under
        ``"allow"`` it would admit every request silently for as long as the
        deployment is wrong. The server refuses before a script runs (it
        checks the command and every key first), so nothing was charged."""
        if error.code in PERMISSION_CODES:
            raise error

    def _count_key_error(self, error: RedisKeyError, breaker: _Breaker | None = None) -> None:
        with self._count_lock:
            counts = self._counts
            counts["errors"] += 1
            counts["key_errors"] += 1
            if error.code in WRITE_REFUSED_CODES:
                counts["write_refused"] += 1
        self._up(breaker)

    def _error_verdict(
        self,
        cfg: LimiterConfig,
        exc: BaseException,
        key: str,
        cost: int,
        now: float | None,
        commit: bool,
        breaker: _Breaker | None = None,
    ) -> KernelVerdict:
        """A decision call failed: a key's error answers that key by its
        policy; a failure of the server or the connection is counted, feeds
        the breaker, and the policy answers (the local store, under ``"local"``)."""
        key_error = self._key_error(exc)
        if key_error is not None:
            return self._key_error_verdict(cfg, key_error, breaker)
        self._failed(exc, breaker)
        return self._unavailable(cfg, key, cost, now, commit, exc, breaker)

    def _part_error(
        self,
        cfg: LimiterConfig,
        part: Any,
        one: tuple[str, int, float | None] | None = None,
        breaker: _Breaker | None = None,
    ) -> tuple[KernelVerdict, bool]:
        """One key's ``"E <error reply>"`` in a multi-key script's reply (the
        script caught that key's error and went on with the others): the
        policy's answer, and whether the error was the server's (a
        ``READONLY`` write on a demoted primary, say: it feeds the breaker).
        ``one`` (a batch's key, cost, ``now``) lets the local store decide
        a server error under ``"local"``; a compound's limit has none (the
        script counted it as denied, so ``"local"`` answers denied)."""
        text = part.decode("utf-8", "replace") if isinstance(part, bytes) else str(part)
        if not text.startswith("E "):
            raise ValueError(f"unexpected script reply {text[:80]!r}")
        text = text[2:]
        code = _code_of_text(text)
        if code in SERVER_ERROR_CODES:
            failure = RedisUnavailableError(f"Redis failed: {text}")
            self._failed(failure, breaker)
            if one is not None:
                return self._unavailable(cfg, *one, True, failure, breaker), True
            return self._fallback(cfg, failure), True
        error = RedisKeyError(f"Redis answered this key with an error: {text}", code)
        return self._key_error_verdict(cfg, error, breaker), False

    def _now_arg(self, now: float | None) -> str:
        if now is None:
            return repr(time.time()) if self.clock == "client" else ""
        return repr(now)

    def _floor_ms(self, now: float | None) -> str:
        return "0" if now is None else str(INJECTED_EXPIRY_FLOOR_MS)

    def _early(
        self,
        config: LimiterConfig,
        key: str,
        cost: int,
        now: float | None,
        commit: bool,
        breaker: _Breaker | None = None,
    ) -> KernelVerdict | None:
        """The answer that needs no round trip, if any: a near-cache denial,
        or the policy's while the breaker (of the key's node) is open."""
        near = self._near
        if near is not None:
            t = time.monotonic() if now is None else now
            hit = near.lookup((config.algorithm, config.rule, key, now is None), cost, t)
            if hit is not None:
                self._near_hits.add()
                return (False, 0.0, hit[0], hit[1], 0.0, False, "", 0.0)  # the store made no decision
        b = breaker or self._breaker
        if not b.allow_call():
            self._count("breaker_open_skips")
            return self._unavailable(config, key, cost, now, commit, None, b)
        return None

    def _single_args(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool, rkey: str = ""
    ) -> tuple[tuple[str], tuple[str, ...]]:
        """``KEYS`` and ``ARGV`` of one decision's ``EVALSHA``."""
        p1, p2 = self._params(config)
        return (rkey or self.redis_key(config, key),), (
            self._now_arg(now),
            str(cost),
            "1" if commit else "0",
            self._floor_ms(now),
            p1,
            p2,
        )

    def _answered(
        self,
        config: LimiterConfig,
        key: str,
        cost: int,
        now: float | None,
        reply: Any,
        breaker: _Breaker | None = None,
    ) -> KernelVerdict:
        """The store answered: a verdict, remembered by the near-cache if a denial."""
        b = breaker or self._breaker
        if b.success():
            log_recovery(self.address, b)
        local = self._local
        if local is not None and local.active and b.closed:
            local.handover(b.name)
        self._decisions.add()
        verdict = _parse_verdict(reply)
        near = self._near
        if near is not None and not verdict[0]:
            t = time.monotonic() if now is None else now
            near.remember((config.algorithm, config.rule, key, now is None), cost, t, verdict[2], verdict[3])
        return verdict

    def _batch_start(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> _BatchRun | list[KernelVerdict]:
        """The script calls of a batch (see ``RedisStorage.run_kernel_many``),
        or the whole answer when nothing is to be sent."""
        n = len(keys)
        if n == 0:
            return []
        if self._routes is None and not self._breaker.allow_call():
            self._count("breaker_open_skips")
            if self._local is not None and self._policy(config.rule) == "local":
                return [self._unavailable(config, k, c, now, True, None) for k, c in zip(keys, costs)]
            return [self._fallback(config, None, answers=n)] * n
        p1, p2 = self._params(config)
        now_arg = self._now_arg(now)
        floor_ms = self._floor_ms(now)
        rkeys = [self.redis_key(config, key) for key in keys]
        calls: list[_Call] = []
        if self.batch == "script":
            script = BATCH_SCRIPTS[config.algorithm]
            groups: dict[int, list[int]] = {}
            if self.cluster:
                slot_of = client_package(self.user_client).crc.key_slot
                for i, rkey in enumerate(rkeys):
                    groups.setdefault(slot_of(rkey.encode("utf-8")), []).append(i)
            else:
                groups[0] = list(range(n))
            for members in groups.values():
                for c in range(0, len(members), BATCH_CHUNK):
                    part = members[c : c + BATCH_CHUNK]
                    args = [now_arg, floor_ms, p1, p2, *[str(costs[i]) for i in part]]
                    calls.append((script, [rkeys[i] for i in part], args, part))
        else:
            script = SCRIPTS[config.algorithm]
            for i, (rkey, cost) in enumerate(zip(rkeys, costs)):
                calls.append((script, [rkey], [now_arg, str(cost), "1", floor_ms, p1, p2], [i]))
        run = _BatchRun(self, config, calls, keys, costs, now)
        if self._routes is not None:
            run.route(self._routes)
        return run

    def _forget_local(self, config: LimiterConfig, key: str) -> str:
        """Drop ``key``'s near-cache entries; the Redis key to ``DEL``."""
        if self._near is not None:
            for server_time in (True, False):  # entries are per time base (monotonic or injected)
                self._near.forget((config.algorithm, config.rule, key, server_time))
        return self.redis_key(config, key)

    # -- refunds ------------------------------------------------------------------
    def _refund_start(
        self, config: LimiterConfig, key: str, units: int, at: float | None, now: float | None
    ) -> tuple[LuaScript, tuple[str], tuple[str, ...], _Breaker, Any] | None:
        """A refund's script, ``KEYS``, ``ARGV``, breaker and cluster node
        (see ``_route``), or None when the open
        breaker answers it (under ``"raise"`` it raises
        :class:`CircuitOpenError`, as a decision would). Like ``run_kernel``
        it takes what the limiter has checked. The key's near-cache denials
        are dropped first: the units given back may let it pass sooner."""
        near = self._near
        if near is not None:
            near.forget((config.algorithm, config.rule, key, now is None))
        rkey = self.redis_key(config, key)
        breaker, node = self._route(rkey)
        local = self._local
        if local is not None and local.refund(config, key, units, at, now, breaker.name):
            return None  # charged in the local store: refunded there, never in Redis
        if not breaker.allow_call():
            self._count("breaker_open_skips")
            self._refund_dropped(config, None)
            return None
        p1, p2 = self._params(config)
        args = (
            self._now_arg(now),
            "" if at is None else repr(at),
            str(units),
            self._floor_ms(now),
            p1,
            p2,
        )
        return REFUND_SCRIPTS[config.algorithm], (rkey,), args, breaker, node

    def _refund_failed(
        self, config: LimiterConfig, exc: BaseException, breaker: _Breaker | None = None
    ) -> None:
        """A refund's call failed: counted and classified as a decision's
        failure is (a key's error reply never feeds the breaker), then the
        policy: ``"raise"`` raises, any other drops the refund."""
        key_error = self._key_error(exc)
        if key_error is not None:
            self._count_key_error(key_error, breaker)
            self._raise_if_refused(key_error)
            exc = key_error
        else:
            self._failed(exc, breaker)
        self._refund_dropped(config, exc)

    def _refund_dropped(self, config: LimiterConfig, exc: BaseException | None) -> None:
        """Why a refund that the store did not make never raises into a
        request under ``"allow"``/``"deny"``: the request was answered
        already, and a refund is a correction the next decision does not
        need; it is counted (``refunds_dropped``) instead."""
        if self._policy(config.rule) == "raise":
            self._raise(exc, "refund")
        self._count("refunds_dropped")

    def _refunded(self, breaker: _Breaker | None = None) -> None:
        self._up(breaker)
        self._count("refunds")

    def _snapshot_command(self, config: LimiterConfig, key: str) -> tuple[str, ...]:
        """The one read command that fetches ``key``'s raw state (a hash's
        every field: a hash without the limiter's is told from no key)."""
        rkey = self.redis_key(config, key)
        algo = config.algorithm
        if algo is Algorithm.GCRA:
            return ("GET", rkey)
        if algo is Algorithm.SLIDING_LOG:
            return ("LRANGE", rkey, "0", "-1")
        return ("HGETALL", rkey)

    @staticmethod
    def _parse_snapshot(algo: Algorithm, raw: Any) -> LimiterState | None:
        """The state read by :meth:`_snapshot_command` (not brought up to
        now), or ``None``. Checked as the scripts check it (``lua/*_state.lua``,
        docs/redis.md, "Foreign values"): a value the decisions refuse with
        ``BADSTATE`` raises :class:`RedisKeyError` here too, rather than be
        shown as a state (a count of -4, a level of NaN, a window index of
        1.5 shown as 1) or fail with a bare ``TypeError``."""
        if algo is Algorithm.GCRA:
            if raw is None:
                return None
            parts = _text(raw).split(" ", 1)  # as the script: the first space splits
            if len(parts) != 2:
                raise _bad_state(algo)
            tat, updated = _number(algo, parts[0]), _number(algo, parts[1])
            if not _whole(tat, _MAX_EXACT) or not _stamp(updated):
                raise _bad_state(algo)
            return LimiterState(algo, updated, tat=int(tat))
        if algo is Algorithm.SLIDING_LOG:
            if not raw:
                return None
            stamps = [_number(algo, x) for x in raw]
            updated = stamps[0]
            if not _stamp(updated) or not all(-MAX_TIME < s <= updated + MAX_CLOCK_LEAD for s in stamps[1:]):
                raise _bad_state(algo)
            return LimiterState(algo, updated, log=tuple(stamps[1:]))
        if not raw:
            return None
        fields = {_text(name): value for name, value in raw.items()}

        def need(name: str) -> float:
            """A field every state of ``algo`` has, as a number (other
            fields, which the scripts never read, are not looked at)."""
            if name not in fields:
                raise _bad_state(algo)
            return _number(algo, fields[name])

        if algo in (Algorithm.TOKEN_BUCKET, Algorithm.LEAKY_BUCKET):
            level, updated = need("l"), need("u")
            if not 0.0 <= level <= MAX_LIMIT or not _stamp(updated):
                raise _bad_state(algo)
            return LimiterState(algo, updated, level=level)
        k, count, updated = need("k"), need("n"), need("u")
        previous = need("p") if algo is Algorithm.SLIDING_COUNTER else 0.0
        if not (_whole(k, _MAX_EXACT) and _count(count) and _count(previous) and _stamp(updated)):
            raise _bad_state(algo)
        if algo is Algorithm.FIXED_WINDOW:
            return LimiterState(algo, updated, window_index=int(k), count=int(count))
        return LimiterState(algo, updated, window_index=int(k), count=int(count), previous=int(previous))

    # -- Storage protocol ---------------------------------------------------------
    def apply(self, key: str, now: float, mutate: Callable[[Any], tuple[Any, Any]]) -> Any:
        """Not supported: a Python closure cannot run atomically inside Redis
        (a WATCH/MULTI loop would retry under contention and could not keep
        docs/spec.md §5's one-step contract cheaply). Built-in algorithms never call it."""
        raise NotImplementedError(
            f"{type(self).__name__} runs the built-in algorithms only; "
            "a custom algorithm needs its own Lua script"
        )

    def evict_idle(self, cutoff: float) -> int:
        """A no-op that returns 0: every key carries an expiry equal to the time
        until its state is back to "never seen", so Redis evicts idle keys
        itself, on every node, without a scan."""
        check_cutoff(cutoff)
        return 0

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"<{name} prefix={self.prefix!r} cluster={self.cluster} on_error={self.on_error!r}>"


class _BatchRun:
    """One batch in flight, for either storage: the script calls still to
    send and the verdicts so far. ``absorb`` takes a pipeline's replies and
    answers the script to load when some calls hit ``NOSCRIPT`` (those did not
    run, and are sent once more); nothing else is ever retried."""

    __slots__ = (
        "bad",
        "config",
        "costs",
        "down",
        "failed",
        "keys",
        "now",
        "out",
        "redirects",
        "route_of",
        "storage",
        "todo",
    )

    def __init__(
        self,
        storage: _RedisBase,
        config: LimiterConfig,
        calls: list[_Call],
        keys: Sequence[str],
        costs: Sequence[int],
        now: float | None,
    ) -> None:
        self.storage = storage
        self.config = config
        self.todo = calls
        self.keys = keys
        self.costs = costs
        self.now = now
        self.out: list[KernelVerdict | None] = [None] * len(keys)
        self.failed = 0  # keys the policy answered
        self.down = False  # whether the server (not a key) failed
        # a cluster: each call's breaker and node, by the call's first batch
        # position, and the breakers whose node failed in this batch
        self.route_of: dict[int, tuple[_Breaker, Any]] = {}
        self.bad: set[str] = set()
        # a cluster's calls a node answered MOVED or ASK (the script did not
        # run there): sent once more, to the node the redirect names
        self.redirects: list[tuple[_Call, BaseException]] | None = None

    def route(self, routes: NodeRoutes) -> None:
        """A cluster's batch: each call to its node. A node behind an open
        breaker, or a slot no node owns, is answered by policy now, with no
        round trip (one probe per half-open node goes)."""
        storage = self.storage
        allowed: dict[str, bool] = {}
        todo = []
        for call in self.todo:
            breaker, node = routes.route(call[1][0])
            name = breaker.name
            ok = allowed.get(name)
            if ok is None:
                ok = allowed[name] = breaker.allow_call()
                if ok and node is None:
                    storage._failed(routes.uncovered(), breaker)
                    ok = allowed[name] = False
                elif not ok:
                    storage._count("breaker_open_skips")
            if not ok:
                self._policy(call[3], None, breaker)
                continue
            self.route_of[call[3][0]] = (breaker, node)
            todo.append(call)
        self.todo = todo
        self.redirects = []

    def follow_redirects(self, routes: NodeRoutes) -> list[tuple[_Breaker, Any, bool, list[_Call]]]:
        """The calls a node redirected (``MOVED``, ``ASK``), by the node to
        send them to now: (its breaker, the node, whether ``ASKING``, the
        calls). Once: a call redirected again is its node's failure. A
        target behind an open breaker, or one the client does not know, is
        answered by policy here."""
        redirects = self.redirects or []
        self.redirects = None
        if not redirects:
            return []
        groups, lost = routes.redirect_groups(redirects)
        out = []
        for breaker, node, asking, calls in groups:
            if not breaker.allow_call():
                self.storage._count("breaker_open_skips")
                for call in calls:
                    self._policy(call[3], None, breaker)
                continue
            for call in calls:
                self.route_of[call[3][0]] = (breaker, node)  # its answer feeds this breaker
            out.append((breaker, node, asking, calls))
        for call, exc in lost:
            # in its first node's episode: that node's next answer ends it
            # (None is the standalone scope, which nothing on a cluster ends)
            self._policy(call[3], exc, self.route_of[call[3][0]][0])
        return out

    def by_node(self) -> list[tuple[_Breaker, Any, list[_Call]]]:
        """The calls still to send, grouped by node (a cluster's batch)."""
        groups: dict[str, tuple[_Breaker, Any, list[_Call]]] = {}
        for call in self.todo:
            breaker, node = self.route_of[call[3][0]]
            groups.setdefault(breaker.name, (breaker, node, []))[2].append(call)
        return list(groups.values())

    def _policy(self, members: list[int], exc: BaseException | None, breaker: _Breaker | None) -> None:
        storage = self.storage
        self.failed += len(members)
        for i in members:
            self.out[i] = storage._unavailable(
                self.config, self.keys[i], self.costs[i], self.now, True, exc, breaker
            )

    def node_failed(self, breaker: _Breaker, calls: list[_Call], exc: BaseException) -> None:
        """One node's round trip failed (a cluster's batch): its breaker is
        fed once, its calls are answered by policy, the others go on."""
        self._raise_if_refused(exc, breaker)
        self.storage._failed(exc, breaker)
        self.down = True
        self.bad.add(breaker.name)
        for call in calls:
            self._policy(call[3], exc, breaker)

    def _raise_if_refused(self, exc: BaseException, breaker: _Breaker | None = None) -> None:
        """A round trip that failed on an ACL refusal (the ``SCRIPT LOAD``
        that ``NOSCRIPT`` asked for) raises, as a decision's would."""
        storage = self.storage
        key_error = storage._key_error(exc)
        if key_error is not None and key_error.code in PERMISSION_CODES:
            storage._count_key_error(key_error, breaker)
            storage._raise_if_refused(key_error)

    def queue(self, pipe: Any) -> None:
        for script, call_keys, args, _ in self.todo:
            pipe.execute_command("EVALSHA", script.sha, len(call_keys), *call_keys, *args)

    def absorb(self, replies: Sequence[Any], attempt: int) -> LuaScript | None:
        again = self.absorb_calls(self.todo, replies, attempt, None)
        self.todo = again
        return again[0][0] if again else None

    def absorb_calls(
        self, calls: Sequence[_Call], replies: Sequence[Any], attempt: int, breaker: _Breaker | None
    ) -> list[_Call]:
        """Take the replies of ``calls`` (sent to ``breaker``'s server);
        the calls to send again after a script load (``NOSCRIPT``)."""
        storage, config, out = self.storage, self.config, self.out
        again = []
        for call, reply in zip(calls, replies):
            members = call[3]
            if isinstance(reply, BaseException):
                if attempt == 0 and is_noscript(reply):
                    again.append(call)
                    continue
                if self.redirects is not None and error_code(reply) in _REDIRECT_CODES:
                    self.redirects.append((call, reply))
                    continue
                self.failed += len(members)
                key_error = storage._key_error(reply)
                if key_error is not None and (len(members) == 1 or key_error.code in PERMISSION_CODES):
                    # one EVALSHA: its key's error (an ACL refusal raises here)
                    out[members[0]] = storage._key_error_verdict(config, key_error, breaker)
                    continue
                self.down = True
                if breaker is not None:
                    self.bad.add(breaker.name)
                storage._failed(reply, breaker)
                for i in members:
                    out[i] = storage._unavailable(
                        config, self.keys[i], self.costs[i], self.now, True, reply, breaker
                    )
            elif isinstance(reply, list):
                for i, part in zip(members, reply):
                    try:
                        out[i] = _parse_verdict(part)
                    except ValueError:  # that key's error: the script went on with the others
                        out[i], down = storage._part_error(
                            config, part, (self.keys[i], self.costs[i], self.now), breaker
                        )
                        self.failed += 1
                        if down:
                            self.down = True
                            if breaker is not None:
                                self.bad.add(breaker.name)
            else:
                out[members[0]] = _parse_verdict(reply)
        return again

    def abort(self, exc: BaseException) -> list[KernelVerdict]:
        """The round trip itself failed (each key's error reply comes back
        among the replies instead): a failure of the server or the
        connection; the policy answers what is still open."""
        storage = self.storage
        self._raise_if_refused(exc)
        storage._failed(exc)
        config, keys, costs, now = self.config, self.keys, self.costs, self.now
        if storage._local is None or storage._policy(config.rule) != "local":
            open_ = sum(1 for v in self.out if v is None)
            fallback = storage._fallback(config, exc, answers=open_)
            return [fallback if v is None else v for v in self.out]
        return [
            storage._unavailable(config, keys[i], costs[i], now, True, exc) if v is None else v
            for i, v in enumerate(self.out)
        ]

    def result(self) -> list[KernelVerdict]:
        if self.route_of:
            seen = {b.name: b for b, _ in self.route_of.values()}
            for name, breaker in seen.items():
                if name not in self.bad:
                    self.storage._up(breaker)
        elif self.storage._routes is None and not self.down:
            self.storage._up()
        self.storage._count("decisions", len(self.out) - self.failed)
        return [v for v in self.out if v is not None]


# --------------------------------------------------------------------------
# Limiter glue (either twin)


def limiter_config(limiter: Any) -> LimiterConfig:
    """A limiter's validated configuration, whichever twin built it."""
    cfg = limiter.config
    if not isinstance(cfg, LimiterConfig):
        raise ValidationError(f"{type(limiter).__name__} is not a nanolimit limiter")
    return cfg


def kernel_now(limiter: Any) -> float | None:
    """What the limiter would hand a KernelStorage: None for the default
    SystemClock (use the server's TIME), else its injected clock's reading."""
    clock = limiter.clock
    if type(clock) is SystemClock:
        return None
    return check_now(clock.now())


def decision_maker(limiter: Any, cfg: LimiterConfig) -> Callable[[KernelVerdict], Any]:
    """Build the Decision type of the limiter's own twin from a verdict."""
    return functools.partial(decision_from_verdict, twin_of(limiter).Decision, cfg)
