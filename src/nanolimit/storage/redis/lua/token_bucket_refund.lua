local function r_token_bucket(key, clock, at, cost, floor_ms, capacity, rate)
  local level, updated = s_token_bucket(key)
  if not level then return 0 end
  local now = clock
  if updated > now then now = updated end
  level = level + (now - updated) * rate
  if level > capacity then level = capacity end
  level = level + cost
  if level > capacity then level = capacity end
  local reset = (capacity - level) / rate
  if reset > 0 and now > clock then reset = reset + (now - clock) end
  redis.call('HSET', key, 'l', string.format('%.17g', level), 'u', string.format('%.17g', now))
  redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  return 1
end
