"""The end-to-end HTTP benchmark's harness, kept from rotting: its apps answer
what its tables claim, its in-process measurement runs, its servers start,
answer and are gone after their stop. Behaviour only: no time is asserted
and wrk is never run here (bench/http_e2e.py and bench/README.md for that).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

pytest_plugins = ["redis_servers"]  # the Redis rows' server fixtures

BENCH = Path(__file__).resolve().parent.parent / "bench"
CALLS = 300


def _load(name: str) -> ModuleType:
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))  # the bench modules import each other by name
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def inprocess() -> ModuleType:
    return _load("asgi_inprocess")


@pytest.fixture(scope="module")
def apps() -> ModuleType:
    return _load("http_apps")


def apps_huge(mod: ModuleType) -> int:
    return int(mod.HUGE)


def _assert_answers(mod: ModuleType, name: str, answers: list[tuple[int, dict[str, str], bytes]]) -> None:
    rate = mod.RATE_HEADER_NAMES
    statuses = [status for status, _, _ in answers]
    if name.startswith("nanolimit") and name.endswith("_denied"):
        assert statuses == [200] + [429] * (len(answers) - 1)
        for _, headers, body in answers[1:]:
            assert b"rate_limit_exceeded" in body
            assert headers["x-ratelimit-remaining"] == "0"
            assert "retry-after" in headers
    else:
        assert statuses == [200] * len(answers)
        assert {body for _, _, body in answers} == {b"ok"}
    for _, headers, _ in answers:
        if name == "bare":
            assert not any(h in headers for h in rate)
        else:
            assert all(h in headers for h in rate), headers
    left = [int(headers["x-ratelimit-remaining"]) for _, headers, _ in answers if name != "bare"]
    if name in ("nanolimit", "nanolimit_route", "nanolimit_ext") or name.endswith("_redis"):
        # it decides: each admitted request spends one of the budget
        assert left == list(range(left[0], left[0] - len(answers), -1))
    if name == "nanolimit_counted":
        # charged on entry, refunded on the 200 (only 401s count): the budget
        # each request sees is the one the last left untouched
        assert len(set(left)) == 1
        assert left[0] < apps_huge(mod)
    if name == "headers_only":
        assert {headers["x-ratelimit-remaining"] for _, headers, _ in answers} == {"999999999"}


ASGI_TIMED = ["bare", "headers_only", "nanolimit", "nanolimit_denied", "nanolimit_route", "nanolimit_counted"]
WSGI_TIMED = ["bare", "headers_only", "nanolimit", "nanolimit_denied", "nanolimit_counted"]


@pytest.mark.parametrize("name", ASGI_TIMED)
def test_asgi_variants_answer_as_timed(inprocess: ModuleType, name: str) -> None:
    app = inprocess.asgi_variants()[name]
    answers = inprocess.asgi_answers(app, CALLS, inprocess.SCOPES.get(name, inprocess.SCOPE))
    _assert_answers(inprocess, name, answers)
    inprocess.check(name, answers)  # the measurement's own guard agrees


def test_route_variant_decides_by_its_declared_route(inprocess: ModuleType) -> None:
    """The in-process route row is limited by the rule made from the route
    table, not by a prefix rule: its policy names the view, not ``bench``."""
    app = inprocess.asgi_variants()["nanolimit_route"]
    ((_, headers, _),) = inprocess.asgi_answers(app, 1, inprocess.SCOPES["nanolimit_route"])
    assert '"bench"' not in headers["ratelimit-policy"]
    assert "index" in headers["ratelimit-policy"]
    assert headers["x-ratelimit-limit"] == str(inprocess.HUGE)


@pytest.mark.parametrize("name", WSGI_TIMED)
def test_wsgi_variants_answer_as_timed(inprocess: ModuleType, name: str) -> None:
    app = inprocess.wsgi_variants()[name]
    answers = inprocess.wsgi_answers(app, CALLS)
    _assert_answers(inprocess, name, answers)
    inprocess.check(name, answers)


def test_check_refuses_a_wrong_answer(inprocess: ModuleType) -> None:
    """A variant on the wrong path is never timed: the guard notices."""
    answers = inprocess.asgi_answers(inprocess.asgi_variants()["bare"], 3)
    with pytest.raises(RuntimeError, match="without"):
        inprocess.check("headers_only", answers)
    denied = inprocess.asgi_answers(inprocess.asgi_variants()["nanolimit_denied"], 3)
    with pytest.raises(RuntimeError, match="statuses"):
        inprocess.check("nanolimit", denied)


def test_measure_reports_every_variant(inprocess: ModuleType) -> None:
    figures = inprocess.measure(rounds=3, calls=50)
    assert set(figures["asgi"]) == set(ASGI_TIMED) == set(inprocess.VARIANTS)
    assert set(figures["wsgi"]) == set(WSGI_TIMED)
    for kind in ("asgi", "wsgi"):
        assert "added_ns" not in figures[kind]["bare"]
        for name in ("headers_only", "nanolimit", "nanolimit_denied", "nanolimit_counted"):
            assert "added_ns" in figures[kind][name]
        assert "over_headers_only_ns" in figures[kind]["nanolimit"]
        assert figures[kind]["nanolimit_counted"]["over_nanolimit_ratio"] > 0
    assert figures["asgi"]["nanolimit_route"]["over_nanolimit_ratio"] > 0
    table = inprocess.markdown(figures)
    assert table.count("| ASGI |") == len(ASGI_TIMED)
    assert table.count("| WSGI |") == len(WSGI_TIMED)


# the served apps whose frameworks the test extras install (FastAPI, slowapi
# and flask-limiter are the bench extra's; http_e2e.py installs them)
SERVED = [
    ("starlette", "bare"),
    ("starlette", "headers_only"),
    ("starlette", "nanolimit"),
    ("starlette", "nanolimit_denied"),
    ("fastapi", "bare"),
    ("fastapi", "nanolimit"),
    ("fastapi", "nanolimit_route"),
    ("fastapi", "nanolimit_counted"),
    ("flask", "bare"),
    ("flask", "headers_only"),
    ("flask", "nanolimit"),
    ("flask", "nanolimit_denied"),
    ("flask", "nanolimit_ext"),
    ("flask", "nanolimit_ext_denied"),
]


def _served_answers(app: Any, framework: str, calls: int) -> list[tuple[int, dict[str, str], bytes]]:
    if framework == "flask":
        client = app.test_client()
        replies = [client.get("/") for _ in range(calls)]
        return [(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.data) for r in replies]
    import asyncio

    import httpx

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=app, client=("127.0.0.1", 40000))
        async with httpx.AsyncClient(transport=transport, base_url="http://bench") as client:
            return [await client.get("/") for _ in range(calls)]

    replies = asyncio.run(run())
    return [(r.status_code, {k.lower(): v for k, v in r.headers.items()}, r.content) for r in replies]


@pytest.mark.parametrize(("framework", "name"), SERVED)
def test_served_apps_answer_as_their_rows_claim(apps: ModuleType, framework: str, name: str) -> None:
    row = apps.variant(framework, name)
    assert row.denied == name.endswith("_denied")
    answers = _served_answers(row.build(framework, row.limit), framework, 50)
    _assert_answers(apps, name, answers)


# Django's settings are per process: each row is built and called in its own
_DJANGO_CALLS = """
import json, sys
from wsgiref.util import setup_testing_defaults
import http_apps
row = http_apps.variant("django", sys.argv[1])
app = row.build("django", row.limit)
out = []
for _ in range(50):
    env = {}
    setup_testing_defaults(env)
    env["REMOTE_ADDR"] = "127.0.0.1"
    got = {}
    def start(status, headers, exc_info=None):
        got["status"], got["headers"] = int(status.split()[0]), {k.lower(): v for k, v in headers}
    body = b"".join(app(env, start))
    out.append([got["status"], got["headers"], body.decode("latin-1")])
