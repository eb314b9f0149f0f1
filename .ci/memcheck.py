"""Run part of the native test suite under valgrind memcheck and fail on any
error or definite leak whose stack passes through nanolimit's own C code.

CPython itself is not built for valgrind, so interpreter start-up and glibc's
vectorised string routines report noise; only frames in our extension count.
Usage: python .ci/memcheck.py [pytest args...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

OURS = ("nanolimit/_core", "_core.c", "_native.h", "_kernels.pxd", "_table.pxd", "_core.pyx")


def frames_are_ours(error: ET.Element) -> bool:
    for frame in error.iter("frame"):
        text = " ".join((frame.findtext(tag) or "") for tag in ("obj", "file", "fn", "dir"))
        if any(mark in text for mark in OURS):
            return True
    return False


def main(pytest_args: list[str]) -> int:
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "memcheck.xml")
        command = [
            "valgrind",
            "--tool=memcheck",
            "--leak-check=full",
            "--show-leak-kinds=definite",
            "--xml=yes",
            f"--xml-file={report}",
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            *pytest_args,
        ]
        env = dict(os.environ, PYTHONMALLOC="malloc")
        tests = subprocess.run(command, env=env, check=False)
        root = ET.parse(report).getroot()
    ours = [e for e in root.iter("error") if frames_are_ours(e)]
    total = sum(1 for _ in root.iter("error"))
    for error in ours:
        what = error.findtext("what") or error.findtext("xwhat/text")
        print("memcheck:", error.findtext("kind"), "-", what)
        for frame in list(error.iter("frame"))[:8]:
            print("   ", frame.findtext("fn"), frame.findtext("file"), frame.findtext("line"))
    print(f"memcheck: {total} reports in all, {len(ours)} in nanolimit's native code")
    if tests.returncode != 0:
        print(f"memcheck: the tests themselves failed under valgrind (exit {tests.returncode})")
        return 1
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
