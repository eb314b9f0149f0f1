"""A small Django project for tests/test_django_limiter.py: its settings,
URLconf and views, served in-process by Django's test clients and by
gunicorn (wsgi.py) on 127.0.0.1."""
