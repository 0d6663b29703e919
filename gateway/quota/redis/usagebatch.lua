-- The usage events of leased admissions, written by their instance in one call, with their
-- final statuses and refunds: once, whatever the retries (a batch's id is kept a day).
-- Wires named in script.ts (USAGE_BATCH). KEY: the account's bundles of events (a stream), the
-- exporter's cursor hash (`unsettled` lives there, and the bundles' cursor), this batch's id,
-- and the account's counters. One hash tag: one Cluster slot, with the counters quota.lua leased
-- the units from.
-- ARG: the stream's cap in events; `month`, `soft` and `overageWindow` as refund.lua's; how many
-- events and refunds; `data`, the events as their instance wrote them, with their final
-- statuses: a line each of what varies, the heads they share once (usage/events.ts,
-- bundleData; the exporter frames them into CloudEvents). From REST (script.ts,
-- usageBatchArgs): per refund the index of its event (from 0), when that was admitted (Redis ms)
-- and its units; then per credit lease its id and how many of the events it paid.
-- The batch is one stream entry, a bundle: `n` its events (refunds among them), `upto` the
-- events the account's bundles took up to it (`badded` in the cursor), `data`, and `refunds`
-- (per refund `index units overage`), so the exporter reads and sends a bundle as one string
-- and its cursor counts in events: `bupto` the events up to the last bundle it sent (or the cap
-- dropped), `bconsumed` those sent, `bdropped` those dropped; held = badded - bupto.
-- Each event's unit leaves `unsettled`, where quota.lua put it when it leased it; a refund's
-- units leave the windows here too (units-back.lua), in the same run: until then they stay
-- counted and unsettled, so what the day counted = events written net of refunds + unsettled,
-- whenever the instance dies.
-- With credits (`paidWithCredits` 1), each event names the credit lease its credit came from:
-- written, its credit is spent from that lease's hold (quota.lua: `h:<id>`, "size fromGrant gp
-- x"; `r` the holds' sum), so it no longer goes back to the balance when the lease closes or
-- lapses; a refunded unit's credit goes back as a purchased one, as refund.lua gives it, if it
-- was spent (an event written after its hold lapsed spent none: the lapse gave it back). The
-- holder closing its lease first gives back only what it did not hand out: the units it handed
-- out stay held (quota.lua, unhold) until this spends them, so nothing is spent twice, nor
-- before its event. So spent = events written net of refunds, whenever the holder dies, before
-- or after closing: its lost events' credits go back with the lapse, their units stay in `unsettled`.
-- Returns the events written (0: a batch sent again, already written).
if not redis.call('SET', KEY.batch, 1, 'NX', 'PX', 86400000) then return 0 end
-- `units` of the hold `field` spent: its grant's part first, as the hold gives its purchased
-- part back first. Returns how many of them its grant paid, and how many it paid in all (0, 0:
-- no hold, it lapsed and went back to the balance whole).
local function spend(field, units)
  local v = redis.call('HGET', KEY.credits, field)
  if not v then return 0, 0 end
  local size, fromGrant, rest = string.match(v, '^(%d+) (%d+) (.*)$')
  size, fromGrant = tonumber(size), tonumber(fromGrant)
  local n = math.min(units, size)
  if n >= size then redis.call('HDEL', KEY.credits, field)
  else redis.call('HSET', KEY.credits, field, (size - n) .. ' ' .. math.max(0, fromGrant - n) .. ' ' .. rest) end
  redis.call('HSET', KEY.credits, 'r', math.max(0, (tonumber(redis.call('HGET', KEY.credits, 'r')) or 0) - n))
  return math.min(n, fromGrant), n
end
local paid = tonumber(ARG.paidWithCredits) == 1
local month, soft, window = tonumber(ARG.month), tonumber(ARG.soft), tonumber(ARG.overageWindow)
local n, refunds = tonumber(ARG.events), tonumber(ARG.refunds)
local total = n + refunds
local cursor = redis.call('HMGET', KEY.cursor, 'badded', 'bupto')
local added, upto = tonumber(cursor[1]) or 0, tonumber(cursor[2]) or 0
-- The cap, in events: the oldest bundles go until this one fits, each counted as dropped and
-- passed by the cursor (the exporter's move then counts only what follows, and what it delivered of these as
-- sent instead: sent or dropped, never both).
local cap = tonumber(ARG.eventsCap)
while added + total - upto > cap do
  local oldest = redis.call('XRANGE', KEY.bundles, '-', '+', 'COUNT', 1)[1]
  if not oldest then break end
  local f = oldest[2]
  local through = tonumber(f[4])
  redis.call('XDEL', KEY.bundles, oldest[1])
  redis.call('HINCRBY', KEY.cursor, 'bdropped', through - upto)
  redis.call('HSET', KEY.cursor, 'bid', oldest[1], 'bupto', through)
  upto = through
end
local last = REST + 3 * refunds - 1
-- What paid each event, in line order (`payers`: each one's lease, 1 + its place after the
-- refunds in ARGV): `g` its lease's grant, `p` purchased credits, `-` nothing (its hold lapsed,
-- and gave its credit back). A lease's events in order, its granted ones first, as spend takes them.
local paidBy = {}
if paid then
  local granted, spent, seen = {}, {}, {}
  for i = last + 1, #ARGV, 2 do granted[#granted + 1], spent[#spent + 1] = spend('h:' .. ARGV[i], tonumber(ARGV[i + 1])) end
  for j in string.gmatch(ARG.payers, '%d+') do
    j = tonumber(j)
    local c = (seen[j] or 0) + 1
    seen[j] = c
    if j > 0 and c <= (granted[j] or 0) then paidBy[#paidBy + 1] = 'g'
    elseif j > 0 and c <= (spent[j] or 0) then paidBy[#paidBy + 1] = 'p'
    else paidBy[#paidBy + 1] = '-' end
  end
end
-- A refund gives its event's credit back, as purchased, if the event spent one.
local refunded, refundedCredits = {}, 0
for i = REST, last, 3 do
  local units = tonumber(ARGV[i + 2])
  local over = units_back(KEY.counters, units, tonumber(ARGV[i + 1]), month, soft, window)
  refunded[#refunded + 1] = ARGV[i] .. ' ' .. units .. ' ' .. over
  local by = paidBy[tonumber(ARGV[i]) + 1]
  if by == 'g' or by == 'p' then refundedCredits = refundedCredits + units end
end
added = added + total
local fields = {'n', total, 'upto', added, 'data', ARG.data, 'refunds', table.concat(refunded, ' ')}
-- With credits, what paid each event (`g`, `p` or `-`, in line order): the exporter names it on
-- each event, and on a refund the credit it gave back.
if paid then
  fields[#fields + 1] = 'credits'
  fields[#fields + 1] = table.concat(paidBy)
end
redis.call('XADD', KEY.bundles, '*', unpack(fields))
redis.call('HSET', KEY.cursor, 'badded', added)
if refundedCredits > 0 then redis.call('HINCRBY', KEY.credits, 'p', refundedCredits) end
redis.call('HINCRBY', KEY.cursor, 'unsettled', -n)
return n
