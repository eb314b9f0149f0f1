local id = ARGV[1]
local lid = 'lease:' .. id
local n = tonumber(ARGV[2])
local blob = ARGV[3]
local pos = 1
local shape = {}
for word in string.gmatch(ARGV[4], '%S+') do shape[#shape + 1] = tonumber(word) end
local all = shape[1] or 1
-- the members to reserve for: ARGV[i + 4] has rank shape[2i] and heartbeat
-- expiry shape[2i + 1] (ms, as the caller's last heartbeat saw it: a later
-- one only extends it); silent, by this server's clock now, once it passed
local silent, ranks = {}, {}
local now_ms = nil  -- read once, and only if an expiry needs it
for i = 5, #ARGV do
  local expiry = shape[2 * (i - 4) + 1]
  if expiry > 0 and not now_ms then
    local t = redis.call('TIME')
    now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  end
  if expiry <= 0 or expiry <= now_ms then
    silent[#silent + 1] = ARGV[i]
    ranks[#ranks + 1] = shape[2 * (i - 4)]
  end
end
local function reserved(limit, seen)  -- the blind shares of the silent members with no field in the hash
  local total = 0
  for i = 1, #silent do
    if not seen[silent[i]] then
      total = total + math.floor(limit / all)
      if ranks[i] < limit % all then total = total + 1 end
    end
  end
  return total
end
local out = {}
local totals = {}
local nkeys = #blob / 88
for i = 1, nkeys do
  local h = KEYS[i]
  local mine, limit, prev, ms, current, want, before, weight, ceiling, at, share
  mine, limit, prev, ms, current, want, before, weight, ceiling, at, share, pos =
    struct.unpack('<ddddddddddd', blob, pos)
  local counts, leases, seen = mine, 0, nil
  if #silent > 0 then seen = {} end  -- who has a field here: a silent member with one has its own
  local flat = redis.call('HGETALL', h)
  for j = 1, #flat, 2 do
    local f = flat[j]
    if f ~= id and f ~= lid then  -- ours: the count sent replaces it, the lease is re-granted
      if string.byte(f, 1) == 108 and string.sub(f, 1, 6) == 'lease:' then
        leases = leases + tonumber(flat[j + 1])
        if seen then seen[string.sub(f, 7)] = true end
      else
        counts = counts + tonumber(flat[j + 1])
        if seen then seen[f] = true end
      end
    end
  end
  totals[i] = counts
  if before > 0 then  -- the previous window, read in this very call: its fleet total now
    local weighted = totals[before] * weight
    if weighted > prev then prev = weighted end
  end
  local lease, held = 0, 0
  if current == 1 then
    local rem = limit - prev - counts - leases
    if seen then rem = rem - reserved(limit, seen) end
    if rem > 0 then
      lease = math.ceil(rem / n)
      if want > lease then lease = math.min(want, rem) end
    end
    -- until this reply lands we may still admit up to the ceiling in use: held
    -- for us until our next sync, which reports the lease granted here instead
    held = ceiling - mine
    if lease > held then held = lease end
  end
  redis.call('HSET', h, id, mine, lid, held)
  -- the expiry is the window's end by the wall clock: set once, when the hash
  -- is made (a negative ms, a window of an injected clock, refreshes it)
  if ms < 0 then redis.call('PEXPIRE', h, -ms) elseif #flat == 0 then redis.call('PEXPIRE', h, ms) end
  local claimed = 0
  if at > 0 then  -- our default share of the next window, reserved before we spend it there
    local nh = KEYS[at]
    if redis.call('HEXISTS', nh, id) == 0 then
      redis.call('HSET', nh, lid, share)
      redis.call('PEXPIRE', nh, 2 * math.abs(ms))  -- it outlives one more window
    end
    claimed = 1
  end
  out[#out + 1] = counts
  out[#out + 1] = lease
  out[#out + 1] = claimed
end
return out
