-- The billing period and the credits' grants, prepended to the scripts that need them
-- (quota.lua, topup.lua): one copy of the calendar, computed from Redis's own time.
-- Civil dates from days since 1970-01-01 and back: H. Hinnant's algorithms
-- (http://howardhinnant.github.io/date_algorithms.html), in Lua 5.1's doubles.
local DAY = 86400000
local function civil(z)
  z = z + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524) - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local d = doy - math.floor((153 * mp + 2) / 5) + 1
  local m = mp < 10 and mp + 3 or mp - 9
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m, d
end
local function days(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = m > 2 and m - 3 or m + 9
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  return era * 146097 + yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy - 719468
end
-- 00:00 UTC of the billing day in month m (1-12, or one past either end), a day past the
-- month's end being its last day; and the month's index (year * 12 + month - 1).
local function startIn(y, m, bd)
  if m < 1 then y, m = y - 1, m + 12 elseif m > 12 then y, m = y + 1, m - 12 end
  local ny, nm = y, m + 1
  if nm > 12 then ny, nm = y + 1, 1 end
  local monthDays = days(ny, nm, 1) - days(y, m, 1)
  return days(y, m, math.min(bd, monthDays)) * DAY, y * 12 + m - 1
end
-- The period holding `now` for billing day `bd`: its start, end and start's month index.
local function period(now, bd)
  local y, m = civil(math.floor(now / DAY))
  local here, idx = startIn(y, m, bd)
  if now >= here then return here, (startIn(y, m + 1, bd)), idx end
  local s, i = startIn(y, m - 1, bd)
  return s, here, i
end
-- The ledger keeps the last entries of an account's credits, about this many (it is trimmed by
-- whole stream nodes); with usage export on, every entry is also a usage event, so the sink
-- keeps the whole record.
local LEDGER_KEEP = 1000
-- An entry of `kind` (grant, topup) with its `fields` in the ledger (`book.ledger`), and as a
-- usage event (`book.events`, when `book.eventsCap` > 0). Returns its ledger id.
local function record(book, now, kind, fields)
  local id = redis.call('XADD', book.ledger, 'MAXLEN', '~', LEDGER_KEEP, '*', 'kind', kind, unpack(fields))
  if book.eventsCap > 0 then
    redis.call('XADD', book.events, 'MAXLEN', '~', book.eventsCap, '*', 'kind', 'credits', 'entry', kind, 'ledger', id,
      'at', now, unpack(fields))
  end
  return id
end
-- The account's credits (hash `key`: g granted, p purchased, gp and ge the period of the last
-- grant), with the grants due at `now` applied and recorded (`book`, see record):
-- `grant` each period, added to what is left with `rollover`, else in place of it (what was
-- left of the last grant expires; purchased credits never do). The last grant's period stays
-- in force until its end, even if the billing day moved since; then the period holding `now`
-- (`ps`, `pe`, month index `pidx`) gets one grant, or with rollover one for each period since.
-- Returns the balance's two parts, the grant period in force, and the period of the grant it
-- replaced when it made one now.
local function credits(key, book, now, ps, pe, pidx, grant, rollover)
  local c = redis.call('HMGET', key, 'g', 'p', 'gp', 'ge')
  local g, p, gp, ge = tonumber(c[1]) or 0, tonumber(c[2]) or 0, tonumber(c[3]), tonumber(c[4])
  if ge and now < ge then return g, p, gp, ge, nil end
  local n = 1
  if ge then
    local ey, em = civil(math.floor(ge / DAY))
    n = math.max(1, pidx - (ey * 12 + em - 1) + 1)
  end
  local expired = 0
  if rollover then g = g + n * grant else expired = g g = grant end
  redis.call('HSET', key, 'g', g, 'p', p, 'gp', ps, 'ge', pe)
  record(book, now, 'grant', {'amount', grant * (rollover and n or 1), 'periods', n, 'expired', expired, 'balance', g + p,
    'period', ps})
  return g, p, ps, pe, gp
end
-- Threshold alerts, written to the account's alerts stream (`alerts`) for the webhook
-- dispatcher, once per window, period and threshold (the hash `alerted` remembers which).
-- `thresholds`: the configured fractions, as written ("0.8").
local function fractions(list)
  local out = {}
  for t in string.gmatch(list or '', '[^,]+') do out[#out + 1] = t end
  return out
end
local function alert(alerts, now, kind, window, start, t, used, limit)
  redis.call('XADD', alerts, 'MAXLEN', '~', 10000, '*', 'kind', kind, 'window', window, 'period', start,
    'threshold', t, 'used', used, 'limit', limit, 'at', now)
end
-- A threshold reached between `before` and `after` units of a window of `limit` (at ceil(t * limit) units).
local function crossings(alerted, alerts, now, thresholds, window, start, before, after, limit)
  for _, t in ipairs(thresholds) do
    local line = math.ceil(tonumber(t) * limit)
    if before < line and after >= line and redis.call('HSETNX', alerted, window .. ':' .. start .. ':' .. t, now) == 1 then
      redis.call('PEXPIRE', alerted, 40 * DAY)
      alert(alerts, now, 'crossed', window, start, t, after, limit)
    end
  end
end
-- The alerts of a period that ended (`old`; the one in force is `current`): each resolved once.
local function resolveEnded(alerted, alerts, now, thresholds, window, old, current)
  if not old or old == current then return end
  for _, t in ipairs(thresholds) do
    if redis.call('HDEL', alerted, window .. ':' .. old .. ':' .. t) == 1 then alert(alerts, now, 'resolved', window, old, t, 0, 0) end
  end
end
-- The credits' alerts of grant period `gp` the balance is back over (a top-up): each resolved once.
local function resolveCredits(alerted, alerts, now, thresholds, gp, grant, balance)
  for _, t in ipairs(thresholds) do
    if grant - balance < math.ceil(tonumber(t) * grant) and redis.call('HDEL', alerted, 'credits:' .. gp .. ':' .. t) == 1 then
      alert(alerts, now, 'resolved', 'credits', gp, t, math.max(0, grant - balance), grant)
    end
  end
end
