"""End to end over HTTP: what a rate limiter adds to one request, measured
with a real server, a real load generator and a minimal app.

    python bench/http_e2e.py                    # 7 interleaved rounds (~15 min on 2 cores)
    python bench/http_e2e.py --quick            # 2 short rounds: a CI smoke run
    python bench/http_e2e.py --json out.json    # also the figures and every round, for machines
    python bench/http_e2e.py --only starlette/bare,starlette/nanolimit --rounds 3
    python bench/http_e2e.py --calibrate        # rps of the bare apps by connection count
    python bench/http_e2e.py --inprocess-only   # only bench/asgi_inprocess.py's figures

What is served (bench/http_apps.py): Starlette and FastAPI under uvicorn (1
worker, ``--no-access-log``, uvloop and httptools only where installed, else
asyncio and h11: the run records which), Flask under gunicorn's sync worker
(1 worker), and Django under the same (nanolimit's middleware with
``@limit`` on the view, django-ratelimit's ``@ratelimit``). Every app
answers ``GET /`` with ``ok``; the variants wrap it in nothing (``bare``),
in a middleware that only appends five fixed rate-limit headers
(``headers_only``), in nanolimit's ASGI / WSGI middleware or Flask extension
(``nanolimit_ext``), in slowapi's two middlewares, in flask-limiter or in
django-ratelimit, each with one rule whose
limit no run reaches, and each limiter once more with limit 1 (``*_denied``:
nearly every answer is a 429). Starlette also has the Redis rows
(``nanolimit_async_redis``, ``nanolimit_sync_redis``, ``slowapi_redis``),
FastAPI the same limit declared on the route (``nanolimit_route``) and the
prefix rule counting only 401s (``nanolimit_counted``: charged and refunded).

**Redis.** When a chosen row has ``store="redis"`` the run starts one
``redis-server`` of its own (PATH, else apt-get): 127.0.0.1, a free port,
``--save "" --appendonly no``, under ``timeout``, pinned to the server's
core (``REDIS_CPU``: the app awaits each reply, so the two take turns and the
whole request lands on the serving core), its port handed to the app servers
in ``NANOLIMIT_HTTP_REDIS_PORT``, stopped by its PID at the end as the app
servers are. Each row keeps its own key prefix, and the 10^9 limit needs no
FLUSHALL between rounds. Redis's CPU time per request is reported apart
from the server's (it is another process group).

**Adding a variant** is one row of ``VARIANTS`` in bench/http_apps.py
(framework, name, builder, limit, the headers its answer must carry); this
script runs every row. A builder that needs a package names it in
``NEEDS`` below, and the script pip-installs it when missing.

How it measures:

* the server is pinned to one core and the load generator to another
  (``taskset``; on a 2-core machine core 0 serves, core 1 loads), so
  neither steals the other's core;
* ``wrk`` (apt-get-installed when missing; where there is no apt, a small C
  load generator embedded below is compiled instead and the run says so),
  one thread, ``CONNECTIONS`` keep-alive connections: enough that the server
  always has a request waiting, few enough that no queue builds up in front
  of it (see ``--calibrate``, and bench/README.md for the figures);
* each round starts every variant's server afresh on a free 127.0.0.1 port,
  checks its answer (200 with the headers it claims, or a 429 for a denied
  variant), warms it up, measures, checks the share of non-2xx answers and
  stops it by its PID (its process group; also on Ctrl-C or an exception;
  every server also runs under ``timeout``). The variants are interleaved,
  round by round, in alternating order, so a noisy minute on a shared machine
  lands on every variant alike;
* per variant the median rps of the rounds, and ``µs added`` per request
  over the same framework's ``bare``: ``1e6/rps − 1e6/rps_bare``. For a
  denied variant ``µs/request`` is what a 429 costs end to end. The spread is
  (max − min) / median of the rounds' rps;
* next to it the server's own CPU time per request (its process group's
  ``schedstat`` over the measured seconds / requests answered): on a quiet
  machine it reads like ``1e6/rps``; on a shared one, where other processes
  take turns on the server's core, it moves far less than rps does.

Numbers are one run's medians on the machine at hand; nothing here asserts a
time (tests/test_bench_http.py checks the apps and the harness, never wrk).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SRC = ROOT / "src"
if str(BENCH) not in sys.path:
    sys.path.insert(0, str(BENCH))

from http_apps import REDIS_PORT_ENV, VARIANT_ENV, VARIANTS, Variant  # noqa: E402

ROUNDS, QUICK_ROUNDS = 7, 2
DURATION, QUICK_DURATION = 4.0, 1.0  # seconds measured per variant per round
WARMUP, QUICK_WARMUP = 1.0, 0.3
# One wrk thread (it has one core). Keep-alive connections per server: with
# 1 the server idles for a loopback round trip and wrk's turn per request;
# uvicorn's event loop with 4 always finds the next request waiting while it
# writes the last answer, and 4 in flight is no queue. gunicorn's sync worker
# serves one connection at a time and closes it, so a second connection
# waiting in the accept queue keeps it busy and more would only wait longer
# (bench/README.md has --calibrate's figures).
CONNECTIONS = {"uvicorn": 4, "gunicorn": 2}
THREADS = 1
SERVER_CPU, LOAD_CPU = 0, 1
# The Redis rows' server shares the app server's core: the app awaits each
# reply, so the two mostly take turns, and what a request costs (app and
# store together) lands on the serving core; on core 1 it would take turns
# with wrk instead, and the load would fall with the store's cost.
REDIS_CPU = SERVER_CPU
START_TIMEOUT = 30.0  # seconds a server may take to answer its first request
STOP_GRACE = 5.0
# a denied variant answers at most this share of its requests with a 200
# (its first, and one per window edge)
DENIED_MIN_SHARE = 0.99

# import name -> pip requirement, for the names in a row's ``needs``
NEEDS = {"flask_limiter": "flask-limiter", "django_ratelimit": "django-ratelimit"}
VERSIONS = (
    "nanolimit",
    "uvicorn",
    "gunicorn",
    "starlette",
    "fastapi",
    "flask",
    "werkzeug",
    "slowapi",
    "flask-limiter",
    "limits",
    "django",
    "django-ratelimit",
    "h11",
    "httptools",
    "uvloop",
    "redis",
)


# ---------------------------------------------------------------------------
# What the run needs


def _installed(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def ensure_packages(rows: Sequence[Variant]) -> None:
    """pip-install into this interpreter what the chosen rows import."""
    wanted = {m for r in rows for m in r.needs}
    missing = sorted(m for m in wanted if not _installed(m))
    if missing:
        reqs = [NEEDS.get(m, m) for m in missing]
        print(f"installing {', '.join(reqs)}", file=sys.stderr)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *reqs], check=True, timeout=600)
        importlib.invalidate_caches()


# A stand-in for wrk where apt is not there: keep-alive GETs on N
# connections from one thread, reconnecting when the server closes (gunicorn's
# sync worker closes every connection), printing wrk's summary lines.
LOADGEN_C = r"""
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#define BUF 65536
typedef struct { int fd; size_t len; char buf[BUF]; } conn_t;
static struct sockaddr_in addr; static char req[256]; static size_t reqlen;
static double now(void) {
    struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec / 1e9;
}
static int dial(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0), one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (connect(fd, (struct sockaddr *)&addr, sizeof addr) != 0) { close(fd); return -1; }
    if (write(fd, req, reqlen) != (ssize_t)reqlen) { close(fd); return -1; }
    return fd;
}
int main(int argc, char **argv) {
    if (argc != 5) { fprintf(stderr, "usage: loadgen PORT PATH CONNECTIONS SECONDS\n"); return 2; }
    int n = atoi(argv[3]); double secs = atof(argv[4]);
    addr.sin_family = AF_INET; addr.sin_port = htons(atoi(argv[1]));
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    reqlen = snprintf(req, sizeof req, "GET %s HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n", argv[2]);
    conn_t *c = calloc(n, sizeof *c); struct pollfd *p = calloc(n, sizeof *p);
    long done = 0, bad = 0, errs = 0;
    for (int i = 0; i < n; i++) { c[i].fd = dial(); if (c[i].fd < 0) errs++; }
    double start = now(), end = start + secs;
    while (now() < end) {
        for (int i = 0; i < n; i++) {
            if (c[i].fd < 0) { c[i].fd = dial(); c[i].len = 0; if (c[i].fd < 0) errs++; }
            p[i].fd = c[i].fd; p[i].events = POLLIN; p[i].revents = 0;
        }
        if (poll(p, n, 100) < 0) break;
        for (int i = 0; i < n; i++) {
            if (c[i].fd < 0 || !(p[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
            ssize_t r = read(c[i].fd, c[i].buf + c[i].len, BUF - 1 - c[i].len);
            if (r <= 0) { close(c[i].fd); c[i].fd = -1; continue; }  /* closed: redialled next pass */
            c[i].len += r; c[i].buf[c[i].len] = 0;
            for (;;) {
                char *h = strstr(c[i].buf, "\r\n\r\n");
                if (!h) break;
                size_t head = h + 4 - c[i].buf, body = 0; int closing = 0;
                for (char *l = strstr(c[i].buf, "\r\n"); l && l < h; l = strstr(l + 2, "\r\n")) {
                    if (!strncasecmp(l + 2, "content-length:", 15)) body = strtoul(l + 17, NULL, 10);
                    if (!strncasecmp(l + 2, "connection: close", 17)) closing = 1;
                }
                if (c[i].len < head + body) break;
                int status = atoi(c[i].buf + 9);
                done++; if (status < 200 || status >= 400) bad++;
                memmove(c[i].buf, c[i].buf + head + body, c[i].len - head - body + 1);
                c[i].len -= head + body;
                if (closing) { close(c[i].fd); c[i].fd = -1; break; }  /* redialled next pass */
                if (write(c[i].fd, req, reqlen) != (ssize_t)reqlen) {
                    close(c[i].fd); c[i].fd = -1; errs++; break;
                }
            }
        }
    }
    double took = now() - start;
    printf("  %ld requests in %.2fs\n", done, took);
    if (errs) printf("  Socket errors: connect %ld, read 0, write 0, timeout 0\n", errs);
    if (bad) printf("  Non-2xx or 3xx responses: %ld\n", bad);
    printf("Requests/sec: %.2f\n", done / took);
    return 0;
}
"""


@dataclass
class LoadGen:
    """``wrk``, or the embedded C stand-in, as one command builder."""

    name: str
    path: str
    version: str

    def command(self, port: int, seconds: float, connections: int) -> list[str]:
        if self.name == "wrk":
            secs = f"{max(1, round(seconds))}s"
            return [
                self.path,
                f"-t{THREADS}",
                f"-c{connections}",
                f"-d{secs}",
                "--timeout",
                "10s",
                f"http://127.0.0.1:{port}/",
            ]
        return [self.path, str(port), "/", str(connections), f"{seconds:g}"]


def ensure_loadgen(workdir: Path, force_c: bool = False) -> LoadGen:
    """``wrk`` from PATH, else from apt-get, else the C stand-in built here."""
    wrk = shutil.which("wrk")
    if wrk is None and not force_c and shutil.which("apt-get"):
        print("installing wrk (apt-get)", file=sys.stderr)
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "timeout": 600}
        if subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], **quiet).returncode != 0:  # type: ignore[call-overload]
            subprocess.run(["apt-get", "update", "-qq"], **quiet)  # type: ignore[call-overload]
            subprocess.run(["apt-get", "install", "-y", "-qq", "wrk"], **quiet)  # type: ignore[call-overload]
        wrk = shutil.which("wrk")
    if wrk is not None and not force_c:
        out = subprocess.run([wrk, "-v"], capture_output=True, text=True, timeout=10)
        first = (out.stdout + out.stderr).strip().splitlines()
        return LoadGen("wrk", wrk, first[0] if first else "wrk")
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise SystemExit("no wrk, no apt-get to install it and no C compiler for the stand-in")
    source = workdir / "loadgen.c"
    source.write_text(LOADGEN_C)
    binary = workdir / "loadgen"
    subprocess.run([cc, "-O2", "-o", str(binary), str(source)], check=True, timeout=120)
    return LoadGen("loadgen", str(binary), "embedded C load generator (bench/http_e2e.py LOADGEN_C)")


# ---------------------------------------------------------------------------
# Servers


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def server_stack() -> dict[str, str]:
    """uvicorn's event loop and HTTP parser: the fast ones where installed."""
    return {
        "loop": "uvloop" if _installed("uvloop") else "asyncio",
        "http": "httptools" if _installed("httptools") else "h11",
    }


def server_argv(row: Variant, port: int) -> list[str]:
    if row.server == "gunicorn":
        return [
            sys.executable,
            "-m",
            "gunicorn",
            "-w",
            "1",
            "-k",
            "sync",
            "-b",
            f"127.0.0.1:{port}",
            "--chdir",
            str(BENCH),
            "--timeout",
            "30",
            "--graceful-timeout",
            "2",
            "--log-level",
            "warning",
            f"http_apps:{row.framework}_app()",
        ]
    stack = server_stack()
    return [
        sys.executable,
        "-m",
        "uvicorn",
        "--factory",
        f"http_apps:{row.framework}_app",
        "--app-dir",
        str(BENCH),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--no-access-log",
        "--log-level",
        "warning",
        "--loop",
        stack["loop"],
        "--http",
        stack["http"],
        "--timeout-graceful-shutdown",
        "2",
    ]


# Every server this process started and has not yet seen die: stopped on the
# way out whatever happens (a finally, atexit, SIGTERM turned into an exception).
_LIVE: dict[int, subprocess.Popen[bytes]] = {}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the server's process group, SIGKILL to it after the grace,
    then wait until nothing of the group is left."""
    pgid = proc.pid  # start_new_session: the group has the leader's id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_GRACE)
    deadline = time.monotonic() + STOP_GRACE
    while _group_alive(pgid) and time.monotonic() < deadline:
        time.sleep(0.02)
    if _group_alive(pgid):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(STOP_GRACE)
    _LIVE.pop(proc.pid, None)


def stop_all() -> None:
    for proc in list(_LIVE.values()):
        stop_server(proc)


def get(port: int, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """One ``GET /``: status, lower-case headers, body."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=timeout) as reply:
            return reply.status, {k.lower(): v for k, v in reply.headers.items()}, reply.read()
    except urllib.error.HTTPError as err:
        return err.code, {k.lower(): v for k, v in err.headers.items()}, err.read()


def check_answer(row: Variant, status: int, headers: dict[str, str], body: bytes) -> None:
    """The variant answers what it claims, or nothing of it is measured."""
    want = 429 if row.denied else 200
    if status != want:
        raise RuntimeError(f"{row.framework}/{row.name} answered {status}, not {want}: {body[:200]!r}")
    if not row.denied and body != b"ok":
        raise RuntimeError(f"{row.framework}/{row.name} answered {body[:200]!r}, not b'ok'")
    lacking = [h for h in row.headers if h not in headers]
    if lacking:
        raise RuntimeError(f"{row.framework}/{row.name} answered without {', '.join(lacking)}")


class Running(NamedTuple):
    port: int
    pgid: int  # the server's process group (start_new_session: the leader's pid)


def group_cpu_ns(pgid: int) -> int:
    """CPU time every thread of the process group has run, in ns (the
    scheduler's ``schedstat``; clock ticks where that is missing). A server
    alone on its core burns what it serves: this reads the same figure as
    wall time on a quiet machine, and stays put when other processes take
    turns on that core, which wall time does not."""
    total = 0
    tick = 1e9 / os.sysconf("SC_CLK_TCK")
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
            fields = stat[stat.rindex(")") + 2 :].split()
            if int(fields[2]) != pgid:  # state, ppid, pgrp
                continue
            try:
                for task in os.scandir(Path(entry.path, "task")):
                    total += int(Path(task.path, "schedstat").read_text().split()[0])
            except FileNotFoundError:
                total += round((int(fields[11]) + int(fields[12])) * tick)  # utime, stime
        except (OSError, ValueError, IndexError):
            continue  # it exited meanwhile
    return total


@contextlib.contextmanager
def serve(
    row: Variant, lifetime: float, cpu: int | None = SERVER_CPU, log: Path | None = None
) -> Iterator[Running]:
    """The row's server on a free port, pinned to ``cpu``, under ``timeout``
    (``lifetime`` seconds, whatever this process does); yields the port once
    it answered as the row claims, stops it by its PID on the way out."""
    port = free_port()
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), str(BENCH), *filter(None, [env.get("PYTHONPATH")])])
    env[VARIANT_ENV] = row.name
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    argv = ["timeout", "-s", "KILL", f"{lifetime:.0f}", *pin, *server_argv(row, port)]
    with tempfile.TemporaryFile() if log is None else log.open("w+b") as err:
        proc = subprocess.Popen(
            argv,
            cwd=str(BENCH),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=err,
            start_new_session=True,
        )
        _LIVE[proc.pid] = proc
        try:
            deadline = time.monotonic() + START_TIMEOUT
            answer: tuple[int, dict[str, str], bytes] | None = None
            while answer is None:
                if proc.poll() is not None or time.monotonic() > deadline:
                    err.seek(0)
                    tail = err.read()[-3000:].decode(errors="replace")
                    raise RuntimeError(f"{row.framework}/{row.name} did not start:\n{tail}")
                try:
                    answer = get(port, timeout=2.0)
                except (OSError, urllib.error.URLError):
                    time.sleep(0.05)
            if row.denied and answer[0] == 200:
                answer = get(port)  # the first request of a limit-1 rule is admitted
            check_answer(row, *answer)
            yield Running(port, proc.pid)
        finally:
            stop_server(proc)


