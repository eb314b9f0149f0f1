"""``nanolimit zone NAME``: what a running gateway's shared-memory zone
holds (its size, keys, evictions, arena, lock recoveries and attached
processes), read by attaching with the zone's own parameters; ``--keys``
lists keys, ``--unlink`` removes the zone's name when the gateway is gone."""

from __future__ import annotations

import json
import os
import sys

from ..errors import ValidationError
from ..storage.shared_memory import SharedMemoryStorage


def zone(name: str, *, keys: int = 0, unlink: bool = False) -> int:
    try:
        storage = SharedMemoryStorage.attach(name)
    except ValidationError as exc:
        print(f"nanolimit zone: {exc}", file=sys.stderr)
        return 1
    try:
        # this command attaches too: it is no process of the gateway's
        others = [pid for pid in storage.attached_pids() if pid != os.getpid()]
        metrics = storage.metrics()
        metrics["processes"] = len(others)
        report = {"name": storage.name, "segment": storage.segment_name, **metrics, "attached_pids": others}
        if keys:
            report["keys_sample"] = storage.keys()[:keys]
        print(json.dumps(report, indent=2))
        if unlink:
            storage.unlink()
            kept = "processes attached keep it until they close"
            if others:
                kept = (
                    f"pids {', '.join(map(str, others))} are attached and keep deciding on it, while a "
                    "process that attaches now makes a fresh zone: two budgets until they exit"
                )
            print(f"unlinked {storage.segment_name}: {kept}", file=sys.stderr)
    finally:
        storage.close()
    return 0
