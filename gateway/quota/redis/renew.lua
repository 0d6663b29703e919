-- Renews a subject's concurrency slots held by one instance: each id (REST on) gets a new
-- expiry, TTL from now on Redis's clock. Each is a request this instance still serves, so one
-- the set has lost (a failover that lost the last writes, a restart without persistence, an
-- expiry while this instance could not reach Redis) is put back: counted again by every
-- instance, the set may hold more than the limit until they end. Wires named in slots.ts
-- (RENEW). KEY: the subject's slots (a sorted set, in the account's Cluster slot). Returns how
-- many it added back.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARG.ttlMs)
local args = {}
for i = REST, #ARGV do
  args[#args + 1] = now + ttl
  args[#args + 1] = ARGV[i]
end
if #args == 0 then return 0 end
local n = redis.call('ZADD', KEY.slots, unpack(args))
redis.call('PEXPIRE', KEY.slots, ttl)
return n
