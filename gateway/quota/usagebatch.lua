-- The usage events of leased admissions, written by their instance in one batch, with their
-- final statuses and refunds: once, whatever the retries (a batch's id is kept a day).
-- Wires named in script.ts (USAGE_BATCH). KEY: the account's usage events (stream), the
-- exporter's cursor over it (hash: `unsettled` lives there), this batch's id, and the account's
-- counters. One hash tag: one Cluster slot, with the counters quota.lua leased the units from.
-- ARG: the stream's cap; `month`, `soft` and `overageWindow` as refund.lua's; then, from
-- ARGV[FIRST], EVENT_FIELDS values per event (script.ts): the request's id, key id, plan, route,
-- method, units, when it was admitted (Redis time, ms), the windows' counts the lease showed,
-- its status ('-': none known), and the units of its refund (0: none). Each event's units leave
-- `unsettled`, where quota.lua put them when it leased them; a refund's units leave the windows
-- here too (units-back.lua), in the same run: until then they stay counted and unsettled, so
-- what the day counted = events written net of refunds + unsettled, whenever the instance dies.
-- Returns the events written (0: a batch sent again, already written).
if not redis.call('SET', KEY.batch, 1, 'NX', 'PX', 86400000) then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local cap = tonumber(ARG.eventsCap)
local month, soft, window = tonumber(ARG.month), tonumber(ARG.soft), tonumber(ARG.overageWindow)
local units, written = 0, 0
for i = FIRST, #ARGV, EVENT_FIELDS do
  local id = redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', 'kind', 'request', 'rid', ARGV[i], 'key', ARGV[i + 1],
    'plan', ARGV[i + 2], 'route', ARGV[i + 3], 'method', ARGV[i + 4], 'units', ARGV[i + 5], 'at', ARGV[i + 6],
    'minute', ARGV[i + 7], 'day', ARGV[i + 8], 'month', ARGV[i + 9], 'overage', 0, 'credits', -1, 'status', ARGV[i + 10])
  local refunded = tonumber(ARGV[i + 11])
  if refunded > 0 then
    local over = units_back(KEY.counters, refunded, tonumber(ARGV[i + 6]), month, soft, window)
    redis.call('XADD', KEY.events, 'MAXLEN', '~', cap, '*', 'kind', 'refund', 'ref', id, 'units', refunded,
      'overage', over, 'at', now)
  end
  units = units + tonumber(ARGV[i + 5])
  written = written + 1
end
redis.call('HINCRBY', KEY.cursor, 'unsettled', -units)
return written
