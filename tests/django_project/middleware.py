"""A middleware that switches the URLconf per request, as django-hosts
does: ``X-Urlconf: attack`` routes the request by ``urls_attack``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class PerRequestUrlconf:
    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        if request.headers.get("X-Urlconf") == "attack":
            request.urlconf = "django_project.urls_attack"
        return self.get_response(request)


class ApiKeyGate:
    """An API-key check answering 401 itself, before any view runs: a
    request without ``X-Api-Key: good`` never reaches ``process_view``."""

    def __init__(self, get_response: Callable[[Any], Any]) -> None:
        self.get_response = get_response

    def __call__(self, request: Any) -> Any:
        from django.http import HttpResponse

        if request.headers.get("X-Api-Key") != "good":
            return HttpResponse("bad key", status=401)
        return self.get_response(request)
