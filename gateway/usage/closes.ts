import type { RedisClient } from '../redis/client.js';
import { loopKey, pricesKey, subjectKey } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';
import { eventId, type EncodedEvent } from './events.js';
import { CLOSED_TYPE, SEP, STATEMENT_KEEP_MS, type Statement, statementOf } from './periods.js';

// The period close (issue 49): once a billing period has ended and nothing of it is still to
// come, the leader freezes it (from then on its late events go into the next period as
// corrections: periods.ts, tallyPart), sends one `period.closed` event with the frozen figures,
// and marks it closed once the sink took it. A leader that dies in between leaves it frozen;
// the next one sends the same event (same figures, same id) and closes it.

/** Periods tried a round at most; their close events go in one sink batch. */
const CLOSES_PER_ROUND = 100;
/** A period not ready is tried again no sooner than this (a round tries closes once a second at most). */
export const CLOSE_RETRY_MS = 1000;
/** A period not ready waits this long in the index before its next try: those behind it get theirs. */
const NOT_YET_MS = 5000;

const periodsKey = (prefix: string) => loopKey(prefix, 'usage-export', 'periods');
/** Its start and end, then the account's Redis name: the score is when to try it next. */
const member = (d: Due) => `${d.startMs} ${d.endMs} ${d.name}`;

/**
 * Freezes period ARG.start (ending ARG.end) once Redis's time is past its end and nothing of it
 * can still come: no unsent entry stamped before its end (the events stream is in time order),
 * no leased unit unsettled (which may be its) unless `settle` has passed since the end (an
 * instance that died keeps its units unsettled for good), and no unsent bundle written before
 * the end plus `settle` (a bundle's events are its instance's of the last `settle`, in the order
 * their statuses came, so none written after that holds one of the period's, but for an instance
 * that Redis held up longer: a correction). Fenced as the cursor's moves. 1: frozen (now or
 * before); 0: not yet; -2: fenced.
 */
const FREEZE = {
  keys: ['statements', 'cursor', 'stream', 'bundles'],
  argv: ['token', 'start', 'end', 'settle'],
  lua: `if tonumber(ARG.token) < tonumber(redis.call('HGET', KEY.cursor, 'fence') or '0') then return -2 end
if redis.call('HEXISTS', KEY.statements, ARG.start .. '${SEP}frozen') == 1 then return 1 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local e, settle = tonumber(ARG['end']), tonumber(ARG.settle)
if now < e then return 0 end
if now < e + settle and tonumber(redis.call('HGET', KEY.cursor, 'unsettled') or '0') > 0 then return 0 end
local first = redis.call('XRANGE', KEY.stream, '-', '+', 'COUNT', 1)[1]
if first and tonumber(string.match(first[1], '^(%d+)')) < e then return 0 end
local bundle = redis.call('XRANGE', KEY.bundles, '-', '+', 'COUNT', 1)[1]
if bundle and tonumber(string.match(bundle[1], '^(%d+)')) < e + settle then return 0 end
redis.call('HSET', KEY.statements, ARG.start .. '${SEP}frozen', now)
redis.call('PEXPIRE', KEY.statements, ${STATEMENT_KEEP_MS})
if tonumber(redis.call('HGET', KEY.statements, 'frozen') or '0') < e then redis.call('HSET', KEY.statements, 'frozen', e) end
redis.call('HSET', KEY.cursor, 'fence', ARG.token)
return 1`,
} as const satisfies Script<string, string>;

/** Marks a frozen period closed, its close event accepted: fenced. 1: closed; -2: fenced. */
const CLOSE = {
  keys: ['statements', 'cursor'],
  argv: ['token', 'start'],
  lua: `if tonumber(ARG.token) < tonumber(redis.call('HGET', KEY.cursor, 'fence') or '0') then return -2 end
local t = redis.call('TIME')
redis.call('HSETNX', KEY.statements, ARG.start .. '${SEP}closed', tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000))
redis.call('PEXPIRE', KEY.statements, ${STATEMENT_KEEP_MS})
return 1`,
} as const satisfies Script<string, string>;

/**
 * Notes the plans' prices (prices.ts, pricesInForce) as of Redis's time, unless they are the last
 * noted: `<ms>|<json>` by ms. A period that ended is priced by the last noted before its end, so
 * a price changed at a boundary prices the next period, not the one that ended. Noted more than
 * STATEMENT_KEEP_MS ago, all but the last of them go. 1: noted; 0: the same as the last.
 */
const PRICES = {
  keys: ['prices'],
  argv: ['prices'],
  lua: `local last = redis.call('ZRANGE', KEY.prices, 0, 0, 'REV')[1]
if last and string.sub(last, string.find(last, '|', 1, true) + 1) == ARG.prices then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEY.prices, now, now .. '|' .. ARG.prices)
local kept = redis.call('ZRANGE', KEY.prices, now - ${STATEMENT_KEEP_MS}, '-inf', 'BYSCORE', 'REV', 'LIMIT', 0, 1, 'WITHSCORES')[2]
if kept then redis.call('ZREMRANGEBYSCORE', KEY.prices, '-inf', '(' .. kept) end
return 1`,
} as const satisfies Script<string, string>;

type CloseRedis = RedisClient & {
  freezePeriod(...keysThenArgs: Array<string | number>): Promise<number>;
  closePeriod(...keysThenArgs: Array<string | number>): Promise<number>;
  notePrices(...keysThenArgs: Array<string | number>): Promise<number>;
};

export function defineCloseScripts(redis: RedisClient): void {
  defineScript(redis, 'freezePeriod', FREEZE);
  defineScript(redis, 'closePeriod', CLOSE);
  defineScript(redis, 'notePrices', PRICES);
}

