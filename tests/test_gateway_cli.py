"""The command line: demo through the middleware, check-config, replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import nanolimit
from nanolimit import FakeClock
from nanolimit import __main__ as cli
from nanolimit.cli import demo as demo_command


def test_demo_runs_the_spec_through_the_middleware(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert out.count("as specified") == 4 and "DIFFERS" not in out
    assert "statuses [200, 200, 200, 200, 200, 429, 429]" in out
    assert '"Retry-After": "12"' in out


def test_demo_fails_when_an_answer_differs(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real = demo_command._gateway

    def off_by_one(algorithm, limit, window, clock, name="demo"):  # type: ignore[no-untyped-def]
        return real(algorithm, limit + 1, window, clock, name)

    monkeypatch.setattr(demo_command, "_gateway", off_by_one)  # where the scenarios look it up
    assert cli.main(["demo"]) == 1
    assert "DIFFERS FROM THE SPEC" in capsys.readouterr().out


def test_python_dash_m_entry_point() -> None:
    # run the same nanolimit this test imported (a checkout's src or site-packages)
    env = {**os.environ, "PYTHONPATH": str(Path(nanolimit.__file__).resolve().parents[1])}
    done = subprocess.run(
        [sys.executable, "-m", "nanolimit", "info"], capture_output=True, text=True, env=env, timeout=60
    )
    assert done.returncode == 0
    info = json.loads(done.stdout)
    assert info == {"version": nanolimit.__version__, "implementation": nanolimit.IMPLEMENTATION}


def test_check_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        'stacked = true\n[[rules]]\nname = "login"\nmethod = "POST"\npath_prefix = "/login"\n'
        'rate = "5/minute"\n[default]\nrate = "100/hour"\n'
    )
    assert cli.main(["check-config", str(good)]) == 0
    out = capsys.readouterr().out
    assert "OK, 1 rule(s), stacked" in out and "login" in out and "(default)" in out
    bad = tmp_path / "bad.toml"
    bad.write_text(
        '[[rules]]\nname = "x"\nrate = "5/minute"\nlimit = 3\n[[rules]]\nname = "y"\nrate = "1/s"\n'
        'algorithm = "nope"\n'
    )
    assert cli.main(["check-config", str(bad)]) == 1
    err = capsys.readouterr().err
    assert "INVALID, 2 problem(s)" in err and "rule 'x': rate" in err and "rule 'y': algorithm" in err


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("window.json", '{"rules": [{"name": "a", "limit": 5, "window_seconds": ' + "1" * 400 + "}]}"),
        ("rate.toml", '[[rules]]\nname = "a"\nrate = "' + "9" * 5000 + '/minute"\n'),
        ("storage.toml", '[[rules]]\nname = "a"\nrate = "5/minute"\n[storage]\ntype = []\n'),
    ],
)
def test_check_config_reports_a_huge_number_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, text: str
) -> None:
    path = tmp_path / name
    path.write_text(text)
    assert cli.main(["check-config", str(path)]) == 1
    captured = capsys.readouterr()
    assert "INVALID, 1 problem(s)" in captured.err and "Traceback" not in captured.err + captured.out


def test_check_config_shows_routes_costs_counting_lists_and_exempt(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "routes.toml"
    path.write_text(
        'exempt = ["/health"]\n'
        '[[rules]]\nname = "avatar"\nroutes = ["/users/{id}/avatar"]\nrate = "5/minute;100/hour"\n'
        '[[rules]]\nname = "logins"\npath_prefix = "/login"\nrate = "5/minute"\ncount_when = [401, 403]\n'
        "cost = 2\n"
    )
    assert cli.main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "OK, 3 rule(s)" in out
    assert "avatar:60s" in out and "avatar:3600s" in out and "route /users/{id}/avatar" in out
    assert "group avatar" in out and "cost 2 counts 401,403" in out and "exempt: /health" in out


def _expected(
    rows: list[tuple[float, str, int]], algorithm: str, limit: int, window: float
) -> dict[str, list[int]]:
    """The oracle: one limiter, the clock set to each request's time."""
    cls = {
        "token_bucket": nanolimit.TokenBucket,
        "sliding_counter": nanolimit.SlidingWindowCounter,
        "fixed_window": nanolimit.FixedWindowCounter,
    }[algorithm]
    clock = FakeClock(0.0)
    limiter = cls(limit, window, clock=clock)
    out: dict[str, list[int]] = {}
    for t, key, cost in rows:
        clock.set(t)
        seen = out.setdefault(key, [0, 0])
        seen[0] += 1
        if cost <= limiter.capacity and limiter.allow(key, cost).allowed:
            seen[1] += 1
    return out


