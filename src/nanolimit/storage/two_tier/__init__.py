"""Two-tier limits for fleets: local decisions, reconciled through Redis.

A gateway instance deciding 100,000 requests per second cannot spend a Redis
round trip on each. :class:`TwoTierStorage` decides every request in process,
against this instance's *lease* for the key, and a background thread
reconciles with Redis once per ``sync_interval`` (or sooner when a key runs
out of lease): one pipelined round trip writes what this instance admitted per
key and window, reads the fleet totals back and takes a new lease.

Leases: a Lua script per (key, window) writes this instance's count, then
grants it ``ceil(remaining / N)`` where ``remaining = L - all counts - the
other instances' held leases and claims - the silent members' blind shares``.
Whatever an instance may spend is held in Redis before it spends it: a lease
never exceeds what remains, it shrinks only once the instance has heard of
it (Redis holds the ceiling the instance decides against until its next
sync), and an instance that admitted a key in a window claims its default
share of the next one while it syncs (``L // M`` plus the remainder by rank,
``M`` every member: the shares add up to ``L``). So counts plus held leases
plus claims never pass the limit.

Error bound (``L`` = the limit, ``s_j`` = instance ``j``'s share, ``I`` = sync
interval, ``r_j`` = the rate instance ``j`` admits a key at)::

    admitted per key and window  <=  L + sum over the instances that had not claimed it of u_j
    u_j = min(s_j, r_j * I)     (what j admits in the window before its first sync)

An instance had claimed a window when it admitted the key in the window
before: in steady state the fleet admits at most ``L``, under load exactly
``L``; a key's first window on an instance is the one left open. A cut
instance admits what Redis holds for it, and its blind share in windows
that begin after its heartbeat lapsed (a few of its own sync periods),
which the others reserve for it; nothing more in a window begun before.
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
    HEARTBEAT_GAPS,
    MAX_SPREAD,
    MAX_WINDOW_INDEX,
    RECONCILE_CHUNK,
    SETTLE_READS,
    SUPPORTED_ALGORITHMS,
    SYNC_BUDGET,
    SYNC_CHUNK,
)
from ._storage import TwoTierStorage

__all__ = [
    "FULL_SYNC_EVERY",
    "HEARTBEAT_GAPS",
    "MAX_SPREAD",
    "MAX_WINDOW_INDEX",
    "RECONCILE_CHUNK",
    "SETTLE_READS",
    "SUPPORTED_ALGORITHMS",
    "SYNC_BUDGET",
    "SYNC_CHUNK",
    "TwoTierStorage",
]
