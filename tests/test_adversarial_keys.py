"""Identity under attack: what a client can make the key extractor believe.

Each test is one attack on whose budget a request spends, or on the memory
the extractor keeps while deciding it: padded or junk forwarding entries,
RFC 7239 ``Forwarded`` headers, a server that rewrites the client from
``X-Forwarded-For`` before nanolimit sees it (uvicorn's defaults, run for
real on 127.0.0.1), spoofed headers with no proxy trusted, IPv6 grouping,
IPv4 carried in IPv6, hostile API keys and floods of distinct headers.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import socket
import subprocess
import sys
import time
import tracemalloc
import types
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from gateway_helpers import gateway, get, ok_handler, rule
from hypothesis import given, settings
from hypothesis import strategies as st
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request as StarletteRequest
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from uvicorn.middleware.proxy_headers import ProxyHeadersMiddleware

import nanolimit
from nanolimit._validation import MAX_KEY_BYTES
from nanolimit.asgi import RateLimitMiddleware
from nanolimit.errors import ValidationError
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.keys import (
    CACHE_BYTES,
    MAX_HOPS,
    ClientKey,
    DefaultKeyExtractor,
    RewrittenClientWarning,
)
from nanolimit.gateway.middleware import Request
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import KeyScope

TESTS = Path(__file__).resolve().parent
SRC = Path(nanolimit.__file__).resolve().parents[1]  # the nanolimit under test: the wheel in CI
PROXY = "10.0.0.1"  # the connection's peer in the proxied tests: a trusted proxy
MIB = 1024 * 1024


def _proxied(header: str, name: str = "x-forwarded-for", peer: str = PROXY, **extra: str) -> Request:
    return Request("GET", "/", {name: header, **extra}, peer)


def _xff() -> DefaultKeyExtractor:
    return DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"])


def _fwd() -> DefaultKeyExtractor:
    return DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"], forwarded_header="forwarded")


def _ip(ex: DefaultKeyExtractor, request: Request) -> str:
    """The IP storage key, checked against the slow path: both must agree."""
    key = ex.storage_key_for(request, KeyScope.IP)
    assert key == ex.key_for(request, KeyScope.IP).storage_key()
    return key


def _growth(run: Callable[[], object]) -> int:
    """Bytes still allocated after ``run`` (its result kept alive), by tracemalloc."""
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        kept = run()
        gc.collect()
        after = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    del kept
    return after - before


# -- 1. padded / malformed X-Forwarded-For entries ------------------------------
def test_padded_forwarded_entries_do_not_fill_memory() -> None:
    """10,000 requests, each with its own ``[2001:db8::1]`` + 8 KB padding
    behind a trusted hop. Before: each parsed as an address and was cached
    verbatim twice (~160 MB). Now the entry is rejected, nothing of it is
    cached, and the walk keys by the last trusted hop."""
    ex = _xff()

    def flood() -> DefaultKeyExtractor:
        for i in range(10_000):
            key = ex.storage_key_for(_proxied(f"[2001:db8::1]{i:08d}{'A' * 8192}, 10.0.0.2"), KeyScope.IP)
            assert key == "ip:10.0.0.2"
        return ex

    assert _growth(flood) < 1 * MIB
    assert all(len(k) <= 64 for k in (*ex._ip_keys, *ex._hops, *ex._trusted_cache))


def test_whitespace_padded_entries_are_read_but_never_cached() -> None:
    """Optional whitespace around an entry is allowed by the list syntax, so
    ``8 KB of spaces + address`` is that address; but the raw entry (the
    cache key) is client-sized and must not be kept."""
    ex = _xff()

    def flood() -> DefaultKeyExtractor:
        for i in range(10_000):
            pad = " " * (8192 + i % 7)
            assert ex.storage_key_for(_proxied(f"{pad}203.0.113.{i % 200}{pad}, 10.0.0.2"), KeyScope.IP) == (
                f"ip:203.0.113.{i % 200}"
            )
        return ex

    assert _growth(flood) < 1 * MIB


def test_padded_peer_from_a_rewriting_server_is_not_cached() -> None:
    """Without trusted proxies the peer is the cache key. A server that
    rewrote the client from a header (uvicorn) hands us a client-chosen,
    client-sized "peer": 10,000 distinct 8 KB ones must not be kept."""
    ex = DefaultKeyExtractor()

    def flood() -> DefaultKeyExtractor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RewrittenClientWarning)
            for i in range(10_000):
                key = ex.storage_key_for(Request("GET", "/", {}, f"{i:08d}{'x' * 8192}"), KeyScope.IP)
                assert key.startswith("ip#") and len(key) < 64
        return ex

    assert _growth(flood) < 1 * MIB


def test_every_cache_is_bounded_by_bytes() -> None:
    """Distinct *valid* entries are cached, within ``cache_bytes`` per cache:
    12,000 different IPv6 clients in the bracket-and-port form, and 12,000
    different 250-character non-ASCII API keys, stay under the budget."""
    budget = 256 * 1024
    ex = DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"], cache_bytes=budget)

    def flood() -> DefaultKeyExtractor:
        for i in range(12_000):
            request = _proxied(
                f"[2001:db8:{i:x}::{i:x}]:{1 + i % 65000}, 10.0.0.2", x_api_key=f"é{i:06d}" * 35
            )
            ex.storage_key_for(request, KeyScope.IP)
            ex.storage_key_for(request, KeyScope.API_KEY)
        return ex

    grown = _growth(flood)
    for cache in (ex._ip_cache, ex._hop_cache, ex._trusted_budget, ex._secret_budget):
        assert cache.used <= budget
    assert len(ex._secret_cache) < 1000  # the byte bound bit long before the entry bound
    assert grown < 4 * budget + 1 * MIB
    caches = [v for v in vars(ex).values() if isinstance(v, type(ex._ip_cache))]
    assert len(caches) == 4 and all(c.max_bytes == budget for c in caches)  # docs/proxies.md: 4 x cache_bytes
    assert DefaultKeyExtractor()._ip_cache.max_bytes == CACHE_BYTES == 8 * MIB


ACCEPTED = [
    ("203.0.113.9", "ip:203.0.113.9"),
    ("203.0.113.9:8080", "ip:203.0.113.9"),
    (" \t203.0.113.9\t ", "ip:203.0.113.9"),
    ("2001:db8:5:6::7", "ip:2001:db8:5:6::/64"),
    ("[2001:db8:5:6::7]", "ip:2001:db8:5:6::/64"),
    ("[2001:db8:5:6::7]:443", "ip:2001:db8:5:6::/64"),
    ("2001:DB8:5:6:0:0:0:7", "ip:2001:db8:5:6::/64"),
    ("::ffff:203.0.113.9", "ip:203.0.113.9"),
    ("[::ffff:203.0.113.9]:1", "ip:203.0.113.9"),
]

REJECTED = [
    "[2001:db8::1]" + "A" * 8192,  # padding after the bracket
    "[2001:db8::1]junk",
    "[2001:db8::1]:443junk",
    "[2001:db8::1]:",
    "[2001:db8::1",
    "[203.0.113.9]",  # IPv4 has no brackets
    "203.0.113.9:",
    "203.0.113.9:99999",
    "203.0.113.9:-1",
    "203.0.113.9:８０",  # non-ASCII digits
    "203.0.113.9 junk",
    "203.0.113.9\x00",
    "203.0.113.9/24",
    "203.0.113.09",  # a leading zero: octal to some parsers
    "203.0.113",
    "２０３.0.113.9",
    "fe80::1%eth0",  # zone ids mean nothing past one link
    "[fe80::1%25eth0]:80",
    "2001:db8::1:443:1:2:3:4:5",
    "unknown",
    "_hidden",
    "localhost",
    "1" * 65,
]


@pytest.mark.parametrize(("entry", "key"), ACCEPTED)
def test_accepted_forwarded_for_forms(entry: str, key: str) -> None:
    assert _ip(_xff(), _proxied(f"{entry}, 10.0.0.2")) == key


@pytest.mark.parametrize("entry", REJECTED, ids=lambda e: repr(e[:24]))
def test_rejected_forwarded_for_forms_key_the_last_trusted_hop(entry: str) -> None:
    """Whatever is not an address stops the walk; the request is keyed by
    the last hop a trusted proxy vouched for, never by the junk."""
    ex = _xff()
    assert _ip(ex, _proxied(f"198.51.100.1, {entry}, 10.0.0.2")) == "ip:10.0.0.2"
    assert _ip(ex, _proxied(entry)) == f"ip:{PROXY}"  # the peer wrote junk: key the peer
    assert ex.client_ip(_proxied(entry)) == PROXY


def test_client_ip_is_canonical_text_never_the_raw_entry() -> None:
    ex = _xff()
    assert ex.client_ip(_proxied("[2001:DB8:7:0::1]:443")) == "2001:db8:7::1"
    assert ex.client_ip(_proxied(" 203.0.113.9:80 ,10.0.0.2")) == "203.0.113.9"


def test_junk_cannot_pick_an_identity_through_a_real_proxy(backend: types.SimpleNamespace) -> None:
    """A client behind our proxy writes anything it likes; the proxy appends
    the real address, so the client is keyed by it and spends one budget."""
    mw = gateway(backend, [rule("per-ip", 2, 60.0)], extractor=_xff())
    forged = ["203.0.113.1", "[2001:db8::1]" + "A" * 100, "unknown", "1.2.3.4, junk", "", ","]
    statuses = [
        mw(get(client=PROXY, x_forwarded_for=f"{f}, 198.51.100.77"), ok_handler).status for f in forged
    ]
    assert statuses == [200, 200, 429, 429, 429, 429]


def test_the_walk_is_bounded_in_hops() -> None:
    """Thousands of entries cost at most MAX_HOPS steps; a chain longer than
    that is keyed by the last trusted hop reached, never by an entry the
    walk did not vouch for."""
    ex = _xff()
    chain = "203.0.113.66, " + ", ".join(f"10.0.{i // 250}.{i % 250 + 1}" for i in range(5000))
    key = _ip(ex, _proxied(chain))
    assert key != "ip:203.0.113.66" and key.startswith("ip:10.0.")
    short = "203.0.113.66, " + ", ".join(["10.0.0.2"] * (MAX_HOPS - 1))
    assert _ip(ex, _proxied(short)) == "ip:203.0.113.66"
    assert _ip(ex, _proxied("," * 100_000)) == f"ip:{PROXY}"  # only empty entries: the peer


def test_a_trusted_network_client_is_believed_by_design() -> None:
    """The documented limit of any X-Forwarded-For walk: a client *inside*
    trusted_proxies is taken for a proxy, so what it writes is believed.
    trusted_proxies must list proxies, not networks where clients live."""
    ex = _xff()
    assert (
        _ip(ex, Request("GET", "/", {"x-forwarded-for": "203.0.113.200"}, "10.7.7.7")) == "ip:203.0.113.200"
    )


# -- 2. RFC 7239 Forwarded ---------------------------------------------------------
FORWARDED = [
    ("for=203.0.113.7;proto=https", "ip:203.0.113.7"),
    ('for="[2001:db8::1]:443"', "ip:2001:db8::/64"),
    ('for="[2001:db8::1]"', "ip:2001:db8::/64"),
    ("for=198.51.100.1, for=203.0.113.7", "ip:203.0.113.7"),
    ("for=203.0.113.7, for=10.0.0.2", "ip:203.0.113.7"),
    ("for=203.0.113.7,for=10.0.0.2;proto=http;by=10.0.0.1", "ip:203.0.113.7"),
    ("For=203.0.113.7", "ip:203.0.113.7"),
    ("proto=https;for=203.0.113.7;host=example.com", "ip:203.0.113.7"),
    ("for=203.0.113.7 ; proto=https", "ip:203.0.113.7"),
    ('for="203.0.113.7:8080"', "ip:203.0.113.7"),
    ('for="203.0.113.7:_p1"', "ip:203.0.113.7"),
    ('for="\\203.0.113.7"', "ip:203.0.113.7"),  # a quoted-pair is unescaped
    ("for=[2001:db8::1]:443", "ip:2001:db8::/64"),  # unquoted: a leniency
    ('for="2001:db8::1"', "ip:2001:db8::/64"),  # bare IPv6: a leniency
    ("for=_hidden", "ip:_hidden"),
    ("for=_hidden.by-proxy_1, for=10.0.0.2", "ip:_hidden.by-proxy_1"),
    ("for=unknown", f"ip:unknown@{PROXY}"),
    ('for="unknown:80", for=10.0.0.2', "ip:unknown@10.0.0.2"),
    ("proto=https", f"ip:unknown@{PROXY}"),  # no for=: the proxy did not say
    # a client's quoted comma and unbalanced quote do not swallow our proxy's element
    ('for="x, for=6.6.6.6", for=198.51.100.4', "ip:198.51.100.4"),
    ('for="1.2.3.4, for=198.51.100.4', "ip:198.51.100.4"),
    ('by="a\\"b", for=198.51.100.4', "ip:198.51.100.4"),
    ('for=198.51.100.4;by="a\\\\"', "ip:198.51.100.4"),
]

FORWARDED_MALFORMED = [
    "203.0.113.7",  # X-Forwarded-For syntax is not an element
    "for=203.0.113.7;for=203.0.113.8",  # the RFC forbids a repeated parameter
    'for="[2001:db8::1]"junk',
    'for="[2001:db8::1]' + "x" * 8000 + '"',
    "for=203.0.113.7:99999",
    'for="[2001:db8::1]:_"',
    "for=_",
    "for=_a/b",
    "for=",
    'for="fe80::1%eth0"',
    "for=203.0.113.7 junk",
    "for=203.0.113.7;proto",
    "for=localhost",
    'for="[203.0.113.7]"',
    "for=" + "1" * 300,
]


@pytest.mark.parametrize(("header", "key"), FORWARDED)
def test_forwarded_is_parsed_as_rfc_7239(header: str, key: str) -> None:
    assert _ip(_fwd(), _proxied(header, "forwarded")) == key


@pytest.mark.parametrize("header", FORWARDED_MALFORMED, ids=lambda h: repr(h[:24]))
def test_malformed_forwarded_elements_key_the_last_trusted_hop(header: str) -> None:
    ex = _fwd()
    assert _ip(ex, _proxied(header, "forwarded")) == f"ip:{PROXY}"
    assert _ip(ex, _proxied(f"for=198.51.100.1, {header}, for=10.0.0.2", "forwarded")) == "ip:10.0.0.2"


def test_forwarded_clients_get_their_own_budgets(backend: types.SimpleNamespace) -> None:
    """The bug: every RFC 7239 client was keyed as the proxy, so one client
    spent everyone's budget. Now each for= node has its own."""
    mw = gateway(backend, [rule("per-ip", 2, 60.0)], extractor=_fwd())

    def via(header: str) -> int:
        return mw(get(client=PROXY, forwarded=header), ok_handler).status

    assert [via("for=203.0.113.7;proto=https") for _ in range(3)] == [200, 200, 429]
    assert via('for="[2001:db8::1]:443"') == 200
    assert via("for=198.51.100.9, for=203.0.113.8") == 200
    assert via("for=_client-a") == 200 and via("for=_client-a") == 200 and via("for=_client-a") == 429
    assert via("for=_client-b") == 200


