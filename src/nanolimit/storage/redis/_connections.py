"""Connections: the derived client, the connections a storage keeps between
calls, and hiredis packing.

Why a private module: this is where the storage meets the client library's
internals for speed (docs/redis.md, "Connections"); keeping them in one place
keeps what depends on redis-py's private surface small and visible.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
import os
import select
import sys
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, ClassVar, Final

from ...errors import ValidationError

log = logging.getLogger("nanolimit.storage.redis")

# --------------------------------------------------------------------------
# Client plumbing
#
# Which client types are known decides which path a decision takes
# (docs/redis.md, "Clients"). The client library's own classes — the
# standalone client, its ConnectionPool/BlockingConnectionPool and its plain,
# TLS and Unix-socket connections — are known, and only they get the fast
# paths that lean on redis-py internals: a pooled connection used directly,
# connections kept between calls (their ``_sock``/``_writer``). Anything else
# — a subclass of the client or of a pool, a custom connection class — goes
# through the public API (``execute_command``), so what the subclass changes
# is honoured. A Sentinel-managed pool is known for deriving (through its
# Sentinel's public ``master_for``/``slave_for``) and for the direct pool path,
# never for kept connections (its connections follow a failover on connect).

# Reached as attributes of the client's top package (``redis``, ``valkey``);
# valkey-py renamed its client and cluster classes, so each has both names.
_CLIENTS: Final = ("Redis", "Valkey")
_CLUSTERS: Final = ("RedisCluster", "ValkeyCluster")
_STANDALONE_POOLS: Final = ("ConnectionPool", "BlockingConnectionPool")
_PLAIN_CONNECTIONS: Final = ("Connection", "SSLConnection", "UnixDomainSocketConnection")
_ACCEPTED: Final = (
    "a redis-py or valkey-py client object: redis.Redis, redis.RedisCluster, "
    "redis.sentinel.Sentinel(...).master_for(name), their redis.asyncio twins, or the valkey ones"
)


def connection_args(pool: Any) -> tuple[str, ...] | None:
    """What ``pool.get_connection`` takes: older redis-py and valkey-py pools
    want a command name; None when its signature cannot be read."""
    try:
        params = list(inspect.signature(pool.get_connection).parameters.values())
    except (TypeError, ValueError):
        return None
    if (
        params
        and params[0].default is inspect.Parameter.empty
        and params[0].kind
        in (
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
        )
    ):
        return ("EVALSHA",)
    return ()


def client_package(client: Any) -> Any:
    """``redis`` or ``valkey`` (or any redis-py fork): the top package of the
    library the client's class comes from, found along its MRO so a subclass
    defined elsewhere still names its library."""
    for cls in type(client).__mro__:
        top = cls.__module__.split(".")[0]
        if top == "builtins":
            continue
        module = sys.modules.get(top) or importlib.import_module(top)
        if all(hasattr(module, name) for name in ("exceptions", "retry", "backoff")):
            return module
    raise ValidationError(f"client must be {_ACCEPTED}; got {type(client).__name__} {_shown(client)}")


def _shown(value: Any) -> str:
    if isinstance(value, str):  # a URL given where a client belongs: never shown, it may hold a password
        return "(not shown)"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_client(client: Any) -> None:
    """Refuse, with a message naming what is accepted, anything that is not a
    client object: a URL string (``RedisStorage("redis://...")``) used to
    fail deep inside with ``ModuleNotFoundError: builtins.retry``. A URL is
    not accepted here on purpose: how a storage is named by a URI (TLS,
    cluster, Sentinel schemes) is decided in one place,
    ``nanolimit.storage_from_uri`` (``storage/uri.py``), not guessed by each
    storage. The message never shows the URL: it may carry a password."""
    if isinstance(client, (str, bytes)):
        # never the URL itself: it may carry a password
        raise ValidationError(
            f"client must be {_ACCEPTED}; got a URL ({type(client).__name__}): for a storage named by "
            "a URI use nanolimit.storage_from_uri(uri), or pass a client made by redis.Redis.from_url(url)"
        )
    if not callable(getattr(client, "execute_command", None)):
        raise ValidationError(f"client must be {_ACCEPTED}; got {type(client).__name__} {_shown(client)}")
    client_package(client)


def _library_class(pkg: Any, asyncio_client: bool, module: str, name: str) -> Any:
    """``pkg[.asyncio].<module>.<name>``, or None where this library has none."""
    path = f"{pkg.__name__}{'.asyncio' if asyncio_client else ''}.{module}"
    try:
        found = getattr(importlib.import_module(path), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) else None


def _is_a(value: Any, pkg: Any, asyncio_client: bool, module: str, names: tuple[str, ...]) -> bool:
    for name in names:
        cls = _library_class(pkg, asyncio_client, module, name)
        if cls is not None and isinstance(value, cls):
            return True
    return False


def _exactly(value: Any, pkg: Any, asyncio_client: bool, module: str, names: tuple[str, ...]) -> bool:
    return any(type(value) is _library_class(pkg, asyncio_client, module, name) for name in names)


def is_cluster_client(client: Any) -> bool:
    """A RedisCluster (or a subclass), of either flavour: routed by slot."""
    try:
        pkg = client_package(client)
    except ValidationError:
        return False
    return _is_a(client, pkg, is_asyncio_client(client), "cluster", _CLUSTERS)


def address_of(client: Any) -> str:
    """Where ``client`` sends its commands, for a log line: scheme, hosts
    and database, never a credential (none is read)."""
    try:
        if is_cluster_client(client):
            nodes = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
            shown = ",".join(f"{n.host}:{n.port}" for n in nodes[:4])
            return f"redis+cluster://{shown}{',...' if len(nodes) > 4 else ''}"
        pool = client.connection_pool
        service = getattr(pool, "service_name", None)
        kwargs = pool.connection_kwargs
        db = kwargs.get("db", 0)
        if isinstance(service, str):
            return f"redis+sentinel://{service}/{db}"
        if kwargs.get("path"):
            return f"redis+unix://{kwargs['path']}?db={db}"
        return f"redis://{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}/{db}"
    except Exception:  # noqa: BLE001 - a client we cannot read is named by its type
        return f"<{type(client).__name__}>"


def is_asyncio_client(client: Any) -> bool:
    """A ``redis.asyncio`` (or ``valkey.asyncio``) client: its commands are coroutines."""
    return inspect.iscoroutinefunction(getattr(client, "execute_command", None))


def _is_sentinel_pool(pool: Any, pkg: Any, asyncio_client: bool) -> bool:
    return _is_a(pool, pkg, asyncio_client, "sentinel", ("SentinelConnectionPool",))


def direct_path(client: Any) -> str:
    """How decisions on ``client`` (a derived one) reach the server:
    ``"kept"`` — a known client on a known standalone pool of plain
    connections: a pooled connection used directly, and connections kept
    between calls; ``"pool"`` — a known client on a Sentinel-managed pool: a
    pooled connection used directly (``get_connection``/``send_command``/
    ``read_response``/``release``, the pool's and the connection's public
    methods), none kept (so too an asyncio connection without the
    ``can_read`` check a kept one needs); ``"public"`` — anything else: ``execute_command``."""
    pkg = client_package(client)
    aio = is_asyncio_client(client)
    if not _exactly(client, pkg, aio, "client", _CLIENTS):
        return "public"  # a cluster (routing), or a subclass that may change execute_command
    if getattr(client, "connection", None) is not None:
        return "public"  # single_connection_client=True: one connection and its own lock
    pool = getattr(client, "connection_pool", None)
    if pool is None:
        return "public"
    if type(pool) is _library_class(pkg, aio, "sentinel", "SentinelConnectionPool"):
        return "pool"
    if not _exactly(pool, pkg, aio, "connection", _STANDALONE_POOLS):
        return "public"
    connection_class = getattr(pool, "connection_class", None)
    if not any(connection_class is _library_class(pkg, aio, "connection", n) for n in _PLAIN_CONNECTIONS):
        return "public"
    if aio and not callable(getattr(connection_class, "can_read", None)):
        return "pool"  # valkey-py's asyncio connection: no check that a kept one is still open
    return "kept"


# The connect timeout of the clients derived while it is set (None: the
# decision ``timeout``). ``storage_from_uri``'s ``connect_timeout`` comes in
# here, since the storages' constructors take one ``timeout`` for both.
_CONNECT_TIMEOUT: ContextVar[float | None] = ContextVar("nanolimit_connect_timeout", default=None)


@contextmanager
def connect_timeout(seconds: float | None) -> Iterator[None]:
    """Derive clients with ``seconds`` of connect timeout inside the block."""
    token = _CONNECT_TIMEOUT.set(seconds)
    try:
        yield
    finally:
        _CONNECT_TIMEOUT.reset(token)


class _CannotDerive(Exception):
    """Why a client's settings cannot be rebuilt through public API."""


