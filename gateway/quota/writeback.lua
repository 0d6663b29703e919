-- What one gateway instance admitted on its own while Redis failed, added to the windows it
-- was admitted in, if they are still current: once, whatever the retries.
-- Wires named in script.ts (WRITEBACK). KEY: the subject's counters (hash) and the write-backs
-- already applied (hash of ids), in the same Cluster slot (one hash tag).
-- ARG: the write-back's id (instance and batch), the minute start and its units, the day
-- start and its units (Redis time, ms), 1 if the subject has a day window, and the billing
-- period (0: no month window), its end, and the units admitted in it (the outage's earlier days included).
if redis.call('HSETNX', KEY.applied, ARG.id, 1) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ms = now - now % 60000
local ds = now - now % 86400000
redis.call('PEXPIREAT', KEY.applied, ds + 86400000)
local h = redis.call('HMGET', KEY.counters, 'ms', 'mc', 'ds', 'dc', 'ban', 'ps')
local mc = (tonumber(h[1]) == ms) and tonumber(h[2]) or 0
local dc = (tonumber(h[3]) == ds) and tonumber(h[4]) or 0
if tonumber(ARG.minuteStart) == ms then mc = mc + tonumber(ARG.minuteUnits) end
if tonumber(ARG.dayStart) == ds then dc = dc + tonumber(ARG.dayUnits) end
redis.call('HSET', KEY.counters, 'ms', ms, 'mc', mc, 'ds', ds, 'dc', dc)
-- Periods are ordered: a later one than the stored starts afresh; an earlier one is over.
local ps = tonumber(ARG.periodStart) or 0
if ps > 0 then
  local stored = tonumber(h[6]) or 0
  if stored == ps then redis.call('HINCRBY', KEY.counters, 'pc', tonumber(ARG.periodUnits))
  elseif stored < ps then redis.call('HSET', KEY.counters, 'ps', ps, 'pc', tonumber(ARG.periodUnits)) end
end
local expireAt = ms + 60000
if tonumber(ARG.hasDay) == 1 then expireAt = ds + 86400000 end
-- The hash holds the period's count too: it lasts the period.
expireAt = math.max(expireAt, tonumber(ARG.periodEnd) or 0)
redis.call('PEXPIREAT', KEY.counters, math.max(expireAt, tonumber(h[5]) or 0))
return 1
