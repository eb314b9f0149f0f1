"""The Lua scripts: their text, their SHA1s, and how their replies are read.

Why a private module: the scripts are the server half of every decision
(docs/redis.md, "Scripts"); the storages only send them. The Lua lives in
``lua/*.lua`` next to this file, shipped as package data and read once, at
import (``importlib.resources``), so the Lua reads and diffs as Lua (the
prelude's ``@NAME@`` placeholders take the limits from ``_clocks`` and ``_validation``, the mains'
``@ALGORITHM@`` their kernel's name); each file is one fragment of the inline strings the scripts were built
from before, byte for byte (the SHAs are pinned in tests/test_redis_scripts.py).
"""

from __future__ import annotations

import hashlib
from importlib import resources
from typing import Any, Final

from ..._clocks import MAX_CLOCK_LEAD, MAX_TIME
from ..._decision_py import KernelVerdict
from ..._limiter_config import Algorithm, LimiterConfig
from ..._validation import MAX_LIMIT

# Lua. One prelude, one function per kernel; a single-decision script is the
# prelude, its kernel and a three-line main; the compound script holds them all.
#
# What a decision costs the server (Redis 7.0 on 2 vCPUs): each ``redis.call``
# 0.25-1 µs, and every ``%.17g`` 0.2-0.35 µs, in ``string.format`` and inside
# Redis 7.0 alike (it formats each Lua number argument of a command that
# way). So the scripts format no value known to be 0, format a value once when
# it is both stored and answered, write only the hash fields that changed,
# and define no function a script does not call (each is a new closure on
# every call).
#
# Every value read from the key is checked before it is used (docs/redis.md,
# "Foreign values"): a field that does not parse as a number, lies outside the
# range the kernels themselves produce (levels and counts 0..MAX_LIMIT, whole
# counts and window indices, stamps within ±MAX_TIME, a sliding-log stamp at
# most MAX_CLOCK_LEAD past its key's own time), or is missing, and a hash
# without the limiter's fields, raise ``BADSTATE``: that key alone is answered
# by its policy and nothing is written to it. A value of another type raises
# the server's own ``WRONGTYPE`` at the first read.
#
# The clock-lead rule (docs/spec.md §4, ``reference._decide``): a key whose stamp
# ``u`` is more than MAX_CLOCK_LEAD ahead of the clock is moved back by the
# lead with its debt kept (levels unchanged; GCRA's TAT and the window
# indices by the same whole microseconds / windows; sliding-log stamps by the
# lead), ``u`` becomes the clock; within the bound the key's time stands
# still and every positive duration answered gets ``now - clock`` added, so a
# Retry-After is true against the real clock (the expiry too).

_MAX_STAMP: Final = repr(MAX_TIME)  # |u| and |stamp| stay below it (GCRA's µs below 2**53)

_LUA_DIR: Final = resources.files(__package__).joinpath("lua")


def _fragment(name: str, **values: str) -> str:
    """``lua/<name>.lua`` with its ``@NAME@`` placeholders filled in. A
    fragment starts on a new line of the script it joins (the files hold it
    from its first line on, so each begins with a newline here)."""
    text = _LUA_DIR.joinpath(f"{name}.lua").read_text(encoding="utf-8")
    for placeholder, value in values.items():
        text = text.replace(f"@{placeholder}@", value)
    if "@" in text:  # pragma: no cover - a placeholder left unfilled (no Lua here uses "@")
        raise RuntimeError(f"lua/{name}.lua: a placeholder is not filled in")
    return "\n" + text


# The constants the kernels share with the in-memory twins, from _clocks and _validation.
_PRELUDE: Final = _fragment(
    "prelude", MAX_LEAD=repr(MAX_CLOCK_LEAD), MAX_STAMP=_MAX_STAMP, MAX_COUNT=str(MAX_LIMIT)
)


# Each kernel: (key, clock, cost, commit, floor_ms, p1, p2) -> allowed (bool),
# and the reply string "allowed remaining retry_after reset_after delay at"
# (``at``: the key's time it decided at, the ``now`` a sliding log stamps).
# Its stored state is read and checked by ``lua/<algorithm>_state.lua``
# (the two buckets share ``bucket_state.lua``), which the refunds share.
# Each branch has its own format: a value known to be 0 there is a literal '0'
# (what '%.17g' prints for it), every other one '%.17g'. ('%d' would be cheaper
# still for whole numbers, but Lua 5.1 casts it to a C long: 32 bits on a
# 32-bit server build.)
# The order is the algorithm ids of the compound script (its ``kernels`` table).
def _state_lua(algo: Algorithm) -> str:
    """The fragment that reads and checks ``algo``'s stored state."""
    if algo in (Algorithm.TOKEN_BUCKET, Algorithm.LEAKY_BUCKET):
        return _fragment("bucket_state", ALGORITHM=algo.value)
    return _fragment(f"{algo.value}_state")


