local clock
if ARGV[1] == '' then clock = server_time() else clock = tonumber(ARGV[1]) end
local _, verdict = k_@ALGORITHM@(KEYS[1], clock, tonumber(ARGV[2]), ARGV[3] == '1',
  tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))
return verdict
