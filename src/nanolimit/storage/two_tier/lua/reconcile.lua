local id = ARGV[1]
local lid = 'lease:' .. id
local n = tonumber(ARGV[2])
local spec = {}
for word in string.gmatch(ARGV[3], '%S+') do spec[#spec + 1] = word end
local silent = {}
for word in string.gmatch(ARGV[4], '%S+') do silent[#silent + 1] = tonumber(word) end
local function reserved(limit)  -- the silent members' blind shares of this limit
  if #silent < 2 then return 0 end
  local all, total = silent[1], 0
  for i = 2, #silent do
    total = total + math.floor(limit / all)
    if silent[i] < limit % all then total = total + 1 end
  end
  return total
end
local out = {}
local totals = {}
for i = 1, #KEYS do
  local h = KEYS[i]
  local b = (i - 1) * 8
  local mine = spec[b + 1]
  local counts, leases = tonumber(mine), 0
  local limit = tonumber(spec[b + 2])
  local prev = tonumber(spec[b + 3])
  local flat = redis.call('HGETALL', h)
  for j = 1, #flat, 2 do
    local f = flat[j]
    if f ~= id and f ~= lid then  -- ours: the count sent replaces it, the lease is re-granted
      if string.byte(f, 1) == 108 and string.sub(f, 1, 6) == 'lease:' then
        leases = leases + tonumber(flat[j + 1])
      else
        counts = counts + tonumber(flat[j + 1])
      end
    end
  end
  totals[i] = counts
  local before = tonumber(spec[b + 7])
  if before > 0 then  -- the previous window, read in this very call: its fleet total now
    local weighted = totals[before] * tonumber(spec[b + 8])
    if weighted > prev then prev = weighted end
  end
  local lease = 0
  local rem = limit - prev - counts - leases - reserved(limit)
  if spec[b + 5] == '1' and rem > 0 then
    lease = math.ceil(rem / n)
    local want = tonumber(spec[b + 6])
    if want > lease then lease = math.min(want, rem) end
  end
  redis.call('HSET', h, id, mine, lid, lease)
  redis.call('PEXPIRE', h, spec[b + 4])
  out[#out + 1] = counts
  out[#out + 1] = lease
end
return out
