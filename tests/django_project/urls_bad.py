"""A URLconf with a bad declaration: one shared budget declared twice with
different rates (the system check names it)."""

from django.http import HttpRequest, HttpResponse
from django.urls import path

from nanolimit.django import shared


@shared("5/hour", name="dup")
def one(request: HttpRequest) -> HttpResponse:
    return HttpResponse("one")


@shared("9/hour", name="dup")
def two(request: HttpRequest) -> HttpResponse:
    return HttpResponse("two")


urlpatterns = [path("one", one), path("two", two)]
