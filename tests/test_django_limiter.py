"""nanolimit.django under real Django: the test project in tests/django_project
(settings, URLconf, views), driven through ``django.test.Client`` (the sync
handler), ``AsyncClient`` and Django's own ASGI handler (the async one), and
one real gunicorn server on 127.0.0.1.

Django's settings are configured once per process: this module configures
them from django_project.settings (or, when another module configured them
first, applies the project's values with ``override_settings``), and each
test varies ``NANOLIMIT`` with ``override_settings``, which rebuilds the
process's one pipeline. Every test runs on both twins: the store is the
twin's ``InMemoryStorage``, handed over as ``NANOLIMIT["STORAGE"]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

django = pytest.importorskip("django")

from django.conf import settings  # noqa: E402
from django_project import settings as project  # noqa: E402

PROJECT = {name: getattr(project, name) for name in dir(project) if name.isupper()}
if not settings.configured:
    settings.configure(**PROJECT)
django.setup()

from django.contrib.auth.models import User  # noqa: E402
from django.core import checks  # noqa: E402
from django.core.exceptions import ImproperlyConfigured, PermissionDenied  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.test import AsyncClient, Client, override_settings  # noqa: E402
from django_project import views  # noqa: E402

import nanolimit.django as nd  # noqa: E402
from nanolimit.gateway import django as gateway_django  # noqa: E402

pytest_plugins = ["redis_servers"]  # the real Redis of the network-store test

HERE = Path(__file__).resolve().parent
PROJECT_DIR = HERE / "django_project"
SRC = Path(gateway_django.__file__).resolve().parents[2]
IP = "192.0.2.10"


@pytest.fixture(scope="module", autouse=True)
def project_settings() -> Iterator[None]:
    """The project's settings (applied over another module's, if it
    configured Django first), and its tables in the in-memory database."""
    ours = all(getattr(settings, name, None) == value for name, value in PROJECT.items())
    with contextlib.ExitStack() as stack:
        if not ours:
            stack.enter_context(override_settings(**PROJECT))
        call_command("migrate", verbosity=0, interactive=False)
        yield
    nd.reset()


@pytest.fixture
def nano(backend: types.SimpleNamespace) -> Iterator[Callable[..., None]]:
    """``nano(**NANOLIMIT)``: this test's settings, on a fresh store of the
    twin under test (``override_settings`` rebuilds the pipeline)."""
    with contextlib.ExitStack() as stack:

        def configure(**conf: Any) -> None:
            conf.setdefault("STORAGE", backend.InMemoryStorage())
            conf.setdefault("LOG_DENIALS", 0.0)
            stack.enter_context(override_settings(NANOLIMIT=conf))

        configure()
        yield configure
    views.breaches.clear()


def get(client: Client, path: str, ip: str = IP, **extra: Any) -> Any:
    return client.get(path, REMOTE_ADDR=ip, **extra)


def statuses(client: Client, path: str, n: int, ip: str = IP, method: str = "get", **extra: Any) -> list[int]:
    return [getattr(client, method)(path, REMOTE_ADDR=ip, **extra).status_code for _ in range(n)]


# ---------------------------------------------------------------------------
# The declaration forms


def test_function_view_limit_with_headers_and_the_429_body(nano: Any) -> None:
    client = Client()
    first = get(client, "/hello")
    assert first.status_code == 200 and first.content == b"hello"
    assert first["X-RateLimit-Limit"] == "3" and first["X-RateLimit-Remaining"] == "2"
    assert first["RateLimit-Policy"] == '"django_project.views.hello";q=3;w=3600'
    assert "Retry-After" not in first
    assert statuses(client, "/hello", 3) == [200, 200, 429]
    denied = get(client, "/hello")
    assert denied.status_code == 429 and denied["Content-Type"] == "application/json"
    body = json.loads(denied.content)
    assert body["error"] == "rate_limit_exceeded" and body["rule"] == "django_project.views.hello"
    assert int(denied["Retry-After"]) == body["retry_after"] > 0
    assert denied["X-RateLimit-Remaining"] == "0"
    # another client has a budget of its own
    assert get(client, "/hello", ip="192.0.2.99").status_code == 200


def test_class_based_views_declared_on_the_class_and_on_as_view(nano: Any) -> None:
    client = Client()
    assert statuses(client, "/report", 3) == [200, 200, 429]
    assert get(client, "/report").content != b"report"
    assert statuses(client, "/export", 3) == [200, 200, 429]
    names = {r.name for r in nd.pipeline().registry.ruleset.rules}
    assert {"django_project.views.Report", "django_project.views.Export"} <= names


def test_shared_budget_spent_by_two_views(nano: Any) -> None:
    client = Client()
    assert statuses(client, "/search", 2) == [200, 200]
    assert statuses(client, "/search/export", 2) == [200, 429]
    assert get(client, "/search").status_code == 429
    assert json.loads(get(client, "/search").content)["rule"] == "search-budget"


def test_default_limit_applies_where_nothing_is_declared_and_exempt_views_escape_it(nano: Any) -> None:
    nano(DEFAULT="2/hour")
    client = Client()
    assert statuses(client, "/plain", 3) == [200, 200, 429]
    # exempt: a function view and a class-based view, never limited, not even by DEFAULT
    assert statuses(client, "/health", 10) == [200] * 10
    assert statuses(client, "/status", 10) == [200] * 10
    assert statuses(client, "/ping", 10) == [200] * 10
    assert "X-RateLimit-Limit" not in get(client, "/health")
    # a declared view keeps its own limit instead of the default
    assert statuses(client, "/hello", 4) == [200, 200, 200, 429]


def test_default_rate_list_decides_all_or_nothing(nano: Any) -> None:
    nano(DEFAULT=["2/hour", "100/day"])
    client = Client()
    assert statuses(client, "/plain", 3) == [200, 200, 429]
    rules = {r.name: r for r in nd.pipeline().registry.ruleset.rules}
    assert {"default:3600s", "default:86400s"} <= set(rules)


def test_unresolved_paths_spend_the_default_budget(nano: Any) -> None:
    """A 404 from the resolver never reaches a view: decided after it, so a
    flood of unknown paths is limited too."""
    nano(DEFAULT="2/hour")
    client = Client()
    assert [get(client, f"/nowhere/{i}").status_code for i in range(3)] == [404, 404, 429]


def test_rules_file_prefix_rule_and_route_rule(nano: Any) -> None:
    nano(RULES=str(PROJECT_DIR / "rules.toml"))
    client = Client()
    assert statuses(client, "/api/files/abc", 2) == [200, 200]
    assert get(client, "/api/files/xyz").status_code == 429  # one prefix budget
    assert statuses(client, "/plain", 2) == [200, 429]  # the rule naming route "plain"
    assert json.loads(get(client, "/plain").content)["rule"] == "plain-route"
    # declarations stay next to the file's rules
    assert statuses(client, "/hello", 4) == [200, 200, 200, 429]


def test_route_template_ids_share_one_budget(nano: Any) -> None:
    client = Client()
    assert [get(client, f"/api/users/{i}/avatar").status_code for i in (1, 2, 3, 4)] == [200, 200, 200, 429]
    rule = next(r for r in nd.pipeline().registry.ruleset.rules if r.name == "django_project.views.avatar")
    assert rule.routes == ("/api/users/{id:int}/avatar",)


def test_root_view_and_re_path_routes(nano: Any) -> None:
    client = Client()
    assert statuses(client, "/", 3) == [200, 200, 429]
    routes = {r.template for r in nd.routes_of()}
    assert {"/", "hello", "api/users/<int:id>/avatar", "api/files/(?P<name>[a-z]+)$"} <= routes


def test_methods_limit_only_the_declared_method(nano: Any) -> None:
    client = Client()
    assert statuses(client, "/api/items", 2, method="post") == [200, 429]
    assert statuses(client, "/api/items", 5) == [200] * 5


def test_static_cost_and_callable_cost(nano: Any) -> None:
    client = Client()
    assert statuses(client, "/bulk", 3) == [200, 200, 429]  # 4 + 4, then 12 > 10
    assert get(client, "/fanout?n=6").status_code == 200
    assert get(client, "/fanout?n=4").status_code == 200
    assert get(client, "/fanout?n=1").status_code == 429


def test_cost_above_the_limit_answers_429_saying_why(nano: Any) -> None:
    client = Client()
    denied = get(client, "/fanout?n=11")
    assert denied.status_code == 429
    body = json.loads(denied.content)
    assert body["reason"] == "cost_exceeds_limit" and body["cost"] == 11 and body["limit"] == 10
    assert body["retry_after"] is None
    assert get(client, "/fanout?n=10").status_code == 200  # nothing was spent by it


# ---------------------------------------------------------------------------
# Counting by response


def _login(client: Client, password: str, ip: str = IP) -> int:
    body = json.dumps({"password": password})
    return int(client.post("/login", body, content_type="application/json", REMOTE_ADDR=ip).status_code)


def test_failed_logins_only_spend_the_budget(nano: Any) -> None:
    client = Client()
    assert [_login(client, views.PASSWORD) for _ in range(10)] == [200] * 10
    assert [_login(client, "guess") for _ in range(5)] == [401] * 5
    assert _login(client, "guess") == 429
    assert _login(client, views.PASSWORD) == 429  # the budget is spent: no more tries
    # and the headers of an admitted login still go out
    other = client.post("/login", "{}", content_type="application/json", REMOTE_ADDR="192.0.2.77")
    assert other.status_code == 401 and other["X-RateLimit-Limit"] == "5"


def test_a_view_that_raises_is_settled_by_djangos_500(nano: Any) -> None:
    client = Client(raise_request_exception=False)
    assert get(client, "/boom?ok=1").status_code == 200  # not counted: refunded
    assert get(client, "/boom?ok=1").status_code == 200
    assert get(client, "/boom?ok=1").status_code == 200
    assert statuses(client, "/boom", 2) == [500, 500]  # counted
    assert get(client, "/boom?ok=1").status_code == 429


def test_an_exception_that_propagates_is_settled_as_a_500(nano: Any) -> None:
    """DEBUG_PROPAGATE_EXCEPTIONS: Django sends no response; the exception
    leaves through the middleware, which settles it as the 500 it is."""
    with override_settings(DEBUG_PROPAGATE_EXCEPTIONS=True):
        for _ in range(2):
            with pytest.raises(RuntimeError, match="the view failed"):
                get(Client(), "/boom")  # (a client keeps a propagated exception: one each)
    assert get(Client(), "/boom?ok=1").status_code == 429  # both counted


def test_a_permission_denied_view_is_settled_by_its_403(nano: Any) -> None:
    client = Client()
    assert statuses(client, "/login", 5, method="post", data={"deny": "1"}) == [403] * 5
    assert _login(client, views.PASSWORD) == 429  # the five 403s spent the budget


# ---------------------------------------------------------------------------
# Denials the app controls


def test_headers_off(nano: Any) -> None:
    nano(HEADERS=False)
    client = Client()
    ok = get(client, "/hello")
    assert ok.status_code == 200 and not [h for h in ok.headers if "ratelimit" in h.lower()]
    statuses(client, "/hello", 2)
    denied = get(client, "/hello")
    assert denied.status_code == 429 and int(denied["Retry-After"]) > 0
    assert not [h for h in denied.headers if "ratelimit" in h.lower()]


def test_renamed_headers(nano: Any) -> None:
    nano(HEADER_NAMES={"X-RateLimit-Limit": "X-Limit", "Retry-After": "X-Retry-In"})
    client = Client()
    ok = get(client, "/hello")
    assert ok["X-Limit"] == "3" and "X-RateLimit-Limit" not in ok
    statuses(client, "/hello", 2)
    denied = get(client, "/hello")
    assert int(denied["X-Retry-In"]) > 0 and "Retry-After" not in denied


def test_breach_hook_and_denial_log(nano: Any, caplog: pytest.LogCaptureFixture) -> None:
    nano(ON_BREACH="django_project.views.on_breach")
    client = Client()
    with caplog.at_level(logging.WARNING, logger="nanolimit.denials"):
        statuses(client, "/hello", 5)
    assert views.breaches == [("django_project.views.hello", "GET", "hello", None)] * 2
    records = [r for r in caplog.records if r.name == "nanolimit.denials"]
    assert len(records) == 2 and records[0].rule == "django_project.views.hello"  # type: ignore[attr-defined]
    assert "path='/hello'" in records[0].getMessage()


def test_django_request_does_not_log_each_429_of_a_flood_again(
    nano: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """nanolimit's denial log has the flood (one record per rule per
    interval); django.request still logs the 4xx answers that are not ours."""
    nano(LOG_DENIALS=3600.0)
    client = Client()
    with caplog.at_level(logging.WARNING):
        assert statuses(client, "/hello", 6) == [200] * 3 + [429] * 3
        assert get(client, "/no-such-page").status_code == 404
    ours = [r for r in caplog.records if r.name == "nanolimit.denials"]
    django_request = [r.getMessage() for r in caplog.records if r.name == "django.request"]
    assert len(ours) == 1
    assert django_request == ["Not Found: /no-such-page"]


def test_log_denials_none_writes_no_records(nano: Any, caplog: pytest.LogCaptureFixture) -> None:
    nano(LOG_DENIALS=None)
    with caplog.at_level(logging.WARNING, logger="nanolimit.denials"):
        assert statuses(Client(), "/hello", 4)[-1] == 429
    assert not [r for r in caplog.records if r.name == "nanolimit.denials"]


def test_deny_callable_answers_the_denial(nano: Any) -> None:
    nano(DENY="django_project.views.deny")
    client = Client()
    statuses(client, "/hello", 3)
    denied = get(client, "/hello")
    assert denied.status_code == 429 and denied.content == b"slow down (django_project.views.hello)"
    assert denied["Content-Type"] == "text/plain" and int(denied["Retry-After"]) > 0


def test_raise_hands_the_denial_to_handler403(nano: Any) -> None:
    nano(RAISE=True)
    client = Client()
    assert statuses(client, "/hello", 3) == [200] * 3
    denied = get(client, "/hello")
    assert denied.status_code == 403
    assert denied.content == b"custom 403: rate limit exceeded: rule 'django_project.views.hello'"
    assert int(denied["Retry-After"]) > 0  # still says when to come back
    assert issubclass(nd.Ratelimited, PermissionDenied)


def test_enabled_false_takes_the_middleware_out(nano: Any) -> None:
    nano(ENABLED=False)
    assert statuses(Client(), "/hello", 6) == [200] * 6


# ---------------------------------------------------------------------------
# The user scope: Django's auth


def test_request_user_is_the_user_scope(nano: Any) -> None:
    nano(ON_BREACH="django_project.views.on_breach")
    alice = User.objects.create_user("alice", password="pw-alice")
    bob = User.objects.create_user("bob", password="pw-bob")
    try:
        a, b, anon = Client(), Client(), Client()
        a.force_login(alice)
        b.force_login(bob)
        # the same address, three budgets: two users and the address itself
        assert [get(a, "/me").content for _ in range(2)] == [b"alice"] * 2
        assert get(a, "/me").status_code == 429
        assert statuses(b, "/me", 3) == [200, 200, 429]
        assert statuses(anon, "/me", 3) == [200, 200, 429]
        # the user is request.user.pk; an anonymous client spends its address's budget
        assert [u for *_, u in views.breaches] == [str(alice.pk), str(bob.pk), None]
        # a header naming a user is not a user
        assert get(Client(), "/me", ip="192.0.2.55", HTTP_X_USER=str(alice.pk)).status_code == 200
        assert get(Client(), "/me", ip="192.0.2.55", HTTP_REMOTE_USER=str(alice.pk)).status_code == 200
        assert get(Client(), "/me", ip="192.0.2.55").status_code == 429
    finally:
        User.objects.filter(username__in=("alice", "bob")).delete()


def test_async_client_user_scope(nano: Any) -> None:
    carol = User.objects.create_user("carol", password="pw-carol")
    try:

        async def run() -> list[int]:
            client = AsyncClient()
            await client.aforce_login(carol)
            return [(await client.get("/me", REMOTE_ADDR=IP)).status_code for _ in range(3)]

        assert asyncio.run(run()) == [200, 200, 429]
    finally:
        carol.delete()


# ---------------------------------------------------------------------------
# The async handler


def test_async_client_decides_in_line_on_memory_stores(nano: Any) -> None:
    async def run() -> list[Any]:
        client = AsyncClient()
        out = [await client.get("/ahello", REMOTE_ADDR=IP) for _ in range(4)]
        out.append(await client.get("/hello", REMOTE_ADDR=IP))
        return out

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200, 200, 200, 429, 200]
    assert responses[0]["X-RateLimit-Remaining"] == "2"
    assert json.loads(responses[3].content)["rule"] == "django_project.views.ahello"
    assert not gateway_django._state().network


def test_async_failed_logins_and_raise(nano: Any) -> None:
    async def logins() -> list[int]:
        client = AsyncClient()
        out = []
        for password in [views.PASSWORD] * 3 + ["x"] * 6:
            r = await client.post(
                "/login", json.dumps({"password": password}), content_type="application/json", REMOTE_ADDR=IP
            )
            out.append(r.status_code)
        return out

    assert asyncio.run(logins()) == [200] * 3 + [401] * 5 + [429]
    nano(RAISE=True)

    async def raised() -> list[int]:
        client = AsyncClient()
        return [(await client.get("/ahello", REMOTE_ADDR=IP)).status_code for _ in range(4)]

    assert asyncio.run(raised()) == [200, 200, 200, 403]


def test_djangos_asgi_application(nano: Any) -> None:
    """Django's own ASGI handler (``get_asgi_application()``), driven as an
    ASGI server drives it: the client address comes from the scope."""
    httpx = pytest.importorskip("httpx")
    from django.core.asgi import get_asgi_application

    app = get_asgi_application()

    async def run() -> list[Any]:
        transport = httpx.ASGITransport(app=app, client=("192.0.2.200", 5000))
        async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
            return [await client.get("/api/users/7/avatar") for _ in range(4)]

    responses = asyncio.run(run())
    assert [r.status_code for r in responses] == [200, 200, 200, 429]
    assert responses[0].headers["x-ratelimit-limit"] == "3"
    assert responses[3].json()["rule"] == "django_project.views.avatar"


def test_network_store_is_called_off_the_event_loop(redis_server: Any) -> None:
    """On Redis the async path decides in a worker thread
    (``sync_to_async(thread_sensitive=False)``): the event loop's thread
    never waits on the store's socket. On a real Redis server."""
    pytest.importorskip("redis")
    with override_settings(NANOLIMIT={"STORAGE": f"redis://127.0.0.1:{redis_server.port}/0"}):
        live = gateway_django._state()
        assert live.network
        threads: list[int] = []
        check = live.core.check

        def spy(request: Any) -> Any:
            threads.append(threading.get_ident())
            return check(request)

        async def run() -> tuple[list[int], int]:
            client = AsyncClient()
            out = [(await client.get("/ahello", REMOTE_ADDR=IP)).status_code for _ in range(4)]
            out += [
                (
                    await client.post("/login", "{}", content_type="application/json", REMOTE_ADDR=IP)
                ).status_code
                for _ in range(6)
            ]
            return out, threading.get_ident()

        live.core.check = spy  # type: ignore[method-assign]
        codes, loop_thread = asyncio.run(run())
        assert codes == [200, 200, 200, 429] + [401] * 5 + [429]
        assert len(threads) == 10 and loop_thread not in threads


