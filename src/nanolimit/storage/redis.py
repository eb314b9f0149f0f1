"""Redis (and Valkey) storage: the SPEC §4 kernels as Lua scripts, one atomic
``EVALSHA`` per decision, shared by every gateway instance.

Why a script: read, decide and write must be one atomic step per key (SPEC §5).
A script runs next to the data, alone on the server, so two gateway processes
deciding the same key can never both spend its last unit. Each of the six
scripts is the reference kernel (``nanolimit.reference``) transcribed line by
line: the same IEEE-double operations in the same order, so a decision on
Redis equals a decision in memory (the equivalence tests hold them to it).

Wire conventions (see docs/redis.md): floats go in as ``repr(float)`` strings and
come back as ``%.17g`` strings, because a Lua number in a reply is truncated
to an integer; numbers are stored as Lua numbers, which Redis and Valkey write
with 17 significant digits and read back exactly (the token bucket's level,
which is in the reply too, is stored as the script's own ``%.17g`` string:
the same bytes Redis 7.0 writes for the number, the same value everywhere).

State per key, only what its algorithm needs:

==================  ==============================================
token/leaky bucket  hash ``l`` (level), ``u`` (the key's own time)
fixed window        hash ``k`` (window index), ``n`` (count), ``u``
sliding counter     hash ``k``, ``n``, ``p`` (previous), ``u``
GCRA                string ``"<tat µs> <u>"``
sliding log         list: ``u`` at index 0, then the timestamps,
                    oldest first (capped at the capacity)
==================  ==============================================

``u`` (updated_at) is kept because SPEC §4 says per-key time never runs
backwards: ``now = max(clock, u)``. Without it a clock stepping back would
judge a key differently than the in-memory store does.

Every write sets ``PEXPIRE`` to the time until the state is back to "never
seen" (``reset_after``), rounded up to whole milliseconds plus 1 ms of slack,
never below 1 ms — so idle keys disappear on their own and ``evict_idle`` has
nothing to do. With an injected clock (tests, replays) the expiry has a floor
of an hour of real time, so a slow fake clock never meets a real expiry.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import importlib
import inspect
import math
import os
import select
import sys
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, ClassVar, Final, Literal

from .._shared import (
    DUPLICATE_COMPOUND,
    MAX_CLOCK_LEAD,
    MAX_KEY_BYTES,
    MAX_LIMIT,
    MAX_TIME,
    REASON_STORE_UNAVAILABLE,
    Algorithm,
    CompoundDecision,
    KernelVerdict,
    LimiterConfig,
    LimiterState,
    SystemClock,
    ValidationError,
    check_batch,
    check_cost,
    check_cutoff,
    check_key,
    check_now,
    compound_items,
    decision_from_verdict,
    event_counter,
)

__all__ = [
    "MAX_CLOCK_LEAD",
    "AsyncRedisStorage",
    "CircuitOpenError",
    "RedisKeyError",
    "RedisStorage",
    "RedisUnavailableError",
    "StorageUnavailableError",
]

OnError = Literal["allow", "deny", "raise"]
_POLICIES: Final = ("allow", "deny", "raise")

# --------------------------------------------------------------------------
# Errors


class StorageUnavailableError(RuntimeError):
    """A shared store could not answer a decision (raised only under
    ``on_error="raise"``; the other policies answer a degraded decision)."""


class RedisUnavailableError(StorageUnavailableError):
    """Redis/Valkey failed, timed out, or is behind an open circuit breaker."""


class CircuitOpenError(RedisUnavailableError):
    """The circuit breaker is open: the store was not even asked."""


class RedisKeyError(RedisUnavailableError):
    """The server answered this one call with an error about the key, not
    about itself: a value of another type at the limiter's key (``WRONGTYPE``),
    a stored state the limiter did not write (``BADSTATE``), a write refused
    for memory (``OOM``) or persistence (``MISCONF``), an ACL refusal
    (``NOPERM``), a script error. Raised only under ``on_error="raise"``; it
    never feeds the circuit breaker (``code`` is the reply's error code)."""

    def __init__(self, message: str, code: str) -> None:
        super().__init__(message)
        self.code = code


# Decision.reason when the policy answered one key's error reply (the store is up).
REASON_STORE_ERROR: Final = "store_error"

# --------------------------------------------------------------------------
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
# The clock-lead rule (SPEC §4, ``reference._decide``): a key whose stamp
# ``u`` is more than MAX_CLOCK_LEAD ahead of the clock is moved back by the
# lead with its debt kept (levels unchanged; GCRA's TAT and the window
# indices by the same whole microseconds / windows; sliding-log stamps by the
# lead), ``u`` becomes the clock; within the bound the key's time stands
# still and every positive duration answered gets ``now - clock`` added, so a
# Retry-After is true against the real clock (the expiry too).

_MAX_STAMP: Final = repr(MAX_TIME)  # |u| and |stamp| stay below it (GCRA's µs below 2**53)

_PRELUDE = rf"""
local MAX_LEAD = {MAX_CLOCK_LEAD!r}
local MAX_STAMP = {_MAX_STAMP}
local MAX_COUNT = {MAX_LIMIT}
local MAX_EXACT = 9007199254740992
-- TIME's two strings; Lua's arithmetic converts them exactly as tonumber would
local function server_time()
  local t = redis.call('TIME')
  return t[1] + t[2] / 1000000
end
local function expiry_ms(reset_after, floor_ms)
  local ms = math.ceil(reset_after * 1000) + 1
  if ms < floor_ms then ms = floor_ms end
  if ms < 1 then ms = 1 end
  if ms > MAX_EXACT then ms = MAX_EXACT end  -- printed in full by %.17g, and far from PEXPIRE's overflow
  return ms
end
"""

# Each kernel: (key, clock, cost, commit, floor_ms, p1, p2) -> allowed (bool),
# and the reply string "allowed remaining retry_after reset_after delay".
# Each branch has its own format: a value known to be 0 there is a literal '0'
# (what '%.17g' prints for it), every other one '%.17g'. ('%d' would be cheaper
# still for whole numbers, but Lua 5.1 casts it to a C long: 32 bits on a
# 32-bit server build.)
_KERNEL_LUA: Final[dict[Algorithm, str]] = {
    Algorithm.TOKEN_BUCKET: r"""
local function k_token_bucket(key, clock, cost, commit, floor_ms, capacity, rate)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local v = redis.call('HMGET', key, 'l', 'u')
  local level, updated
  if v[1] then
    level = tonumber(v[1]); updated = tonumber(v[2])
    if not (level and updated and level >= 0 and level <= MAX_COUNT
        and updated > -MAX_STAMP and updated < MAX_STAMP) then
      error({err = 'BADSTATE token_bucket: the stored state is not one this limiter writes'})
    end
    if updated - clock > MAX_LEAD then  -- the clock's error: the level (debt) stays
      updated = clock; rebased = true
    end
  elseif v[2] or redis.call('EXISTS', key) == 1 then
    error({err = 'BADSTATE token_bucket: a hash without the limiter fields'})
  else level = capacity; updated = clock end
  local now = clock
  if updated > now then now = updated end
  local elapsed = now - updated
  level = level + elapsed * rate
  if level > capacity then level = capacity end
  local retry = 0.0
  local allowed = level >= cost
  if allowed then level = level - cost else retry = (cost - level) / rate end
  local reset = (capacity - level) / rate
  local extra = now - clock  -- > 0 only while the key's time stands still ahead of the clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
  end
  -- the level goes both into the state and into the reply: format it once
  -- (what Redis 7.0 would store for the number; newer servers read it back exactly)
  local l = string.format('%.17g', level)
  if commit then
    redis.call('HSET', key, 'l', l, 'u', now)
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %s 0 %.17g 0', l, reset), rebased end
  return false, string.format('0 %s %.17g %.17g 0', l, retry, reset), rebased
end
""",
    Algorithm.LEAKY_BUCKET: r"""
local function k_leaky_bucket(key, clock, cost, commit, floor_ms, capacity, rate)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local v = redis.call('HMGET', key, 'l', 'u')
  local level, updated
  if v[1] then
    level = tonumber(v[1]); updated = tonumber(v[2])
    if not (level and updated and level >= 0 and level <= MAX_COUNT
        and updated > -MAX_STAMP and updated < MAX_STAMP) then
      error({err = 'BADSTATE leaky_bucket: the stored state is not one this limiter writes'})
    end
    if updated - clock > MAX_LEAD then  -- the clock's error: the level (debt) stays
      updated = clock; rebased = true
    end
  elseif v[2] or redis.call('EXISTS', key) == 1 then
    error({err = 'BADSTATE leaky_bucket: a hash without the limiter fields'})
  else level = 0.0; updated = clock end
  local now = clock
  if updated > now then now = updated end
  local elapsed = now - updated
  level = level - elapsed * rate
  if level < 0.0 then level = 0.0 end
  local room = capacity - level
  local delay = 0.0
  local retry = 0.0
  local remaining
  local allowed = cost <= room
  if allowed then
    delay = level / rate
    level = level + cost
    remaining = capacity - level
  else
    remaining = room
    retry = (cost - room) / rate
  end
  local reset = level / rate
  local extra = now - clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
    if delay > 0 then delay = delay + extra end
  end
  if commit then
    redis.call('HSET', key, 'l', level, 'u', now)
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g %.17g', remaining, reset, delay), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0', remaining, retry, reset), rebased
end
""",
    Algorithm.FIXED_WINDOW: r"""
local function k_fixed_window(key, clock, cost, commit, floor_ms, capacity, window)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local v = redis.call('HMGET', key, 'k', 'n', 'u')
  local k, count, updated
  local moved = not v[1]  -- k must be written: a new key, or (below) a new window
  if v[1] then
    k = tonumber(v[1]); count = tonumber(v[2]); updated = tonumber(v[3])
    if not (k and count and updated and k % 1 == 0 and k > -MAX_EXACT and k < MAX_EXACT
        and count >= 0 and count <= MAX_COUNT and count % 1 == 0
        and updated > -MAX_STAMP and updated < MAX_STAMP) then
      error({err = 'BADSTATE fixed_window: the stored state is not one this limiter writes'})
    end
    if updated - clock > MAX_LEAD then  -- the clock's error: back by as many windows, count kept
      rebased = true
      k = k - (math.floor(updated / window) - math.floor(clock / window))
      updated = clock
      moved = true
    end
  elseif v[2] or v[3] or redis.call('EXISTS', key) == 1 then
    error({err = 'BADSTATE fixed_window: a hash without the limiter fields'})
  else k = math.floor(clock / window); count = 0; updated = clock end
  local now = clock
  if updated > now then now = updated end
  local index = math.floor(now / window)
  if index ~= k then k = index; count = 0; moved = true end
  local start = k * window
  local retry = 0.0
  local allowed = count + cost <= capacity
  if allowed then count = count + cost else retry = start + window - now end
  local reset = 0.0
  if count > 0 then reset = start + window - now end
  local extra = now - clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
  end
  if commit then
    -- only the fields that changed: the others hold these very values already
    if moved then redis.call('HSET', key, 'k', k, 'n', count, 'u', now)
    elseif allowed then redis.call('HSET', key, 'n', count, 'u', now)
    else redis.call('HSET', key, 'u', now) end
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0', capacity - count, reset), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0', capacity - count, retry, reset), rebased
end
""",
    Algorithm.SLIDING_COUNTER: r"""
local function k_sliding_counter(key, clock, cost, commit, floor_ms, capacity, window)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local v = redis.call('HMGET', key, 'k', 'n', 'p', 'u')
  local k, count, previous, updated
  local moved = not v[1]  -- k and p must be written: a new key, or (below) a new window
  if v[1] then
    k = tonumber(v[1]); count = tonumber(v[2]); previous = tonumber(v[3]); updated = tonumber(v[4])
    if not (k and count and previous and updated and k % 1 == 0 and k > -MAX_EXACT and k < MAX_EXACT
        and count >= 0 and count <= MAX_COUNT and count % 1 == 0
        and previous >= 0 and previous <= MAX_COUNT and previous % 1 == 0
        and updated > -MAX_STAMP and updated < MAX_STAMP) then
      error({err = 'BADSTATE sliding_counter: the stored state is not one this limiter writes'})
    end
    if updated - clock > MAX_LEAD then  -- the clock's error: back by as many windows, counts kept
      rebased = true
      k = k - (math.floor(updated / window) - math.floor(clock / window))
      updated = clock
      moved = true
    end
  elseif v[2] or v[3] or v[4] or redis.call('EXISTS', key) == 1 then
    error({err = 'BADSTATE sliding_counter: a hash without the limiter fields'})
  else k = math.floor(clock / window); count = 0; previous = 0; updated = clock end
  local now = clock
  if updated > now then now = updated end
  local index = math.floor(now / window)
  if index ~= k then
    if index == k + 1 then previous = count else previous = 0 end
    count = 0
    k = index
    moved = true
  end
  local start = k * window
  local weight = 1.0 - (now - start) / window
  local estimate = previous * weight + count
  local retry = 0.0
  local remaining
  local allowed = estimate + cost <= capacity
  if allowed then
    count = count + cost
    remaining = capacity - estimate - cost
  else
    remaining = capacity - estimate
    local room = capacity - count - cost
    if previous <= 0 or room < 0 then retry = start + window - now
    else retry = start + window * (1.0 - room / previous) - now end
  end
  local reset = 0.0
  if count > 0 then reset = start + 2.0 * window - now
  elseif previous > 0 then reset = start + window - now end
  local extra = now - clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
  end
  if commit then
    -- only the fields that changed: the others hold these very values already
    if moved then redis.call('HSET', key, 'k', k, 'n', count, 'p', previous, 'u', now)
    elseif allowed then redis.call('HSET', key, 'n', count, 'u', now)
    else redis.call('HSET', key, 'u', now) end
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0', remaining, reset), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0', remaining, retry, reset), rebased
end
""",
    Algorithm.GCRA: r"""
local function k_gcra(key, clock, cost, commit, floor_ms, interval, tolerance)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local v = redis.call('GET', key)
  local tat, updated
  if v then
    local sp = string.find(v, ' ', 1, true)
    if sp then tat = tonumber(string.sub(v, 1, sp - 1)); updated = tonumber(string.sub(v, sp + 1)) end
    if not (tat and updated and tat % 1 == 0 and tat > -MAX_EXACT and tat < MAX_EXACT
        and updated > -MAX_STAMP and updated < MAX_STAMP) then
      error({err = 'BADSTATE gcra: the stored state is not one this limiter writes'})
    end
    if updated - clock > MAX_LEAD then  -- the clock's error: back by as many whole µs, backlog kept
      rebased = true
      tat = tat - (math.floor(updated * 1000000.0) - math.floor(clock * 1000000.0))
      updated = clock
    end
  else tat = math.floor(clock * 1000000.0); updated = clock end
  local now = clock
  if updated > now then now = updated end
  local now_us = math.floor(now * 1000000.0)
  local backlog = tat - now_us
  if backlog < 0 then backlog = 0 end
  local need = interval * cost
  local retry = 0.0
  -- integer arithmetic, rearranged only so that no partial sum passes 2^53
  local allowed = need <= tolerance - backlog
  if allowed then
    backlog = backlog + need
    tat = now_us + backlog
  else
    retry = (backlog - tolerance + need) / 1000000.0
  end
  local left = tolerance - backlog
  local remaining = math.floor(left / interval)
  if remaining * interval > left then remaining = remaining - 1 end
  if (remaining + 1) * interval <= left then remaining = remaining + 1 end
  local reset = backlog / 1000000.0
  local extra = now - clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
  end
  if commit then
    redis.call('SET', key, string.format('%.17g %.17g', tat, now), 'PX', expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0', remaining, reset), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0', remaining, retry, reset), rebased
end
""",
    Algorithm.SLIDING_LOG: r"""
-- One stored stamp, checked (a number, within ±MAX_STAMP and at most
-- MAX_LEAD past its key's own stored time), then moved back by the
-- clock-lead rebase's ``shift`` when there is one.
local function log_stamp(raw, limit, shift)
  local s = tonumber(raw)
  if not (s and s > -MAX_STAMP and s <= limit) then
    error({err = 'BADSTATE sliding_log: a stored stamp is not one this limiter writes'})
  end
  if shift then s = s - shift end
  return s
end
local function k_sliding_log(key, clock, cost, commit, floor_ms, capacity, window)
  local total = redis.call('LLEN', key)
  local updated, n
  local limit, shift = 0, nil
  if total == 0 then updated = clock; n = 0
  else
    updated = tonumber(redis.call('LINDEX', key, 0)); n = total - 1
    if not (updated and updated > -MAX_STAMP and updated < MAX_STAMP) then
      error({err = 'BADSTATE sliding_log: the stored state is not one this limiter writes'})
    end
    limit = updated + MAX_LEAD
    if updated - clock > MAX_LEAD then  -- the clock's error: every stamp back by the lead
      shift = updated - clock
      updated = clock
    end
  end
  local now = clock
  if updated > now then now = updated end
  -- entries sit at list indices 1..n; drop those over the capacity, then the expired
  local pos = 1
  if n > capacity then pos = 1 + n - capacity end
  local cutoff = now - window
  -- the common case, nothing expired, costs one LINDEX; else scan in chunks
  local scan = pos <= n and log_stamp(redis.call('LINDEX', key, pos), limit, shift) <= cutoff
  while scan and pos <= n do
    local chunk = redis.call('LRANGE', key, pos, pos + 63)
    local i = 1
    while i <= #chunk and log_stamp(chunk[i], limit, shift) <= cutoff do i = i + 1 end
    pos = pos + i - 1
    if i <= #chunk then break end
  end
  local drop = pos - 1
  local len = n - drop
  local retry = 0.0
  local remaining = 0.0
  local newest = nil
  local allowed = len + cost <= capacity
  if allowed then
    len = len + cost
    remaining = capacity - len
    newest = now
  else
    retry = log_stamp(redis.call('LINDEX', key, pos + len + cost - capacity - 1), limit, shift) + window - now
    if len > 0 then newest = log_stamp(redis.call('LINDEX', key, -1), limit, shift) end
  end
  local reset = 0.0
  if newest then reset = newest + window - now end
  local extra = now - clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
  end
  if commit then
    local stamp = string.format('%.17g', now)
    if total == 0 then redis.call('RPUSH', key, stamp)
    elseif shift then
      -- rebased: the kept entries (list indices pos..n) go to the tail moved
      -- back by the lead, then everything before them is dropped and the new
      -- u goes in front (a write refused for memory fails at the first RPUSH,
      -- before anything changed)
      local at = pos
      while at <= n do
        local last = at + 4095
        if last > n then last = n end
        local chunk = redis.call('LRANGE', key, at, last)
        local moved = {}
        for i = 1, #chunk do moved[i] = string.format('%.17g', log_stamp(chunk[i], limit, shift)) end
        redis.call('RPUSH', key, unpack(moved))
        at = last + 1
      end
      redis.call('LTRIM', key, n + 1, -1)
      redis.call('LPUSH', key, stamp)
    else
      if drop > 0 then redis.call('LTRIM', key, drop, -1) end
      redis.call('LSET', key, 0, stamp)
    end
    if allowed and cost == 1 then redis.call('RPUSH', key, stamp)
    elseif allowed then
      local batch = {}
      local size = cost
      if size > 4096 then size = 4096 end
      for i = 1, size do batch[i] = stamp end
      local left = cost
      while left > 0 do
        if left < size then
          local part = {}
          for i = 1, left do part[i] = stamp end
          batch = part
        end
        redis.call('RPUSH', key, unpack(batch))
        left = left - #batch
      end
    end
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0', remaining, reset), shift ~= nil end
  return false, string.format('0 0 %.17g %.17g 0', retry, reset), shift ~= nil
end
""",
}

_ALGO_IDS: Final = {algo: i for i, algo in enumerate(_KERNEL_LUA)}

# KEYS[1]; ARGV: now ('' = server TIME), cost, commit, floor_ms, p1, p2.
# A kernel's error (WRONGTYPE, BADSTATE, OOM) is the script's error reply.
_SINGLE_MAIN = r"""
local clock
if ARGV[1] == '' then clock = server_time() else clock = tonumber(ARGV[1]) end
local _, verdict = k_%s(KEYS[1], clock, tonumber(ARGV[2]), ARGV[3] == '1',
  tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))
return verdict
"""

# Scripts that decide several keys catch each key's error, so one bad key
# never fails the others: its answer is "E <the error reply>" in its place.
_ERROR_TEXT = r"""
local function error_text(e)
  if type(e) == 'table' then e = e.err end
  return 'E ' .. tostring(e)
end
"""

# KEYS[1..n]; ARGV: n, then per item: algorithm id, now, cost, floor_ms, p1, p2,
# and '1' when the item's failure policy allows. Dry run every item; commit
# (and answer the committed verdicts) only if all allow. An item whose key
# errs counts as its policy says (allow: allowed, else denied), is never
# written, and is answered by its error.
_COMPOUND_MAIN = r"""
local kernels = {[0] = k_token_bucket, k_leaky_bucket, k_fixed_window, k_sliding_counter,
  k_gcra, k_sliding_log}
local n = tonumber(ARGV[1])
local server_now = nil
local clocks = {}
for i = 1, n do
  local arg = ARGV[2 + (i - 1) * 7 + 1]
  if arg == '' then
    if server_now == nil then server_now = server_time() end
    clocks[i] = server_now
  else clocks[i] = tonumber(arg) end
end
local failed = {}
local rebased = {}
local function run(commit)
  local out = {}
  local all = true
  for i = 1, n do
    local b = 2 + (i - 1) * 7
    local ok, a, verdict = true, ARGV[b + 6] == '1', failed[i]
    if not verdict then
      ok, a, verdict, rebased[i] = pcall(kernels[tonumber(ARGV[b])], KEYS[i], clocks[i],
        tonumber(ARGV[b + 2]), commit, tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]))
      if not ok then
        verdict = error_text(a)
        failed[i] = verdict
        a = ARGV[b + 6] == '1'
      end
    end
    if not a then all = false end
    out[i] = verdict
  end
  return all, out
end
local all, out = run(false)
if all then all, out = run(true)
else
  -- Denied: nothing is charged, but a key the clock-lead rule moved back is
  -- stored moved (decided at cost 0, which charges nothing); else every
  -- compound would move it back again from the clock's new time, and it
  -- would never refill (reference.InMemoryStorage.allow_all alike).
  for i = 1, n do
    if rebased[i] and not failed[i] then
      local b = 2 + (i - 1) * 7
      pcall(kernels[tonumber(ARGV[b])], KEYS[i], clocks[i], 0, true,
        tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]))
    end
  end
end
return out
"""


class _Script:
    """A script's source and its SHA1, computed locally (no round trip)."""

    __slots__ = ("sha", "source")

    def __init__(self, source: str) -> None:
        self.source = source
        self.sha = hashlib.sha1(source.encode("utf-8")).hexdigest()


# A batch on one node (one slot on a cluster): KEYS[1..n]; ARGV: now, floor_ms,
# p1, p2, cost_1 .. cost_n. One clock reading for the whole batch, as in memory.
_BATCH_MAIN = r"""
local clock
if ARGV[1] == '' then clock = server_time() else clock = tonumber(ARGV[1]) end
local floor_ms, p1, p2 = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {}
for i = 1, #KEYS do
  local ok, e, verdict = pcall(k_%s, KEYS[i], clock, tonumber(ARGV[4 + i]), true, floor_ms, p1, p2)
  if ok then out[i] = verdict else out[i] = error_text(e) end
end
return out
"""

SCRIPTS: Final[dict[Algorithm, _Script]] = {
    algo: _Script(_PRELUDE + lua + _SINGLE_MAIN % algo.value) for algo, lua in _KERNEL_LUA.items()
}
BATCH_SCRIPTS: Final[dict[Algorithm, _Script]] = {
    algo: _Script(_PRELUDE + lua + _ERROR_TEXT + _BATCH_MAIN % algo.value)
    for algo, lua in _KERNEL_LUA.items()
}
# Keys per batch script: bounds how long one script holds the server (~10 µs a key).
BATCH_CHUNK: Final = 200
COMPOUND_SCRIPT: Final = _Script(_PRELUDE + "".join(_KERNEL_LUA.values()) + _ERROR_TEXT + _COMPOUND_MAIN)

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
    """A script's reply: one string, ``"allowed remaining retry reset delay"``
    (one ``string.format`` in Lua is cheaper than five, and a Lua number
    would be truncated to an integer on the way out). A multi-key script's
    ``"E <error reply>"`` for one key raises ``ValueError`` here (see
    :meth:`_RedisBase._part_verdict`)."""
    allowed, remaining, retry_after, reset_after, delay = reply.split()
    return (
        allowed == b"1" or allowed == "1",
        float(remaining),
        float(retry_after),
        float(reset_after),
        float(delay),
        False,
    )


# --------------------------------------------------------------------------
# Error replies: which say the server cannot answer now (they feed the circuit
# breaker) and which are about one call's key (answered by that key's policy).
# Classified by the reply's error code, its first word; never by its text.

# The server, or its role in a cluster, is not able to serve anyone right now.
SERVER_ERROR_CODES: Final = frozenset(
    {
        "LOADING",  # loading its dataset after a restart
        "BUSY",  # another script is running past the busy threshold
        "MASTERDOWN",  # a replica that lost its primary
        "READONLY",  # a replica (a failover moved the primary)
        "CLUSTERDOWN",
        "TRYAGAIN",  # slot migration in progress
        "MOVED",
        "ASK",
        "NOREPLICAS",
        "NOAUTH",
        "WRONGPASS",
    }
)
# Writes refused server-wide (memory full under noeviction, persistence
# failing): answered per call, not by the breaker, counted in ``write_refused``.
WRITE_REFUSED_CODES: Final = frozenset({"OOM", "MISCONF"})

# Codes redis-py/valkey-py strip from the message when they pick a class.
_CLASS_CODES: Final = {
    "NoScriptError": "NOSCRIPT",
    "OutOfMemoryError": "OOM",
    "ReadOnlyError": "READONLY",
    "ExecAbortError": "EXECABORT",
    "NoPermissionError": "NOPERM",
    "AskError": "ASK",
    "MovedError": "MOVED",
    "TryAgainError": "TRYAGAIN",
    "ClusterDownError": "CLUSTERDOWN",
    "MasterDownError": "MASTERDOWN",
    "ClusterCrossSlotError": "CROSSSLOT",
    "BusyLoadingError": "LOADING",
    "AuthenticationError": "NOAUTH",
}


def _code_of_text(text: str) -> str:
    """The error code that starts an error reply's text (``"ERR"`` when the
    text starts with none: redis-py strips ``ERR``)."""
    word = text.split(" ", 1)[0]
    if word.isascii() and word.isupper() and word.replace("_", "").isalpha():
        return word
    return "ERR"


def error_code(exc: BaseException) -> str:
    """The error code of a server's error reply (``WRONGTYPE``, ``OOM``,
    ``BADSTATE``, ...): redis-py 8's ``status_code``, else the class the
    client picked for it, else the first word of the reply."""
    code = getattr(exc, "status_code", None)
    if isinstance(code, str) and code:
        return code
    found = _CLASS_CODES.get(type(exc).__name__)
    if found is not None:
        return found
    return _code_of_text(str(exc.args[0]) if exc.args else "")


def _is_noscript(exc: BaseException) -> bool:
    """redis-py and valkey-py raise ``NoScriptError`` (the ``NOSCRIPT`` prefix
    stripped); other clients may hand back the raw reply."""
    return type(exc).__name__ == "NoScriptError" or error_code(exc) == "NOSCRIPT"


# --------------------------------------------------------------------------
# Client plumbing


def _client_package(client: Any) -> Any:
    """``redis`` or ``valkey`` (or any redis-py fork): the client's top package."""
    return importlib.import_module(type(client).__module__.split(".")[0])


def is_cluster_client(client: Any) -> bool:
    """A RedisCluster-like client (duck typed: it has a nodes manager)."""
    return hasattr(client, "nodes_manager") and hasattr(client, "get_nodes")


def is_asyncio_client(client: Any) -> bool:
    """A ``redis.asyncio`` (or ``valkey.asyncio``) client: its commands are coroutines."""
    return inspect.iscoroutinefunction(getattr(client, "execute_command", None))


def derive_client(client: Any, timeout: float) -> Any:
    """A client with the caller's connection settings but a short socket
    timeout and **no retries**: a retried script can charge twice, and
    redis-py's defaults (seconds of timeout, several retries) blocked a caller
    for over 25 s on a frozen server. The caller's own client is left as it is.
    Works for the synchronous and the ``asyncio`` clients alike (each has its
    own ``Retry`` class, next to its client module).
    """
    pkg = _client_package(client)
    home = type(client).__module__.rsplit(".", 1)[0]  # "redis" or "redis.asyncio"
    retry_mod = importlib.import_module(home + ".retry")
    backoff_mod = importlib.import_module(pkg.__name__ + ".backoff")

    def no_retry() -> Any:
        return retry_mod.Retry(backoff_mod.NoBackoff(), 0)

    overrides = {
        "socket_timeout": timeout,
        "socket_connect_timeout": timeout,
        "retry_on_timeout": False,
        "retry_on_error": [],
    }
    if is_cluster_client(client):
        kwargs = dict(client.nodes_manager.connection_kwargs)
        for name in ("host", "port", "retry", "connection_pool", "connection_class"):
            kwargs.pop(name, None)
        kwargs.update(overrides)
        kwargs.pop("retry_on_timeout", None)
        kwargs.pop("retry_on_error", None)
        params = inspect.signature(type(client).__init__).parameters
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            # the asyncio cluster keeps internal settings there that its constructor refuses
            kwargs = {name: value for name, value in kwargs.items() if name in params}
        node_type = importlib.import_module(home + ".cluster").ClusterNode
        # an asyncio cluster not used yet knows only its startup nodes
        known = client.get_nodes() or list(client.nodes_manager.startup_nodes.values())
        nodes = [node_type(n.host, n.port) for n in known]
        return type(client)(startup_nodes=nodes, retry=no_retry(), **kwargs)
    pool = client.connection_pool
    kwargs = dict(pool.connection_kwargs)
    kwargs.update(overrides)
    kwargs["retry"] = no_retry()
    extra: dict[str, Any] = {}
    if isinstance(getattr(pool, "timeout", None), (int, float)):
        # a BlockingConnectionPool: waiting for a free connection is bounded too
        extra["timeout"] = min(pool.timeout, timeout)
    new_pool = type(pool)(
        connection_class=pool.connection_class, max_connections=pool.max_connections, **kwargs, **extra
    )
    derived = type(client)(connection_pool=new_pool)
    derived.auto_close_connection_pool = True  # our pool: ``close()``/``aclose()`` disconnects it
    return derived


# --------------------------------------------------------------------------
# Circuit breaker


class _Breaker:
    """Closed → (``threshold`` consecutive failures) → open for ``cooldown``
    seconds, answering by policy without a round trip → half-open: one caller
    probes; success closes it, failure opens it again. Stops a dead server
    from costing every request a full timeout."""

    __slots__ = ("_failures", "_lock", "_open_until", "_probing", "cooldown", "opened", "threshold")

    def __init__(self, threshold: int, cooldown: float) -> None:
        self.threshold = threshold
        self.cooldown = cooldown
        self._failures = 0
        self._open_until = 0.0
        self._probing = False
        self._lock = threading.Lock()
        self.opened = 0

    def allow_call(self) -> bool:
        if self._failures < self.threshold:
            return True
        with self._lock:
            if self._failures < self.threshold:
                return True
            now = time.monotonic()
            if now < self._open_until:
                return False
            # Half-open: this caller is the probe. A probe that never reports
            # (cancelled, interrupted, failed on its own input) must not keep
            # the breaker half-open for good: after another cooldown the next
            # caller probes instead.
            self._probing = True
            self._open_until = now + self.cooldown
            return True

    def success(self) -> None:
        if self._failures or self._probing:
            with self._lock:
                self._failures = 0
                self._probing = False

    def failure(self) -> None:
        with self._lock:
            self._failures += 1
            self._probing = False
            if self._failures >= self.threshold:
                if self._failures == self.threshold:
                    self.opened += 1
                self._open_until = time.monotonic() + self.cooldown

    @property
    def state(self) -> str:
        if self._failures < self.threshold:
            return "closed"
        return "half-open" if time.monotonic() >= self._open_until else "open"


# --------------------------------------------------------------------------
# Near-cache


class _NearCache:
    """Local memory of recent denials:
    ``(rule, key) -> (until, cost, retry_at, reset_at)``.

    A request of at least the denied cost before ``until`` is denied without a
    round trip (a smaller cost might pass sooner, so it goes to the store).
    Bounded in size (LRU) and in lifetime (``max_ttl``) so a stale entry can
    only ever shorten, never extend, the wrong answer window. The answer's
    ``retry_after`` counts down from the store's own, not from ``until``:
    the cache's lifetime is ours, the wait is the client's.
    """

    __slots__ = ("_entries", "_lock", "max_entries", "max_ttl")

    def __init__(self, max_entries: int, max_ttl: float) -> None:
        self.max_entries = max_entries
        self.max_ttl = max_ttl
        self._entries: OrderedDict[Any, tuple[float, int, float, float]] = OrderedDict()
        self._lock = threading.Lock()

    def lookup(self, ident: Any, cost: int, now: float) -> tuple[float, float] | None:
        entry = self._entries.get(ident)
        if entry is None:
            return None
        until, min_cost, retry_at, reset_at = entry
        if now >= until:
            with self._lock:
                if self._entries.get(ident) is entry:
                    del self._entries[ident]
            return None
        if cost < min_cost:
            return None
        return retry_at - now, max(0.0, reset_at - now)

    def remember(self, ident: Any, cost: int, now: float, retry_after: float, reset_after: float) -> None:
        ttl = min(retry_after, self.max_ttl)
        if ttl <= 0.0:
            return
        with self._lock:
            self._entries[ident] = (now + ttl, cost, now + retry_after, now + reset_after)
            self._entries.move_to_end(ident)
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)

    def forget(self, ident: Any) -> None:
        with self._lock:
            self._entries.pop(ident, None)

    def __len__(self) -> int:
        return len(self._entries)


