"""The test project's settings: auth and sessions on an in-memory SQLite
database (shared between threads, as Django's async handler needs), and
nanolimit's middleware before AuthenticationMiddleware on purpose: the
decision is made in process_view, when the user is known whatever the order."""

from pathlib import Path

HERE = Path(__file__).resolve().parent

SECRET_KEY = "nanolimit-tests-not-a-secret"
DEBUG = False
ALLOWED_HOSTS = ["testserver", "127.0.0.1", "localhost"]
ROOT_URLCONF = "django_project.urls"
USE_TZ = True
INSTALLED_APPS = [
    "django.contrib.contenttypes",
    "django.contrib.auth",
    "django.contrib.sessions",
    "nanolimit.django.NanolimitConfig",
]
MIDDLEWARE = [
    "django.contrib.sessions.middleware.SessionMiddleware",
    "nanolimit.django.RateLimitMiddleware",
    "django.contrib.auth.middleware.AuthenticationMiddleware",
]
DATABASES = {
    "default": {
        "ENGINE": "django.db.backends.sqlite3",
        "NAME": "file:nanolimit-django-tests?mode=memory&cache=shared",
        "OPTIONS": {"uri": True},
        "TEST": {"NAME": "file:nanolimit-django-tests?mode=memory&cache=shared"},
    }
}
PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]  # fast, tests only
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
LOGGING_CONFIG = None
# every denial logged (the tests read nanolimit.denials)
NANOLIMIT = {"LOG_DENIALS": 0.0}