def ensure_redis_server() -> str:
    """``redis-server`` from PATH, else from apt-get (Debian's package)."""
    found = shutil.which("redis-server")
    if found is None and shutil.which("apt-get"):
        print("installing redis-server (apt-get)", file=sys.stderr)
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "timeout": 600}
        if subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], **quiet).returncode != 0:  # type: ignore[call-overload]
            subprocess.run(["apt-get", "update", "-qq"], **quiet)  # type: ignore[call-overload]
            subprocess.run(["apt-get", "install", "-y", "-qq", "redis-server"], **quiet)  # type: ignore[call-overload]
        found = shutil.which("redis-server")
    if found is None:
        raise SystemExit("the Redis rows need redis-server: apt-get install -y redis-server")
    return found


def redis_version(port: int) -> str | None:
    """The server's ``redis_version`` (INFO server), for the JSON."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2.0) as s:
            s.settimeout(2.0)
            s.sendall(b"INFO server\r\n")
            text = s.recv(65536).decode(errors="replace")
    except OSError:
        return None
    found = re.search(r"redis_version:(\S+)", text)
    return found.group(1) if found else None


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.settimeout(0.5)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@contextlib.contextmanager
def redis_server(
    binary: str, lifetime: float, workdir: Path, cpu: int | None = REDIS_CPU
) -> Iterator[Running]:
    """A throwaway Redis for the run: 127.0.0.1, a free port, no
    persistence, pinned to ``cpu``, under ``timeout``; its port in
    ``REDIS_PORT_ENV`` for the servers started meanwhile, and stopped by its
    PID (its process group) on the way out, as every app server is."""
    port = free_port()
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    argv = [
        "timeout", "-s", "KILL", f"{lifetime:.0f}", *pin, binary,
        "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--protected-mode", "no", "--dir", str(workdir), "--logfile", str(workdir / "redis.log"),
    ]  # fmt: skip
    proc = subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    _LIVE[proc.pid] = proc
    before = os.environ.get(REDIS_PORT_ENV)
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _ping(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                log = workdir / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RuntimeError(f"redis-server did not start on port {port}:\n{tail}")
            time.sleep(0.05)
        os.environ[REDIS_PORT_ENV] = str(port)
        yield Running(port, proc.pid)
    finally:
        if before is None:
            os.environ.pop(REDIS_PORT_ENV, None)
        else:
            os.environ[REDIS_PORT_ENV] = before
        stop_server(proc)


# ---------------------------------------------------------------------------
# Load


@dataclass
class Load:
    rps: float
    requests: int
    non2xx: int
    socket_errors: int
    cpu_ns: int = 0  # the server's CPU time over the run (measure() sets it)
    store_cpu_ns: int | None = None  # the Redis server's, for a row that uses it

    @property
    def cpu_us(self) -> float:
        """Server CPU µs per answered request."""
        return self.cpu_ns / 1e3 / self.requests if self.requests else 0.0

    @property
    def store_cpu_us(self) -> float | None:
        """Redis CPU µs per answered request (not in ``cpu_us``: another process)."""
        if self.store_cpu_ns is None:
            return None
        return self.store_cpu_ns / 1e3 / self.requests if self.requests else 0.0


_REQUESTS = re.compile(r"(\d+) requests in")
_RPS = re.compile(r"Requests/sec:\s+([\d.]+)")
_NON2XX = re.compile(r"Non-2xx or 3xx responses:\s+(\d+)")
_ERRORS = re.compile(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)")


def parse_load(text: str) -> Load:
    """wrk's summary (the C stand-in prints the same lines)."""
    rps, requests = _RPS.search(text), _REQUESTS.search(text)
    if rps is None or requests is None:
        raise RuntimeError(f"no Requests/sec in the load generator's output:\n{text[-2000:]}")
    non2xx = _NON2XX.search(text)
    errors = _ERRORS.search(text)
    return Load(
        float(rps.group(1)),
        int(requests.group(1)),
        int(non2xx.group(1)) if non2xx else 0,
        sum(int(g) for g in errors.groups()) if errors else 0,
    )


