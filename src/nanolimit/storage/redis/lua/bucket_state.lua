-- The stored state, checked (docs/redis.md, "Foreign values"): level and u,
-- or nothing for a key that does not exist. Decisions and refunds read it.
local function s_@ALGORITHM@(key)
  local v = redis.call('HMGET', key, 'l', 'u')
  if not v[1] then
    if v[2] or redis.call('EXISTS', key) == 1 then
      error({err = 'BADSTATE @ALGORITHM@: a hash without the limiter fields'})
    end
    return nil
  end
  local level, updated = tonumber(v[1]), tonumber(v[2])
  if not (level and updated and level >= 0 and level <= MAX_COUNT
      and updated > -MAX_STAMP and updated < MAX_STAMP) then
    error({err = 'BADSTATE @ALGORITHM@: the stored state is not one this limiter writes'})
  end
  return level, updated
end
