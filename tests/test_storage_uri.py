"""``storage_from_uri``: every scheme builds the storage it names and that
storage decides (a limit of 3 admits exactly 3) on a real server — standalone,
Unix socket, Sentinel, cluster, Valkey, asyncio — or a real zone; every
option is read back from what was built; every URI that cannot be used is a
ValidationError naming the fault, and no message shows a password."""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis_servers import Server, require_binary

import nanolimit
from nanolimit import LimiterFactory, RateLimitRule, ValidationError, storage_from_uri
from nanolimit._select import native_core
from nanolimit.storage.redis import AsyncRedisStorage, RedisStorage
from nanolimit.storage.redis._connections import direct_path
from nanolimit.storage.redis._resilience import ON_ERROR_POLICIES
from nanolimit.storage.uri import DEFAULT_MEMORY_MAX_KEYS, SCHEMES, redact_uri

pytest_plugins = ["redis_servers"]  # the server fixtures

HOST = "127.0.0.1"
SECRET = "hunter2-Zq"  # a password no message may show


def _rule(name: str = "uri", limit: int = 3) -> RateLimitRule:
    return RateLimitRule(name, "*", "/", "ip", "token_bucket", limit, 60.0)


def _limiter(storage: Any, name: str = "uri", limit: int = 3) -> Any:
    """The limiter the gateway would build for a ``limit``/minute token bucket."""
    return LimiterFactory(storage).for_rule(_rule(name, limit))


def _drain(limiter: Any, key: str, n: int = 4) -> list[bool]:
    return [limiter.allow(key).allowed for _ in range(n)]


def _no_secret(*texts: str) -> None:
    for text in texts:
        assert SECRET not in text


needs_zone = pytest.mark.skipif(
    native_core() is None, reason="the shared-memory zone needs the native extension"
)


# --------------------------------------------------------------------------
# memory://


def test_memory_builds_a_bounded_in_memory_store() -> None:
    storage = storage_from_uri("memory://")
    assert type(storage) is nanolimit.InMemoryStorage
    assert storage.max_keys == DEFAULT_MEMORY_MAX_KEYS
    assert _drain(_limiter(storage), "k") == [True, True, True, False]


def test_memory_options_are_applied_and_a_keyword_wins() -> None:
    storage = storage_from_uri(
        "memory://?max_keys=50&stripes=4&on_full=deny_new&evict_idle_after=30", max_keys=70
    )
    assert storage.max_keys == 70  # the keyword over the query
    assert storage.on_full == "deny_new" and storage.evict_idle_after == 30.0
    assert "stripes=4" in repr(storage)
    assert storage_from_uri("memory://?max_keys=none").max_keys is None


def test_memory_default_bound_is_the_factorys() -> None:
    from nanolimit.gateway.factory import DEFAULT_MAX_KEYS

    assert DEFAULT_MEMORY_MAX_KEYS == DEFAULT_MAX_KEYS


# --------------------------------------------------------------------------
# redis:// on the shared server (Redis and Valkey)


def test_redis_standalone_decides_and_every_option_is_applied(redis_server: Server) -> None:
    uri = (
        f"redis://{HOST}:{redis_server.port}/3?timeout=0.25&connect_timeout=0.75&on_error=deny"
        "&prefix=cfg:&breaker_threshold=7&breaker_cooldown=2.5&near_cache=yes&keep_connections=3"
        "&batch=pipeline&deny_retry_after=4&clock=client&hash_identities=false"
        "&max_identity_bytes=32&client_name=urier&health_check_interval=0&socket_keepalive=1"
        "&near_cache_size=99&near_cache_ttl=0.5&max_key_bytes=512&max_connections=20"
    )
    storage = storage_from_uri(uri)
    direct = redis_server.client(db=3)
    try:
        assert type(storage) is RedisStorage
        kwargs = storage.client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 0.25 and kwargs["socket_connect_timeout"] == 0.75
        assert kwargs["db"] == 3 and kwargs["client_name"] == "urier" and kwargs["socket_keepalive"] is True
        assert storage.timeout == 0.25 and storage.on_error == "deny" and storage.prefix == "cfg:"
        assert storage._breaker.threshold == 7 and storage._breaker.cooldown == 2.5
        assert storage._near is not None and storage.batch == "pipeline"
        assert storage._near.max_entries == 99 and storage._near.max_ttl == 0.5
        assert storage.max_key_bytes == 512 and storage.client.connection_pool.max_connections == 20
        assert storage.deny_retry_after == 4.0 and storage.clock == "client"
        assert storage.max_identity_bytes == 32 and storage.hash_identities is False
        assert direct_path(storage.client) == "kept" and storage._spares._keep == 3
        limiter = _limiter(storage)
        assert _drain(limiter, "ip:10.0.0.1") == [True, True, True, False]
        # the prefix is in the Redis key, in database 3
        assert direct.keys("cfg:*") == [storage.redis_key(limiter.config, "ip:10.0.0.1").encode()]
        storage.close()
    finally:
        direct.close()