_KERNEL_LUA: Final[dict[Algorithm, str]] = {
    algo: _state_lua(algo) + _fragment(algo.value)
    for algo in (
        Algorithm.TOKEN_BUCKET,
        Algorithm.LEAKY_BUCKET,
        Algorithm.FIXED_WINDOW,
        Algorithm.SLIDING_COUNTER,
        Algorithm.GCRA,
        Algorithm.SLIDING_LOG,
    )
}

_ALGO_IDS: Final = {algo: i for i, algo in enumerate(_KERNEL_LUA)}

# KEYS[1]; ARGV: now ('' = server TIME), cost, commit, floor_ms, p1, p2.
# A kernel's error (WRONGTYPE, BADSTATE, OOM) is the script's error reply.
# lua/single_main.lua, its kernel named by @ALGORITHM@.

# Scripts that decide several keys catch each key's error, so one bad key
# never fails the others: its answer is "E <the error reply>" in its place.
_ERROR_TEXT: Final = _fragment("error_text")

# KEYS[1..n]; ARGV: n, then per item: algorithm id, now, cost, floor_ms, p1, p2,
# and '1' when the item's failure policy allows. Dry run every item; commit
# (and answer the committed verdicts) only if all allow. An item whose key
# errs counts as its policy says (allow: allowed, else denied), is never
# written, and is answered by its error.
_COMPOUND_MAIN: Final = _fragment("compound_main")


class LuaScript:
    """A script's source and its SHA1, computed locally (no round trip)."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()


# A batch on one node (one slot on a cluster): KEYS[1..n]; ARGV: now, floor_ms,
# p1, p2, cost_1 .. cost_n. One clock reading for the whole batch, as in memory.
# lua/batch_main.lua, its kernel named by @ALGORITHM@.

SCRIPTS: Final[dict[Algorithm, LuaScript]] = {
    algo: LuaScript(_PRELUDE + lua + _fragment("single_main", ALGORITHM=algo.value))
    for algo, lua in _KERNEL_LUA.items()
}
BATCH_SCRIPTS: Final[dict[Algorithm, LuaScript]] = {
    algo: LuaScript(_PRELUDE + lua + _ERROR_TEXT + _fragment("batch_main", ALGORITHM=algo.value))
    for algo, lua in _KERNEL_LUA.items()
}
# Keys per batch script: bounds how long one script holds the server (~10 µs a key).
BATCH_CHUNK: Final = 200
COMPOUND_SCRIPT: Final = LuaScript(_PRELUDE + "".join(_KERNEL_LUA.values()) + _ERROR_TEXT + _COMPOUND_MAIN)

# A refund (docs/redis.md, "Refunds"): KEYS[1]; ARGV: now ('' = server TIME),
# at ('' = the key's own u), cost, floor_ms, p1, p2. Reads the state as a
# decision does (``<algorithm>_state.lua``), gives back, stamps u = now and
# sets the expiry a decision would; a key that does not exist is left
# unmade (the reply is 0, else 1).
REFUND_SCRIPTS: Final[dict[Algorithm, LuaScript]] = {
    algo: LuaScript(
        _PRELUDE
        + _state_lua(algo)
        + _fragment(f"{algo.value}_refund")
        + _fragment("refund_main", ALGORITHM=algo.value)
    )
    for algo in _KERNEL_LUA
}

# Real milliseconds an injected-clock key lives at least (docs/redis.md).
INJECTED_EXPIRY_FLOOR_MS: Final = 3_600_000


def _params(cfg: LimiterConfig) -> tuple[str, str]:
    """The two constants a kernel needs, as exact strings."""
    algo = cfg.algorithm
    if algo is Algorithm.GCRA:
        return str(cfg.gcra_interval_us), str(cfg.gcra_tolerance_us)
    if algo in (Algorithm.TOKEN_BUCKET, Algorithm.LEAKY_BUCKET):
        return str(cfg.capacity), repr(cfg.rate)
    return str(cfg.capacity), repr(cfg.window_seconds)


def _parse_verdict(reply: Any) -> KernelVerdict:
    """A script's reply: one string, ``"allowed remaining retry reset delay
    at"`` (one ``string.format`` in Lua is cheaper than six, and a Lua number
    would be truncated to an integer on the way out), as the 8-element
    verdict whose last element is the decision's time (``Decision.at``, what
    a refund names). A multi-key script's ``"E <error reply>"`` for one key
    raises ``ValueError`` here (see :meth:`_RedisBase._part_error`)."""
    allowed, remaining, retry_after, reset_after, delay, at = reply.split()
    return (
        allowed == b"1" or allowed == "1",
        float(remaining),
        float(retry_after),
        float(reset_after),
        float(delay),
        False,
        "",
        float(at),
    )
