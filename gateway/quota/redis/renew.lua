-- Renews a subject's concurrency slots held by one instance: each id (REST on) still in the set
-- gets a new expiry, TTL from now on Redis's clock (ZADD XX: a slot that expired and was swept
-- meanwhile is not brought back). Wires named in script.ts (RENEW). KEY: the subject's slots
-- (a sorted set, in the account's Cluster slot). Returns how many it renewed.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARG.ttlMs)
local args = {'XX', 'CH'}
for i = REST, #ARGV do
  args[#args + 1] = now + ttl
  args[#args + 1] = ARGV[i]
end
if #args == 2 then return 0 end
local n = redis.call('ZADD', KEY.slots, unpack(args))
redis.call('PEXPIRE', KEY.slots, ttl)
return n