def test_a_keyword_wins_over_the_query_and_the_userinfo(redis_server: Server) -> None:
    storage = storage_from_uri(
        f"redis://nobody:wrong@{HOST}:{redis_server.port}/0?prefix=q:&timeout=0.1&username=other",
        prefix="kw:",
        timeout=0.3,
        username="default",
        password="",
    )
    kwargs = storage.client.connection_pool.connection_kwargs
    assert storage.prefix == "kw:" and kwargs["socket_timeout"] == 0.3
    assert kwargs["username"] == "default" and kwargs["password"] == ""
    storage.close()


def test_the_factory_takes_a_uri(redis_server: Server) -> None:
    factory = LimiterFactory(f"redis://{HOST}:{redis_server.port}?on_error=raise&prefix=fac:")
    assert isinstance(factory.storage, RedisStorage) and factory.storage.prefix == "fac:"
    rule = RateLimitRule("fac", "*", "/", "ip", "fixed_window", 3, 60.0)
    assert _drain(factory.for_rule(rule), "k") == [True, True, True, False]
    factory.storage.close()  # type: ignore[attr-defined]
    with pytest.raises(ValidationError, match="unknown storage scheme"):
        LimiterFactory("mongodb://x")


def test_a_password_and_a_user_reach_the_server_and_never_a_message(redis_server: Server) -> None:
    admin = redis_server.client()
    admin.execute_command("ACL", "SETUSER", "urier", "on", f">{SECRET}", "~*", "+@all")
    try:
        storage = storage_from_uri(f"redis://urier:{SECRET}@{HOST}:{redis_server.port}?on_error=raise")
        assert _drain(_limiter(storage), "k") == [True, True, True, False]
        _no_secret(repr(storage), repr(storage.client), str(storage.metrics()))
        storage.close()
        # the wrong password: the server refuses it, and the error names no password
        wrong = storage_from_uri(f"redis://urier:{SECRET}x@{HOST}:{redis_server.port}?on_error=raise")
        with pytest.raises(nanolimit.RedisUnavailableError) as err:
            _limiter(wrong).allow("k")
        _no_secret(str(err.value), repr(err.value))
        wrong.close()
        # password in the query, percent-encoded characters in the userinfo
        admin.execute_command("ACL", "SETUSER", "urier", "on", ">p@ss:w/rd", "~*", "+@all")
        for uri in (
            f"redis://urier:p%40ss%3Aw%2Frd@{HOST}:{redis_server.port}?on_error=raise",
            f"redis://{HOST}:{redis_server.port}?username=urier&password=p%40ss%3Aw%2Frd&on_error=raise",
        ):
            encoded = storage_from_uri(uri)
            assert _limiter(encoded, "enc").allow("k").allowed
            encoded.close()
    finally:
        admin.execute_command("ACL", "DELUSER", "urier")
        admin.close()


def test_the_client_made_for_the_uri_is_not_left_open(redis_server: Server) -> None:
    """Decisions go through the derived client; the one made from the URI
    is closed, and ``close()`` closes the derived one's connections."""
    storage = storage_from_uri(f"redis://{HOST}:{redis_server.port}?on_error=raise")
    assert storage.client is not storage.user_client
    _limiter(storage).allow("k")
    pool = storage.client.connection_pool
    assert len(pool._available_connections) + len(pool._in_use_connections) >= 1
    storage.close()
    assert all(c._sock is None for c in pool._available_connections)