def run_load(gen: LoadGen, port: int, seconds: float, connections: int, cpu: int | None = LOAD_CPU) -> Load:
    pin = ["taskset", "-c", str(cpu)] if cpu is not None else []
    proc = subprocess.Popen(
        [*pin, *gen.command(port, seconds, connections)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=seconds + 30)
    finally:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)
    if proc.returncode != 0:
        raise RuntimeError(f"{gen.name} exited {proc.returncode}:\n{out.decode(errors='replace')[-2000:]}")
    return parse_load(out.decode(errors="replace"))


# ---------------------------------------------------------------------------
# The run


@dataclass
class Cell:
    row: Variant
    rounds: list[Load] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.row.framework}/{self.row.name}"

    @property
    def rps(self) -> list[float]:
        return [r.rps for r in self.rounds]


def measure(
    rows: Sequence[Variant],
    gen: LoadGen,
    rounds: int,
    seconds: float,
    warmup: float,
    connections: int | None = None,
    cpus: tuple[int | None, int | None] = (SERVER_CPU, LOAD_CPU),
    store: Running | None = None,
) -> list[Cell]:
    cells = [Cell(row) for row in rows]
    lifetime = START_TIMEOUT + warmup + seconds + 60
    for n in range(rounds):
        order = cells if n % 2 == 0 else cells[::-1]
        for i, cell in enumerate(order, 1):
            print(
                f"round {n + 1}/{rounds} {i:2}/{len(order)} {cell.key}", end="", file=sys.stderr, flush=True
            )
            with serve(cell.row, lifetime, cpus[0]) as server:
                conns = connections or CONNECTIONS[cell.row.server]
                if warmup > 0:
                    run_load(gen, server.port, warmup, conns, cpus[1])
                uses_store = store is not None and cell.row.store is not None
                cpu0 = group_cpu_ns(server.pgid)
                store0 = group_cpu_ns(store.pgid) if uses_store and store is not None else 0
                load = run_load(gen, server.port, seconds, conns, cpus[1])
                load.cpu_ns = group_cpu_ns(server.pgid) - cpu0
                if uses_store and store is not None:
                    load.store_cpu_ns = group_cpu_ns(store.pgid) - store0
            check_load(cell.row, load)
            cell.rounds.append(load)
            print(f"  {load.rps:10,.0f} rps {load.cpu_us:8.1f} CPU µs/request", file=sys.stderr)
    return cells


