-- A request's units back to the windows that counted it, if they are still current (units-back.lua), and to
-- its account's credits: the gateway failed it (502/504), so the client is not charged.
-- Wires named in script.ts (REFUND). KEY: the subject's counters, credits and usage events.
-- ARG: `countedAt`, when it was counted (Redis time, ms): each fixed window (FIXED, windows.ts)
-- it was counted in is given the units back if it is still the stored one, and with `month` 1
-- the stored period if it holds that moment; its units; `paidWithCredits` (given back as
-- purchased credits, which never expire); `soft`, the quota past which units are billed as
-- overage (0: none), and `overageWindow` (1: the month, 2: the day); `eventsCap` (0: none) and
-- `eventId`: the refund is an event of its own, cancelling that one's charge and the overage it
-- takes back, with the request's `plan` and `route` ('': not known) for its statement line and
-- the credits it gives back (`cr`).
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
if tonumber(ARG.paidWithCredits) == 1 then redis.call('HINCRBY', KEY.credits, 'p', n) end
local over = units_back(KEY.counters, n, at, tonumber(ARG.month), tonumber(ARG.soft) or 0, tonumber(ARG.overageWindow) or 0)
local cap = tonumber(ARG.eventsCap) or 0
if cap > 0 and eventId and eventId ~= '' then
  local t = redis.call('TIME')
  redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', 'kind', 'refund', 'ref', eventId, 'units', n,
    'overage', over, 'at', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000), 'plan', ARG.plan, 'route', ARG.route,
    -- The credits given back (as purchased ones): none when the request was not paid with credits.
    'cr', tonumber(ARG.paidWithCredits) == 1 and n or 0)
end
if settling then return {'refunded', over} end
return over