def test_unknown_and_obfuscated_nodes_cannot_pick_a_shared_identity(backend: types.SimpleNamespace) -> None:
    """``unknown`` (the writer could not say) gets one bucket per writer,
    apart from the writer's own key: exhausting it leaves the proxy's own
    requests and every identified client alone. A client cannot write an
    ``unknown``, obfuscated or address node that we believe: ours are to its
    right."""
    mw = gateway(backend, [rule("per-ip", 2, 60.0)], extractor=_fwd())

    def via(header: str | None) -> int:
        extra = {} if header is None else {"forwarded": header}
        return mw(get(client=PROXY, **extra), ok_handler).status

    assert [via("for=unknown") for _ in range(3)] == [200, 200, 429]
    assert via(None) == 200  # the proxy's own key is untouched
    assert via("for=203.0.113.7") == 200
    # a client forging a node: our proxy's element, to its right, decides
    assert [via("for=_victim, for=198.51.100.50") for _ in range(3)] == [200, 200, 429]
    assert via("for=unknown, for=198.51.100.51") == 200
    assert via("for=_victim") == 200  # the forged name never spent the real one's budget


def test_xff_header_is_ignored_when_forwarded_is_configured() -> None:
    ex = _fwd()
    assert _ip(ex, _proxied("203.0.113.9")) == f"ip:{PROXY}"
    assert _ip(_xff(), _proxied("for=203.0.113.9", "forwarded")) == f"ip:{PROXY}"


