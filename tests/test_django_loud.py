"""Django: no limit that silently does nothing, and key functions.

nanolimit installed (``NanolimitConfig``) with its middleware missing from
``MIDDLEWARE`` fails ``manage.py check`` (``nanolimit.E004``; a warning,
``W001``, when nothing is declared yet), and a server that never runs the
checks warns once at its first request. Driven through
``call_command("check")`` and ``django.test.Client`` on the test project
(tests/django_project), configured as test_django_limiter.py does.
"""

from __future__ import annotations

import asyncio
import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import pytest

django = pytest.importorskip("django")

from django.conf import settings  # noqa: E402
from django_project import settings as project  # noqa: E402

PROJECT = {name: getattr(project, name) for name in dir(project) if name.isupper()}
if not settings.configured:
    settings.configure(**PROJECT)
django.setup()

from django.core import checks  # noqa: E402
from django.core.management import call_command  # noqa: E402
from django.core.management.base import SystemCheckError  # noqa: E402
from django.http import HttpRequest, HttpResponse  # noqa: E402
from django.test import AsyncClient, Client, override_settings  # noqa: E402
from django.urls import path  # noqa: E402

import nanolimit.django as nd  # noqa: E402
from nanolimit import InMemoryStorage  # noqa: E402
from nanolimit.errors import UnenforcedLimitWarning  # noqa: E402

OURS = "nanolimit.django.RateLimitMiddleware"
WITHOUT = [m for m in project.MIDDLEWARE if m != OURS]
IP = "192.0.2.10"


class OwnMiddleware(nd.RateLimitMiddleware):
    """A project's subclass of nanolimit's middleware: it counts as installed."""


@pytest.fixture(scope="module", autouse=True)
def project_settings() -> Iterator[None]:
    ours = all(getattr(settings, name, None) == value for name, value in PROJECT.items())
    with contextlib.ExitStack() as stack:
        if not ours:
            stack.enter_context(override_settings(**PROJECT))
        stack.enter_context(override_settings(NANOLIMIT={"STORAGE": InMemoryStorage(), "LOG_DENIALS": None}))
        yield
    nd.reset()


def nanolimit_messages() -> list[Any]:
    return [m for m in checks.run_checks(tags=["nanolimit"]) if m.id.startswith("nanolimit.")]


def unenforced(seen: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in seen if issubclass(w.category, UnenforcedLimitWarning)]


# ---------------------------------------------------------------------------
# The system check


def test_the_project_as_configured_passes_the_check() -> None:
    assert nanolimit_messages() == []
    call_command("check", verbosity=0)


def test_a_missing_middleware_fails_manage_py_check() -> None:
    with override_settings(MIDDLEWARE=WITHOUT):
        [error] = nanolimit_messages()
        assert error.id == "nanolimit.E004" and error.level == checks.ERROR
        assert "django_project.views.hello" in error.msg and OURS in error.msg
        assert OURS in error.hint
        with pytest.raises(SystemCheckError, match=r"nanolimit\.E004"):
            call_command("check", verbosity=0)


def test_settings_rules_without_the_middleware_are_an_error_too() -> None:
    with override_settings(MIDDLEWARE=WITHOUT, ROOT_URLCONF=__name__, NANOLIMIT={"DEFAULT": "100/hour"}):
        [error] = nanolimit_messages()
    assert error.id == "nanolimit.E004" and "NANOLIMIT['DEFAULT']" in error.msg


def test_installed_with_nothing_to_enforce_and_no_middleware_is_a_warning() -> None:
    with override_settings(MIDDLEWARE=WITHOUT, ROOT_URLCONF="django_project.urls_plain"):
        [warning] = nanolimit_messages()
        call_command("check", verbosity=0)  # a warning does not stop the start
    assert warning.id == "nanolimit.W001" and warning.level == checks.WARNING


@pytest.mark.parametrize(
    "middleware",
    [[*WITHOUT, "nanolimit.gateway.django.RateLimitMiddleware"], [*WITHOUT, f"{__name__}.OwnMiddleware"]],
    ids=["adapter path", "subclass"],
)
def test_the_adapter_path_and_a_subclass_count_as_installed(middleware: list[str]) -> None:
    with override_settings(MIDDLEWARE=middleware):
        assert nanolimit_messages() == []


