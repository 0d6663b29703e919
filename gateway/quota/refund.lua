-- A request's units back to the windows that counted it, if they are still current, and to
-- its account's credits: the gateway failed it (502/504), so the client is not charged.
-- KEYS[1]: the subject's counters (hash); KEYS[2]: its credits (hash); KEYS[3]: its usage events (stream). ARGV: the minute and day
-- starts it was counted in (Redis time, ms); when it was counted, if the subject has a month
-- window (0: none): the stored period is the one in force if it holds that moment; its units;
-- 1 if it paid with credits (given back as purchased credits, which never expire); its units
-- billed as overage, and that overage's window (1: the month, 2: the day); the usage events'
-- cap (0: none) and its event's id: the refund is an event of its own, cancelling that one's charge.
local h = redis.call('HMGET', KEYS[1], 'ms', 'mc', 'ds', 'dc', 'ps', 'pc', 'os', 'oc', 'pe')
local n = tonumber(ARGV[4])
local at = tonumber(ARGV[3])
local ps, pe = tonumber(h[5]) or 0, tonumber(h[9]) or 0
local inPeriod = at > 0 and ps <= at and at < pe
if tonumber(h[1]) == tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'mc', math.max(0, (tonumber(h[2]) or 0) - n)) end
if tonumber(h[3]) == tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], 'dc', math.max(0, (tonumber(h[4]) or 0) - n)) end
if inPeriod then redis.call('HSET', KEYS[1], 'pc', math.max(0, (tonumber(h[6]) or 0) - n)) end
if tonumber(ARGV[5]) == 1 then redis.call('HINCRBY', KEYS[2], 'p', n) end
local over, window = tonumber(ARGV[6]) or 0, tonumber(ARGV[7]) or 0
local os = tonumber(h[7])
if over > 0 and ((window == 1 and inPeriod and os == ps) or (window == 2 and os == tonumber(ARGV[2]))) then
  redis.call('HSET', KEYS[1], 'oc', math.max(0, (tonumber(h[8]) or 0) - over))
end
local cap = tonumber(ARGV[8]) or 0
if cap > 0 and ARGV[9] and ARGV[9] ~= '' then
  local t = redis.call('TIME')
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', cap, '*', 'kind', 'refund', 'ref', ARGV[9], 'units', n,
    'at', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
end
return 1