def test_header_names_without_a_parser_are_refused() -> None:
    for name in ("x-forwarded", "forwarded-for", "x_forwarded_for", "via", ""):
        with pytest.raises(ValidationError, match="has no parser"):
            DefaultKeyExtractor(forwarded_header=name)
    with pytest.raises(ValidationError):
        DefaultKeyExtractor(forwarded_header=b"forwarded")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        DefaultKeyExtractor(cache_bytes=-1)
    ex = DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"], forwarded_header="X-Real-IP")
    assert _ip(ex, _proxied("203.0.113.9", "x-real-ip")) == "ip:203.0.113.9"
    assert _ip(ex, _proxied("[2001:db8::1]junk", "x-real-ip")) == f"ip:{PROXY}"


# -- 3. a server that rewrites the client (uvicorn's proxy headers) --------------
def test_a_rewritten_client_warns_once_per_extractor() -> None:
    """No trusted proxies, yet the connection's address is the one the
    request's own X-Forwarded-For names: the server rewrote it."""
    ex = DefaultKeyExtractor()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _ip(ex, Request("GET", "/", {}, "198.51.100.7"))
        _ip(ex, Request("GET", "/", {"x-forwarded-for": "203.0.113.9"}, "198.51.100.8"))
        assert not caught  # a plain client, and a spoof the server did not act on
        _ip(ex, Request("GET", "/", {"x-forwarded-for": "203.0.113.50"}, "203.0.113.50"))
        _ip(ex, Request("GET", "/", {"x-forwarded-for": "203.0.113.51, 127.0.0.1"}, "203.0.113.51"))
    assert [w.category for w in caught] == [RewrittenClientWarning]
    assert "--no-proxy-headers" in str(caught[0].message)
    other = DefaultKeyExtractor()
    with pytest.warns(RewrittenClientWarning):
        other.storage_key_for(
            Request("GET", "/", {"x-forwarded-for": "[2001:db8::9]:1"}, "2001:db8::9"), KeyScope.IP
        )