def check_load(row: Variant, load: Load) -> None:
    """Nothing is reported that was measured on the wrong path."""
    if load.requests == 0:
        raise RuntimeError(f"{row.framework}/{row.name}: no request answered")
    if load.socket_errors > 0.01 * load.requests:
        # a few at the end of a run (or a timeout on a loaded machine) are
        # counted in the JSON; more means the server was not serving
        raise RuntimeError(f"{row.framework}/{row.name}: {load.socket_errors} socket errors")
    share = load.non2xx / load.requests
    if row.denied and share < DENIED_MIN_SHARE:
        raise RuntimeError(f"{row.framework}/{row.name}: only {share:.1%} of answers were 429s")
    if not row.denied and load.non2xx:
        raise RuntimeError(f"{row.framework}/{row.name}: {load.non2xx} answers were not 2xx")


def summarise(cells: Sequence[Cell]) -> list[dict[str, Any]]:
    """Per cell: wall figures (the brief's 1e6/rps) and the server's CPU
    time per request, each as medians over the rounds, and each minus the
    same framework's ``bare``."""
    bare = {c.row.framework: c for c in cells if c.row.name == "bare"}
    out = []
    for c in cells:
        rps = c.rps
        cpu = [r.cpu_us for r in c.rounds]
        med = statistics.median(rps)
        us = 1e6 / med
        base = bare.get(c.row.framework)
        added = cpu_added = None
        added_rounds: list[float] = []
        if base is not None and c is not base:
            added = us - 1e6 / statistics.median(base.rps)
            added_rounds = [1e6 / a - 1e6 / b for a, b in zip(rps, base.rps)]
            cpu_added = statistics.median(cpu) - statistics.median(r.cpu_us for r in base.rounds)
        store_cpu = [x for x in (r.store_cpu_us for r in c.rounds) if x is not None]
        out.append(
            {
                "framework": c.row.framework,
                "variant": c.row.name,
                "server": c.row.server,
                "denied": c.row.denied,
                "limit": c.row.limit,
                "rps_median": round(med, 1),
                "rps_min": round(min(rps), 1),
                "rps_max": round(max(rps), 1),
                "spread": round((max(rps) - min(rps)) / med, 4),
                "us_per_request": round(us, 2),
                "us_added": None if added is None else round(added, 2),
                "us_added_rounds": [round(a, 2) for a in added_rounds],
                "cpu_us_median": round(statistics.median(cpu), 2),
                "cpu_us_min": round(min(cpu), 2),
                "cpu_us_max": round(max(cpu), 2),
                "cpu_us_added": None if cpu_added is None else round(cpu_added, 2),
                "store": c.row.store,
                "store_cpu_us_median": round(statistics.median(store_cpu), 2) if store_cpu else None,
                "socket_errors": sum(r.socket_errors for r in c.rounds),
                "non2xx_share": round(sum(r.non2xx for r in c.rounds) / sum(r.requests for r in c.rounds), 4),
                "rounds_rps": [round(r, 1) for r in rps],
                "rounds_cpu_us": [round(x, 2) for x in cpu],
                "rounds_store_cpu_us": [round(x, 2) for x in store_cpu],
            }
        )
    return out


