local function r_leaky_bucket(key, clock, at, cost, floor_ms, capacity, rate)
  local level, updated = s_leaky_bucket(key)
  if not level then return 0 end
  local now = clock
  if updated > now then now = updated end
  level = level - (now - updated) * rate
  if level < 0.0 then level = 0.0 end
  level = level - cost
  if level < 0.0 then level = 0.0 end
  local reset = level / rate
  if reset > 0 and now > clock then reset = reset + (now - clock) end
  redis.call('HSET', key, 'l', level, 'u', now)
  redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  return 1
end
