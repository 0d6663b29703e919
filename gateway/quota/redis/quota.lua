-- One atomic decision per request: ban check, the minute, day and billing-period windows, then
-- the prepaid credits. billing.lua is prepended (period, credits).
-- Its wires are named in script.ts (QUOTA: KEYS, ARGV and the reply's fields, in order), bound
-- here as KEY.<name> and ARG.<name>; the reply is built by name with packed{...}.
-- KEY: the subject's counters (hash), its recent 429s (list), credits (hash), their ledger
-- (stream), usage events (stream), alerts fired (hash) and to send (stream), this call's
-- reply, and the usage events' cursor (hash). All share one hash tag, so they live in one Redis Cluster slot.
-- ARG: the limits (perDay 0: no day window; perMonth 0: no billing-period window, with overage
-- the ceiling) and the ban policy (banAfter 0: no bans); `lease`, the units an admitted request
-- may take at once; `back*`, the leases this instance closes with the call: their unused units,
-- minute, day and period starts, and their size when taken (size less unused: units delivered,
-- sent even when none is unused); `deadline` (Redis time, ms; 0: none) past which the gateway
-- has given up waiting; `cost` in units (a costly request takes no lease); `refill` 1 when the
-- call only takes a whole lease ahead of need, or nothing, and is never a refusal; `soft`, the
-- quota of the overage window (the month's, else the day's) past which units are billed as
-- overage (0: none): no lease reaches past it, so every unit past it is decided here and
-- counted in `oc`; `grant` each period (-1: no credits) and `rollover`; `eventsCap` (0: no
-- event) with the request's id, key id, plan, route and method for its usage event; `alerts`,
-- thresholds as a comma list ('' none); `callId` ('' none), also a credit lease's id;
-- `backCredits`, the credit leases closed with the call, `id=unused` comma-separated;
-- `pendEvents` 1 for a subject whose usage is exported: the units of its leases are added to
-- `unsettled` in its events cursor (KEY.cursor) until their instance writes their events, and
-- `backPending`, the closed leases' units never handed out, leave it. `concurrent` (0: none)
-- and `slotTtlMs`: in-flight slots in KEY.slots, `slotId` the one to take (the call's id, or
-- a slot the instance kept lingering: still a member, it needs no room); `burstSize` (0:
-- none) and `burstPerSecond`: GCRA on KEY.burst; `burstTake`, tokens an admitted request's
-- instance may take beyond its cost, as many as the bucket holds, to spend itself.
-- The reply: the outcome (an index into OUTCOMES in decision.ts; -1: past the deadline), the
-- windows' counts, Redis's time, the ban's end, the units taken, the period, the balance (-1:
-- no credits), the overage billed so far and this request's, its usage event's id (or false),
-- 1 if an alert was written (the gateway marks the account: usage/active.ts), the slots in
-- flight, the burst's tokens left (-1: none), ms to its next, a burst refusal's wait, and the
-- tokens taken beyond the cost. Time is
-- Redis's own, so skewed gateways agree.
-- A call sent twice (the client sends again what was unanswered when its connection dropped)
-- gets the first run's reply: never counted twice. KEY.call holds it for CALL_KEEP_MS (script.ts),
-- also for refund.lua to settle a call the gateway gave up on without a reply: past its
-- deadline a call changes nothing anyway.
local callKey = nil
if ARG.callId and ARG.callId ~= '' then
  callKey = KEY.call
  local seen = redis.call('GET', callKey)
  if seen then return cjson.decode(seen) end
end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
-- Run after the gateway stopped waiting (a frozen or stalled Redis): it decided the request
-- itself, so nothing changes here, and the request is counted once, where it was decided.
local deadline = tonumber(ARG.deadline) or 0
if deadline > 0 and now > deadline then return packed{outcome = -1, nowMs = now} end
local perMonth = tonumber(ARG.perMonth) or 0
local banAfter, banWithin, banFor = tonumber(ARG.banAfter), tonumber(ARG.banWithinMs), tonumber(ARG.banForMs)
local lease = tonumber(ARG.lease) or 1
local cost = tonumber(ARG.cost) or 1
local soft = tonumber(ARG.soft) or 0
local grant = tonumber(ARG.grant) or -1

