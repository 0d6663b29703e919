-- One atomic decision per request: ban check, then the minute and day windows.
-- KEYS[1]: the subject's counters (hash); KEYS[2]: times of its recent 429s (list).
-- Both share one hash tag, so they live in one Redis Cluster slot.
-- ARGV: perMinute, perDay (0: no day window), banAfter (0: no bans), banWithinMs, banForMs,
-- lease (units an admitted request may take at once: 1, or more for a lease), and the unused
-- units of this instance's last lease with that lease's minute and day starts, given back;
-- then the deadline (Redis time, ms; 0: none) after which the gateway has given up waiting,
-- and the request's cost in units (1 unless its route costs more; a costly request takes no lease);
-- then refill (1: no request is admitted, the call only takes a whole lease ahead of need, or
-- nothing, and is never a refusal).
-- Returns {outcome, minuteUsed, dayUsed, nowMs, banUntilMs, taken}; outcome is an index into
-- OUTCOMES in decision.ts: 0 allowed, 1 minute, 2 day, 3 banned. Time is Redis's own, so
-- skewed gateways agree.
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Run after the gateway stopped waiting (a frozen or stalled Redis): it decided the request
-- itself, so nothing changes here, and the request is counted once, where it was decided.
local deadline = tonumber(ARGV[10]) or 0
if deadline > 0 and now > deadline then return {-1, 0, 0, now, 0} end
local perMinute, perDay = tonumber(ARGV[1]), tonumber(ARGV[2])
local banAfter, banWithin, banFor = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lease = tonumber(ARGV[6]) or 1
local cost = tonumber(ARGV[11]) or 1

local h = redis.call('HMGET', KEYS[1], 'ms', 'mc', 'ds', 'dc', 'ban')
local ms = now - now % 60000
local ds = now - now % 86400000
local mc = (tonumber(h[1]) == ms) and tonumber(h[2]) or 0
local dc = (tonumber(h[3]) == ds) and tonumber(h[4]) or 0
local ban = tonumber(h[5]) or 0
-- Units leased earlier and never handed out leave the windows they were counted in.
local back = tonumber(ARGV[7]) or 0
if back > 0 then
  local changed = false
  if tonumber(ARGV[9]) == ds and dc >= back then dc = dc - back changed = true end
  if tonumber(ARGV[8]) == ms and mc >= back then mc = mc - back changed = true end
  if changed then redis.call('HSET', KEYS[1], 'ms', ms, 'mc', mc, 'ds', ds, 'dc', dc) end
end
-- A request during a ban neither counts nor extends it; the counts still tell whether
-- a window stays closed past the ban's end.
if ban > now then return {3, mc, dc, now, ban} end

local expireAt = ms + 60000
if perDay > 0 then expireAt = ds + 86400000 end

-- A refill, while the instance still hands out its current lease: a whole lease while both
-- windows keep room for two, else nothing (the requests then ask one by one, as below).
if tonumber(ARGV[12]) == 1 then
  local room = perMinute - mc
  if perDay > 0 then room = math.min(room, perDay - dc) end
  if room < 2 * lease then return {0, mc, dc, now, 0, 0} end
  mc = mc + lease
  dc = dc + lease
  redis.call('HSET', KEYS[1], 'ms', ms, 'mc', mc, 'ds', ds, 'dc', dc)
  redis.call('PEXPIREAT', KEYS[1], math.max(expireAt, ban))
  return {0, mc, dc, now, 0, lease}
end

-- The day is checked first: when both are full, the day is what the client must wait for.
local violated = 0
if perDay > 0 and dc + cost > perDay then violated = 2 elseif mc + cost > perMinute then violated = 1 end

if violated > 0 then
  -- Refused: counted in neither window, only in the list of recent 429s.
  if banAfter > 0 then
    redis.call('LPUSH', KEYS[2], now)
    redis.call('LTRIM', KEYS[2], 0, banAfter)
    redis.call('PEXPIRE', KEYS[2], banWithin)
    local oldest = tonumber(redis.call('LINDEX', KEYS[2], banAfter))
    if oldest and oldest > now - banWithin then
      ban = now + banFor
      redis.call('HSET', KEYS[1], 'ban', ban)
      redis.call('PEXPIREAT', KEYS[1], math.max(expireAt, ban))
      redis.call('DEL', KEYS[2])
      return {3, mc, dc, now, ban}
    end
  end
  return {violated, mc, dc, now, 0}
end

-- A lease takes several units at once, for the instance to hand out itself, only while
-- both windows keep room for two leases: near the limit, one decision per request.
local take = cost
if lease > 1 and cost == 1 then
  local room = perMinute - mc
  if perDay > 0 then room = math.min(room, perDay - dc) end
  if room >= 2 * lease then take = lease end
end
mc = mc + take
dc = dc + take
redis.call('HSET', KEYS[1], 'ms', ms, 'mc', mc, 'ds', ds, 'dc', dc)
redis.call('PEXPIREAT', KEYS[1], math.max(expireAt, ban))
return {0, mc, dc, now, 0, take}
