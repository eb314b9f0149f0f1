"""A DRF ViewSet whose ``list`` action declares the limit: refused."""

from .urls_drf import listed as urlpatterns

__all__ = ["urlpatterns"]