# --------------------------------------------------------------------------
# Unix socket


@pytest.fixture
def unix_server(server_kind: str):  # type: ignore[no-untyped-def]
    """A server of its own listening on a Unix socket too (bounded, stopped by PID)."""
    folder = tempfile.mkdtemp(prefix="nl-sock-")
    path = str(Path(folder) / "redis.sock")
    server = Server(
        require_binary(server_kind), server_kind, extra=("--unixsocket", path, "--unixsocketperm", "700")
    )
    server.start()
    yield server, path
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.parametrize("scheme", ["redis+unix", "unix", "valkey+unix"])
def test_a_unix_socket_decides(unix_server: Any, scheme: str) -> None:
    server, path = unix_server
    storage = storage_from_uri(f"{scheme}://{path}?db=2&on_error=raise&prefix=sock:")
    direct = server.client(db=2)
    try:
        assert storage.client.connection_pool.connection_kwargs["path"] == path
        limiter = _limiter(storage)
        assert _drain(limiter, "k") == [True, True, True, False]
        assert direct.exists(storage.redis_key(limiter.config, "k")) == 1
        storage.close()
    finally:
        direct.close()


# --------------------------------------------------------------------------
# Sentinel, cluster, Valkey, asyncio


def test_a_sentinel_uri_decides_on_the_master(sentinel: Any, redis_server: Server) -> None:
    import redis.sentinel

    uri = f"redis+sentinel://{HOST}:{sentinel.port},{HOST}:{sentinel.port}/{sentinel.name}/4?on_error=raise"
    storage = storage_from_uri(uri, timeout=0.4)
    direct = redis_server.client(db=4)
    try:
        pool = storage.client.connection_pool
        assert type(pool) is redis.sentinel.SentinelConnectionPool and pool.service_name == sentinel.name
        assert pool.connection_kwargs["socket_timeout"] == 0.4 and pool.connection_kwargs["db"] == 4
        limiter = _limiter(storage)
        assert _drain(limiter, "user:1") == [True, True, True, False]
        assert direct.exists(storage.redis_key(limiter.config, "user:1")) == 1  # on the master, db 4
        # the Sentinels themselves are asked with the same bound
        watcher = pool.sentinel_manager.sentinels[0]
        assert watcher.connection_pool.connection_kwargs["socket_timeout"] == 0.4
        storage.close()
    finally:
        direct.close()


def test_a_cluster_uri_decides(redis_cluster: Any) -> None:
    from redis.cluster import RedisCluster

    ports = [node.port for node in redis_cluster.nodes]
    storage = storage_from_uri(
        f"redis+cluster://{HOST}:{ports[0]},{HOST}:{ports[1]}?on_error=raise&timeout=0.5&prefix=cl:"
    )
    try:
        assert type(storage.client) is RedisCluster and storage.cluster
        assert storage.client.nodes_manager.connection_kwargs["socket_timeout"] == 0.5
        for n in range(5):  # identities on several slots
            assert _drain(_limiter(storage), f"user:{n}") == [True, True, True, False]
    finally:
        storage.close()


def test_valkey_schemes_make_valkey_py_clients(redis_server: Server, redis_cluster: Any) -> None:
    import valkey
    import valkey.cluster

    storage = storage_from_uri(f"valkey://{HOST}:{redis_server.port}/1?on_error=raise")
    assert type(storage.client) is valkey.Valkey and storage.client is not storage.user_client
    assert direct_path(storage.client) == "kept"
    assert _drain(_limiter(storage), "k") == [True, True, True, False]
    storage.close()
    port = redis_cluster.nodes[0].port
    clustered = storage_from_uri(f"valkey+cluster://{HOST}:{port}?on_error=raise")
    try:
        assert type(clustered.client) is valkey.cluster.ValkeyCluster and clustered.cluster
        assert clustered.client.nodes_manager.connection_kwargs["socket_timeout"] == 0.05
        assert _drain(_limiter(clustered), "user:9") == [True, True, True, False]
    finally:
        clustered.close()


