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
-- The stored state's length and its u, checked (docs/redis.md, "Foreign
-- values"); 0 for a key that does not exist. Decisions and refunds read it.
local function s_sliding_log(key)
  local total = redis.call('LLEN', key)
  if total == 0 then return 0 end
  local updated = tonumber(redis.call('LINDEX', key, 0))
  if not (updated and updated > -MAX_STAMP and updated < MAX_STAMP) then
    error({err = 'BADSTATE sliding_log: the stored state is not one this limiter writes'})
  end
  return total, updated
end
-- The list index of the first entry from ``pos`` on (entries sit at 1..n)
-- that is not expired, past n when all are: the common case, nothing
-- expired, costs one LINDEX; else the head is scanned in chunks.
local function log_live(key, pos, n, cutoff, limit, shift)
  local scan = pos <= n and log_stamp(redis.call('LINDEX', key, pos), limit, shift) <= cutoff
  while scan and pos <= n do
    local chunk = redis.call('LRANGE', key, pos, pos + 63)
    local i = 1
    while i <= #chunk and log_stamp(chunk[i], limit, shift) <= cutoff do i = i + 1 end
    pos = pos + i - 1
    if i <= #chunk then break end
  end
  return pos
end
