"""``nanolimit.flask``: the Flask extension, on real Flask apps through
Werkzeug's test client, and one real gunicorn (threads) on 127.0.0.1 for the
concurrent count-by-response run.

Every app gets a fresh store of the twin under test (``backend``), so each
test runs on the native core and on the reference.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
import sys
import threading
import time
import types
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from adversarial_servers import SRC, TESTS, free_port, raw_request
from flask import Blueprint, Flask, abort, jsonify, request
from flask.views import MethodView

import nanolimit
import nanolimit.flask as nanolimit_flask
from nanolimit import Algorithm, KeyScope, RateLimitRule, RuleRegistry, ValidationError
from nanolimit.errors import RuleValidationError
from nanolimit.flask import CONFIG_KEYS, Limiter, RateLimitExceeded

IP_A = {"REMOTE_ADDR": "192.0.2.1"}
IP_B = {"REMOTE_ADDR": "192.0.2.2"}


def _limiter(backend: types.SimpleNamespace, **kw: Any) -> Limiter:
    kw.setdefault("storage", backend.InMemoryStorage())
    kw.setdefault("log_denials", None)
    return Limiter(**kw)


def _statuses(client: Any, path: str, n: int, method: str = "GET", **kw: Any) -> list[int]:
    return [client.open(path, method=method, **kw).status_code for _ in range(n)]


# ---------------------------------------------------------------------------
# Module and exception


def test_the_documented_path_is_a_facade_of_the_gateway_module() -> None:
    import nanolimit.gateway.flask as adapter

    assert nanolimit_flask.Limiter is adapter.Limiter and nanolimit_flask.__all__ == adapter.__all__
    assert issubclass(RateLimitExceeded, __import__("werkzeug.exceptions").exceptions.TooManyRequests)


# ---------------------------------------------------------------------------
# Declaration forms


def test_function_view_limit_answers_429_json_with_headers(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("views")

    @app.get("/hello")
    @limiter.limit("2/minute")
    def hello() -> str:
        return "hi"

    @app.get("/free")
    def free() -> str:
        return "free"

    limiter.init_app(app)
    client = app.test_client()
    first = client.get("/hello", environ_base=IP_A)
    assert first.status_code == 200 and first.data == b"hi"
    assert first.headers["X-RateLimit-Limit"] == "2"
    assert first.headers["X-RateLimit-Remaining"] == "1"
    assert "q=2;w=60" in first.headers["RateLimit-Policy"]
    assert client.get("/hello", environ_base=IP_A).status_code == 200
    denied = client.get("/hello", environ_base=IP_A)
    assert denied.status_code == 429
    assert denied.headers["Content-Type"] == "application/json"
    body = denied.get_json()
    assert body["error"] == "rate_limit_exceeded"
    assert body["retry_after"] == int(denied.headers["Retry-After"])
    assert body["rule"].endswith("hello")
    assert denied.headers["X-RateLimit-Remaining"] == "0"
    # another client has its own budget; an undeclared route none at all
    assert client.get("/hello", environ_base=IP_B).status_code == 200
    assert _statuses(client, "/free", 10, environ_base=IP_A) == [200] * 10
    assert "RateLimit-Policy" not in client.get("/free").headers


def test_method_view_class_and_its_decorators_list(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)

    @limiter.limit("2/minute")
    class Items(MethodView):
        def get(self) -> str:
            return "items"

        def post(self) -> str:
            return "made"

    class Orders(MethodView):
        decorators = [limiter.limit("1/minute")]

        def get(self) -> str:
            return "orders"

    app = Flask("methodviews")
    app.add_url_rule("/items", view_func=Items.as_view("items"))
    app.add_url_rule("/orders", view_func=Orders.as_view("orders"))
    limiter.init_app(app)
    client = app.test_client()
    # the class's limit covers every method of the view, one budget
    assert client.get("/items").status_code == 200
    assert client.post("/items").status_code == 200
    assert client.get("/items").status_code == 429
    assert client.get("/orders").status_code == 200
    assert client.get("/orders").status_code == 429


def test_a_method_view_routed_by_two_as_view_calls_keeps_one_budget(backend: types.SimpleNamespace) -> None:
    """``Items.as_view("items")`` and ``Items.as_view("item")`` (a list and
    a detail URL) are two functions of one class: its limit made two rules
    of one name and every request failed (500). One view, one budget."""
    limiter = _limiter(backend)

    @limiter.limit("2/minute")
    class Items(MethodView):
        def get(self, item_id: int | None = None) -> str:
            return "items"

    app = Flask("twoviews")
    app.add_url_rule("/items", view_func=Items.as_view("items"))
    app.add_url_rule("/items/<int:item_id>", view_func=Items.as_view("item"))
    limiter.init_app(app)
    client = app.test_client()
    assert _statuses(client, "/items", 1) + _statuses(client, "/items/1", 2) == [200, 200, 429]


def test_a_limit_on_a_method_of_a_method_view_is_refused(backend: types.SimpleNamespace) -> None:
    """flask-limiter users decorate ``def post`` of a ``MethodView``;
    nanolimit reads the class and the view only, so the POSTs ran
    unlimited (200, 200, 200) without a word. Binding refuses it, naming
    the method and the declaration that works."""
    limiter = _limiter(backend)

    class Items(MethodView):
        def get(self) -> str:
            return "items"

        @limiter.limit("2/minute")
        def post(self) -> str:
            return "made"

    app = Flask("methodlimit")
    app.add_url_rule("/items", view_func=Items.as_view("items"))
    limiter.init_app(app)
    with pytest.raises(ValidationError, match=r"Items\.post declares a limit.*methods=\['POST'\]"):
        limiter.check_routes(app)
    reply = app.test_client().post("/items")  # and no request runs it unlimited
    assert reply.status_code == 500 and reply.data != b"made"


def test_an_app_hook_added_after_init_app_is_limited_and_one_added_before_is_not(
    backend: types.SimpleNamespace,
) -> None:
    """docs/flask.md: before_request hooks run in the order they were added;
    an API-key check added after ``init_app`` has its 401s spend the
    route's limit, one added before it answers unlimited."""

    def gated(first: bool) -> list[int]:
        limiter = _limiter(backend)
        app = Flask("gated")

        @app.post("/login")
        @limiter.limit("3/minute", count_when={401})
        def login() -> str:
            return "ok"

        def api_key() -> None:
            if request.headers.get("X-Key") != "secret":
                abort(401)

        if first:
            app.before_request(api_key)
        limiter.init_app(app)
        if not first:
            app.before_request(api_key)
        client = app.test_client()
        return [client.post("/login").status_code for _ in range(5)]

    assert gated(first=False) == [401, 401, 401, 429, 429]
    assert gated(first=True) == [401] * 5


