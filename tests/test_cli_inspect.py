"""``nanolimit inspect`` and ``nanolimit clear`` through ``python -m nanolimit``
subprocesses, against a real Redis/Valkey server and a real shared-memory
zone: the state a gateway-built limiter left is read (and not spent), a
clear is seen by the gateway's limiter, and bad input is one line, exit 2."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis_servers import Server, free_port

import nanolimit
from nanolimit import LimiterFactory, RateLimitRule, storage_from_uri
from nanolimit._select import native_core

pytest_plugins = ["redis_servers"]  # the server fixtures

HOST = "127.0.0.1"
SECRET = "hunter2-Zq"
ENV = {**os.environ, "PYTHONPATH": str(Path(nanolimit.__file__).resolve().parents[1])}


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nanolimit", *args], capture_output=True, text=True, env=ENV, timeout=60
    )


def _inside_a_fixed_window(window: float, margin: float) -> None:
    """Wait out the end of the current wall-clock window when fewer than
    ``margin`` seconds of it are left: a fixed-window key read by a CLI
    subprocess after the boundary is a new, empty window (CI met it)."""
    left = window - time.time() % window
    if left < margin:
        time.sleep(left + 0.05)


def _gateway_limiter(storage: Any, rule: RateLimitRule) -> Any:
    """The limiter the gateway builds for ``rule`` on ``storage``."""
    return LimiterFactory(storage).for_rule(rule)


def _one_line_error(done: subprocess.CompletedProcess[str], code: int, *named: str) -> None:
    assert done.returncode == code, done
    assert done.stdout == ""
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    for text in named:
        assert text in lines[0]
    assert SECRET not in done.stderr


# --------------------------------------------------------------------------
# Redis


def test_inspect_reads_a_key_on_redis_without_spending(redis_server: Server) -> None:
    uri = f"redis://{HOST}:{redis_server.port}/0?prefix=gw:"
    storage = storage_from_uri(uri, on_error="raise")
    rule = RateLimitRule.from_rate("api", "5/hour", scope="ip", algorithm="fixed_window")
    limiter = _gateway_limiter(storage, rule)
    key = "ip:203.0.113.7"  # what the gateway keys that client under
    _inside_a_fixed_window(3600.0, margin=60.0)  # four CLI runs read this window
    assert limiter.allow(key).allowed and limiter.allow(key).allowed
    try:
        args = ("--storage", uri, "--rule", "api", "--rate", "5/hour", "--algorithm", "fixed_window")
        done = cli("inspect", "203.0.113.7", *args, "--scope", "ip", "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["key"] == key and report["exists"] is True
        assert report["storage"] == "RedisStorage"
        assert report["redis_key"] == storage.redis_key(limiter.config, key)
        assert report["redis_key"].startswith("gw:")
        assert report["state"]["count"] == 2 and report["state"]["algorithm"] == "fixed_window"
        assert report["next"]["allowed"] is True and report["next"]["remaining"] == 2
        assert report["rule"]["limit"] == 5 and report["rule"]["name"] == "api"
        # peek spends nothing
        assert limiter.state(key).count == 2
        # the same key given as the limiter's key itself, as text
        text = cli("inspect", key, *args)
        assert text.returncode == 0, text.stderr
        assert f"key        {key}" in text.stdout and "count=2" in text.stdout
        assert "next       allowed: remaining 2 of 5" in text.stdout
        # a key never seen
        fresh = json.loads(cli("inspect", "ip:198.51.100.1", *args, "--json").stdout)
        assert fresh["exists"] is False and fresh["state"] is None and fresh["next"]["remaining"] == 4
    finally:
        storage.close()


def test_clear_resets_a_key_on_redis_and_says_whether_it_existed(redis_server: Server) -> None:
    uri = f"redis://{HOST}:{redis_server.port}"
    storage = storage_from_uri(uri, on_error="raise")
    rule = RateLimitRule.from_rate("login", "2/minute", scope="user")
    limiter = _gateway_limiter(storage, rule)
    assert [limiter.allow("user:42").allowed for _ in range(3)] == [True, True, False]
    try:
        args = ("--storage", uri, "--rule", "login", "--rate", "2/minute", "--scope", "user")
        done = cli("clear", "42", *args)
        assert done.returncode == 0, done.stderr
        assert "cleared user:42" in done.stdout and "it existed" in done.stdout
        assert limiter.state("user:42") is None and limiter.allow("user:42").allowed
        limiter.reset("user:42")
        again = cli("clear", "42", *args)
        assert again.returncode == 0 and "nothing to clear" in again.stdout
    finally:
        storage.close()


def test_the_rule_comes_from_a_rules_file(redis_server: Server, tmp_path: Path) -> None:
    """(An hour's rate: one request's state lives 6 minutes, not the 6 s
    that three CLI processes on a busy runner had outlived.)"""
    rules = tmp_path / "rules.toml"
    rules.write_text(
        '[[rules]]\nname = "search"\npath_prefix = "/search"\nscope = "user"\n'
        'algorithm = "gcra"\nrate = "10/hour burst 3"\n[default]\nrate = "100/hour"\n'
    )
    uri = f"redis://{HOST}:{redis_server.port}"
    storage = storage_from_uri(uri, on_error="raise")
    rule = nanolimit.load_rules(rules).rules[0]
    limiter = _gateway_limiter(storage, rule)
    limiter.allow("user:alice")
    try:
        done = cli("inspect", "alice", "--storage", uri, "--rules", str(rules), "--rule", "search", "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["key"] == "user:alice" and report["exists"] is True  # the rule's own scope
        assert report["state"]["algorithm"] == "gcra" and report["rule"]["burst"] == 3
        assert report["next"]["remaining"] == limiter.peek("user:alice").remaining
        cleared = cli("clear", "alice", "--storage", uri, "--rules", str(rules), "--rule", "search")
        assert cleared.returncode == 0 and "it existed" in cleared.stdout
        assert limiter.state("user:alice") is None
        default = cli("inspect", "10.0.0.1", "--storage", uri, "--rules", str(rules), "--rule", "default")
        assert default.returncode == 0 and "key        ip:10.0.0.1" in default.stdout
    finally:
        storage.close()


# --------------------------------------------------------------------------
# A shared-memory zone, and memory://


@pytest.mark.skipif(native_core() is None, reason="the shared-memory zone needs the native extension")
def test_inspect_and_clear_on_a_zone() -> None:
    name = f"nl-cli-{uuid.uuid4().hex[:12]}"
    zone = storage_from_uri(f"shm://{name}?max_keys=1000")
    try:
        rule = RateLimitRule.from_rate("zone-api", "3/minute", scope="api_key")
        limiter = _gateway_limiter(zone, rule)
        # the gateway keys an API key by its digest: the CLI does the same
        from nanolimit.gateway.keys import DefaultKeyExtractor
        from nanolimit.gateway.request import Request

        key = DefaultKeyExtractor().storage_key_for(
            Request("GET", "/", headers={"x-api-key": "sk-live-1"}), rule.scope
        )
        assert [limiter.allow(key).allowed for _ in range(4)] == [True, True, True, False]
        args = (
            "--storage",
            f"shm://{name}",
            "--rule",
            "zone-api",
            "--rate",
            "3/minute",
            "--scope",
            "api_key",
        )
        done = cli("inspect", "sk-live-1", *args, "--json")
        assert done.returncode == 0, done.stderr
        report = json.loads(done.stdout)
        assert report["key"] == key and report["zone"] == name and report["exists"] is True
        assert report["next"]["allowed"] is False and report["next"]["retry_after"] > 0
        cleared = cli("clear", "sk-live-1", *args)
        assert cleared.returncode == 0 and "it existed" in cleared.stdout
        assert limiter.allow(key).allowed  # the gateway's limiter sees the cleared key
    finally:
        zone.unlink()
        zone.close()
    gone = cli("inspect", "k", "--storage", f"shm://{name}", "--rule", "r", "--rate", "1/s")
    _one_line_error(gone, 2, "no shared-memory zone called")


def test_memory_holds_nothing_in_a_fresh_process() -> None:
    done = cli("inspect", "k", "--storage", "memory://", "--rule", "r", "--rate", "3/minute", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["exists"] is False
    assert (
        "nothing to clear"
        in cli("clear", "k", "--storage", "memory://", "--rule", "r", "--rate", "1/s").stdout
    )


# --------------------------------------------------------------------------
# Bad input: one line, exit 2; an unreachable store: one line, exit 1


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (("--storage", f"mongodb://u:{SECRET}@h", "--rule", "r", "--rate", "1/s"), "unknown storage scheme"),
        (
            ("--storage", f"redis://:{SECRET}@h?colour=red", "--rule", "r", "--rate", "1/s"),
            "no option 'colour'",
        ),
        (("--storage", "redis://", "--rule", "r", "--rate", "1/s"), "needs a host"),
        (("--storage", "memory://", "--rule", "r", "--rate", "lots"), "rate"),
        (("--storage", "memory://", "--rule", "r"), "give --rules FILE, or --rate"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: tuple[str, ...], named: str) -> None:
    _one_line_error(cli("inspect", "k", *args), 2, "nanolimit inspect:", named)


def test_an_unknown_rule_in_a_rules_file_is_one_line(tmp_path: Path) -> None:
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps({"rules": [{"name": "login", "rate": "5/minute"}]}))
    done = cli("clear", "k", "--storage", "memory://", "--rules", str(rules), "--rule", "nope")
    _one_line_error(done, 2, "nanolimit clear:", "has no rule 'nope'", "login")
    both = cli(
        "inspect", "k", "--storage", "memory://", "--rules", str(rules), "--rule", "login", "--rate", "1/s"
    )
    _one_line_error(both, 2, "give one or the other")
    broken = tmp_path / "broken.toml"
    broken.write_text("[[rules]]\nname = 3\n")
    _one_line_error(cli("inspect", "k", "--storage", "memory://", "--rules", str(broken), "--rule", "x"), 2)


def test_an_unreachable_redis_is_one_line_and_exit_1() -> None:
    port = free_port()  # nothing listens there
    done = cli(
        "inspect",
        "k",
        "--storage",
        f"redis://:{SECRET}@{HOST}:{port}?timeout=0.5",
        "--rule",
        "r",
        "--rate",
        "1/s",
    )
    _one_line_error(done, 1, "nanolimit inspect:", f"redis://:***@{HOST}:{port}")


def test_default_names_the_files_default_rule_whatever_its_name(tmp_path: Path) -> None:
    """The docs promise ``--rule default`` reads the file's default rule; a
    [default] with a name of its own was refused ("has no rule 'default'").
    A rule actually named "default" still wins."""
    rules = tmp_path / "rules.toml"
    rules.write_text(
        '[default]\nname = "fallback"\nrate = "100/hour"\n[[rules]]\nname = "login"\nrate = "5/minute"\n'
    )
    args = ("--storage", "memory://", "--rules", str(rules), "--json")
    done = cli("inspect", "10.0.0.1", *args, "--rule", "default")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rule"]["name"] == "fallback"
    rules.write_text(
        '[default]\nname = "fallback"\nrate = "100/hour"\n[[rules]]\nname = "default"\nrate = "5/minute"\n'
    )
    done = cli("inspect", "10.0.0.1", *args, "--rule", "default")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["rule"]["limit"] == 5