# ---------------------------------------------------------------------------
# Settings and the system check


def test_unknown_settings_key_is_improperly_configured(nano: Any) -> None:
    nano(STORGE="memory://")
    with pytest.raises(ImproperlyConfigured, match=r"'STORGE'.*accepted: RULES, STORAGE, DEFAULT"):
        Client().get("/hello")
    errors = checks.run_checks(tags=["nanolimit"])
    assert [e.id for e in errors] == ["nanolimit.E001"] and "STORGE" in errors[0].msg


@pytest.mark.parametrize(
    ("conf", "named"),
    [
        ({"SCOPE": "tenant"}, "SCOPE"),
        ({"ALGORITHM": "sliding-window"}, "ALGORITHM"),
        ({"DEFAULT": "5 per fortnight"}, "DEFAULT"),
        ({"HEADERS": "yes"}, "HEADERS"),
        ({"DENY": "django_project.views.nothing_here"}, "DENY"),
        ({"DENY": "django_project.views.deny", "RAISE": True}, "RAISE"),
        ({"TRUSTED_PROXIES": "10.0.0.0/8"}, "TRUSTED_PROXIES"),
        ({"LOG_DENIALS": -1}, "LOG_DENIALS"),
        ({"RULES": "/nonexistent/rules.toml"}, "RULES"),
        ({"STORAGE": "nosuch://x"}, "STORAGE"),
        ({"HEADER_NAMES": {"X-Unknown": "X-Other"}}, "HEADER_NAMES"),
        ({"LIMITS": "django_project.views.hello"}, "LIMITS"),
        ({"DEFAULT": ["5/minute", "bogus"]}, "DEFAULT"),
        ({"DEFAULT": 5}, "DEFAULT"),
    ],
)
def test_bad_setting_values_are_improperly_configured(nano: Any, conf: dict[str, Any], named: str) -> None:
    before = nd.limits.registry.ruleset
    nano(**conf)
    with pytest.raises(ImproperlyConfigured, match=rf"NANOLIMIT\['{named}'\]"):
        Client().get("/hello")
    assert nd.limits.registry.ruleset is before  # a bad setting changes nothing