def test_a_valkey_sentinel_uri_decides(sentinel: Any) -> None:
    import valkey.sentinel

    storage = storage_from_uri(f"valkey+sentinel://{HOST}:{sentinel.port}/{sentinel.name}?on_error=raise")
    assert type(storage.client.connection_pool) is valkey.sentinel.SentinelConnectionPool
    assert _drain(_limiter(storage), "k") == [True, True, True, False]
    storage.close()


@pytest.mark.parametrize("scheme", ["async+redis", "async+valkey"])
def test_an_async_uri_decides_under_asyncio(redis_server: Server, scheme: str) -> None:
    async def main() -> list[bool]:
        storage = storage_from_uri(f"{scheme}://{HOST}:{redis_server.port}/0?on_error=raise&timeout=0.5")
        assert type(storage) is AsyncRedisStorage
        assert storage.client.connection_pool.connection_kwargs["socket_timeout"] == 0.5
        limiter = _limiter(storage, "async")
        try:
            return [(await limiter.allow_async("k")).allowed for _ in range(4)]
        finally:
            await storage.close()

    assert asyncio.run(main()) == [True, True, True, False]


def test_an_async_cluster_uri_decides(redis_cluster: Any) -> None:
    port = redis_cluster.nodes[0].port

    async def main() -> list[bool]:
        storage = storage_from_uri(f"async+redis+cluster://{HOST}:{port}?on_error=raise&timeout=0.5")
        assert type(storage) is AsyncRedisStorage and storage.cluster
        limiter = _limiter(storage, "async-cl")
        try:
            return [(await limiter.allow_async("user:3")).allowed for _ in range(4)]
        finally:
            await storage.close()

    assert asyncio.run(main()) == [True, True, True, False]


# --------------------------------------------------------------------------
# shm://


@needs_zone
def test_a_zone_is_created_then_attached_by_name() -> None:
    name = f"nl-uri-{uuid.uuid4().hex[:12]}"
    zone = storage_from_uri(
        f"shm://{name}?max_keys=1000&stripes=4&on_full=deny_new&if_stale=reset&arena_bytes=2097152"
        "&evict_idle_after=60"
    )
    try:
        assert type(zone) is nanolimit.SharedMemoryStorage and zone.name == name
        assert zone.max_keys == 1000 and zone.on_full == "deny_new" and zone.arena_bytes == 2097152
        assert zone.evict_idle_after == 60.0 and "stripes=4" in repr(zone)
        limiter = _limiter(zone)
        assert _drain(limiter, "k") == [True, True, True, False]
        # no max_keys: attach to the zone that exists, with its own parameters
        seen = storage_from_uri(f"shm://{name}")
        assert seen.max_keys == 1000 and _limiter(seen).allow("k").allowed is False
        seen.close()
        factory = LimiterFactory(
            storage=f"shm://{name}?max_keys=1000&stripes=4&on_full=deny_new&arena_bytes=2097152&evict_idle_after=60"
        )
        assert type(factory.storage) is nanolimit.SharedMemoryStorage
        assert factory.for_rule(_rule()).peek("k").allowed is False  # the same zone, the same key
        factory.storage.close()  # type: ignore[attr-defined]
    finally:
        zone.unlink()
        zone.close()
    with pytest.raises(ValidationError, match="no shared-memory zone called"):
        storage_from_uri(f"shm://{name}")


@needs_zone
def test_zone_options_without_max_keys_are_refused() -> None:
    with pytest.raises(ValidationError, match="stripes need max_keys"):
        storage_from_uri(f"shm://nl-uri-{uuid.uuid4().hex[:12]}?stripes=4")


# --------------------------------------------------------------------------
# What cannot be used


