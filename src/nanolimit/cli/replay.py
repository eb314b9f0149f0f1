"""``nanolimit replay``: run a request log through a candidate limit on the
native batch path and say what would have been allowed and denied."""

from __future__ import annotations

import csv
import json
import math
import operator
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from itertools import compress
from typing import Any, TextIO

from nanolimit import FakeClock, InMemoryStorage

from .._clocks import MAX_TIME
from .._limiter_config import Algorithm
from ..errors import ValidationError
from ..gateway.factory import LimiterFactory
from ..gateway.keys import ClientKey, DefaultKeyExtractor
from ..gateway.rules import KeyScope, RateLimitRule, parse_rate

REPLAY_BATCH = 65536
_FIRST = operator.itemgetter(0)
_SECOND = operator.itemgetter(1)
_THIRD = operator.itemgetter(2)
_MAX_RAW_KEY_BYTES = 1000


class _Progress:
    """A one-line progress bar on stderr, redrawn at most 10 times a second."""

    def __init__(self, total: int, stream: TextIO) -> None:
        self.total = max(1, total)
        self.stream = stream
        self.last = 0.0

    def update(self, done: int, lines: int, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last < 0.1:
            return
        self.last = now
        frac = min(1.0, done / self.total)
        bar = "#" * int(frac * 30)
        self.stream.write(f"\r[{bar:<30}] {frac:6.1%} {lines:,} lines")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()


def _key_mapper(scope: KeyScope) -> Callable[[str], str]:
    """A trace's key column -> the key the rule would count under: the
    client's network for ``ip`` (IPv6 /64), one key for ``global``, the value
    itself otherwise (bounded: a huge value becomes its digest)."""
    if scope is KeyScope.GLOBAL:
        return lambda _raw: "*"
    if scope is KeyScope.IP:
        extractor = DefaultKeyExtractor()
        return extractor.ip_value

    def bounded(raw: str) -> str:
        if (
            len(raw) * 4 <= _MAX_RAW_KEY_BYTES
            or len(raw.encode("utf-8", "surrogatepass")) <= _MAX_RAW_KEY_BYTES
        ):
            return raw or "(empty)"
        return ClientKey(scope, raw).storage_key()

    return bounded


def _parse_time(text: str, iso: bool) -> float:
    if iso:
        return datetime.fromisoformat(text.strip()).timestamp()
    return float(text)


class _Replay:
    def __init__(self, limiter: Any, capacity: int, scope: KeyScope, batch: int) -> None:
        self.limiter = limiter
        self.capacity = capacity
        self.batch = batch
        self.mapper = _key_mapper(scope)
        self.map_cache: dict[str, str] = {}
        self.identity = scope in (KeyScope.USER, KeyScope.API_KEY)
        self.iso: bool | None = None
        self.line = 0
        self.total: Counter[str] = Counter()
        self.allowed: Counter[str] = Counter()
        self.oversized: Counter[str] = Counter()
        self.skipped = 0
        self.first_error: str | None = None
        self.decide_seconds = 0.0
        self.decisions = 0

    def _bad(self, line: int, why: str) -> None:
        self.skipped += 1
        if self.first_error is None:
            self.first_error = f"line {line}: {why}"

    def _map_keys(self, raw: list[str]) -> list[str]:
        if self.identity and raw and max(map(len, raw)) * 4 <= _MAX_RAW_KEY_BYTES and all(raw):
            return raw
        cache = self.map_cache
        missing = [k for k in set(raw) if k not in cache]
        if len(cache) + len(missing) > 1 << 20:
            cache.clear()  # bounded; refilled below for this chunk
            missing = list(set(raw))
        mapper = self.mapper
        for k in missing:
            cache[k] = mapper(k)
        return list(map(cache.__getitem__, raw))  # C-level: no Python loop per line

    def _rows_slow(self, rows: list[list[str]], first_line: int) -> tuple[list[float], list[str], list[int]]:
        times: list[float] = []
        keys: list[str] = []
        costs: list[int] = []
        assert self.iso is not None
        for offset, row in enumerate(rows):
            n = first_line + offset
            if not row or (len(row) == 1 and not row[0].strip()):
                continue
            if len(row) < 2 or len(row) > 3:
                self._bad(n, f"expected timestamp,key[,cost], got {len(row)} column(s)")
                continue
            try:
                t = _parse_time(row[0], self.iso)
            except (ValueError, OverflowError):
                self._bad(n, f"bad timestamp {row[0]!r}")
                continue
            if not math.isfinite(t) or abs(t) >= MAX_TIME:
                self._bad(n, f"timestamp out of range {row[0]!r}")
                continue
            cost = 1
            if len(row) == 3 and row[2].strip():
                try:
                    cost = int(row[2])
                except ValueError:
                    self._bad(n, f"bad cost {row[2]!r}")
                    continue
                if cost < 1:
                    self._bad(n, f"cost must be >= 1, got {cost}")
                    continue
            times.append(t)
            keys.append(row[1])
            costs.append(cost)
        return times, keys, costs

    def feed(self, lines: list[str]) -> None:
        rows = list(csv.reader(lines))
        first_line = self.line + 1
        self.line += len(lines)
        if self.iso is None:
            # the first row decides the timestamp format, and may be a header
            while rows and not any(c.strip() for c in rows[0]):
                rows.pop(0)
                first_line += 1
            if not rows:
                return
            head = rows[0][0] if rows[0] else ""
            try:
                float(head)
                self.iso = False
            except ValueError:
                try:
                    datetime.fromisoformat(head.strip())
                    self.iso = True
                except ValueError:
                    rows.pop(0)  # a header line
                    first_line += 1
                    self.iso = False
                    if rows:
                        try:
                            float(rows[0][0])
                        except (ValueError, IndexError):
                            try:
                                datetime.fromisoformat(rows[0][0].strip())
                                self.iso = True
                            except (ValueError, IndexError):
                                pass
        if not rows:
            return
        times_l: list[float]
        costs_l: list[int] | None
        try:
            if self.iso:
                raise ValueError("iso timestamps take the careful path")
            widths = set(map(len, rows))
            times_l = list(map(float, map(_FIRST, rows)))
            keys = list(map(_SECOND, rows))
            if widths == {2}:
                costs_l = None
            elif widths == {3}:
                costs_l = list(map(int, map(_THIRD, rows)))
                if min(costs_l) < 1:
                    raise ValueError("cost < 1")
            else:
                raise ValueError("ragged rows")
            # NaN or inf poisons the sum; anything out of the clock's range is refused
            if not math.isfinite(sum(times_l)) or max(times_l) >= MAX_TIME or min(times_l) <= -MAX_TIME:
                raise ValueError("timestamp out of range")
        except (ValueError, IndexError, OverflowError):
            times_l, keys, costs_l = self._rows_slow(rows, first_line)
            if costs_l and max(costs_l) == 1:
                costs_l = None
        if costs_l is not None and max(costs_l, default=0) > self.capacity:
            keep = [c <= self.capacity for c in costs_l]
            self.oversized.update(self._map_keys(list(compress(keys, [not k for k in keep]))))
            times_l = list(compress(times_l, keep))
            keys = list(compress(keys, keep))
            costs_l = list(compress(costs_l, keep))
        self._decide(times_l, self._map_keys(keys), costs_l)

    def _decide(self, times_l: list[float], keys: list[str], costs_l: list[int] | None) -> None:
        step = self.batch
        allow_many = self.limiter.allow_many
        for i in range(0, len(keys), step):
            k = keys[i : i + step]
            t = times_l[i : i + step]  # a list: allow_many takes it without a copy
            c = None if costs_l is None else costs_l[i : i + step]
            start = time.perf_counter()
            result = allow_many(k, c, times=t)
            self.decide_seconds += time.perf_counter() - start
            self.decisions += len(k)
            self.total.update(k)
            self.allowed.update(compress(k, result.allowed))


def replay(
    path: str,
    rate: str,
    algorithm: str,
    scope: str,
    *,
    top: int = 10,
    batch: int = REPLAY_BATCH,
    progress: bool | None = None,
    as_json: bool = False,
    per_key: str | None = None,
) -> int:
    try:
        parsed = parse_rate(rate)
        rule = RateLimitRule(
            "replay",
            "*",
            "/",
            KeyScope(scope),
            Algorithm.parse(algorithm),
            parsed.limit,
            parsed.window_seconds,
            parsed.burst,
        )
    except (ValidationError, ValueError) as exc:
        print(f"nanolimit replay: {exc}", file=sys.stderr)
        return 2
    limiter = LimiterFactory(InMemoryStorage(), FakeClock(0.0)).for_rule(rule)
    run = _Replay(limiter, rule.capacity, rule.scope, batch)
    try:
        size = os.path.getsize(path)
        handle = open(path, newline="", encoding="utf-8", errors="surrogateescape")  # noqa: SIM115
    except OSError as exc:
        print(f"nanolimit replay: cannot read {path}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if progress is None:
        progress = sys.stderr.isatty() and size > 8 << 20
    bar = _Progress(size, sys.stderr) if progress else None
    started = time.perf_counter()
    done = 0
    with handle:
        while True:
            lines = handle.readlines(4 << 20)
            if not lines:
                break
            done += sum(map(len, lines))
            run.feed(lines)
            if bar is not None:
                bar.update(done, run.line)
    if bar is not None:
        bar.update(size, run.line, force=True)
        bar.close()
    elapsed = time.perf_counter() - started
    total = run.decisions + sum(run.oversized.values())
    allowed = sum(run.allowed.values())
    denied = total - allowed
    keys = set(run.total) | set(run.oversized)
    rows = []
    for key in keys:
        seen = run.total[key] + run.oversized[key]
        ok = run.allowed[key]
        rows.append((seen - ok, seen, ok, key))
    rows.sort(key=lambda r: (-r[0], -r[1], r[3]))
    rate_per_s = run.decisions / run.decide_seconds if run.decide_seconds > 0 else 0.0
    summary: dict[str, Any] = {
        "file": path,
        "rule": rate,
        "algorithm": rule.algorithm.value,
        "scope": rule.scope.value,
        "requests": total,
        "allowed": allowed,
        "denied": denied,
        "keys": len(keys),
        "keys_denied": sum(1 for r in rows if r[0] > 0),
        "oversized": sum(run.oversized.values()),
        "skipped_lines": run.skipped,
        "first_error": run.first_error,
        "decide_seconds": round(run.decide_seconds, 6),
        "decisions_per_second": round(rate_per_s),
        "total_seconds": round(elapsed, 6),
        "top": [{"key": r[3], "requests": r[1], "allowed": r[2], "denied": r[0]} for r in rows[:top]],
    }
    if per_key is not None:
        with open(per_key, "w", newline="", encoding="utf-8", errors="surrogateescape") as out:
            writer = csv.writer(out)
            writer.writerow(["key", "requests", "allowed", "denied"])
            for denied_k, seen, ok, key in sorted(rows, key=lambda r: r[3]):
                writer.writerow([key, seen, ok, denied_k])
    if as_json:
        print(json.dumps(summary, indent=2))
        return 0

    def pct(n: int) -> str:
        return f"{100.0 * n / total:.1f} %" if total else "-"

    print(
        f"replayed {total:,} requests from {path}: "
        f"rule {rate}, {rule.algorithm.value}, scope {rule.scope.value}"
    )
    print(f"  allowed {allowed:,} ({pct(allowed)}), denied {denied:,} ({pct(denied)})")
    print(f"  {len(keys):,} keys, {summary['keys_denied']:,} of them denied at least once")
    if summary["oversized"]:
        print(
            f"  {summary['oversized']:,} requests cost more than the capacity {rule.capacity}: denied forever"
        )
    if run.skipped:
        print(f"  skipped {run.skipped:,} malformed line(s); first: {run.first_error}")
    if rows and top > 0:
        print(f"  keys with the most denials (top {min(top, len(rows))}):")
        width = max(12, *(len(r[3]) for r in rows[:top]))
        print(f"    {'key':<{width}} {'requests':>10} {'allowed':>10} {'denied':>10}")
        for denied_k, seen, ok, key in rows[:top]:
            print(f"    {key:<{width}} {seen:>10,} {ok:>10,} {denied_k:>10,}")
    print(
        f"  decided in {run.decide_seconds:.3f} s ({rate_per_s / 1e6:.2f} M decisions/s on the batch path), "
        f"{elapsed:.3f} s in all"
    )
    return 0
