"""The engine behind ``nanolimit bench``: nanolimit and its peers, side by side.

Why it exists: our reason to exist is speed with full answers, and a claim
about speed is only worth a ratio measured in one process, on one machine, in
one run. This module runs the same scenarios through nanolimit and through the
in-memory API of every installed peer (``limits``, ``throttled-py``,
``pyrate-limiter``, ``token-bucket``) and reports nanoseconds per decision and
our ratio to each peer.

It times plain ``time.perf_counter_ns`` loops rather than pytest-benchmark, so
a user can run it from an installed wheel without pytest. The pytest suite in
``bench/`` imports the same adapters (:data:`LIBRARIES`), so the CLI and the
suite always measure the same calls.

Every figure includes the cost of the Python ``for`` loop that drives the
calls (the same loop for every library, reported as ``loop_overhead_ns``),
and each cell checks that the decisions it times really are the ones the
scenario means (allowed, or denied), so nothing is measured on the wrong path.

This module is the entry (``run``, ``main``) and the one import path
(``nanolimit.cli.bench``; ``nanolimit bench`` runs it): the cells live in
:mod:`.bench_cells`, the peer adapters in :mod:`.bench_peers`, the table and
the plot in :mod:`.bench_report`, and every name the suite uses is
re-exported here.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import json
import platform
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from .bench_cells import (
    ALGORITHMS as ALGORITHMS,
)
from .bench_cells import (
    BATCH as BATCH,
)
from .bench_cells import (
    COST as COST,
)
from .bench_cells import (
    DENIED_LIMIT as DENIED_LIMIT,
)
from .bench_cells import (
    DENIED_WINDOW as DENIED_WINDOW,
)
from .bench_cells import (
    FULL_BUDGET as FULL_BUDGET,
)
from .bench_cells import (
    HIGH_LIMIT as HIGH_LIMIT,
)
from .bench_cells import (
    HIGH_WINDOW as HIGH_WINDOW,
)
from .bench_cells import (
    HOT_KEY as HOT_KEY,
)
from .bench_cells import (
    KEYS_1M as KEYS_1M,
)
from .bench_cells import (
    KEYS_100K as KEYS_100K,
)
from .bench_cells import (
    MEMORY_SCENARIOS as MEMORY_SCENARIOS,
)
from .bench_cells import (
    OURS as OURS,
)
from .bench_cells import (
    QUICK_BUDGET as QUICK_BUDGET,
)
from .bench_cells import (
    QUICK_SCENARIOS as QUICK_SCENARIOS,
)
from .bench_cells import (
    REDIS_BATCH as REDIS_BATCH,
)
from .bench_cells import (
    REDIS_KEYS as REDIS_KEYS,
)
from .bench_cells import (
    REDIS_SCENARIOS as REDIS_SCENARIOS,
)
from .bench_cells import (
    SCENARIOS as SCENARIOS,
)
from .bench_cells import (
    ZONE as ZONE,
)
from .bench_cells import (
    Budget as Budget,
)
from .bench_cells import (
    Cell as Cell,
)
from .bench_cells import (
    Maker as Maker,
)
from .bench_cells import (
    Prepared as Prepared,
)
from .bench_cells import (
    Results as Results,
)
from .bench_cells import (
    Shared as Shared,
)
from .bench_cells import (
    Subject as Subject,
)
from .bench_cells import (
    WrongPath as WrongPath,
)
from .bench_cells import (
    _hot_cell as _hot_cell,
)
from .bench_cells import (
    _nothing as _nothing,
)
from .bench_cells import (
    _prefill as _prefill,
)
from .bench_cells import (
    _round_robin as _round_robin,
)
from .bench_cells import (
    _timed as _timed,
)
from .bench_cells import (
    key_list as key_list,
)
from .bench_cells import (
    loop_overhead_ns as loop_overhead_ns,
)
from .bench_cells import (
    prepare as prepare,
)
from .bench_cells import (
    sample as sample,
)
from .bench_cells import (
    zone_available as zone_available,
)
from .bench_cells import (
    zone_makers as zone_makers,
)
from .bench_peers import (
    DEFAULT_LIBRARIES as PEER_DEFAULT_LIBRARIES,
)
from .bench_peers import (
    LIBRARIES as LIBRARIES,
)
from .bench_peers import (
    THROTTLED_ALGORITHMS as THROTTLED_ALGORITHMS,
)
from .bench_peers import (
    THROTTLED_MAX_SIZE as THROTTLED_MAX_SIZE,
)
from .bench_peers import (
    Library as Library,
)
from .bench_peers import (
    RedisTarget as RedisTarget,
)
from .bench_peers import (
    _importable as _importable,
)
from .bench_peers import (
    _nanolimit_makers as _nanolimit_makers,
)
from .bench_report import (
    format_markdown as format_markdown,
)
from .bench_report import (
    format_table as format_table,
)
from .bench_report import (
    plot as plot,
)

__all__ = [
    "ALGORITHMS",
    "LIBRARIES",
    "SCENARIOS",
    "ZONE",
    "Cell",
    "Library",
    "Results",
    "Subject",
    "format_markdown",
    "format_table",
    "main",
    "plot",
    "run",
]


@dataclass(frozen=True)
class _ZoneLibrary(Library):
    """The zone is there when the native extension has the class, not merely
    when ``nanolimit._core`` imports (on a platform without POSIX shared
    memory its cells report the error the constructor raises)."""

    def available(self) -> bool:
        return zone_available()


def _with_zone(libraries: dict[str, Library]) -> None:
    """Put the shared-memory zone right after in-memory nanolimit in
    ``libraries`` (in place: the report orders its rows and columns by it)."""
    if ZONE in libraries:
        return
    entries = list(libraries.items())
    libraries.clear()
    for name, lib in entries:
        libraries[name] = lib
        if name == OURS:
            libraries[ZONE] = _ZoneLibrary(
                ZONE,
                "nanolimit._core",
                zone_makers,
                ALGORITHMS,
                "the native limiters on a SharedMemoryStorage, one state for every process of the host",
            )


_with_zone(LIBRARIES)
#: the in-memory table and the zone, then every peer
DEFAULT_LIBRARIES = tuple(
    name for lib in PEER_DEFAULT_LIBRARIES for name in ((lib, ZONE) if lib == OURS else (lib,))
)


def _meta(quick: bool) -> dict[str, Any]:
    import nanolimit

    versions: dict[str, str] = {"nanolimit": f"{nanolimit.__version__} ({nanolimit.IMPLEMENTATION})"}
    for dist in ("limits", "throttled-py", "pyrate-limiter", "token-bucket"):
        try:
            versions[dist] = importlib.metadata.version(dist)
        except Exception:  # noqa: BLE001 - not installed, or no metadata: the table says so
            versions[dist] = "not installed"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
        "platform": platform.platform(),
        "versions": versions,
        "quick": quick,
        "clock": "SystemClock (nanolimit); each peer its own default clock",
        "batch": BATCH,
    }


def run(
    quick: bool = True,
    libraries: Iterable[str] | None = None,
    algorithms: Iterable[str] | None = None,
    scenarios: Iterable[str] | None = None,
    progress: Callable[[str], None] | None = None,
    redis_url: str | None = None,
) -> Results:
    """Measure every library × algorithm × scenario asked for, in this process.

    Unknown names raise ``ValueError``; a library that is not installed, or
    lacks an algorithm or a scenario's API, simply has no cell (or an
    ``error`` cell saying why), so the run always completes. ``redis_url``
    adds the ``redis_`` scenarios (they need it); the keys they write there
    are deleted at the end.
    """
    libs = list(libraries or DEFAULT_LIBRARIES)
    algs = list(algorithms or ALGORITHMS)
    default = list(QUICK_SCENARIOS if quick else MEMORY_SCENARIOS)
    if redis_url:
        default += list(REDIS_SCENARIOS)
    scens = list(scenarios or default)
    for name, known in ((libs, LIBRARIES), (algs, ALGORITHMS), (scens, SCENARIOS)):
        unknown = [n for n in name if n not in known]
        if unknown:
            raise ValueError(f"unknown: {', '.join(unknown)} (known: {', '.join(known)})")
    wants_redis = [scen for scen in scens if scen in REDIS_SCENARIOS]
    if wants_redis and not redis_url:
        raise ValueError(f"{', '.join(wants_redis)} need a server: --redis redis://HOST:PORT/DB")
    target = RedisTarget(redis_url) if redis_url and wants_redis else None
    if target is not None:
        try:
            target.check()
        except Exception as exc:  # any client error: say which server, and why
            raise ValueError(f"no Redis answering at {_public_url(target.url)}: {exc}") from exc
    budget = QUICK_BUDGET if quick else FULL_BUDGET
    results = Results(_meta(quick))
    results.meta["loop_overhead_ns"] = round(loop_overhead_ns(budget), 1)
    if target is not None:
        results.meta["redis"] = _public_url(target.url)
    say = progress or (lambda _msg: None)
    missing = [lib for lib in libs if not LIBRARIES[lib].available()]
    results.meta["missing"] = missing
    shared = Shared()
    for lib_name in missing:
        say(f"{lib_name}: not installed, skipped (pip install 'nanolimit[bench]')")
    present = [lib for lib in libs if lib not in missing]
    makers = {lib: LIBRARIES[lib].makers() for lib in present}
    redis_makers: dict[str, dict[str, Maker]] = {}
    if target is not None:
        for lib in present:
            found = LIBRARIES[lib].redis_makers
            if found is not None:
                redis_makers[lib] = found(target)
    try:
        _run_cells(results, algs, makers, redis_makers, scens, shared, budget, say)
    finally:
        if target is not None:
            results.meta["redis_keys_removed"] = target.cleanup()
    return results


def _public_url(url: str) -> str:
    """``url`` without its passwords, for a report (``redact_uri``: every spelling)."""
    from ..storage.uri import redact_uri

    return redact_uri(url)


def _run_cells(
    results: Results,
    algs: list[str],
    makers: dict[str, dict[str, Maker]],
    redis_makers: dict[str, dict[str, Maker]],
    scens: list[str],
    shared: Shared,
    budget: Budget,
    say: Callable[[str], None],
) -> None:
    # algorithm outermost: ours and each peer's figures for one algorithm are
    # taken seconds apart, so a change in the machine's load skews no ratio
    for alg in algs:
        for lib_name, lib_makers in makers.items():
            try:
                for scen in scens:
                    source = redis_makers.get(lib_name, {}) if scen in REDIS_SCENARIOS else lib_makers
                    make = source.get(alg)
                    if make is None:
                        continue
                    if scen == "allow_many_100k" and not lib_name.startswith(OURS):
                        continue
                    say(f"{alg} {lib_name} {scen}")
                    gc.collect()
                    try:
                        prepared = prepare(scen, make, shared)
                    except NotImplementedError:
                        continue  # the library has no such API (peek): no cell
                    except Exception as exc:  # noqa: BLE001 - one broken peer must not sink the run
                        results.cells.append(Cell(lib_name, alg, scen, error=f"{type(exc).__name__}: {exc}"))
                        continue
                    try:
                        results.cells.append(Cell.of(lib_name, alg, scen, sample(prepared, budget)))
                    except Exception as exc:  # noqa: BLE001 - the same, while timing
                        results.cells.append(Cell(lib_name, alg, scen, error=f"{type(exc).__name__}: {exc}"))
                    finally:
                        prepared.close()
            finally:
                shared.close()
                gc.collect()


# ---------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------


def _csv(value: str | None) -> list[str] | None:
    return [v.strip() for v in value.split(",") if v.strip()] if value else None


def main(argv: Sequence[str] | None = None) -> int:
    """``nanolimit bench [--full] [--json] [--plot PATH] [--redis URL] [--libraries a,b] ...``"""
    parser = argparse.ArgumentParser(
        prog="nanolimit bench",
        description="nanolimit and its peers side by side: ns per decision, measured in this process.",
        epilog="libraries: "
        + "; ".join(f"{lib.name}: {lib.note}" if lib.note else lib.name for lib in LIBRARIES.values())
        + f". Default: {', '.join(DEFAULT_LIBRARIES)}. The {ZONE} rows' ratio is their time over the "
        "in-memory nanolimit's (above 1: the zone is slower).",
    )
    parser.add_argument("--full", action="store_true", help="longer runs, and the 1,000,000-key scenario")
    parser.add_argument("--json", action="store_true", help="print the results as JSON instead of a table")
    parser.add_argument("--markdown", action="store_true", help="print markdown tables (for the README)")
    parser.add_argument("--plot", metavar="PATH", help="also draw a bar chart (needs matplotlib)")
    parser.add_argument("--libraries", help=f"comma-separated, from: {', '.join(LIBRARIES)}")
    parser.add_argument("--algorithms", help=f"comma-separated, from: {', '.join(ALGORITHMS)}")
    parser.add_argument("--scenarios", help=f"comma-separated, from: {', '.join(SCENARIOS)}")
    parser.add_argument(
        "--redis",
        metavar="URL",
        help="also run the redis_ scenarios against this server (redis://HOST:PORT/DB); "
        "the keys written there are deleted at the end",
    )
    parser.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    args = parser.parse_args(argv)
    if args.plot and not _importable("matplotlib"):  # fail now, not after minutes
        parser.exit(2, "nanolimit bench: --plot needs matplotlib: pip install matplotlib\n")

    def progress(msg: str) -> None:
        print(f"  {msg}", file=sys.stderr, flush=True)

    try:
        results = run(
            quick=not args.full,
            libraries=_csv(args.libraries),
            algorithms=_csv(args.algorithms),
            scenarios=_csv(args.scenarios),
            progress=None if args.quiet else progress,
            redis_url=args.redis,
        )
    except ValueError as exc:
        parser.exit(2, f"nanolimit bench: {exc}\n")
    if args.json:
        print(json.dumps(results.as_dict(), indent=2))
    elif args.markdown:
        print(format_markdown(results))
    else:
        print(format_table(results))
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