@pytest.mark.parametrize(
    ("uri", "options", "named"),
    [
        ("mongodb://h", {}, "unknown storage scheme 'mongodb'"),
        ("redis:/h", {}, "no scheme://"),
        ("127.0.0.1:6379", {}, "no scheme://"),
        ("async+memory://", {}, "unknown storage scheme 'async+memory'"),
        ("rediss+unix:///tmp/s.sock", {}, "unknown storage scheme"),
        (f"redis://:{SECRET}@h?colour=blue", {}, "has no option 'colour'"),
        (f"redis://:{SECRET}@h?socket_timeout=1", {}, "use timeout"),
        ("redis://h", {"colour": "blue"}, "has no option 'colour'"),
        (f"redis://:{SECRET}@h?timeout=soon", {}, "option 'timeout' must be a number"),
        ("redis://h?timeout=0", {}, "option 'timeout' must be a number of seconds > 0"),
        ("redis://h?timeout=nan", {}, "option 'timeout' must be a finite"),
        ("redis://h", {"timeout": 10**400}, "option 'timeout' must be a finite"),  # no OverflowError
        ("redis://h?near_cache=maybe", {}, "option 'near_cache' must be a bool"),
        ("redis://h?breaker_threshold=0", {}, "option 'breaker_threshold' must be an int >= 1"),
        ("redis://h?keep_connections=1.5", {}, "option 'keep_connections' must be an int"),
        ("redis://h?on_error=ignore", {}, "option 'on_error' must be one of allow, deny, raise"),
        ("redis://h?batch=lua", {}, "option 'batch' must be one of script, pipeline"),
        ("redis://h?prefix={x}", {}, "'prefix' must be a str without"),
        ("redis://h", {"near_cache": "sometimes"}, "option 'near_cache' must be a bool"),
        ("redis://h?timeout=1&timeout=2", {}, "given twice"),
        ("redis://h?timeout", {}, "has no '='"),
        ("redis://h?secret_rules=a", {}, "as a keyword only"),
        (f"redis://:{SECRET}@", {}, "redis:// needs a host"),
        ("redis://", {}, "redis:// needs a host"),
        ("redis://h:port", {}, "port of host #1 must be a number"),
        ("redis://h:70000", {}, "port of host #1 must be a number"),
        ("redis://a,b", {}, "takes one host"),
        ("redis://h/zero", {}, "the path is the database number"),
        ("redis://h?ssl_cert_reqs=none", {}, "TLS options need a rediss://"),
        ("rediss://h?ssl_cert_reqs=sometimes", {}, "option 'ssl_cert_reqs' must be one of none, optional"),
        ("redis://h?sentinel_password=x", {}, "for the +sentinel schemes"),
        (f"redis+sentinel://:{SECRET}@h:26379", {}, "needs the service name"),
        ("redis+sentinel://h:26379/", {}, "needs the service name"),
        ("redis+sentinel://h/svc/one", {}, "only a database number"),
        ("redis+sentinel:///svc", {}, "redis+sentinel:// needs a host"),
        ("redis+cluster://h:7000?db=1", {}, "a cluster has database 0 only"),
        ("redis+cluster://h:7000/2", {}, "a cluster has database 0 only"),
        ("redis+cluster://", {}, "redis+cluster:// needs a host"),
        ("redis+unix://h/tmp/s.sock", {}, "takes a socket path, not a host"),
        ("unix://", {}, "needs the socket's path"),
        ("shm://", {}, "shm:// needs the zone's name"),
        ("shm://?max_keys=10", {}, "shm:// needs the zone's name"),
        ("shm://z/extra", {}, "shm:// takes no path"),
        ("shm://z?max_keys=lots", {}, "option 'max_keys' must be an int"),
        ("shm://z?if_stale=maybe", {}, "option 'if_stale' must be one of reuse, reset"),
        ("shm://z?prefix=a", {}, "has no option 'prefix'"),
        ("memory://host", {}, "memory:// names no host"),
        ("memory://?on_full=drop", {}, "option 'on_full' must be one of evict, deny_new"),
        ("memory://?timeout=1", {}, "has no option 'timeout'"),
        ("async+redis+cluster://h:7000?ssl_ca_path=/x", {}, "TLS options need"),
        (
            "async+rediss+cluster://h:7000?ssl_ca_path=/x",
            {},
            "not taken by redis.asyncio.cluster.RedisCluster",
        ),
        ("redis://h", {"password": 5}, "option 'password' must be a string"),
    ],
)
def test_a_uri_that_cannot_be_used_names_the_fault(uri: str, options: dict[str, Any], named: str) -> None:
    with pytest.raises(ValidationError) as err:
        storage_from_uri(uri, **options)
    message = str(err.value)
    assert named in message
    _no_secret(message, repr(err.value))


