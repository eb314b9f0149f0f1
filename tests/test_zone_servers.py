"""The shared-memory zone under real multi-process servers.

``gunicorn -w 4`` (sync workers, with and without ``--preload``) serving
Flask, and ``uvicorn --workers 4`` serving Starlette, each on 127.0.0.1 on a
free port, limited by one ``api`` rule of 1,000 per hour on a single global
key (tests/zone_apps.py). A bounded load from many client threads, a fresh
connection per request so every worker takes a share, then:

* on one :class:`SharedMemoryStorage` zone, opened by every worker, exactly
  1,000 responses are 200 across all the workers and the rest 429;
* on the per-process :class:`InMemoryStorage`, each worker admits up to
  1,000 on its own, so the total exceeds 1,000: the N-times over-admission
  the zone removes.

The measured figures (200s in total and per worker, wall times) land in
``FIGURES`` and are printed as one ``zone-servers:`` JSON line per test (see
them with ``-s``). Every server runs under ``timeout`` and is stopped by its
PID in a ``finally``; every zone has a unique name and is unlinked in one.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import types
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from _helpers import clear_of_window_edge as _clear_of_window_edge
from _helpers import needs_shared_memory
from adversarial_servers import SRC, TESTS, free_port, raw_request
from zone_apps import ALGORITHM_ENV, LIMIT_ENV, MAX_KEYS, STORAGE_ENV, WINDOW, ZONE_ENV

WORKERS = 4
LIMIT = 1_000
TOTAL = 5_000  # requests of one load: over 1,000 a worker when they share it evenly
CLIENTS = 32  # client threads, each a fresh connection per request
START_TIMEOUT = 30.0
LOAD_TIMEOUT = 45.0
LIFETIME = 120  # seconds `timeout` lets a server live, whatever the test does
# A fixed window is aligned to the epoch: a load that straddles the top of
# the hour would get a second budget. Start none this close to the edge.
EDGE_MARGIN = 40.0
RECYCLE = 400  # gunicorn --max-requests of the recycling run

FIGURES: dict[str, dict[str, Any]] = {}


def _gunicorn(port: int, extra: tuple[str, ...]) -> list[str]:
    argv = ["-m", "gunicorn", "-w", str(WORKERS), "-k", "sync", "-b", f"127.0.0.1:{port}"]
    argv += ["--timeout", "30", "--graceful-timeout", "3", "--log-level", "warning", *extra]
    return [*argv, "zone_apps:flask_app()"]


def _uvicorn(port: int, extra: tuple[str, ...]) -> list[str]:
    return [
        "-m",
        "uvicorn",
        "--factory",
        "zone_apps:starlette_app",
        "--workers",
        str(WORKERS),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--no-access-log",
        "--timeout-graceful-shutdown",
        "3",
        *extra,
    ]


# name -> (argv builder, extra arguments, modules it needs)
SERVERS: dict[str, tuple[Any, tuple[str, ...], tuple[str, ...]]] = {
    "gunicorn": (_gunicorn, (), ("gunicorn", "flask")),
    # the master opens the zone before the fork; the workers inherit its mapping
    "gunicorn-preload": (_gunicorn, ("--preload",), ("gunicorn", "flask")),
    # every worker exits after ~RECYCLE requests: its successor attaches mid-load
    "gunicorn-recycle": (
        _gunicorn,
        ("--max-requests", str(RECYCLE), "--max-requests-jitter", "100"),
        ("gunicorn", "flask"),
    ),
    "uvicorn": (_uvicorn, (), ("uvicorn", "starlette")),
}


def _needs(server: str) -> None:
    for module in SERVERS[server][2]:
        pytest.importorskip(module)


# ---------------------------------------------------------------------------
# The server


class Server(NamedTuple):
    port: int
    proc: subprocess.Popen[bytes]
    health: dict[int, dict[str, Any]]  # worker pid -> its /health at start
    started_s: float


def _alive(pid: int) -> bool:
    """Running: neither gone nor a zombie its parent has not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except OSError:
        return os.path.exists(f"/proc/{pid}") or not os.path.isdir("/proc")


