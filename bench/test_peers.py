"""nanolimit next to its peers: the same scenarios through each peer's
in-memory API, in this process, so every comparison is a ratio from one run.

The adapters and scenarios are those of ``nanolimit bench``
(:mod:`nanolimit.cli.bench`), so the suite and the CLI measure the same calls.
Each case is grouped by ``algorithm/scenario``: pytest-benchmark's relative
column inside a group is the ratio to the fastest, normally nanolimit.

Peers come from the ``bench`` extra (``pip install -e '.[bench]'``); a missing
one is skipped. The million-key cases fill a peer's store one Python call at a
time (a minute or more per peer), so they run only with
``NANOLIMIT_BENCH_MILLION=1``; nanolimit's own million-key figures are in
``test_core.py``.

``test_adapter_sanity`` is a plain test (it runs without ``--benchmark-only``):
it proves each adapter really decides, exactly N allowed of M on a fresh key.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Iterator

import pytest
from bench_helpers import check_adapter, peer_cases

from nanolimit.cli import bench as _bench
from nanolimit.cli.bench import LIBRARIES, Maker, Prepared, Shared

PEERS = ("limits", "throttled", "pyrate", "token_bucket")
LIBS = ("nanolimit", *PEERS)
SCENARIOS = ("hot_allowed", "hot_denied", "keys_100k", "keys_1m", "fresh_key", "cost_5", "peek")
# Each case times about this long: the whole peer suite stays near a minute.
CASE_SECONDS = 0.2

# Ordered algorithm, library, scenario: ours and the peers' figures for one
# algorithm are taken close together, and the 100k-key store of one library
# and algorithm is filled once for its consecutive cases (see ``Shared``).
CASES, PAIRS = peer_cases(LIBS, SCENARIOS)


def _maker(lib: str, alg: str) -> Maker:
    if importlib.util.find_spec(LIBRARIES[lib].module) is None:
        pytest.skip(f"{lib} is not installed (pip install -e '.[bench]')")
    return LIBRARIES[lib].makers()[alg]


_makers: dict[tuple[str, str], Maker] = {}


def _cached_maker(lib: str, alg: str) -> Maker:
    """One maker per library and algorithm, so ``Shared`` sees the same one
    across cases and keeps its filled store."""
    if (lib, alg) not in _makers:
        _makers[(lib, alg)] = _maker(lib, alg)
    return _makers[(lib, alg)]


@pytest.fixture(scope="module")
def shared() -> Iterator[Shared]:
    store = Shared()
    yield store
    store.close()


@pytest.mark.parametrize(("lib", "alg", "scen"), CASES)
def test_peer(time_cell: Callable[..., None], shared: Shared, lib: str, alg: str, scen: str) -> None:
    if scen == "keys_1m" and lib != "nanolimit" and not os.environ.get("NANOLIMIT_BENCH_MILLION"):
        pytest.skip("a peer's million-key fill takes minutes: set NANOLIMIT_BENCH_MILLION=1")
    make = _cached_maker(lib, alg)
    try:
        prepared: Prepared = _bench.prepare(scen, make, shared)
    except NotImplementedError as exc:
        pytest.skip(f"{lib} has {exc}")
    time_cell(prepared, f"{alg}/{scen}", CASE_SECONDS, 200)


@pytest.mark.parametrize(("lib", "alg"), PAIRS)
def test_adapter_sanity(lib: str, alg: str) -> None:
    """Each adapter decides (see ``bench_helpers.check_adapter``)."""
    check_adapter(_maker(lib, alg))


def test_bench_cli_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    """``nanolimit bench`` end to end on a tiny selection: the JSON carries a
    cell per library and scenario, and our ratio to the peer."""
    import json

    argv = ["--quiet", "--json", "--libraries", "nanolimit,token_bucket", "--algorithms", "token_bucket"]
    argv += ["--scenarios", "hot_allowed,hot_denied"]
    if importlib.util.find_spec("token_bucket") is None:
        argv[3] = "nanolimit"
    assert _bench.main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    cells = {(c["library"], c["scenario"]): c for c in out["cells"]}
    assert all(c["error"] is None and c["median_ns"] > 0 for c in cells.values()), cells
    assert ("nanolimit", "hot_denied") in cells
    if ("token_bucket", "hot_allowed") in cells:
        assert cells[("token_bucket", "hot_allowed")]["ours_faster_x"] > 0