def derive_client(client: Any, timeout: float) -> Any:
    """A client with the caller's connection settings but a short socket
    timeout and **no retries**: a retried script can charge twice, and
    redis-py's defaults (seconds of timeout, several retries) blocked a caller
    for over 25 s on a frozen server. The caller's own client is left as it is.
    Works for the synchronous and the ``asyncio`` clients alike (each has its
    own ``Retry`` class, next to its client module).

    A cluster is rebuilt from its nodes and its nodes manager's settings
    (redis-py has no public accessor for them); a Sentinel-managed client
    through its Sentinel's ``master_for``/``slave_for``; any other from its
    pool's public ``connection_kwargs``, ``connection_class`` and
    ``max_connections``, with the same client and pool classes. A client
    whose classes cannot be rebuilt that way (a pool subclass whose
    constructor wants arguments of its own, a pool without
    ``connection_kwargs``) is used as it is, as with ``derive=False``: its
    timeouts and retries are the caller's, and a warning on the
    ``nanolimit.storage.redis`` logger says why — refusing it would refuse a
    client that works, and guessing its constructor could drop what it adds.
    """
    check_client(client)
    try:
        return _derive(client, timeout)
    except _CannotDerive as exc:
        log.warning(
            "nanolimit: RedisStorage uses %s as it is (derive=False): %s; its timeouts and retries "
            "are yours (a retried decision can be charged twice): give it no retries and a short "
            "socket_timeout, or pass derive=False to say so",
            type(client).__name__,
            exc,
        )
        return client