# --------------------------------------------------------------------------
# The storages: what the synchronous and the asyncio one share, then each one's I/O


def _digest(text: str, salt: bytes) -> str:
    return "#" + hashlib.blake2b(text.encode("utf-8"), digest_size=16, key=salt).hexdigest()


_UNPROBED: Final = object()
_hiredis_pack: Any
try:
    from hiredis import pack_command as _hiredis_pack  # the ``redis`` extra installs it
except ImportError:  # pragma: no cover - the connection packs
    _hiredis_pack = None


def _refused_connect(exc: BaseException, connection_error: tuple[type[BaseException], ...]) -> BaseException:
    """The server answered a connect's own commands (``SELECT``, ``AUTH``,
    ``HELLO``, ``CLIENT SETINFO``) with an error reply: the connection
    failed, whatever the reply's code, so it goes on as the client's
    ``ConnectionError`` and is never taken for one key's error."""
    if not connection_error:
        return exc
    failure = connection_error[0](f"the server refused the connection: {type(exc).__name__}: {exc}")
    failure.__cause__ = exc
    return failure


class _SpareConnections:
    """Connections a storage keeps out of its derived client's pool between
    calls.

    Taking a connection from a redis-py pool and giving it back costs more
    than the server spends on a decision (about 15 µs here for the
    synchronous pool: two lock holds, observability hooks, a release event,
    and a ``poll`` through two socket-mode switches; 7 µs for the asyncio
    one). A connection whose reply was read in full has nothing of its own
    waiting, so up to ``keep`` of them wait in a list (``pop`` and
    ``append`` are atomic: any thread takes any of them).

    Before reuse a cheap check shows the server has not closed it (one
    ``poll``, 0.6 µs; the asyncio stream's own state): one that fails it is
    disconnected and goes back through the pool, which connects it again
    (redis-py 8's pools skip their own check when maintenance notifications
    are on). What redis-py does on release (a refreshed credential's
    re-authentication, a reconnect after a maintenance notice) still
    happens: a connection that wants either, that sat idle over
    ``IDLE_CHECK`` seconds, or that has been kept over ``MAX_KEPT`` seconds
    in all goes back through the pool. After an error a connection is
    disconnected and goes back (an error reply from the server leaves it
    intact and kept); a forked child forgets its parent's. Commands are
    packed by hiredis directly where that writes the connection's own bytes
    (redis-py's packing wraps the same call in 2.2 µs of argument handling;
    the asyncio client packs in Python, 6 µs).

    Only the derived client's pool keeps connections: it is the storage's
    own, so nothing else waits for one (``close()`` disconnects it whole).
    """

    IDLE_CHECK: ClassVar[float] = 0.5
    MAX_KEPT: ClassVar[float] = 1.0
    _live: ClassVar[weakref.WeakSet[_SpareConnections]] = weakref.WeakSet()

    __slots__ = (
        "__weakref__",
        "_broken",
        "_conn_args",
        "_connect_error",
        "_idle",
        "_keep",
        "_pack",
        "_pid",
        "_pool",
        "_reply_error",
    )

    def __init__(self, pool: Any, conn_args: tuple[str, ...], keep: int, exceptions: Any) -> None:
        self._pool = pool
        self._conn_args = conn_args
        self._keep = keep
        self._pid = os.getpid()

        def error_class(*names: str) -> tuple[type[BaseException], ...]:
            for name in names:
                found = getattr(exceptions, name, None)
                if isinstance(found, type) and issubclass(found, Exception):
                    return (found,)
            return ()

        # the server's error reply (the connection is intact), and what a broken one raises
        self._reply_error = error_class("ResponseError")
        self._connect_error = error_class("ConnectionError")
        self._broken: tuple[type[BaseException], ...] = (OSError, *error_class("RedisError", "ValkeyError"))
        # (connection, what its check needs, when it was put back, when it was first kept)
        self._idle: list[tuple[Any, Any, float, float]] = []
        self._pack: Any = _UNPROBED
        _SpareConnections._live.add(self)

    def _packer(self, conn: Any) -> Any:
        """hiredis's ``pack_command`` where it writes exactly the bytes the
        connection would; else None: the connection packs."""
        pack = _hiredis_pack
        if pack is None:
            return None
        sample: Any = ("EVALSHA", "0" * 40, 1, "ns:{cl\u00e9}", "", "1.5", "16777216.0")
        try:
            if b"".join(conn.pack_command(*sample)) != pack(sample):
                return None
        except (AttributeError, TypeError, ValueError):  # a client that packs its own way
            return None
        return pack

    def _packed(self, conn: Any) -> Any:
        pack = self._pack
        if pack is _UNPROBED:
            pack = self._pack = self._packer(conn)
        return pack

    def _refused(self, exc: BaseException) -> BaseException:
        return _refused_connect(exc, self._connect_error)

    def _take(self) -> tuple[Any, Any, float, bool] | None:
        """A kept connection, its check state, when it was first kept, and
        whether it is due back through the pool whatever its check says."""
        if self._pid != os.getpid():  # a fork that skipped the at-fork hook
            self._idle.clear()
            self._pid = os.getpid()
        try:
            conn, check, since, first = self._idle.pop()
        except IndexError:
            return None
        now = time.monotonic()
        due = (
            now - since > self.IDLE_CHECK
            or now - first > self.MAX_KEPT
            or getattr(conn, "_re_auth_token", None) is not None
            or bool(getattr(conn, "should_reconnect", bool)())
        )
        return conn, check, first, due

    def _keep_or_release(self, conn: Any, check: Any, first: float) -> bool:
        """Keep ``conn`` if there is room; False means the caller gives it back."""
        if len(self._idle) >= self._keep:
            return False
        now = time.monotonic()
        self._idle.append((conn, check, now, first if first else now))
        return True

    @classmethod
    def forget_after_fork(cls) -> None:
        """In a forked child: the kept sockets are the parent's. The pool
        resets itself in the child; nothing here may touch them."""
        for spares in list(cls._live):
            spares._idle.clear()
            spares._pid = os.getpid()


