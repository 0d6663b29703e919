-- One atomic decision per request: ban check, the minute, day and billing-period windows, then
-- the prepaid credits. billing.lua is prepended (period, credits).
-- KEYS: the subject's counters (hash), times of its recent 429s (list), its credits (hash),
-- their ledger (stream), its usage events (stream), and its alerts fired (hash) and to send (stream). All share one hash tag, so they live in
-- one Redis Cluster slot.
-- ARGV, in order:
--   1-5   perMinute, perDay (0: no day window), banAfter (0: no bans), banWithinMs, banForMs;
--   6     lease: units an admitted request may take at once (1, or more for a lease);
--   7-9   the unused units of this instance's last lease, with that lease's minute and day starts, given back;
--   10    the deadline (Redis time, ms; 0: none) after which the gateway has given up waiting;
--   11    the request's cost in units (1 unless its route costs more; a costly request takes no lease);
--   12    refill: 1 when no request is admitted, the call only takes a whole lease ahead of need,
--         or nothing, and is never a refusal;
--   13-14 perMonth (0: no billing-period window; with overage, the ceiling), billingDay (1-31);
--   15    soft: the quota of the window that has overage (the month's, else the day's), past which
--         units are billed as overage (0: none); no lease reaches past it, so every unit past it
--         is decided here, one request at a time, and counted in `oc` (exact: what is billed);
--   16-17 the credits granted each period (-1: no credits), and 1 if what is left rolls over;
--   18    the period start of the lease given back (7-9);
--   19-24 usage events: the most the stream keeps (0: no event), and the request's id, key id,
--         plan, route and method: an admitted request's event is written here, with its count;
--   25    alert thresholds, as fractions in a comma list ('' none), for the day, the month and
--         credits: KEYS[6] remembers the alerts fired, KEYS[7] is their stream (billing.lua);
--   26    the size of the leases given back (7-9, 18) when they were taken: closing them tells
--         how many of their units were delivered (size less unused), sent even when none is unused.
--   27    this call's id, unique per instance and call ('' none): KEYS[8] keeps its reply.
-- Returns {outcome, minuteUsed, dayUsed, nowMs, banUntilMs, taken, periodUsed, periodStart,
-- periodEnd, balance (-1: no credits), overage units billed in the window so far, this request's,
-- its usage event's id (or false), 1 if an alert was written (the gateway marks the account for
-- the dispatcher: usage/active.ts)}; outcome is an index into OUTCOMES in decision.ts: 0
-- allowed, 1 minute, 2 day, 3 banned, 4 month, 5 credits. Time is Redis's own, so skewed
-- gateways agree.
-- A call sent twice (the client sends again what was unanswered when its connection dropped)
-- gets the first run's reply: never counted twice. KEYS[8] holds it, named by the call's id
-- (ARGV 27), for 10 s: past its deadline a call changes nothing anyway.
local callKey = nil
if ARGV[27] and ARGV[27] ~= '' then
  callKey = KEYS[8]
  local seen = redis.call('GET', callKey)
  if seen then return cjson.decode(seen) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Run after the gateway stopped waiting (a frozen or stalled Redis): it decided the request
-- itself, so nothing changes here, and the request is counted once, where it was decided.
local deadline = tonumber(ARGV[10]) or 0
if deadline > 0 and now > deadline then return {-1, 0, 0, now, 0} end
local perMinute, perDay, perMonth = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[13]) or 0
local banAfter, banWithin, banFor = tonumber(ARGV[3]), tonumber(ARGV[4]), tonumber(ARGV[5])
local lease = tonumber(ARGV[6]) or 1
local cost = tonumber(ARGV[11]) or 1
local soft = tonumber(ARGV[15]) or 0
local grant = tonumber(ARGV[16]) or -1

local h = redis.call('HMGET', KEYS[1], 'ms', 'mc', 'ds', 'dc', 'ban', 'ps', 'pc', 'os', 'oc', 'pe', 'lo', 'ls')
local ms = now - now % 60000
local ds = now - now % DAY
local ps, pe, pidx = 0, 0, 0
if perMonth > 0 or grant >= 0 then ps, pe, pidx = period(now, tonumber(ARGV[14]) or 1) end
local g, p, gp, ge, replaced = 0, 0, 0, 0, nil
if grant >= 0 then
  local book = { ledger = KEYS[4], events = KEYS[5], eventsCap = tonumber(ARGV[19]) or 0 }
  g, p, gp, ge, replaced = credits(KEYS[3], book, now, ps, pe, pidx, grant, tonumber(ARGV[17]) == 1)
  -- Without a month window, the period shown is the grant's.
  if perMonth == 0 then ps, pe = gp, ge end