def _derive(client: Any, timeout: float) -> Any:
    pkg = client_package(client)
    aio = is_asyncio_client(client)
    home = pkg.__name__ + (".asyncio" if aio else "")  # where the client's own Retry lives
    retry_mod = importlib.import_module(home + ".retry")
    backoff_mod = importlib.import_module(pkg.__name__ + ".backoff")

    def no_retry() -> Any:
        return retry_mod.Retry(backoff_mod.NoBackoff(), 0)

    connect = _CONNECT_TIMEOUT.get()
    overrides = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout if connect is None else connect,
        "retry_on_timeout": False,
        "retry_on_error": [],
    }
    if is_cluster_client(client):
        kwargs = dict(client.nodes_manager.connection_kwargs)
        for name in ("host", "port", "retry", "connection_pool", "connection_class"):
            kwargs.pop(name, None)
        kwargs.update(overrides)
        kwargs.pop("retry_on_timeout", None)
        kwargs.pop("retry_on_error", None)
        params = inspect.signature(type(client).__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            # the asyncio cluster keeps internal settings there that its constructor refuses
            kwargs = {name: value for name, value in kwargs.items() if name in params}
        node_type = importlib.import_module(home + ".cluster").ClusterNode
        # an asyncio cluster not used yet knows only its startup nodes
        known = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
        nodes = [node_type(n.host, n.port) for n in known]
        return type(client)(startup_nodes=nodes, retry=no_retry(), **kwargs)
    pool = getattr(client, "connection_pool", None)
    if pool is None or not isinstance(getattr(pool, "connection_kwargs", None), dict):
        raise _CannotDerive(f"its pool ({type(pool).__name__}) has no connection_kwargs to rebuild it from")
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(overrides)
    kwargs["retry"] = no_retry()
    if _is_sentinel_pool(pool, pkg, aio):
        # the pool's own back reference (a proxy) is rebuilt by the new pool
        kwargs.pop("connection_pool", None)
        manager = _bounded_sentinel(pool.sentinel_manager, overrides, no_retry)
        make = manager.master_for if pool.is_master else manager.slave_for
        # redis-py names the client class ``redis_class``, valkey-py ``valkey_class``
        names = inspect.signature(make).parameters
        class_arg = next((n for n in ("redis_class", "valkey_class") if n in names), None)
        if class_arg is None:
            raise _CannotDerive(f"{type(manager).__name__}.master_for takes no client class")
        classes = {class_arg: type(client), "connection_pool_class": type(pool)}
        try:
            derived = make(pool.service_name, max_connections=pool.max_connections, **classes, **kwargs)
        except TypeError as exc:  # a Sentinel or pool subclass with other arguments
            raise _CannotDerive(f"its Sentinel cannot make another ({exc})") from exc
        derived.auto_close_connection_pool = True
        return derived
    extra: dict[str, Any] = {}
    if hasattr(pool, "timeout"):
        # a BlockingConnectionPool: waiting for a free connection is bounded
        # too. Its ``timeout=None`` (wait for ever) must not become the
        # constructor's default of 20 s: 20 threads on one connection of a
        # frozen server waited 1 s for a 50 ms decision.
        wait = pool.timeout
        extra["timeout"] = timeout if not isinstance(wait, (int, float)) else min(wait, timeout)
    try:
        new_pool = type(pool)(
            connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs, **extra
        )
    except TypeError as exc:  # a subclass whose constructor takes other arguments
        raise _CannotDerive(f"{type(pool).__name__} cannot be rebuilt from its settings ({exc})") from exc
    try:
        derived = type(client)(connection_pool=new_pool)
    except TypeError as exc:
        _drop(new_pool)
        raise _CannotDerive(f"{type(client).__name__} cannot be made on a pool ({exc})") from exc
    derived.auto_close_connection_pool = True  # our pool: ``close()``/``aclose()`` disconnects it
    return derived


def _bounded_sentinel(manager: Any, overrides: dict[str, Any], no_retry: Callable[[], Any]) -> Any:
    """The caller's Sentinel again, its watchers asked with our timeout and no
    retries: finding the master is on the decision path, and redis-py's
    default retries with backoff made one decision against unreachable
    Sentinels take 8 s at a 50 ms timeout."""
    try:
        places = [watcher.connection_pool.connection_kwargs for watcher in manager.sentinels]
        hosts = [(place["host"], place["port"]) for place in places]
        watchers = dict(manager.sentinel_kwargs)
        settings = dict(manager.connection_kwargs)
    except (AttributeError, KeyError, TypeError) as exc:
        shown = type(manager).__name__
        raise _CannotDerive(f"its Sentinel ({shown}) does not show its watchers ({exc})") from exc
    watchers.update(overrides, retry=no_retry())
    for name in ("retry_on_timeout", "retry_on_error"):  # the Retry says it (redis-py 6 warns of these)
        watchers.pop(name, None)
    if getattr(manager, "_force_master_ip", None) is not None:  # redis-py only
        settings["force_master_ip"] = manager._force_master_ip
    try:
        return type(manager)(
            hosts,
            min_other_sentinels=getattr(manager, "min_other_sentinels", 0),
            sentinel_kwargs=watchers,
            **settings,
        )
    except TypeError as exc:  # a Sentinel subclass with other arguments
        raise _CannotDerive(f"its Sentinel cannot make another ({exc})") from exc


def _drop(pool: Any) -> None:
    """Disconnect a synchronous pool nobody will use (it has no connections
    yet; an asyncio one has nothing to close before its first use)."""
    disconnect = getattr(pool, "disconnect", None)
    if callable(disconnect) and not inspect.iscoroutinefunction(disconnect):
        disconnect()


_UNPROBED: Final = object()
_hiredis_pack: Any
try:
    from hiredis import pack_command as _hiredis_pack  # the ``redis`` extra installs it
except ImportError:  # pragma: no cover - the connection packs
    _hiredis_pack = None


def _refused_connect(exc: BaseException, connection_error: tuple[type[BaseException], ...]) -> BaseException:
    """The server answered a connect's own commands (``SELECT``, ``AUTH``,
    ``HELLO``, ``CLIENT SETINFO``) with an error reply: the connection
    failed, whatever the reply's code, so it goes on as the client's
    ``ConnectionError`` and is never taken for one key's error."""
    if not connection_error:
        return exc
    failure = connection_error[0](f"the server refused the connection: {type(exc).__name__}: {exc}")
    failure.__cause__ = exc
    return failure


class _SpareConnections:
    """Connections a storage keeps out of its derived client's pool between
    calls.

    Taking a connection from a redis-py pool and giving it back costs more
    than the server spends on a decision (about 15 µs here for the
    synchronous pool: two lock holds, observability hooks, a release event,
    and a ``poll`` through two socket-mode switches; 7 µs for the asyncio
    one). A connection whose reply was read in full has nothing of its own
    waiting, so up to ``keep`` of them wait in a list (``pop`` and
    ``append`` are atomic: any thread takes any of them).

    Before reuse a cheap check shows the server has not closed it (one
    ``poll``, 0.6 µs; the asyncio stream's own state): one that fails it is
    disconnected and goes back through the pool, which connects it again
    (redis-py 8's pools skip their own check when maintenance notifications
    are on). What redis-py does on release (a refreshed credential's
    re-authentication, a reconnect after a maintenance notice) still
    happens: a connection that wants either, that sat idle over
    ``IDLE_CHECK`` seconds, or that has been kept over ``MAX_KEPT`` seconds
    in all goes back through the pool. After an error a connection is
    disconnected and goes back (an error reply from the server leaves it
    intact and kept); a forked child forgets its parent's. Commands are
    packed by hiredis directly where that writes the connection's own bytes
    (redis-py's packing wraps the same call in 2.2 µs of argument handling;
    the asyncio client packs in Python, 6 µs).

    Only the derived client's pool keeps connections: it is the storage's
    own, so nothing else waits for one (``close()`` disconnects it whole).
    """

    IDLE_CHECK: ClassVar[float] = 0.5
    MAX_KEPT: ClassVar[float] = 1.0
    _live: ClassVar[weakref.WeakSet[_SpareConnections]] = weakref.WeakSet()

    __slots__ = (
        "__weakref__",
        "_broken",
        "_conn_args",
        "_connect_error",
        "_idle",
        "_keep",
        "_pack",
        "_pid",
        "_pool",
        "_reply_error",
    )

    def __init__(self, pool: Any, conn_args: tuple[str, ...], keep: int, exceptions: Any) -> None:
        self._pool = pool
        self._conn_args = conn_args
        self._keep = keep
        self._pid = os.getpid()

        def error_class(*names: str) -> tuple[type[BaseException], ...]:
            for name in names:
                found = getattr(exceptions, name, None)
                if isinstance(found, type) and issubclass(found, Exception):
                    return (found,)
            return ()

        # the server's error reply (the connection is intact), and what a broken one raises
        self._reply_error = error_class("ResponseError")
        self._connect_error = error_class("ConnectionError")
        self._broken: tuple[type[BaseException], ...] = (OSError, *error_class("RedisError", "ValkeyError"))
        # (connection, what its check needs, when it was put back, when it was first kept)
        self._idle: list[tuple[Any, Any, float, float]] = []
        self._pack: Any = _UNPROBED
        _SpareConnections._live.add(self)

    def _packer(self, conn: Any) -> Any:
        """hiredis's ``pack_command`` where it writes exactly the bytes the
        connection would; else None: the connection packs."""
        pack = _hiredis_pack
        if pack is None:
            return None
        sample: Any = ("EVALSHA", "0" * 40, 1, "ns:{cl\u00e9}", "", "1.5", "16777216.0")
        try:
            if b"".join(conn.pack_command(*sample)) != pack(sample):
                return None
        except (AttributeError, TypeError, ValueError):  # a client that packs its own way
            return None
        return pack

    def _packed(self, conn: Any) -> Any:
        pack = self._pack
        if pack is _UNPROBED:
            pack = self._pack = self._packer(conn)
        return pack

    def _refused(self, exc: BaseException) -> BaseException:
        return _refused_connect(exc, self._connect_error)

    def _take(self) -> tuple[Any, Any, float, bool] | None:
        """A kept connection, its check state, when it was first kept, and
        whether it is due back through the pool whatever its check says."""
        if self._pid != os.getpid():  # a fork that skipped the at-fork hook
            self._idle.clear()
            self._pid = os.getpid()
        try:
            conn, check, since, first = self._idle.pop()
        except IndexError:
            return None
        now = time.monotonic()
        due = (
            now - since > self.IDLE_CHECK
            or now - first > self.MAX_KEPT
            or getattr(conn, "_re_auth_token", None) is not None
            or bool(getattr(conn, "should_reconnect", bool)())
        )
        return conn, check, first, due

    def _keep_or_release(self, conn: Any, check: Any, first: float) -> bool:
        """Keep ``conn`` if there is room; False means the caller gives it back."""
        if len(self._idle) >= self._keep:
            return False
        now = time.monotonic()
        self._idle.append((conn, check, now, first if first else now))
        return True

    @classmethod
    def forget_after_fork(cls) -> None:
        """In a forked child: the kept sockets are the parent's. The pool
        resets itself in the child; nothing here may touch them."""
        for spares in list(cls._live):
            spares._idle.clear()
            spares._pid = os.getpid()


class _SyncSpareConnections(_SpareConnections):
    """:class:`_SpareConnections` of a synchronous pool."""

    __slots__ = ()

    def call(self, args: tuple[Any, ...]) -> Any:
        """One command, one attempt, on a kept connection if one is idle."""
        pool = self._pool
        conn: Any = None
        try:
            kept = self._take()
            if kept is None:
                sock = poller = None
                first = 0.0
                try:
                    conn = pool.get_connection(*self._conn_args)
                except self._reply_error as exc:
                    raise self._refused(exc) from exc
            else:
                conn, (sock, poller), first, due = kept
                # readable: closed by the server, or data nobody asked for
                broken = getattr(conn, "_sock", None) is not sock or bool(poller.poll(0))
                if broken or due:
                    if broken:
                        conn.disconnect()  # the pool may skip its own check
                    held, conn = conn, None
                    pool.release(held)
                    sock = poller = None
                    first = 0.0
                    try:
                        conn = pool.get_connection(*self._conn_args)
                    except self._reply_error as exc:
                        raise self._refused(exc) from exc
            pack = self._packed(conn)
            if pack is None:
                conn.send_command(*args)
            else:
                conn.send_packed_command((pack(args),))
            reply = conn.read_response()
        except self._reply_error:
            if conn is not None:  # else the pool's own connect failed with it
                self._put_back(conn, sock, poller, first)  # the server's error reply, read in full
            raise
        except BaseException:
            if conn is not None:
                conn.disconnect()  # a reply may be half read: never reuse the socket as is
                pool.release(conn)
            raise
        self._put_back(conn, sock, poller, first)
        return reply

    def _put_back(self, conn: Any, sock: Any, poller: Any, first: float) -> None:
        """Keep a connection whose reply was read in full, or give it back."""
        try:
            current = getattr(conn, "_sock", None)
            if current is not None:
                if current is not sock:
                    first = 0.0  # a new socket: its keeping starts now
                    poller = select.poll()
                    poller.register(current, select.POLLIN)
                if self._keep_or_release(conn, (current, poller), first):
                    return
        except BaseException:
            self._pool.release(conn)
            raise
        self._pool.release(conn)

    def release_all(self) -> None:
        """Every kept connection disconnected and back to the pool."""
        while True:
            try:
                conn = self._idle.pop()[0]
            except IndexError:
                return
            conn.disconnect()
            self._pool.release(conn)


class _AsyncSpareConnections(_SpareConnections):
    """:class:`_SpareConnections` of an asyncio pool (one event loop, as the
    storage itself). Its check is the connection's own ``can_read()``: the
    loop reads the socket all along, so a closed one is already at EOF
    there, with no system call."""

    __slots__ = ()

    async def call(self, args: tuple[Any, ...]) -> Any:
        """One command, one attempt, on a kept connection if one is idle."""
        pool = self._pool
        conn: Any = None
        first = 0.0
        try:
            kept = self._take()
            if kept is None:
                try:
                    conn = await pool.get_connection(*self._conn_args)
                except self._reply_error as exc:
                    raise self._refused(exc) from exc
            else:
                conn, _, first, due = kept
                try:
                    broken = not conn.is_connected or await conn.can_read()
                except self._broken:
                    broken = True
                if broken or due:
                    if broken:
                        await conn.disconnect(nowait=True)  # the pool may skip its own check
                    held, conn = conn, None
                    first = 0.0
                    await pool.release(held)
                    try:
                        conn = await pool.get_connection(*self._conn_args)
                    except self._reply_error as exc:
                        raise self._refused(exc) from exc
            pack = self._packed(conn)
            packed = [pack(args)] if pack is not None else conn.pack_command(*args)
            writer = getattr(conn, "_writer", None)
            if type(writer) is asyncio.StreamWriter and not getattr(conn, "health_check_interval", 1):
                # redis-py bounds a send by wrapping it in ``asyncio.wait_for``,
                # a new Task per call (15 µs here). A command this small is
                # sent at once or buffered; the reply's read timeout bounds
                # the wait either way, and a lost connection shows there.
                writer.writelines(packed)
            else:
                await conn.send_packed_command(packed)
            reply = await conn.read_response()
        except self._reply_error:
            if conn is not None:  # else the pool's own connect failed with it
                await self._put_back(conn, first)  # the server's error reply, read in full
            raise
        except BaseException:
            # a timeout, a socket error or a cancellation: a reply may be half
            # read, so the socket is never reused as is
            if conn is not None:
                await conn.disconnect(nowait=True)
                await pool.release(conn)
            raise
        await self._put_back(conn, first)
        return reply

    async def _put_back(self, conn: Any, first: float) -> None:
        if not (conn.is_connected and self._keep_or_release(conn, None, first)):
            await self._pool.release(conn)

    async def release_all(self) -> None:
        """Every kept connection disconnected and back to the pool."""
        while True:
            try:
                conn = self._idle.pop()[0]
            except IndexError:
                return
            await conn.disconnect(nowait=True)
            await self._pool.release(conn)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SpareConnections.forget_after_fork)
