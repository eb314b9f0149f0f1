local MAX_LEAD = @MAX_LEAD@
local MAX_STAMP = @MAX_STAMP@
local MAX_COUNT = @MAX_COUNT@
local MAX_EXACT = 9007199254740992
-- TIME's two strings; Lua's arithmetic converts them exactly as tonumber would
local function server_time()
  local t = redis.call('TIME')
  return t[1] + t[2] / 1000000
end
local function expiry_ms(reset_after, floor_ms)
  local ms = math.ceil(reset_after * 1000) + 1
  if ms < floor_ms then ms = floor_ms end
  if ms < 1 then ms = 1 end
  if ms > MAX_EXACT then ms = MAX_EXACT end  -- printed in full by %.17g, and far from PEXPIRE's overflow
  return ms
end
