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
