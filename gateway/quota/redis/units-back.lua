-- A library prepended to refund.lua and usagebatch.lua: a refunded request's units back to its
-- counters. `n` units counted at `at` (Redis time, ms) go back to each fixed window (FIXED,
-- windows.ts) still the stored one, and with `month` 1 to the stored period if it holds `at`.
-- `soft`: the quota past which units are billed as overage (0: none), `window` its window (1: the
-- month, 2: the day). Returns the overage units taken back.
local function units_back(key, n, at, month, soft, window)
  local h = read_counters(key, {'ps', 'pc', 'os', 'oc', 'pe', 'lo', 'ls'})
  local ps, pe = tonumber(h.ps) or 0, tonumber(h.pe) or 0
  local inPeriod = month == 1 and ps <= at and at < pe
  local current = {}
  for _, w in ipairs(FIXED) do
    current[w.name] = tonumber(h[w.start]) == at - at % w.len
    if current[w.name] then redis.call('HSET', key, w.count, math.max(0, (tonumber(h[w.count]) or 0) - n)) end
  end
  local dc, pc = math.max(0, (tonumber(h[FIXED.day.count]) or 0) - n), math.max(0, (tonumber(h.pc) or 0) - n)
  if inPeriod then redis.call('HSET', key, 'pc', pc) end
  -- The overage billed is at most what is known delivered past the quota (quota.lua's bill):
  -- a refunded unit takes back the overage that no longer has a delivered unit under it, at
  -- most its own units, whether or not the request itself was billed as overage.
  local os, oc = tonumber(h.os), tonumber(h.oc) or 0
  local long, start = pc, ps
  if window == 2 then long, start = dc, at - at % FIXED.day.len end
  if soft > 0 and os == start and ((window == 1 and inPeriod) or (window == 2 and current.day)) then
    local lo = (tonumber(h.ls) == start) and tonumber(h.lo) or 0
    local over = math.min(n, math.max(0, oc - math.max(0, long - lo - soft)))
    if over > 0 then redis.call('HSET', key, 'oc', oc - over) end
    return over
  end
  return 0
end
