"""In process, no sockets: what nanolimit's ASGI and WSGI middlewares add to
a bare app, next to a middleware that only appends five fixed headers.

    python bench/asgi_inprocess.py              # 201 rounds of 2,000 calls per variant
    python bench/asgi_inprocess.py --quick      # a smoke run
    python bench/asgi_inprocess.py --json       # the figures as JSON
    python bench/asgi_inprocess.py --frameworks # Flask (extension, WSGI middleware), Django, aiohttp

Each variant is called directly with one prebuilt scope (environ) and no-op
``receive`` / ``send`` (``start_response``). An ASGI call is driven by hand
(``coroutine.send(None)``): nothing in these apps awaits anything that
suspends, so no event loop runs and none is measured. Rounds interleave the
variants; per variant the median of the rounds' ns per call, and ``added``:
the median of each round's difference from ``bare`` (the pairs are timed
seconds apart, so a noisy minute cancels out). ``nanolimit_denied`` (limit 1)
answers 429 from its second call on: its figure is what a 429 costs.
``nanolimit_route`` (ASGI only) declares the same limit on a route
(``RouteLimits``) and finds it through ``scope["app"]``, a Starlette router
holding that route; ``nanolimit_counted`` counts only 401s, so each request
is charged and then refunded on its 200.

Before anything is timed every variant's answer is checked (200 or 429,
the headers it claims); tests/test_bench_http.py runs that check too.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any, cast

BENCH = Path(__file__).resolve().parent
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from http_apps import (  # noqa: E402
    HUGE,
    RATE_HEADER_NAMES,
    ASGIApp,
    HeaderOnlyASGI,
    HeaderOnlyWSGI,
    Message,
    WSGIApp,
    bare_asgi,
    bare_wsgi,
    nanolimit_asgi,
    nanolimit_registry,
    nanolimit_wsgi,
    peer_rate,
)

ROUNDS, CALLS = 201, 2000
QUICK_ROUNDS, QUICK_CALLS = 21, 300

# what uvicorn would hand the app for `GET /` from 127.0.0.1 (one prebuilt
# object: building it per request is the server's cost, not the middleware's)
SCOPE: dict[str, Any] = {
    "type": "http",
    "asgi": {"version": "3.0", "spec_version": "2.3"},
    "http_version": "1.1",
    "server": ("127.0.0.1", 8000),
    "client": ("127.0.0.1", 50000),
    "scheme": "http",
    "method": "GET",
    "root_path": "",
    "path": "/",
    "raw_path": b"/",
    "query_string": b"",
    "headers": [(b"host", b"127.0.0.1:8000"), (b"user-agent", b"bench"), (b"accept", b"*/*")],
    "state": {},
}
ENVIRON: dict[str, Any] = {
    "REQUEST_METHOD": "GET",
    "SCRIPT_NAME": "",
    "PATH_INFO": "/",
    "QUERY_STRING": "",
    "SERVER_NAME": "127.0.0.1",
    "SERVER_PORT": "8000",
    "SERVER_PROTOCOL": "HTTP/1.1",
    "REMOTE_ADDR": "127.0.0.1",
    "HTTP_HOST": "127.0.0.1:8000",
    "HTTP_USER_AGENT": "bench",
    "wsgi.url_scheme": "http",
}

# name -> whether its answers carry the five rate headers, and its limit (1: denied)
VARIANTS: dict[str, tuple[bool, int | None]] = {
    "bare": (False, None),
    "headers_only": (True, None),
    "nanolimit": (True, HUGE),
    "nanolimit_denied": (True, 1),
    "nanolimit_route": (True, HUGE),
    "nanolimit_counted": (True, HUGE),
}
COUNTED = frozenset({401})  # the app answers 200: every request is refunded

# the scope a variant is called with, where it is not SCOPE (asgi_variants() fills it)
SCOPES: dict[str, dict[str, Any]] = {}


def _asgi_route(limit: int) -> tuple[ASGIApp, dict[str, Any]]:
    """nanolimit's middleware over ``bare_asgi`` with the limit declared on a
    route, and the scope whose ``app`` holds that route (what Starlette puts
    in every scope): the middleware binds to it at the first call."""
    from starlette.routing import Route, Router

    from nanolimit.asgi import RateLimitMiddleware
    from nanolimit.gateway.routes import RouteLimits

    limits = RouteLimits()

    @limits.limit(peer_rate(limit), algorithm="fixed_window")
    async def index(request: Any) -> None:  # never called: bare_asgi answers
        raise AssertionError("the declared view is only read for its route")

    app = RateLimitMiddleware(bare_asgi, limits=limits)
    return app, {**SCOPE, "app": Router(routes=[Route("/", index)])}


def asgi_variants() -> dict[str, ASGIApp]:
    """Fresh apps (a nanolimit one has its own storage: a denied one starts
    with its one admitted request unspent)."""
    from nanolimit.asgi import RateLimitMiddleware
    from nanolimit.gateway.factory import LimiterFactory

    route, SCOPES["nanolimit_route"] = _asgi_route(HUGE)
    return {
        "bare": bare_asgi,
        "headers_only": HeaderOnlyASGI(bare_asgi),
        "nanolimit": nanolimit_asgi(bare_asgi, HUGE),
        "nanolimit_denied": nanolimit_asgi(bare_asgi, 1),
        "nanolimit_route": route,
        "nanolimit_counted": RateLimitMiddleware(
            bare_asgi, nanolimit_registry(HUGE, count_when=COUNTED), LimiterFactory()
        ),
    }


def wsgi_variants() -> dict[str, WSGIApp]:
    """The WSGI twins (no route-level row: that needs a framework's routes)."""
    from nanolimit.gateway.factory import LimiterFactory
    from nanolimit.wsgi import RateLimitMiddleware

    return {
        "bare": bare_wsgi,
        "headers_only": HeaderOnlyWSGI(bare_wsgi),
        "nanolimit": nanolimit_wsgi(bare_wsgi, HUGE),
        "nanolimit_denied": nanolimit_wsgi(bare_wsgi, 1),
        "nanolimit_counted": RateLimitMiddleware(
            bare_wsgi, nanolimit_registry(HUGE, count_when=COUNTED), LimiterFactory()
        ),
    }


async def _receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


async def _send(message: Message) -> None:
    return None


def call_asgi(app: ASGIApp, send: Callable[[Message], Any] = _send, scope: dict[str, Any] = SCOPE) -> None:
    """One request, driven without an event loop."""
    coro = cast("Coroutine[Any, Any, None]", app(scope, _receive, send))
    try:
        coro.send(None)
    except StopIteration:
        return
    coro.close()
    raise RuntimeError("the app suspended: it needs an event loop")


def _start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
    return None


def call_wsgi(
    app: WSGIApp, start_response: Callable[..., Any] = _start_response, environ: dict[str, Any] = ENVIRON
) -> bytes:
    """One request, the body iterated and closed as a server does."""
    body = app(environ, start_response)
    try:
        return b"".join(body)
    finally:
        close = getattr(body, "close", None)
        if close is not None:
            close()


def asgi_answers(
    app: ASGIApp, calls: int, scope: dict[str, Any] = SCOPE
) -> list[tuple[int, dict[str, str], bytes]]:
    """Each call's status, lower-case headers and body, as ``send`` saw them."""
    out: list[tuple[int, dict[str, str], bytes]] = []
    for _ in range(calls):
        seen: list[Message] = []

        async def record(message: Message) -> None:
            seen.append(message)

        call_asgi(app, record, scope)
        start = next(m for m in seen if m["type"] == "http.response.start")
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in start.get("headers", ())}
        body = b"".join(m.get("body", b"") for m in seen if m["type"] == "http.response.body")
        out.append((start["status"], headers, body))
    return out