def test_no_warning_when_the_header_is_ours_to_read() -> None:
    """A trusted peer's X-Forwarded-For is read by nanolimit: no rewrite."""
    ex = _xff()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _ip(ex, _proxied("10.0.0.1")) == "ip:10.0.0.1"
        assert _ip(ex, _proxied("203.0.113.9")) == "ip:203.0.113.9"


def _limited_app(backend_name: str, trusted: tuple[str, ...] = ()) -> Starlette:
    """A Starlette app behind nanolimit's ASGI middleware: 2 requests per
    minute per IP, on the named twin's store and a frozen clock."""
    import importlib

    from nanolimit._clocks import FakeClock

    twin = importlib.import_module("nanolimit._core" if backend_name == "native" else "nanolimit.reference")

    async def home(request: StarletteRequest) -> PlainTextResponse:
        return PlainTextResponse("home")

    registry = RuleRegistry([rule("site", 2, 60.0)])
    factory = LimiterFactory(twin.InMemoryStorage(), FakeClock(0.0))
    extractor = DefaultKeyExtractor(trusted_proxies=trusted)
    return Starlette(
        routes=[Route("/", home)],
        middleware=[Middleware(RateLimitMiddleware, registry=registry, factory=factory, extractor=extractor)],
    )


def spoof_app() -> Starlette:
    """The uvicorn factory of the subprocess tests (``--factory``)."""
    trusted = tuple(filter(None, os.environ.get("NANOLIMIT_TEST_TRUSTED", "").split(",")))
    return _limited_app(os.environ["NANOLIMIT_TEST_BACKEND"], trusted)


