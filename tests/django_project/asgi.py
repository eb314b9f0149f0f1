"""The ASGI application (Django's own handler, async middleware chain)."""

import os

from django.core.asgi import get_asgi_application

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "django_project.settings")
application = get_asgi_application()
