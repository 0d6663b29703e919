-- What one gateway instance admitted on its own while Redis failed, added to the windows it
-- was admitted in, if they are still current: once, whatever the retries.
-- KEYS[1]: the subject's counters (hash); KEYS[2]: the write-backs already applied (hash of
-- ids), in the same Cluster slot (one hash tag).
-- ARGV: the write-back's id (instance and batch), the minute start and its units, the day
-- start and its units (Redis time, ms), 1 if the subject has a day window, and the billing
-- period (0: no month window), its end, and the units admitted in it (the outage's earlier days included).
if redis.call('HSETNX', KEYS[2], ARGV[1], 1) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = now - now % 60000
local ds = now - now % 86400000
redis.call('PEXPIREAT', KEYS[2], ds + 86400000)
local h = redis.call('HMGET', KEYS[1], 'ms', 'mc', 'ds', 'dc', 'ban', 'ps')
local mc = (tonumber(h[1]) == ms) and tonumber(h[2]) or 0
local dc = (tonumber(h[3]) == ds) and tonumber(h[4]) or 0
if tonumber(ARGV[2]) == ms then mc = mc + tonumber(ARGV[3]) end
if tonumber(ARGV[4]) == ds then dc = dc + tonumber(ARGV[5]) end
redis.call('HSET', KEYS[1], 'ms', ms, 'mc', mc, 'ds', ds, 'dc', dc)
-- Periods are ordered: a later one than the stored starts afresh; an earlier one is over.
local ps = tonumber(ARGV[7]) or 0
if ps > 0 then
  local stored = tonumber(h[6]) or 0
  if stored == ps then redis.call('HINCRBY', KEYS[1], 'pc', tonumber(ARGV[9]))
  elseif stored < ps then redis.call('HSET', KEYS[1], 'ps', ps, 'pc', tonumber(ARGV[9])) end
end
local expireAt = ms + 60000
if tonumber(ARGV[6]) == 1 then expireAt = ds + 86400000 end
-- The hash holds the period's count too: it lasts the period.
expireAt = math.max(expireAt, tonumber(ARGV[8]) or 0)
redis.call('PEXPIREAT', KEYS[1], math.max(expireAt, tonumber(h[5]) or 0))
return 1