def markdown(rows: Sequence[dict[str, Any]]) -> str:
    # a Redis column only when some row used one (the store's own CPU time,
    # which the server's column leaves out)
    store = any(r.get("store_cpu_us_median") is not None for r in rows)
    lines = [
        "| framework | variant | rps median (min-max) | spread | µs/request | µs added over bare "
        "| server CPU µs/request (min-max) | CPU µs added over bare | 429 share |"
        + (" Redis CPU µs/request |" if store else ""),
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if store else ""),
    ]
    for r in rows:
        added = "" if r["us_added"] is None else f"{r['us_added']:+.1f}"
        cpu_added = "" if r["cpu_us_added"] is None else f"{r['cpu_us_added']:+.1f}"
        store_cpu = r.get("store_cpu_us_median")
        lines.append(
            f"| {r['framework']} | {r['variant']} "
            f"| {r['rps_median']:,.0f} ({r['rps_min']:,.0f}-{r['rps_max']:,.0f}) "
            f"| {r['spread']:.0%} | {r['us_per_request']:.1f} | {added} "
            f"| {r['cpu_us_median']:.1f} ({r['cpu_us_min']:.1f}-{r['cpu_us_max']:.1f}) | {cpu_added} "
            f"| {r['non2xx_share']:.1%} |"
            + ((f" {store_cpu:.1f} |" if store_cpu is not None else " |") if store else "")
        )
    return "\n".join(lines)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine(gen: LoadGen | None = None) -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    import nanolimit

    info: dict[str, Any] = {
        "nproc": os.cpu_count(),
        "cpu": model or platform.processor(),
        "python": platform.python_version(),
        "implementation": nanolimit.IMPLEMENTATION,
        "platform": platform.platform(),
        "loadavg": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "versions": {d: _version(d) for d in VERSIONS},
        "uvicorn": server_stack(),
    }
    info["git"] = git_state()
    if gen is not None:
        info["load_generator"] = {"name": gen.name, "version": gen.version}
    return info


