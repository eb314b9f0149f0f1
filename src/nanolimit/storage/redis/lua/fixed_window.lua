local function k_fixed_window(key, clock, cost, commit, floor_ms, capacity, window)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local v = redis.call('HMGET', key, 'k', 'n', 'u')
  local k, count, updated
  local moved = not v[1]  -- k must be written: a new key, or (below) a new window
  if v[1] then
    k = tonumber(v[1]); count = tonumber(v[2]); updated = tonumber(v[3])
    if not (k and count and updated and k % 1 == 0 and k > -MAX_EXACT and k < MAX_EXACT
        and count >= 0 and count <= MAX_COUNT and count % 1 == 0
        and updated > -MAX_STAMP and updated < MAX_STAMP) then
      error({err = 'BADSTATE fixed_window: the stored state is not one this limiter writes'})
    end
    if updated - clock > MAX_LEAD then  -- the clock's error: back by as many windows, count kept
      rebased = true
      k = k - (math.floor(updated / window) - math.floor(clock / window))
      updated = clock
      moved = true
    end
  elseif v[2] or v[3] or redis.call('EXISTS', key) == 1 then
    error({err = 'BADSTATE fixed_window: a hash without the limiter fields'})
  else k = math.floor(clock / window); count = 0; updated = clock end
  local now = clock
  if updated > now then now = updated end
  local index = math.floor(now / window)
  if index ~= k then k = index; count = 0; moved = true end
  local start = k * window
  local retry = 0.0
  local allowed = count + cost <= capacity
  if allowed then count = count + cost else retry = start + window - now end
  local reset = 0.0
  if count > 0 then reset = start + window - now end
  local extra = now - clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
  end
  if commit then
    -- only the fields that changed: the others hold these very values already
    if moved then redis.call('HSET', key, 'k', k, 'n', count, 'u', now)
    elseif allowed then redis.call('HSET', key, 'n', count, 'u', now)
    else redis.call('HSET', key, 'u', now) end
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0', capacity - count, reset), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0', capacity - count, retry, reset), rebased
end