def test_blueprint_limit_covers_each_route_and_nested_blueprints(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    api = Blueprint("api", __name__, url_prefix="/api")
    v1 = Blueprint("v1", __name__, url_prefix="/v1")

    @api.get("/a")
    def a() -> str:
        return "a"

    @api.get("/b")
    def b() -> str:
        return "b"

    @v1.get("/c")
    def c() -> str:
        return "c"

    @v1.get("/d")
    @limiter.limit("3/minute")
    def d() -> str:
        return "d"

    api.register_blueprint(v1)
    limiter.limit("2/minute")(api)
    app = Flask("blueprints")
    app.register_blueprint(api)

    @app.get("/outside")
    def outside() -> str:
        return "outside"

    limiter.init_app(app)
    client = app.test_client()
    # each route of the blueprint has its own budget of 2
    assert _statuses(client, "/api/a", 3) == [200, 200, 429]
    assert _statuses(client, "/api/b", 3) == [200, 200, 429]
    # the nested blueprint's routes inherit it
    assert _statuses(client, "/api/v1/c", 3) == [200, 200, 429]
    # a view's own limit applies with the blueprint's, all or nothing: 2 binds first
    assert _statuses(client, "/api/v1/d", 3) == [200, 200, 429]
    assert _statuses(client, "/outside", 5) == [200] * 5


def test_shared_limit_is_one_budget_for_every_route(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    reports = limiter.shared("3/minute", name="reports")
    app = Flask("shared")

    @app.get("/search")
    @reports
    def search() -> str:
        return "search"

    @app.get("/export")
    @reports
    def export() -> str:
        return "export"

    limiter.init_app(app)
    client = app.test_client()
    assert [client.get(p).status_code for p in ("/search", "/export", "/search", "/export")] == [
        200,
        200,
        200,
        429,
    ]
    assert client.get("/search").get_json()["rule"] == "reports"


def test_a_limit_on_one_of_two_views_of_one_rule_is_that_views_alone(backend: types.SimpleNamespace) -> None:
    """GET /login unlimited beside a limited POST /login: the limit is the
    POST view's (docs/routes.md tells the two routes apart by their
    methods), so GETs neither get its headers nor spend its budget; HEAD
    goes with GET."""
    limiter = _limiter(backend)
    app = Flask("shared_template")

    @app.get("/login")
    def login_form() -> str:
        return "form"

    @app.post("/login")
    @limiter.limit("3/minute")
    def login_submit() -> str:
        return "ok"

    limiter.init_app(app)
    client = app.test_client()
    assert _statuses(client, "/login", 5) == [200] * 5
    assert "X-RateLimit-Limit" not in client.get("/login").headers
    assert _statuses(client, "/login", 2, method="HEAD") == [200] * 2
    assert _statuses(client, "/login", 4, method="POST") == [200, 200, 200, 429]
    assert client.get("/login").status_code == 200


def test_a_view_that_alone_answers_several_methods_keeps_one_budget(backend: types.SimpleNamespace) -> None:
    """A limited view answering PUT and DELETE beside a GET view of the same
    template: a rule per method would give PUT and DELETE 3 each (6 in
    all); the limit stays one budget over the template (docs/routes.md)."""
    limiter = _limiter(backend)
    app = Flask("several_alone")

    @app.get("/items/<int:item>")
    def read(item: int) -> str:
        return "item"

    @app.route("/items/<int:item>", methods=["PUT", "DELETE"])
    @limiter.limit("3/minute")
    def change(item: int) -> str:
        return "changed"

    limiter.init_app(app)
    client = app.test_client()
    assert _statuses(client, "/items/1", 2, method="PUT") == [200, 200]
    assert _statuses(client, "/items/1", 2, method="DELETE") == [200, 429]
    assert client.put("/items/1").status_code == 429


def test_a_view_on_two_templates_keeps_one_budget_over_both(backend: types.SimpleNamespace) -> None:
    """The limited view serves /login (beside a GET view: POST alone) and
    /signin (alone: every method). A rule set per template would give each
    the whole limit; one budget covers both."""
    limiter = _limiter(backend)
    app = Flask("two_templates")

    @app.get("/login")
    def form() -> str:
        return "form"

    @app.post("/login")
    @app.post("/signin")
    @limiter.limit("3/minute")
    def submit() -> str:
        return "ok"

    limiter.init_app(app)
    client = app.test_client()
    assert _statuses(client, "/login", 2, method="POST") == [200, 200]
    assert _statuses(client, "/signin", 2, method="POST") == [200, 429]
    assert client.post("/login").status_code == 429


def test_exempt_view_and_blueprint_escape_even_the_default_limit(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend, default_limits="2/minute")
    hooks = Blueprint("hooks", __name__, url_prefix="/hooks")

    @hooks.post("/stripe")
    def stripe() -> str:
        return "ok"

    limiter.exempt(hooks)
    app = Flask("exempt", static_folder=str(Path(__file__).parent), static_url_path="/static")

    @app.get("/health")
    @limiter.exempt
    def health() -> str:
        return "ok"

    @app.get("/page")
    def page() -> str:
        return "page"

    app.register_blueprint(hooks)
    limiter.init_app(app)
    client = app.test_client()
    assert _statuses(client, "/health", 5) == [200] * 5
    assert _statuses(client, "/hooks/stripe", 5, method="POST") == [200] * 5
    # Flask's static files are never limited
    assert _statuses(client, "/static/flask_apps.py", 4) == [200] * 4
    assert _statuses(client, "/page", 3) == [200, 200, 429]


def test_default_limit_is_one_budget_a_route_with_its_own_replaces_it(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("defaults")
    app.config["RATELIMIT_DEFAULT"] = "3/minute"

    @app.get("/a")
    def a() -> str:
        return "a"

    @app.get("/b")
    def b() -> str:
        return "b"

    @app.get("/own")
    @limiter.limit("5/minute")
    def own() -> str:
        return "own"

    limiter.init_app(app)
    client = app.test_client()
    assert [client.get(p).status_code for p in ("/a", "/b", "/a", "/b")] == [200, 200, 200, 429]
    assert client.get("/a").get_json()["rule"] == "default_limit"
    assert _statuses(client, "/own", 6) == [200] * 5 + [429]


def test_default_rate_list_decides_together(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend, default_limits=["2/second", "3/hour"])
    app = Flask("default-list")

    @app.get("/")
    def home() -> str:
        return "home"

    limiter.init_app(app)
    rules = {r.name for r in limiter.check_routes(app)}
    assert rules == {"default_limit:1s", "default_limit:3600s"}
    assert _statuses(app.test_client(), "/", 3) == [200, 200, 429]


def test_rules_file_through_config(backend: types.SimpleNamespace, tmp_path: Path) -> None:
    path = tmp_path / "rules.toml"
    path.write_text(
        '[[rules]]\nname = "admin"\npath_prefix = "/admin"\nrate = "2/minute"\n'
        '[default]\nname = "fallback"\nrate = "4/minute"\n'
    )
    limiter = _limiter(backend)
    app = Flask("rulesfile")
    app.config["RATELIMIT_RULES"] = str(path)

    @app.get("/admin/users")
    def admin() -> str:
        return "admin"

    @app.get("/home")
    def home() -> str:
        return "home"

    @app.get("/own")
    @limiter.limit("1/minute")
    def own() -> str:
        return "own"

    limiter.init_app(app)
    client = app.test_client()
    assert _statuses(client, "/admin/users", 3) == [200, 200, 429]
    assert _statuses(client, "/home", 5) == [200] * 4 + [429]
    # a route's declaration sits next to the file's rules
    assert _statuses(client, "/own", 2) == [200, 429]
    # a bad file fails at init_app, naming the rule and the field
    path.write_text('[[rules]]\nname = "bad"\nrate = "five per minute"\n')
    other = Flask("badfile")
    other.config["RATELIMIT_RULES"] = str(path)
    with pytest.raises(nanolimit.ConfigError, match="bad"):
        _limiter(backend).init_app(other)


# ---------------------------------------------------------------------------
# Routes, methods, cost


def test_route_template_shares_the_budget_across_ids(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("templates")

    @app.get("/users/<int:id>/avatar")
    @limiter.limit("3/minute")
    def avatar(id: int) -> str:
        return f"avatar {id}"

    limiter.init_app(app)
    client = app.test_client()
    assert [client.get(f"/users/{i}/avatar").status_code for i in (1, 2, 1, 2)] == [200, 200, 200, 429]
    # a path the template does not route is a 404, not a spent budget
    assert client.get("/users/x/avatar").status_code == 404
    (rule,) = limiter.check_routes(app)
    assert rule.routes == ("/users/{id:int}/avatar",)


def test_methods_restrict_a_limit(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("methods")

    @app.route("/posts", methods=["GET", "POST"])
    @limiter.limit("2/minute", methods=["POST"])
    def posts() -> str:
        return request.method

    limiter.init_app(app)
    client = app.test_client()
    assert _statuses(client, "/posts", 5) == [200] * 5
    assert _statuses(client, "/posts", 3, method="POST") == [200, 200, 429]
    assert client.get("/posts").status_code == 200


def test_cost_static_and_read_from_the_request(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("cost")
    seen: list[Any] = []

    def pages(req: nanolimit.Request) -> int:
        seen.append(req.native)
        return int(req.native.args.get("pages", "1"))

    @app.get("/export")
    @limiter.limit("5/minute", cost=2)
    def export() -> str:
        return "export"

    @app.get("/search")
    @limiter.limit("10/minute", cost=pages)
    def search() -> str:
        return "search"

    limiter.init_app(app)
    client = app.test_client()
    assert _statuses(client, "/export", 3) == [200, 200, 429]
    first = client.get("/search?pages=4")
    assert first.status_code == 200 and first.headers["X-RateLimit-Remaining"] == "6"
    assert seen and seen[-1].path == "/search"  # native is flask.request
    assert client.get("/search?pages=6").status_code == 200
    assert client.get("/search?pages=1").status_code == 429


def test_cost_above_the_limit_is_a_429_that_says_why(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("too-costly")

    @app.get("/bulk")
    @limiter.limit("5/minute", cost=lambda req: int(req.native.args["n"]))
    def bulk() -> str:
        return "bulk"

    limiter.init_app(app)
    client = app.test_client()
    reply = client.get("/bulk?n=6")
    assert reply.status_code == 429
    body = reply.get_json()
    assert body["reason"] == "cost_exceeds_limit" and body["cost"] == 6 and body["limit"] == 5
    assert body["retry_after"] is None and "Retry-After" not in reply.headers
    assert client.get("/bulk?n=5").status_code == 200  # nothing was spent by the refusal


# ---------------------------------------------------------------------------
# Counting by response


def _login_app(limiter: Limiter, fails: int = 3) -> Flask:
    app = Flask("logins")

    @app.post("/login")
    @limiter.limit(f"{fails}/hour", count_when={401})
    def login() -> Any:
        if request.form.get("password") == "right":
            return "welcome"
        return "wrong password", 401

    limiter.init_app(app)
    return app


def test_throttle_failed_logins_only(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    client = _login_app(limiter).test_client()
    good = {"password": "right"}
    bad = {"password": "wrong"}
    assert [client.post("/login", data=good).status_code for _ in range(4)] == [200] * 4
    assert [client.post("/login", data=bad).status_code for _ in range(3)] == [401] * 3
    refused = client.post("/login", data=bad)
    assert refused.status_code == 429
    # the budget is spent: even the right password waits now
    assert client.post("/login", data=good).status_code == 429


def test_a_view_that_raises_is_settled_as_500(backend: types.SimpleNamespace) -> None:
    """In testing mode the exception passes every handler (the response
    never starts): the extension settles it as a 500 as it passes. Served
    normally, Flask answers 500 and the start of that response settles it.
    Neither counts under ``count_when={401}``."""
    limiter = _limiter(backend)
    app = Flask("raises")

    @app.get("/flaky")
    @limiter.limit("2/hour", count_when={401})
    def flaky() -> Any:
        if request.args.get("fail"):
            raise RuntimeError("boom")
        return "no", 401

    limiter.init_app(app)
    app.testing = True
    client = app.test_client()
    for _ in range(3):
        with pytest.raises(RuntimeError):
            client.get("/flaky?fail=1")
    app.testing = False
    assert _statuses(client, "/flaky?fail=1", 3) == [500] * 3
    assert _statuses(client, "/flaky", 3) == [401, 401, 429]


def _gunicorn(port: int, log: Path, fails: int, handler: bool = False) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(TESTS)])
    env["NANOLIMIT_FLASK_FAILS"] = str(fails)
    env["NANOLIMIT_FLASK_HANDLER"] = "1" if handler else "0"
    argv = ["timeout", "90", sys.executable, "-m", "gunicorn", "-w", "1", "-k", "gthread", "--threads", "8"]
    argv += ["-b", f"127.0.0.1:{port}", "--timeout", "30", "--graceful-timeout", "3"]
    argv += ["--log-level", "warning"]
    with log.open("wb") as err:
        return subprocess.Popen(
            [*argv, "flask_apps:login_app()"],
            cwd=str(TESTS),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )


@contextlib.contextmanager
def _served(tmp_path: Path, fails: int, handler: bool = False) -> Iterator[int]:
    """gunicorn, one worker of 8 threads, bounded by ``timeout`` and stopped by its PID."""
    pytest.importorskip("gunicorn")
    port = free_port()
    log = tmp_path / "gunicorn.log"
    proc = _gunicorn(port, log, fails, handler)
    try:
        deadline = time.monotonic() + 30.0
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"gunicorn exited:\n{log.read_text(errors='replace')[-3000:]}")
            try:
                if raw_request(port, "GET", b"/health").status == 200:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"gunicorn never answered:\n{log.read_text(errors='replace')[-3000:]}")
            time.sleep(0.05)
        yield port
    finally:
        if proc.poll() is None:
            proc.terminate()  # timeout forwards SIGTERM to gunicorn
            try:
                proc.wait(15.0)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait(10.0)


def test_failed_logins_under_8_concurrent_threads_on_gunicorn(tmp_path: Path) -> None:
    """The live twin behind a real server: 8 client threads at once against
    8 worker threads. Successful logins (fewer in flight than the budget)
    all pass; of 48 failed ones exactly the budget is admitted, never more."""
    fails = 10
    clients = 8
    with _served(tmp_path, fails) as port:

        def burst(target: bytes, per_client: int) -> tuple[Counter[int], set[str]]:
            statuses: Counter[int] = Counter()
            threads_seen: set[str] = set()
            lock = threading.Lock()
            barrier = threading.Barrier(clients)

            def client() -> None:
                barrier.wait(10.0)
                for _ in range(per_client):
                    reply = raw_request(port, "POST", target)
                    with lock:
                        statuses[reply.status] += 1
                        if "x-thread" in reply.headers:
                            threads_seen.add(reply.headers["x-thread"])

            workers = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
            for t in workers:
                t.start()
            for t in workers:
                t.join(60.0)
            return statuses, threads_seen

        good, served_by = burst(b"/login?password=right", 4)
        assert good == Counter({200: clients * 4}), good
        bad, _ = burst(b"/login?password=wrong", 6)
        assert bad[401] == fails, bad
        assert bad[429] == clients * 6 - fails and sum(bad.values()) == clients * 6, bad
        assert len(served_by) > 1  # the server ran them on several threads


# ---------------------------------------------------------------------------
# Denials the app controls


def test_headers_off_and_renamed(backend: types.SimpleNamespace) -> None:
    for config, check in (
        ({"RATELIMIT_HEADERS_ENABLED": False}, "off"),
        ({"RATELIMIT_HEADER_NAMES": {"X-RateLimit-Remaining": "X-Left", "Retry-After": "X-Wait"}}, "renamed"),
    ):
        limiter = _limiter(backend)
        app = Flask(f"headers-{check}")
        app.config.update(config)

        @app.get("/")
        @limiter.limit("1/minute")
        def home() -> str:
            return "home"

        limiter.init_app(app)
        client = app.test_client()
        ok, denied = client.get("/"), client.get("/")
        if check == "off":
            assert not any(h.lower().startswith(("ratelimit", "x-ratelimit")) for h in ok.headers.keys())
            assert denied.status_code == 429 and "Retry-After" in denied.headers
            assert "X-RateLimit-Limit" not in denied.headers
        else:
            assert ok.headers["X-Left"] == "0" and "X-RateLimit-Remaining" not in ok.headers
            assert denied.headers["X-Wait"] == str(denied.get_json()["retry_after"])
            assert "Retry-After" not in denied.headers


def test_breach_hook_and_denial_log(backend: types.SimpleNamespace, caplog: pytest.LogCaptureFixture) -> None:
    breaches: list[tuple[Any, Any]] = []
    limiter = _limiter(backend, on_breach=lambda req, outcome: breaches.append((req, outcome)), log_denials=0)
    app = Flask("breach")

    @app.get("/x")
    @limiter.limit("1/minute")
    def x() -> str:
        return "x"

    limiter.init_app(app)
    client = app.test_client()
    with caplog.at_level(logging.WARNING, logger="nanolimit.denials"):
        assert _statuses(client, "/x", 3, environ_base=IP_A) == [200, 429, 429]
    assert len(breaches) == 2
    req, outcome = breaches[0]
    assert req.path == "/x" and req.route == "/x" and req.client == "192.0.2.1"
    assert outcome.allowed is False and outcome.rule.endswith(".x")
    records = [r for r in caplog.records if r.name == "nanolimit.denials"]
    assert len(records) == 2 and "path='/x'" in records[0].getMessage()


def test_the_apps_errorhandlers_answer_the_denial(backend: types.SimpleNamespace) -> None:
    for by in (429, RateLimitExceeded):
        limiter = _limiter(backend)
        app = Flask(f"handler-{by}")
        caught: list[Any] = []

        @app.errorhandler(by)
        def too_many(exc: Any) -> Any:
            caught.append(exc)
            return jsonify(message="slow down", rule=exc.outcome.rule), 429

        @app.get("/")
        @limiter.limit("1/minute")
        def home() -> str:
            return "home"

        limiter.init_app(app)
        client = app.test_client()
        assert client.get("/").status_code == 200
        denied = client.get("/")
        assert denied.status_code == 429
        assert denied.get_json()["message"] == "slow down"
        assert isinstance(caught[0], RateLimitExceeded)
        # the handler's response still carries the limiter's headers
        assert int(denied.headers["Retry-After"]) >= 1 and denied.headers["X-RateLimit-Remaining"] == "0"


def test_a_denial_is_answered_as_the_app_answers_http_errors(backend: types.SimpleNamespace) -> None:
    """No handler of the app's own: the limiter's 429 (JSON body, headers),
    with no exception raised through Flask. A blueprint's handler, a
    handler of a class above RateLimitExceeded, an app class that handles
    HTTP errors its own way and TRAP_HTTP_EXCEPTIONS all see it as before."""
    from werkzeug.exceptions import HTTPException

    seen: list[str] = []

    class OwnErrors(Flask):
        def handle_http_exception(self, e: Any) -> Any:
            seen.append(f"app class {e.code}")
            return super().handle_http_exception(e)

    def app_with(cls: type[Flask] = Flask, **config: Any) -> Flask:
        limiter = _limiter(backend)
        app = cls(f"errors-{len(seen)}-{sorted(config)}")
        app.config.update(config)
        bp = Blueprint("bp", __name__)

        @bp.errorhandler(429)
        def bp_handler(exc: Any) -> Any:
            seen.append("blueprint")
            return "bp says slow down", 429

        @bp.get("/b")
        @limiter.limit("1/minute")
        def b() -> str:
            return "b"

        @app.get("/a")
        @limiter.limit("1/minute")
        def a() -> str:
            return "a"

        app.register_blueprint(bp)
        limiter.init_app(app)
        return app

    client = app_with().test_client()
    assert client.get("/a").status_code == 200
    denied = client.get("/a")
    assert denied.status_code == 429 and denied.get_json()["rule"].endswith(".a")
    assert denied.headers["Content-Type"] == "application/json"
    assert int(denied.headers["Retry-After"]) >= 1 and denied.headers["X-RateLimit-Remaining"] == "0"
    assert denied.headers["Content-Length"] == str(len(denied.data))
    assert seen == []
    assert client.get("/b").status_code == 200
    assert client.get("/b").data == b"bp says slow down" and seen == ["blueprint"]

    app = app_with()

    @app.errorhandler(HTTPException)
    def any_http(exc: Any) -> Any:
        seen.append(f"HTTPException {type(exc).__name__}")
        return "http error", exc.code

    client = app.test_client()
    client.get("/a")
    assert client.get("/a").data == b"http error" and seen[-1] == "HTTPException RateLimitExceeded"

    client = app_with(OwnErrors).test_client()
    client.get("/a")
    assert client.get("/a").status_code == 429 and seen[-1] == "app class 429"

    client = app_with(TRAP_HTTP_EXCEPTIONS=True, TESTING=True).test_client()
    client.get("/a")
    with pytest.raises(RateLimitExceeded):
        client.get("/a")


def test_a_denial_no_handler_takes_is_never_raised_through_flask(backend: types.SimpleNamespace) -> None:
    """Under a flood most requests are denials: with no 429 handler of the
    app's own, the 429 is answered without Flask's exception machinery
    (which cost more than serving the view); with one, that handler is
    called with the ``RateLimitExceeded``, still without raising it."""
    import sys

    hooks = {Flask.handle_user_exception.__code__, Flask.handle_http_exception.__code__}

    def entered_during(client: Any) -> list[str]:
        called: list[str] = []

        def profile(frame: Any, event: str, arg: Any) -> None:
            if event == "call" and frame.f_code in hooks:
                called.append(frame.f_code.co_name)

        sys.setprofile(profile)
        try:
            status = client.get("/").status_code
        finally:
            sys.setprofile(None)
        assert status == 429
        return called

    for with_handler in (False, True):
        limiter = _limiter(backend)
        app = Flask(f"no-raise-{with_handler}")

        @app.get("/")
        @limiter.limit("1/minute")
        def home() -> str:
            return "home"

        handled: list[str] = []
        if with_handler:

            def own(exc: Any) -> Any:
                handled.append(type(exc).__name__)
                return "own 429", 429

            app.register_error_handler(429, own)
        limiter.init_app(app)
        client = app.test_client()
        assert client.get("/").status_code == 200
        assert entered_during(client) == []  # the app's handler, if any, called directly
        assert handled == (["RateLimitExceeded"] if with_handler else [])


def test_custom_deny_builds_the_response(backend: types.SimpleNamespace) -> None:
    calls: list[Any] = []

    def deny(req: nanolimit.Request, outcome: nanolimit.Outcome) -> Any:
        calls.append(req.native.path)
        return f"wait {outcome.retry_after}s", 503, {"Retry-After": "99"}

    limiter = _limiter(backend, deny=deny)
    app = Flask("deny")
    ran: list[int] = []

    @app.get("/")
    @limiter.limit("1/minute")
    def home() -> str:
        ran.append(1)
        return "home"

    limiter.init_app(app)
    client = app.test_client()
    client.get("/")
    denied = client.get("/")
    assert denied.status_code == 503 and denied.data.startswith(b"wait ")
    assert denied.headers["Retry-After"] == "99"  # what deny wrote is kept
    assert calls == ["/"] and ran == [1]


# ---------------------------------------------------------------------------
# Config


def test_ratelimit_config_keys(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)

    @limiter.limit("2/minute")
    def plain() -> str:
        return "plain"

    @limiter.limit("2/minute", algorithm="gcra")
    def own_algorithm() -> str:
        return "own"

    app = Flask("config")
    app.config.update(
        RATELIMIT_SCOPE="global",
        RATELIMIT_ALGORITHM="fixed-window",
        RATELIMIT_TRUSTED_PROXIES=["10.0.0.0/8"],
    )
    app.add_url_rule("/plain", view_func=plain)
    app.add_url_rule("/own", view_func=own_algorithm)
    limiter.init_app(app)
    rules = {r.name.rsplit(".", 1)[-1]: r for r in limiter.check_routes(app)}
    assert rules["plain"].algorithm is Algorithm.FIXED_WINDOW and rules["plain"].scope is KeyScope.GLOBAL
    assert rules["own_algorithm"].algorithm is Algorithm.GCRA
    client = app.test_client()
    # global: two clients share one budget
    assert client.get("/plain", environ_base=IP_A).status_code == 200
    assert client.get("/plain", environ_base=IP_B).status_code == 200
    assert client.get("/plain", environ_base=IP_A).status_code == 429


def test_trusted_proxies_config_believes_only_the_proxy(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("proxies")
    app.config["RATELIMIT_TRUSTED_PROXIES"] = ["10.0.0.0/8"]

    @app.get("/")
    @limiter.limit("1/minute")
    def home() -> str:
        return "home"

    limiter.init_app(app)
    client = app.test_client()

    def status(peer: str, forwarded: str) -> int:
        reply = client.get("/", environ_base={"REMOTE_ADDR": peer}, headers={"X-Forwarded-For": forwarded})
        return reply.status_code

    # behind the trusted proxy each forwarded client has its own budget
    assert [status("10.1.2.3", f"198.51.100.{i}") for i in (1, 2, 1)] == [200, 200, 429]
    # a client outside the proxy network cannot pick its identity with the header
    assert [status("192.0.2.9", f"198.51.100.{i}") for i in (7, 8)] == [200, 429]


def test_constructor_arguments_win_over_config(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend, key_scope="ip", algorithm="sliding_log", headers=True)
    app = Flask("wins")
    app.config.update(RATELIMIT_SCOPE="global", RATELIMIT_ALGORITHM="gcra", RATELIMIT_HEADERS_ENABLED=False)

    @app.get("/")
    @limiter.limit("1/minute")
    def home() -> str:
        return "home"

    limiter.init_app(app)
    (rule,) = limiter.check_routes(app)
    assert rule.scope is KeyScope.IP and rule.algorithm is Algorithm.SLIDING_LOG
    assert "RateLimit-Policy" in app.test_client().get("/").headers


def test_ratelimit_enabled_false_turns_every_limit_off(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend, default_limits="1/minute")
    app = Flask("off")
    app.config["RATELIMIT_ENABLED"] = False

    @app.get("/")
    @limiter.limit("1/minute")
    def home() -> str:
        return "home"

    wsgi_app = app.wsgi_app
    limiter.init_app(app)
    reply_statuses = _statuses(app.test_client(), "/", 5)
    assert reply_statuses == [200] * 5
    assert "RateLimit-Policy" not in app.test_client().get("/").headers
    # off costs nothing: no hook, nothing around the app
    assert app.wsgi_app == wsgi_app and not any(app.before_request_funcs.values())


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("RATELIMIT_STORAGE_URL", "memory://", "did you mean RATELIMIT_STORAGE_URI"),
        ("RATELIMIT_DEFAULTS_PER_METHOD", True, "unknown config key RATELIMIT_DEFAULTS_PER_METHOD"),
    ],
)
def test_unknown_config_key_is_named_with_the_accepted_ones(key: str, value: Any, message: str) -> None:
    app = Flask("unknown")
    app.config[key] = value
    with pytest.raises(ValidationError, match=message) as info:
        Limiter(app)
    for accepted in CONFIG_KEYS:
        assert accepted in str(info.value)
    assert "nanolimit" not in app.extensions  # nothing was installed


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("RATELIMIT_SCOPE", "tenant", "RATELIMIT_SCOPE: unknown scope 'tenant'"),
        ("RATELIMIT_ALGORITHM", "bogus", "RATELIMIT_ALGORITHM"),
        ("RATELIMIT_DEFAULT", "lots", "RATELIMIT_DEFAULT"),
        ("RATELIMIT_HEADERS_ENABLED", "yes", "RATELIMIT_HEADERS_ENABLED: must be a bool"),
        ("RATELIMIT_ENABLED", 0, "RATELIMIT_ENABLED must be a bool"),
        ("RATELIMIT_TRUSTED_PROXIES", ["not-a-network"], "RATELIMIT_TRUSTED_PROXIES"),
        ("RATELIMIT_HEADER_NAMES", {"X-Nope": "X-A"}, "X-Nope"),
    ],
)
def test_bad_config_values_are_named(key: str, value: Any, message: str) -> None:
    app = Flask("bad-value")
    app.config[key] = value
    with pytest.raises(ValidationError, match=message):
        Limiter(app)


def test_storage_uri_from_config_and_a_storage_object(backend: types.SimpleNamespace) -> None:
    pytest.importorskip("nanolimit.storage.uri")
    for make in ("uri", "object"):
        limiter = Limiter(storage=backend.InMemoryStorage()) if make == "object" else Limiter()
        app = Flask(f"storage-{make}")
        if make == "uri":
            app.config["RATELIMIT_STORAGE_URI"] = "memory://?max_keys=1000"

        @app.get("/")
        @limiter.limit("1/minute")
        def home() -> str:
            return "home"

        limiter.init_app(app)
        assert _statuses(app.test_client(), "/", 2) == [200, 429]
        storage = limiter.pipeline(app).factory.storage
        if make == "object":
            assert isinstance(storage, backend.InMemoryStorage)
        else:
            assert isinstance(storage, nanolimit.InMemoryStorage)


def test_one_limiter_serves_an_application_factory(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend, storage=None)

    @limiter.limit("2/minute")
    def home() -> str:
        return "home"

    def create_app(**config: Any) -> Flask:
        app = Flask("factory")
        app.config.update(config)
        app.add_url_rule("/", view_func=home)
        limiter.init_app(app)
        limiter.check_routes(app)
        return app

    strict = create_app(RATELIMIT_DEFAULT="1/minute")
    testing = create_app(RATELIMIT_ENABLED=False)
    again = create_app()
    assert _statuses(strict.test_client(), "/", 3) == [200, 200, 429]
    assert _statuses(testing.test_client(), "/", 3) == [200] * 3
    assert _statuses(again.test_client(), "/", 3) == [200, 200, 429]  # its own store
    assert limiter.pipeline(strict) is not limiter.pipeline(again)
    with pytest.raises(ValidationError, match="already initialised"):
        limiter.init_app(strict)


def test_a_registry_serves_one_app(backend: types.SimpleNamespace) -> None:
    registry = RuleRegistry()
    limiter = _limiter(backend, rules=registry)
    limiter.init_app(Flask("first"))
    with pytest.raises(ValidationError, match="another app"):
        limiter.init_app(Flask("second"))


# ---------------------------------------------------------------------------
# Checked when written, and at startup


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"rate": "5 per fortnight"}, "limit '5 per fortnight'"),
        ({"rate": "5/minute", "algorithm": "leaky-token"}, "leaky-token"),
        ({"rate": "5/minute", "cost": 0}, r"limit '5/minute': cost: must be >= 1"),
        ({"rate": "5/minute", "cost": 6}, r"limit '5/minute': cost: 6 exceeds the capacity 5"),
        ({"rate": "5/minute", "scope": "tenant"}, "unknown scope 'tenant'"),
    ],
)
def test_a_bad_declaration_raises_when_written(kwargs: dict[str, Any], message: str) -> None:
    limiter = Limiter()
    rate = kwargs.pop("rate")
    with pytest.raises(ValidationError, match=message):

        @limiter.limit(rate, **kwargs)
        def view() -> str:
            return "never"


