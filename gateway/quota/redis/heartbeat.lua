-- One gateway instance's heartbeat: it says it is alive, and learns how many instances are,
-- and its rank among them, for its share of a window while Redis fails (degraded-budget.ts).
-- Wires named in script.ts (HEARTBEAT). KEY.registry: a hash, instance id -> its last heartbeat
-- (Redis time in ms). ARG.id: this instance's; ARG.ttlMs: how long a heartbeat counts (0: leaving).
-- Returns {live instances, this one's rank by id, Redis time in ms}.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if tonumber(ARG.ttlMs) == 0 then
  redis.call('HDEL', KEY.registry, ARG.id)
  return {0, 0, now}
end
local ttl = tonumber(ARG.ttlMs)
redis.call('HSET', KEY.registry, ARG.id, now)
local all = redis.call('HGETALL', KEY.registry)
local live, rank = 0, 0
for i = 1, #all, 2 do
  if tonumber(all[i + 1]) > now - ttl then
    live = live + 1
    if all[i] < ARG.id then rank = rank + 1 end
  else
    redis.call('HDEL', KEY.registry, all[i])
  end
end
redis.call('PEXPIRE', KEY.registry, ttl)
return {live, rank, now}
