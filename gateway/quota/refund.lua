-- A request's units back to the windows that counted it, if they are still current, and to
-- its account's credits: the gateway failed it (502/504), so the client is not charged.
-- KEYS[1]: the subject's counters (hash); KEYS[2]: its credits (hash); KEYS[3]: its usage events (stream). ARGV: the minute and day
-- starts it was counted in (Redis time, ms); when it was counted, if the subject has a month
-- window (0: none): the stored period is the one in force if it holds that moment; its units;
-- 1 if it paid with credits (given back as purchased credits, which never expire); the quota
-- past which units are billed as overage (0: none), and that overage's window (1: the month,
-- 2: the day); the usage events' cap (0: none) and its event's id: the refund is an event of its
-- own, cancelling that one's charge and the overage it takes back.
-- Returns the overage units taken back.
local h = redis.call('HMGET', KEYS[1], 'ms', 'mc', 'ds', 'dc', 'ps', 'pc', 'os', 'oc', 'pe', 'lo', 'ls')
local n = tonumber(ARGV[4])
local at = tonumber(ARGV[3])
local ps, pe = tonumber(h[5]) or 0, tonumber(h[9]) or 0
local inPeriod = at > 0 and ps <= at and at < pe
local sameDay = tonumber(h[3]) == tonumber(ARGV[2])
local dc, pc = math.max(0, (tonumber(h[4]) or 0) - n), math.max(0, (tonumber(h[6]) or 0) - n)
if tonumber(h[1]) == tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'mc', math.max(0, (tonumber(h[2]) or 0) - n)) end
if sameDay then redis.call('HSET', KEYS[1], 'dc', dc) end
if inPeriod then redis.call('HSET', KEYS[1], 'pc', pc) end
if tonumber(ARGV[5]) == 1 then redis.call('HINCRBY', KEYS[2], 'p', n) end
-- The overage billed is at most what is known delivered past the quota (quota.lua's bill):
-- a refunded unit takes back the overage that no longer has a delivered unit under it, at
-- most its own units, whether or not the request itself was billed as overage.
local soft, window = tonumber(ARGV[6]) or 0, tonumber(ARGV[7]) or 0
local os, oc = tonumber(h[7]), tonumber(h[8]) or 0
local over = 0
local long, start = pc, ps
if window == 2 then long, start = dc, tonumber(ARGV[2]) end
if soft > 0 and os == start and ((window == 1 and inPeriod) or (window == 2 and sameDay)) then
  local lo = (tonumber(h[11]) == start) and tonumber(h[10]) or 0
  over = math.min(n, math.max(0, oc - math.max(0, long - lo - soft)))
  if over > 0 then redis.call('HSET', KEYS[1], 'oc', oc - over) end
end
local cap = tonumber(ARGV[8]) or 0
if cap > 0 and ARGV[9] and ARGV[9] ~= '' then
  local t = redis.call('TIME')
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', cap, '*', 'kind', 'refund', 'ref', ARGV[9], 'units', n,
    'overage', over, 'at', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
return over
