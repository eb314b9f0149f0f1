"""The shared-memory zone through the gateway: the factory, the pipeline,
a rules file's ``[storage]`` section, its reload and ``check-config``.
(Real servers with several workers: test_zone_servers.py.)"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from _helpers import needs_shared_memory

from nanolimit.errors import ConfigError, ValidationError
from nanolimit.gateway.config import ConfigWatcher, LoadedRules, StorageSection, load_rules, parse_rules
from nanolimit.gateway.factory import LimiterFactory
from nanolimit.gateway.middleware import RateLimitPipeline, Request, Response
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import RateLimitRule

pytestmark = [pytest.mark.native, needs_shared_memory]


@pytest.fixture
def name() -> Iterator[str]:
    zone_name = f"nltest-{uuid.uuid4().hex[:16]}"
    yield zone_name
    import nanolimit._core as c

    c.SharedMemoryStorage.unlink_segment(zone_name)


def rules_text(name: str, extra: str = "") -> str:
    return (
        '[[rules]]\nname = "api"\npath_prefix = "/api"\nrate = "3/minute"\nscope = "global"\n\n'
        f'[storage]\ntype = "shared_memory"\nname = "{name}"\nmax_keys = 1000\n{extra}'
    )


def ok(request: Request) -> Response:
    return Response(200)


def test_two_pipelines_on_one_zone_share_the_budget(native, name):
    registry = RuleRegistry([RateLimitRule("api", "*", "/api", "global", "fixed_window", 3, 60.0)])
    first = RateLimitPipeline(registry, LimiterFactory(native.SharedMemoryStorage(name, max_keys=100)))
    second = RateLimitPipeline(registry, LimiterFactory(native.SharedMemoryStorage(name, max_keys=100)))
    request = Request("GET", "/api/x", client="10.0.0.1")
    statuses = [mw(request, ok).status for _ in range(3) for mw in (first, second)]
    assert statuses.count(200) == 3 and statuses.count(429) == 3
    assert type(first.factory.for_rule(registry.rules()[0])).__module__ == "nanolimit._core"


def test_a_rules_file_storage_section_builds_the_zone(native, name, tmp_path: Path):
    path = tmp_path / "rules.toml"
    path.write_text(rules_text(name, 'on_full = "deny_new"\narena_bytes = 65536\n'))
    loaded = load_rules(path)
    assert loaded.storage is not None and loaded.storage.type == "shared_memory"
    one, two = loaded.factory(), loaded.factory()
    assert one.storage.name == name and one.storage.on_full == "deny_new" and one.storage.arena_bytes == 65536
    assert one.storage.created and not two.storage.created
    a, b = (f.for_rule(loaded.rules[0]) for f in (one, two))
    assert [a.allow("k").allowed, b.allow("k").allowed, a.allow("k").allowed, b.allow("k").allowed] == [
        True, True, True, False,
    ]  # fmt: skip


def test_a_memory_section_and_no_section(native):
    memory = parse_rules({"rules": [{"name": "r", "rate": "1/second"}], "storage": {"max_keys": 50}})
    assert memory.storage is not None and memory.storage.type == "memory"
    assert memory.factory().storage.max_keys == 50
    plain = parse_rules({"rules": [{"name": "r", "rate": "1/second"}]})
    assert plain.storage is None and plain.factory().storage.max_keys == 100_000


@pytest.mark.parametrize(
    ("section", "field", "message"),
    [
        ({"type": "redis"}, "type", "must be one of memory, shared_memory"),
        ({"type": "shared_memory", "max_keys": 10}, "name", "missing"),
        ({"type": "shared_memory", "name": "z"}, "max_keys", "missing"),
        ({"type": "shared_memory", "name": "z", "max_keys": "10"}, "max_keys", "must be an int"),
        ({"type": "shared_memory", "name": "z", "max_keys": True}, "max_keys", "must be an int"),
        ({"type": "shared_memory", "name": "z", "max_keys": 10, "size": 5}, "size", "unknown field"),
        ({"type": "memory", "arena_bytes": 5}, "arena_bytes", "unknown field for type 'memory'"),
        ("shared_memory", "storage", "must be a table"),
    ],
)
def test_a_bad_storage_section_is_one_problem_each(section, field, message):
    with pytest.raises(ConfigError) as caught:
        parse_rules({"rules": [{"name": "r", "rate": "1/second"}], "storage": section})
    assert any(p.field == field and message in p.message for p in caught.value.problems), caught.value


def test_a_zone_that_cannot_be_made_is_a_config_error(native):
    data = {
        "rules": [{"name": "r", "rate": "1/second"}],
        "storage": {"type": "shared_memory", "name": "a/b", "max_keys": 10},
    }
    with pytest.raises(ConfigError, match=r"storage.*name"):  # refused when the file is read
        parse_rules(data)
    loaded = LoadedRules(
        parse_rules({"rules": data["rules"]}).rules,
        storage=StorageSection("shared_memory", (("name", "a/b"), ("max_keys", 10))),
    )
    with pytest.raises(ConfigError, match=r"storage.*name"):  # and when it is built
        loaded.factory()


def test_a_reload_may_change_rules_but_not_the_storage(native, name, tmp_path: Path):
    path = tmp_path / "rules.toml"
    path.write_text(rules_text(name))
    loaded = load_rules(path)
    factory = loaded.factory()
    registry = loaded.registry()
    watcher = ConfigWatcher(path, registry, factory)
    watcher.load()
    path.write_text(rules_text(name).replace("3/minute", "4/minute"))
    assert not watcher.check()  # new bytes are installed when two polls in a row read them
    assert watcher.check()
    assert registry.rules()[0].limit == 4
    path.write_text(rules_text(name).replace("max_keys = 1000", "max_keys = 2000"))
    assert not watcher.check() and not watcher.check()
    assert "storage" in str(watcher.last_error) and registry.rules()[0].limit == 4
    factory.storage.unlink()


def test_check_config_shows_the_storage(name, tmp_path: Path):
    path = tmp_path / "rules.toml"
    path.write_text(rules_text(name))
    out = subprocess.run(
        [sys.executable, "-m", "nanolimit", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert f"storage: shared_memory name='{name}' max_keys=1000" in out.stdout


def doc_blocks(path: Path, language: str) -> list[str]:
    import re

    return re.findall(rf"```{language}\n(.*?)```", path.read_text(), flags=re.S)


@pytest.mark.parametrize("doc", ["docs/shared_memory.md", "README.md"])
def test_the_zone_snippets_in_the_docs_run(native, doc: str, name: str, tmp_path: Path):
    root = Path(__file__).resolve().parents[1]
    blocks = [b for b in doc_blocks(root / doc, "python") if "SharedMemoryStorage" in b]
    assert blocks, f"{doc} shows the zone"
    for block in blocks:
        namespace: dict[str, object] = {}
        exec(compile(block.replace('"api-gateway"', repr(name)), doc, "exec"), namespace)
        zones = [v for v in namespace.values() if isinstance(v, native.SharedMemoryStorage)]
        zone = zones[0] if zones else namespace["factory"].storage  # type: ignore[attr-defined]
        assert zone.name == name and zone.max_keys == 100_000
        zone.unlink()
    for i, block in enumerate(doc_blocks(root / doc, "toml")):
        if "shared_memory" in block:
            path = tmp_path / f"rules{i}.toml"
            path.write_text(block + '\n[[rules]]\nname = "r"\nrate = "1/second"\n')
            loaded = load_rules(path)
            assert loaded.storage is not None and dict(loaded.storage.options)["max_keys"] == 100_000


def test_attach_takes_the_zone_s_own_parameters_and_never_creates(native, name):
    with pytest.raises(ValidationError, match="no shared-memory zone"):
        native.SharedMemoryStorage.attach(name)
    assert not native.SharedMemoryStorage.unlink_segment(name)  # attach made nothing
    made = native.SharedMemoryStorage(
        name, max_keys=777, on_full="deny_new", evict_idle_after=30.0, arena_bytes=1 << 16, stripes=16
    )
    seen = native.SharedMemoryStorage.attach(name)
    assert not seen.created
    assert (seen.max_keys, seen.on_full, seen.evict_idle_after, seen.arena_bytes, seen.stripes) == (
        777, "deny_new", 30.0, 1 << 16, 16,
    )  # fmt: skip
    native.TokenBucket(3, 60.0, made, rule="r").allow("k")
    assert seen.keys() == made.keys()


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "nanolimit", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=60)


def test_the_zone_command_reports_and_unlinks(native, name):
    import json

    zone = native.SharedMemoryStorage(name, max_keys=500)
    native.FixedWindowCounter(5, 60.0, zone, rule="api").allow("user:1")
    out = run_cli("zone", name, "--keys", "5")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert report["keys"] == 1 and report["max_keys"] == 500 and report["keys_sample"] == zone.keys()
    # the command's own process is no gateway process (it counted itself: 2 and [pid, its pid])
    assert report["attached_pids"] == [os.getpid()] and report["processes"] == 1
    out = run_cli("zone", name, "--unlink")
    assert out.returncode == 0 and "unlinked" in out.stderr
    assert f"pids {os.getpid()} are attached" in out.stderr and "two budgets" in out.stderr
    assert not native.SharedMemoryStorage.unlink_segment(name)
    missing = run_cli("zone", name)
    assert missing.returncode == 1 and "no shared-memory zone" in missing.stderr
