local function k_sliding_counter(key, clock, cost, commit, floor_ms, capacity, window)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local v = redis.call('HMGET', key, 'k', 'n', 'p', 'u')
  local k, count, previous, updated
  local moved = not v[1]  -- k and p must be written: a new key, or (below) a new window
  if v[1] then
    k = tonumber(v[1]); count = tonumber(v[2]); previous = tonumber(v[3]); updated = tonumber(v[4])
    if not (k and count and previous and updated and k % 1 == 0 and k > -MAX_EXACT and k < MAX_EXACT
        and count >= 0 and count <= MAX_COUNT and count % 1 == 0
        and previous >= 0 and previous <= MAX_COUNT and previous % 1 == 0
        and updated > -MAX_STAMP and updated < MAX_STAMP) then
      error({err = 'BADSTATE sliding_counter: the stored state is not one this limiter writes'})
    end
    if updated - clock > MAX_LEAD then  -- the clock's error: back by as many windows, counts kept
      rebased = true
      k = k - (math.floor(updated / window) - math.floor(clock / window))
      updated = clock
      moved = true
    end
  elseif v[2] or v[3] or v[4] or redis.call('EXISTS', key) == 1 then
    error({err = 'BADSTATE sliding_counter: a hash without the limiter fields'})
  else k = math.floor(clock / window); count = 0; previous = 0; updated = clock end
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
  if commit then
    -- only the fields that changed: the others hold these very values already
    if moved then redis.call('HSET', key, 'k', k, 'n', count, 'p', previous, 'u', now)
    elseif allowed then redis.call('HSET', key, 'n', count, 'u', now)
    else redis.call('HSET', key, 'u', now) end
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0', remaining, reset), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0', remaining, retry, reset), rebased
end