def test_enabled_false_is_off_on_purpose() -> None:
    with override_settings(MIDDLEWARE=WITHOUT, NANOLIMIT={"ENABLED": False}):
        assert nanolimit_messages() == []


# ---------------------------------------------------------------------------
# At the first request: for servers that never run the checks


def test_the_first_request_without_the_middleware_warns_once() -> None:
    with override_settings(MIDDLEWARE=WITHOUT), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        client = Client()
        assert [client.get("/hello", REMOTE_ADDR=IP).status_code for _ in range(5)] == [200] * 5
    [message] = unenforced(seen)
    assert "django_project.views.hello" in message and "not in settings.MIDDLEWARE" in message


def test_the_first_request_with_the_middleware_says_nothing() -> None:
    with (
        override_settings(NANOLIMIT={"STORAGE": InMemoryStorage(), "LOG_DENIALS": None}),
        warnings.catch_warnings(record=True) as seen,
    ):
        warnings.simplefilter("always")
        assert [Client().get("/hello", REMOTE_ADDR=IP).status_code for _ in range(4)] == [200, 200, 200, 429]
    assert unenforced(seen) == []


# ---------------------------------------------------------------------------
# Key functions get the HttpRequest; flask-limiter's spellings name ours

seen_requests: list[Any] = []


def tenant(request: HttpRequest) -> str:
    seen_requests.append(request)
    return request.headers.get("X-Tenant", "anon")


@nd.limit("1/hour", key=tenant)
def by_tenant(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


calls: list[str] = []


def header_or_nothing(request: HttpRequest) -> Any:
    calls.append(request.path)
    return request.headers.get("X-Id")  # None without the header: the app's mistake


@nd.limit("2/hour", key=header_or_nothing)
def by_header(request: HttpRequest) -> HttpResponse:
    return HttpResponse("ok")


urlpatterns = [path("tenant", by_tenant), path("by-header", by_header)]


def test_a_django_key_function_is_handed_the_http_request() -> None:
    seen_requests.clear()
    with override_settings(ROOT_URLCONF=__name__):
        client = Client()
        got = [client.get("/tenant", HTTP_X_TENANT=t, REMOTE_ADDR=IP).status_code for t in "aab"]
    assert got == [200, 429, 200]
    assert len(seen_requests) == 3 and all(isinstance(r, HttpRequest) for r in seen_requests)


def test_flask_limiter_spellings_on_django_limit_name_ours() -> None:
    with pytest.raises(TypeError, match=r"deduct_when=.*use count_when="):
        nd.limit("5/minute", deduct_when=lambda response: True)
    with pytest.raises(TypeError, match=r"key_func=.*use key="):
        nd.shared("5/minute", name="s", key_func=tenant)


def test_a_long_key_is_limited_and_a_bad_one_is_one_error_per_request() -> None:
    calls.clear()
    long = "t" * 300  # a client's header: its length is the client's to choose
    with override_settings(ROOT_URLCONF=__name__, DEBUG_PROPAGATE_EXCEPTIONS=False):
        client = Client(raise_request_exception=False)
        got = [client.get("/by-header", HTTP_X_ID=long, REMOTE_ADDR=IP).status_code for _ in range(3)]
        assert got == [200, 200, 429]
        assert client.get("/by-header", HTTP_X_ID=long[:-1] + "u", REMOTE_ADDR=IP).status_code == 200
        calls.clear()
        assert client.get("/by-header", REMOTE_ADDR=IP).status_code == 500
    assert calls == ["/by-header"]  # decided once: the key function ran once, its error logged once


def test_a_bad_key_is_one_error_per_request_under_the_async_handler_too() -> None:
    """The async handler decided again after Django had answered the key
    function's error: the function ran twice per request and its error
    was logged twice (``['/by-header', '/by-header']``)."""
    calls.clear()

    async def status() -> int:
        client = AsyncClient(raise_request_exception=False)
        return (await client.get("/by-header", REMOTE_ADDR=IP)).status_code

    with override_settings(ROOT_URLCONF=__name__, DEBUG_PROPAGATE_EXCEPTIONS=False):
        assert asyncio.run(status()) == 500
    assert calls == ["/by-header"]
