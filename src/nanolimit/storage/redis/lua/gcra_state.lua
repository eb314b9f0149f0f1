-- The stored state, checked (docs/redis.md, "Foreign values"): the TAT (µs)
-- and u, or nothing for a key that does not exist. Decisions and refunds read it.
local function s_gcra(key)
  local v = redis.call('GET', key)
  if not v then return nil end
  local tat, updated
  local sp = string.find(v, ' ', 1, true)
  if sp then tat = tonumber(string.sub(v, 1, sp - 1)); updated = tonumber(string.sub(v, sp + 1)) end
  if not (tat and updated and tat % 1 == 0 and tat > -MAX_EXACT and tat < MAX_EXACT
      and updated > -MAX_STAMP and updated < MAX_STAMP) then
    error({err = 'BADSTATE gcra: the stored state is not one this limiter writes'})
  end
  return tat, updated
end
