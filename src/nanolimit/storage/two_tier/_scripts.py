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
# clock for the fleet): score = when a member's heartbeat expires, in ms
# (ARGV: id, its heartbeat's ttl in ms, partition_grace in ms). A member is
# live until then, then *silent* (partitioned or dead: nobody can tell) for
# ``partition_grace``, then dropped. Returns {live, 1 if this instance was
# not a member, its rank among all members by id, all members, the silent
# members' ranks, every member's id in rank order, their expiries, the
# server's clock (ms)}: after our first sync, a
# missing member means the server restarted or was flushed (or we were
# silent past the grace), and our counts may be gone with it. A blind
# instance admits its share, L // all plus one of the remainder's units by
# rank; the others reserve that same share for each silent member, so a
# partition of some instances keeps the fleet within L. Sent with EVAL (it
# is short).
HEARTBEAT: Final = _read("heartbeat")

# Per (key, window), atomically, for each of the first n KEYS (ARGV: id, N,
# one binary string of eleven little-endian doubles per key, then "members
# rank expiry rank expiry ..." and the ids of the members whose blind shares
# are reserved once the server's clock is past their heartbeat's expiry (ms;
# 0: at once), judged in the script, so a member the caller's last heartbeat
# saw live is reserved from the moment it lapses, not one sync later;
# the fields: count, limit, weighted previous window, expiry ms (positive:
# set when the hash is made; negative: refreshed on every call), current?,
# wanted cost, the position of the same key's previous window among KEYS (0:
# not sent) and its weight, the ceiling in use (the most our count may reach
# before the reply lands), the position among KEYS of the next window's hash
# to claim our default share in (0: no claim) and that share — one argument,
# not 11 per key, read by struct.unpack in C: parsing words with gmatch and
# tonumber was a third of the script's time, and an expiry written on every
# call another tenth):
# write this instance's absolute count, sum every instance's count and every
# *other* instance's lease field (units it may still admit before its next
# sync: a lease, held, or a claim), and grant this instance a lease of
# ceil(remaining / N), or of the wanted cost when that is larger (a request
# above ceil(L / N) would otherwise be refused forever), with what remains
# leaving out the reserved members' blind shares where they have no field.
# The lease never exceeds what remains; Redis holds max(lease, ceiling in
# use - count) for us until our next sync. Then the claim, unless we count
# in the next window already. Returns count, lease, claimed?, count, ...
RECONCILE: Final = LuaScript(_read("reconcile"))
