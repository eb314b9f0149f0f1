local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
local grace = tonumber(ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - grace)  -- silent for longer than the grace
local added = redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
redis.call('PEXPIRE', KEYS[1], (grace + ttl) * 2)
local flat = redis.call('ZRANGE', KEYS[1], 0, -1, 'WITHSCORES')
local members, expiry = {}, {}
for i = 1, #flat, 2 do
  members[#members + 1] = flat[i]
  expiry[flat[i]] = tonumber(flat[i + 1])
end
table.sort(members)
local rank, silent, expiries = 0, {}, {}
for i = 1, #members do
  if members[i] == ARGV[1] then rank = i - 1 end
  if expiry[members[i]] <= now then silent[#silent + 1] = i - 1 end
  expiries[i] = expiry[members[i]]
end
return {#members - #silent, added, rank, #members, table.concat(silent, ' '), members, expiries, now}