def _health(port: int) -> dict[str, Any]:
    reply = raw_request(port, "GET", b"/health")
    if reply.status != 200:
        raise RuntimeError(f"/health answered {reply.status}: {reply.body[:200]!r}")
    data: dict[str, Any] = json.loads(reply.body)
    return data


def _probe_workers(port: int, deadline: float, alive: Any) -> dict[int, dict[str, Any]]:
    """Poll ``/health`` from several threads until every worker has answered
    (or the deadline: the load then asserts on what it saw)."""
    seen: dict[int, dict[str, Any]] = {}
    lock = threading.Lock()

    def poll() -> None:
        while time.monotonic() < deadline and alive():
            with lock:
                if len(seen) >= WORKERS:
                    return
            try:
                data = _health(port)
            except (OSError, RuntimeError, ValueError):
                time.sleep(0.05)
                continue
            with lock:
                seen[int(data["pid"])] = data

    threads = [threading.Thread(target=poll, daemon=True) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()) + 1.0)
    return seen


def _stop(proc: subprocess.Popen[bytes], pids: Iterator[int] | list[int]) -> None:
    """SIGTERM to the server (``timeout`` forwards it); SIGKILL to its process
    group, then to any worker seen, if they outlive the grace period."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15.0)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: start_new_session
            proc.wait(10.0)
    deadline = time.monotonic() + 10.0
    left = [pid for pid in pids if _alive(pid)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [pid for pid in left if _alive(pid)]
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def serve(server: str, env_extra: dict[str, str], log: Path) -> Iterator[Server]:
    """The named server in a subprocess, bounded by ``timeout``; yields once
    every worker answered ``/health`` (or START_TIMEOUT passed)."""
    build, extra, _ = SERVERS[server]
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(TESTS)])
    env.update(env_extra)
    began = time.monotonic()
    with log.open("wb") as err:
        proc = subprocess.Popen(
            ["timeout", str(LIFETIME), sys.executable, *build(port, extra)],
            cwd=str(TESTS),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
    seen: dict[int, dict[str, Any]] = {}
    try:
        seen = _probe_workers(port, began + START_TIMEOUT, lambda: proc.poll() is None)
        if not seen:
            raise RuntimeError(f"{server} never answered /health:\n{log.read_text(errors='replace')[-3000:]}")
        yield Server(port, proc, seen, time.monotonic() - began)
    finally:
        _stop(proc, list(seen))


# ---------------------------------------------------------------------------
# The load


class Tally(NamedTuple):
    statuses: Counter[int]
    admitted: Counter[int]  # worker pid -> 200s
    answered: Counter[int]  # worker pid -> responses
    errors: list[str]
    first: float  # wall clock at the first request sent
    last: float  # wall clock at the last response read
    wall_s: float


def load(port: int, total: int = TOTAL, clients: int = CLIENTS) -> Tally:
    """``total`` GETs of ``/api/...`` from ``clients`` threads, each request
    on its own connection (``Connection: close``), all started together."""
    statuses: Counter[int] = Counter()
    admitted: Counter[int] = Counter()
    answered: Counter[int] = Counter()
    errors: list[str] = []
    lock = threading.Lock()
    barrier = threading.Barrier(clients + 1)
    shares = [total // clients + (1 if i < total % clients else 0) for i in range(clients)]

    def client(i: int, n: int) -> None:
        target = f"/api/client-{i}".encode()
        barrier.wait(10.0)
        for _ in range(n):
            try:
                reply = raw_request(port, "GET", target)
            except OSError as exc:
                with lock:
                    errors.append(f"client {i}: {exc!r}")
                continue
            pid = int(reply.headers.get("x-worker-pid", "0"))
            with lock:
                statuses[reply.status] += 1
                answered[pid] += 1
                if reply.status == 200:
                    admitted[pid] += 1

    threads = [threading.Thread(target=client, args=(i, n), daemon=True) for i, n in enumerate(shares)]
    for t in threads:
        t.start()
    barrier.wait(10.0)
    first, began = time.time(), time.monotonic()
    deadline = began + LOAD_TIMEOUT
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    last, wall = time.time(), time.monotonic() - began
    stuck = sum(t.is_alive() for t in threads)
    if stuck:
        errors.append(f"{stuck} client threads still running after {LOAD_TIMEOUT} s")
    return Tally(statuses, admitted, answered, errors, first, last, wall)


def clear_of_window_edge(window: float = WINDOW, margin: float = EDGE_MARGIN) -> None:
    """Sleep past the next window boundary when it is under ``margin`` away."""
    _clear_of_window_edge(window, margin)


def record(test: str, server: Server, tally: Tally, **extra: Any) -> dict[str, Any]:
    figures = {
        "server": test,
        "requests": sum(tally.statuses.values()),
        "ok_200": tally.statuses[200],
        "limited_429": tally.statuses[429],
        "other": {str(k): v for k, v in tally.statuses.items() if k not in (200, 429)},
        "workers_answered": len([p for p in tally.answered if p]),
        "per_worker_200": sorted(tally.admitted.values(), reverse=True),
        "per_worker_answered": sorted(tally.answered.values(), reverse=True),
        "load_wall_s": round(tally.wall_s, 3),
        "requests_per_s": round(sum(tally.statuses.values()) / tally.wall_s, 1) if tally.wall_s else None,
        "start_s": round(server.started_s, 3),
        "workers_at_start": len(server.health),
        **extra,
    }
    FIGURES[test] = figures
    print(f"\nzone-servers: {json.dumps(figures, sort_keys=True)}")
    return figures


def assert_spread(tally: Tally) -> None:
    assert not tally.errors, tally.errors[:5]
    assert sum(tally.statuses.values()) == TOTAL, tally.statuses
    assert 0 not in tally.answered, "a response without X-Worker-Pid"
    assert len(tally.answered) >= 2, f"one worker took every request: {dict(tally.answered)}"


# ---------------------------------------------------------------------------
# The tests


@pytest.fixture
def zone_name(native: types.ModuleType) -> Iterator[str]:
    """A unique zone name; the segment is unlinked whatever the test did."""
    native.SharedMemoryStorage  # noqa: B018 (an AttributeError here is an error, not a skip)
    name = f"nltest-{uuid.uuid4().hex[:12]}"
    try:
        yield name
    finally:
        native.SharedMemoryStorage.unlink_segment(name)


def _env(storage: str, algorithm: str, zone: str | None = None) -> dict[str, str]:
    env = {STORAGE_ENV: storage, ALGORITHM_ENV: algorithm, LIMIT_ENV: str(LIMIT)}
    if zone is not None:
        env[ZONE_ENV] = zone
    return env


def _attach(native: types.ModuleType, zone: str) -> dict[str, Any]:
    """Open the zone from the test process, as one more attacher."""
    z = native.SharedMemoryStorage(zone, max_keys=MAX_KEYS)
    try:
        assert not z.created, "the test process created a zone the servers should have made"
        assert z.name == zone
        metrics = _plain(z.metrics())
        pids = getattr(z, "attached_pids", None)
        return {
            "len": len(z),
            "keys": [str(k) for k in list(z.keys())[:4]],
            "metrics": metrics,
            "attached_pids": list(pids()) if pids is not None else None,
        }
    finally:
        z.close()


def _plain(value: Any) -> Any:
    """``value`` made JSON-friendly (stats may be a mapping or an object)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    if hasattr(value, "_asdict"):
        return _plain(value._asdict())
    return repr(value)


