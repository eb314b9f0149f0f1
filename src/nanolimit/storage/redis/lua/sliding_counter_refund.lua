local function r_sliding_counter(key, clock, at, cost, floor_ms, capacity, window)
  local k, count, previous, updated = s_sliding_counter(key)
  if not k then return 0 end
  local now = clock
  if updated > now then now = updated end
  if at == nil then at = updated end
  local index = math.floor(now / window)
  if index ~= k then
    if index == k + 1 then previous = count else previous = 0 end
    count = 0
    k = index
  end
  local charged = math.floor(at / window)
  if charged == k then
    if cost > count then count = 0 else count = count - cost end
  elseif charged == k - 1 then
    if cost > previous then previous = 0 else previous = previous - cost end
  end
  local start = k * window
  local reset = 0.0
  if count > 0 then reset = start + 2.0 * window - now
  elseif previous > 0 then reset = start + window - now end
  if reset > 0 and now > clock then reset = reset + (now - clock) end
  redis.call('HSET', key, 'k', k, 'n', count, 'p', previous, 'u', now)
  redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  return 1
end