def test_uvicorns_proxy_middleware_in_process_lets_a_local_client_pick_its_key(
    backend: types.SimpleNamespace,
) -> None:
    """uvicorn's own ProxyHeadersMiddleware (what its defaults install) in
    front of the app: a spent local client comes back with a header. The
    extractor cannot undo the rewrite, but it says so."""
    app = ProxyHeadersMiddleware(_limited_app(backend.name), trusted_hosts="127.0.0.1")

    async def calls() -> list[int]:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            spent = [(await http.get("/")).status_code for _ in range(3)]
            spoofed = (await http.get("/", headers={"X-Forwarded-For": "203.0.113.77"})).status_code
            return [*spent, spoofed]

    with pytest.warns(RewrittenClientWarning):
        assert asyncio.run(calls()) == [200, 200, 429, 200]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def uvicorn_server(tmp_path: Path) -> Iterator[Callable[..., tuple[str, Path]]]:
    """Start ``uvicorn`` (the real CLI) on 127.0.0.1 serving ``spoof_app``;
    every server is bounded in time and stopped by its PID."""
    started: list[subprocess.Popen[bytes]] = []

    def start(backend_name: str, *flags: str, trusted: str = "", uds: Path | None = None) -> tuple[str, Path]:
        port = _free_port()
        if uds is not None:
            flags = (*flags, "--uds", str(uds))  # uvicorn binds the socket, not the port
        env = {k: v for k, v in os.environ.items() if k != "FORWARDED_ALLOW_IPS"}  # uvicorn's defaults
        env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(TESTS), env.get("PYTHONPATH", "")])
        env["NANOLIMIT_TEST_BACKEND"] = backend_name
        env["NANOLIMIT_TEST_TRUSTED"] = trusted
        env["PYTHONWARNINGS"] = "default"
        log = tmp_path / f"uvicorn-{port}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, "-m", "uvicorn", "test_adversarial_keys:spoof_app", "--factory",
                 "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                 "--lifespan", "off", *flags],
                env=env, stdout=out, stderr=subprocess.STDOUT, cwd=str(TESTS),
            )  # fmt: skip
        started.append(proc)
        deadline = time.monotonic() + 20.0
        while True:
            assert proc.poll() is None, log.read_text(errors="replace")
            try:
                if uds is None:
                    socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                else:
                    with socket.socket(socket.AF_UNIX) as probe:
                        probe.connect(str(uds))
                break
            except OSError:
                assert time.monotonic() < deadline, "uvicorn did not start"
                time.sleep(0.05)
        return f"http://127.0.0.1:{port}", log

    try:
        yield start
    finally:
        for proc in started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(10.0)
                except subprocess.TimeoutExpired:
                    os.kill(proc.pid, signal.SIGKILL)
                    proc.wait(10.0)


def _spent_then_spoofed(base: str) -> list[int]:
    with httpx.Client(base_url=base, timeout=5.0) as http:
        spent = [http.get("/").status_code for _ in range(3)]
        spoofed = [http.get("/", headers={"X-Forwarded-For": f"203.0.113.{i}"}).status_code for i in (1, 2)]
    return spent + spoofed