def test_an_unknown_option_lists_the_accepted_ones() -> None:
    with pytest.raises(ValidationError) as err:
        storage_from_uri("redis://h?colour=blue")
    for name in ("timeout", "connect_timeout", "on_error", "prefix", "keep_connections", "password", "db"):
        assert name in str(err.value)
    with pytest.raises(ValidationError) as err:
        storage_from_uri("mongodb://h")
    for scheme in SCHEMES:
        assert f"{scheme}://" in str(err.value)


def test_on_error_accepts_the_storages_own_policies() -> None:
    """One tuple of policies: what the URI accepts is what the storage does."""
    with pytest.raises(ValidationError) as err:
        storage_from_uri("redis://h?on_error=nope")
    assert ", ".join(ON_ERROR_POLICIES) in str(err.value)
    for policy in ON_ERROR_POLICIES:
        storage = storage_from_uri(f"redis://{HOST}:1?on_error={policy}")
        assert storage.on_error == policy
        storage.close()


@pytest.mark.parametrize(
    ("text", "value"),
    [("true", True), ("YES", True), ("1", True), ("0", False), ("no", False), ("false", False)],
)
def test_bools_are_read_in_every_spelling(text: str, value: bool) -> None:
    storage = storage_from_uri(f"redis://{HOST}:1?near_cache={text}")
    assert (storage._near is not None) is value
    storage.close()


def test_the_password_is_never_in_a_message_a_repr_or_a_redaction() -> None:
    uri = f"redis://user:{SECRET}@{HOST}:1/0?password={SECRET}&ssl_password={SECRET}&timeout=x"
    with pytest.raises(ValidationError) as err:
        storage_from_uri(uri)
    _no_secret(str(err.value))
    shown = redact_uri(f"rediss://user:{SECRET}@h:1/0?password={SECRET}&sentinel_password={SECRET}&db=1")
    assert shown == "rediss://user:***@h:1/0?password=***&sentinel_password=***&db=1"
    storage = storage_from_uri(f"rediss://user:{SECRET}@{HOST}:1/0", ssl_password=SECRET)
    _no_secret(repr(storage), repr(storage.client), repr(storage.user_client))
    storage.close()
    with pytest.raises(ValidationError) as err:
        storage_from_uri(f"redis://{HOST}:1", password=object())
    _no_secret(str(err.value))
    assert "got" not in str(err.value)  # a secret option's value is never shown


def test_the_tls_options_reach_the_connection() -> None:
    storage = storage_from_uri(
        f"rediss://{HOST}:1?ssl_cert_reqs=none&ssl_check_hostname=false&ssl_ca_certs=/etc/ca.pem"
    )
    kwargs = storage.client.connection_pool.connection_kwargs
    assert storage.client.connection_pool.connection_class.__name__ == "SSLConnection"
    assert kwargs["ssl_cert_reqs"] == "none" and kwargs["ssl_check_hostname"] is False
    assert kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    storage.close()
    plain = storage_from_uri(f"redis://{HOST}:1")
    assert plain.client.connection_pool.connection_class.__name__ == "Connection"
    plain.close()


def test_the_remaining_client_options_reach_the_client() -> None:
    """Read back from what was built (nothing here connects)."""
    storage = storage_from_uri(
        f"rediss://{HOST}:1?protocol=3&health_check_interval=7&ssl_certfile=/c.pem&ssl_keyfile=/k.pem"
        f"&ssl_ca_path=/ca&ssl_password={SECRET}"
    )
    kwargs = storage.client.connection_pool.connection_kwargs
    assert kwargs["protocol"] == 3 and kwargs["health_check_interval"] == 7.0
    assert (kwargs["ssl_certfile"], kwargs["ssl_keyfile"], kwargs["ssl_ca_path"]) == (
        "/c.pem",
        "/k.pem",
        "/ca",
    )
    assert kwargs["ssl_password"] == SECRET
    storage.close()
    watched = storage_from_uri(
        f"redis+sentinel://{HOST}:1/svc?sentinel_username=watch&sentinel_password={SECRET}&password=m"
    )
    pool = watched.client.connection_pool
    watcher = pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs
    assert watcher["username"] == "watch" and watcher["password"] == SECRET
    assert pool.connection_kwargs["password"] == "m" and pool.service_name == "svc"
    assert watcher["port"] == 1
    _no_secret(repr(watched), repr(watched.client))
    watched.close()
    default_port = storage_from_uri("redis+sentinel://127.0.0.1/svc")
    assert (
        default_port.client.connection_pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs[
            "port"
        ]
        == 26379
    )
    default_port.close()


