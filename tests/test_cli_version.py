"""``nanolimit --version`` names the version and the live core."""

from __future__ import annotations

import subprocess
import sys

import nanolimit


def test_version_flag() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "nanolimit", "--version"], capture_output=True, text=True, check=True
    ).stdout.strip()
    assert out == f"nanolimit {nanolimit.__version__} ({nanolimit.IMPLEMENTATION} core)"


def test_python_dash_m_bench_shim_runs_the_bench_command() -> None:
    # CI's bench job runs ``python -m nanolimit._bench``: the shim must run it, not just alias it
    done = subprocess.run(
        [sys.executable, "-m", "nanolimit._bench", "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0
    assert done.stdout.startswith("usage: nanolimit bench")
