"""Real servers and raw sockets for the adversarial path tests.

The path attacks only work when a request-target reaches the app exactly as
an attacker wrote it: an HTTP client would normalise ``/x/../login`` or
``//login`` before sending. So the tests speak HTTP/1.1 over a plain
``socket`` to real servers (Werkzeug's dev server and uvicorn in a thread,
gunicorn in a subprocess), each bound to 127.0.0.1 on a free port, bounded in
time and stopped in a ``finally``.

Every app here answers with ``X-Handler: <route>`` so a test can tell which
handler a variant reached, and is limited by :func:`registry`: a ``login``
rule on ``/login`` (the GET rule covers HEAD), an ``api`` rule on ``/api``
and a ``default`` rule for everything else. With ``api_key`` scope each probe
can bring its own budget (``X-API-Key``), so one server answers many probes,
and the ``RateLimit-Policy`` header says which rule charged it.

gunicorn imports this module by name (``adversarial_servers:flask_app()``):
keep it importable with only ``src`` and ``tests`` on the path, and choose
the twin with the ``NANOLIMIT_ADVERSARIAL_TWIN`` environment variable.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import nanolimit
from nanolimit._limiter_config import Algorithm
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import KeyScope, RateLimitRule

TESTS = Path(__file__).resolve().parent
# the nanolimit this process imported: a subprocess must test the same code
SRC = Path(nanolimit.__file__).resolve().parents[1]
TWIN_ENV = "NANOLIMIT_ADVERSARIAL_TWIN"
LIMIT_ENV = "NANOLIMIT_ADVERSARIAL_LIMIT"
START_TIMEOUT = 20.0
IO_TIMEOUT = 5.0


def registry(limit: int = 3) -> RuleRegistry:
    """The rules every app here runs under: ``login`` (GET, so HEAD too, and
    POST through a second rule), ``api`` and a default, all per API key."""
    key, fixed = KeyScope.API_KEY, Algorithm.FIXED_WINDOW
    return RuleRegistry(
        [
            RateLimitRule("login", "GET", "/login", key, fixed, limit, 3600.0),
            RateLimitRule("login-post", "POST", "/login", key, fixed, limit, 3600.0),
            RateLimitRule("api", "*", "/api", key, fixed, limit, 3600.0),
        ],
        default=RateLimitRule("default", "*", "/", key, fixed, 1_000_000, 3600.0),
    )


def factory(twin: str | None = None) -> LimiterFactory:
    """A fresh store of the named twin (``native`` or ``reference``)."""
    name = twin or os.environ.get(TWIN_ENV, "reference")
    module = importlib.import_module("nanolimit._core" if name == "native" else "nanolimit.reference")
    return LimiterFactory(module.InMemoryStorage())


def _limit() -> int:
    return int(os.environ.get(LIMIT_ENV, "3"))


# ---------------------------------------------------------------------------
# The apps: the same routes on Flask, Starlette and Django


def flask_app(twin: str | None = None, limit: int | None = None, limited: bool = True) -> Any:
    """Flask with ``/login`` (GET, POST), ``/api/<path:rest>`` and ``/``."""
    from flask import Flask, Response

    from nanolimit.wsgi import RateLimitMiddleware

    app = Flask("adversarial")

    def answer(handler: str) -> Response:
        return Response(handler, mimetype="text/plain", headers={"X-Handler": handler})

    @app.route("/login", methods=["GET", "POST"])
    def login() -> Response:
        return answer("login")

    @app.get("/api/<path:rest>")
    def api(rest: str) -> Response:
        return answer("api")

    @app.get("/")
    def home() -> Response:
        return answer("home")

    if limited:
        app.wsgi_app = RateLimitMiddleware(  # type: ignore[method-assign]
            app.wsgi_app, registry(limit or _limit()), factory(twin)
        )
    return app


def starlette_app(twin: str | None = None, limit: int | None = None, limited: bool = True) -> Any:
    """Starlette with the same routes; ``Route`` answers HEAD with the GET handler."""
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    def handler(name: str) -> Callable[[Request], Any]:
        async def run(request: Request) -> PlainTextResponse:
            return PlainTextResponse(name, headers={"X-Handler": name})

        return run

    from nanolimit.asgi import RateLimitMiddleware

    middleware = (
        [Middleware(RateLimitMiddleware, registry=registry(limit or _limit()), factory=factory(twin))]
        if limited
        else []
    )
    return Starlette(
        routes=[
            Route("/login", handler("login"), methods=["GET", "POST"]),
            Route("/api/{rest:path}", handler("api")),
            Route("/", handler("home")),
        ],
        middleware=middleware,
    )


def _django_view(name: str) -> Callable[..., Any]:
    def view(request: Any, rest: str = "") -> Any:
        from django.http import HttpResponse  # type: ignore[import-untyped]

        response = HttpResponse(name, content_type="text/plain")
        response["X-Handler"] = name
        return response

    return view


# Django's URLconf is this module (ROOT_URLCONF): Django's own convention,
# ``login/`` with CommonMiddleware appending the slash.
urlpatterns: list[Any] = []


def django_app(twin: str | None = None, limit: int | None = None, limited: bool = True) -> Any:
    """Django's WSGI application with ``login/``, ``api/<path:rest>`` and ``""``."""
    from django.conf import settings  # type: ignore[import-untyped]

    own = {
        "ROOT_URLCONF": __name__,
        "MIDDLEWARE": ["django.middleware.common.CommonMiddleware"],
        "ALLOWED_HOSTS": ["*"],
        "DEBUG": False,
        "APPEND_SLASH": True,
    }
    borrowed = settings.configured  # another test module (tests/test_django_limiter.py) owns them
    if not borrowed:
        settings.configure(SECRET_KEY="adversarial-tests", INSTALLED_APPS=[], USE_TZ=True, **own)
    from django.core.wsgi import get_wsgi_application  # type: ignore[import-untyped]
    from django.urls import path  # type: ignore[import-untyped]

    if not urlpatterns:
        urlpatterns.extend(
            [
                path("login/", _django_view("login")),
                path("api/<path:rest>", _django_view("api")),
                path("", _django_view("home")),
            ]
        )
    from nanolimit.wsgi import RateLimitMiddleware

    app = _OwnDjangoSettings(own) if borrowed else get_wsgi_application()
    if limited:
        return RateLimitMiddleware(app, registry(limit or _limit()), factory(twin))
    return app