print(json.dumps(out))
"""


@pytest.mark.parametrize("name", ["bare", "headers_only", "nanolimit", "nanolimit_denied"])
def test_served_django_apps_answer_as_their_rows_claim(apps: ModuleType, name: str) -> None:
    import json
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", _DJANGO_CALLS, name], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    answers = [(status, headers, body.encode("latin-1")) for status, headers, body in json.loads(done.stdout)]
    assert apps.variant("django", name).server == "gunicorn"
    _assert_answers(apps, name, answers)


# the in-process Django rows (asgi_inprocess --frameworks, django_instructions.py):
# each answers what it is timed for, and each limited row's answers carry the headers
_DJANGO_INPROCESS = """
import json, sys, warnings
warnings.simplefilter("ignore")
import asgi_inprocess
rows = asgi_inprocess._django_calls()
for name, call in rows.items():
    asgi_inprocess.check_framework("django/" + name, call)
print(json.dumps(sorted(rows)))
"""


def test_inprocess_django_rows_answer_as_timed() -> None:
    import json
    import subprocess

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(BENCH), *sys.path])}
    done = subprocess.run(
        [sys.executable, "-c", _DJANGO_INPROCESS], capture_output=True, text=True, timeout=60, env=env
    )
    assert done.returncode == 0, done.stderr
    rows = ["bare", "nanolimit", "nanolimit_denied", "nanolimit_wsgi", "nanolimit_wsgi_denied"]
    assert json.loads(done.stdout) == rows
    assert tuple(rows) == _load("django_instructions").ROWS  # what the instruction counts run


# the rows whose state is in Redis (slowapi_redis needs slowapi: the bench
# extra's, like the other slowapi rows)
SERVED_REDIS = [
    ("starlette", "nanolimit_async_redis", "async"),
    ("starlette", "nanolimit_sync_redis", "sync"),
]


@pytest.mark.parametrize(("framework", "name", "lane"), SERVED_REDIS)
def test_redis_rows_answer_and_keep_their_state_in_redis(
    apps: ModuleType, redis_server: Any, monkeypatch: pytest.MonkeyPatch, framework: str, name: str, lane: str
) -> None:
    monkeypatch.setenv(apps.REDIS_PORT_ENV, str(redis_server.port))
    row = apps.variant(framework, name)
    assert row.store == "redis" and "redis" in row.needs
    answers = _served_answers(row.build(framework, row.limit), framework, 50)
    _assert_answers(apps, name, answers)
    client = redis_server.client()
    try:
        keys = [k.decode() for k in client.keys("*")]
    finally:
        client.close()
    # one key, under the row's own prefix: every decision was made in Redis
    assert len(keys) == 1 and keys[0].startswith(f"bench:{framework}:{lane}:"), keys


def test_redis_rows_refuse_to_build_without_a_server_port(
    apps: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(apps.REDIS_PORT_ENV, raising=False)
    for framework, name, _ in SERVED_REDIS:
        row = apps.variant(framework, name)
        with pytest.raises(RuntimeError, match=apps.REDIS_PORT_ENV):
            row.build(framework, row.limit)


def test_variant_table(apps: ModuleType) -> None:
    keys = [(r.framework, r.name) for r in apps.VARIANTS]
    assert len(keys) == len(set(keys))
    for framework in {r.framework for r in apps.VARIANTS}:
        assert (framework, "bare") in keys  # every framework's baseline
    for row in apps.VARIANTS:
        if row.denied:
            assert (row.framework, row.name.removesuffix("_denied")) in keys
    with pytest.raises(LookupError, match="no variant"):
        apps.variant("starlette", "nope")
    assert {r.name for r in apps.VARIANTS if r.store == "redis"} == {
        "nanolimit_async_redis",
        "nanolimit_sync_redis",
        "slowapi_redis",
    }


def test_parse_load_reads_wrk(apps: ModuleType) -> None:
    e2e = _load("http_e2e")
    text = """Running 4s test @ http://127.0.0.1:40000/
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   812.10us  101.20us   3.10ms   90.00%
  20216 requests in 4.00s, 2.91MB read
  Socket errors: connect 0, read 3, write 0, timeout 1
  Non-2xx or 3xx responses: 20215
