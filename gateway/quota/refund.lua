-- A request's units back to the windows that counted it, if they are still current, and to
-- its account's credits: the gateway failed it (502/504), so the client is not charged.
-- KEYS[1]: the subject's counters (hash); KEYS[2]: its credits (hash). ARGV: the minute, day
-- and period starts it was counted in (Redis time, ms; period 0: no period window), its units,
-- 1 if it paid with credits (given back as purchased credits, which never expire), and its
-- units billed as overage with the start of that overage window.
local h = redis.call('HMGET', KEYS[1], 'ms', 'mc', 'ds', 'dc', 'ps', 'pc', 'os', 'oc')
local n = tonumber(ARGV[4])
if tonumber(h[1]) == tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'mc', math.max(0, (tonumber(h[2]) or 0) - n)) end
if tonumber(h[3]) == tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], 'dc', math.max(0, (tonumber(h[4]) or 0) - n)) end
if tonumber(ARGV[3]) > 0 and tonumber(h[5]) == tonumber(ARGV[3]) then
  redis.call('HSET', KEYS[1], 'pc', math.max(0, (tonumber(h[6]) or 0) - n))
end
if tonumber(ARGV[5]) == 1 then redis.call('HINCRBY', KEYS[2], 'p', n) end
local over = tonumber(ARGV[6]) or 0
if over > 0 and tonumber(h[7]) == tonumber(ARGV[7]) then
  redis.call('HSET', KEYS[1], 'oc', math.max(0, (tonumber(h[8]) or 0) - over))
end
return 1