@pytest.mark.parametrize("algorithm", ["token_bucket", "sliding_counter", "fixed_window"])
def test_replay_matches_a_limiter_fed_request_by_request(
    tmp_path: Path, algorithm: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = []
    t = 1_700_000_000.0
    for i in range(3000):
        t += (i * 7919 % 13) / 100.0
        rows.append((round(t, 3), f"10.0.0.{i * 31 % 17}", 1))
    trace = tmp_path / "trace.csv"
    trace.write_text("timestamp,key\n" + "".join(f"{t},{k}\n" for t, k, _ in rows))
    assert (
        cli.main(
            [
                "replay",
                str(trace),
                "--rule",
                "20/minute",
                "--algorithm",
                algorithm,
                "--json",
                "--batch",
                "500",
                "--top",
                "100",
            ]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    expected = _expected(rows, algorithm, 20, 60.0)
    assert summary["requests"] == 3000
    assert summary["allowed"] == sum(v[1] for v in expected.values())
    assert summary["denied"] == 3000 - summary["allowed"] > 0
    assert summary["keys"] == 17
    assert {e["key"]: [e["requests"], e["allowed"]] for e in summary["top"]} == expected
    denials = [e["denied"] for e in summary["top"]]
    assert denials == sorted(denials, reverse=True)


def test_replay_costs_scopes_and_messy_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text(
        "2026-01-01T00:00:00+00:00,2001:db8:0:1::1,2\n"
        "2026-01-01T00:00:01+00:00,2001:db8:0:1::2,2\n"
        "2026-01-01T00:00:02+00:00,2001:db8:0:1::3\n"
        "not-a-time,2001:db8:0:1::3\n"
        "2026-01-01T00:00:03+00:00,2001:db8:0:2::1,99\n"
        "2026-01-01T00:00:04+00:00,2001:db8:0:2::1,0\n"
        "\n"
        "2026-01-01T00:00:05+00:00\n"
    )
    per_key = tmp_path / "keys.csv"
    assert (
        cli.main(
            ["replay", str(trace), "--rule", "5/hour", "--scope", "ip", "--json", "--per-key", str(per_key)]
        )
        == 0
    )
    summary = json.loads(capsys.readouterr().out)
    # the first three share one /64 and 5 units: 2 + 2 pass, the 1-unit third passes too
    top = {e["key"]: e for e in summary["top"]}
    assert top["2001:db8:0:1::/64"] == {"key": "2001:db8:0:1::/64", "requests": 3, "allowed": 3, "denied": 0}
    assert top["2001:db8:0:2::/64"]["denied"] == 1  # cost 99 > capacity 5: can never pass
    assert summary["oversized"] == 1 and summary["skipped_lines"] == 3
    assert summary["first_error"].startswith("line 4:")
    assert per_key.read_text().splitlines()[0] == "key,requests,allowed,denied"
    assert cli.main(["replay", str(trace), "--rule", "1/hour", "--scope", "global", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["keys"] == 1 and summary["allowed"] == 1 and summary["requests"] == 4


def test_replay_text_report_and_progress_bar(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("".join(f"{i * 0.01},user{i % 3},1\n" for i in range(900)))
    assert (
        cli.main(["replay", str(trace), "--rule", "10/s", "--scope", "user", "--progress", "--top", "2"]) == 0
    )
    captured = capsys.readouterr()
    assert "replayed 900 requests" in captured.out and "keys with the most denials (top 2)" in captured.out
    assert "M decisions/s" in captured.out
    assert "100.0%" in captured.err and "900 lines" in captured.err


def test_replay_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["replay", str(tmp_path / "none.csv"), "--rule", "5/s"]) == 2
    assert "cannot read" in capsys.readouterr().err
    trace = tmp_path / "t.csv"
    trace.write_text("1,a\n")
    assert cli.main(["replay", str(trace), "--rule", "lots"]) == 2
    assert "cannot parse rate" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["replay", str(trace), "--rule", "5/s", "--algorithm", "nope"])


def test_replay_skips_timestamps_the_clock_would_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("100.0,a\n1e300,a\nnan,b\ninf,b\n101.0,a\n")
    assert cli.main(["replay", str(trace), "--rule", "1/minute", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["skipped_lines"] == 3 and summary["requests"] == 2
    assert summary["allowed"] == 1 and summary["first_error"].startswith("line 2:")
