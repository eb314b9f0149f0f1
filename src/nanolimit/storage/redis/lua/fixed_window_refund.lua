local function r_fixed_window(key, clock, at, cost, floor_ms, capacity, window)
  local k, count, updated = s_fixed_window(key)
  if not k then return 0 end
  local now = clock
  if updated > now then now = updated end
  if at == nil then at = updated end
  local index = math.floor(now / window)
  if index ~= k then k = index; count = 0 end
  if math.floor(at / window) == k then  -- else it expired with its window
    if cost > count then count = 0 else count = count - cost end
  end
  local start = k * window
  local reset = 0.0
  if count > 0 then reset = start + window - now end
  if reset > 0 and now > clock then reset = reset + (now - clock) end
  redis.call('HSET', key, 'k', k, 'n', count, 'u', now)
  redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  return 1
end