@pytest.mark.parametrize(
    "storage",
    [("redis://app:Pw7QzX9kJ@h/0",), ["redis://app:Pw7QzX9kJ@h/0"], b"redis://app:Pw7QzX9kJ@h/0"],
    ids=["trailing-comma-tuple", "list", "bytes"],
)
def test_a_storage_setting_of_the_wrong_type_never_echoes_its_password(nano: Any, storage: Any) -> None:
    """``STORAGE = "redis://app:PASSWORD@h/0",`` (a trailing comma makes a
    tuple) was refused with ``got ('redis://app:PASSWORD@h/0',)``: the
    password in the exception, the system check and the server's log."""
    nano(STORAGE=storage)
    with pytest.raises(ImproperlyConfigured, match=r"NANOLIMIT\['STORAGE'\]") as caught:
        Client().get("/hello")
    assert "Pw7QzX9kJ" not in str(caught.value) and type(storage).__name__ in str(caught.value)
    errors = checks.run_checks(tags=["nanolimit"])
    assert errors and all("Pw7QzX9kJ" not in e.msg for e in errors)


def test_system_check_catches_a_template_matching_no_route(nano: Any) -> None:
    assert checks.run_checks(tags=["nanolimit"]) == []
    nano(RULES=str(PROJECT_DIR / "rules_bad_route.toml"))
    errors = checks.run_checks(tags=["nanolimit"])
    assert [e.id for e in errors] == ["nanolimit.E002"]
    assert "avatar-typo" in errors[0].msg and "avatr" in errors[0].msg and errors[0].obj == "avatar-typo"
    # and every request fails loudly rather than limiting nothing
    with pytest.raises(Exception, match="matches no route"):
        Client().get("/hello")


