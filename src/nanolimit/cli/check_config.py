"""``nanolimit check-config``: validate a rules file (TOML or JSON) and list
the rules it defines."""

from __future__ import annotations

import sys

from ..errors import ConfigError
from ..gateway.config import load_rules


def check_config(path: str) -> int:
    try:
        loaded = load_rules(path)
    except ConfigError as exc:
        print(f"{exc.source}: INVALID, {len(exc.problems)} problem(s)", file=sys.stderr)
        for problem in exc.problems:
            print(f"  - {problem}", file=sys.stderr)
        return 1
    mode = "stacked (every matching rule applies)" if loaded.stacked else "most specific rule wins"
    print(f"{path}: OK, {len(loaded.rules)} rule(s), {mode}")
    if loaded.storage is not None:
        # never a password: the URI is shown redacted, a secret option as ***
        print(f"  storage: {loaded.storage.type} {loaded.storage.shown_options()}".rstrip())
    rows = [*loaded.rules, *(() if loaded.default is None else (loaded.default,))]
    for rule in rows:
        extras = []
        if rule.burst is not None:
            extras.append(f"burst {rule.burst}")
        if rule.tier is not None:
            extras.append(f"tier {rule.tier}")
        if rule.dry_run:
            extras.append("dry run")
        if type(rule.cost) is int and rule.cost != 1:
            extras.append(f"cost {rule.cost}")
        if type(rule.count_when) is frozenset:
            extras.append("counts " + ",".join(str(s) for s in sorted(rule.count_when)))
        if rule.group is not None:
            extras.append(f"group {rule.group}")
        label = "(default)" if rule is loaded.default else ""
        where = "route " + " ".join(rule.routes) if rule.routes else rule.path_prefix
        line = (
            f"  {rule.name:<20} {rule.method:<6} {where:<24} {rule.scope.value:<8} "
            f"{rule.algorithm.value:<16} {rule.limit}/{rule.window_seconds:g}s {' '.join(extras)} {label}"
        )
        print(line.rstrip())
    if loaded.exempt:
        print(f"  exempt: {' '.join(loaded.exempt)}")
    return 0
