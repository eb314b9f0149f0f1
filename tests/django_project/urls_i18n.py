"""A URLconf under ``i18n_patterns``: one limited view, reachable under a
prefix per language (``/en/quota``, ``/fr/quota``). Every prefix is the
same view, so every prefix must spend the same budget."""

from django.conf.urls.i18n import i18n_patterns
from django.http import HttpRequest, HttpResponse
from django.urls import path

from nanolimit.django import limit


@limit("2/hour")
def quota(request: HttpRequest) -> HttpResponse:
    return HttpResponse("quota")


urlpatterns = [
    *i18n_patterns(path("quota", quota)),
    *i18n_patterns(path("plain", quota), prefix_default_language=False),
]
