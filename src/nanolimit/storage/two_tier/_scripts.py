"""The two-tier storage's Lua: the heartbeat and the reconcile script.

Why a module of its own: the scripts are the server half of the sync, and
their wire format (what each ARGV word means) is the contract the sync's
packing follows. The Lua lives in ``lua/*.lua`` next to this file, shipped as
package data and read once, at import (``importlib.resources``), as the Redis
storage's scripts are.
"""

from __future__ import annotations

from importlib import resources
from typing import Final

from ..redis import LuaScript

_LUA_DIR: Final = resources.files(__package__).joinpath("lua")


def _read(name: str) -> str:
    # each script's source starts on a new line, as the inline strings did
    return "\n" + _LUA_DIR.joinpath(f"{name}.lua").read_text(encoding="utf-8")


# Register this instance and count the others, by the server's clock (one
# clock for the fleet): score = when a member's heartbeat expires, in ms. A
# member is live until then, then *silent* (partitioned or dead: nobody can
# tell) until ``partition_grace`` after its last heartbeat, then dropped.
# Returns {live, 1 if this instance was not a member, its rank among all
# members by id, all members, the silent members' ranks}: after our first
# sync, a missing member means the server restarted or was flushed (or we
# were silent past the grace), and our counts may be gone with it. A blind
# instance admits its share, L // all plus one of the remainder's units by
# rank; the others reserve that same share for each silent member, so a
# partition of some instances keeps the fleet within L. Sent with EVAL (it
# is short).
HEARTBEAT: Final = _read("heartbeat")

# Per (key, window), atomically, for each KEYS[i] (ARGV: id, N, and one
# string of eight words per key: count, limit, weighted previous window,
# expiry ms, current?, wanted cost, the position of the same key's previous
# window among KEYS (0: not sent) and its weight — one argument, not 8 per
# key, to keep the client's packing cheap):
# write this instance's absolute count, sum every instance's count and every
# *other* instance's lease (units it may still admit before its next sync),
# and grant this instance a lease of ceil(remaining / N), or of the wanted
# cost when that is larger (a request above ceil(L / N) would otherwise be
# refused forever). The lease never exceeds what remains, so the counts plus
# the leases of instances that have synced never pass the limit. What
# remains leaves out the silent members' blind shares (ARGV[4]: all members,
# then each silent member's rank; see HEARTBEAT). Returns count, lease,
# count, lease, ...
RECONCILE: Final = LuaScript(_read("reconcile"))
