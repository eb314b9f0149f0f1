local function k_token_bucket(key, clock, cost, commit, floor_ms, capacity, rate)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local level, updated = s_token_bucket(key)
  if not level then level = capacity; updated = clock
  elseif updated - clock > MAX_LEAD then  -- the clock's error: the level (debt) stays
    updated = clock; rebased = true
  end
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
  -- the level and the time go both into the state and into the reply: format
  -- each once (what Redis 7.0 would store for the number; newer servers read
  -- it back exactly)
  local l, u = string.format('%.17g', level), string.format('%.17g', now)
  if commit then
    redis.call('HSET', key, 'l', l, 'u', u)
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %s 0 %.17g 0 %s', l, reset, u), rebased end
  return false, string.format('0 %s %.17g %.17g 0 %s', l, retry, reset, u), rebased
end