class _SyncSpareConnections(_SpareConnections):
    """:class:`_SpareConnections` of a synchronous pool."""

    __slots__ = ()

    def call(self, args: tuple[Any, ...]) -> Any:
        """One command, one attempt, on a kept connection if one is idle."""
        pool = self._pool
        conn: Any = None
        try:
            kept = self._take()
            if kept is None:
                sock = poller = None
                first = 0.0
                try:
                    conn = pool.get_connection(*self._conn_args)
                except self._reply_error as exc:
                    raise self._refused(exc) from exc
            else:
                conn, (sock, poller), first, due = kept
                # readable: closed by the server, or data nobody asked for
                broken = getattr(conn, "_sock", None) is not sock or bool(poller.poll(0))
                if broken or due:
                    if broken:
                        conn.disconnect()  # the pool may skip its own check
                    held, conn = conn, None
                    pool.release(held)
                    sock = poller = None
                    first = 0.0
                    try:
                        conn = pool.get_connection(*self._conn_args)
                    except self._reply_error as exc:
                        raise self._refused(exc) from exc
            pack = self._packed(conn)
            if pack is None:
                conn.send_command(*args)
            else:
                conn.send_packed_command((pack(args),))
            reply = conn.read_response()
        except self._reply_error:
            if conn is not None:  # else the pool's own connect failed with it
                self._put_back(conn, sock, poller, first)  # the server's error reply, read in full
            raise
        except BaseException:
            if conn is not None:
                conn.disconnect()  # a reply may be half read: never reuse the socket as is
                pool.release(conn)
            raise
        self._put_back(conn, sock, poller, first)
        return reply

    def _put_back(self, conn: Any, sock: Any, poller: Any, first: float) -> None:
        """Keep a connection whose reply was read in full, or give it back."""
        try:
            current = getattr(conn, "_sock", None)
            if current is not None:
                if current is not sock:
                    first = 0.0  # a new socket: its keeping starts now
                    poller = select.poll()
                    poller.register(current, select.POLLIN)
                if self._keep_or_release(conn, (current, poller), first):
                    return
        except BaseException:
            self._pool.release(conn)
            raise
        self._pool.release(conn)

    def release_all(self) -> None:
        """Every kept connection disconnected and back to the pool."""
        while True:
            try:
                conn = self._idle.pop()[0]
            except IndexError:
                return
            conn.disconnect()
            self._pool.release(conn)


