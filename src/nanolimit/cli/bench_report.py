"""The report of ``nanolimit bench``: the human table, the README's markdown
tables and the bar chart."""

from __future__ import annotations

import importlib
from typing import Any

from .bench_cells import ALGORITHMS, BATCH, REDIS_BATCH, SCENARIOS, ZONE, Cell, Results
from .bench_peers import LIBRARIES

# ---------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------


def _ns(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if value >= 100 else f"{value:.1f}"


def _verdict(results: Results, c: Cell) -> str:
    """The last column: how many times faster nanolimit is than a peer; for
    the zone, its time over the in-memory table's (above 1: slower)."""
    ratio = results.ratio(c)
    if ratio is None:
        return ""
    if c.library == ZONE:
        return f"{ratio:.2f}x the in-memory time"
    return f"{ratio:.1f}x faster" if ratio >= 1 else f"{1 / ratio:.2f}x SLOWER"


def format_table(results: Results) -> str:
    """The human table: one row per cell, grouped by scenario and algorithm."""
    meta = results.meta
    lines = [
        f"nanolimit bench ({'quick' if meta.get('quick') else 'full'}) - {meta['date']}",
        f"{meta['python']} on {meta['platform']}",
        "versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        f"ns per decision, median (min-max) over repeats of {BATCH} calls ({REDIS_BATCH} on Redis); "
        f"every figure includes the driving loop, {meta['loop_overhead_ns']} ns",
        "",
    ]
    w = max(len(c.scenario) for c in results.cells) if results.cells else 16
    header = f"{'scenario':<{w}} {'algorithm':<16} {'library':<20} {'median':>9} {'min-max':>19}"
    header += "  nanolimit is"
    lines += [header, "-" * len(header)]
    order = {s: i for i, s in enumerate(SCENARIOS)}
    alg_order = {a: i for i, a in enumerate(ALGORITHMS)}
    lib_order = {name: i for i, name in enumerate(LIBRARIES)}
    cells = sorted(
        results.cells, key=lambda c: (order[c.scenario], alg_order[c.algorithm], lib_order[c.library])
    )
    previous: tuple[str, str] | None = None
    for c in cells:
        group = (c.scenario, c.algorithm)
        if previous is not None and group != previous and c.scenario != previous[0]:
            lines.append("")
        scen = c.scenario if group != previous else ""
        alg = c.algorithm if group != previous else ""
        previous = group
        if c.error:
            lines.append(f"{scen:<{w}} {alg:<16} {c.library:<20} error: {c.error}")
            continue
        spread = f"{_ns(c.min_ns)}-{_ns(c.max_ns)}"
        verdict = _verdict(results, c)
        lines.append(f"{scen:<{w}} {alg:<16} {c.library:<20} {_ns(c.median_ns):>9} {spread:>19}  {verdict}")
    if meta.get("missing"):
        lines += ["", "not installed: " + ", ".join(meta["missing"]) + " (pip install 'nanolimit[bench]')"]
    return "\n".join(lines)


def format_markdown(results: Results) -> str:
    """The README's form: one table per scenario, a row per algorithm, a column
    per library; each peer cell reads ``median ns (our ratio)``."""
    meta = results.meta
    libs = [lib for lib in LIBRARIES if any(c.library == lib for c in results.cells)]
    out = [
        f"{meta['python']}, {meta['platform']}, {meta['date']}; "
        + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()),
        "",
        f"ns per decision, median of repeats of {BATCH} calls ({REDIS_BATCH} on Redis) "
        f"(loop included: {meta['loop_overhead_ns']} ns); in brackets, how many times faster nanolimit is"
        + (f" ({ZONE}: its time over in-memory nanolimit's, above 1 slower)." if ZONE in libs else "."),
    ]
    for scen, title in SCENARIOS.items():
        rows = [
            alg for alg in ALGORITHMS if any(c.scenario == scen and c.algorithm == alg for c in results.cells)
        ]
        if not rows:
            continue
        out += ["", f"**{scen}**: {title}", "", "| algorithm | " + " | ".join(libs) + " |"]
        out.append("| --- |" + " ---: |" * len(libs))
        for alg in rows:
            cells = []
            for lib in libs:
                c = results.cell(lib, alg, scen)
                if c is None:
                    cells.append("")
                elif c.error:
                    cells.append("error")
                else:
                    ratio = results.ratio(c)
                    digits = 2 if lib == ZONE else 1
                    cells.append(_ns(c.median_ns) + (f" ({ratio:.{digits}f}x)" if ratio is not None else ""))
            out.append(f"| {alg} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(results: Results, path: str) -> None:
    """A grouped bar chart, one panel per scenario, log scale: faster reads lower.
    Whiskers span the quartiles: on a busy machine the max is one stray spike.

    matplotlib is optional: without it this raises ``SystemExit`` with the
    command that installs it, rather than a traceback.
    """
    try:
        matplotlib: Any = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt: Any = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install matplotlib  (or pip install 'nanolimit[bench]')"
        ) from None
    scenarios = [s for s in SCENARIOS if any(c.scenario == s and c.median_ns for c in results.cells)]
    libraries = [lib for lib in LIBRARIES if any(c.library == lib and c.median_ns for c in results.cells)]
    cols = 2
    rows = max(1, (len(scenarios) + cols - 1) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(14, 3.6 * rows), squeeze=False)
    width = 0.8 / max(1, len(libraries))
    for ax, scen in zip(axes.flat, scenarios):
        algs = [a for a in ALGORITHMS if any(c.scenario == scen and c.algorithm == a for c in results.cells)]
        for j, lib in enumerate(libraries):
            xs, ys, lo, hi = [], [], [], []
            for i, alg in enumerate(algs):
                c = results.cell(lib, alg, scen)
                if c is None or c.median_ns is None or c.q1_ns is None or c.q3_ns is None:
                    continue
                xs.append(i + (j - (len(libraries) - 1) / 2) * width)
                ys.append(c.median_ns)
                lo.append(max(0.0, c.median_ns - c.q1_ns))
                hi.append(max(0.0, c.q3_ns - c.median_ns))
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], capsize=2, label=lib)
        ax.set_yscale("log")
        ax.set_ylim(bottom=10)  # one floor for every panel: bar heights compare across panels
        ax.set_title(SCENARIOS[scen], fontsize=9)
        ax.set_xticks(range(len(algs)))
        ax.set_xticklabels(algs, fontsize=8)
        ax.set_ylabel("ns per decision (log)")
        ax.grid(axis="y", which="both", alpha=0.3)
    for ax in list(axes.flat)[len(scenarios) :]:
        ax.axis("off")
    handles, labels = axes.flat[0].get_legend_handles_labels()
    meta = results.meta
    fig.suptitle(
        f"ns per decision, median and quartiles (lower is faster) - {meta['python']}, {meta['date']}",
        y=0.995,
        fontsize=10,
    )
    fig.legend(
        handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.975), ncol=len(labels), frameon=False
    )
    fig.tight_layout(rect=(0, 0, 1, 0.94))
    fig.savefig(path, dpi=110)
    plt.close(fig)
