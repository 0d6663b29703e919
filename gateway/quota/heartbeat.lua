-- One gateway instance's heartbeat: it says it is alive, and learns how many instances are,
-- and its rank among them, for its share of a window while Redis fails (degraded-budget.ts).
-- KEYS[1]: the registry (hash: instance id -> its last heartbeat, Redis time in ms).
-- ARGV: this instance's id, how long a heartbeat counts (ms); or no ARGV[2]: leaving.
-- Returns {live instances, this one's rank by id, Redis time in ms}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if not ARGV[2] then
  redis.call('HDEL', KEYS[1], ARGV[1])
  return {0, 0, now}
end
local ttl = tonumber(ARGV[2])
redis.call('HSET', KEYS[1], ARGV[1], now)
local all = redis.call('HGETALL', KEYS[1])
local live, rank = 0, 0
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) > now - ttl then
    live = live + 1
    if all[i] < ARGV[1] then rank = rank + 1 end
  else
    redis.call('HDEL', KEYS[1], all[i])
  end
end
redis.call('PEXPIRE', KEYS[1], ttl)
return {live, rank, now}
