local id = ARGV[1]
local lid = 'lease:' .. id
local n = tonumber(ARGV[2])
local spec = {}
for word in string.gmatch(ARGV[3], '%S+') do spec[#spec + 1] = word end
local shape = {}
for word in string.gmatch(ARGV[4], '%S+') do shape[#shape + 1] = tonumber(word) end
local all = shape[1] or 1
local silent = {}  -- the silent members' ids; shape[i + 1] is silent[i]'s rank
for i = 5, #ARGV do silent[#silent + 1] = ARGV[i] end
local function reserved(limit, seen)  -- the blind shares of the silent members with no field in the hash
  local total = 0
  for i = 1, #silent do
    if not seen[silent[i]] then
      total = total + math.floor(limit / all)
      if shape[i + 1] < limit % all then total = total + 1 end
    end
  end
  return total
end
local out = {}
local totals = {}
for i = 1, #spec / 11 do
  local h = KEYS[i]
  local b = (i - 1) * 11
  local mine = tonumber(spec[b + 1])
  local limit = tonumber(spec[b + 2])
  local prev = tonumber(spec[b + 3])
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
  local before = tonumber(spec[b + 7])
  if before > 0 then  -- the previous window, read in this very call: its fleet total now
    local weighted = totals[before] * tonumber(spec[b + 8])
    if weighted > prev then prev = weighted end
  end
  local lease, held = 0, 0
  if spec[b + 5] == '1' then
    local rem = limit - prev - counts - leases
    if seen then rem = rem - reserved(limit, seen) end
    if rem > 0 then
      lease = math.ceil(rem / n)
      local want = tonumber(spec[b + 6])
      if want > lease then lease = math.min(want, rem) end
    end
    -- until this reply lands we may still admit up to the ceiling in use: held
    -- for us until our next sync, which reports the lease granted here instead
    held = tonumber(spec[b + 9]) - mine
    if lease > held then held = lease end
  end
  redis.call('HSET', h, id, spec[b + 1], lid, held)
  redis.call('PEXPIRE', h, spec[b + 4])
  local claimed = 0
  local at = tonumber(spec[b + 10])
  if at > 0 then  -- our default share of the next window, reserved before we spend it there
    local nh = KEYS[at]
    if redis.call('HEXISTS', nh, id) == 0 then
      redis.call('HSET', nh, lid, spec[b + 11])
      redis.call('PEXPIRE', nh, 2 * tonumber(spec[b + 4]))  -- it outlives one more window
    end
    claimed = 1
  end
  out[#out + 1] = counts
  out[#out + 1] = lease
  out[#out + 1] = claimed
end
return out
