local kernels = {[0] = k_token_bucket, k_leaky_bucket, k_fixed_window, k_sliding_counter,
  k_gcra, k_sliding_log}
local n = tonumber(ARGV[1])
local server_now = nil
local clocks = {}
for i = 1, n do
  local arg = ARGV[2 + (i - 1) * 7 + 1]
  if arg == '' then
    if server_now == nil then server_now = server_time() end
    clocks[i] = server_now
  else clocks[i] = tonumber(arg) end
end
local failed = {}
local rebased = {}
local function run(commit)
  local out = {}
  local all = true
  for i = 1, n do
    local b = 2 + (i - 1) * 7
    local ok, a, verdict = true, ARGV[b + 6] == '1', failed[i]
    if not verdict then
      ok, a, verdict, rebased[i] = pcall(kernels[tonumber(ARGV[b])], KEYS[i], clocks[i],
        tonumber(ARGV[b + 2]), commit, tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]))
      if not ok then
        verdict = error_text(a)
        failed[i] = verdict
        a = ARGV[b + 6] == '1'
      end
    end
    if not a then all = false end
    out[i] = verdict
  end
  return all, out
end
local all, out = run(false)
if all then all, out = run(true)
else
  -- Denied: nothing is charged, but a key the clock-lead rule moved back is
  -- stored moved (decided at cost 0, which charges nothing); else every
  -- compound would move it back again from the clock's new time, and it
  -- would never refill (reference.InMemoryStorage.allow_all alike).
  for i = 1, n do
    if rebased[i] and not failed[i] then
      local b = 2 + (i - 1) * 7
      pcall(kernels[tonumber(ARGV[b])], KEYS[i], clocks[i], 0, true,
        tonumber(ARGV[b + 3]), tonumber(ARGV[b + 4]), tonumber(ARGV[b + 5]))
    end
  end
end
return out
