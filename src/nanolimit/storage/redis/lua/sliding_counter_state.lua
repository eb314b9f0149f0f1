-- The stored state, checked (docs/redis.md, "Foreign values"): window index,
-- count, previous count and u, or nothing for a key that does not exist.
-- Decisions and refunds read it.
local function s_sliding_counter(key)
  local v = redis.call('HMGET', key, 'k', 'n', 'p', 'u')
  if not v[1] then
    if v[2] or v[3] or v[4] or redis.call('EXISTS', key) == 1 then
      error({err = 'BADSTATE sliding_counter: a hash without the limiter fields'})
    end
    return nil
  end
  local k, count, previous, updated = tonumber(v[1]), tonumber(v[2]), tonumber(v[3]), tonumber(v[4])
  if not (k and count and previous and updated and k % 1 == 0 and k > -MAX_EXACT and k < MAX_EXACT
      and count >= 0 and count <= MAX_COUNT and count % 1 == 0
      and previous >= 0 and previous <= MAX_COUNT and previous % 1 == 0
      and updated > -MAX_STAMP and updated < MAX_STAMP) then
    error({err = 'BADSTATE sliding_counter: the stored state is not one this limiter writes'})
  end
  return k, count, previous, updated
end
