-- A request's units back to the windows that counted it, if they are still current, and to
-- its account's credits: the gateway failed it (502/504), so the client is not charged.
-- Wires named in script.ts (REFUND). KEY: the subject's counters, credits and usage events.
-- ARG: the minute and day starts it was counted in (Redis time, ms); `countedAt`, if the
-- subject has a month window (0: none): the stored period is the one in force if it holds that
-- moment; its units; `paidWithCredits` (given back as purchased credits, which never expire);
-- `soft`, the quota past which units are billed as overage (0: none), and `overageWindow` (1:
-- the month, 2: the day); `eventsCap` (0: none) and `eventId`: the refund is an event of its
-- own, cancelling that one's charge and the overage it takes back.
-- Returns the overage units taken back.
local h = redis.call('HMGET', KEY.counters, 'ms', 'mc', 'ds', 'dc', 'ps', 'pc', 'os', 'oc', 'pe', 'lo', 'ls')
local n = tonumber(ARG.units)
local at = tonumber(ARG.countedAt)
local ps, pe = tonumber(h[5]) or 0, tonumber(h[9]) or 0
local inPeriod = at > 0 and ps <= at and at < pe
local sameDay = tonumber(h[3]) == tonumber(ARG.dayStart)
local dc, pc = math.max(0, (tonumber(h[4]) or 0) - n), math.max(0, (tonumber(h[6]) or 0) - n)
if tonumber(h[1]) == tonumber(ARG.minuteStart) then redis.call('HSET', KEY.counters, 'mc', math.max(0, (tonumber(h[2]) or 0) - n)) end
if sameDay then redis.call('HSET', KEY.counters, 'dc', dc) end
if inPeriod then redis.call('HSET', KEY.counters, 'pc', pc) end
if tonumber(ARG.paidWithCredits) == 1 then redis.call('HINCRBY', KEY.credits, 'p', n) end
-- The overage billed is at most what is known delivered past the quota (quota.lua's bill):
-- a refunded unit takes back the overage that no longer has a delivered unit under it, at
-- most its own units, whether or not the request itself was billed as overage.
local soft, window = tonumber(ARG.soft) or 0, tonumber(ARG.overageWindow) or 0
local os, oc = tonumber(h[7]), tonumber(h[8]) or 0
local over = 0
local long, start = pc, ps
if window == 2 then long, start = dc, tonumber(ARG.dayStart) end
if soft > 0 and os == start and ((window == 1 and inPeriod) or (window == 2 and sameDay)) then
  local lo = (tonumber(h[11]) == start) and tonumber(h[10]) or 0
  over = math.min(n, math.max(0, oc - math.max(0, long - lo - soft)))
  if over > 0 then redis.call('HSET', KEY.counters, 'oc', oc - over) end
end
local cap = tonumber(ARG.eventsCap) or 0
if cap > 0 and ARG.eventId and ARG.eventId ~= '' then
  local t = redis.call('TIME')
  redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', 'kind', 'refund', 'ref', ARG.eventId, 'units', n,
    'overage', over, 'at', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
return over
