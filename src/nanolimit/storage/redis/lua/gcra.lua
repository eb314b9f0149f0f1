local function k_gcra(key, clock, cost, commit, floor_ms, interval, tolerance)
  local rebased = false  -- moved back by the clock-lead rule (a denied compound stores it)
  local tat, updated = s_gcra(key)
  if not tat then tat = math.floor(clock * 1000000.0); updated = clock
  elseif updated - clock > MAX_LEAD then  -- the clock's error: back by as many whole µs, backlog kept
    rebased = true
    tat = tat - (math.floor(updated * 1000000.0) - math.floor(clock * 1000000.0))
    updated = clock
  end
  local now = clock
  if updated > now then now = updated end
  local now_us = math.floor(now * 1000000.0)
  local backlog = tat - now_us
  if backlog < 0 then backlog = 0 end
  local need = interval * cost
  local retry = 0.0
  -- integer arithmetic, rearranged only so that no partial sum passes 2^53
  local allowed = need <= tolerance - backlog
  if allowed then
    backlog = backlog + need
    tat = now_us + backlog
  else
    retry = (backlog - tolerance + need) / 1000000.0
  end
  local left = tolerance - backlog
  local remaining = math.floor(left / interval)
  if remaining * interval > left then remaining = remaining - 1 end
  if (remaining + 1) * interval <= left then remaining = remaining + 1 end
  local reset = backlog / 1000000.0
  local extra = now - clock
  if extra > 0 then
    if retry > 0 then retry = retry + extra end
    if reset > 0 then reset = reset + extra end
  end
  local u = string.format('%.17g', now)  -- stored and answered: formatted once
  if commit then
    redis.call('SET', key, string.format('%.17g %s', tat, u), 'PX', expiry_ms(reset, floor_ms))
  end
  if allowed then return true, string.format('1 %.17g 0 %.17g 0 %s', remaining, reset, u), rebased end
  return false, string.format('0 %.17g %.17g %.17g 0 %s', remaining, retry, reset, u), rebased
end
