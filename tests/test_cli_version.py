"""The command line's own words: ``--version`` names the version and the live
core, every ``--help`` reads as plain text, and the ``python -m`` entries run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import nanolimit
from nanolimit.cli._help import plain

#: every command ``nanolimit --help`` lists
COMMANDS = ("demo", "info", "bench", "check-config", "replay")
#: reStructuredText that must never reach a terminal: literals, a literal
#: block's marker, any Sphinx role (:func:, :class:, ...), interpreted text
REST_MARKUP = re.compile(r"``|::|:[a-z]+(?::[a-z]+)?:`|`")


def _help(*args: str) -> str:
    # run the same nanolimit this test imported (a checkout's src or site-packages)
    env = {**os.environ, "PYTHONPATH": str(Path(nanolimit.__file__).resolve().parents[1]), "COLUMNS": "100"}
    done = subprocess.run(
        [sys.executable, "-m", "nanolimit", *args, "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: nanolimit"), done.stdout
    return done.stdout


def _assert_plain(text: str) -> None:
    found = sorted({m.group(0) for m in REST_MARKUP.finditer(text)})
    assert not found, f"reST markup {found} in:\n{text}"


def test_version_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nanolimit", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == f"nanolimit {nanolimit.__version__} ({nanolimit.IMPLEMENTATION} core)"


def test_python_dash_m_nanolimit_bench_runs_the_bench_command() -> None:
    # CI's bench job runs ``python -m nanolimit bench``
    done = subprocess.run(
        [sys.executable, "-m", "nanolimit", "bench", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert done.stdout.startswith("usage: nanolimit bench")


def test_top_level_help_is_plain_text_and_lists_every_command() -> None:
    out = _help()
    _assert_plain(out)
    for command in COMMANDS:
        assert re.search(rf"^ +{re.escape(command)}\b", out, re.MULTILINE), f"{command} not listed"


@pytest.mark.parametrize("command", COMMANDS)
def test_command_help_is_plain_text(command: str) -> None:
    out = _help(command)
    assert out.startswith(f"usage: nanolimit {command}")
    _assert_plain(out)


def test_plain_takes_out_the_markup_docstrings_use() -> None:
    doc = """``nanolimit replay``: see :func:`replay`, :class:`~.bench_cells.Subject`
    and :ref:`the spec <spec>`; `interpreted` text.

    Example::

        nanolimit replay trace.csv --rule 5/s

    .. note:: gone
    """
    out = plain(doc)
    _assert_plain(out)
    assert out.startswith("nanolimit replay: see replay, Subject\nand the spec; interpreted text.")
    assert "Example:\n\n    nanolimit replay trace.csv --rule 5/s" in out
    assert "gone" not in out
