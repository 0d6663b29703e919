-- A top-up of an account's purchased credits, once per idempotency key, however often and
-- however concurrently it is retried. billing.lua is prepended (period, credits).
-- KEYS: the account's credits (hash), their ledger (stream), the top-ups made before keys
-- expired (a hash of idempotency key -> "fingerprint entryId balance", read only), its alerts
-- fired (hash) and to send (stream), this idempotency key's top-up (a string, kept ARGV[9] ms),
-- and its usage events (stream): one Cluster slot.
-- ARGV: amount, reason, idempotency key, fingerprint (of amount and reason), billingDay, the
-- credits granted each period, 1 if they roll over, the alert thresholds ('' none), how long
-- the idempotency key is kept (ms), the usage events' cap (0: none).
-- Returns {1, entryId, balance} for a top-up made now, {0, what the first one stored} for a retry.
local seen = redis.call('GET', KEYS[6]) or redis.call('HGET', KEYS[3], ARGV[3])
if seen then return {0, seen} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ps, pe, pidx = period(now, tonumber(ARGV[5]))
local book = { ledger = KEYS[2], events = KEYS[7], eventsCap = tonumber(ARGV[10]) or 0 }
-- Grants due first, so a top-up before the period's first request is not replaced by its grant.
local grant = tonumber(ARGV[6])
local g, p, gp = credits(KEYS[1], book, now, ps, pe, pidx, grant, tonumber(ARGV[7]) == 1)
local amount = tonumber(ARGV[1])
p = p + amount
redis.call('HSET', KEYS[1], 'g', g, 'p', p)
local id = record(book, now, 'topup', {'amount', amount, 'balance', g + p, 'reason', ARGV[2], 'idempotencyKey', ARGV[3]})
redis.call('SET', KEYS[6], ARGV[4] .. ' ' .. id .. ' ' .. (g + p), 'PX', ARGV[9])
-- A credits alert the balance is back over is resolved.
if grant > 0 then resolveCredits(KEYS[4], KEYS[5], now, fractions(ARGV[8]), gp, grant, g + p) end
return {1, id, g + p}