Requests/sec:   5053.85
Transfer/sec:    745.36KB
"""
    load = e2e.parse_load(text)
    assert (load.rps, load.requests, load.non2xx, load.socket_errors) == (5053.85, 20216, 20215, 4)
    with pytest.raises(RuntimeError, match="Requests/sec"):
        e2e.parse_load("wrk: connection refused")


def _gone(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.skipif(sys.platform != "linux", reason="the harness pins with taskset and stops process groups")
@pytest.mark.parametrize(("framework", "name"), [("starlette", "nanolimit"), ("flask", "nanolimit_denied")])
def test_server_starts_answers_and_is_stopped(apps: ModuleType, framework: str, name: str) -> None:
    """The harness's own server: a free 127.0.0.1 port, its answer checked,
    and after the block nothing of its process group is left."""
    e2e = _load("http_e2e")
    row = apps.variant(framework, name)
    with e2e.serve(row, lifetime=60, cpu=None) as server:
        (proc,) = e2e._LIVE.values()
        assert server.pgid == proc.pid
        before = e2e.group_cpu_ns(server.pgid)
        for _ in range(20):
            status, headers, _ = e2e.get(server.port)
            assert status == (429 if row.denied else 200)
            assert all(h in headers for h in row.headers)
        # the server's CPU time is read from its process group, and it served
        assert e2e.group_cpu_ns(server.pgid) > before
    assert _gone(proc.pid)
    assert proc.returncode is not None
    assert not e2e._LIVE


@pytest.mark.skipif(sys.platform != "linux", reason="the harness pins with taskset and stops process groups")
def test_harness_redis_serves_a_redis_row_and_both_are_stopped(apps: ModuleType, tmp_path: Path) -> None:
    """The harness's own Redis (what the benchmark runs against): started on
    a free port, its port handed to the app server through the environment,
    the app's state kept there, and both process groups gone afterwards."""
    from redis_servers import require_binary

    e2e = _load("http_e2e")
    binary = require_binary("redis")
    row = apps.variant("starlette", "nanolimit_async_redis")
    with e2e.redis_server(binary, lifetime=60, workdir=tmp_path, cpu=None) as store:
        (redis_proc,) = e2e._LIVE.values()
        assert os.environ[apps.REDIS_PORT_ENV] == str(store.port)
        with e2e.serve(row, lifetime=60, cpu=None) as server:
            for _ in range(10):
                status, headers, body = e2e.get(server.port)
                assert (status, body) == (200, b"ok")
            # ten, and serve()'s own check of the first answer
            assert int(headers["x-ratelimit-remaining"]) == apps.HUGE - 11
        assert e2e.redis_version(store.port)
        assert e2e.group_cpu_ns(store.pgid) > 0
    assert _gone(redis_proc.pid)
    assert apps.REDIS_PORT_ENV not in os.environ
    assert not e2e._LIVE
