-- A top-up of an account's purchased credits, once per idempotency key, however often and
-- however concurrently it is retried. billing.lua is prepended (period, credits).
-- Wires named in script.ts (TOPUP). KEY: the account's credits (hash), their ledger (stream), the top-ups made before keys
-- expired (a hash of idempotency key -> "fingerprint entryId balance", read only), its alerts
-- fired (hash) and to send (stream), this idempotency key's top-up (a string, kept ARG.keepMs ms),
-- and its usage events (stream): one Cluster slot.
-- ARG: amount, reason, idempotency key, fingerprint (of amount and reason), billingDay, the
-- credits granted each period, 1 if they roll over, the alert thresholds ('' none), how long
-- the idempotency key is kept (ms), the usage events' cap (0: none).
-- Returns {1, entryId, balance} for a top-up made now, {0, what the first one stored} for a retry.
local seen = redis.call('GET', KEY.topUp) or redis.call('HGET', KEY.topUps, ARG.idempotencyKey)
if seen then return {0, seen} end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ps, pe, pidx = period(now, tonumber(ARG.billingDay))
local book = { ledger = KEY.ledger, events = KEY.events, eventsCap = tonumber(ARG.eventsCap) or 0 }
-- Grants due first, so a top-up before the period's first request is not replaced by its grant.
local grant = tonumber(ARG.grant)
local g, p, gp = credits(KEY.credits, book, now, ps, pe, pidx, grant, tonumber(ARG.rollover) == 1)
local amount = tonumber(ARG.amount)
p = p + amount
redis.call('HSET', KEY.credits, 'g', g, 'p', p)
local id = record(book, now, 'topup', {'amount', amount, 'balance', g + p, 'reason', ARG.reason, 'idempotencyKey', ARG.idempotencyKey})
redis.call('SET', KEY.topUp, ARG.fingerprint .. ' ' .. id .. ' ' .. (g + p), 'PX', ARG.keepMs)
-- A credits alert the balance is back over is resolved.
if grant > 0 then resolveCredits(KEY.alerted, KEY.alerts, now, fractions(ARG.alerts), gp, grant, g + p) end
return {1, id, g + p}