end
-- The stored period stays in force until its end, even if the billing day moved since: a new
-- billing day applies from the next period, and a period's count is never reset early.
if perMonth > 0 then
  local sps, spe = tonumber(h[6]), tonumber(h[10])
  if sps and spe and sps <= now and now < spe then ps, pe = sps, spe end
end
-- Threshold alerts: those of a day or month that ended are resolved by the first request after it.
local thresholds = fractions(ARGV[25])
local alerting = #thresholds > 0
local alertsBefore = alerting and redis.call('XLEN', KEYS[7])
if alerting and perDay > 0 then resolveEnded(KEYS[6], KEYS[7], now, thresholds, 'day', tonumber(h[3]), ds) end
if alerting and perMonth > 0 then resolveEnded(KEYS[6], KEYS[7], now, thresholds, 'month', tonumber(h[6]), ps) end
if alerting and replaced then resolveEnded(KEYS[6], KEYS[7], now, thresholds, 'credits', replaced, gp) end
local mc = (tonumber(h[1]) == ms) and tonumber(h[2]) or 0
local dc = (tonumber(h[3]) == ds) and tonumber(h[4]) or 0
local pc = (perMonth > 0 and tonumber(h[6]) == ps) and tonumber(h[7]) or 0
local ban = tonumber(h[5]) or 0
-- Overage billed so far in the overage window (the month's, else the day's): `os` its start.
local ow = ds
if perMonth > 0 then ow = ps end
local oc = (soft > 0 and tonumber(h[8]) == ow) and tonumber(h[9]) or 0
-- Units of leases taken in the overage window and not closed yet (`ls` its start): counted in
-- the windows, but how many of them were delivered is known only when their holder closes them.
local lo = (tonumber(h[12]) == ow) and tonumber(h[11]) or 0
local mine = 0
local eventId = false
local function reply(outcome, taken, banUntil)
  local balance = -1
  if grant >= 0 then balance = g + p end
  local alerted = 0
  if alerting and redis.call('XLEN', KEYS[7]) ~= alertsBefore then alerted = 1 end
  local out = {outcome, mc, dc, now, banUntil or 0, taken or 0, pc, ps, pe, balance, oc, mine, eventId, alerted}
  if callKey then redis.call('SET', callKey, cjson.encode(out), 'PX', 10000) end
  return out
end
local function save()
  redis.call('HSET', KEYS[1], 'ms', ms, 'mc', mc, 'ds', ds, 'dc', dc, 'lo', lo, 'ls', ow)
  if perMonth > 0 then redis.call('HSET', KEYS[1], 'ps', ps, 'pc', pc, 'pe', pe) end
end
local expireAt = ms + 60000
if perDay > 0 then expireAt = ds + DAY end
if perMonth > 0 then expireAt = pe end
local function keep() redis.call('PEXPIREAT', KEYS[1], math.max(expireAt, ban)) end

-- The overage window's count.
local function long()
  if perMonth > 0 then return pc end
  return dc
end
-- Overage is billed for units known to be delivered past the quota: the overage window's
-- count less the units of leases not closed yet. `units`: those this call makes known (a
-- request's, or a closed lease's delivered ones); only they are billed now, so a lease given
-- back never makes a unit billed twice, and a quota lowered mid-period bills nothing already
-- delivered. A lease whose holder dies is never closed: its delivered units stay unbilled.
local function bill(units)
  if soft <= 0 or units <= 0 then return end
  local due = math.min(units, long() - lo - soft - oc)
  if due > 0 then
    mine = mine + due
    oc = oc + due
    redis.call('HSET', KEYS[1], 'os', ow, 'oc', oc)
  end
end

-- Leases closed by their holder: units never handed out leave the windows they were counted
-- in, and the units handed out are known delivered.
local back, closed = tonumber(ARGV[7]) or 0, tonumber(ARGV[26]) or 0
if back > 0 or closed > 0 then
  if tonumber(ARGV[9]) == ds and dc >= back then dc = dc - back end
  if tonumber(ARGV[8]) == ms and mc >= back then mc = mc - back end
  if perMonth > 0 and tonumber(ARGV[18]) == ps and pc >= back then pc = pc - back end
  local leasedIn = tonumber(ARGV[9])
  if perMonth > 0 then leasedIn = tonumber(ARGV[18]) end
  if closed > 0 and leasedIn == ow then
    lo = math.max(0, lo - closed)
    bill(closed - back)
  end
  save()
