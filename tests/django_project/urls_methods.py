"""A URLconf whose class-based view declares its limit on a handler method
(``def get``), where nanolimit never looks: the system check must refuse
it, not let the method run unlimited."""

from django.http import HttpRequest, HttpResponse
from django.urls import path
from django.utils.decorators import method_decorator
from django.views import View

from nanolimit.django import limit


class OnGet(View):
    @method_decorator(limit("2/hour"))
    def get(self, request: HttpRequest) -> HttpResponse:
        return HttpResponse("onget")


urlpatterns = [path("onget", OnGet.as_view())]
