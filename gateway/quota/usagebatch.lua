-- The usage events of leased admissions, written by their instance in one batch, with their
-- final statuses and refunds: once, whatever the retries (a batch's id is kept a day).
-- Wires named in script.ts (USAGE_BATCH). KEY: the account's usage events (stream), the
-- exporter's cursor over it (hash: `unsettled` lives there), this batch's id, and the account's
-- counters. One hash tag: one Cluster slot, with the counters quota.lua leased the units from.
-- ARG: the stream's cap; `month`, `soft` and `overageWindow` as refund.lua's; how many events
-- and refunds. From REST (script.ts, usageBatchArgs): per event (one unit each) when it was
-- admitted (Redis time, ms) and its CloudEvent data, encoded by its instance with its final
-- status (usage/events.ts): the entry holds it as it is, so the exporter reads back three fields,
-- not fifteen; then per refund the index of its event (from 0) and its units; then per credit
-- lease its id and how many of the events it paid. Each event's unit leaves
-- `unsettled`, where quota.lua put it when it leased it; a refund's units leave the windows
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
local refundedCredits = 0
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cap = tonumber(ARG.eventsCap)
local month, soft, window = tonumber(ARG.month), tonumber(ARG.soft), tonumber(ARG.overageWindow)
local n = tonumber(ARG.events)
-- The refunds' values start after the events', the credit leases' after the refunds'.
local refund, leases = REST + 2 * n, REST + 2 * n + 2 * tonumber(ARG.refunds)
for k = 0, n - 1 do
  local i = REST + 2 * k
  local admitted = ARGV[i]
  local id = redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', 'kind', 'request', 'at', admitted, 'data', ARGV[i + 1])
  if refund < leases and tonumber(ARGV[refund]) == k then
    local refunded = tonumber(ARGV[refund + 1])
    refund = refund + 2
    local over = units_back(KEY.counters, refunded, tonumber(admitted), month, soft, window)
    redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', 'kind', 'refund', 'ref', id, 'units', refunded,
      'overage', over, 'at', now)
    if paid then refundedCredits = refundedCredits + refunded end
  end
end
if paid then
  for i = leases, #ARGV, 2 do spend('h:' .. ARGV[i], tonumber(ARGV[i + 1])) end
end
if refundedCredits > 0 then redis.call('HINCRBY', KEY.credits, 'p', refundedCredits) end
redis.call('HINCRBY', KEY.cursor, 'unsettled', -n)
return n
