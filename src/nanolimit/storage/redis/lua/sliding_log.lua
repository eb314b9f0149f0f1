local function k_sliding_log(key, clock, cost, commit, floor_ms, capacity, window)
  local total, updated = s_sliding_log(key)
  local n = 0
  local limit, shift = 0, nil
  if total == 0 then updated = clock
  else
    n = total - 1
    limit = updated + MAX_LEAD
    if updated - clock > MAX_LEAD then  -- the clock's error: every stamp back by the lead
      shift = updated - clock
      updated = clock
    end
  end
  local now = clock
  if updated > now then now = updated end
  -- drop the entries over the capacity, then the expired
  local pos = 1
  if n > capacity then pos = 1 + n - capacity end
  pos = log_live(key, pos, n, now - window, limit, shift)
  local drop = pos - 1
  local len = n - drop
  local retry = 0.0
  local remaining = 0.0
  local newest = nil
  local allowed = len + cost <= capacity
  if allowed then
    len = len + cost
    remaining = capacity - len
    newest = now
  else
    retry = log_stamp(redis.call('LINDEX', key, pos + len + cost - capacity - 1), limit, shift) + window - now
    if len > 0 then newest = log_stamp(redis.call('LINDEX', key, -1), limit, shift) end
  end
  local reset = 0.0
  if newest then reset = newest + window - now end
  local extra = now - clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
  end
  local stamp = string.format('%.17g', now)  -- stored and answered: formatted once
  if commit then
    if total == 0 then redis.call('RPUSH', key, stamp)
    elseif shift then
      -- rebased: the kept entries (list indices pos..n) go to the tail moved
      -- back by the lead, then everything before them is dropped and the new
      -- u goes in front (a write refused for memory fails at the first RPUSH,
      -- before anything changed)
      local at = pos
      while at <= n do
        local last = at + 4095
        if last > n then last = n end
        local chunk = redis.call('LRANGE', key, at, last)
        local moved = {}
        for i = 1, #chunk do moved[i] = string.format('%.17g', log_stamp(chunk[i], limit, shift)) end
        redis.call('RPUSH', key, unpack(moved))
        at = last + 1
      end
      redis.call('LTRIM', key, n + 1, -1)
      redis.call('LPUSH', key, stamp)
    else
      if drop > 0 then redis.call('LTRIM', key, drop, -1) end
      redis.call('LSET', key, 0, stamp)
    end
    if allowed and cost == 1 then redis.call('RPUSH', key, stamp)
    elseif allowed then
      local batch = {}
      local size = cost
      if size > 4096 then size = 4096 end
      for i = 1, size do batch[i] = stamp end
      local left = cost
      while left > 0 do
        if left < size then
          local part = {}
          for i = 1, left do part[i] = stamp end
          batch = part
        end
        redis.call('RPUSH', key, unpack(batch))
        left = left - #batch
      end
    end
    redis.call('PEXPIRE', key, expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0 %s', remaining, reset, stamp), shift ~= nil end
  return false, string.format('0 0 %.17g %.17g 0 %s', retry, reset, stamp), shift ~= nil
end
