"""One class-based view routed by two ``as_view()`` calls (a list URL and a
detail URL, as projects write them): one view, one budget."""

from django.urls import path

from . import views

urlpatterns = [path("r1", views.Report.as_view()), path("r2", views.Report.as_view())]
