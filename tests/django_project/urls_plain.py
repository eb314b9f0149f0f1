"""A URLconf whose views declare no limit (the missing-middleware check's
warning case)."""

from django.urls import path

from . import views

urlpatterns = [path("plain", views.plain)]