/**
 * Each period a round's events go to waits for its close, from its end (one ZADD, whatever the
 * accounts; NX: a period already waiting keeps its next try). Before the round's moves: a round
 * that fails after them has indexed its periods all the same.
 */
export async function periodsTouched(redis: RedisClient, prefix: string, touched: readonly Due[]) {
  if (touched.length === 0) return;
  const args: Array<string | number> = [];
  for (const d of touched) args.push(d.endMs, member(d));
  await redis.zadd(periodsKey(prefix), 'NX', ...args);
}

export interface Due {
  name: string;
  startMs: number;
  endMs: number;
}

/** Redis's clock (ms): a period's end is by it, as the freeze script and the events' stamps are, not by this host's. */
export async function redisNow(redis: RedisClient): Promise<number> {
  const [s, us] = await redis.time();
  return Number(s) * 1000 + Math.floor(Number(us) / 1000);
}

/** The periods whose try is due by `nowMs` (Redis's: redisNow), the oldest first. */
export async function duePeriods(redis: RedisClient, prefix: string, nowMs: number): Promise<Due[]> {
  const got = await redis.zrangebyscore(periodsKey(prefix), '-inf', nowMs, 'LIMIT', 0, CLOSES_PER_ROUND);
  return got.map((m) => {
    const [start, end] = m.split(' ', 2) as [string, string];
    return { startMs: Number(start), endMs: Number(end), name: m.slice(start.length + end.length + 2) };
  });
}

/**
 * A period not ready: tried again in NOT_YET_MS, so the ones behind it are tried meanwhile; but
 * at its settle's end if that comes first (a busy account's units are unsettled until then),
 * and every round in the NOT_YET_MS after it (its last bundle, written moments before, goes in
 * the next round; this clock and Redis's may differ by a few ms).
 */
export async function notYet(redis: RedisClient, prefix: string, d: Due, nowMs: number, settleMs: number): Promise<void> {
  const settled = d.endMs + settleMs;
  const next =
    nowMs < settled ? Math.min(nowMs + NOT_YET_MS, settled) : nowMs < settled + NOT_YET_MS ? nowMs + CLOSE_RETRY_MS : nowMs + NOT_YET_MS;
  await redis.zadd(periodsKey(prefix), 'XX', next, member(d));
}

export async function freeze(redis: RedisClient, d: Due, token: number, settleMs: number): Promise<'frozen' | 'not yet' | 'fenced'> {
  const keys = {
    statements: subjectKey.statements(d.name),
    cursor: subjectKey.eventsCursor(d.name),
    stream: subjectKey.events(d.name),
    bundles: subjectKey.bundles(d.name),
  };
  const n = Number(
    await (redis as CloseRedis).freezePeriod(...wiresArgs(FREEZE, keys, { token, start: d.startMs, end: d.endMs, settle: settleMs })),
  );
  return n === 1 ? 'frozen' : n === 0 ? 'not yet' : 'fenced';
}

/** The frozen period's statement, from the figures the moves tallied. */
export async function frozenStatement(redis: RedisClient, d: Due): Promise<Statement & { frozenAt: number }> {
  const hash = await redis.hgetall(subjectKey.statements(d.name));
  return { ...statementOf(hash, d), frozenAt: Number(hash[`${d.startMs}${SEP}frozen`]) };
}

/** Out of the index without a close: its account is no longer configured, and has no name to close it under. */
export async function forget(redis: RedisClient, prefix: string, d: Due): Promise<void> {
  await redis.zrem(periodsKey(prefix), member(d));
}

/** Closed, and out of the index; false: fenced. */
export async function markClosed(redis: RedisClient, prefix: string, d: Due, token: number): Promise<boolean> {
  const keys = { statements: subjectKey.statements(d.name), cursor: subjectKey.eventsCursor(d.name) };
  if (Number(await (redis as CloseRedis).closePeriod(...wiresArgs(CLOSE, keys, { token, start: d.startMs }))) !== 1) return false;
  await redis.zrem(periodsKey(prefix), member(d));
  return true;
}

/** `com.petstore.gateway.period.closed`, id `<account>/period/<start>`: the same whoever sends it, however often. */
export function closedEvent(account: string, source: string, s: Statement & { frozenAt: number }): EncodedEvent {
  return JSON.stringify({
    specversion: '1.0',
    id: eventId(account, `period/${s.period.start}`),
    source,
    type: CLOSED_TYPE,
    subject: account,
    time: new Date(s.frozenAt).toISOString(),
    datacontenttype: 'application/json',
    data: {
      period: s.period,
      requests: s.totals.requests,
      units: s.totals.units,
      refunds: s.totals.refunds,
      overage: s.totals.overage,
      corrections: s.totals.corrections,
      credits: s.credits,
      events: s.events,
      digest: s.digest,
    },
  });
}

/** The plans' prices as pricesInForce gives them, noted if they changed since the last noted. */
export async function notePrices(redis: RedisClient, prefix: string, prices: string): Promise<void> {
  await (redis as CloseRedis).notePrices(...wiresArgs(PRICES, { prices: pricesKey(prefix) }, { prices }));
}

/**
 * The prices a period ending at `endMs` is priced by: the last noted before its end, or, for a
 * period that ended before any was noted, the first noted; undefined: none noted.
 */
export async function pricesAt(redis: RedisClient, prefix: string, endMs: number): Promise<string | undefined> {
  const key = pricesKey(prefix);
  const [entry] = await redis.zrange(key, `(${endMs}`, '-inf', 'BYSCORE', 'REV', 'LIMIT', 0, 1);
  const found = entry ?? (await redis.zrange(key, 0, 0))[0];
  return found?.slice(found.indexOf('|') + 1);
}