def test_storage_from_uri_is_a_lazy_top_level_name() -> None:
    assert nanolimit.storage_from_uri is storage_from_uri
    assert "storage_from_uri" in nanolimit.__all__
    from nanolimit.storage import storage_from_uri as from_storage

    assert from_storage is storage_from_uri


def test_a_unix_socket_path_with_a_user_and_password_is_read(tmp_path: Path) -> None:
    path = str(tmp_path / "r.sock")
    storage = storage_from_uri(f"redis+unix://me:{SECRET}@{path}?db=5")
    kwargs = storage.client.connection_pool.connection_kwargs
    assert kwargs["path"] == path and kwargs["db"] == 5
    assert kwargs["username"] == "me" and kwargs["password"] == SECRET
    _no_secret(repr(storage), repr(storage.client))
    storage.close()


# --------------------------------------------------------------------------
# docs/storage_uris.md: its examples run, its URI forms build, its errors are said

DOC = Path(__file__).resolve().parents[1] / "docs" / "storage_uris.md"


def _blocks(kind: str) -> list[str]:
    text = DOC.read_text()
    return [part.split("```", 1)[0] for part in text.split(f"```{kind}\n")[1:]]


def test_the_docs_python_examples_run(redis_server: Server, capsys: pytest.CaptureFixture[str]) -> None:
    blocks = _blocks("python")
    assert len(blocks) >= 2
    zone = f"nl-doc-{uuid.uuid4().hex[:12]}"
    for block in blocks:
        if "shm://" in block and native_core() is None:
            continue  # the zone needs the native extension
        code = block.replace("127.0.0.1:6379", f"{HOST}:{redis_server.port}").replace("docs-example", zone)
        exec(compile(code, str(DOC), "exec"), {})
    out = capsys.readouterr().out
    assert "True" in out
    if native_core() is not None:
        assert "[True, True, True, False]" in out


def test_every_uri_form_in_the_docs_builds() -> None:
    from nanolimit.storage.uri import storage_kind

    [forms] = _blocks("text")
    uris = [line.strip() for line in forms.splitlines() if line.strip()]
    assert len(uris) >= 12
    for uri in uris:
        kind = storage_kind(uri)
        if kind == "shm" or (kind == "redis" and "+cluster" in uri):
            continue  # would create a zone / asks the cluster's nodes at once: the tests above make both
        storage = storage_from_uri(uri)
        if kind == "async":
            asyncio.run(storage.close())
        else:
            close = getattr(storage, "close", None)
            if close is not None:
                close()


def test_the_docs_error_table_is_what_is_said() -> None:
    text = DOC.read_text().split("## Errors", 1)[1].split("##", 1)[0]
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert len(rows) >= 8
    for row in rows:
        uri, said = (cell.strip().strip("`") for cell in row.strip("|").split("|")[:2])
        if uri.startswith("shm://") and native_core() is None:
            continue  # without the extension every zone says that first (the test below)
        with pytest.raises(ValidationError) as err:
            storage_from_uri(uri)
        for fragment in said.split("..."):
            fragment = fragment.strip(" :;")
            assert fragment in str(err.value), (uri, fragment, str(err.value))


