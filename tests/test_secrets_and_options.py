"""Two classes of attack on a deployment's configuration.

Secrets: no output, ``repr``, log record or error message holds a storage
password, in any spelling a URI allows (raw ``/ ? # @ : &``, percent-encoded,
``:pw@`` with no user, ``rediss://``, ``unix://...?password=``, Sentinel
URIs with several hosts and a ``sentinel_password``): ``nanolimit
check-config`` run for real, the loaded rules and their ``[storage]``, what
an ``on_reload`` hook receives, the storages, the records logged while an
unreachable server is asked, and the errors of bad URIs.

Options: every numeric option of every store is range-checked where it is
given, with a ``ValidationError`` naming it, so nothing that was accepted
fails later — ``local_max_keys=2**40`` used to raise ``OverflowError`` at
every decision of the first Redis outage; at the largest value accepted the
local fallback answers through a real one.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import subprocess
import sys
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import redis
import redis.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from redis_servers import Server, free_port

from nanolimit import ValidationError
from nanolimit._validation import MAX_KEYS
from nanolimit.cli.check_config import check_config
from nanolimit.errors import ConfigError
from nanolimit.gateway.config import ConfigWatcher, load_rules, parse_rules
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.storage.redis import REASON_STORE_UNAVAILABLE_LOCAL, AsyncRedisStorage, RedisStorage
from nanolimit.storage.two_tier import TwoTierStorage
from nanolimit.storage.uri import check_storage_uri, redact_uri, storage_from_uri

pytest_plugins = ["redis_servers"]

SRC = str(Path(__file__).resolve().parent.parent / "src")
# distinctive: no part of a URI but the password holds these
SECRET = "Pw7QzX9kJ"
RAW = "QZ/x?y#w@v:u&t=s+r%2"  # every character a URI reserves, raw
PORT = free_port()  # nobody listens here


def spellings(secret: str = SECRET, port: int = PORT) -> list[str]:
    """One URI per way of writing a password into it."""
    enc = quote(secret, safe="")
    return [
        f"redis://app:{secret}@127.0.0.1:{port}/0",
        f"redis://:{secret}@127.0.0.1:{port}/0",
        f"redis://app:{secret}/{RAW}@127.0.0.1:{port}/0",
        f"redis://app:{secret}?{RAW}@127.0.0.1:{port}/0",
        f"redis://app:{secret}#frag@127.0.0.1:{port}/0",
        f"redis://app:{secret}@x@127.0.0.1:{port}/0",
        f"redis://app:{enc}%2F%3F%23%40@127.0.0.1:{port}/0",
        f"rediss://app:{secret}@127.0.0.1:{port}/0?ssl_password={secret}",
        f"redis://127.0.0.1:{port}/0?password={secret}",
        f"redis://127.0.0.1:{port}/0?pass%77ord={enc}",
        f"unix:///tmp/nanolimit-no.sock?password={secret}&db=1",
        f"unix://:{secret}@/tmp/nano@limit-no.sock",
        f"redis+sentinel://:{secret}@127.0.0.1:{port},127.0.0.2:{port}/mymaster/0"
        f"?sentinel_password={secret}x",
        f"async+redis://app:{secret}@127.0.0.1:{port}/0",
    ]


def assert_hidden(text: str, secret: str = SECRET) -> None:
    assert secret not in text, text
    assert quote(secret, safe="") not in text, text


def rules_file(tmp_path: Path, uri: str, name: str = "rules.toml") -> Path:
    path = tmp_path / name
    escaped = uri.replace("\\", "\\\\").replace('"', '\\"')
    path.write_text(
        textwrap.dedent(
            f"""\
            [storage]
            type = "uri"
            uri = "{escaped}"

            [[rules]]
            name = "login"
            rate = "5/minute"
            """
        )
    )
    return path


# -- secrets -----------------------------------------------------------------------
@pytest.mark.parametrize("uri", spellings())
def test_check_config_never_prints_the_password(
    tmp_path: Path, uri: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = rules_file(tmp_path, uri)
    assert check_config(str(path)) == 0
    out = capsys.readouterr()
    assert "storage: uri uri='" in out.out
    assert_hidden(out.out + out.err)


def test_check_config_as_a_real_process(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    for i, uri in enumerate(spellings()):
        path = rules_file(tmp_path, uri, f"r{i}.toml")
        done = subprocess.run(
            [sys.executable, "-m", "nanolimit", "check-config", str(path)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        assert "storage: uri" in done.stdout
        assert_hidden(done.stdout + done.stderr)


@pytest.mark.parametrize(
    "table",
    [
        {"type": "uri", "uri": ["redis://app:" + SECRET + "@h/0"]},
        {"type": "uri", "uri": f"redis://app:{SECRET}@h:99999/0"},
        {"type": "uri", "uri": f"redis://app:{SECRET}@h/0?local_max_keys={2**40}"},
        {"type": "uri", "uri": f"redis://app:{SECRET}@h/0?bogus=1"},
        {"type": "uri", "uri": f"redis://h/0?password={SECRET}&{SECRET}x=1"},
        {"type": "uri", "uri": f"bad{SECRET}://h"},
        {"type": "uri", "uri": "redis://h", "password": SECRET},
        {"type": "uri", "uri": "redis://h", "sentinel_password": SECRET},
        # the URI pasted as the type: echoed whole in "must be one of ..., got '...'"
        {"type": f"redis://app:{SECRET}@h/0"},
        {"type": f"redis://h/0?password={SECRET}"},
    ],
)
def test_a_bad_storage_section_never_echoes_the_password(table: dict[str, Any], tmp_path: Path) -> None:
    data = {"storage": table, "rules": [{"name": "a", "rate": "1/second"}]}
    with pytest.raises(ConfigError) as caught:
        parse_rules(data)
    assert_hidden(str(caught.value) + repr(caught.value.problems))


def test_reprs_of_the_rules_and_what_on_reload_receives(tmp_path: Path) -> None:
    for i, uri in enumerate(spellings()):
        path = rules_file(tmp_path, uri, f"r{i}.toml")
        loaded = load_rules(path)
        assert loaded.storage is not None and loaded.storage.options == (("uri", uri),)  # build() has it
        section = loaded.storage
        for shown in (repr(loaded), repr(section), str(section), section.shown_options()):
            assert_hidden(shown)
        seen: list[str] = []
        watcher = ConfigWatcher(
            path, RuleRegistry([]), on_reload=lambda got: seen.append(f"{got!r} {got.storage!r}")
        )
        watcher.load()
        assert len(seen) == 1
        assert_hidden(seen[0])


@pytest.mark.parametrize("uri", spellings())
def test_redact_uri_hides_every_spelling(uri: str) -> None:
    shown = redact_uri(uri)
    assert_hidden(shown)
    assert shown.startswith(uri.partition("://")[0] + "://")


def test_redact_uri_folds_a_secret_looking_continuation_whole() -> None:
    """``password=ab&pass<rest>=1`` is the password ``ab&pass<rest>=1`` with a
    raw ``&``: a continuation whose name looked secret was shown by name
    (``password=***&passPw7QzX9kJ=***``), the rest of the password with it."""
    for uri in (
        f"redis://h/0?password=ab&pass{SECRET}=1",
        f"redis://h/0?password=ab&token{SECRET}=1&db=1",
        f"rediss://h/0?ssl_password=ab&auth{SECRET}=x&timeout=1",
    ):
        shown = redact_uri(uri)
        assert_hidden(shown)
        assert shown.count("***") == 1 and "password=***" in shown
    assert redact_uri("redis://h/0?password=ab&pass1=x&db=1") == "redis://h/0?password=***&db=1"


def test_redact_uri_keeps_what_is_no_secret() -> None:
    assert redact_uri("redis://app:pw@db.internal:6380/2") == "redis://app:***@db.internal:6380/2"
    assert redact_uri("redis://db.internal:6379/0?timeout=0.1") == "redis://db.internal:6379/0?timeout=0.1"
    assert redact_uri("redis://h/0?client_name=a@b") == "redis://h/0?client_name=a@b"
    assert redact_uri("unix:///run/a@b.sock?db=1") == "unix:///run/a@b.sock?db=1"
    assert redact_uri("unix://:pw@/run/a@b.sock") == "unix://:***@/run/a@b.sock"
    assert (
        redact_uri("redis+sentinel://:pw@s1:26379,s2:26380/main?sentinel_password=sp&db=1")
        == "redis+sentinel://:***@s1:26379,s2:26380/main?sentinel_password=***&db=1"
    )


# printable ASCII that a URI reserves or escapes, and capitals (no option's name)
_CHARS = st.sampled_from(list("/?#@:&=+%;,$!*'()[] ~\"<>\\^`{|}") + list("QXJKVWYZ0123456789"))
_PASSWORDS = st.text(_CHARS, min_size=1, max_size=24).map(lambda s: f"Pw7{s}Qz9")


@given(password=_PASSWORDS, where=st.integers(0, 5))
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_redact_uri_property(password: str, where: int) -> None:
    enc = quote(password, safe="")
    uri = [
        f"redis://app:{password}@db.internal:6379/0",
        f"redis://:{password}@db.internal/0?timeout=0.1",
        f"rediss://app:{enc}@db.internal:6380/0",
        f"redis://db.internal/0?password={password}",
        f"unix://:{password}@/run/redis.sock?db=2",
        f"redis+sentinel://:{password}@s1,s2:26380/main?sentinel_password={enc}",
    ][where]
    shown = redact_uri(uri)
    assert password not in shown and enc not in shown, (uri, shown)


@given(password=_PASSWORDS)
@settings(max_examples=100, deadline=None)
def test_no_error_of_a_uri_holds_its_password(password: str) -> None:
    for uri in (
        f"redis://app:{password}@127.0.0.1:{PORT}/0?bogus=1",
        f"redis://app:{password}@127.0.0.1:{PORT}/x",
        f"redis://app:{password}@127.0.0.1:99999/0",
        f"redis://app:{password}@127.0.0.1:{PORT}/0?timeout=soon",
        f"memory://:{password}@",
        f"shm://app:{password}@zone",
        f"redis://127.0.0.1:{PORT}/0?password={password}&x",
    ):
        try:
            made = storage_from_uri(uri)
        except ValidationError as exc:
            assert password not in str(exc), (uri, str(exc))
        else:
            assert password not in repr(made)
            made.close()


BAD_URIS = [
    f"redis://app:{SECRET}@h:99999/0",
    f"redis://app:{SECRET}@h:{'9' * 5000}/0",
    f"redis://app:{SECRET}@h/notadb",
    f"redis://app:{SECRET}@h/0?bogus=1",
    f"redis://app:{SECRET}@h/0?timeout=nan",
    f"redis://app:{SECRET}@h/0?db={'9' * 30}",
    f"redis://h/0?password={SECRET}&{SECRET}",
    f"redis://h/0?password={SECRET}&{SECRET}=1",
    f"redis://h/0?password=a&password={SECRET}",
    f"redis+sentinel://:{SECRET}@h1,h2/",
    f"redis+cluster://:{SECRET}@h1,h2/3",
    f"redis+unix://:{SECRET}@h/x.sock",
    f"memory://:{SECRET}@",
    f"shm://app:{SECRET}@zone",
    f"x{SECRET}://h",
    f"app:{SECRET}@h",
]


@pytest.mark.parametrize("uri", BAD_URIS)
def test_bad_uris_are_refused_without_their_password(uri: str) -> None:
    with pytest.raises(ValidationError) as caught:
        storage_from_uri(uri)
    assert_hidden(str(caught.value))
    with pytest.raises(ValidationError) as caught:
        check_storage_uri(uri)
    assert_hidden(str(caught.value))


def test_keyword_secrets_are_never_shown() -> None:
    for kwargs in ({"password": 5}, {"password": [SECRET]}, {"key_salt": SECRET}):
        with pytest.raises(ValidationError) as caught:
            storage_from_uri(f"redis://127.0.0.1:{PORT}/0", **kwargs)
        assert_hidden(str(caught.value))
    with pytest.raises(ValidationError) as caught:
        storage_from_uri("redis+sentinel://127.0.0.1/m", sentinel_password=[SECRET])
    assert_hidden(str(caught.value))
    with pytest.raises(ValidationError) as caught:
        RedisStorage(f"redis://app:{SECRET}@127.0.0.1/0")  # a URL where a client belongs
    assert_hidden(str(caught.value))


def test_storage_reprs_hold_no_password() -> None:
    made = []
    for uri in spellings():
        if uri.startswith(("unix", "rediss")):
            continue
        storage: Any = storage_from_uri(uri, on_error="local")
        made.append(storage)
        assert_hidden(repr(storage))
        assert storage._local is not None
        assert_hidden(repr(storage._local))
    sync = storage_from_uri(spellings()[0], on_error="local")
    tier = TwoTierStorage(remote=sync, start=False)
    assert_hidden(repr(tier) + repr(tier.remote))
    for storage in (*made, sync):
        if isinstance(storage, AsyncRedisStorage):
            asyncio.run(storage.aclose()) if hasattr(storage, "aclose") else None
        else:
            storage.close()


def test_cluster_error_holds_no_password() -> None:
    with pytest.raises(Exception) as caught:  # the synchronous cluster asks its nodes at once
        storage_from_uri(f"redis+cluster://:{SECRET}@127.0.0.1:{PORT},127.0.0.2:{PORT}")
    assert_hidden(str(caught.value) + repr(caught.value))


def test_no_log_record_of_a_failing_connection_holds_the_password(
    caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    from nanolimit.reference import TokenBucket

    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    for uri in spellings():
        if uri.startswith(("rediss", "async")):
            continue
        for policy in ("allow", "local", "raise"):
            storage: Any = storage_from_uri(uri, on_error=policy, breaker_threshold=2)
            limiter = TokenBucket(5, 60.0, storage, rule="r")
            for _ in range(4):
                try:
                    limiter.allow("k")
                except Exception as exc:  # on_error="raise": the error itself is output too
                    texts.append(f"{exc!s} {exc!r} {exc.__cause__!s}")
            texts.append(repr(storage.metrics()))
            storage.close()
    # a rules file whose reload fails is logged too
    path = rules_file(tmp_path, spellings()[2])
    watcher = ConfigWatcher(path, RuleRegistry([]))
    watcher.load()
    path.write_text(path.read_text().replace('rate = "5/minute"', 'rate = "oops"'))
    assert not watcher.check() and not watcher.check()  # new bytes are tried by the second poll
    for record in caplog.records:
        texts.append(record.getMessage())
        if record.exc_info and record.exc_info[1] is not None:
            texts.append(str(record.exc_info[1]))
    assert caplog.records  # something was logged, and none of it shows the password
    for text in texts:
        assert_hidden(text)


@pytest.mark.parametrize("scheme", ["redis", "rediss", "async+redis", "redis+cluster"])
def test_a_password_written_without_its_colon_is_refused_not_shown(scheme: str) -> None:
    """``redis://PASSWORD@host`` reads PASSWORD as a user name: it passed
    check-config (which printed it), every decision then failed to log in
    (degraded, allowed under on_error="allow") and the outage WARNING named
    the store as redis://PASSWORD@host. A user without a password is refused
    before anything connects, and redact_uri shows it as ***@."""
    uri = f"{scheme}://{SECRET}@127.0.0.1:{PORT}"
    for check in (storage_from_uri, check_storage_uri):
        with pytest.raises(ValidationError, match="names a user but no password") as caught:
            check(uri)
        assert_hidden(str(caught.value))
    assert redact_uri(uri) == f"{scheme}://***@127.0.0.1:{PORT}"
    # a user with its password elsewhere, or an empty one, is a login
    check_storage_uri(f"{scheme}://app@127.0.0.1:{PORT}?password={SECRET}")
    check_storage_uri(f"{scheme}://app:@127.0.0.1:{PORT}")
    check_storage_uri(f"{scheme}://127.0.0.1:{PORT}", username="app", password=SECRET)


def test_a_raw_password_authenticates(own_server: Server) -> None:
    """The password with raw reserved characters is read whole: the server
    that requires it answers (the parse is right, not only the redaction)."""
    password = "Pw7/x?y#w@v:u"
    admin = own_server.client()
    admin.config_set("requirepass", password)
    admin.close()
    port = own_server.port
    for uri in (
        f"redis://:{password}@127.0.0.1:{port}/0",
        f"redis://default:{password}@127.0.0.1:{port}/0",
        f"redis://:{quote(password, safe='')}@127.0.0.1:{port}/0",
        f"redis://127.0.0.1:{port}/0?password={quote(password, safe='')}",
    ):
        storage: Any = storage_from_uri(uri, on_error="raise", timeout=1.0)
        assert storage.client.ping()
        assert_hidden(repr(storage), password)
        storage.close()
    with pytest.raises(Exception) as caught:  # a wrong one is refused, and not shown either
        bad: Any = storage_from_uri(f"redis://:{password}x@127.0.0.1:{port}/0", on_error="raise", timeout=1.0)
        bad.client.ping()
    assert_hidden(str(caught.value), password)


# -- option ranges -----------------------------------------------------------------
NAN = math.nan
INF = math.inf
BIG = 10**30

MEMORY_BAD = [
    ("max_keys", 2**32),
    ("max_keys", 2**40),
    ("max_keys", BIG),
    ("max_keys", -1),
    ("max_keys", 0),
    ("max_keys", True),
    ("max_keys", 1.5),
    ("stripes", 2**20),
    ("stripes", True),
    ("stripes", -64),
    ("max_key_bytes", 2**40),
    ("max_key_bytes", True),
    ("max_key_bytes", 0),
    ("evict_idle_after", NAN),
    ("evict_idle_after", INF),
    ("evict_idle_after", -1.0),
    ("evict_idle_after", True),
    ("evict_idle_after", BIG**20),
]


@pytest.mark.parametrize(("name", "value"), MEMORY_BAD, ids=lambda v: repr(v)[:20])
def test_in_memory_options_are_checked_at_construction(
    backend: types.SimpleNamespace, name: str, value: Any
) -> None:
    if backend.name == "zone":
        pytest.skip("the zone's own table below")
    with pytest.raises(ValidationError, match=name):
        backend.module.InMemoryStorage(**{name: value})


def test_in_memory_at_the_largest_bound_works(backend: types.SimpleNamespace) -> None:
    if backend.name == "zone":
        pytest.skip("InMemoryStorage only")
    storage = backend.module.InMemoryStorage(max_keys=MAX_KEYS)
    limiter = backend.limiters["token_bucket"](3, 60.0, storage, backend.FakeClock(0.0), "r")
    assert [limiter.allow("k").allowed for _ in range(4)] == [True, True, True, False]


@pytest.mark.native
def test_zone_options_are_checked_at_construction() -> None:
    from nanolimit.storage.shared_memory import SharedMemoryStorage

    for name, value in [
        ("max_keys", 2**40),
        ("max_keys", True),
        ("max_keys", -1),
        ("arena_bytes", 2**41),
        ("arena_bytes", True),
        ("stripes", True),
        ("evict_idle_after", NAN),
    ]:
        kwargs: dict[str, Any] = {"max_keys": 1000, name: value}
        with pytest.raises(ValidationError, match=name):
            SharedMemoryStorage(f"nl-opt-{os.getpid()}", **kwargs)


REDIS_BAD = [
    ("local_max_keys", 2**32),
    ("local_max_keys", 2**40),
    ("local_max_keys", BIG),
    ("local_max_keys", -5),
    ("local_max_keys", True),
    ("local_instances", BIG),
    ("local_instances", 10**400),
    ("local_share", NAN),
    ("local_share", True),
    ("timeout", NAN),
    ("timeout", INF),
    ("timeout", True),
    ("timeout", -1.0),
    ("timeout", 1e300),
    ("deny_retry_after", True),
    ("deny_retry_after", NAN),
    ("deny_retry_after", -1),
    ("deny_retry_after", 1e300),
    ("breaker_threshold", True),
    ("breaker_threshold", BIG),
    ("breaker_threshold", 0),
    ("breaker_cooldown", NAN),
    ("breaker_cooldown", INF),
    ("breaker_cooldown", -1.0),
    ("breaker_cooldown", True),
    ("near_cache_size", BIG),
    ("near_cache_size", True),
    ("near_cache_size", 0),
    ("near_cache_ttl", NAN),
    ("near_cache_ttl", True),
    ("near_cache_ttl", -1),
    ("keep_connections", BIG),
    ("keep_connections", -1),
    ("keep_connections", True),
    ("max_identity_bytes", BIG),
    ("max_identity_bytes", True),
    ("max_key_bytes", BIG),
    ("max_key_bytes", 0),
]


@pytest.mark.parametrize(("name", "value"), REDIS_BAD, ids=lambda v: repr(v)[:20])
@pytest.mark.parametrize("policy", ["allow", "local"])
def test_redis_options_are_checked_at_construction(name: str, value: Any, policy: str) -> None:
    with pytest.raises(ValidationError, match=name):
        RedisStorage(redis.Redis(host="127.0.0.1", port=PORT), on_error=policy, **{name: value})
    with pytest.raises(ValidationError, match=name):
        AsyncRedisStorage(redis.asyncio.Redis(host="127.0.0.1", port=PORT), on_error=policy, **{name: value})


URI_BAD = [
    ("local_max_keys", str(2**40)),
    ("local_max_keys", "9" * 30),
    ("local_max_keys", "-1"),
    ("local_max_keys", "true"),
    ("local_instances", "9" * 5000),
    ("timeout", "nan"),
    ("timeout", "inf"),
    ("timeout", "1e300"),
    ("connect_timeout", "1e300"),
    ("breaker_threshold", "9" * 30),
    ("breaker_cooldown", "inf"),
    ("near_cache_size", "9" * 30),
    ("keep_connections", "9" * 30),
    ("db", "9" * 30),
    ("max_connections", "9" * 30),
    ("health_check_interval", "1e300"),
    ("deny_retry_after", "1e300"),
]


@pytest.mark.parametrize(("name", "value"), URI_BAD, ids=lambda v: repr(v)[:20])
def test_uri_query_options_are_checked(name: str, value: str) -> None:
    uri = f"redis://127.0.0.1:{PORT}/0?on_error=local&{name}={value}"
    for call in (storage_from_uri, check_storage_uri):
        with pytest.raises(ValidationError, match=name):
            call(uri)


@pytest.mark.parametrize(
    "uri",
    [
        "memory://?max_keys=" + "9" * 30,
        f"memory://?max_keys={2**32}",
        "memory://?max_keys=" + "9" * 5000,
        "memory://?stripes=" + "9" * 30,
        "memory://?evict_idle_after=nan",
        "memory://?evict_idle_after=1e999",
        "memory://?max_key_bytes=" + "9" * 30,
        "shm://z?max_keys=" + "9" * 30,
        "shm://z?max_keys=10&arena_bytes=" + "9" * 30,
    ],
)
def test_table_uris_are_validation_errors_not_overflow(uri: str) -> None:
    name = uri.rpartition("&")[2].partition("?")[2] or uri.rpartition("&")[2]
    name = name.partition("=")[0]
    with pytest.raises(ValidationError, match=name):
        storage_from_uri(uri)


def test_two_tier_options_are_checked_at_construction() -> None:
    remote = RedisStorage(redis.Redis(host="127.0.0.1", port=PORT))
    for name, value in [
        ("sync_interval", True),
        ("sync_interval", NAN),
        ("sync_interval", -1),
        ("heartbeat_ttl", True),
        ("heartbeat_ttl", NAN),
        ("heartbeat_ttl", INF),
        ("partition_grace", NAN),
        ("partition_grace", True),
        ("timeout", NAN),
        ("timeout", -1.0),
        ("timeout", True),
        ("timeout", 1e300),
        ("instances", True),
        ("instances", 10**400),
        ("instances", 0),
    ]:
        with pytest.raises(ValidationError, match=name):
            TwoTierStorage(remote=remote, start=False, **{name: value})
    remote.close()


@pytest.mark.parametrize(
    ("table", "name"),
    [
        ({"type": "memory", "max_keys": 2**40}, "max_keys"),
        ({"type": "memory", "stripes": 2**20}, "stripes"),
        ({"type": "memory", "evict_idle_after": NAN}, "evict_idle_after"),
        ({"type": "memory", "evict_idle_after": INF}, "evict_idle_after"),
        ({"type": "shared_memory", "name": "z", "max_keys": 2**40}, "max_keys"),
        ({"type": "uri", "uri": f"redis://h/0?on_error=local&local_max_keys={2**40}"}, "local_max_keys"),
        ({"type": "uri", "uri": "memory://?max_keys=" + "9" * 30}, "max_keys"),
    ],
)
def test_rules_file_storage_sections_are_range_checked_at_load(table: dict[str, Any], name: str) -> None:
    with pytest.raises(ConfigError, match=name):
        parse_rules({"storage": table, "rules": [{"name": "a", "rate": "1/second"}]})


def _through_an_outage(make: Callable[[Server], Any], server: Server, backend: types.SimpleNamespace) -> None:
    storage = make(server)
    limiter = backend.limiters["token_bucket"](10, 60.0, storage, backend.FakeClock(1_000_000.0), "r")
    assert limiter.allow("k").allowed and not limiter.allow("k").degraded
    server.kill()
    during = [limiter.allow(f"k{i % 3}") for i in range(12)]
    assert all(d.degraded and d.reason == REASON_STORE_UNAVAILABLE_LOCAL for d in during)
    assert any(d.allowed for d in during)
    assert storage.metrics()["local_decisions"] == 12
    storage.close()


def test_the_largest_local_max_keys_answers_through_a_real_outage(
    backend: types.SimpleNamespace, own_server: Server
) -> None:
    """At MAX_KEYS the local store is made at the first failed decision and
    decides: no OverflowError (2**40 was accepted before and raised one at
    every decision of the outage)."""
    if backend.name == "zone":
        pytest.skip("the local fallback is an InMemoryStorage")

    def make(server: Server) -> Any:
        return storage_from_uri(
            f"redis://127.0.0.1:{server.port}/0?on_error=local&local_max_keys={MAX_KEYS}"
            "&breaker_threshold=2&timeout=0.2"
        )

    _through_an_outage(make, own_server, backend)
    with pytest.raises(ValidationError, match="local_max_keys"):
        RedisStorage(own_server.client(), on_error="local", local_max_keys=MAX_KEYS + 1)


def test_the_largest_local_max_keys_at_a_port_nobody_listens_on(backend: types.SimpleNamespace) -> None:
    if backend.name == "zone":
        pytest.skip("the local fallback is an InMemoryStorage")
    storage = RedisStorage(
        redis.Redis(host="127.0.0.1", port=free_port()), on_error="local", local_max_keys=MAX_KEYS
    )
    limiter = backend.limiters["sliding_counter"](4, 60.0, storage, backend.FakeClock(5.0), "r")
    decisions = [limiter.allow("k") for _ in range(6)]
    assert all(d.reason == REASON_STORE_UNAVAILABLE_LOCAL for d in decisions)
    assert [d.allowed for d in decisions] == [True] * 4 + [False] * 2
    storage.close()