def wsgi_answers(app: WSGIApp, calls: int) -> list[tuple[int, dict[str, str], bytes]]:
    out: list[tuple[int, dict[str, str], bytes]] = []
    for _ in range(calls):
        seen: list[tuple[str, list[tuple[str, str]]]] = []

        def start(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> None:
            seen.append((status, headers))

        body = call_wsgi(app, start)
        status, headers = seen[-1]
        out.append((int(status.split()[0]), {k.lower(): v for k, v in headers}, body))
    return out


def check(name: str, answers: Sequence[tuple[int, dict[str, str], bytes]]) -> None:
    """The variant answered what it is timed for, or nothing is timed."""
    with_headers, limit = VARIANTS[name]
    want = [429 if limit == 1 and i else 200 for i in range(len(answers))]
    got = [status for status, _, _ in answers]
    if got != want:
        raise RuntimeError(f"{name}: statuses {sorted(set(got))}, expected {sorted(set(want))}")
    for status, headers, body in answers:
        lacking = [h for h in RATE_HEADER_NAMES if h not in headers]
        if with_headers and lacking:
            raise RuntimeError(f"{name}: an answer without {', '.join(lacking)}")
        if not with_headers and any(h in headers for h in RATE_HEADER_NAMES):
            raise RuntimeError(f"{name}: rate headers on an app that has none")
        if status == 200 and body != b"ok":
            raise RuntimeError(f"{name}: answered {body[:100]!r}")


def _time_asgi(
    app: Callable[..., Coroutine[Any, Any, None]], calls: int, scope: dict[str, Any] = SCOPE
) -> float:
    receive, send = _receive, _send
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        coro = app(scope, receive, send)
        try:
            coro.send(None)
        except StopIteration:  # the call returned (suppress() would time a context manager)
            continue
    return (time.perf_counter_ns() - t0) / calls


def _time_wsgi(app: WSGIApp, calls: int, scope: Any = None) -> float:
    environ, start = ENVIRON, _start_response
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        for _chunk in app(environ, start):
            pass
    return (time.perf_counter_ns() - t0) / calls


def _figures(per_round: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    bare = per_round["bare"]
    out: dict[str, dict[str, float]] = {}
    for name, ns in per_round.items():
        row = {
            "ns_median": round(statistics.median(ns), 1),
            "ns_min": round(min(ns), 1),
            "ns_q1": round(statistics.quantiles(ns, n=4)[0], 1) if len(ns) > 1 else round(ns[0], 1),
            "ns_q3": round(statistics.quantiles(ns, n=4)[2], 1) if len(ns) > 1 else round(ns[0], 1),
        }
        if name != "bare":
            row["added_ns"] = round(statistics.median(a - b for a, b in zip(ns, bare)), 1)
        out[name] = row
    if "headers_only" in out and "nanolimit" in out:
        diffs = (a - b for a, b in zip(per_round["nanolimit"], per_round["headers_only"]))
        out["nanolimit"]["over_headers_only_ns"] = round(statistics.median(diffs), 1)
    for name in ("nanolimit_route", "nanolimit_counted"):
        # the brief's ratios: each against the plain prefix rule, round by round
        if name in out and "nanolimit" in out:
            ratios = (a / b for a, b in zip(per_round[name], per_round["nanolimit"]))
            out[name]["over_nanolimit_ratio"] = round(statistics.median(ratios), 3)
    return out


def measure(rounds: int = ROUNDS, calls: int = CALLS) -> dict[str, Any]:
    """Both protocols' figures: ``{"asgi": {variant: {...}}, "wsgi": ...}``."""
    import nanolimit

    asgi, wsgi = asgi_variants(), wsgi_variants()
    for name, app in asgi.items():
        check(name, asgi_answers(app, 3, SCOPES.get(name, SCOPE)))
    for name, wapp in wsgi.items():
        check(name, wsgi_answers(wapp, 3))
    timers: list[tuple[str, Callable[[Any, int, Any], float], dict[str, Any]]] = [
        ("asgi", _time_asgi, dict(asgi)),
        ("wsgi", _time_wsgi, dict(wsgi)),
    ]
    per_round: dict[str, dict[str, list[float]]] = {kind: {n: [] for n in apps} for kind, _, apps in timers}
    scopes: dict[str, dict[str, dict[str, Any] | None]] = {
        "asgi": {n: SCOPES.get(n, SCOPE) for n in asgi},
        "wsgi": dict.fromkeys(wsgi),
    }
    for kind, timer, apps in timers:
        for name, app in apps.items():
            timer(app, calls, scopes[kind][name])  # warm: caches, the native Decision pool
    for n in range(rounds):
        for kind, timer, apps in timers:
            names = list(apps) if n % 2 == 0 else list(apps)[::-1]
            for name in names:
                per_round[kind][name].append(timer(apps[name], calls, scopes[kind][name]))
        if n % 16 == 15:
            gc.collect()  # a full collection between rounds, not inside a timed block
    # still on the path that was timed: a denied app denies, the others admit
    after = {f"asgi/{n}": asgi_answers(a, 1, SCOPES.get(n, SCOPE))[0][0] for n, a in asgi.items()}
    after.update({f"wsgi/{n}": wsgi_answers(a, 1)[0][0] for n, a in wsgi.items()})
    wrong = {k: s for k, s in after.items() if s != (429 if VARIANTS[k.split("/")[1]][1] == 1 else 200)}
    if wrong:
        raise RuntimeError(f"answers changed while timed: {wrong}")
    return {
        "implementation": nanolimit.IMPLEMENTATION,
        "rounds": rounds,
        "calls": calls,
        "asgi": _figures(per_round["asgi"]),
        "wsgi": _figures(per_round["wsgi"]),
    }


# ---------------------------------------------------------------------------
# Frameworks: Flask, Django and aiohttp apps in process (``--frameworks``)

FRAMEWORK_ROWS = ("bare", "nanolimit", "nanolimit_denied")


def _flask_call(app: Any) -> Callable[[], Any]:
    from werkzeug.test import EnvironBuilder

    environ = EnvironBuilder(path="/", environ_base={"REMOTE_ADDR": "127.0.0.1"}).get_environ()
    wsgi = app.wsgi_app if hasattr(app, "wsgi_app") else app

    def call() -> Any:
        seen: list[int] = []
        body = wsgi(dict(environ), lambda status, headers, exc_info=None: seen.append(int(status[:3])))
        b"".join(body)
        getattr(body, "close", lambda: None)()
        return seen[-1]

    return call


def _django_calls() -> dict[str, Callable[[], Any]]:
    """One process, one Django: a bare handler, one through nanolimit's
    middleware (``/limited`` declared with ``@limit`` at a limit no run
    spends, ``/denied`` at 1 an hour), and nanolimit's WSGI middleware
    around the bare handler (one prefix rule: the same decision without
    Django's hooks, the fair floor of the Django integration)."""
    import django
    from django.conf import settings

    if not settings.configured:
        settings.configure(
            SECRET_KEY="bench",
            ALLOWED_HOSTS=["*"],
            ROOT_URLCONF=__name__,
            INSTALLED_APPS=[],
            MIDDLEWARE=[],
            NANOLIMIT={"LOG_DENIALS": None},
            USE_TZ=True,
            LOGGING_CONFIG=None,
        )
        django.setup()
    from django.core.handlers.wsgi import WSGIHandler
    from django.test import RequestFactory, override_settings

    bare = WSGIHandler()
    with override_settings(MIDDLEWARE=["nanolimit.django.RateLimitMiddleware"]):
        limited = WSGIHandler()
    factory = RequestFactory()

    def caller(handler: Any, path: str) -> Callable[[], Any]:
        environ = factory._base_environ(PATH_INFO=path, REQUEST_METHOD="GET", REMOTE_ADDR="127.0.0.1")

        def call() -> Any:
            seen: list[int] = []
            body = handler(dict(environ), lambda status, headers, exc_info=None: seen.append(int(status[:3])))
            b"".join(body)
            getattr(body, "close", lambda: None)()
            return seen[-1]

        return call

    return {
        "bare": caller(bare, "/limited"),
        "nanolimit": caller(limited, "/limited"),
        "nanolimit_denied": caller(limited, "/denied"),
        "nanolimit_wsgi": caller(nanolimit_wsgi(bare, HUGE), "/limited"),
        "nanolimit_wsgi_denied": caller(nanolimit_wsgi(bare, 1), "/limited"),
    }


def _django_urls() -> list[Any]:
    from django.http import HttpResponse
    from django.urls import path

    from nanolimit.django import limit

    @limit(peer_rate(HUGE), algorithm="fixed_window")
    def limited(request: Any) -> Any:
        return HttpResponse("ok", content_type="text/plain")

    @limit(peer_rate(1), algorithm="fixed_window")
    def denied(request: Any) -> Any:
        return HttpResponse("ok", content_type="text/plain")

    return [path("limited", limited), path("denied", denied)]


def __getattr__(name: str) -> Any:  # Django's URLconf: this module, its patterns made when first asked
    if name == "urlpatterns":
        return _django_urls()
    raise AttributeError(name)


def _aiohttp_calls() -> dict[str, Callable[[], Any]]:
    """aiohttp's middleware called by hand on one mocked, routed request (no
    event loop runs: nothing here suspends)."""
    import asyncio

    from aiohttp import web
    from aiohttp.test_utils import make_mocked_request

    from nanolimit.aiohttp import rate_limit_middleware
    from nanolimit.gateway.factory import LimiterFactory

    async def index(request: Any) -> Any:
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_get("/", index)
    request = make_mocked_request("GET", "/", app=app)
    loop = asyncio.new_event_loop()
    try:
        info = loop.run_until_complete(app.router.resolve(request))
    finally:
        loop.close()
    info.add_app(app)
    request._match_info = info
    request._transport_peername = ("127.0.0.1", 50000)

    def caller(middleware: Any) -> Callable[[], Any]:
        def call() -> Any:
            coro = index(request) if middleware is None else middleware(request, index)
            try:
                coro.send(None)
            except StopIteration as done:
                return done.value.status
            raise RuntimeError("the app suspended: it needs an event loop")

        return call

    def limited(limit: int) -> Any:
        return rate_limit_middleware(nanolimit_registry(limit), LimiterFactory(), log_denials=None)

    return {"bare": caller(None), "nanolimit": caller(limited(HUGE)), "nanolimit_denied": caller(limited(1))}


def _flask_calls() -> dict[str, Callable[[], Any]]:
    """Flask's rows: ``nanolimit`` is the extension (a default limit),
    ``nanolimit_wsgi`` nanolimit's WSGI middleware around the same app (one
    prefix rule: the same decision without Flask's hooks, the fair floor of
    the extension); ``nanolimit_counted``: the extension's limit counting
    only 5xx answers (charged, then given back at ``start_response``)."""
    from http_apps import wsgi_bare, wsgi_nanolimit, wsgi_nanolimit_flask

    return {
        "bare": _flask_call(wsgi_bare("flask", HUGE)),
        "nanolimit": _flask_call(wsgi_nanolimit_flask("flask", HUGE)),
        "nanolimit_denied": _flask_call(wsgi_nanolimit_flask("flask", 1)),
        "nanolimit_counted": _flask_call(wsgi_nanolimit_flask("flask", HUGE, count_when=frozenset({500}))),
        "nanolimit_wsgi": _flask_call(wsgi_nanolimit("flask", HUGE)),
        "nanolimit_wsgi_denied": _flask_call(wsgi_nanolimit("flask", 1)),
    }


def framework_variants() -> dict[str, dict[str, Callable[[], Any]]]:
    """``{framework: {row: call}}``, each call one request answering its
    status."""
    return {"flask": _flask_calls(), "django": _django_calls(), "aiohttp": _aiohttp_calls()}


def check_framework(name: str, call: Callable[[], Any]) -> None:
    """The row answers what it is timed for (a denied row: 200, then 429s)."""
    got = [call() for _ in range(3)]
    want = [200, 429, 429] if name.endswith("_denied") else [200] * 3
    if got != want:
        raise RuntimeError(f"{name}: statuses {got}, expected {want}")


def measure_frameworks(rounds: int, calls: int) -> dict[str, Any]:
    """Medians of interleaved rounds per framework row, ``added``: each
    round's difference from the framework's ``bare``, and ``denied / admitted``:
    what a 429 costs against a 200 of the same middleware."""
    variants = framework_variants()
    for framework, rows in variants.items():
        for name, call in rows.items():
            check_framework(f"{framework}/{name}", call)
    per_round: dict[str, dict[str, list[float]]] = {f: {n: [] for n in rows} for f, rows in variants.items()}
    for n in range(rounds):
        for framework, rows in variants.items():
            names = list(rows) if n % 2 == 0 else list(rows)[::-1]
            for name in names:
                call = rows[name]
                t0 = time.perf_counter_ns()
                for _ in range(calls):
                    call()
                per_round[framework][name].append((time.perf_counter_ns() - t0) / calls)
        if n % 16 == 15:
            gc.collect()
    out: dict[str, Any] = {}
    for framework, rows in per_round.items():
        bare = rows["bare"]
        out[framework] = {}
        for name, ns in rows.items():
            row = {"ns_median": round(statistics.median(ns), 1)}
            if name != "bare":
                row["added_ns"] = round(statistics.median(a - b for a, b in zip(ns, bare)), 1)
            if name.endswith("_denied"):
                admitted = rows[name.removesuffix("_denied")]
                row["over_admitted_ratio"] = round(statistics.median(a / b for a, b in zip(ns, admitted)), 3)
            wsgi = rows.get(name.replace("nanolimit", "nanolimit_wsgi", 1))
            if wsgi is not None and wsgi is not ns:  # the integration against the WSGI middleware
                row["over_wsgi_ns"] = round(statistics.median(a - b for a, b in zip(ns, wsgi)), 1)
            out[framework][name] = row
    return {"implementation": __import__("nanolimit").IMPLEMENTATION, "rounds": rounds, "calls": calls, **out}


def frameworks_markdown(figures: dict[str, Any]) -> str:
    lines = [
        f"Frameworks in process ({figures['implementation']} twin, {figures['rounds']} rounds of "
        f"{figures['calls']:,} calls, medians):",
        "",
        "| framework | variant | µs/request | µs added over bare | over the WSGI middleware "
        "| denied / admitted |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for framework in ("flask", "django", "aiohttp"):
        for name, r in figures[framework].items():
            added = f"{r['added_ns'] / 1000:+.2f}" if "added_ns" in r else ""
            over = f"{r['over_wsgi_ns'] / 1000:+.2f}" if "over_wsgi_ns" in r else ""
            ratio = f"{r['over_admitted_ratio']:.2f}x" if "over_admitted_ratio" in r else ""
            lines.append(
                f"| {framework} | {name} | {r['ns_median'] / 1000:.2f} | {added} | {over} | {ratio} |"
            )
    return "\n".join(lines)


def sizes(quick: bool) -> tuple[int, int]:
    return (QUICK_ROUNDS, QUICK_CALLS) if quick else (ROUNDS, CALLS)


def markdown(figures: dict[str, Any]) -> str:
    lines = [
        f"In process ({figures['implementation']} twin, {figures['rounds']} rounds of "
        f"{figures['calls']:,} calls, medians):",
        "",
        "| protocol | variant | ns/request | quartiles | ns added over bare | over headers_only "
        "| / nanolimit |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for kind in ("asgi", "wsgi"):
        for name, r in figures[kind].items():
            added = f"{r['added_ns']:+,.0f}" if "added_ns" in r else ""
            over = f"{r['over_headers_only_ns']:+,.0f}" if "over_headers_only_ns" in r else ""
            ratio = f"{r['over_nanolimit_ratio']:.2f}x" if "over_nanolimit_ratio" in r else ""
            lines.append(
                f"| {kind.upper()} | {name} | {r['ns_median']:,.0f} | {r['ns_q1']:,.0f}-{r['ns_q3']:,.0f} "
                f"| {added} | {over} | {ratio} |"
            )
    return "\n".join(lines)


def main(argv: Iterable[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int)
    parser.add_argument("--calls", type=int)
    parser.add_argument("--json", action="store_true", help="print JSON, not the table")
    parser.add_argument(
        "--frameworks",
        action="store_true",
        help="Flask, Django and aiohttp apps instead (41 rounds of 500 calls)",
    )
    args = parser.parse_args(None if argv is None else list(argv))
    if args.frameworks:
        rounds, calls = (QUICK_ROUNDS, 50) if args.quick else (41, 500)
        figures = measure_frameworks(args.rounds or rounds, args.calls or calls)
        print(json.dumps(figures, indent=1) if args.json else frameworks_markdown(figures))
        return 0
    rounds, calls = sizes(args.quick)
    figures = measure(args.rounds or rounds, args.calls or calls)
    print(json.dumps(figures, indent=1) if args.json else markdown(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