def _zone_run(
    native: types.ModuleType, server: str, zone: str, algorithm: str, tmp_path: Path
) -> tuple[Server, Tally, dict[str, Any], dict[int, dict[str, Any]]]:
    with serve(server, _env("zone", algorithm, zone), tmp_path / f"{server}.log") as srv:
        tally = load(srv.port)
        after = _probe_workers(srv.port, time.monotonic() + 10.0, lambda: srv.proc.poll() is None)
        attached = _attach(native, zone)
        # the workers that answered /health and are still alive after the
        # attach. A recycled worker (--max-requests, the probes count) closes
        # its zone before it exits: one missing from the zone's list is
        # given a few seconds to finish exiting; one that stays is missing.
        registered = set(attached["attached_pids"] or after)
        deadline = time.monotonic() + 5.0
        while any(_alive(pid) and pid not in registered for pid in after) and time.monotonic() < deadline:
            time.sleep(0.05)
        attached["live_workers"] = sorted(pid for pid in after if _alive(pid))
    return srv, tally, attached, after


@pytest.mark.native
@needs_shared_memory
@pytest.mark.parametrize("server", list(SERVERS))
def test_zone_admits_exactly_the_limit_across_workers(
    server: str, native: types.ModuleType, zone_name: str, tmp_path: Path
) -> None:
    """Fixed window, 1,000 an hour, one key: exactly 1,000 200s in total,
    whichever of the four workers answered them, and the rest 429."""
    _needs(server)
    clear_of_window_edge()
    srv, tally, attached, after = _zone_run(native, server, zone_name, "fixed_window", tmp_path)
    figures = record(f"{server}/zone/fixed_window", srv, tally, zone=attached)
    assert_spread(tally)
    assert math.floor(tally.first / WINDOW) == math.floor(tally.last / WINDOW), "the load crossed the hour"
    assert tally.statuses[200] == LIMIT, figures
    assert tally.statuses[429] == TOTAL - LIMIT, figures
    assert sum(tally.admitted.values()) == LIMIT
    # One key in the one shared table, seen alike by the test and every worker,
    # and every live worker registered in the zone (a recycled one replaced).
    assert attached["len"] == 1, attached
    assert {data["keys"] for data in after.values()} == {1}, after
    assert attached["metrics"]["keys"] == 1, attached
    if attached["attached_pids"] is not None:
        assert set(attached["live_workers"]) <= set(attached["attached_pids"]), attached
        assert os.getpid() in attached["attached_pids"], attached
        # the workers, the test, and under --preload the master: no dead ones
        assert len(attached["attached_pids"]) <= WORKERS + 2, attached
    created = [pid for pid, data in srv.health.items() if data["created"]]
    # Every process is gone: the segment is there until unlinked, once.
    assert native.SharedMemoryStorage.unlink_segment(zone_name) is True
    assert native.SharedMemoryStorage.unlink_segment(zone_name) is False
    if server == "gunicorn-preload":
        # The master built the zone before the fork: every worker inherited it.
        assert len(created) == len(srv.health), srv.health
    else:
        # Each worker opened it itself: one created the segment, the rest attached.
        assert len(created) <= 1, srv.health
        if len(srv.health) == WORKERS:
            assert len(created) == 1, srv.health


