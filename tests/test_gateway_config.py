"""Rules files and hot reload."""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

import pytest
from gateway_helpers import gateway, get, ok_handler, rule

import nanolimit
from nanolimit.errors import ConfigError, UnknownAlgorithmError, ValidationError
from nanolimit.gateway.config import ConfigWatcher, load_rules, parse_rules
from nanolimit.gateway.registry import RuleRegistry
from nanolimit.gateway.rules import KeyScope

GOOD = """
stacked = false

[default]
rate = "1000/hour"

[[rules]]
name = "login"
method = "POST"
path_prefix = "/login"
algorithm = "sliding_counter"
rate = "5/minute"

[[rules]]
name = "api"
path_prefix = "/api"
scope = "api_key"
algorithm = "gcra"
limit = 100
window_seconds = 60
burst = 20
tier = "paid"

[[rules]]
name = "trial"
path_prefix = "/search"
rate = "10/s burst 20"
dry_run = true
"""

BAD = """
[[rules]]
name = "ok"
rate = "5/minute"

[[rules]]
name = "negative"
limit = -1
window_seconds = 60

[[rules]]
name = "typo"
rate = "5/minute"
widnow = 3

[[rules]]
name = "algo"
rate = "5/minute"
algorithm = "leaky_faucet"

[[rules]]
name = "rate"
rate = "five a minute"

[[rules]]
name = "prefix"
rate = "5/minute"
path_prefix = "login"

[[rules]]
name = "ok"
rate = "1/s"

[[rules]]
rate = "1/s"
"""


def _write(path: Path, text: str) -> None:
    path.write_text(text, encoding="utf-8")


def _settled(watcher: ConfigWatcher) -> bool:
    """Two polls in a row, as the watcher's thread makes them an interval
    apart: once rules run, new bytes are installed (or refused) only when
    two polls read them, so the first says False."""
    assert watcher.check() is False
    return watcher.check()


def test_load_toml(tmp_path: Path) -> None:
    f = tmp_path / "rules.toml"
    _write(f, GOOD)
    loaded = load_rules(f)
    assert [r.name for r in loaded.rules] == ["login", "api", "trial"]
    login, api, trial = loaded.rules
    assert (login.method, login.path_prefix, login.limit, login.window_seconds) == ("POST", "/login", 5, 60.0)
    assert login.scope is KeyScope.IP
    assert (api.scope, api.burst, api.tier, api.capacity) == (KeyScope.API_KEY, 20, "paid", 20)
    assert trial.dry_run and trial.burst == 20 and trial.limit == 10
    assert loaded.default is not None and loaded.default.name == "default" and loaded.default.limit == 1000
    reg = loaded.registry()
    assert reg.rule_for("POST", "/login").name == "login"
    assert reg.rule_for("GET", "/else").name == "default"


def test_load_json_same_shape(tmp_path: Path) -> None:
    f = tmp_path / "rules.json"
    f.write_text(json.dumps({"stacked": True, "rules": [{"name": "a", "rate": "3/s", "scope": "global"}]}))
    loaded = load_rules(f)
    assert loaded.stacked and loaded.rules[0].scope is KeyScope.GLOBAL and loaded.default is None
    for rule_ in loaded.rules:
        assert parse_rules({"rules": [rule_.to_dict()]}).rules == (rule_,)


def test_every_bad_rule_is_reported_with_its_field(tmp_path: Path) -> None:
    f = tmp_path / "rules.toml"
    _write(f, BAD)
    with pytest.raises(ConfigError) as info:
        load_rules(f)
    err = info.value
    assert isinstance(err, ValidationError)
    found = {(p.rule, p.field) for p in err.problems}
    assert found == {
        ("negative", "limit"),
        ("typo", "widnow"),
        ("algo", "algorithm"),
        ("rate", "rate"),
        ("prefix", "path_prefix"),
        ("ok", "name"),
        ("rules[7]", "name"),
    }
    text = str(err)
    for name in ("negative", "typo", "algo", "prefix"):
        assert f"'{name}'" in text


