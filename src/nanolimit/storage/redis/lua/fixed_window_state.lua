-- The stored state, checked (docs/redis.md, "Foreign values"): window index,
-- count and u, or nothing for a key that does not exist. Decisions and
-- refunds read it.
local function s_fixed_window(key)
  local v = redis.call('HMGET', key, 'k', 'n', 'u')
  if not v[1] then
    if v[2] or v[3] or redis.call('EXISTS', key) == 1 then
      error({err = 'BADSTATE fixed_window: a hash without the limiter fields'})
    end
    return nil
  end
  local k, count, updated = tonumber(v[1]), tonumber(v[2]), tonumber(v[3])
  if not (k and count and updated and k % 1 == 0 and k > -MAX_EXACT and k < MAX_EXACT
      and count >= 0 and count <= MAX_COUNT and count % 1 == 0
      and updated > -MAX_STAMP and updated < MAX_STAMP) then
    error({err = 'BADSTATE fixed_window: the stored state is not one this limiter writes'})
  end
  return k, count, updated
end
