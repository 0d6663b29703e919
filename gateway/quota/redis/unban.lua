-- Lifts a subject's ban and forgets its recent 429s, so its next request is decided afresh.
-- Wires named in script.ts (UNBAN). KEY: the subject's counters (hash), its list of recent 429s
-- (one Cluster slot: an account's keys).
-- Returns the end (ms, Redis time) of the ban it lifted, or 0 when none was in force.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ban = tonumber(redis.call('HGET', KEY.counters, 'ban')) or 0
redis.call('HDEL', KEY.counters, 'ban')
redis.call('DEL', KEY.rejections)
if ban > now then return ban end
return 0