-- The counters hash, by field: the fixed windows' (FIXED, from windows.ts) and the others.
local h = read_counters(KEY.counters, {'ban', 'ps', 'pc', 'os', 'oc', 'pe', 'lo', 'ls'})
-- Each fixed window now: its start, its stored start, its admitted count, its limit, whether the subject has it.
local win = {}
for _, w in ipairs(FIXED) do
  local start, stored, limit = now - now % w.len, tonumber(h[w.start]), tonumber(ARG[w.limit]) or 0
  win[w.name] = {start = start, stored = stored, count = (stored == start) and tonumber(h[w.count]) or 0, limit = limit,
    on = w.always or limit > 0}
end
-- The day: the overage window without a month, and alerts' window.
local day = win.day
local ps, pe, pidx = 0, 0, 0
if perMonth > 0 or grant >= 0 then ps, pe, pidx = period(now, tonumber(ARG.billingDay) or 1) end
local g, p, gp, ge, replaced = 0, 0, 0, 0, nil
if grant >= 0 then
  local book = { ledger = KEY.ledger, events = KEY.events, eventsCap = tonumber(ARG.eventsCap) or 0 }
  g, p, gp, ge, replaced = credits(KEY.credits, book, now, ps, pe, pidx, grant, tonumber(ARG.rollover) == 1)
  -- Without a month window, the period shown is the grant's.
  if perMonth == 0 then ps, pe = gp, ge end
end
-- The stored period stays in force until its end, even if the billing day moved since: a new
-- billing day applies from the next period, and a period's count is never reset early.
if perMonth > 0 then
  local sps, spe = tonumber(h.ps), tonumber(h.pe)
  if sps and spe and sps <= now and now < spe then ps, pe = sps, spe end
