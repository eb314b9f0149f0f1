"""Two-tier limits for fleets: local decisions, reconciled through Redis.

A gateway instance deciding 100,000 requests per second cannot spend a Redis
round trip on each. :class:`TwoTierStorage` decides every request in process,
against this instance's *lease* for the key, and a background thread
reconciles with Redis once per ``sync_interval`` (or sooner when a key runs
out of lease): one pipelined round trip writes what this instance admitted per
key and window, reads the fleet totals back and takes a new lease.

Leases: a Lua script per (key, window) writes this instance's count, then
grants it ``ceil(remaining / N)`` where ``remaining = L - all counts - the
other instances' leases``. A lease never exceeds what remains, so the counts
plus the leases of the instances that have synced in a window never pass the
limit. Before its first sync of a window, an instance spends a default share
``ceil(L / N)`` that nobody else has seen yet: that is the only overshoot.

Error bound (``L`` = the limit, ``N`` = live instances, ``I`` = sync interval,
``r_j`` = the rate instance ``j`` admits a key at)::

    admitted per key and window  <=  L + sum over all but the first instance to sync of u_j
    u_j = min(ceil(L / N), r_j * I)     (what j admits in the window before its first sync)
    so the over-admission is at most (N - 1) * min(ceil(L / N), r * I)

``sync_interval`` is the knob: shorter means fewer units admitted unseen.
See ``docs/two_tier.md``.

The package's modules, by what they hold: ``_records`` (the per-key records
and the shared constants), ``_scripts`` (the Lua, read from ``lua/*.lua`` once
at import), ``_sync`` (the remote tier: heartbeat, reconcile, the replies
applied), ``_storage`` (the local tier: the decision, partition mode, the
lifecycle), and this module: the public names.
"""

from __future__ import annotations

from ._records import (
    FULL_SYNC_EVERY,
    MAX_WINDOW_INDEX,
    RECONCILE_CHUNK,
    SETTLE_READS,
    SUPPORTED_ALGORITHMS,
    SYNC_CHUNK,
)
from ._storage import TwoTierStorage

__all__ = [
    "FULL_SYNC_EVERY",
    "MAX_WINDOW_INDEX",
    "RECONCILE_CHUNK",
    "SETTLE_READS",
    "SUPPORTED_ALGORITHMS",
    "SYNC_CHUNK",
    "TwoTierStorage",
]