def git_state() -> dict[str, Any]:
    """The commit measured, and how many files under src/ differ from it
    (the servers import the working tree, edits and built extension included)."""

    def git(*argv: str) -> str:
        try:
            out = subprocess.run(["git", *argv], cwd=ROOT, capture_output=True, text=True, timeout=30)
        except OSError:
            return ""
        return out.stdout.strip() if out.returncode == 0 else ""

    dirty = git("status", "--porcelain", "--", "src")
    return {"commit": git("rev-parse", "HEAD") or None, "src_files_changed": len(dirty.splitlines())}


def calibrate(gen: LoadGen, seconds: float, rounds: int) -> dict[str, dict[int, float]]:
    """Median rps of each bare app by connection count, interleaved: the
    smallest count where the curve flattens is the one to run with."""
    counts = (1, 2, 4, 8, 16, 32)
    bare = [r for r in VARIANTS if r.name == "bare" and r.framework in ("starlette", "flask")]
    seen: dict[str, dict[int, list[float]]] = {r.framework: {c: [] for c in counts} for r in bare}
    for _ in range(rounds):
        for row in bare:
            with serve(row, START_TIMEOUT + len(counts) * (seconds + 5) + 60) as server:
                port = server.port
                run_load(gen, port, 1.0, CONNECTIONS[row.server])
                for c in counts:
                    seen[row.framework][c].append(run_load(gen, port, seconds, c).rps)
    return {fw: {c: round(statistics.median(v), 1) for c, v in by.items()} for fw, by in seen.items()}