def test_unreadable_and_unparsable_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_rules(tmp_path / "missing.toml")
    broken = tmp_path / "broken.toml"
    _write(broken, "[[rules]\nname = ")
    with pytest.raises(ConfigError, match="not valid"):
        load_rules(broken)
    with pytest.raises(ConfigError, match="unknown top-level"):
        parse_rules({"rule": []})
    with pytest.raises(ConfigError):
        parse_rules({"rules": [{"name": "x", "rate": "5/s", "limit": 3}]})


def test_unknown_algorithm_in_a_rule_is_an_unknown_algorithm_error() -> None:
    with pytest.raises(UnknownAlgorithmError):
        rule("x", algorithm="nope")


def test_watcher_hot_reload_keeps_state_and_survives_a_broken_file(
    backend, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    f = tmp_path / "rules.toml"
    _write(
        f,
        '[[rules]]\nname = "a"\npath_prefix = "/a"\nrate = "3/minute"\n'
        '[[rules]]\nname = "b"\npath_prefix = "/b"\nrate = "3/minute"\nalgorithm = "fixed_window"\n',
    )
    mw = gateway(backend, [])
    watcher = ConfigWatcher(f, mw.registry, mw.factory, interval=0.05)
    assert watcher.check() is True
    assert watcher.check() is False  # unchanged content: nothing to do
    assert [mw(get("/a"), ok_handler).status for _ in range(2)] == [200, 200]
    assert [mw(get("/b"), ok_handler).status for _ in range(3)] == [200, 200, 200]
    # edit rule b only: a keeps its state (1 left), b gets its new limit
    # without a fresh budget (3 spent of 4)
    _write(
        f,
        '[[rules]]\nname = "a"\npath_prefix = "/a"\nrate = "3/minute"\n'
        '[[rules]]\nname = "b"\npath_prefix = "/b"\nrate = "4/minute"\nalgorithm = "fixed_window"\n'
        '[[rules]]\nname = "c"\npath_prefix = "/c"\nrate = "1/minute"\n',
    )
    assert _settled(watcher) is True
    assert [mw(get("/a"), ok_handler).status for _ in range(2)] == [200, 429]
    assert [mw(get("/b"), ok_handler).status for _ in range(2)] == [200, 429]
    assert [mw(get("/c"), ok_handler).status for _ in range(2)] == [200, 429]
    assert len(mw.factory) == 3  # the retired "b" limiter was pruned
    rules_before = mw.registry.rules()
    _write(f, '[[rules]]\nname = "a"\nrate = "oops"\n')
    with caplog.at_level(logging.ERROR, logger="nanolimit.config"):
        assert _settled(watcher) is False
        assert watcher.check() is False  # the same bad content is logged once
    assert mw.registry.rules() == rules_before
    assert watcher.errors == 2 and isinstance(watcher.last_error, ConfigError)
    assert len([r for r in caplog.records if "keeping the current rules" in r.getMessage()]) == 1
    assert mw(get("/c"), ok_handler).status == 429  # the old rules still run
    f.unlink()
    assert watcher.check() is False and mw.registry.rules() == rules_before


@pytest.mark.parametrize("rates", ["{}/hour", "{}/hour;100/day"], ids=["one-rate", "rate-list"])
@pytest.mark.parametrize(("after", "more"), [(4, 1), (2, 0)], ids=["raised", "lowered"])
def test_a_limit_edit_by_reload_never_hands_back_spent_budget(
    backend, tmp_path: Path, rates: str, after: int, more: int
) -> None:
    """docs/spec.md §6, for a rate list too: its rules are named by window, so
    editing a limit keeps each key's state (a name with the limit in it gave
    every key a fresh budget: 3 + 4 in the hour for "4/hour;100/day")."""
    f = tmp_path / "rules.toml"
    table = '[[rules]]\nname = "api"\nalgorithm = "fixed_window"\nrate = "{}"\n'
    _write(f, table.format(rates.format(3)))
    clock = backend.FakeClock(1_000_000.0)  # 800 s before the hour's window ends
    mw = gateway(backend, [], clock)
    watcher = ConfigWatcher(f, mw.registry, mw.factory)
    watcher.load()
    assert sum(mw(get(), ok_handler).status == 200 for _ in range(10)) == 3
    _write(f, table.format(rates.format(after)))
    assert _settled(watcher)
    clock.advance(1.0)
    # raised to 4: one more, 4 in the hour; lowered to 2: none until the window ends
    assert sum(mw(get(), ok_handler).status == 200 for _ in range(10)) == more
    clock.advance(800.0)
    assert sum(mw(get(), ok_handler).status == 200 for _ in range(10)) == after


def test_watcher_thread_picks_up_a_change_without_a_restart(backend, tmp_path: Path) -> None:
    f = tmp_path / "rules.json"
    f.write_text(json.dumps({"rules": [{"name": "x", "rate": "1/minute"}]}))
    registry = RuleRegistry()
    reloaded: list[int] = []
    with ConfigWatcher(
        f, registry, interval=0.02, on_reload=lambda loaded: reloaded.append(len(loaded.rules))
    ):
        assert registry.rule_for("GET", "/").limit == 1
        f.write_text(
            json.dumps(
                {
                    "rules": [
                        {"name": "x", "rate": "7/minute"},
                        {"name": "y", "path_prefix": "/y", "rate": "1/s"},
                    ]
                }
            )
        )
        deadline = time.monotonic() + 5.0
        while registry.rule_for("GET", "/").limit != 7:
            assert time.monotonic() < deadline, "the watcher did not reload"
            time.sleep(0.01)
    assert reloaded[-1] == 2 and registry.rule_for("GET", "/y").name == "y"


def test_watcher_load_raises_on_a_bad_file(tmp_path: Path) -> None:
    f = tmp_path / "rules.toml"
    _write(f, '[[rules]]\nname = "x"\nrate = "bad"\n')
    registry = RuleRegistry([rule("keep")])
    with pytest.raises(ConfigError):
        ConfigWatcher(f, registry).load()
    assert registry.rules()[0].name == "keep"


def test_an_empty_or_truncated_file_never_lifts_the_limits(tmp_path: Path) -> None:
    """An empty file is valid TOML with nothing in it: installed, it would lift
    every limit at once (a truncate-then-write caught mid-way looks the same)."""
    f = tmp_path / "rules.toml"
    _write(f, '[[rules]]\nname = "keep"\nrate = "5/minute"\n')
    registry = RuleRegistry([])
    watcher = ConfigWatcher(f, registry)
    watcher.load()
    for text in ("", "\n# only a comment\n", "stacked = true\n"):
        _write(f, text)
        assert not _settled(watcher)
        assert [r.name for r in registry.rules()] == ["keep"]
    assert watcher.errors >= 1 and "nothing to enforce" in str(watcher.last_error)
    with pytest.raises(ConfigError, match="nothing to enforce"):
        parse_rules({})


@pytest.mark.parametrize("suffix", [".json", ".toml"])
def test_a_file_nested_too_deeply_is_a_config_error(tmp_path: Path, suffix: str) -> None:
    f = tmp_path / f"rules{suffix}"
    f.write_text("[" * 100_000 if suffix == ".json" else "x = " + "[" * 100_000)
    with pytest.raises(ConfigError):
        load_rules(f)


def test_a_rule_name_may_not_end_in_a_newline() -> None:
    with pytest.raises(ValidationError):
        rule("api\n")


# Numbers no float or int() can hold: each is a problem of the file, never a
# raw OverflowError / ValueError / TypeError out of the loader or the watcher.
HUGE_NUMBER_FILES = {
    "window.json": '{"rules": [{"name": "a", "limit": 5, "window_seconds": ' + "1" * 400 + "}]}",
    "rate.toml": '[[rules]]\nname = "a"\nrate = "' + "9" * 5000 + '/minute"\n',
    "burst.toml": '[[rules]]\nname = "a"\nrate = "5/minute burst ' + "9" * 5000 + '"\n',
    "storage.toml": '[[rules]]\nname = "a"\nrate = "5/minute"\n[storage]\ntype = []\n',
}


@pytest.mark.parametrize("name", HUGE_NUMBER_FILES)
def test_a_number_past_float_or_int_is_a_config_error(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    _write(f, HUGE_NUMBER_FILES[name])
    with pytest.raises(ConfigError) as info:
        load_rules(f)
    assert len(info.value.problems) == 1


@pytest.mark.parametrize("name", HUGE_NUMBER_FILES)
def test_the_watcher_counts_a_huge_number_as_a_bad_file(tmp_path: Path, name: str) -> None:
    f = tmp_path / name
    _write(
        f,
        '{"rules": [{"name": "keep", "rate": "5/minute"}]}'
        if name.endswith(".json")
        else '[[rules]]\nname = "keep"\nrate = "5/minute"\n',
    )
    registry = RuleRegistry([])
    seen: list[Exception] = []
    watcher = ConfigWatcher(f, registry, on_error=seen.append)
    watcher.load()
    _write(f, HUGE_NUMBER_FILES[name])
    assert not _settled(watcher)
    assert watcher.errors == 1 and len(seen) == 1 and isinstance(seen[0], ConfigError)
    assert [r.name for r in registry.rules()] == ["keep"]


@pytest.mark.parametrize(
    "text",
    [
        '{"rules": [{"name": "login", "rate": "5/minute", "rate": "500/minute"}]}',
        '{"rules": [{"name": "a", "rate": "5/minute"}], "rules": [{"name": "b", "rate": "1/s"}]}',
    ],
    ids=["a-field-twice", "rules-twice"],
)
def test_a_json_key_given_twice_is_a_config_error(tmp_path: Path, text: str) -> None:
    """TOML refuses a key given twice; ``json`` kept the last one without a
    word: the login rule ran at 500/minute, or rule "a" was dropped."""
    f = tmp_path / "rules.json"
    _write(f, text)
    with pytest.raises(ConfigError, match="is given twice in one object"):
        load_rules(f)
    registry = RuleRegistry([rule("keep")])
    watcher = ConfigWatcher(f, registry)
    assert not watcher.check()
    assert [r.name for r in registry.rules()] == ["keep"]


def _kept(caplog: pytest.LogCaptureFixture) -> int:
    return len([r for r in caplog.records if "keeping the current rules" in r.getMessage()])


def test_a_missing_file_is_logged_once_not_at_every_poll(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A deleted rules file logged an ERROR (and called on_error) at every
    poll: 86,400 lines a day at the default interval, where the docs promise
    one per distinct failure. Back and gone again, it is news again."""
    f = tmp_path / "rules.toml"
    good = '[[rules]]\nname = "keep"\nrate = "5/minute"\n'
    _write(f, good)
    registry = RuleRegistry([])
    seen: list[Exception] = []
    watcher = ConfigWatcher(f, registry, on_error=seen.append)
    watcher.load()
    with caplog.at_level(logging.ERROR, logger="nanolimit.config"):
        f.unlink()
        assert [watcher.check() for _ in range(5)] == [False] * 5
        assert watcher.errors == 5 and _kept(caplog) == 1 and len(seen) == 1
        _write(f, good)  # restored as it was: nothing to install
        assert watcher.check() is False
        f.unlink()
        assert watcher.check() is False
    assert _kept(caplog) == 2 and len(seen) == 2 and "cannot read" in str(seen[-1])
    assert [r.name for r in registry.rules()] == ["keep"]


def test_the_same_bad_file_after_a_good_one_is_logged_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Bad content X (logged), good content installed, X again: X was still
    remembered as already logged, so the second bad push was kept out
    without a word."""
    f = tmp_path / "rules.toml"
    bad = '[[rules]]\nname = "x"\nrate = "oops"\n'
    _write(f, '[[rules]]\nname = "one"\nrate = "5/minute"\n')
    registry = RuleRegistry([])
    seen: list[Exception] = []
    watcher = ConfigWatcher(f, registry, on_error=seen.append)
    watcher.load()
    with caplog.at_level(logging.ERROR, logger="nanolimit.config"):
        _write(f, bad)
        assert _settled(watcher) is False
        _write(f, '[[rules]]\nname = "two"\nrate = "5/minute"\n')
        assert _settled(watcher) is True
        _write(f, bad)
        assert _settled(watcher) is False
    assert _kept(caplog) == 2 and len(seen) == 2
    assert [r.name for r in registry.rules()] == ["two"]


def test_an_on_reload_hook_that_raises_never_reads_as_a_refused_file(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The hook ran after the swap, so its ValueError was caught as a bad
    file: "keeping the current rules" was logged, check() said False and
    on_error ran, while the new rules were already live."""
    f = tmp_path / "rules.toml"
    _write(f, '[[rules]]\nname = "a"\nrate = "5/minute"\n')
    registry = RuleRegistry([])
    failures: list[Exception] = []

    def hook(loaded: object) -> None:
        raise ValueError("the hook's own fault")

    watcher = ConfigWatcher(f, registry, on_reload=hook, on_error=failures.append)
    with caplog.at_level(logging.ERROR, logger="nanolimit.config"):
        assert [r.name for r in watcher.load().rules] == ["a"]
        _write(f, '[[rules]]\nname = "b"\nrate = "5/minute"\n')
        assert _settled(watcher) is True
    assert [r.name for r in registry.rules()] == ["b"]
    assert watcher.errors == 0 and failures == [] and watcher.reloads == 2
    assert _kept(caplog) == 0
    assert len([r for r in caplog.records if "on_reload hook failed" in r.getMessage()]) == 2


def test_a_file_caught_half_rewritten_in_place_is_never_installed(backend, tmp_path: Path) -> None:
    """An in-place rewrite (``open(path, "w")``, ``cat >``, an editor) is
    valid TOML at many points: a poll that caught the bytes up to
    ``limit = 15`` of ``limit = 1500`` installed login at 15 and dropped the
    admin rule: /admin ran unlimited until the next poll. Two polls must
    read the bytes."""
    f = tmp_path / "rules.toml"
    text = (
        '[[rules]]\nname = "login"\npath_prefix = "/login"\nwindow_seconds = 60\nlimit = {}\n'
        '[[rules]]\nname = "admin"\npath_prefix = "/admin"\nrate = "3/minute"\n'
    )
    _write(f, text.format(1000))
    mw = gateway(backend, [])
    watcher = ConfigWatcher(f, mw.registry, mw.factory)
    watcher.load()
    assert [mw(get("/admin"), ok_handler).status for _ in range(4)] == [200, 200, 200, 429]
    new = text.format(1500)
    cut = new.index("limit = 1500") + len("limit = 15")
    with f.open("w", encoding="utf-8") as out:  # the writer pauses after a valid prefix
        out.write(new[:cut])
        out.flush()
        assert watcher.check() is False
        assert [(r.name, r.limit) for r in mw.registry.rules()] == [("login", 1000), ("admin", 3)]
        assert mw(get("/admin"), ok_handler).status == 429  # still limited
        out.write(new[cut:])
    assert _settled(watcher) is True
    assert [(r.name, r.limit) for r in mw.registry.rules()] == [("login", 1500), ("admin", 3)]
    assert mw(get("/admin"), ok_handler).status == 429  # its spent budget was kept


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_a_byte_order_mark_is_no_content(tmp_path: Path, suffix: str) -> None:
    """A rules file saved by a Windows editor starts with a UTF-8 BOM: it was
    refused as "Invalid statement (at line 1, column 1)" (TOML) or
    "Unexpected UTF-8 BOM" (JSON), for a character no editor shows."""
    f = tmp_path / f"rules{suffix}"
    body = (
        json.dumps({"rules": [{"name": "login", "rate": "5/minute"}]})
        if suffix == ".json"
        else '[[rules]]\nname = "login"\nrate = "5/minute"\n'
    )
    f.write_bytes(b"\xef\xbb\xbf" + body.encode())
    assert [(r.name, r.limit) for r in load_rules(f).rules] == [("login", 5)]


_SWAPPED_CHILD = """
import sys
from pathlib import Path
from nanolimit.errors import ConfigError
from nanolimit.gateway.config import ConfigWatcher, load_rules
from nanolimit.gateway.registry import RuleRegistry

path, kind = Path(sys.argv[1]), sys.argv[2]
registry = RuleRegistry([])
watcher = ConfigWatcher(path, registry)
watcher.load()
path.unlink()
if kind == "fifo":
    import os
    os.mkfifo(path)
elif kind == "dev-zero":
    path.symlink_to("/dev/zero")
else:
    with path.open("wb") as f:
        f.truncate(1 << 40)  # a sparse terabyte: no disk, but read whole it is memory
assert watcher.check() is False and watcher.check() is False
assert [r.name for r in registry.rules()] == ["keep"]
try:
    load_rules(path)
except ConfigError as exc:
    print(exc.problems[0].message)
"""


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "sparse-terabyte"])
def test_a_rules_path_swapped_for_a_fifo_a_device_or_a_huge_file_is_refused(
    tmp_path: Path, kind: str
) -> None:
    """read_bytes() read whatever the path named: a FIFO blocked the watcher
    (and its lock, so load() too) for good, a symlink to /dev/zero or a
    sparse terabyte grew the gateway until MemoryError. Run in a child
    bounded in time and address space."""
    f = tmp_path / "rules.toml"
    _write(f, '[[rules]]\nname = "keep"\nrate = "5/minute"\n')
    limit = 1 << 30

    def bounded() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    src = str(Path(nanolimit.__file__).resolve().parents[1])
    done = subprocess.run(
        [sys.executable, "-c", _SWAPPED_CHILD, str(f), kind],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": src},
        timeout=30,
        preexec_fn=bounded,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("cannot read: "), done.stdout
    assert ("not a regular file" if kind != "sparse-terabyte" else "over ") in done.stdout


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ('name = "a/b"\nmax_keys = 1000', "zone's name"),
        ('name = "' + "z" * 201 + '"\nmax_keys = 1000', "zone's name"),
        ('name = "api"\nmax_keys = 2147483648', "max_keys of a shared-memory zone"),
        ('name = "api"\nmax_keys = 1073741824\nstripes = 1', "keys in a stripe"),
        ('name = "api"\nmax_keys = 1000\nif_stale = "keep"', "if_stale"),
    ],
)
def test_check_config_refuses_a_zone_the_gateway_cannot_make(
    tmp_path: Path, fields: str, named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """[storage] type = "shared_memory" was range-checked as an in-memory
    table only: a name with '/', max_keys past the zone's 2**30 or 2**30
    keys in one stripe passed check-config (exit 0, "OK") and stopped the
    gateway's start (LoadedRules.factory: ConfigError)."""
    from nanolimit.cli.check_config import check_config

    f = tmp_path / "rules.toml"
    _write(f, f'[[rules]]\nname = "a"\nrate = "5/minute"\n[storage]\ntype = "shared_memory"\n{fields}\n')
    assert check_config(str(f)) == 1
    assert named in capsys.readouterr().err


@pytest.mark.parametrize("interval", [float("inf"), 1e12, float("nan"), 0, -1.0, True, "1"])
def test_a_watcher_interval_that_cannot_be_waited_is_refused_at_construction(
    tmp_path: Path, interval: object
) -> None:
    """interval=inf or 1e12 passed the "> 0" check; start() then returned
    and the polling thread died at its first wait (OverflowError: timestamp
    out of range), so no change was ever picked up again. "1" raised a bare
    TypeError. Each is a ValidationError when the watcher is made."""
    f = tmp_path / "rules.toml"
    _write(f, '[[rules]]\nname = "a"\nrate = "5/minute"\n')
    with pytest.raises(ValidationError, match="interval must be a finite number of seconds"):
        ConfigWatcher(f, RuleRegistry([]), interval=interval)  # type: ignore[arg-type]
    assert ConfigWatcher(f, RuleRegistry([]), interval=86_400).interval == 86_400.0
