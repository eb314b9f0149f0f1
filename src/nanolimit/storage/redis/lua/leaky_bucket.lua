local function k_leaky_bucket(key, clock, cost, commit, floor_ms, capacity, rate)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local level, updated = s_leaky_bucket(key)
  if not level then level = 0.0; updated = clock
  elseif updated - clock > MAX_LEAD then  -- the clock's error: the level (debt) stays
    updated = clock; rebased = true
  end
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
  local u = string.format('%.17g', now)  -- stored and answered: formatted once
  if commit then
    redis.call('HSET', key, 'l', level, 'u', u)
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g %.17g %s', remaining, reset, delay, u), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0 %s', remaining, retry, reset, u), rebased
end
