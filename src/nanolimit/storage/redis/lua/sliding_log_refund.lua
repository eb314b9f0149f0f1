local function r_sliding_log(key, clock, at, cost, floor_ms, capacity, window)
  local total, updated = s_sliding_log(key)
  if total == 0 then return 0 end
  local n = total - 1
  local limit = updated + MAX_LEAD
  local now = clock
  if updated > now then now = updated end
  if at == nil then at = updated end
  -- drop the entries over the capacity, then the expired, as a decision does
  local pos = 1
  if n > capacity then pos = 1 + n - capacity end
  local cutoff = now - window
  pos = log_live(key, pos, n, cutoff, limit, nil)
  local drop = pos - 1
  local live = n - drop
  -- Oldest first, so the stamps equal to ``at`` are one run: read from the
  -- tail past the newer stamps to the end of that run (all reads before any
  -- write). The common case, the latest decision refunded, reads cost + 1.
  local newer, run, tail, below = 0, 0, nil, nil
  local seen, size = 0, cost + 1
  if at > cutoff then
    while seen < live and not below do
      local first = seen + size
      if first > live then first = live end
      local chunk = redis.call('LRANGE', key, -first, -seen - 1)
      for i = #chunk, 1, -1 do
        local s = log_stamp(chunk[i], limit, nil)
        if not tail then tail = s end
        if s > at and run == 0 then newer = newer + 1
        elseif s == at then run = run + 1
        else below = s; break end
      end
      seen = first
      size = 64
    end
  elseif live > 0 then
    tail = log_stamp(redis.call('LINDEX', key, -1), limit, nil)
  end
  local k = run
  if k > cost then k = cost end
  local newest = below
  if newer > 0 or (live > 0 and k == 0) then newest = tail elseif run > k then newest = at end
  if drop > 0 then redis.call('LTRIM', key, drop, -1) end
  redis.call('LSET', key, 0, string.format('%.17g', now))
  if k > 0 and newer == 0 then redis.call('LTRIM', key, 0, -k - 1)
  elseif k > 0 then  -- inside the list: blank the k, then remove the blanks (no stamp is '')
    for j = 1, k do redis.call('LSET', key, -newer - j, '') end
    redis.call('LREM', key, -k, '')
  end
  local reset = 0.0
  if newest then reset = newest + window - now end
  if reset > 0 and now > clock then reset = reset + (now - clock) end
  redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  return 1
end