@pytest.mark.native
@needs_shared_memory
def test_zone_token_bucket_across_gunicorn_workers(
    native: types.ModuleType, zone_name: str, tmp_path: Path
) -> None:
    """Token bucket on the zone: the full bucket (1,000) plus no more than
    what refills at 1,000 an hour while the load runs."""
    _needs("gunicorn")
    srv, tally, attached, _ = _zone_run(native, "gunicorn", zone_name, "token_bucket", tmp_path)
    refill = (tally.last - tally.first) * LIMIT / WINDOW
    figures = record("gunicorn/zone/token_bucket", srv, tally, zone=attached, refill_bound=round(refill, 3))
    assert_spread(tally)
    assert LIMIT <= tally.statuses[200] <= LIMIT + math.floor(refill) + 1, figures
    assert tally.statuses[200] + tally.statuses[429] == TOTAL, figures
    assert attached["len"] == 1, attached


@pytest.mark.parametrize("server", ["gunicorn", "uvicorn"])
def test_in_memory_storage_over_admits_per_worker(server: str, tmp_path: Path) -> None:
    """The same load on per-process InMemoryStorage: each worker keeps its own
    1,000, so the total is over 1,000 (what the zone exists to prevent)."""
    _needs(server)
    clear_of_window_edge()
    with serve(server, _env("memory", "fixed_window"), tmp_path / f"{server}.log") as srv:
        tally = load(srv.port)
    expected = sum(min(n, LIMIT) for n in tally.answered.values())
    figures = record(f"{server}/in-memory/fixed_window", srv, tally, per_worker_expected=expected)
    assert_spread(tally)
    assert tally.statuses[200] > LIMIT, figures
    # Each worker admitted exactly its own first 1,000.
    assert all(tally.admitted[pid] == min(n, LIMIT) for pid, n in tally.answered.items()), figures
    assert tally.statuses[200] == expected, figures
