"""A URLconf where an exempt route shares its shape with a limited one:
``items/<int:item_id>`` limited, ``items/<slug:name>`` exempt. The
exemption must never cover the limited view."""

from django.http import HttpRequest, HttpResponse
from django.urls import path

from nanolimit.django import exempt, limit


@limit("2/hour")
def item(request: HttpRequest, item_id: int) -> HttpResponse:
    return HttpResponse(f"item {item_id}")


@exempt
def named(request: HttpRequest, name: str) -> HttpResponse:
    return HttpResponse(f"named {name}")


urlpatterns = [path("items/<int:item_id>", item), path("items/<slug:name>", named)]