end
-- Threshold alerts: those of a day or month that ended are resolved by the first request after it.
local thresholds = fractions(ARG.alerts)
local alerting = #thresholds > 0
local alertsBefore = alerting and redis.call('XLEN', KEY.alerts)
if alerting and day.on then resolveEnded(KEY.alerted, KEY.alerts, now, thresholds, 'day', day.stored, day.start) end
if alerting and perMonth > 0 then resolveEnded(KEY.alerted, KEY.alerts, now, thresholds, 'month', tonumber(h.ps), ps) end
if alerting and replaced then resolveEnded(KEY.alerted, KEY.alerts, now, thresholds, 'credits', replaced, gp) end
-- Credit leases: each one's units are taken from the balance when it is granted and held in
-- the credits hash (`h:<call id>`: size, its granted part, the grant period, when it lapses),
-- `r` their sum and `rx` the first to lapse. Its holder closes it with a later call (`backCredits`:
-- each lease's id and units not handed out, which go back to the balance). One its holder never
-- closed (the instance died, or Redis failed past it) goes back whole once it lapsed, written
-- to the ledger as `lapsed`: what its holder delivered from it is then not charged, never the
-- reverse. HOLD_GRACE: the time past its minute a live holder has to close it.
local HOLD_GRACE = 10000
local held, heldNext = 0, nil
if grant >= 0 then
  local c = redis.call('HMGET', KEY.credits, 'r', 'rx')
  held, heldNext = tonumber(c[1]) or 0, tonumber(c[2])
end
-- `units` of the reservation `v` (as stored) back to the balance: its purchased part first, the
-- rest to the grant if it is still the one in force, else as purchased credits (a refund's way).
-- With `keep`, the rest stays held (its units handed out, their events not written yet): their
-- instance's batch spends them (usagebatch.lua), or they lapse back if it dies first.
local function unhold(field, v, units, keep)
  local size, fromGrant, from, x = string.match(v, '^(%d+) (%d+) (%d+) (%d+)')
  size, fromGrant = tonumber(size), tonumber(fromGrant)
  units = math.min(units, size)
  local toPurchased = math.min(units, size - fromGrant)
  local toGrant = units - toPurchased
  if keep and units < size then
    redis.call('HSET', KEY.credits, field, (size - units) .. ' ' .. (fromGrant - toGrant) .. ' ' .. from .. ' ' .. x)
    held = math.max(0, held - units)
  else
    redis.call('HDEL', KEY.credits, field)
    held = math.max(0, held - size)
  end
  if tonumber(from) ~= gp then toPurchased, toGrant = units, 0 end
  g, p = g + toGrant, p + toPurchased
  return units
end
local function saveHeld()
  if held > 0 then redis.call('HSET', KEY.credits, 'g', g, 'p', p, 'r', held, 'rx', heldNext)
  else redis.call('HSET', KEY.credits, 'g', g, 'p', p, 'r', 0) redis.call('HDEL', KEY.credits, 'rx') end
end
if grant >= 0 and ARG.backCredits and ARG.backCredits ~= '' then
  for id, left in string.gmatch(ARG.backCredits, '([^,=]+)=(%d+)') do
    local v = redis.call('HGET', KEY.credits, 'h:' .. id)
    -- An exporting subject's handed-out units stay held until their events are written.
    if v then unhold('h:' .. id, v, tonumber(left), tonumber(ARG.pendEvents) == 1) end
  end
  saveHeld()
end
if grant >= 0 and held > 0 and heldNext and now >= heldNext then
  local all, first = redis.call('HGETALL', KEY.credits), nil
  for i = 1, #all, 2 do
    if string.sub(all[i], 1, 2) == 'h:' then
      local x = tonumber(string.match(all[i + 1], '(%d+)$'))
      if now >= x then
        local units = unhold(all[i], all[i + 1], math.huge)
        record({ ledger = KEY.ledger, events = KEY.events, eventsCap = 0 }, now, 'lapsed',
          {'amount', units, 'balance', g + p, 'lease', string.sub(all[i], 3)})
      elseif not first or x < first then first = x end
    end
  end
  heldNext = first
  saveHeld()
end
local pc = (perMonth > 0 and tonumber(h.ps) == ps) and tonumber(h.pc) or 0
local ban = tonumber(h.ban) or 0
-- Overage billed so far in the overage window (the month's, else the day's): `os` its start.
local ow = day.start
if perMonth > 0 then ow = ps end
local oc = (soft > 0 and tonumber(h.os) == ow) and tonumber(h.oc) or 0
-- Units of leases taken in the overage window and not closed yet (`ls` its start): counted in
-- the windows, but how many of them were delivered is known only when their holder closes them.
local lo = (tonumber(h.ls) == ow) and tonumber(h.lo) or 0
local mine = 0
local eventId = false
local pending = tonumber(ARG.pendEvents) == 1
-- Concurrency (`concurrent` slots, 0: none): a sorted set of this subject's slots, each scored
-- by its expiry on Redis's clock; the expired ones go first (an instance that died holding them).
-- Burst (`burstSize` at `burstPerSecond`, 0: none): GCRA, one key holding the theoretical
-- arrival time (TAT, ms). Both are read here and taken only once every other check admits.
local concurrent = tonumber(ARG.concurrent) or 0
local inFlight, burstSize = 0, tonumber(ARG.burstSize) or 0
local slotHeld = false
if concurrent > 0 then
  redis.call('ZREMRANGEBYSCORE', KEY.slots, '-inf', now)
  inFlight = redis.call('ZCARD', KEY.slots)
  slotHeld = redis.call('ZSCORE', KEY.slots, ARG.slotId) ~= false
  -- The slot the call brings is its own: in flight beside it are the others.
  if slotHeld then inFlight = inFlight - 1 end
end
local interval, span, tat = 0, 0, now
if burstSize > 0 then
  interval = 1000 / tonumber(ARG.burstPerSecond)
  span = burstSize * interval
  tat = math.max(tonumber(redis.call('GET', KEY.burst)) or now, now)
end
local burstRetry, burstTaken = 0, 0
-- Tokens left with the TAT at `tat`, and ms until the next one comes back (0: full).
local function burstState()
  if burstSize <= 0 then return -1, 0 end
  local left = math.floor((span - (tat - now)) / interval + 1e-9)
  if left >= burstSize then return burstSize, 0 end
  return left, math.max(1, math.ceil((tat - now) - (burstSize - left - 1) * interval))
end
local function reply(outcome, taken, banUntil)
  local balance = -1
  if grant >= 0 then balance = g + p end
  local alerted = 0
  if alerting and redis.call('XLEN', KEY.alerts) ~= alertsBefore then alerted = 1 end
  local left, nextMs = burstState()
  local r = {outcome = outcome, nowMs = now, banUntilMs = banUntil, taken = taken, monthUsed = pc, periodStart = ps,
    periodEnd = pe, balance = balance, overageUsed = oc, overageUnits = mine, eventId = eventId, alerted = alerted,
    inFlight = inFlight, burstLeft = left, burstNextMs = nextMs, burstRetryMs = burstRetry, burstTaken = burstTaken}
  for _, w in ipairs(FIXED) do r[w.used] = win[w.name].count end
  local out = packed(r)
  if callKey then redis.call('SET', callKey, cjson.encode(out), 'PX', CALL_KEEP_MS) end
  return out
end
local function save()
  local set = {'lo', lo, 'ls', ow}
  -- Only the windows the subject has: a plan without an hour stores no hour (at a million keys, 30 MB).
  for _, w in ipairs(FIXED) do
    local c = win[w.name]
    if c.on then for _, v in ipairs({w.start, c.start, w.count, c.count}) do table.insert(set, v) end end
  end
  redis.call('HSET', KEY.counters, unpack(set))
  if perMonth > 0 then redis.call('HSET', KEY.counters, 'ps', ps, 'pc', pc, 'pe', pe) end
end
-- The counters last until the end of the subject's longest window.
local expireAt = 0
for _, w in ipairs(FIXED) do
  if win[w.name].on then expireAt = math.max(expireAt, win[w.name].start + w.len) end
end
if perMonth > 0 then expireAt = pe end
local function keep() redis.call('PEXPIREAT', KEY.counters, math.max(expireAt, ban)) end

-- The overage window's count.
local function long()
  if perMonth > 0 then return pc end
  return day.count
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
    redis.call('HSET', KEY.counters, 'os', ow, 'oc', oc)
  end
end

-- Leases closed by their holder: units never handed out leave the windows they were counted
-- in, and the units handed out are known delivered.
local back, closed = tonumber(ARG.backUnused) or 0, tonumber(ARG.backSize) or 0
if back > 0 or closed > 0 then
  for _, w in ipairs(FIXED) do
    local c = win[w.name]
    if tonumber(ARG['back_' .. w.name]) == c.start and c.count >= back then c.count = c.count - back end
  end
  if perMonth > 0 and tonumber(ARG.backPeriodStart) == ps and pc >= back then pc = pc - back end
  local leasedIn = tonumber(ARG.back_day)
  if perMonth > 0 then leasedIn = tonumber(ARG.backPeriodStart) end
  if closed > 0 and leasedIn == ow then
    lo = math.max(0, lo - closed)
    bill(closed - back)
  end
  save()
end
-- Units of the closed leases never handed out: no event will come for them.
local backPending = tonumber(ARG.backPending) or 0
if backPending > 0 then redis.call('HINCRBY', KEY.cursor, 'unsettled', -backPending) end
-- A request during a ban neither counts nor extends it; the counts still tell whether
-- a window stays closed past the ban's end.
if ban > now then return reply(3, 0, ban) end

-- Room for a lease: what every window has left, and none at or past the overage line.
local function room()
  local r = win.minute.limit - win.minute.count
  for _, w in ipairs(FIXED) do
    local c = win[w.name]
    if c.on then r = math.min(r, c.limit - c.count) end
  end
  if perMonth > 0 then r = math.min(r, perMonth - pc) end
  if soft > 0 then r = math.min(r, soft - long()) end
  return r
end
-- The granted part of the credits take() last spent (the rest purchased): the request's event names it.
local tookGranted = 0
-- Units taken: a request's (`leased` false), known delivered, or a lease's, not closed yet.
local function take(units, leased)
  for _, w in ipairs(FIXED) do win[w.name].count = win[w.name].count + units end
  if perMonth > 0 then pc = pc + units end
  if leased then lo = lo + units else bill(units) end
  -- A lease of an exporting subject: its units' events come later, in their instance's batches (usagebatch.lua).
  if leased and pending then redis.call('HINCRBY', KEY.cursor, 'unsettled', units) end
  if grant >= 0 then
    local fromGrant = math.min(g, units)
    tookGranted = fromGrant
    g = g - fromGrant
    p = p - (units - fromGrant)
    redis.call('HSET', KEY.credits, 'g', g, 'p', p)
    if leased then
      local x = win.minute.start + FIXED.minute.len + HOLD_GRACE
      redis.call('HSET', KEY.credits, 'h:' .. ARG.callId, units .. ' ' .. fromGrant .. ' ' .. gp .. ' ' .. x)
      held = held + units
      if not heldNext or x < heldNext then heldNext = x end
      saveHeld()
    end
  end
  save()
  keep()
end
-- Units taken (a request's, or a lease's: a lease's crossing fires when the lease is taken), and the thresholds they reach.
local function takeAndAlert(units, leased)
  local d, m, b = day.count, pc, g + p
  take(units, leased)
  if not alerting then return end
  if day.on then crossings(KEY.alerted, KEY.alerts, now, thresholds, 'day', day.start, d, day.count, day.limit) end
  if perMonth > 0 then crossings(KEY.alerted, KEY.alerts, now, thresholds, 'month', ps, m, pc, perMonth) end
  if grant > 0 then crossings(KEY.alerted, KEY.alerts, now, thresholds, 'credits', gp, grant - b, grant - (g + p), grant) end
end

-- A refill, while the instance still hands out its current lease: a whole lease while every
-- window keeps room for two, else nothing (the requests then ask one by one, as below).
-- With credits, a lease is also at most 1% of the balance: near its end, one decision per request.
if grant >= 0 then lease = math.min(lease, math.floor((g + p) / 100)) end
if tonumber(ARG.refill) == 1 then
  if lease <= 1 or room() < 2 * lease then return reply(0, 0) end
  takeAndAlert(lease, true)
  return reply(0, lease)
end

-- The longest window is checked first: when several are full, it is what the client must wait for.
local violated = 0
if perMonth > 0 and pc + cost > perMonth then violated = 4 end
for i = #FIXED, 1, -1 do
  local w, c = FIXED[i], win[FIXED[i].name]
  if violated == 0 and c.on and c.count + cost > c.limit then violated = w.outcome end
end

if violated > 0 then
  -- Refused: counted in no window, only in the list of recent 429s.
  if banAfter > 0 then
    redis.call('LPUSH', KEY.rejections, now)
    redis.call('LTRIM', KEY.rejections, 0, banAfter)
    redis.call('PEXPIRE', KEY.rejections, banWithin)
    local oldest = tonumber(redis.call('LINDEX', KEY.rejections, banAfter))
    if oldest and oldest > now - banWithin then
      ban = now + banFor
      redis.call('HSET', KEY.counters, 'ban', ban)
      keep()
      redis.call('DEL', KEY.rejections)
      return reply(3, 0, ban)
    end
  end
  return reply(violated, 0)
end
-- Every window has room; the balance must cover the cost too (a 402, which bans no one).
if grant >= 0 and g + p < cost then return reply(5, 0) end
-- The burst, then a free slot: refused, charged nothing anywhere (no window, no ban, no credit).
-- The burst first: its wait is known (Retry-After to the token), a slot's is not.
if burstSize > 0 and tat + cost * interval - now > span + 1e-6 then
  burstRetry = math.max(1, math.ceil(tat + cost * interval - span - now))
  return reply(8, 0)
end
if concurrent > 0 and inFlight >= concurrent then return reply(7, 0) end
if burstSize > 0 then
  -- Tokens leased beyond the cost: whole ones the bucket holds once the request's are out.
  local want = tonumber(ARG.burstTake) or 0
  if want > 0 then
    burstTaken = math.max(0, math.min(want, math.floor((span - (tat + cost * interval - now)) / interval + 1e-9)))
  end
  tat = tat + (cost + burstTaken) * interval
  redis.call('SET', KEY.burst, string.format('%.3f', tat), 'PX', math.ceil(tat - now) + 1)
end
if concurrent > 0 then
  local ttl = tonumber(ARG.slotTtlMs)
  redis.call('ZADD', KEY.slots, now + ttl, ARG.slotId)
  redis.call('PEXPIRE', KEY.slots, ttl)
  inFlight = inFlight + 1
end

-- A lease takes several units at once, for the instance to hand out itself, only while every
-- window keeps room for two leases: near a limit, one decision per request.
local units = cost
if lease > 1 and cost == 1 and room() >= 2 * lease then units = lease end
takeAndAlert(units, units > cost)
-- The request's usage event, in the same step as its count: what is enforced is what is billed.
-- A lease's are written by its instance, as it hands out the units (usagebatch.lua).
local cap = tonumber(ARG.eventsCap) or 0
if cap > 0 and units == cost then
  local balance = -1
  if grant >= 0 then balance = g + p end
  local entry = {'kind', 'request', 'rid', ARG.requestId, 'key', ARG.keyId, 'plan', ARG.plan, 'route', ARG.route,
    'method', ARG.method, 'units', cost, 'at', now}
  -- Each fixed window the plan has, by its name (the table in windows.ts), then the month.
  for _, w in ipairs(FIXED) do
    if win[w.name].on then
      entry[#entry + 1] = w.name
      entry[#entry + 1] = win[w.name].count
    end
  end
  for _, v in ipairs({'month', pc, 'overage', mine, 'credits', balance}) do entry[#entry + 1] = v end
  -- Paid with credits: how many of its units came from the grant (spent first), the rest purchased.
  if grant >= 0 then
    entry[#entry + 1] = 'cg'
    entry[#entry + 1] = tookGranted
  end
  eventId = redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', unpack(entry))
end
return reply(0, units)
