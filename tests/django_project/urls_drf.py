"""Django REST framework views declaring limits: an ``APIView`` and a
``ViewSet`` (whose ``as_view`` is DRF's own, routed as a list and a detail
URL, as DRF's routers do), each limited on the class. Needs
``djangorestframework``: its test is skipped without it."""

from django.urls import path
from rest_framework.response import Response
from rest_framework.views import APIView
from rest_framework.viewsets import ViewSet

from nanolimit.django import limit


@limit("2/hour")
class Items(APIView):
    authentication_classes: list[type] = []
    permission_classes: list[type] = []

    def get(self, request: object) -> Response:
        return Response(["a"])


@limit("2/hour")
class Things(ViewSet):
    authentication_classes: list[type] = []
    permission_classes: list[type] = []

    def list(self, request: object) -> Response:
        return Response(["t"])

    def retrieve(self, request: object, pk: str) -> Response:
        return Response(pk)


class Listed(ViewSet):
    """A limit on the ``list`` action: a method nanolimit never reads."""

    @limit("2/hour")
    def list(self, request: object) -> Response:
        return Response([])


urlpatterns = [
    path("items", Items.as_view()),
    path("things", Things.as_view({"get": "list"})),
    path("things/<str:pk>", Things.as_view({"get": "retrieve"})),
]

# the ViewSet whose action declares the limit, routed only by its own test
listed = [path("listed", Listed.as_view({"get": "list"}))]
