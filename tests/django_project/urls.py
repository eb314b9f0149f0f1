from django.urls import include, path, re_path

from nanolimit.django import exempt, limit

from . import views

handler403 = "django_project.views.forbidden"

api = [
    path("users/<int:id>/avatar", views.avatar),
    path("items", views.items),
    re_path(r"^files/(?P<name>[a-z]+)$", views.files),
]

urlpatterns = [
    path("", views.index),
    path("hello", views.hello),
    path("ahello", views.ahello),
    path("report", views.Report.as_view()),
    path("export", limit("2/hour")(views.Export.as_view())),
    path("search", views.search),
    path("search/export", views.search_export),
    path("health", views.health),
    path("status", views.Status.as_view()),
    path("ping", exempt(views.Ping.as_view())),
    path("plain", views.plain),
    path("api/", include(api)),
    path("bulk", views.bulk),
    path("fanout", views.fanout),
    path("login", views.login),
    path("boom", views.boom),
    path("me", views.me),
]