class _OwnDjangoSettings:
    """Django's WSGI app under this module's URLconf and middleware when
    another module configured Django first (settings are configured once
    per process): each request runs under ``override_settings``, one at a
    time, with a handler built under them."""

    def __init__(self, own: dict[str, Any]) -> None:
        from django.core.wsgi import get_wsgi_application
        from django.test import override_settings  # type: ignore[import-untyped]

        self._override = override_settings(**own)
        self._lock = threading.Lock()
        with self._override:
            self._app = get_wsgi_application()

    def __call__(self, environ: dict[str, Any], start_response: Any) -> list[bytes]:
        with self._lock, self._override:
            return list(self._app(environ, start_response))


# ---------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_for_port(port: int, deadline: float, alive: Callable[[], bool]) -> None:
    while True:
        if not alive():
            raise RuntimeError(f"the server on port {port} exited before it listened")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing listened on port {port} within {START_TIMEOUT} s") from None
            time.sleep(0.05)


@contextlib.contextmanager
def werkzeug_server(app: Any) -> Iterator[int]:
    """Werkzeug's dev server (``make_server``) in a thread; yields the port."""
    from werkzeug.serving import WSGIRequestHandler, make_server

    class Quiet(WSGIRequestHandler):
        def log(self, type: str, message: str, *args: Any) -> None:
            pass  # hundreds of probes: keep the test output readable

    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=Quiet)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server.server_port
    finally:
        server.shutdown()
        server.server_close()
        thread.join(10.0)


@contextlib.contextmanager
def uvicorn_server(app: Any, lifespan: str = "off") -> Iterator[int]:
    """uvicorn in a thread (its h11 protocol unless httptools is installed);
    ``lifespan="on"``: a startup failure stops it, as it stops a real server."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error", lifespan=lifespan)
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("uvicorn did not start")
            time.sleep(0.02)
        yield port
    finally:
        server.should_exit = True
        thread.join(10.0)


@contextlib.contextmanager
def gunicorn_server(app_spec: str, twin: str, limit: int = 3, lifetime: float = 120.0) -> Iterator[int]:
    """``gunicorn -w 1 -b 127.0.0.1:PORT app_spec`` in a subprocess that
    ``timeout`` ends after ``lifetime`` seconds whatever happens to the test;
    stopped by its PID in the ``finally``."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(TESTS)])
    env[TWIN_ENV] = twin
    env[LIMIT_ENV] = str(limit)
    proc = subprocess.Popen(
        [
            "timeout",
            str(int(lifetime)),
            sys.executable,
            "-m",
            "gunicorn",
            "-w",
            "1",
            "-b",
            f"127.0.0.1:{port}",
            "--timeout",
            "30",
            "--graceful-timeout",
            "2",
            "--log-level",
            "warning",
            app_spec,
        ],
        cwd=str(TESTS),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        try:
            _wait_for_port(port, time.monotonic() + START_TIMEOUT, lambda: proc.poll() is None)
        except RuntimeError:
            proc.kill()
            _, err = proc.communicate(timeout=10.0)
            raise RuntimeError(f"gunicorn did not start: {err.decode(errors='replace')[-2000:]}") from None
        yield port
    finally:
        if proc.poll() is None:
            proc.terminate()  # timeout forwards SIGTERM to gunicorn
            try:
                proc.wait(10.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10.0)
        if proc.stderr is not None:
            proc.stderr.close()


# ---------------------------------------------------------------------------
# Raw HTTP/1.1


class RawResponse(NamedTuple):
    status: int
    headers: dict[str, str]
    body: bytes

    @property
    def handler(self) -> str | None:
        """Which app handler answered (None: a 404, a redirect, a 429...)."""
        return self.headers.get("x-handler")

    @property
    def charged(self) -> str | None:
        """The rule that charged the request (its ``RateLimit-Policy`` name),
        or the rule a 429 names."""
        policy = self.headers.get("ratelimit-policy")
        if policy is None:
            return None
        return policy.split(";", 1)[0].strip('"')


def raw_request(port: int, method: str, target: bytes, headers: dict[str, str] | None = None) -> RawResponse:
    """Send ``METHOD target HTTP/1.1`` with the exact request-target bytes
    given and read the whole response (the connection is closed after it)."""
    lines = [method.encode("ascii") + b" " + target + b" HTTP/1.1", b"Host: 127.0.0.1", b"Connection: close"]
    for name, value in (headers or {}).items():
        lines.append(f"{name}: {value}".encode("latin-1"))
    data = b"\r\n".join(lines) + b"\r\n"
    if method.upper() == "POST":
        data += b"Content-Length: 0\r\n"
    data += b"\r\n"
    chunks: list[bytes] = []
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT) as sock:
        sock.sendall(data)
        while True:
            chunk = sock.recv(65536)
            if not chunk:
                break
            chunks.append(chunk)
    raw = b"".join(chunks)
    head, _, body = raw.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
    out: dict[str, str] = {}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if sep:
            out[name.strip().lower()] = value.strip()
    return RawResponse(status, out, body)
