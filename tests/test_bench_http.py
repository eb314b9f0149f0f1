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


def _assert_answers(mod: ModuleType, name: str, answers: list[tuple[int, dict[str, str], bytes]]) -> None:
    rate = mod.RATE_HEADER_NAMES
    statuses = [status for status, _, _ in answers]
    if name == "nanolimit_denied":
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
    if name == "nanolimit":
        # it decides: each admitted request spends one of the budget
        left = [int(headers["x-ratelimit-remaining"]) for _, headers, _ in answers]
        assert left == list(range(left[0], left[0] - len(answers), -1))
    if name == "headers_only":
        assert {headers["x-ratelimit-remaining"] for _, headers, _ in answers} == {"999999999"}


@pytest.mark.parametrize("name", ["bare", "headers_only", "nanolimit", "nanolimit_denied"])
def test_asgi_variants_answer_as_timed(inprocess: ModuleType, name: str) -> None:
    app = inprocess.asgi_variants()[name]
    answers = inprocess.asgi_answers(app, CALLS)
    _assert_answers(inprocess, name, answers)
    inprocess.check(name, answers)  # the measurement's own guard agrees


@pytest.mark.parametrize("name", ["bare", "headers_only", "nanolimit", "nanolimit_denied"])
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
    for kind in ("asgi", "wsgi"):
        assert set(figures[kind]) == set(inprocess.VARIANTS)
        assert "added_ns" not in figures[kind]["bare"]
        for name in ("headers_only", "nanolimit", "nanolimit_denied"):
            assert "added_ns" in figures[kind][name]
        assert "over_headers_only_ns" in figures[kind]["nanolimit"]
    table = inprocess.markdown(figures)
    assert table.count("| ASGI |") == table.count("| WSGI |") == len(inprocess.VARIANTS)


# the served apps whose frameworks the test extras install (FastAPI, slowapi
# and flask-limiter are the bench extra's; http_e2e.py installs them)
SERVED = [
    ("starlette", "bare"),
    ("starlette", "headers_only"),
    ("starlette", "nanolimit"),
    ("starlette", "nanolimit_denied"),
    ("flask", "bare"),
    ("flask", "headers_only"),
    ("flask", "nanolimit"),
    ("flask", "nanolimit_denied"),
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
