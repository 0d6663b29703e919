-- A request's units back to the windows that counted it, if they are still current: the
-- gateway failed it (502/504), so the client is not charged.
-- KEYS[1]: the subject's counters (hash). ARGV: the minute and day starts it was counted in
-- (Redis time, ms), and its units.
local h = redis.call('HMGET', KEYS[1], 'ms', 'mc', 'ds', 'dc')
local n = tonumber(ARGV[3])
if tonumber(h[1]) == tonumber(ARGV[1]) then redis.call('HSET', KEYS[1], 'mc', math.max(0, (tonumber(h[2]) or 0) - n)) end
if tonumber(h[3]) == tonumber(ARGV[2]) then redis.call('HSET', KEYS[1], 'dc', math.max(0, (tonumber(h[4]) or 0) - n)) end
return 1
