"""A Flask app for the real-server run of test_flask_limiter: gunicorn
imports it by name (``flask_apps:login_app()``), so keep it importable with
only ``src`` and ``tests`` on the path.

``/login`` throttles failed logins only: ``count_when={401}``, a budget of
``NANOLIMIT_FLASK_FAILS`` (default 10) an hour per client. The password
``right`` answers 200 (refunded), anything else 401 (counted). ``/health``
is exempt, for the readiness probe. Each response says which worker thread
answered (``X-Thread``), so a test can see the requests ran concurrently.
With ``NANOLIMIT_FLASK_HANDLER=1`` the app answers 429s with a handler of
its own (``errorhandler(429)``).
"""

from __future__ import annotations

import os
import threading
from typing import Any

from flask import Flask, request

from nanolimit.flask import Limiter

FAILS_ENV = "NANOLIMIT_FLASK_FAILS"
FAILS = int(os.environ.get(FAILS_ENV, "10"))
HANDLER_ENV = "NANOLIMIT_FLASK_HANDLER"

limiter = Limiter()


@limiter.limit(f"{FAILS}/hour", count_when={401})
def login() -> tuple[str, int, dict[str, str]]:
    ok = request.args.get("password") == "right"
    return (
        ("welcome" if ok else "wrong password"),
        (200 if ok else 401),
        {"X-Thread": threading.current_thread().name},
    )


@limiter.exempt
def health() -> str:
    return "ok"


def login_app() -> Flask:
    app = Flask("flask_apps")
    app.add_url_rule("/login", view_func=login, methods=["POST"])
    app.add_url_rule("/health", view_func=health)
    if os.environ.get(HANDLER_ENV) == "1":

        @app.errorhandler(429)
        def too_many(exc: Any) -> tuple[dict[str, Any], int]:
            return {"own": True, "rule": exc.outcome.rule}, 429

    limiter.init_app(app)
    limiter.check_routes(app)
    return app
