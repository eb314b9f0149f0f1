"""The .pyi stub of the compiled module matches the runtime exactly
(``mypy.stubtest``: names, signatures, finality), with a short allowlist of
what Cython cannot expose, each entry with its reason."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

pytestmark = pytest.mark.native

ALLOWLIST = pathlib.Path(__file__).resolve().parent.parent / ".ci" / "stubtest-allowlist.txt"


def test_core_stub_matches_runtime(native) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "nanolimit._core", "--allowlist", str(ALLOWLIST)],
        capture_output=True,
        text=True,
        env=dict(os.environ),
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
