-- What one gateway instance admitted on its own while Redis failed, added to the windows it
-- was admitted in, if they are still current: once, whatever the retries.
-- Wires named in script.ts (WRITEBACK). KEY: the subject's counters (hash) and the write-backs
-- already applied (hash of ids), in the same Cluster slot (one hash tag).
-- ARG: the write-back's id (instance and batch); for each fixed window (FIXED, windows.ts) the
-- start it was admitted in and its units (`start_<name>`, `units_<name>`, Redis time, ms); the
-- length of the subject's longest fixed window (the counters last until its end); and the
-- billing period (0: no month window), its end, and the units admitted in it (the outage's earlier days included).
if redis.call('HSETNX', KEY.applied, ARG.id, 1) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('PEXPIREAT', KEY.applied, now - now % 86400000 + 86400000)
local h = read_counters(KEY.counters, {'ban', 'ps'})
local set = {}
for _, w in ipairs(FIXED) do
  local start = now - now % w.len
  local count = (tonumber(h[w.start]) == start) and tonumber(h[w.count]) or 0
  if tonumber(ARG['start_' .. w.name]) == start then count = count + tonumber(ARG['units_' .. w.name]) end
  for _, v in ipairs({w.start, start, w.count, count}) do table.insert(set, v) end
end
redis.call('HSET', KEY.counters, unpack(set))
-- Periods are ordered: a later one than the stored starts afresh; an earlier one is over.
local ps = tonumber(ARG.periodStart) or 0
if ps > 0 then
  local stored = tonumber(h.ps) or 0
  if stored == ps then redis.call('HINCRBY', KEY.counters, 'pc', tonumber(ARG.periodUnits))
  elseif stored < ps then redis.call('HSET', KEY.counters, 'ps', ps, 'pc', tonumber(ARG.periodUnits)) end
end
local longest = tonumber(ARG.longestMs)
local expireAt = now - now % longest + longest
-- The hash holds the period's count too: it lasts the period.
expireAt = math.max(expireAt, tonumber(ARG.periodEnd) or 0)
redis.call('PEXPIREAT', KEY.counters, math.max(expireAt, tonumber(h.ban) or 0))
return 1
