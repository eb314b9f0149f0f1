"""A URLconf where an exempt route shares its shape with a limited one:
``items/<int:item_id>`` limited, ``items/<slug:name>`` exempt. The
exemption must never cover the limited view. ``slashed/`` is limited and
ends in a slash (``APPEND_SLASH`` redirects ``/slashed`` to it)."""

from django.http import HttpRequest, HttpResponse
from django.urls import path

from nanolimit.django import exempt, limit


@limit("2/hour")
def item(request: HttpRequest, item_id: int) -> HttpResponse:
    return HttpResponse(f"item {item_id}")


@exempt
def named(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse(f"named {name}")


@limit("2/hour")
def slashed(request: HttpRequest) -> HttpResponse:
    return HttpResponse("slashed")


urlpatterns = [
    path("items/<int:item_id>", item),
    path("items/<slug:name>", named),
    path("slashed/", slashed),
]
