"""``bench/floors.py``: the memory floors under issue 4's last two targets.
Small sizes here; the figures themselves are read in bench/README.md."""

from __future__ import annotations

import importlib.util
import json
import pathlib
from types import ModuleType

import pytest

import nanolimit

FLOORS = pathlib.Path(__file__).resolve().parent.parent / "bench" / "floors.py"


def load_floors() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_floors", FLOORS)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SMALL = ["--rounds", "1", "--keys", "3000", "--batch-keys", "2000"]


def test_json_figures_add_up(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_floors().main(["--json", *SMALL]) == 0
    r = json.loads(capsys.readouterr().out)
    ns, million, batch = r["ns"], r["million"], r["allow_many"]
    assert r["implementation"] == nanolimit.IMPLEMENTATION
    assert (r["keys"], r["batch_keys"], r["rounds"]) == (3000, 2000, 1)
    assert set(ns) == {"hot_key", "million", "batch_cached", "batch_table", "miss"}
    assert all(value > 0 for value in ns.values())
    # the miss is a dependent load over 64 MiB: never an L1 hit (~1 ns)
    assert ns["miss"] > 5
    assert million["floor"] == pytest.approx(ns["hot_key"] + ns["miss"], abs=0.11)
    assert million["measured"] == ns["million"]
    assert million["floor_under_target"] == (million["floor"] <= million["target"] == 200)
    assert batch["floor"] == ns["batch_cached"]
    assert batch["measured"] == ns["batch_table"]
    assert batch["unhidden_misses"] == pytest.approx(batch["measured"] - batch["floor"], abs=0.11)
    assert batch["headroom"] == pytest.approx(25 - batch["floor"], abs=0.11)


def test_text_report_names_both_targets_and_the_floor_parts(capsys: pytest.CaptureFixture[str]) -> None:
    assert load_floors().main(SMALL) == 0
    out = capsys.readouterr().out
    assert "allow() over 3,000 keys: target 200" in out
    assert "allow_many over 2,000 keys: target 25" in out
    assert "one miss over 64 MiB" in out
    assert ("no table layout meets it here" in out) != ("could meet it here" in out)


@pytest.mark.parametrize(
    "argv", [["--rounds", "0"], ["--keys", "999"], ["--batch-keys", "10"], ["--rounds", "x"]]
)
def test_bad_arguments_are_refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        load_floors().main(argv)
    assert exit_info.value.code == 2
    assert "usage" in capsys.readouterr().err