class _AsyncSpareConnections(_SpareConnections):
    """:class:`_SpareConnections` of an asyncio pool (one event loop, as the
    storage itself). Its check is the connection's own ``can_read()``: the
    loop reads the socket all along, so a closed one is already at EOF
    there, with no system call."""

    __slots__ = ()

    async def call(self, args: tuple[Any, ...]) -> Any:
        """One command, one attempt, on a kept connection if one is idle."""
        pool = self._pool
        conn: Any = None
        first = 0.0
        try:
            kept = self._take()
            if kept is None:
                try:
                    conn = await pool.get_connection(*self._conn_args)
                except self._reply_error as exc:
                    raise self._refused(exc) from exc
            else:
                conn, _, first, due = kept
                try:
                    broken = not conn.is_connected or await conn.can_read()
                except self._broken:
                    broken = True
                if broken or due:
                    if broken:
                        await conn.disconnect(nowait=True)  # the pool may skip its own check
                    held, conn = conn, None
                    first = 0.0
                    await pool.release(held)
                    try:
                        conn = await pool.get_connection(*self._conn_args)
                    except self._reply_error as exc:
                        raise self._refused(exc) from exc
            pack = self._packed(conn)
            packed = [pack(args)] if pack is not None else conn.pack_command(*args)
            writer = getattr(conn, "_writer", None)
            if type(writer) is asyncio.StreamWriter and not getattr(conn, "health_check_interval", 1):
                # redis-py bounds a send by wrapping it in ``asyncio.wait_for``,
                # a new Task per call (15 µs here). A command this small is
                # sent at once or buffered; the reply's read timeout bounds
                # the wait either way, and a lost connection shows there.
                writer.writelines(packed)
            else:
                await conn.send_packed_command(packed)
            reply = await conn.read_response()
        except self._reply_error:
            if conn is not None:  # else the pool's own connect failed with it
                await self._put_back(conn, first)  # the server's error reply, read in full
            raise
        except BaseException:
            # a timeout, a socket error or a cancellation: a reply may be half
            # read, so the socket is never reused as is
            if conn is not None:
                await conn.disconnect(nowait=True)
                await pool.release(conn)
            raise
        await self._put_back(conn, first)
        return reply

    async def _put_back(self, conn: Any, first: float) -> None:
        if not (conn.is_connected and self._keep_or_release(conn, None, first)):
            await self._pool.release(conn)

    async def release_all(self) -> None:
        """Every kept connection disconnected and back to the pool."""
        while True:
            try:
                conn = self._idle.pop()[0]
            except IndexError:
                return
            await conn.disconnect(nowait=True)
            await self._pool.release(conn)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_SpareConnections.forget_after_fork)