def test_check_routes_names_a_rule_whose_route_does_not_exist(backend: types.SimpleNamespace) -> None:
    registry = RuleRegistry(
        [RateLimitRule("typo", "*", "/", "ip", "token_bucket", 5, 60.0, routes=("/logn",))]
    )
    limiter = _limiter(backend, rules=registry)
    app = Flask("typo")

    @app.post("/login")
    def login() -> str:
        return "ok"

    limiter.init_app(app)
    with pytest.raises(RuleValidationError, match="typo") as info:
        limiter.check_routes(app)
    assert "'/logn' matches no route of the app" in str(info.value)
    assert info.value.rule == "typo"


def test_routes_added_after_init_app_are_bound_on_the_first_request(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("late")
    limiter.init_app(app)

    @app.get("/late")
    @limiter.limit("1/minute")
    def late() -> str:
        return "late"

    assert _statuses(app.test_client(), "/late", 2) == [200, 429]


# ---------------------------------------------------------------------------
# The user scope


def test_flask_login_current_user_is_the_user_scope(backend: types.SimpleNamespace) -> None:
    flask_login = pytest.importorskip("flask_login")

    class User(flask_login.UserMixin):
        def __init__(self, uid: str) -> None:
            self.id = uid

    limiter = _limiter(backend)
    app = Flask("users")
    app.secret_key = "test"
    manager = flask_login.LoginManager(app)
    manager.user_loader(User)

    @app.post("/login/<uid>")
    def login(uid: str) -> str:
        flask_login.login_user(User(uid))
        return "in"

    @app.get("/me")
    @limiter.limit("2/minute", scope="user")
    def me() -> str:
        return str(getattr(flask_login.current_user, "id", "anonymous"))

    limiter.init_app(app)
    alice = app.test_client()
    alice.post("/login/alice", environ_base=IP_A)
    # one user from two addresses: one budget
    assert alice.get("/me", environ_base=IP_A).status_code == 200
    assert alice.get("/me", environ_base=IP_B).status_code == 200
    assert alice.get("/me", environ_base=IP_A).status_code == 429
    # another user from the same address: a budget of their own
    bob = app.test_client()
    bob.post("/login/bob", environ_base=IP_A)
    assert bob.get("/me", environ_base=IP_A).status_code == 200
    # an anonymous caller is keyed by its IP, and a header names nobody
    anon = app.test_client()
    statuses = [
        anon.get("/me", environ_base={"REMOTE_ADDR": "192.0.2.50"}, headers={"X-User": f"u{i}"}).status_code
        for i in range(3)
    ]
    assert statuses == [200, 200, 429]


def test_remote_user_without_flask_login(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("remote-user")

    @app.get("/")
    @limiter.limit("1/minute", scope="user")
    def home() -> str:
        return "home"

    limiter.init_app(app)
    client = app.test_client()
    assert client.get("/", environ_base={**IP_A, "REMOTE_USER": "carol"}).status_code == 200
    assert client.get("/", environ_base={**IP_B, "REMOTE_USER": "carol"}).status_code == 429
    assert client.get("/", environ_base={**IP_A, "REMOTE_USER": "dave"}).status_code == 200


def test_metrics_count_the_apps_decisions(backend: types.SimpleNamespace) -> None:
    metrics = nanolimit.Metrics()
    limiter = _limiter(backend, metrics=metrics)
    app = Flask("metrics")

    @app.get("/")
    @limiter.limit("1/minute")
    def home() -> str:
        return "home"

    limiter.init_app(app)
    _statuses(app.test_client(), "/", 3)
    assert limiter.pipeline(app).metrics is metrics
    (counts,) = metrics.snapshot().values()
    assert counts["allowed"] == 1 and counts["denied"] == 2


def test_the_429_body_is_the_pipelines(backend: types.SimpleNamespace) -> None:
    limiter = _limiter(backend)
    app = Flask("body")

    @app.get("/")
    @limiter.limit("1/minute")
    def home() -> str:
        return "home"

    limiter.init_app(app)
    client = app.test_client()
    client.get("/")
    denied = client.get("/")
    assert json.loads(denied.data) == {
        "error": "rate_limit_exceeded",
        "rule": denied.get_json()["rule"],
        "retry_after": int(denied.headers["Retry-After"]),
    }


def test_abort_401_counts_and_head_spends_the_get_budget(backend: types.SimpleNamespace) -> None:
    """A failure answered by ``abort(401)`` (an HTTPException Flask turns
    into the response) is the status the response starts with; a ``GET``
    limit covers ``HEAD``, which Flask answers with the GET view."""
    from flask import abort

    limiter = _limiter(backend)
    app = Flask("abort")

    @app.get("/token")
    @limiter.limit("2/hour", methods=["GET"], count_when={401})
    def token() -> str:
        abort(401)

    limiter.init_app(app)
    client = app.test_client()
    assert client.head("/token").status_code == 401
    assert client.get("/token").status_code == 401
    assert client.get("/token").status_code == 429


def test_a_rate_header_the_app_sets_itself_is_kept_and_not_repeated(backend: types.SimpleNamespace) -> None:
    """The limiter writes its headers as the response starts, but not one a
    response already carries, however the app spelt it; responses between
    them (whose names the extension remembers as none of its own) get all."""
    limiter = _limiter(backend)
    app = Flask("own-headers")

    @app.get("/<name>")
    @limiter.limit("100/hour")
    def own(name: str) -> Any:
        if name == "plain":
            return "plain", 200, {"X-Other": "1"}
        return "own", 200, {name: "mine", "X-Other": "1"}

    limiter.init_app(app)
    client = app.test_client()
    names = ("plain", "X-RateLimit-Remaining", "plain", "x-ratelimit-remaining", "X-RATELIMIT-LIMIT", "plain")
    for name in names:
        pairs = [(k.lower(), v) for k, v in client.get(f"/{name}").headers.items()]
        rate = [pair for pair in pairs if pair[0].startswith("x-ratelimit-")]
        if name == "plain":
            assert {k for k, _ in rate} == {"x-ratelimit-limit", "x-ratelimit-remaining", "x-ratelimit-reset"}
        else:
            assert (name.lower(), "mine") in rate and len(rate) == 3, pairs  # theirs, and our other two
        assert len({k for k, _ in pairs}) == len(pairs), pairs  # no header twice


def test_the_status_that_counts_is_the_one_the_client_gets(backend: types.SimpleNamespace) -> None:
    """An ``after_request`` hook of the app's own may change the status: the
    charge is settled with the status the response starts with."""
    limiter = _limiter(backend)
    app = Flask("after-hook")

    @app.get("/login")
    @limiter.limit("2/hour", count_when={401})
    def login() -> str:
        return "ok"

    @app.after_request
    def deny_bad_passwords(response: Any) -> Any:
        if response.status_code == 200 and request.args.get("password") != "right":
            response.status_code = 401
        return response

    limiter.init_app(app)
    client = app.test_client()
    assert _statuses(client, "/login?password=right", 4) == [200] * 4  # refunded: 200 does not count
    assert _statuses(client, "/login", 3) == [401, 401, 429]


def _counting_app(backend: types.SimpleNamespace, name: str) -> Flask:
    """An app whose one route allows one uncounted-by-200 request an hour:
    a second 200 in a row is answered only if the first was settled."""
    limiter = _limiter(backend)
    app = Flask(name)

    @app.get("/")
    @limiter.limit("1/hour", count_when={401})
    def home() -> str:
        return "home"

    limiter.init_app(app)
    return app


def test_middleware_added_around_the_app_keeps_headers_and_settlement(backend: types.SimpleNamespace) -> None:
    app = _counting_app(backend, "wrapped-after")
    inner = app.wsgi_app
    seen: list[str] = []

    def outer(environ: dict[str, Any], start_response: Any) -> Any:
        def start(status: str, headers: list[tuple[str, str]], *exc_info: Any) -> Any:
            seen.append(dict(headers)["X-RateLimit-Limit"])  # ours, before this middleware's turn
            return start_response(status, [*headers, ("X-Outer", "1")], *exc_info)

        return inner(environ, start)

    app.wsgi_app = outer  # type: ignore[method-assign]
    client = app.test_client()
    replies = [client.get("/") for _ in range(3)]
    assert [r.status_code for r in replies] == [200] * 3
    assert seen == ["1"] * 3 and all(r.headers["X-Outer"] == "1" for r in replies)


def test_a_request_outside_the_apps_wsgi_app_is_still_answered_and_settled(
    backend: types.SimpleNamespace,
) -> None:
    """A request context pushed by hand, or a ``wsgi_app`` replaced by one
    that never calls the extension's: the headers and the settlement go
    through the response object as Flask finalises it."""
    app = _counting_app(backend, "by-hand")
    for _ in range(3):
        with app.test_request_context("/", environ_base=IP_A):
            response = app.full_dispatch_request()
        assert response.status_code == 200 and response.headers["X-RateLimit-Limit"] == "1"

    replaced = _counting_app(backend, "replaced")
    replaced.wsgi_app = lambda environ, start: Flask.wsgi_app(replaced, environ, start)  # type: ignore[method-assign]
    client = replaced.test_client()
    replies = [client.get("/") for _ in range(3)]
    assert [r.status_code for r in replies] == [200] * 3
    assert all(r.headers["X-RateLimit-Remaining"] == "0" for r in replies)


def test_the_extension_decides_through_the_pipelines_public_decide(
    backend: types.SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gateway_helpers import audit_decisions

    log = audit_decisions(monkeypatch)
    limiter = _limiter(backend)
    app = Flask("audited")

    @app.get("/")
    @limiter.limit("2/minute")
    def home() -> str:
        return "ok"

    limiter.init_app(app)
    assert _statuses(app.test_client(), "/", 3) == [200, 200, 429]
    assert log == [True, True, False]


@pytest.mark.parametrize("handler", [False, True], ids=["no-handler", "errorhandler-429"])
def test_a_denial_on_gunicorn_with_and_without_the_apps_429_handler(tmp_path: Path, handler: bool) -> None:
    """A real server's denial: the JSON 429 when the app has no handler of
    its own, the app's ``errorhandler(429)`` answer when it has one; the
    rate-limit headers on both."""
    with _served(tmp_path, 2, handler) as port:
        replies = [raw_request(port, "POST", b"/login?password=wrong") for _ in range(3)]
    assert [r.status for r in replies] == [401, 401, 429]
    denied = replies[-1]
    body = json.loads(denied.body)
    if handler:
        assert body == {"own": True, "rule": "flask_apps.login"}
    else:
        assert body["error"] == "rate_limit_exceeded" and body["rule"] == "flask_apps.login"
    assert int(denied.headers["retry-after"]) >= 1 and denied.headers["x-ratelimit-remaining"] == "0"
