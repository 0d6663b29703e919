-- The usage events of leased admissions, written by their instance in one batch, with their
-- final statuses and refunds: once, whatever the retries (a batch's id is kept a day).
-- Wires named in script.ts (USAGE_BATCH). KEY: the account's usage events (stream), the
-- exporter's cursor over it (hash: `unsettled` lives there), this batch's id, and the account's
-- counters. One hash tag: one Cluster slot, with the counters quota.lua leased the units from.
-- ARG: the stream's cap; `month`, `soft` and `overageWindow` as refund.lua's; then, from REST,
-- EVENT_FIELDS values per event, read at their offsets by name (EVENT, script.ts): when it was
-- admitted (Redis time, ms), its units, the units of its refund (0: none), and its CloudEvent
-- data, encoded by its instance with its final status (usage/events.ts): the entry holds it as
-- it is, so the exporter reads back three fields, not fifteen. Each event's units leave
-- `unsettled`, where quota.lua put them when it leased them; a refund's units leave the windows
-- here too (units-back.lua), in the same run: until then they stay counted and unsettled, so
-- what the day counted = events written net of refunds + unsettled, whenever the instance dies.
-- With credits (`paidWithCredits` 1), each event names the credit lease its credit came from:
-- written, its credit is spent from that lease's hold (quota.lua: `h:<id>`, "size fromGrant gp
-- x"; `r` the holds' sum), so it no longer goes back to the balance when the lease closes or
-- lapses; a refunded unit's credit goes back as a purchased one, as refund.lua gives it. The
-- holder closing its lease first gives back only what it did not hand out: its hold is gone then,
-- and nothing is spent twice. So spent = events written net of refunds, whenever the holder dies:
-- its lost events' credits go back with the lapse, their units stay in `unsettled`.
-- Returns the events written (0: a batch sent again, already written).
if not redis.call('SET', KEY.batch, 1, 'NX', 'PX', 86400000) then return 0 end
-- `units` of the hold `field` spent: its grant's part first, as the hold gives its purchased part back first.
local function spend(field, units)
  local v = redis.call('HGET', KEY.credits, field)
  if not v then return end
  local size, fromGrant, rest = string.match(v, '^(%d+) (%d+) (.*)$')
  size, fromGrant = tonumber(size), tonumber(fromGrant)
  local n = math.min(units, size)
  if n >= size then redis.call('HDEL', KEY.credits, field)
  else redis.call('HSET', KEY.credits, field, (size - n) .. ' ' .. math.max(0, fromGrant - n) .. ' ' .. rest) end
  redis.call('HSET', KEY.credits, 'r', math.max(0, (tonumber(redis.call('HGET', KEY.credits, 'r')) or 0) - n))
end
local paid = tonumber(ARG.paidWithCredits) == 1
local spent, refundedCredits = {}, 0
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cap = tonumber(ARG.eventsCap)
local month, soft, window = tonumber(ARG.month), tonumber(ARG.soft), tonumber(ARG.overageWindow)
local units, written = 0, 0
-- Each field's offset, looked up once rather than per event.
local AT, UNITS, REFUND, LEASE, DATA = EVENT.at, EVENT.units, EVENT.refundUnits, EVENT.creditLease, EVENT.data
for i = REST, #ARGV, EVENT_FIELDS do
  local admitted, n = ARGV[i + AT], tonumber(ARGV[i + UNITS])
  local id = redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', 'kind', 'request', 'at', admitted, 'data', ARGV[i + DATA])
  local refunded = tonumber(ARGV[i + REFUND])
  if refunded > 0 then
    local over = units_back(KEY.counters, refunded, tonumber(admitted), month, soft, window)
    redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', 'kind', 'refund', 'ref', id, 'units', refunded,
      'overage', over, 'at', now)
  end
  if paid then
    local lease = ARGV[i + LEASE]
    if lease ~= '' then spent[lease] = (spent[lease] or 0) + n end
    refundedCredits = refundedCredits + refunded
  end
  units = units + n
  written = written + 1
end
for lease, n in pairs(spent) do spend('h:' .. lease, n) end
if refundedCredits > 0 then redis.call('HINCRBY', KEY.credits, 'p', refundedCredits) end
redis.call('HINCRBY', KEY.cursor, 'unsettled', -units)
return written
