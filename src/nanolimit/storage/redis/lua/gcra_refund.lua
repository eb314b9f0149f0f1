local function r_gcra(key, clock, at, cost, floor_ms, interval, tolerance)
  local tat, updated = s_gcra(key)
  if not tat then return 0 end
  local now = clock
  if updated > now then now = updated end
  local now_us = math.floor(now * 1000000.0)
  tat = tat - interval * cost
  if tat < now_us then tat = now_us end  -- never more room than a fresh key's
  local reset = (tat - now_us) / 1000000.0
  if reset > 0 and now > clock then reset = reset + (now - clock) end
  redis.call('SET', key, string.format('%.17g %.17g', tat, now), 'PX', expiry_ms(reset, floor_ms))
  return 1
end
