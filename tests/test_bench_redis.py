"""``nanolimit bench --redis URL``: the Redis scenarios run against the named
server, report a cell per library and scenario, and delete exactly the keys
they wrote (a key of the user's on the same server survives)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nanolimit.cli import bench as _bench

pytest_plugins = ["redis_servers"]  # the server fixtures


def test_redis_scenarios_run_and_clean_up(redis_server: Any, capsys: pytest.CaptureFixture[str]) -> None:
    admin = redis_server.client()
    admin.set("users:own:key", "keep me")
    url = f"redis://127.0.0.1:{redis_server.port}/0"
    argv = ["--quiet", "--json", "--redis", url, "--libraries", "nanolimit"]
    argv += ["--algorithms", "token_bucket,gcra"]
    argv += ["--scenarios", "redis_hot_allowed,redis_hot_denied,redis_keys_1k,redis_peek"]
    assert _bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    cells = {(c["algorithm"], c["scenario"]): c for c in out["cells"]}
    assert len(cells) == 8
    assert all(c["error"] is None and c["median_ns"] > 1_000 for c in cells.values()), cells  # a round trip
    assert out["meta"]["redis"] == url
    # most keys expire at once (16M per second refills them); a spent one-per-hour key would stay
    assert out["meta"]["redis_keys_removed"] >= 2
    assert admin.keys("*nlbench*") == []
    assert admin.get("users:own:key") == b"keep me"
    admin.close()


def test_redis_scenarios_need_a_server(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stopped:
        _bench.main(["--quiet", "--libraries", "nanolimit", "--scenarios", "redis_hot_allowed"])
    assert stopped.value.code == 2
    assert "--redis" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stopped:
        _bench.main(["--quiet", "--redis", "redis://127.0.0.1:1/0", "--scenarios", "redis_peek"])
    assert stopped.value.code == 2
    assert "no Redis answering at redis://127.0.0.1:1/0" in capsys.readouterr().err


def test_a_reported_url_never_shows_the_password() -> None:
    assert _bench._public_url("redis://app:s3cret@db.internal:6380/2") == "redis://app:***@db.internal:6380/2"
    assert _bench._public_url("redis://:s3cret@db.internal/0") == "redis://:***@db.internal/0"
    assert _bench._public_url("redis://db.internal:6379/0") == "redis://db.internal:6379/0"