def select(only: str | None) -> list[Variant]:
    if not only:
        return list(VARIANTS)
    wanted = [w.strip() for w in only.split(",") if w.strip()]
    rows = [r for r in VARIANTS if f"{r.framework}/{r.name}" in wanted or r.framework in wanted]
    unknown = [w for w in wanted if not any(w in (f"{r.framework}/{r.name}", r.framework) for r in rows)]
    if unknown:
        raise SystemExit(f"unknown variants: {', '.join(unknown)}")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="2 short rounds (a smoke run)")
    parser.add_argument("--json", metavar="PATH", help="write the figures and every round here")
    parser.add_argument(
        "--rounds", type=int, help=f"interleaved rounds (default {ROUNDS}, --quick {QUICK_ROUNDS})"
    )
    parser.add_argument(
        "--duration", type=float, help=f"seconds measured per variant per round ({DURATION:g})"
    )
    parser.add_argument("--warmup", type=float, help=f"seconds of load before each measurement ({WARMUP:g})")
    parser.add_argument("--connections", type=int, help=f"connections, every server (default {CONNECTIONS})")
    parser.add_argument("--only", help="comma-separated framework/variant names, or frameworks")
    parser.add_argument("--calibrate", action="store_true", help="rps of the bare apps by connection count")
    parser.add_argument("--inprocess-only", action="store_true", help="only the in-process figures")
    parser.add_argument("--no-inprocess", action="store_true", help="skip the in-process figures")
    parser.add_argument("--c-loadgen", action="store_true", help="use the embedded C load generator, not wrk")
    args = parser.parse_args(argv)
    rounds = args.rounds or (QUICK_ROUNDS if args.quick else ROUNDS)
    seconds = args.duration or (QUICK_DURATION if args.quick else DURATION)
    warmup = args.warmup if args.warmup is not None else (QUICK_WARMUP if args.quick else WARMUP)

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    atexit.register(stop_all)
    result: dict[str, Any] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="http_e2e") as tmp:
            if not args.inprocess_only:
                rows = select(args.only)
                ensure_packages(rows)
                gen = ensure_loadgen(Path(tmp), args.c_loadgen)
                if (os.cpu_count() or 1) < 2:
                    print("warning: one core: server and load share it", file=sys.stderr)
                result["machine"] = machine(gen)
                result["method"] = {
                    "rounds": rounds,
                    "seconds": seconds,
                    "warmup_seconds": warmup,
                    "connections": args.connections or CONNECTIONS,
                    "threads": THREADS,
                    "server_cpu": SERVER_CPU,
                    "load_cpu": LOAD_CPU,
                    "redis_cpu": REDIS_CPU,
                }
                print(json.dumps(result["machine"]), file=sys.stderr)
                if args.calibrate:
                    result["calibration"] = calibrate(gen, seconds, rounds)
                    print(json.dumps(result["calibration"], indent=1))
                else:
                    started = time.monotonic()
                    with contextlib.ExitStack() as stack:
                        store = None
                        if any(r.store == "redis" for r in rows):
                            # one server for the run, outliving every round (10^9
                            # per hour: no round's counts reach a limit)
                            lifetime = rounds * len(rows) * (START_TIMEOUT + warmup + seconds + 30) + 120
                            binary = ensure_redis_server()
                            store = stack.enter_context(redis_server(binary, lifetime, Path(tmp)))
                            result["machine"]["redis"] = redis_version(store.port)
                        cells = measure(rows, gen, rounds, seconds, warmup, args.connections, store=store)
                    result["wall_seconds"] = round(time.monotonic() - started, 1)
                    result["rows"] = summarise(cells)
                    result["loadavg_after"] = os.getloadavg()
                    print(markdown(result["rows"]))
            if not args.no_inprocess and not args.calibrate:
                import asgi_inprocess

                figures = asgi_inprocess.measure(*asgi_inprocess.sizes(args.quick))
                result["inprocess"] = figures
                print()
                print(asgi_inprocess.markdown(figures))
    finally:
        stop_all()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
