"""One fleet instance for ``test_two_tier``: run as a separate process.

``python two_tier_worker.py '<json>'`` builds its own TwoTierStorage against
the shared loopback server (or a proxy in front of it), drives a load at the
same keys as its siblings from ``t0`` for ``duration`` seconds (real time):
paced (``pace`` seconds between rounds over the keys) or, with ``pace`` 0,
as fast as it can. With ``warm_at``, it decides each key once at that time
first (the fleet has seen the keys before the load starts). Without ``t0``
it prints ``ready`` once its storage has synced (it is a fleet member) and
reads ``t0``, ``warm_at`` and ``converge_at`` as one JSON line from stdin, so
a fleet starts together however long its interpreters took. It prints one
JSON line: what it admitted per key and window (and how much of it while
blind), its view of the fleet after a final sync, and its metrics.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections import defaultdict
from typing import Any


class RecordingClock:
    """Wall time, remembering the last reading: the window a decision fell in
    is then exactly the one the storage charged."""

    def __init__(self) -> None:
        self.last = 0.0

    def now(self) -> float:
        self.last = time.time()
        return self.last


def main(args: dict[str, Any]) -> None:
    import redis

    import nanolimit
    from nanolimit.storage.two_tier import TwoTierStorage

    client = redis.Redis(host="127.0.0.1", port=args["port"])
    storage = TwoTierStorage(
        None,
        client,
        sync_interval=args["sync_interval"],
        instance_id=args["instance_id"],
        heartbeat_ttl=args["heartbeat_ttl"],
        partition_grace=args.get("partition_grace", 30.0),
    )
    clock = RecordingClock()
    cls = getattr(nanolimit, args["limiter"])
    limiter = cls(args["limit"], args["window"], storage=storage, clock=clock)
    window = float(args["window"])
    admitted: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    blind: dict[str, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    instances_seen: set[int] = set()
    keys = args["keys"]
    decisions = 0

    def decide(key: str) -> None:
        decision = limiter.allow(key)
        if decision.allowed:
            k = math.floor(clock.last / window)
            admitted[key][k] += 1
            if decision.degraded:
                blind[key][k] += 1

    if args.get("t0") is None:
        print("ready", flush=True)
        args.update(json.loads(sys.stdin.readline()))
    if args.get("warm_at") is not None:
        time.sleep(max(0.0, args["warm_at"] - time.time()))
        for key in keys:
            decide(key)
            decisions += 1
    time.sleep(max(0.0, args["t0"] - time.time()))
    end = args["t0"] + args["duration"]
    pace = args["pace"]
    while time.time() < end:
        for key in keys:
            decide(key)
        decisions += len(keys)
        instances_seen.add(storage.instances)
        if pace:
            time.sleep(pace)
    storage.sync_now()
    time.sleep(max(0.0, args["converge_at"] - time.time()))
    storage.sync_now()
    view = {key: storage.fleet_counts(limiter.config, key) for key in args["keys"]}
    metrics = storage.metrics()
    storage.close()
    out = {
        "instance_id": args["instance_id"],
        "t0": args["t0"],
        "admitted": {key: {str(k): n for k, n in per.items()} for key, per in admitted.items()},
        "blind": {key: {str(k): n for k, n in per.items()} for key, per in blind.items()},
        "view": {key: {str(k): n for k, n in per.items()} for key, per in view.items()},
        "metrics": metrics,
        "decisions": decisions,
        "instances_seen": sorted(instances_seen),
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
