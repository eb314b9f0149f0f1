"""Views declaring limits in every form nanolimit.django offers."""

from __future__ import annotations

import json
import os
from typing import Any

from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse, JsonResponse
from django.views import View

from nanolimit.django import exempt, limit, shared

PASSWORD = "correct horse"


def _pid(response: HttpResponse) -> HttpResponse:
    response["X-Worker-Pid"] = str(os.getpid())
    return response


@limit("2/hour")
def index(request: HttpRequest) -> HttpResponse:
    """The root view: route "" (template "/")."""
    return HttpResponse("index")


@limit("3/hour")
def hello(request: HttpRequest) -> HttpResponse:
    return _pid(HttpResponse("hello", content_type="text/plain"))


@limit("3/hour")
async def ahello(request: HttpRequest) -> HttpResponse:
    return HttpResponse("async hello", content_type="text/plain")


@limit("2/hour")
class Report(View):
    """Declared on the class."""

    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("report")


class Export(View):
    """Declared on ``as_view()``, in urls.py."""

    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("export")


search_budget = shared("3/hour", name="search-budget")


@search_budget
def search(request: HttpRequest) -> HttpResponse:
    return HttpResponse("search")


@search_budget
def search_export(request: HttpRequest) -> HttpResponse:
    return HttpResponse("search export")


@exempt
def health(request: HttpRequest) -> HttpResponse:
    return _pid(JsonResponse({"pid": os.getpid()}))


@exempt
class Status(View):
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("status")


class Ping(View):
    """Exempted on ``as_view()``, in urls.py."""

    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("pong")


def plain(request: HttpRequest) -> HttpResponse:
    """No declaration: DEFAULT, or the rules file, decides."""
    return HttpResponse("plain")


def files(request: HttpRequest, name: str) -> HttpResponse:
    """A re_path route; the rules file's prefix rule covers it."""
    return HttpResponse(f"file {name}")


@limit("3/hour")
def avatar(request: HttpRequest, id: int) -> HttpResponse:
    return HttpResponse(f"avatar {id}")


@limit("1/hour", methods="POST")
def items(request: HttpRequest) -> HttpResponse:
    return HttpResponse(f"items {request.method}")


@limit("10/hour", cost=4)
def bulk(request: HttpRequest) -> HttpResponse:
    return HttpResponse("bulk")


def _cost(request: Any) -> int:
    """nanolimit's Request: Django's own is ``native``."""
    return int(request.native.GET.get("n", "1"))


@limit("10/hour", cost=_cost)
def fanout(request: HttpRequest) -> HttpResponse:
    return HttpResponse("fanout")


@limit("5/hour", count_when={401, 403}, methods="POST")
def login(request: HttpRequest) -> HttpResponse:
    """Failed logins only spend the budget (a 401, or Django's 403 for a
    PermissionDenied)."""
    if request.POST.get("deny"):
        raise PermissionDenied("locked out")
    try:
        password = json.loads(request.body or b"{}").get("password")
    except ValueError:
        password = None
    if password != PASSWORD:
        return _pid(HttpResponse("wrong password", status=401))
    return _pid(HttpResponse("welcome"))


@limit("2/hour", count_when={500})
def boom(request: HttpRequest) -> HttpResponse:
    """Raises unless ?ok: only the failures (Django's 500) spend."""
    if "ok" in request.GET:
        return HttpResponse("fine")
    raise RuntimeError("the view failed")


@limit("2/hour", scope="user")
def me(request: HttpRequest) -> HttpResponse:
    user = request.user
    return HttpResponse(user.get_username() if user.is_authenticated else "anonymous")


def deny(request: HttpRequest, outcome: Any) -> HttpResponse:
    """NANOLIMIT["DENY"]: the app's own denial."""
    return HttpResponse(f"slow down ({outcome.rule})", status=429, content_type="text/plain")


def forbidden(request: HttpRequest, exception: Exception) -> HttpResponse:
    """handler403: answers a Ratelimited (RAISE) too."""
    return HttpResponse(f"custom 403: {exception}", status=403)


breaches: list[tuple[str, str, str, str | None]] = []


def on_breach(request: Any, outcome: Any) -> None:
    """NANOLIMIT["ON_BREACH"]: nanolimit's Request and the outcome."""
    breaches.append((outcome.rule, request.method, request.route, request.user))
