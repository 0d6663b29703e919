-- A request's units back to the windows that counted it, if they are still current, and to
-- its account's credits: the gateway failed it (502/504), so the client is not charged.
-- Wires named in script.ts (REFUND). KEY: the subject's counters, credits and usage events.
-- ARG: `countedAt`, when it was counted (Redis time, ms): each fixed window (FIXED, windows.ts)
-- it was counted in is given the units back if it is still the stored one, and with `month` 1
-- the stored period if it holds that moment; its units; `paidWithCredits` (given back as
-- purchased credits, which never expire); `soft`, the quota past which units are billed as
-- overage (0: none), and `overageWindow` (1: the month, 2: the day); `eventsCap` (0: none) and
-- `eventId`: the refund is an event of its own, cancelling that one's charge and the overage it takes back.
-- Returns the overage units taken back.
-- With `callId` (KEY.call, its kept reply): a call the gateway gave up on whose reply never came
-- (its connection dropped, or the client library gave up on it), so the request was answered
-- otherwise (503, or the degraded budget). quota.lua keeps every call's reply for CALL_KEEP_MS:
-- if it counted a request, that request is refunded here by the reply's own units, time and
-- event. The record becomes a refusal (outcome -1), so the call sent again changes nothing and
-- this happens once. Returns {kind}: 'unknown' (no record: it never ran, or ran longer ago
-- than CALL_KEEP_MS), 'none' (it counted nothing), 'refunded', or {'lease', record}: units of a
-- lease, which the gateway gives back with its next call as it does a late reply's.
local n, at, eventId = tonumber(ARG.units), tonumber(ARG.countedAt), ARG.eventId
local settling = ARG.callId ~= ''
if settling then
  local seen = redis.call('GET', KEY.call)
  local t = redis.call('TIME')
  local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
  redis.call('SET', KEY.call, cjson.encode(packed_call{outcome = -1, nowMs = now}), 'PX', CALL_KEEP_MS)
  if not seen then return {'unknown'} end
  local r = unpacked_call(cjson.decode(seen))
  if r.outcome ~= 0 or r.taken == 0 then return {'none'} end
  if r.taken > n then return {'lease', seen} end
  n, at, eventId = r.taken, r.nowMs, r.eventId
  if not eventId then eventId = '' end
end
local h = read_counters(KEY.counters, {'ps', 'pc', 'os', 'oc', 'pe', 'lo', 'ls'})
local ps, pe = tonumber(h.ps) or 0, tonumber(h.pe) or 0
local inPeriod = tonumber(ARG.month) == 1 and ps <= at and at < pe
local current = {}
for _, w in ipairs(FIXED) do
  current[w.name] = tonumber(h[w.start]) == at - at % w.len
  if current[w.name] then redis.call('HSET', KEY.counters, w.count, math.max(0, (tonumber(h[w.count]) or 0) - n)) end
end
local sameDay = current.day
local dc, pc = math.max(0, (tonumber(h[FIXED.day.count]) or 0) - n), math.max(0, (tonumber(h.pc) or 0) - n)
if inPeriod then redis.call('HSET', KEY.counters, 'pc', pc) end
if tonumber(ARG.paidWithCredits) == 1 then redis.call('HINCRBY', KEY.credits, 'p', n) end
-- The overage billed is at most what is known delivered past the quota (quota.lua's bill):
-- a refunded unit takes back the overage that no longer has a delivered unit under it, at
-- most its own units, whether or not the request itself was billed as overage.
local soft, window = tonumber(ARG.soft) or 0, tonumber(ARG.overageWindow) or 0
local os, oc = tonumber(h.os), tonumber(h.oc) or 0
local over = 0
local long, start = pc, ps
if window == 2 then long, start = dc, at - at % FIXED.day.len end
if soft > 0 and os == start and ((window == 1 and inPeriod) or (window == 2 and sameDay)) then
  local lo = (tonumber(h.ls) == start) and tonumber(h.lo) or 0
  over = math.min(n, math.max(0, oc - math.max(0, long - lo - soft)))
  if over > 0 then redis.call('HSET', KEY.counters, 'oc', oc - over) end
end
local cap = tonumber(ARG.eventsCap) or 0
if cap > 0 and eventId and eventId ~= '' then
  local t = redis.call('TIME')
  redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', 'kind', 'refund', 'ref', eventId, 'units', n,
    'overage', over, 'at', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
if settling then return {'refunded', over} end
return over