def test_system_check_catches_a_bad_declaration(nano: Any) -> None:
    with override_settings(ROOT_URLCONF="django_project.urls_bad"):
        errors = checks.run_checks(tags=["nanolimit"])
    assert [e.id for e in errors] == ["nanolimit.E003"] and "'dup'" in errors[0].msg


def test_a_limit_on_a_handler_method_of_a_class_based_view_is_refused(nano: Any) -> None:
    """``@method_decorator(limit(...))`` on ``def get`` (django-ratelimit's
    idiom) marks a method nanolimit never reads: the view answered
    200, 200, 200 unlimited. It is an error of the system check, and every
    request fails loudly rather than limiting nothing."""
    with override_settings(ROOT_URLCONF="django_project.urls_methods"):
        errors = checks.run_checks(tags=["nanolimit"])
        assert [e.id for e in errors] == ["nanolimit.E003"]
        assert "OnGet.get" in errors[0].msg and "methods=['GET']" in errors[0].msg
        with pytest.raises(Exception, match="class-based view"):
            Client().get("/onget", REMOTE_ADDR=IP)


def test_manage_py_check_fails_at_startup_on_a_bad_template(tmp_path: Path) -> None:
    """``django-admin check`` in a fresh process: the app entry registers
    the check before Django runs it."""
    settings_module = tmp_path / "bad_settings.py"
    settings_module.write_text(
        "from django_project.settings import *  # noqa\n"
        f"NANOLIMIT = {{'RULES': {str(PROJECT_DIR / 'rules_bad_route.toml')!r}}}\n"
    )
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="bad_settings")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE), str(tmp_path)])
    run = subprocess.run(
        ["timeout", "60", sys.executable, "-m", "django", "check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert run.returncode != 0
    assert "nanolimit.E002" in run.stderr and "avatar-typo" in run.stderr
    env["DJANGO_SETTINGS_MODULE"] = "django_project.settings"
    ok = subprocess.run(
        ["timeout", "60", sys.executable, "-m", "django", "check"],
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert ok.returncode == 0, ok.stderr


def test_the_documented_path_is_a_facade_and_names_the_middleware() -> None:
    assert nd.RateLimitMiddleware is gateway_django.RateLimitMiddleware
    assert nd.__all__ == gateway_django.__all__
    assert settings.MIDDLEWARE[1] == "nanolimit.django.RateLimitMiddleware"
    assert nd.RateLimitMiddleware.sync_capable and nd.RateLimitMiddleware.async_capable


# ---------------------------------------------------------------------------
# One real server: gunicorn, failed logins from 8 threads

THREADS = 8
ATTEMPTS = 12  # per thread: 96 tries at a budget of 5
LIFETIME = 90  # seconds `timeout` lets the server live, whatever the test does


def _post(port: int, path: str, body: bytes) -> tuple[int, dict[str, str]]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.request("POST", path, body, {"Content-Type": "application/json", "Connection": "close"})
        response = conn.getresponse()
        response.read()
        return response.status, {k.lower(): v for k, v in response.getheaders()}
    finally:
        conn.close()


def _raw(port: int, method: str, path: str) -> tuple[int, list[str]]:
    """One request sent as written (no client normalises the path): the
    status and the header names on the wire, repeats kept."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        conn.putheader("Connection", "close")
        conn.endheaders()
        response = conn.getresponse()
        response.read()
        return response.status, [k.lower() for k, _ in response.getheaders()]
    finally:
        conn.close()


def _wait_healthy(port: int, proc: subprocess.Popen[bytes], deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError("gunicorn exited before it served")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/health")
            if conn.getresponse().status == 200:
                return
        except OSError:
            time.sleep(0.1)
        finally:
            conn.close()
    raise RuntimeError("gunicorn never answered /health")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()  # `timeout` forwards it to gunicorn
        try:
            proc.wait(15.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session
            proc.wait(10.0)


def test_gunicorn_never_admits_more_failed_logins_than_the_budget(tmp_path: Path) -> None:
    pytest.importorskip("gunicorn")
    from adversarial_servers import free_port

    port = free_port()
    env = dict(os.environ, DJANGO_SETTINGS_MODULE="django_project.settings")
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(HERE)])
    log = tmp_path / "gunicorn.log"
    argv = ["timeout", str(LIFETIME), sys.executable, "-m", "gunicorn", "-w", "1", "-k", "gthread"]
    argv += ["--threads", str(THREADS), "-b", f"127.0.0.1:{port}", "--timeout", "30"]
    argv += ["--graceful-timeout", "3", "--log-level", "warning", "django_project.wsgi:application"]
    with log.open("wb") as err:
        proc = subprocess.Popen(
            argv,
            cwd=str(HERE),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    try:
        _wait_healthy(port, proc, time.monotonic() + 30)
        tally: Counter[int] = Counter()
        pids: set[str] = set()
        errors: list[str] = []
        lock = threading.Lock()
        barrier = threading.Barrier(THREADS)

        def attacker(i: int) -> None:
            barrier.wait(10)
            for n in range(ATTEMPTS):
                # every third try is the right password: those must not spend
                password = views.PASSWORD if n % 3 == 0 else f"guess-{i}-{n}"
                try:
                    status, headers = _post(port, "/login", json.dumps({"password": password}).encode())
                except OSError as exc:
                    with lock:
                        errors.append(repr(exc))
                    continue
                with lock:
                    tally[status] += 1
                    if "x-worker-pid" in headers:
                        pids.add(headers["x-worker-pid"])

        threads = [threading.Thread(target=attacker, args=(i,), daemon=True) for i in range(THREADS)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors[:3]
        assert sum(tally.values()) == THREADS * ATTEMPTS, tally
        assert set(tally) <= {200, 401, 429}, (tally, log.read_text(errors="replace")[-2000:])
        assert 1 <= tally[401] <= 5, tally  # never more failed logins than the budget
        assert tally[429] > 0 and len(pids) == 1
        print(f"\ndjango-gunicorn: {json.dumps({str(k): v for k, v in sorted(tally.items())})}")
        # on the wire: odd spellings of /hello are 404s with no headers and
        # spend nothing; HEAD spends its budget; each header is sent once
        rate = [h.lower() for h in RATE]
        for probe in ("//hello", "/hello/", "/%68ello/", "/hello%00"):
            status, names = _raw(port, "GET", probe)
            assert status == 404 and not set(names) & {*rate, "retry-after"}, (probe, names)
        answers = [_raw(port, "HEAD", "/hello") for _ in range(4)]
        assert [status for status, _ in answers] == [200, 200, 200, 429]
        assert [[n for n in names if n in rate] for _, names in answers] == [rate] * 4
        assert answers[3][1].count("retry-after") == 1
    finally:
        _stop(proc)


def test_scope_and_algorithm_settings_are_the_declarations_defaults(nano: Any) -> None:
    nano(SCOPE="user", ALGORITHM="fixed-window")
    declared = nd.limit("1/hour")
    assert declared.scope.value == "user" and declared.algorithm.value == "fixed_window"
    assert nd.limit("1/hour", scope="ip").scope.value == "ip"
    nano(DEFAULT="1/hour", SCOPE="api_key")
    assert nd.pipeline().registry.ruleset.default.scope.value == "api_key"  # type: ignore[union-attr]


# ---------------------------------------------------------------------------
# Attacks: an exemption of one route, a probe before the victim


@pytest.mark.parametrize("probe", ["/items/abc", "/items/-1", "/items/1/", "/nope", "/items/" + "9" * 20])
def test_an_exempt_route_never_exempts_another_of_its_shape(nano: Any, probe: str) -> None:
    """``items/<slug:name>`` exempt and ``items/<int:item_id>`` limited are
    two routes: whatever another client sends first, the limited view
    denies its third request and the exempt one never does."""
    with override_settings(ROOT_URLCONF="django_project.urls_attack"):
        client = Client()
        get(client, probe, ip="192.0.2.77")
        assert statuses(client, "/items/1", 3) == [200, 200, 429]
        assert statuses(client, "/items/abc", 5) == [200] * 5
        rules = nd.pipeline().registry.rules()
        assert [r.routes for r in rules] == [("/items/{item_id:int}",), ("/slashed/",)]


# ---------------------------------------------------------------------------
# Probes: methods, HEAD, 404 and 405, slashes, odd paths, a per-request URLconf

RATE = ("X-RateLimit-Limit", "X-RateLimit-Remaining", "X-RateLimit-Reset", "RateLimit-Policy", "RateLimit")


def _rate_headers(response: Any) -> list[str]:
    """The rate-limit headers as the handler hands them to the server (each
    name once: a header written twice would be sent twice)."""
    names = [name for name, _ in response.items()]
    return [name for name in names if name in (*RATE, "Retry-After")]


def test_an_admitted_and_a_denied_answer_carry_each_header_once(nano: Any) -> None:
    client = Client()
    first = get(client, "/hello")
    assert _rate_headers(first) == list(RATE)
    assert first["X-RateLimit-Remaining"] == "2" and first["RateLimit"].startswith(
        '"django_project.views.hello";r=2'
    )
    assert first["Content-Type"] == "text/plain" and first["X-Worker-Pid"]  # the view's own headers stay
    statuses(client, "/hello", 2)
    denied = get(client, "/hello")
    assert _rate_headers(denied) == [*RATE, "Retry-After"]
    assert denied["Content-Type"] == "application/json" and "X-Worker-Pid" not in denied
    assert json.loads(denied.content)["retry_after"] == int(denied["Retry-After"])


def test_head_and_other_methods_spend_the_views_budget(nano: Any) -> None:
    """HEAD is a request like GET to a view that takes every method: an
    attacker cannot probe past the limit with it, and its 429 still says
    when to come back."""
    client = Client()
    assert [client.head("/hello", REMOTE_ADDR=IP).status_code for _ in range(2)] == [200, 200]
    assert get(client, "/hello").status_code == 200
    denied = client.head("/hello", REMOTE_ADDR=IP)
    assert denied.status_code == 429 and int(denied["Retry-After"]) > 0
    assert statuses(client, "/hello", 2, method="options") == [429, 429]


def test_a_method_the_view_refuses_is_a_405_that_spends_its_budget(nano: Any) -> None:
    """The class-based view answers POST with 405 itself: the request
    reached the view, so it is decided there and spends the view's budget."""
    client = Client()
    refused = client.post("/report", REMOTE_ADDR=IP)
    assert refused.status_code == 405 and refused["X-RateLimit-Remaining"] == "1"
    assert statuses(client, "/report", 2, method="post") == [405, 429]
    assert get(client, "/report").status_code == 429


@pytest.mark.parametrize("probe", ["/hello/", "/hello//", "/hello%2f", "/HELLO", "/h%C3%A9llo", "/hello;x"])
def test_odd_spellings_of_a_path_are_404s_that_spend_only_the_default(nano: Any, probe: str) -> None:
    """Spellings of ``/hello`` Django does not route to it are 404s: with no
    DEFAULT they are unlimited and carry no headers, and they never spend
    (nor reset) the view's budget; under a DEFAULT they spend it."""
    client = Client()
    assert statuses(client, probe, 5) == [404] * 5
    assert "X-RateLimit-Limit" not in get(client, probe)
    assert statuses(client, "/hello", 4) == [200, 200, 200, 429]
    assert statuses(client, "/hello?x=1", 1) == [429]  # the query is not the path
    nano(DEFAULT="2/hour")
    assert statuses(client, probe, 3) == [404, 404, 429]


def test_append_slash_redirects_never_spend_the_views_budget(nano: Any) -> None:
    """``/slashed`` is redirected to ``slashed/`` by CommonMiddleware before
    any view: decided after that response (DEFAULT only), so a flood of
    redirects neither spends nor escapes the view's own limit."""
    middleware = ["django.middleware.common.CommonMiddleware", *project.MIDDLEWARE]
    with override_settings(
        ROOT_URLCONF="django_project.urls_attack", MIDDLEWARE=middleware, APPEND_SLASH=True
    ):
        client = Client()
        assert statuses(client, "/slashed", 4) == [301] * 4
        assert statuses(client, "/slashed/", 3) == [200, 200, 429]
        nano(DEFAULT="2/hour")
        assert statuses(client, "/slashed", 3) == [301, 301, 429]
        assert statuses(client, "/slashed/", 3) == [200, 200, 429]  # its own limit, not DEFAULT's


def test_every_language_prefix_of_i18n_patterns_spends_the_views_budget(nano: Any) -> None:
    """Under ``i18n_patterns`` the route Django reports carries the prefix
    of the language the request activated (``fr/quota``): a limit bound to
    the default language's spelling alone let ``/fr/quota`` and
    ``/de/quota`` through unlimited. Each prefix is the same view and
    spends its one budget; so does the unprefixed default language."""
    middleware = [project.MIDDLEWARE[0], "django.middleware.locale.LocaleMiddleware", *project.MIDDLEWARE[1:]]
    languages = [("en", "English"), ("fr", "French"), ("de", "German")]
    with override_settings(
        ROOT_URLCONF="django_project.urls_i18n",
        MIDDLEWARE=middleware,
        USE_I18N=True,
        LANGUAGE_CODE="en",
        LANGUAGES=languages,
    ):
        client = Client()
        assert statuses(client, "/en/quota", 2) == [200, 200]
        assert statuses(client, "/fr/quota", 2) == [429, 429]
        assert statuses(client, "/de/quota", 2) == [429, 429]
        assert statuses(client, "/fr/plain", 1) == [429]  # the same view, unprefixed in English
        assert statuses(client, "/en/quota", 1, ip="192.0.2.11") == [200]  # still per client
        assert statuses(client, "/plain", 2, ip="192.0.2.11") == [200, 429]


def test_a_middleware_answering_before_the_view_still_spends_the_views_limit(nano: Any) -> None:
    """A middleware after nanolimit's (an API-key check) answers 401 itself,
    so ``process_view`` never runs: the request used to be decided with no
    route, by ``DEFAULT`` alone, and failed logins through it ran
    unlimited (eight 401s past ``5/hour, count_when={401}``). Its path is
    resolved now, and the view's limit decides it, as it would decide the
    view's own answers."""
    middleware = [*project.MIDDLEWARE, "django_project.middleware.ApiKeyGate"]
    with override_settings(MIDDLEWARE=middleware):
        client = Client()
        failed = statuses(client, "/login", 7, method="post", data="{}", content_type="application/json")
        assert failed == [401] * 5 + [429] * 2
        assert statuses(client, "/hello", 4) == [401, 401, 401, 429]
        assert statuses(client, "/nope", 4) == [401] * 4  # no view: no view's limit (and no DEFAULT)
        assert statuses(client, "/health", 5) == [401] * 5  # exempt
        good = {"HTTP_X_API_KEY": "good"}
        assert statuses(client, "/hello", 2, ip="192.0.2.11", **good) == [200, 200]

        async def run() -> list[int]:  # Django's async handler: the same
            aclient = AsyncClient()
            return [(await aclient.get("/hello", REMOTE_ADDR="192.0.2.12")).status_code for _ in range(4)]

        assert asyncio.run(run()) == [401, 401, 401, 429]
    # listed before nanolimit's, the gate's answers never reach it (docs/django.md)
    with override_settings(MIDDLEWARE=["django_project.middleware.ApiKeyGate", *project.MIDDLEWARE]):
        assert statuses(Client(), "/hello", 5, ip="192.0.2.13") == [401] * 5


def test_a_class_routed_by_two_as_view_calls_is_one_view_with_one_budget(nano: Any) -> None:
    """``path("r1", Report.as_view())`` and ``path("r2", Report.as_view())``
    (a list and a detail URL): each ``as_view()`` is a new function, so the
    class's limit became two rules of one name, and every request failed
    with a 500 (``two rules share this name``). The class is the view: its
    routes share its one budget, as a function's do."""
    with override_settings(ROOT_URLCONF="django_project.urls_twice"):
        assert checks.run_checks(tags=["nanolimit"]) == []
        client = Client()
        assert statuses(client, "/r1", 2) + statuses(client, "/r2", 1) == [200, 200, 429]


def test_a_limit_on_a_drf_viewset_is_enforced(nano: Any) -> None:
    """DRF's ``ViewSet.as_view(actions)`` names its class ``cls``, not
    ``view_class``: a ``@limit`` on the ViewSet bound to nothing and the
    list answered 200, 200, 200. An ``APIView`` (``view_class`` set) was
    limited already."""
    with override_settings(
        ROOT_URLCONF="django_project.urls_drf", INSTALLED_APPS=[*project.INSTALLED_APPS, "rest_framework"]
    ):
        client = Client()
        assert statuses(client, "/items", 3) == [200, 200, 429]
        assert statuses(client, "/things", 2) + statuses(client, "/things/1", 1) == [200, 200, 429]
    with override_settings(ROOT_URLCONF="django_project.urls_drf_listed"):  # a limit on an action: refused
        errors = checks.run_checks(tags=["nanolimit"])
        assert [e.id for e in errors] == ["nanolimit.E003"] and "Listed.list" in errors[0].msg
        assert "methods=['GET']" in errors[0].msg


def test_a_per_request_urlconf_never_poisons_the_root_urlconfs_limits(nano: Any) -> None:
    """A middleware routing some requests by another URLconf: ``/hello``
    there is a 404 (no route), ``/items/1`` a route the root lacks. Neither
    changes what the root's ``/hello`` answers, whatever comes first."""
    middleware = ["django_project.middleware.PerRequestUrlconf", *project.MIDDLEWARE]
    with override_settings(MIDDLEWARE=middleware):
        client = Client()
        other = {"HTTP_X_URLCONF": "attack"}
        assert statuses(client, "/hello", 3, **other) == [404] * 3
        # bound to ROOT_URLCONF's routes only: the other URLconf's route is unlimited (docs/django.md)
        assert statuses(client, "/items/1", 3, **other) == [200] * 3
        assert statuses(client, "/hello", 4) == [200, 200, 200, 429]
        assert statuses(client, "/hello", 2, **other) == [404, 404]  # still not the root's view
        assert get(client, "/hello", **other).content != b"hello"


def test_async_views_get_the_same_headers_and_429(nano: Any) -> None:
    async def run() -> list[Any]:
        client = AsyncClient()
        return [await client.get("/ahello", REMOTE_ADDR=IP) for _ in range(4)]

    replies = asyncio.run(run())
    assert [r.status_code for r in replies] == [200, 200, 200, 429]
    assert _rate_headers(replies[0]) == list(RATE) and _rate_headers(replies[3]) == [*RATE, "Retry-After"]


def test_the_middleware_decides_through_the_pipelines_public_decide(
    nano: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway_helpers import audit_decisions

    log = audit_decisions(monkeypatch)
    assert statuses(Client(), "/hello", 4) == [200, 200, 200, 429]
    assert log == [True, True, True, False]