def test_real_uvicorn_defaults_let_a_local_client_pick_its_identity(
    backend: types.SimpleNamespace, uvicorn_server: Callable[..., tuple[str, Path]]
) -> None:
    """uvicorn trusts X-Forwarded-For from 127.0.0.1 by default and rewrites
    scope["client"]: a local client whose budget is spent gets a 200 by
    sending the header, and the extractor warns. ``--no-proxy-headers``
    closes it; the same client stays denied and nothing is warned."""
    base, log = uvicorn_server(backend.name)
    assert _spent_then_spoofed(base) == [200, 200, 429, 200, 200]
    base_off, log_off = uvicorn_server(backend.name, "--no-proxy-headers")
    assert _spent_then_spoofed(base_off) == [200, 200, 429, 429, 429]
    deadline = time.monotonic() + 5.0
    while "RewrittenClientWarning" not in log.read_text(errors="replace"):
        assert time.monotonic() < deadline, log.read_text(errors="replace")
        time.sleep(0.05)
    assert "RewrittenClientWarning" not in log_off.read_text(errors="replace")


def test_unix_trusts_a_peerless_connection_and_nothing_else() -> None:
    """``"unix"`` in ``trusted_proxies``: a connection with no peer address
    (a Unix socket) is a trusted hop; a TCP peer outside the networks is
    still its own key, whatever it writes. Without it a peerless request
    is ``unknown``, as before."""
    ex = DefaultKeyExtractor(trusted_proxies=["unix"])
    assert ex.trust_unix and ex.trusted_proxies == () and ex.peer_keys() is None
    two = {"x-forwarded-for": "6.6.6.6, 198.51.100.4"}
    assert _ip(ex, Request("GET", "/", two, None)) == "ip:198.51.100.4"
    assert _ip(ex, Request("GET", "/", {"x-forwarded-for": "198.51.100.5"}, "")) == "ip:198.51.100.5"
    assert _ip(ex, Request("GET", "/", {}, None)) == "ip:unknown"
    assert _ip(ex, Request("GET", "/", {"x-forwarded-for": "junk"}, None)) == "ip:unknown"
    assert _ip(ex, _proxied("198.51.100.6", peer="192.0.2.9")) == "ip:192.0.2.9"  # a TCP client's header
    fwd = DefaultKeyExtractor(trusted_proxies=["unix", "10.0.0.0/8"], forwarded_header="forwarded")
    assert _ip(fwd, Request("GET", "/", {"forwarded": "for=unknown"}, None)) == "ip:unknown@unix"
    chain = {"forwarded": "for=198.51.100.7, for=10.0.0.3"}
    assert _ip(fwd, Request("GET", "/", chain, None)) == "ip:198.51.100.7"
    plain = DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"])
    assert _ip(plain, Request("GET", "/", {"x-forwarded-for": "198.51.100.4"}, None)) == "ip:unknown"
    with pytest.raises(ValidationError, match="trusted_proxies"):
        DefaultKeyExtractor(trusted_proxies=["unix:/run/app.sock"])


def _clients_over(uds: Path) -> list[int]:
    """What a reverse proxy on a Unix socket sends: client A three times,
    then clients B and C once each, each named in X-Forwarded-For."""
    transport = httpx.HTTPTransport(uds=str(uds))
    with httpx.Client(transport=transport, base_url="http://app", timeout=5.0) as http:
        sent = [http.get("/", headers={"X-Forwarded-For": "198.51.100.1"}).status_code for _ in range(3)]
        for other in ("203.0.113.2", "203.0.113.3"):
            sent.append(http.get("/", headers={"X-Forwarded-For": other}).status_code)
    return sent


def test_real_uvicorn_on_a_unix_socket_keys_each_forwarded_client(
    backend: types.SimpleNamespace, uvicorn_server: Callable[..., tuple[str, Path]], tmp_path: Path
) -> None:
    """Behind a reverse proxy on a Unix socket (uvicorn ``--uds``, gunicorn
    ``--bind unix:``) the connection has no address: every client was
    ``ip:unknown``, one budget for the whole site, and no network in
    ``trusted_proxies`` could name the socket (client A spent it, B and C
    got 429). ``"unix"`` trusts the socket: each client its own budget."""
    shared, _ = uvicorn_server(backend.name, "--no-proxy-headers", uds=tmp_path / "shared.sock")
    assert _clients_over(tmp_path / "shared.sock") == [200, 200, 429, 429, 429]
    uvicorn_server(backend.name, "--no-proxy-headers", trusted="unix", uds=tmp_path / "unix.sock")
    assert _clients_over(tmp_path / "unix.sock") == [200, 200, 429, 200, 200]


def test_real_uvicorn_without_proxy_headers_and_nanolimit_trusting_loopback(
    backend: types.SimpleNamespace, uvicorn_server: Callable[..., tuple[str, Path]]
) -> None:
    """The consistent set-up for a local reverse proxy: uvicorn leaves the
    client alone, nanolimit reads the header (strictly) from 127.0.0.1 only.
    Each forwarded client has its own budget and junk is keyed as the proxy."""
    base, _ = uvicorn_server(backend.name, "--no-proxy-headers", trusted="127.0.0.1/32")
    with httpx.Client(base_url=base, timeout=5.0) as http:

        def status(xff: str) -> int:
            return http.get("/", headers={"X-Forwarded-For": xff}).status_code

        assert [status("203.0.113.1") for _ in range(3)] == [200, 200, 429]
        assert status("203.0.113.2") == 200
        assert [status("[2001:db8::1]" + "A" * 4000) for _ in range(3)] == [200, 200, 429]
        assert status("203.0.113.3") == 200


