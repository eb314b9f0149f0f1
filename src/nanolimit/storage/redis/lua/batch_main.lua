local clock
if ARGV[1] == '' then clock = server_time() else clock = tonumber(ARGV[1]) end
local floor_ms, p1, p2 = tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local out = {}
for i = 1, #KEYS do
  local ok, e, verdict = pcall(k_@ALGORITHM@, KEYS[i], clock, tonumber(ARGV[4 + i]), true, floor_ms, p1, p2)
  if ok then out[i] = verdict else out[i] = error_text(e) end
end
return out
