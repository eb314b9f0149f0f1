local function k_fixed_window(key, clock, cost, commit, floor_ms, capacity, window)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local k, count, updated = s_fixed_window(key)
  local moved = not k  -- k must be written: a new key, or (below) a new window
  if not k then k = math.floor(clock / window); count = 0; updated = clock
  elseif updated - clock > MAX_LEAD then  -- the clock's error: back by as many windows, count kept
    rebased = true
    k = k - (math.floor(updated / window) - math.floor(clock / window))
    updated = clock
    moved = true
  end
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
  local u = string.format('%.17g', now)  -- stored and answered: formatted once
  if commit then
    -- only the fields that changed: the others hold these very values already
    if moved then redis.call('HSET', key, 'k', k, 'n', count, 'u', u)
    elseif allowed then redis.call('HSET', key, 'n', count, 'u', u)
    else redis.call('HSET', key, 'u', u) end
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0 %s', capacity - count, reset, u), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0 %s', capacity - count, retry, reset, u), rebased
end