# -- beyond the list -------------------------------------------------------------
SPOOF_HEADERS = {
    "X-Forwarded-For": "203.0.113.1",
    "Forwarded": "for=203.0.113.1",
    "X-Real-IP": "203.0.113.1",
    "True-Client-IP": "203.0.113.1",
    "CF-Connecting-IP": "203.0.113.1",
    "X-Client-IP": "203.0.113.1",
}


@pytest.mark.parametrize("header", sorted(SPOOF_HEADERS))
def test_spoofed_headers_are_ignored_without_trusted_proxies(
    backend: types.SimpleNamespace, header: str
) -> None:
    """Through Starlette, no proxy trusted: no header moves a spent client."""
    app = _limited_app(backend.name)

    async def calls() -> list[int]:
        transport = httpx.ASGITransport(app=app, client=("198.51.100.20", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            spent = [(await http.get("/")).status_code for _ in range(2)]
            return [*spent, (await http.get("/", headers={header: SPOOF_HEADERS[header]})).status_code]

    assert asyncio.run(calls()) == [200, 200, 429]


def test_spoofed_headers_from_an_untrusted_peer_are_ignored() -> None:
    ex = DefaultKeyExtractor(trusted_proxies=["10.0.0.0/8"], forwarded_header="forwarded")
    request = Request(
        "GET", "/", {"forwarded": "for=203.0.113.1", "x-forwarded-for": "203.0.113.1"}, "198.51.100.7"
    )
    assert _ip(ex, request) == "ip:198.51.100.7"


def test_ipv6_rotation_through_a_proxy_stays_one_budget(backend: types.SimpleNamespace) -> None:
    mw = gateway(backend, [rule("per-ip", 3, 60.0)], extractor=_xff())
    forms = [
        "[2001:db8:1:2::1]:1",
        "2001:db8:1:2::ffff",
        "[2001:db8:1:2:abcd:ef01:2345:6789]",
        "2001:db8:1:2::7",
    ]
    assert [mw(get(client=PROXY, x_forwarded_for=f), ok_handler).status for f in forms] == [
        200,
        200,
        200,
        429,
    ]
    assert mw(get(client=PROXY, x_forwarded_for="2001:db8:1:3::1"), ok_handler).status == 200


def test_zone_ids_on_the_peer_do_not_split_a_host() -> None:
    ex = DefaultKeyExtractor(ipv6_prefix=128)
    a = _ip(ex, Request("GET", "/", {}, "fe80::1%eth0"))
    b = _ip(ex, Request("GET", "/", {}, "fe80::1%eth1"))
    assert a == b == "ip:fe80::1"


@pytest.mark.parametrize("prefix", [64, 128])
def test_ipv4_in_ipv6_is_one_identity(backend: types.SimpleNamespace, prefix: int) -> None:
    """A dual-stack host must not hold two budgets (``::ffff:a.b.c.d`` and
    ``a.b.c.d``), and mapped addresses must not fall into one shared ``::/64``.
    6to4 and Teredo carry an IPv4 host too: a 6to4 host owns a /48, 65,536
    /64s, and would otherwise get as many budgets."""
    ex = DefaultKeyExtractor(ipv6_prefix=prefix)
    forms = ["192.0.2.9", "::ffff:192.0.2.9", "::ffff:c000:209", "2002:c000:209::1", "2002:c000:209:ffff::1",
             "2001:0:4136:e378:8000:63bf:3fff:fdf6"]  # fmt: skip
    keys = {_ip(ex, Request("GET", "/", {}, f)) for f in forms[:5]}
    assert keys == {"ip:192.0.2.9"}
    assert _ip(ex, Request("GET", "/", {}, forms[5])) == "ip:192.0.2.9"  # Teredo's client 192.0.2.9
    assert _ip(ex, Request("GET", "/", {}, "::ffff:192.0.2.10")) != _ip(
        ex, Request("GET", "/", {}, "192.0.2.9")
    )
    mw = gateway(backend, [rule("per-ip", 2, 60.0)], extractor=ex)
    assert [mw(get(client=f), ok_handler).status for f in forms[:3]] == [200, 200, 429]


def test_a_mapped_trusted_network_trusts_the_plain_ipv4_peer() -> None:
    ex = DefaultKeyExtractor(trusted_proxies=["::ffff:10.0.0.0/104"])
    assert _ip(ex, _proxied("203.0.113.9")) == "ip:203.0.113.9"
    assert _ip(ex, _proxied("203.0.113.9", peer="::ffff:10.0.0.1")) == "ip:203.0.113.9"


HOSTILE_KEYS = [
    "k" * 1_000_000,  # huge
    "ключ-🔑-" * 40,  # non-ASCII, over 256 UTF-8 bytes
    "ключ",  # non-ASCII, short
    "a\x00b\x1b[31m\r\nX-Injected: 1",  # control characters
    "\udc80\udcff",  # lone surrogates (a custom api_key= may hand them over)
    "   padded   ",
]


@pytest.mark.parametrize("secret", HOSTILE_KEYS, ids=lambda s: repr(s[:12]))
def test_hostile_api_keys_give_bounded_printable_distinct_keys(secret: str) -> None:
    ex = DefaultKeyExtractor(api_key=lambda r: r.headers.get("x-api-key"))
    request = Request("GET", "/", {"x-api-key": secret}, "192.0.2.1")
    key = ex.storage_key_for(request, KeyScope.API_KEY)
    assert key == ex.key_for(request, KeyScope.API_KEY).storage_key()
    assert key.isascii() and key.isprintable() and len(key) <= 64 < MAX_KEY_BYTES
    assert secret not in key
    twin = Request("GET", "/", {"x-api-key": secret + "\x00"}, "192.0.2.1")
    assert ex.storage_key_for(twin, KeyScope.API_KEY) != key  # no normalisation merges two keys
    assert all(len(k) <= 256 for k in ex._secret_cache)


def test_bearer_edge_cases_fall_back_to_the_ip() -> None:
    ex = DefaultKeyExtractor()
    for auth in ("Bearer ", "Bearer \t ", "Basic abc", "Bearerabc"):
        request = Request("GET", "/", {"authorization": auth}, "192.0.2.1")
        assert ex.storage_key_for(request, KeyScope.API_KEY) == "ip:192.0.2.1"
    a = ex.storage_key_for(Request("GET", "/", {"authorization": "bearer T"}, "192.0.2.1"), KeyScope.API_KEY)
    b = ex.storage_key_for(Request("GET", "/", {"x-api-key": " T "}, "192.0.2.2"), KeyScope.API_KEY)
    assert a == b and a.startswith("api_key:")


def test_a_flood_of_distinct_headers_changes_no_key_and_no_cache(backend: types.SimpleNamespace) -> None:
    """Hundreds of distinct, long header names per request, through
    Starlette: the key is still the peer, the budget still one, and the
    extractor keeps nothing of them."""
    ex = DefaultKeyExtractor()
    registry = RuleRegistry([rule("site", 2, 60.0)])
    factory = LimiterFactory(backend.InMemoryStorage(), backend.FakeClock(0.0))

    async def home(request: StarletteRequest) -> PlainTextResponse:
        return PlainTextResponse("home")

    app = Starlette(
        routes=[Route("/", home)],
        middleware=[Middleware(RateLimitMiddleware, registry=registry, factory=factory, extractor=ex)],
    )

    async def calls() -> list[int]:
        transport = httpx.ASGITransport(app=app, client=("198.51.100.30", 1))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as http:
            out = []
            for n in range(3):
                headers = {f"x-junk-{n}-{i}-{'h' * 100}": "v" * 200 for i in range(300)}
                headers["X-Forwarded-For"] = "203.0.113.1"
                out.append((await http.get("/", headers=headers)).status_code)
            return out

    assert asyncio.run(calls()) == [200, 200, 429]
    assert list(ex._ip_keys) == ["198.51.100.30"] and not ex._hops and not ex._secret_cache


_HEADER_TEXT = st.text(alphabet=st.sampled_from(list('0123456789abcdef.:[]%, \t"=;_fortunkw\\')), max_size=80)


@settings(max_examples=300, deadline=None)
@given(xff=_HEADER_TEXT, fwd=_HEADER_TEXT)
def test_any_header_gives_a_bounded_key_from_the_chain(xff: str, fwd: str) -> None:
    """Whatever a header holds: no exception, the two paths agree, the key
    is bounded, and it names either the peer or an address, identifier or
    ``unknown@`` the header itself carried."""
    for ex, name, text in ((_xff(), "x-forwarded-for", xff), (_fwd(), "forwarded", fwd)):
        request = _proxied(text, name)
        key = _ip(ex, request)
        assert len(key.encode()) <= MAX_KEY_BYTES
        client = ex.client_ip(request)
        assert client is not None
        if client != PROXY and not client.startswith("unknown@") and not client.startswith("_"):
            assert ex.ip_value(client) in key
        assert all(len(k) <= 128 for k in ex._hops)


def test_client_key_values_stay_literal_or_digest() -> None:
    assert ClientKey(KeyScope.IP, "unknown@10.0.0.1").storage_key() == "ip:unknown@10.0.0.1"
