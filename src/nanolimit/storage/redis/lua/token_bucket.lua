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