def test_without_the_extension_a_zone_uri_says_why() -> None:
    """The pure twin has no zone: ``shm://`` is refused, naming the reason."""
    import subprocess
    import sys

    code = (
        "from nanolimit import storage_from_uri, ValidationError\n"
        "try:\n    storage_from_uri('shm://x?max_keys=10')\n"
        "except ValidationError as exc:\n    print(exc)\n"
    )
    env = {
        **os.environ,
        "NANOLIMIT_NO_EXTENSIONS": "1",
        "PYTHONPATH": str(Path(nanolimit.__file__).resolve().parents[1]),
    }
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("shm://: SharedMemoryStorage needs nanolimit's native extension")


_ZONE_QUERIES = [
    "max_keys=10&stripes=3",  # not a power of two
    "max_keys=1073741824&stripes=1",  # 2**30 keys in one stripe: past what a stripe indexes
    "max_keys=16777215&stripes=1",
    "max_keys=16777214&stripes=1",
    "max_keys=10&arena_bytes=1",
    "max_keys=1073741825",
    "",
]
_ZONE_NAMES = ["{ok}", "bad%2Fname", "a" * 201, "a" * 200, "caf%C3%A9", "dot.and-dash_{ok}"]


@pytest.mark.native
@pytest.mark.parametrize("query", _ZONE_QUERIES)
@pytest.mark.parametrize("name", _ZONE_NAMES, ids=lambda n: n[:12])
def test_check_storage_uri_refuses_what_making_the_zone_refuses(name: str, query: str) -> None:
    """check_storage_uri (check-config, a rules file's [storage]) passed
    shm://z?max_keys=10&stripes=3 and a zone name with '/', which the zone
    refuses when the gateway starts: a file that check-config calls OK must
    not stop the start."""
    from nanolimit.storage.uri import check_storage_uri

    ok = f"nlt-{uuid.uuid4().hex[:8]}"
    uri = f"shm://{name.format(ok=ok)}" + (f"?{query}" if query else "")
    try:
        made = storage_from_uri(uri)
    except ValidationError as exc:
        refused: str | None = str(exc)
    else:
        refused = None
        made.unlink()
        made.close()
    if refused is not None and "no shared-memory zone called" in refused:
        check_storage_uri(uri)  # attach to a zone that may exist later: only a live check can tell
        return
    if refused is None:
        check_storage_uri(uri)
    else:
        with pytest.raises(ValidationError):
            check_storage_uri(uri)


@pytest.mark.parametrize(
    "query",
    [
        "prefix=a{b}",
        "prefix=tag}",
        "local_share=1.5",
        "local_share=1",
        "local_share=none",
        "prefix=api:&local_share=0.25",
        "max_identity_bytes=2000&max_key_bytes=100",
        "near_cache=true&clock=client",
    ],
)
@pytest.mark.parametrize("scheme", ["redis", "async+redis"])
def test_check_storage_uri_refuses_what_making_the_redis_storage_refuses(scheme: str, query: str) -> None:
    """check_storage_uri stopped at the client: a prefix with a brace and
    local_share = 1.5 passed it (check-config OK) and were refused by
    RedisStorage when the gateway started; storage_uris.md promises the
    same checks."""
    from nanolimit.storage.uri import check_storage_uri

    uri = f"{scheme}://{HOST}:1/0?{query}"  # nothing is connected: no server needed
    try:
        made = storage_from_uri(uri)
    except ValidationError:
        with pytest.raises(ValidationError):
            check_storage_uri(uri)
    else:
        if scheme == "redis":
            made.close()
        check_storage_uri(uri)


@pytest.mark.parametrize("option", ["ssl_ca_path=/etc/ssl/certs", "ssl_password=x"])
def test_check_storage_uri_refuses_what_the_asyncio_cluster_class_refuses(option: str) -> None:
    """storage_uris.md: the asyncio cluster has no ssl_ca_path or
    ssl_password, "refused by name"; the dry check used a stand-in class
    that took any keyword, so check-config passed them and the start failed."""
    from nanolimit.storage.uri import check_storage_uri

    uri = f"async+rediss+cluster://{HOST}:1?{option}"
    with pytest.raises(ValidationError, match="is not taken by"):
        storage_from_uri(uri)
    with pytest.raises(ValidationError, match="is not taken by"):
        check_storage_uri(uri)
    check_storage_uri(f"rediss+cluster://{HOST}:1?{option}")  # the synchronous one takes them
