local clock
if ARGV[1] == '' then clock = server_time() else clock = tonumber(ARGV[1]) end
local at = nil
if ARGV[2] ~= '' then at = tonumber(ARGV[2]) end
return r_@ALGORITHM@(KEYS[1], clock, at, tonumber(ARGV[3]), tonumber(ARGV[4]),
  tonumber(ARGV[5]), tonumber(ARGV[6]))
