import type { RedisClient } from '../redis/client.js';
import { loopKey, subjectKey } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';
import { COMPACT } from '../quota/bundle.js';
import { eventId, type EncodedEvent } from './events.js';
import { CLOSED_TYPE, SEP, type Statement, statementOf } from './periods.js';

// The period close (issue 49): once a billing period has ended and nothing of it is still to
// come, the leader freezes it (from then on its late events go into the next period as
// corrections: periods.ts, tallyPart), sends one `period.closed` event with the frozen figures,
// and marks it closed once the sink took it. A leader that dies in between leaves it frozen;
// the next one sends the same event (same figures, same id) and closes it.

/** Periods to close a round at most; a period waits in the index (score: its end) until it closes. */
const CLOSES_PER_ROUND = 16;
/** A period not ready is tried again no sooner than this. */
export const CLOSE_RETRY_MS = 1000;
/** Bundles still unsent past which a period waits whatever they hold: the sink is behind. */
const PENDING_BUNDLES = 16;

const periodsKey = (prefix: string) => loopKey(prefix, 'usage-export', 'periods');
const member = (name: string, startMs: number) => `${startMs} ${name}`;

/**
 * Freezes period ARG.start (ending ARG.end) once Redis's time is past its end and nothing of it
 * can still come: no unsent entry stamped before its end, no unsent bundle with an event from
 * before it, and no leased unit unsettled (which may be its) unless `settle` has passed since the
 * end (an instance that died keeps its units unsettled for good). Fenced as the cursor's moves.
 * 1: frozen (now or before); 0: not yet; -2: fenced.
 */
const FREEZE = {
  keys: ['statements', 'cursor', 'stream', 'bundles'],
  argv: ['token', 'start', 'end', 'settle'],
  lua: `if tonumber(ARG.token) < tonumber(redis.call('HGET', KEY.cursor, 'fence') or '0') then return -2 end
if redis.call('HEXISTS', KEY.statements, ARG.start .. '${SEP}frozen') == 1 then return 1 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local e = tonumber(ARG['end'])
if now < e then return 0 end
if now < e + tonumber(ARG.settle) and tonumber(redis.call('HGET', KEY.cursor, 'unsettled') or '0') > 0 then return 0 end
local first = redis.call('XRANGE', KEY.stream, '-', '+', 'COUNT', 1)[1]
if first and tonumber(string.match(first[1], '^(%d+)')) < e then return 0 end
if redis.call('XLEN', KEY.bundles) > ${PENDING_BUNDLES} then return 0 end
for _, b in ipairs(redis.call('XRANGE', KEY.bundles, '-', '+')) do
  local from = string.match(b[2][6] or '', '^${COMPACT}[^${COMPACT}]*${COMPACT}(%d+)${COMPACT}')
  if not from or tonumber(from) < e then return 0 end
end
redis.call('HSET', KEY.statements, ARG.start .. '${SEP}frozen', now)
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
return 1`,
} as const satisfies Script<string, string>;

type CloseRedis = RedisClient & {
  freezePeriod(...keysThenArgs: Array<string | number>): Promise<number>;
  closePeriod(...keysThenArgs: Array<string | number>): Promise<number>;
};

export function defineCloseScripts(redis: RedisClient): void {
  defineScript(redis, 'freezePeriod', FREEZE);
  defineScript(redis, 'closePeriod', CLOSE);
}

/** After a round's moves: each period its events went to waits for its close (one ZADD, whatever the accounts). */
export async function periodsTouched(
  redis: RedisClient,
  prefix: string,
  touched: ReadonlyArray<{ name: string; start: number; end: number }>,
) {
  if (touched.length === 0) return;
  const args: Array<string | number> = [];
  for (const t of touched) args.push(t.end, member(t.name, t.start));
  await redis.zadd(periodsKey(prefix), ...args);
}

export interface Due {
  name: string;
  startMs: number;
  endMs: number;
}

/** The periods ended by `nowMs`, oldest end first. */
export async function duePeriods(redis: RedisClient, prefix: string, nowMs: number): Promise<Due[]> {
  const got = await redis.zrangebyscore(periodsKey(prefix), '-inf', nowMs, 'WITHSCORES', 'LIMIT', 0, CLOSES_PER_ROUND);
  const out: Due[] = [];
  for (let i = 0; i < got.length; i += 2) {
    const m = got[i]!;
    const space = m.indexOf(' ');
    out.push({ name: m.slice(space + 1), startMs: Number(m.slice(0, space)), endMs: Number(got[i + 1]) });
  }
  return out;
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
  await redis.zrem(periodsKey(prefix), member(d.name, d.startMs));
}

/** Closed, and out of the index; false: fenced. */
export async function markClosed(redis: RedisClient, prefix: string, d: Due, token: number): Promise<boolean> {
  const keys = { statements: subjectKey.statements(d.name), cursor: subjectKey.eventsCursor(d.name) };
  if (Number(await (redis as CloseRedis).closePeriod(...wiresArgs(CLOSE, keys, { token, start: d.startMs }))) !== 1) return false;
  await redis.zrem(periodsKey(prefix), member(d.name, d.startMs));
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