# One script call of a batch: script, its keys, its arguments, the batch positions it decides.
_Call = tuple[_Script, list[str], list[str], list[int]]


class _RedisBase:
    """Everything but the I/O, shared by :class:`RedisStorage` and
    :class:`AsyncRedisStorage`: options, key layout, argument caches, verdict
    parsing, the failure policy, the circuit breaker, the near-cache and the
    metrics. A subclass sends what these methods prepare and hands the
    replies back; see :class:`RedisStorage` for the options."""

    _asyncio: ClassVar[bool] = False

    def __init__(
        self,
        client: Any,
        *,
        prefix: str = "nanolimit:",
        clock: Literal["server", "client"] = "server",
        on_error: OnError = "allow",
        rule_on_error: Mapping[str, OnError] | None = None,
        timeout: float = 0.05,
        derive: bool = True,
        deny_retry_after: float = 1.0,
        breaker_threshold: int = 5,
        breaker_cooldown: float = 1.0,
        batch: Literal["script", "pipeline"] = "script",
        near_cache: bool = False,
        near_cache_size: int = 10_000,
        near_cache_ttl: float = 1.0,
        secret_rules: Collection[str] = (),
        hash_identities: bool = False,
        max_identity_bytes: int = 64,
        key_salt: bytes = b"",
        max_key_bytes: int = MAX_KEY_BYTES,
        keep_connections: int = 8,
    ) -> None:
        if type(keep_connections) is not int or keep_connections < 0:
            raise ValidationError(f"keep_connections must be an int >= 0, got {keep_connections!r}")
        if not isinstance(prefix, str) or "{" in prefix or "}" in prefix:
            raise ValidationError("prefix must be a str without '{' or '}' (they would become a hash tag)")
        if batch not in ("script", "pipeline"):
            raise ValidationError(f"batch must be 'script' or 'pipeline', got {batch!r}")
        if clock not in ("server", "client"):
            raise ValidationError(f"clock must be 'server' or 'client', got {clock!r}")
        for policy in (on_error, *(rule_on_error or {}).values()):
            if policy not in _POLICIES:
                raise ValidationError(f"on_error must be one of {_POLICIES}, got {policy!r}")
        if not (isinstance(timeout, (int, float)) and 0 < timeout <= 60):
            raise ValidationError(f"timeout must be seconds in (0, 60], got {timeout!r}")
        if not (deny_retry_after > 0 and math.isfinite(deny_retry_after)):
            raise ValidationError("deny_retry_after must be finite and > 0")
        if not isinstance(breaker_threshold, int) or breaker_threshold < 1:
            raise ValidationError("breaker_threshold must be an int >= 1")
        if len(key_salt) > 64:
            raise ValidationError("key_salt is at most 64 bytes (BLAKE2b key)")
        if is_asyncio_client(client) is not self._asyncio:
            want, other = (
                ("an asyncio", "RedisStorage") if self._asyncio else ("a synchronous", "AsyncRedisStorage")
            )
            raise ValidationError(
                f"{type(self).__name__} needs {want} client, got {type(client).__module__}."
                f"{type(client).__name__} (use {other} for that one)"
            )
        self.user_client = client
        self.client = derive_client(client, float(timeout)) if derive else client
        self.cluster = is_cluster_client(client)
        self.prefix = prefix
        self.clock = clock
        self.batch = batch
        self.on_error: OnError = on_error
        self.rule_on_error: dict[str, OnError] = dict(rule_on_error or {})
        self.timeout = float(timeout)
        self.deny_retry_after = float(deny_retry_after)
        self.secret_rules = frozenset(secret_rules)
        self.hash_identities = hash_identities
        self.max_identity_bytes = max_identity_bytes
        self.key_salt = bytes(key_salt)
        self.max_key_bytes = max_key_bytes
        self._breaker = _Breaker(breaker_threshold, float(breaker_cooldown))
        self._setup_direct(keep_connections)
        self._near = _NearCache(near_cache_size, near_cache_ttl) if near_cache else None
        self._counts = {
            "decisions": 0,
            "errors": 0,
            "degraded": 0,
            "timeouts": 0,
            "key_errors": 0,
            "write_refused": 0,
            "script_loads": 0,
            "breaker_open_skips": 0,
        }
        self._count_lock = threading.Lock()
        self._near_hits = event_counter()  # counted on the near-cache's hot path: no lock
        self._decisions = event_counter()  # and this one on every decision's
        self._prefixes: dict[tuple[Algorithm, str], str] = {}
        self._param_cache: dict[LimiterConfig, tuple[str, str]] = {}
        # the last config asked for: a limiter passes the same object every
        # time, and an identity test is cheaper than hashing the dataclass
        self._last_params: tuple[LimiterConfig | None, tuple[str, str]] = (None, ("", ""))
        # What counts as "the store failed": the client library's base error
        # (redis-py's RedisError, valkey-py's ValkeyError) and socket errors;
        # anything unknown is caught broadly rather than raised into a request.
        self._errors: tuple[type[BaseException], ...] = (Exception,)
        # The server's error replies (redis-py's ResponseError): the ones
        # about a key answer that key alone (see ``_error_verdict``).
        self._reply_errors: tuple[type[BaseException], ...] = ()
        self._connect_error: tuple[type[BaseException], ...] = ()
        try:
            exceptions = _client_package(client).exceptions
            base = getattr(exceptions, "RedisError", None) or getattr(exceptions, "ValkeyError", None)
            if isinstance(base, type) and issubclass(base, BaseException):
                self._errors = (base, OSError)
            reply = getattr(exceptions, "ResponseError", None)
            if isinstance(reply, type) and issubclass(reply, BaseException):
                self._reply_errors = (reply,)
            connect = getattr(exceptions, "ConnectionError", None)
            if isinstance(connect, type) and issubclass(connect, BaseException):
                self._connect_error = (connect,)
        except (ImportError, AttributeError):
            pass

    def _setup_direct(self, keep: int) -> None:
        """Decide whether single calls may talk to a pooled connection directly.

        redis-py 8 wraps every ``execute_command`` in retry and observability
        machinery that costs about 25 µs on this machine — most of what a
        decision costs above a ``PING``. The decision call needs none of it
        (it must not be retried), so on a standalone client we take a
        connection from the client's pool, send, read and give it back, as
        redis-py itself does underneath (the asyncio client alike, awaiting
        each step). Clusters (routing) and single-connection clients go
        through ``execute_command``.
        """
        self._pool: Any = None
        self._conn_args: tuple[str, ...] = ()
        self._spares: Any = None  # _SyncSpareConnections or _AsyncSpareConnections
        pool = getattr(self.client, "connection_pool", None)
        if self.cluster or pool is None or getattr(self.client, "connection", None) is not None:
            return
        if not (hasattr(pool, "get_connection") and hasattr(pool, "release")):
            return
        try:
            params = list(inspect.signature(pool.get_connection).parameters.values())
        except (TypeError, ValueError):
            return
        if (
            params
            and params[0].default is inspect.Parameter.empty
            and params[0].kind
            in (
                inspect.Parameter.POSITIONAL_ONLY,
                inspect.Parameter.POSITIONAL_OR_KEYWORD,
            )
        ):
            self._conn_args = ("EVALSHA",)  # older redis-py and valkey-py want a command name
        self._pool = pool
        self._keep_spares(pool, keep)

    def _keep_spares(self, pool: Any, keep: int) -> None:
        """Let single calls keep up to ``keep`` connections out of the
        derived client's pool between calls (see :class:`_SpareConnections`):
        never the caller's pool, which may have other users waiting, nor a
        blocking one, and fewer than half of a bounded one."""
        limit = getattr(pool, "max_connections", None)
        if isinstance(limit, int):
            keep = min(keep, limit // 2)
        if (
            keep <= 0
            or self.client is self.user_client
            or isinstance(getattr(pool, "timeout", None), (int, float))
        ):
            return
        exceptions = getattr(_client_package(self.client), "exceptions", None)
        if self._asyncio:
            self._spares = _AsyncSpareConnections(pool, self._conn_args, keep, exceptions)
            return
        spares = _SyncSpareConnections(pool, self._conn_args, keep, exceptions)
        self._spares = spares
        weakref.finalize(self, spares.release_all)

    # -- keys -------------------------------------------------------------------
    def _rule_prefix(self, cfg: LimiterConfig) -> str:
        ident = (cfg.algorithm, cfg.rule)
        found = self._prefixes.get(ident)
        if found is None:
            rule = cfg.rule
            if "{" in rule or "}" in rule or rule.startswith("#") or len(rule.encode("utf-8")) > 128:
                rule = _digest(rule, self.key_salt)
            found = f"{self.prefix}{cfg.algorithm.value}:{rule}:"
            self._prefixes[ident] = found
        return found

    def redis_key(self, cfg: LimiterConfig, key: str) -> str:
        """The Redis key holding ``key``'s state under ``cfg``."""
        identity = key
        if (
            self.hash_identities
            or cfg.rule in self.secret_rules
            or "{" in key
            or "}" in key
            or key.startswith("#")
            or len(key) > self.max_identity_bytes
            or (not key.isascii() and len(key.encode("utf-8")) > self.max_identity_bytes)
        ):
            identity = _digest(key, self.key_salt)
        return self._rule_prefix(cfg) + "{" + identity + "}"

    def _scan_match(self) -> str:
        special = "*?[]\\"
        return "".join("\\" + c if c in special else c for c in self.prefix) + "*"

    # -- metrics ------------------------------------------------------------------
    def _count(self, name: str, n: int = 1) -> None:
        with self._count_lock:
            self._counts[name] += n

    def metrics(self) -> dict[str, Any]:
        """Counters since construction: ``decisions`` (answered by the store),
        ``errors`` (the server or the connection failed: what feeds the
        breaker), ``timeouts`` (of those), ``key_errors`` (error replies about
        one call's key: a foreign value, a bad state, a refused write),
        ``write_refused`` (of those, ``OOM``/``MISCONF``), ``degraded``
        (answered by the failure policy), ``script_loads``,
        ``breaker_open_skips``, ``near_cache_hits``, plus the breaker's
        ``breaker_state`` and how often it ``breaker_opened``."""
        with self._count_lock:
            out: dict[str, Any] = dict(self._counts)
        out["decisions"] += self._decisions.value
        out["near_cache_hits"] = self._near_hits.value
        out["breaker_state"] = self._breaker.state
        out["breaker_opened"] = self._breaker.opened
        return out

    # -- what a decision sends, and what it makes of the answer --------------------
    def _loaded(self, script: _Script, sha: Any) -> None:
        """Check the SHA a ``SCRIPT LOAD`` answered."""
        if isinstance(sha, bytes):
            sha = sha.decode()
        if sha != script.sha:  # pragma: no cover - a server that hashes differently
            raise RedisUnavailableError(f"server computed SHA {sha} for a script we know as {script.sha}")
        self._count("script_loads")

    def _params(self, cfg: LimiterConfig) -> tuple[str, str]:
        """The kernel constants of ``cfg`` as exact strings, formatted once."""
        last = self._last_params  # one read: another thread may replace it
        if last[0] is cfg:
            return last[1]
        found = self._param_cache.get(cfg)
        if found is None:
            found = self._param_cache[cfg] = _params(cfg)
        self._last_params = (cfg, found)
        return found

    def _policy(self, rule: str) -> OnError:
        return self.rule_on_error.get(rule, self.on_error)

    def _fallback(
        self, cfg: LimiterConfig, exc: BaseException | None, reason: str = REASON_STORE_UNAVAILABLE
    ) -> KernelVerdict:
        """The failure policy's verdict (or raise)."""
        policy = self._policy(cfg.rule)
        if policy == "raise":
            if isinstance(exc, RedisUnavailableError):
                raise exc
            if exc is None:
                raise CircuitOpenError("circuit breaker open: Redis is not being asked")
            # redis-py's repr of its errors drops the message: name and text
            raise RedisUnavailableError(f"Redis decision failed: {type(exc).__name__}: {exc}") from exc
        self._count("degraded")
        if policy == "allow":
            return (True, 0.0, 0.0, 0.0, 0.0, True, reason)
        wait = self.deny_retry_after
        return (False, 0.0, wait, wait, 0.0, True, reason)

    def _failed(self, exc: BaseException) -> None:
        """The server or the connection failed: count it, feed the breaker."""
        self._count("errors")
        if "imeout" in type(exc).__name__ or isinstance(exc, TimeoutError):
            self._count("timeouts")
        self._breaker.failure()

    def _key_error(self, exc: BaseException) -> RedisKeyError | None:
        """``exc`` as an error about one call's key, or None when it says the
        server or the connection failed. By the reply's error code (never its
        text): a reply that is not an error reply (a timeout, a reset socket,
        ``LOADING``, which redis-py raises as a connection error) or whose
        code is in :data:`SERVER_ERROR_CODES` is the server's; any other
        error reply (``WRONGTYPE``, ``BADSTATE``, ``OOM``, ``MISCONF``,
        ``NOPERM``, a script's ``ERR``) came from a server able to answer,
        about this call."""
        if isinstance(exc, RedisKeyError):
            return exc
        if not isinstance(exc, self._reply_errors):
            return None
        code = error_code(exc)
        if code in SERVER_ERROR_CODES:
            return None
        key_error = RedisKeyError(f"Redis answered this key with an error: {code}: {exc}", code)
        key_error.__cause__ = exc
        return key_error

    def _key_error_verdict(self, cfg: LimiterConfig, error: RedisKeyError) -> KernelVerdict:
        """One key's error reply: counted on its own, never the breaker's
        business (the server answered, so it is up: a half-open breaker
        closes), answered by that key's policy, nothing written to it."""
        with self._count_lock:
            counts = self._counts
            counts["errors"] += 1
            counts["key_errors"] += 1
            if error.code in WRITE_REFUSED_CODES:
                counts["write_refused"] += 1
        self._breaker.success()
        return self._fallback(cfg, error, REASON_STORE_ERROR)

    def _error_verdict(self, cfg: LimiterConfig, exc: BaseException) -> KernelVerdict:
        """A decision call failed: a key's error answers that key by its
        policy; a failure of the server or the connection is counted, feeds
        the breaker, and the policy answers."""
        key_error = self._key_error(exc)
        if key_error is not None:
            return self._key_error_verdict(cfg, key_error)
        self._failed(exc)
        return self._fallback(cfg, exc)

    def _part_error(self, cfg: LimiterConfig, part: Any) -> tuple[KernelVerdict, bool]:
        """One key's ``"E <error reply>"`` in a multi-key script's reply (the
        script caught that key's error and went on with the others): the
        policy's answer, and whether the error was the server's (a
        ``READONLY`` write on a demoted primary, say: it feeds the breaker)."""
        text = part.decode("utf-8", "replace") if isinstance(part, bytes) else str(part)
        if not text.startswith("E "):
            raise ValueError(f"unexpected script reply {text[:80]!r}")
        text = text[2:]
        code = _code_of_text(text)
        if code in SERVER_ERROR_CODES:
            failure = RedisUnavailableError(f"Redis failed: {text}")
            self._failed(failure)
            return self._fallback(cfg, failure), True
        error = RedisKeyError(f"Redis answered this key with an error: {text}", code)
        return self._key_error_verdict(cfg, error), False

    def _now_arg(self, now: float | None) -> str:
        if now is None:
            return repr(time.time()) if self.clock == "client" else ""
        return repr(now)

    def _floor_ms(self, now: float | None) -> str:
        return "0" if now is None else str(INJECTED_EXPIRY_FLOOR_MS)

    def _early(self, config: LimiterConfig, key: str, cost: int, now: float | None) -> KernelVerdict | None:
        """The answer that needs no round trip, if any: a near-cache denial,
        or the policy's while the breaker is open."""
        near = self._near
        if near is not None:
            t = time.monotonic() if now is None else now
            hit = near.lookup((config.algorithm, config.rule, key, now is None), cost, t)
            if hit is not None:
                self._near_hits.add()
                return (False, 0.0, hit[0], hit[1], 0.0, False)
        if not self._breaker.allow_call():
            self._count("breaker_open_skips")
            return self._fallback(config, None)
        return None

    def _single_args(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> tuple[tuple[str], tuple[str, ...]]:
        """``KEYS`` and ``ARGV`` of one decision's ``EVALSHA``."""
        p1, p2 = self._params(config)
        return (self.redis_key(config, key),), (
            self._now_arg(now),
            str(cost),
            "1" if commit else "0",
            self._floor_ms(now),
            p1,
            p2,
        )

    def _answered(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, reply: Any
    ) -> KernelVerdict:
        """The store answered: a verdict, remembered by the near-cache if a denial."""
        self._breaker.success()
        self._decisions.add()
        verdict = _parse_verdict(reply)
        near = self._near
        if near is not None and not verdict[0]:
            t = time.monotonic() if now is None else now
            near.remember((config.algorithm, config.rule, key, now is None), cost, t, verdict[2], verdict[3])
        return verdict

    def _batch_start(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> _BatchRun | list[KernelVerdict]:
        """The script calls of a batch (see ``RedisStorage.run_kernel_many``),
        or the whole answer when nothing is to be sent."""
        n = len(keys)
        if n == 0:
            return []
        if not self._breaker.allow_call():
            self._count("breaker_open_skips")
            return [self._fallback(config, None)] * n
        p1, p2 = self._params(config)
        now_arg = self._now_arg(now)
        floor_ms = self._floor_ms(now)
        rkeys = [self.redis_key(config, key) for key in keys]
        calls: list[_Call] = []
        if self.batch == "script":
            script = BATCH_SCRIPTS[config.algorithm]
            groups: dict[int, list[int]] = {}
            if self.cluster:
                slot_of = _client_package(self.user_client).crc.key_slot
                for i, rkey in enumerate(rkeys):
                    groups.setdefault(slot_of(rkey.encode("utf-8")), []).append(i)
            else:
                groups[0] = list(range(n))
            for members in groups.values():
                for c in range(0, len(members), BATCH_CHUNK):
                    part = members[c : c + BATCH_CHUNK]
                    args = [now_arg, floor_ms, p1, p2, *[str(costs[i]) for i in part]]
                    calls.append((script, [rkeys[i] for i in part], args, part))
        else:
            script = SCRIPTS[config.algorithm]
            for i, (rkey, cost) in enumerate(zip(rkeys, costs)):
                calls.append((script, [rkey], [now_arg, str(cost), "1", floor_ms, p1, p2], [i]))
        return _BatchRun(self, config, calls, n)

    def _forget_local(self, config: LimiterConfig, key: str) -> str:
        """Drop ``key``'s near-cache entries; the Redis key to ``DEL``."""
        if self._near is not None:
            for server_time in (True, False):  # entries are per time base (monotonic or injected)
                self._near.forget((config.algorithm, config.rule, key, server_time))
        return self.redis_key(config, key)

    def _snapshot_command(self, config: LimiterConfig, key: str) -> tuple[str, ...]:
        """The one read command that fetches ``key``'s raw state."""
        rkey = self.redis_key(config, key)
        algo = config.algorithm
        if algo is Algorithm.GCRA:
            return ("GET", rkey)
        if algo is Algorithm.SLIDING_LOG:
            return ("LRANGE", rkey, "0", "-1")
        if algo in (Algorithm.TOKEN_BUCKET, Algorithm.LEAKY_BUCKET):
            return ("HMGET", rkey, "l", "u")
        return ("HMGET", rkey, "k", "n", "p", "u")

    @staticmethod
    def _parse_snapshot(algo: Algorithm, raw: Any) -> LimiterState | None:
        """The state read by :meth:`_snapshot_command` (not brought up to now), or ``None``."""
        if algo is Algorithm.GCRA:
            if raw is None:
                return None
            tat, updated = (raw.decode() if isinstance(raw, bytes) else raw).split(" ")
            return LimiterState(algo, float(updated), tat=int(float(tat)))
        if algo is Algorithm.SLIDING_LOG:
            if not raw:
                return None
            return LimiterState(algo, float(raw[0]), log=tuple(float(x) for x in raw[1:]))
        if algo in (Algorithm.TOKEN_BUCKET, Algorithm.LEAKY_BUCKET):
            level, updated = raw
            if level is None:
                return None
            return LimiterState(algo, float(updated), level=float(level))
        k, count, previous, updated = raw
        if k is None:
            return None
        if algo is Algorithm.FIXED_WINDOW:
            return LimiterState(algo, float(updated), window_index=int(float(k)), count=int(float(count)))
        return LimiterState(
            algo,
            float(updated),
            window_index=int(float(k)),
            count=int(float(count)),
            previous=int(float(previous)),
        )

    # -- Storage protocol ---------------------------------------------------------
    def apply(self, key: str, now: float, mutate: Callable[[Any], tuple[Any, Any]]) -> Any:
        """Not supported: a Python closure cannot run atomically inside Redis
        (a WATCH/MULTI loop would retry under contention and could not keep
        SPEC §5's one-step contract cheaply). Built-in algorithms never call it."""
        raise NotImplementedError(
            f"{type(self).__name__} runs the built-in algorithms only; "
            "a custom algorithm needs its own Lua script"
        )

    def evict_idle(self, cutoff: float) -> int:
        """A no-op that returns 0: every key carries an expiry equal to the time
        until its state is back to "never seen", so Redis evicts idle keys
        itself, on every node, without a scan."""
        check_cutoff(cutoff)
        return 0

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"<{name} prefix={self.prefix!r} cluster={self.cluster} on_error={self.on_error!r}>"


class _BatchRun:
    """One batch in flight, for either storage: the script calls still to
    send and the verdicts so far. ``absorb`` takes a pipeline's replies and
    answers the script to load when some calls hit ``NOSCRIPT`` (those did not
    run, and are sent once more); nothing else is ever retried."""

    __slots__ = ("config", "down", "failed", "out", "storage", "todo")

    def __init__(self, storage: _RedisBase, config: LimiterConfig, calls: list[_Call], n: int) -> None:
        self.storage = storage
        self.config = config
        self.todo = calls
        self.out: list[KernelVerdict | None] = [None] * n
        self.failed = 0  # keys the policy answered
        self.down = False  # whether the server (not a key) failed

    def queue(self, pipe: Any) -> None:
        for script, call_keys, args, _ in self.todo:
            pipe.execute_command("EVALSHA", script.sha, len(call_keys), *call_keys, *args)

    def absorb(self, replies: Sequence[Any], attempt: int) -> _Script | None:
        storage, config, out = self.storage, self.config, self.out
        again = []
        for call, reply in zip(self.todo, replies):
            members = call[3]
            if isinstance(reply, BaseException):
                if attempt == 0 and _is_noscript(reply):
                    again.append(call)
                    continue
                self.failed += len(members)
                key_error = storage._key_error(reply)
                if key_error is not None and len(members) == 1:  # one EVALSHA: its key's error
                    out[members[0]] = storage._key_error_verdict(config, key_error)
                    continue
                self.down = True
                storage._failed(reply)
                for i in members:
                    out[i] = storage._fallback(config, reply)
            elif isinstance(reply, list):
                for i, part in zip(members, reply):
                    try:
                        out[i] = _parse_verdict(part)
                    except ValueError:  # that key's error: the script went on with the others
                        out[i], down = storage._part_error(config, part)
                        self.failed += 1
                        self.down = self.down or down
            else:
                out[members[0]] = _parse_verdict(reply)
        self.todo = again
        return again[0][0] if again else None

    def abort(self, exc: BaseException) -> list[KernelVerdict]:
        """The round trip itself failed (each key's error reply comes back
        among the replies instead): a failure of the server or the
        connection; the policy answers what is still open."""
        storage = self.storage
        storage._failed(exc)
        fallback = storage._fallback(self.config, exc)
        return [fallback if v is None else v for v in self.out]

    def result(self) -> list[KernelVerdict]:
        if not self.down:
            self.storage._breaker.success()
        self.storage._count("decisions", len(self.out) - self.failed)
        return [v for v in self.out if v is not None]


class RedisStorage(_RedisBase):
    """Per-key limiter state in Redis/Valkey, decided by Lua scripts.

    ``client`` is your redis-py client (``redis.Redis``, ``redis.RedisCluster``)
    or a valkey-py one (duck typed). Decisions go through a *derived* client:
    the same connection settings with ``timeout`` seconds of socket timeout
    and no retries (``derive=False`` uses yours unchanged — then the timeouts
    and retries are your responsibility).

    Keys: ``<prefix><algorithm>:<rule>:{<identity>}``. The identity is the
    cluster hash tag, so every limit on one identity lives in one slot (and a
    compound request on one identity is one script on one node). An identity
    is replaced by ``#`` + a BLAKE2b digest (keyed with ``key_salt``) when it
    is longer than ``max_identity_bytes``, contains ``{``/``}``, starts with
    ``#``, or belongs to a rule named in ``secret_rules`` (API keys must not
    show in ``SCAN``/``MONITOR``); ``hash_identities=True`` hashes them all.
    Rule names with braces, a leading ``#`` or over 128 bytes are hashed too.

    ``clock``: ``"server"`` (default) — a limiter on the default SystemClock
    is judged by Redis's ``TIME``, one clock for every gateway instance; an
    injected clock (FakeClock, replays) is always passed through.
    ``"client"`` sends the local wall clock instead (not recommended: clients
    disagree).

    Failures (``on_error``, overridable per rule with ``rule_on_error``):
    ``"allow"`` answers allowed, ``"deny"`` answers denied with
    ``deny_retry_after`` seconds, both marked ``degraded``; ``"raise"`` raises
    :class:`RedisUnavailableError`. After ``breaker_threshold`` consecutive
    failures of the server or the connection the breaker opens for
    ``breaker_cooldown`` seconds (no round trips), then lets one probe
    through. An error reply about one key (``WRONGTYPE`` from a foreign
    value, the scripts' ``BADSTATE``, ``OOM``) answers that key alone by its
    policy (``reason="store_error"``, :class:`RedisKeyError` under
    ``"raise"``), is counted in ``key_errors`` and never feeds the breaker;
    the value is left as it is (docs/redis.md, "Failures").

    ``batch``: ``"script"`` (default) decides an ``allow_many`` with one
    batch script per node/slot (about twice the throughput), ``"pipeline"``
    with one ``EVALSHA`` per key; both are one round trip.
    ``near_cache=True`` denies a key the store has just denied locally until
    its ``retry_after`` (see :class:`_NearCache`).

    ``keep_connections`` (default 8): how many connections decisions may
    keep out of the derived client's pool between calls, instead of taking
    one and giving it back each time, which costs more than the server
    spends on the decision (see :class:`_SpareConnections`). ``0`` borrows
    from the pool on every call, as does ``derive=False`` (your pool may
    have other users to serve). A blocking pool, or one whose
    ``max_connections`` is below twice this, keeps fewer or none.
    """

    # -- script calls -------------------------------------------------------------
    def load_scripts(self) -> None:
        """``SCRIPT LOAD`` every script (on every primary of a cluster)."""
        for script in (*SCRIPTS.values(), *BATCH_SCRIPTS.values(), COMPOUND_SCRIPT):
            self._load(script)

    def _load(self, script: _Script) -> None:
        self._loaded(script, self.client.script_load(script.source))

    def _call(self, *args: Any) -> Any:
        """One command, one attempt. A socket error or timeout disconnects
        the connection (redis-py's ``read_response`` does it) before it goes
        back to the pool, so the next call starts on a fresh socket."""
        spares = self._spares
        if spares is not None:
            return spares.call(args)
        pool = self._pool
        if pool is None:
            return self.client.execute_command(*args)
        try:
            conn = pool.get_connection(*self._conn_args)
        except self._reply_errors as exc:
            raise _refused_connect(exc, self._connect_error) from exc
        try:
            conn.send_command(*args)
            return conn.read_response()
        finally:
            pool.release(conn)

    def _evalsha(self, script: _Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        """One ``EVALSHA``; on ``NOSCRIPT`` load and retry once (safe: the
        script did not run). Never retried otherwise."""
        try:
            return self._call("EVALSHA", script.sha, len(keys), *keys, *args)
        except self._errors as exc:
            if not _is_noscript(exc):
                raise
        self._load(script)
        return self._call("EVALSHA", script.sha, len(keys), *keys, *args)

    # -- KernelStorage --------------------------------------------------------------
    def run_kernel(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict:
        """One decision: one ``EVALSHA`` (two after a ``SCRIPT FLUSH``)."""
        early = self._early(config, key, cost, now)
        if early is not None:
            return early
        keys, args = self._single_args(config, key, cost, now, commit)
        try:
            reply = self._evalsha(SCRIPTS[config.algorithm], keys, args)
        except self._errors as exc:
            return self._error_verdict(config, exc)
        return self._answered(config, key, cost, now, reply)

    def run_kernel_many(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> list[KernelVerdict]:
        """A batch in one round trip: one pipeline (``transaction=False``).

        ``batch="script"`` (default) sends one batch script per node — per
        slot on a cluster, at most ``BATCH_CHUNK`` keys each — which runs the
        kernel key after key with one clock reading, as the in-memory batch
        does; ``batch="pipeline"`` sends one ``EVALSHA`` per key (each reads
        the server clock itself). Either way keys are decided in order, a
        repeated key sees its earlier charge, and a script that hit
        ``NOSCRIPT`` (it did not run) is sent again after a load; nothing
        else is retried.
        """
        run = self._batch_start(config, keys, costs, now)
        if isinstance(run, list):
            return run
        try:
            for attempt in range(2):
                pipe = self.client.pipeline(transaction=False)
                run.queue(pipe)
                reload = run.absorb(pipe.execute(raise_on_error=False), attempt)
                if reload is None:
                    break
                self._load(reload)
        except self._errors as exc:
            return run.abort(exc)
        return run.result()

    def run_kernel_all(
        self, items: Sequence[tuple[LimiterConfig, str, int]], now: float | None
    ) -> list[KernelVerdict]:
        """All-or-nothing over several (config, key, cost) with one ``now``."""
        return self._run_all([(cfg, key, cost, now) for cfg, key, cost in items])

    def _run_all(self, items: Sequence[tuple[LimiterConfig, str, int, float | None]]) -> list[KernelVerdict]:
        if not items:
            return []
        cfg0 = items[0][0]
        keys = [self.redis_key(cfg, key) for cfg, key, _, _ in items]
        if len(set(keys)) != len(keys):
            raise ValidationError(DUPLICATE_COMPOUND)
        if self.cluster:
            self._check_one_slot(keys)
        if not self._breaker.allow_call():
            self._count("breaker_open_skips")
            return [self._fallback(cfg, None) for cfg, _, _, _ in items]
        args: list[str] = [str(len(items))]
        for cfg, _key, cost, now in items:
            p1, p2 = _params(cfg)
            args += [
                str(_ALGO_IDS[cfg.algorithm]),
                self._now_arg(now),
                str(cost),
                self._floor_ms(now),
                p1,
                p2,
                "1" if self._policy(cfg.rule) == "allow" else "0",
            ]
        try:
            reply = self._evalsha(COMPOUND_SCRIPT, keys, args)
        except self._errors as exc:
            first = self._error_verdict(cfg0, exc)
            reason = first[6] if len(first) > 6 else REASON_STORE_UNAVAILABLE
            return [first] + [self._fallback(cfg, exc, reason) for cfg, _, _, _ in items[1:]]
        # Each limit's answer; a key that erred was answered by its own
        # policy inside the script too (allowed only under "allow", never
        # written), so the others were charged or not exactly as shown here.
        out: list[KernelVerdict] = []
        down = False
        for (cfg, _, _, _), part in zip(items, reply):
            try:
                out.append(_parse_verdict(part))
            except ValueError:
                verdict, failed = self._part_error(cfg, part)
                out.append(verdict)
                down = down or failed
        if not down:
            self._breaker.success()
        self._count("decisions", sum(1 for v in out if len(v) < 7))
        return out

    def _check_one_slot(self, keys: Sequence[str]) -> None:
        slot = _client_package(self.user_client).crc.key_slot
        slots = {slot(k.encode("utf-8")) for k in keys}
        if len(slots) > 1:
            raise ValidationError(
                "on a Redis Cluster a compound request must bind one identity: its keys are routed by "
                "the identity's hash tag and must share one slot (a global key cannot join a per-user "
                "compound on a cluster; decide it separately)"
            )

    def forget(self, config: LimiterConfig, key: str) -> None:
        """``DEL`` the key (a reset is an admin action: errors raise)."""
        self.client.delete(self._forget_local(config, key))

    def snapshot(self, config: LimiterConfig, key: str, now: float | None) -> LimiterState | None:
        """The raw stored state (not brought up to ``now``), or ``None``."""
        return self._parse_snapshot(
            config.algorithm, self.client.execute_command(*self._snapshot_command(config, key))
        )

    def keys(self) -> list[str]:
        """Every key under the prefix (``SCAN``; every primary of a cluster)."""
        out = []
        for raw in self.client.scan_iter(match=self._scan_match(), count=1000):
            out.append(raw.decode() if isinstance(raw, bytes) else raw)
        return out

    def __len__(self) -> int:
        """Keys under the prefix, counted with ``SCAN`` (O(keys): not for a hot path)."""
        return len(self.keys())

    def clear(self) -> int:
        """Delete every key under the prefix; returns how many."""
        names = self.keys()
        for name in names:
            self.client.delete(name)
        return len(names)

    # -- compound limits ------------------------------------------------------------
    def allow_all(self, requests: Sequence[tuple[Any, ...]]) -> CompoundDecision:
        """All-or-nothing over several limiters of this storage (SPEC §6), in
        one script: every limit is decided without writing, and only if all
        allow is each one charged. Works with limiters of either twin.

        On a cluster every key must share one slot — i.e. one identity (the
        hash tag); see :meth:`_check_one_slot`.
        """
        items = compound_items(requests)
        plan: list[tuple[LimiterConfig, str, int, float | None]] = []
        makers: list[Callable[[KernelVerdict], Any]] = []
        for limiter, key, cost in items:
            if getattr(limiter, "storage", None) is not self:
                raise ValidationError("every limiter of a compound request must use this storage")
            cfg = limiter_config(limiter)
            check_key(key, self.max_key_bytes)
            check_cost(cost, cfg.capacity)
            plan.append((cfg, key, cost, None))
            makers.append(decision_maker(limiter, cfg))
        keys = {(cfg.algorithm, cfg.rule, key) for cfg, key, _, _ in plan}
        if len(keys) != len(plan):
            raise ValidationError(DUPLICATE_COMPOUND)
        plan = [
            (cfg, key, cost, kernel_now(limiter)) for (cfg, key, cost, _), (limiter, _, _) in zip(plan, items)
        ]
        verdicts = self._run_all(plan)
        return CompoundDecision([make(v) for make, v in zip(makers, verdicts)])

    def close(self) -> None:
        """Give kept connections back to the pool and close the derived
        client's connections (never the caller's client)."""
        if self._spares is not None:
            self._spares.release_all()
        if self.client is not self.user_client:
            self.client.close()


_ASYNC_ONLY = (
    "AsyncRedisStorage answers coroutines only: use `await limiter.allow_async(key, cost)` / "
    "`await limiter.peek_async(key, cost)` (and the storage's *_async methods), or RedisStorage "
    "with a synchronous client"
)


class AsyncRedisStorage(_RedisBase):
    """:class:`RedisStorage` for ``asyncio``: the same scripts, keys, options,
    failure policy, breaker, near-cache and metrics, over a ``redis.asyncio``
    client (``redis.asyncio.Redis``, ``redis.asyncio.RedisCluster``, or the
    valkey-py equivalents), so a decision never blocks the event loop::

        storage = AsyncRedisStorage(redis.asyncio.Redis(host="10.0.0.5"))
        limiter = TokenBucket(100, 60.0, storage, rule="api-user")
        decision = await limiter.allow_async("user:42")

    Limiters reach it through ``allow_async``/``peek_async``
    (:meth:`run_kernel_async`). The synchronous entry points (``allow``,
    ``peek``, ``allow_many``, ``reset``, ``state``, ``len()``) raise a
    ``TypeError`` that names the async one to use; batches, resets, reads
    and counts are :meth:`run_kernel_many_async`, :meth:`forget_async`,
    :meth:`snapshot_async` and :meth:`count`. The derived client (short
    timeout, no retries) is bound to the event loop that first uses it:
    build the storage per loop, and ``await storage.close()`` at the end.
    ``keep_connections`` works as in :class:`RedisStorage`.
    """

    _asyncio: ClassVar[bool] = True

    # -- script calls -------------------------------------------------------------
    async def load_scripts(self) -> None:
        """``SCRIPT LOAD`` every script (on every primary of a cluster)."""
        for script in (*SCRIPTS.values(), *BATCH_SCRIPTS.values()):
            await self._load(script)

    async def _load(self, script: _Script) -> None:
        self._loaded(script, await self.client.script_load(script.source))

    async def _call(self, *args: Any) -> Any:
        """One command, one attempt. A timeout, a socket error or a
        cancellation disconnects the connection (redis-py's ``send_command``
        and ``read_response`` do it) before it goes back to the pool, so no
        late reply is ever read by the next caller."""
        spares = self._spares
        if spares is not None:
            return await spares.call(args)
        pool = self._pool
        if pool is None:
            return await self.client.execute_command(*args)
        try:
            conn = await pool.get_connection(*self._conn_args)
        except self._reply_errors as exc:
            raise _refused_connect(exc, self._connect_error) from exc
        try:
            await conn.send_command(*args)
            return await conn.read_response()
        finally:
            await pool.release(conn)

    async def _evalsha(self, script: _Script, keys: Sequence[str], args: Sequence[str]) -> Any:
        """One ``EVALSHA``; on ``NOSCRIPT`` load and retry once (safe: the
        script did not run). Never retried otherwise."""
        try:
            return await self._call("EVALSHA", script.sha, len(keys), *keys, *args)
        except self._errors as exc:
            if not _is_noscript(exc):
                raise
        await self._load(script)
        return await self._call("EVALSHA", script.sha, len(keys), *keys, *args)

    # -- decisions ------------------------------------------------------------------
    async def run_kernel_async(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict:
        """One decision (what ``allow_async``/``peek_async`` await): one
        ``EVALSHA``, two after a ``SCRIPT FLUSH``; a near-cache denial or an
        open breaker answers without a round trip."""
        early = self._early(config, key, cost, now)
        if early is not None:
            return early
        keys, args = self._single_args(config, key, cost, now, commit)
        try:
            reply = await self._evalsha(SCRIPTS[config.algorithm], keys, args)
        except self._errors as exc:
            return self._error_verdict(config, exc)
        return self._answered(config, key, cost, now, reply)

    async def run_kernel_many_async(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> list[KernelVerdict]:
        """A batch in one round trip, as ``RedisStorage.run_kernel_many``
        (``now``: ``None`` for the server's clock, else the injected reading).
        Called directly (it is the async ``allow_many``), so it checks every
        key, cost and the clock first, as a limiter would, and sends nothing
        if one is bad."""
        check_batch(keys, costs, config.capacity, self.max_key_bytes)
        if now is not None:
            check_now(now)
        run = self._batch_start(config, keys, costs, now)
        if isinstance(run, list):
            return run
        try:
            for attempt in range(2):
                pipe = self.client.pipeline(transaction=False)
                run.queue(pipe)
                reload = run.absorb(await pipe.execute(raise_on_error=False), attempt)
                if reload is None:
                    break
                await self._load(reload)
        except self._errors as exc:
            return run.abort(exc)
        return run.result()

    async def forget_async(self, config: LimiterConfig, key: str) -> None:
        """``DEL`` the key (a reset is an admin action: errors raise)."""
        await self.client.delete(self._forget_local(config, key))

    async def snapshot_async(self, config: LimiterConfig, key: str) -> LimiterState | None:
        """The raw stored state (not brought up to now), or ``None``."""
        raw = await self.client.execute_command(*self._snapshot_command(config, key))
        return self._parse_snapshot(config.algorithm, raw)

    async def keys(self) -> list[str]:
        """Every key under the prefix (``SCAN``; every primary of a cluster)."""
        return [
            raw.decode() if isinstance(raw, bytes) else raw
            async for raw in self.client.scan_iter(match=self._scan_match(), count=1000)
        ]

    async def count(self) -> int:
        """Keys under the prefix, counted with ``SCAN`` (O(keys): not for a hot path)."""
        return len(await self.keys())

    async def clear(self) -> int:
        """Delete every key under the prefix; returns how many."""
        names = await self.keys()
        for name in names:
            await self.client.delete(name)
        return len(names)

    async def close(self) -> None:
        """Give kept connections back and close the derived client's
        connections (never the caller's client)."""
        if self._spares is not None:
            await self._spares.release_all()
        if self.client is not self.user_client:
            closer = getattr(self.client, "aclose", None) or self.client.close
            await closer()

    # -- the synchronous protocols: present, so limiters accept the storage ----------
    def run_kernel(
        self, config: LimiterConfig, key: str, cost: int, now: float | None, commit: bool
    ) -> KernelVerdict:
        """Refused: a synchronous decision would block the event loop."""
        raise TypeError(_ASYNC_ONLY)

    def run_kernel_many(
        self, config: LimiterConfig, keys: Sequence[str], costs: Sequence[int], now: float | None
    ) -> list[KernelVerdict]:
        """Refused: ``await storage.run_kernel_many_async(limiter.config, keys, costs, None)``."""
        raise TypeError(_ASYNC_ONLY + "; a batch: `await storage.run_kernel_many_async(...)`")

    def run_kernel_all(
        self, items: Sequence[tuple[LimiterConfig, str, int]], now: float | None
    ) -> list[KernelVerdict]:
        """Refused: compound limits are synchronous only (``RedisStorage.allow_all``)."""
        raise TypeError("AsyncRedisStorage has no compound decisions yet; use RedisStorage.allow_all")

    def forget(self, config: LimiterConfig, key: str) -> None:
        """Refused: ``await storage.forget_async(limiter.config, key)``."""
        raise TypeError(_ASYNC_ONLY + "; a reset: `await storage.forget_async(limiter.config, key)`")

    def snapshot(self, config: LimiterConfig, key: str, now: float | None) -> LimiterState | None:
        """Refused: ``await storage.snapshot_async(limiter.config, key)``."""
        raise TypeError(_ASYNC_ONLY + "; a state: `await storage.snapshot_async(limiter.config, key)`")

    def __len__(self) -> int:
        """Refused: counting keys is I/O; ``await storage.count()``."""
        raise TypeError("use await storage.count()")

    def __bool__(self) -> bool:
        return True  # ``__len__`` refuses: truthiness must not ask it


# --------------------------------------------------------------------------
# Limiter glue (either twin)


def limiter_config(limiter: Any) -> LimiterConfig:
    """A limiter's validated configuration, whichever twin built it."""
    cfg = limiter.config
    if not isinstance(cfg, LimiterConfig):
        raise ValidationError(f"{type(limiter).__name__} is not a nanolimit limiter")
    return cfg


def kernel_now(limiter: Any) -> float | None:
    """What the limiter would hand a KernelStorage: None for the default
    SystemClock (use the server's TIME), else its injected clock's reading."""
    clock = limiter.clock
    if type(clock) is SystemClock:
        return None
    return check_now(clock.now())


def decision_maker(limiter: Any, cfg: LimiterConfig) -> Callable[[KernelVerdict], Any]:
    """Build the Decision type of the limiter's own twin from a verdict."""
    module = sys.modules.get(type(limiter).__module__)
    decision_type: Any = getattr(module, "Decision", None)
    if decision_type is None:  # pragma: no cover - a foreign limiter class
        from .._decision_py import Decision as py_decision

        decision_type = py_decision

    return functools.partial(decision_from_verdict, decision_type, cfg)
