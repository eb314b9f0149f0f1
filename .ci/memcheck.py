"""Run part of the native test suite under valgrind memcheck and fail on any
error or definite leak whose stack passes through nanolimit's own C code.

CPython itself is not built for valgrind, so interpreter start-up and glibc's
vectorised string routines report noise; only frames in our extension count.
Usage: python .ci/memcheck.py [--shards N] [pytest args...]

``--shards N`` splits the run over N valgrind processes at once (the
conftest's ``--shard I/N``): memcheck runs one thread at ~50x, so on a
2-core runner two shards take about half the wall time.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

# Our code, as valgrind names it: the extension's object file, and the
# source files of its frames. Matched on the object and file names only: a
# function name such as CPython's ``pyinit_core.constprop.0`` is not ours.
OURS_OBJECT = "nanolimit/_core"
OURS_FILES = (
    "_core.c",
    "_core.pyx",
    "_native.h",
    "_decision_pool.h",
    "_kernels.pxd",
    "_index.pxd",
    "_evict.pxd",
    "_table.pxd",
    "_zone.pxd",
    "_zone.h",
)


def frames_are_ours(error: ET.Element) -> bool:
    for frame in error.iter("frame"):
        if OURS_OBJECT in (frame.findtext("obj") or ""):
            return True
        name = os.path.basename(frame.findtext("file") or "")
        if name in OURS_FILES or (name.startswith("_core_") and name.endswith(".pxi")):
            return True
    return False


def main(argv: list[str]) -> int:
    shards = 1
    if argv[:1] == ["--shards"]:
        shards, argv = int(argv[1]), argv[2:]
    with tempfile.TemporaryDirectory() as tmp:
        # one report per process: a test that starts a server forks, and the
        # child writes its own document until it execs
        report = os.path.join(tmp, "memcheck.%p.xml")
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
            *argv,
        ]
        # NANOLIMIT_MEMCHECK: the tests repeat each path fewer times (tests/_helpers.rounds)
        env = dict(os.environ, PYTHONMALLOC="malloc", NANOLIMIT_MEMCHECK="1")
        if shards == 1:
            runs = [subprocess.Popen(command, env=env)]
        else:
            runs = [subprocess.Popen([*command, "--shard", f"{i}/{shards}"], env=env) for i in range(shards)]
        codes = [run.wait() for run in runs]
        own = {f"memcheck.{run.pid}.xml" for run in runs}
        errors = []
        for name in sorted(os.listdir(tmp)):
            try:
                errors += list(ET.parse(os.path.join(tmp, name)).getroot().iter("error"))
            except ET.ParseError:  # a forked child's document, cut short by its exec
                if name in own:
                    raise  # a test process's own report must be whole
                continue
    ours = [e for e in errors if frames_are_ours(e)]
    total = len(errors)
    for error in ours:
        what = error.findtext("what") or error.findtext("xwhat/text")
        print("memcheck:", error.findtext("kind"), "-", what)
        for frame in list(error.iter("frame"))[:8]:
            print("   ", frame.findtext("fn"), frame.findtext("file"), frame.findtext("line"))
    print(f"memcheck: {total} reports in all, {len(ours)} in nanolimit's native code")
    if any(codes):
        print(f"memcheck: the tests themselves failed under valgrind (exits {codes})")
        return 1
    return 1 if ours else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
