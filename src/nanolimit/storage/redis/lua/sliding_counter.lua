local function k_sliding_counter(key, clock, cost, commit, floor_ms, capacity, window)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local k, count, previous, updated = s_sliding_counter(key)
  local moved = not k  -- k and p must be written: a new key, or (below) a new window
  if not k then k = math.floor(clock / window); count = 0; previous = 0; updated = clock
  elseif updated - clock > MAX_LEAD then  -- the clock's error: back by as many windows, counts kept
    rebased = true
    k = k - (math.floor(updated / window) - math.floor(clock / window))
    updated = clock
    moved = true
  end
  local now = clock
  if updated > now then now = updated end
  local index = math.floor(now / window)
  if index ~= k then
    if index == k + 1 then previous = count else previous = 0 end
    count = 0
    k = index
    moved = true
  end
  local start = k * window
  local weight = 1.0 - (now - start) / window
  local estimate = previous * weight + count
  local retry = 0.0
  local remaining
  local allowed = estimate + cost <= capacity
  if allowed then
    count = count + cost
    remaining = capacity - estimate - cost
  else
    remaining = capacity - estimate
    local room = capacity - count - cost
    if previous <= 0 or room < 0 then retry = start + window - now
    else retry = start + window * (1.0 - room / previous) - now end
  end
  local reset = 0.0
  if count > 0 then reset = start + 2.0 * window - now
  elseif previous > 0 then reset = start + window - now end
  local extra = now - clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
  end
  local u = string.format('%.17g', now)  -- stored and answered: formatted once
  if commit then
    -- only the fields that changed: the others hold these very values already
    if moved then redis.call('HSET', key, 'k', k, 'n', count, 'p', previous, 'u', u)
    elseif allowed then redis.call('HSET', key, 'n', count, 'u', u)
    else redis.call('HSET', key, 'u', u) end
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0 %s', remaining, reset, u), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0 %s', remaining, retry, reset, u), rebased
end