end
-- A request during a ban neither counts nor extends it; the counts still tell whether
-- a window stays closed past the ban's end.
if ban > now then return reply(3, 0, ban) end

-- Room for a lease: what every window has left, and none at or past the overage line.
local function room()
  local r = perMinute - mc
  if perDay > 0 then r = math.min(r, perDay - dc) end
  if perMonth > 0 then r = math.min(r, perMonth - pc) end
  if soft > 0 then r = math.min(r, soft - long()) end
  return r
end
-- Units taken: a request's (`leased` false), known delivered, or a lease's, not closed yet.
local function take(units, leased)
  mc = mc + units
  dc = dc + units
  if perMonth > 0 then pc = pc + units end
  if leased then lo = lo + units else bill(units) end
  if grant >= 0 then
    local fromGrant = math.min(g, units)
    g = g - fromGrant
    p = p - (units - fromGrant)
    redis.call('HSET', KEYS[3], 'g', g, 'p', p)
  end
  save()
  keep()
end
-- Units taken (a request's, or a lease's: a lease's crossing fires when the lease is taken), and the thresholds they reach.
local function takeAndAlert(units, leased)
  local d, m, b = dc, pc, g + p
  take(units, leased)
  if not alerting then return end
  if perDay > 0 then crossings(KEYS[6], KEYS[7], now, thresholds, 'day', ds, d, dc, perDay) end
  if perMonth > 0 then crossings(KEYS[6], KEYS[7], now, thresholds, 'month', ps, m, pc, perMonth) end
  if grant > 0 then crossings(KEYS[6], KEYS[7], now, thresholds, 'credits', gp, grant - b, grant - (g + p), grant) end
end

-- A refill, while the instance still hands out its current lease: a whole lease while every
-- window keeps room for two, else nothing (the requests then ask one by one, as below).
if tonumber(ARGV[12]) == 1 then
  if grant >= 0 or room() < 2 * lease then return reply(0, 0) end
  takeAndAlert(lease, true)
  return reply(0, lease)
end

-- The longest window is checked first: when several are full, it is what the client must wait for.
local violated = 0
if perMonth > 0 and pc + cost > perMonth then violated = 4
elseif perDay > 0 and dc + cost > perDay then violated = 2
elseif mc + cost > perMinute then violated = 1 end

if violated > 0 then
  -- Refused: counted in no window, only in the list of recent 429s.
  if banAfter > 0 then
    redis.call('LPUSH', KEYS[2], now)
    redis.call('LTRIM', KEYS[2], 0, banAfter)
    redis.call('PEXPIRE', KEYS[2], banWithin)
    local oldest = tonumber(redis.call('LINDEX', KEYS[2], banAfter))
    if oldest and oldest > now - banWithin then
      ban = now + banFor
      redis.call('HSET', KEYS[1], 'ban', ban)
      keep()
      redis.call('DEL', KEYS[2])
      return reply(3, 0, ban)
    end
  end
  return reply(violated, 0)
end
-- Every window has room; the balance must cover the cost too (a 402, which bans no one).
if grant >= 0 and g + p < cost then return reply(5, 0) end

-- A lease takes several units at once, for the instance to hand out itself, only while every
-- window keeps room for two leases: near a limit, one decision per request. Credits are never leased.
local units = cost
if lease > 1 and cost == 1 and grant < 0 and room() >= 2 * lease then units = lease end
takeAndAlert(units, units > cost)
-- The request's usage event, in the same step as its count: what is enforced is what is billed.
local cap = tonumber(ARGV[19]) or 0
if cap > 0 then
  local balance = -1
  if grant >= 0 then balance = g + p end
  eventId = redis.call('XADD', KEYS[5], 'MAXLEN', '~', cap, '*', 'kind', 'request', 'rid', ARGV[20], 'key', ARGV[21],
    'plan', ARGV[22], 'route', ARGV[23], 'method', ARGV[24], 'units', cost, 'at', now, 'minute', mc, 'day', dc,
    'month', pc, 'overage', mine, 'credits', balance)
end
return reply(0, units)
