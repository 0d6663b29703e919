import type { RedisClient } from '../redis/client.js';
import { subjectKey } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';
import { type Bundle, DATA_FIELD, nextId, type UsageEntries } from './events.js';
import { APPLY_TALLY } from './periods.js';

// Each move carries its leader's fencing token (leader.ts). The lock is in another Cluster slot, so the cursor keeps
// the highest token that moved it and compares-and-sets the id the round read: a deposed leader never sends twice.

export type Moved = 'moved' | 'fenced' | 'raced';

export const REFUSED: Record<Exclude<Moved, 'moved'>, string> = {
  fenced: 'moved by a newer lead',
  raced: 'moved since this round read it',
};

const outcome = (n: number): Moved => (n === 1 ? 'moved' : n === 0 ? 'fenced' : 'raced');

/**
 * One slot (`{k:<account>}`). The stream's cursor moves only from the id the round read; the bundles' only forward,
 * by their events: a bundle the cap dropped since the read, then delivered, counts as sent, not dropped. Status ids from REST on.
 */
const MOVE_USAGE = {
  keys: ['cursor', 'stream', 'statuses', 'bundles', 'statements'],
  argv: ['token', 'read', 'sent', 'consumed', 'keepFrom', 'bsent', 'bupto', 'bkeepFrom', 'bfrom', 'frozen', 'stats'],
  lua: `${APPLY_TALLY}local fence = tonumber(redis.call('HGET', KEY.cursor, 'fence') or '0')
if tonumber(ARG.token) < fence then return 0 end
if ARG.sent ~= '' and (redis.call('HGET', KEY.cursor, 'id') or '0-0') ~= ARG.read then return -1 end
-- The round tallied its events against the periods frozen when it read (periods.ts): a freeze since, and it reads again.
if (redis.call('HGET', KEY.statements, 'frozen') or '0') ~= ARG.frozen then return -1 end
redis.call('HSET', KEY.cursor, 'fence', ARG.token)
local bat = tonumber(redis.call('HGET', KEY.cursor, 'bupto') or '0')
-- The bundles tallied so far: moved by this alone (the cap moves bupto too, past bundles the sink may hold).
local tat = tonumber(redis.call('HGET', KEY.cursor, 'tupto') or '0')
applyTally(ARG.stats, ARG.sent ~= '', tat)
if ARG.bsent ~= '' and tonumber(ARG.bupto) > tat then redis.call('HSET', KEY.cursor, 'tupto', ARG.bupto) end
if ARG.sent ~= '' then
  redis.call('HSET', KEY.cursor, 'id', ARG.sent)
  redis.call('HINCRBY', KEY.cursor, 'consumed', ARG.consumed)
  redis.call('XTRIM', KEY.stream, 'MINID', ARG.keepFrom)
end
if ARG.bsent ~= '' then
  local through = tonumber(ARG.bupto)
  -- Bundles this move delivered, (bfrom, through], that the cap dropped after the round read them
  -- (it moved bupto past them) and no move delivered before (tupto): the sink has them, so they
  -- are exported, not dropped. Sent or dropped, never both.
  if ARG.bfrom ~= '' then
    local both = math.min(through, bat) - math.max(tonumber(ARG.bfrom), tat)
    if both > 0 then
      redis.call('HINCRBY', KEY.cursor, 'bdropped', -both)
      redis.call('HINCRBY', KEY.cursor, 'bconsumed', both)
    end
  end
  if through > bat then
    redis.call('HSET', KEY.cursor, 'bid', ARG.bsent, 'bupto', through)
    redis.call('HINCRBY', KEY.cursor, 'bconsumed', through - bat)
    redis.call('XTRIM', KEY.bundles, 'MINID', ARG.bkeepFrom)
  end
end
for i = REST, #ARGV, 500 do
  redis.call('HDEL', KEY.statuses, unpack(ARGV, i, math.min(i + 499, #ARGV)))
end
return 1`,
} as const satisfies Script<string, string>;

/** The alerts cursor stays a plain string, as it always was. */
const MOVE_ALERTS = {
  keys: ['cursor', 'fence'],
  argv: ['token', 'read', 'delivered'],
  lua: `local fence = tonumber(redis.call('GET', KEY.fence) or '0')
if tonumber(ARG.token) < fence then return 0 end
if (redis.call('GET', KEY.cursor) or '0-0') ~= ARG.read then return -1 end
redis.call('SET', KEY.cursor, ARG.delivered)
redis.call('SET', KEY.fence, ARG.token)
return 1`,
} as const satisfies Script<string, string>;

/** Dropped = entries-added - consumed - length, read in one script so a write between reads cannot miscount; plus `bdropped` growth. */
const DROPPED = {
  keys: ['stream', 'cursor'],
  argv: [],
  lua: `local b = redis.call('HMGET', KEY.cursor, 'bdropped', 'bknown')
local grown = (tonumber(b[1]) or 0) - (tonumber(b[2]) or 0)
if grown > 0 then redis.call('HSET', KEY.cursor, 'bknown', b[1]) else grown = 0 end
local length = redis.call('XLEN', KEY.stream)
local added = 0
if length > 0 or redis.call('EXISTS', KEY.stream) == 1 then
  local info = redis.call('XINFO', 'STREAM', KEY.stream)
  for i = 1, #info, 2 do
    if info[i] == 'entries-added' then added = tonumber(info[i + 1]) end
  end
end
local consumed = tonumber(redis.call('HGET', KEY.cursor, 'consumed') or '0')
local known = tonumber(redis.call('HGET', KEY.cursor, 'dropped') or '0')
local dropped = added - consumed - length
if dropped <= known then return grown end
redis.call('HSET', KEY.cursor, 'dropped', dropped)
return grown + dropped - known`,
} as const satisfies Script<string, string>;

/** All a round needs of an account, in one call in its slot ('' for `after`/`bafter`: from the cursor). */
const READ_USAGE = {
  keys: ['cursor', 'stream', 'statuses', 'bundles', 'statements'],
  argv: ['after', 'count', 'bafter', 'bcount'],
  lua: `local cursor = redis.call('HGET', KEY.cursor, 'id') or '0-0'
local after = ARG.after
if after == '' then after = cursor end
local flat, ids = {}, {}
if tonumber(ARG.count) > 0 then
  for _, e in ipairs(redis.call('XRANGE', KEY.stream, '(' .. after, '+', 'COUNT', ARG.count)) do
    local f = e[2]
    flat[#flat + 1] = e[1]
    if #f == 6 and f[5] == '${DATA_FIELD}' and f[1] == 'kind' and f[2] == 'request' and f[3] == 'at' then
      flat[#flat + 1] = f[4]
      flat[#flat + 1] = f[6]
    else
      ids[#ids + 1] = e[1]
      flat[#flat + 1] = ''
      flat[#flat + 1] = f
    end
  end
end
local found = {}
for i = 1, #ids, 500 do
  local chunk = {unpack(ids, i, math.min(i + 499, #ids))}
  local statuses = redis.call('HMGET', KEY.statuses, unpack(chunk))
  for j = 1, #chunk do
    if statuses[j] then
      found[#found + 1] = chunk[j]
      found[#found + 1] = statuses[j]
    end
  end
end
local b = redis.call('HMGET', KEY.cursor, 'bid', 'bdropped', 'bknown')
local bcursor = b[1] or '0-0'
local from = ARG.bafter
if from == '' then from = bcursor end
local bundles, taken, want = {}, 0, tonumber(ARG.bcount)
while taken < want do
  local got = redis.call('XRANGE', KEY.bundles, '(' .. from, '+', 'COUNT', 8)
  if #got == 0 then break end
  for _, e in ipairs(got) do
    local f = e[2]
    local n = tonumber(f[2])
    -- Whole bundles only; the first even past the count, so a round always moves.
    if taken > 0 and taken + n > want then
      want = taken
      break
    end
    for _, v in ipairs({e[1], n, f[4], f[6], f[8], f[10] or ''}) do bundles[#bundles + 1] = v end
    taken = taken + n
    from = e[1]
    if taken >= want then break end
  end
end
local more = 0
if want > 0 and taken >= want then more = 1 end
return {cursor, flat, found, redis.call('XLEN', KEY.stream), bcursor, bundles, more,
  (tonumber(b[2]) or 0) - (tonumber(b[3]) or 0), redis.call('HGET', KEY.statements, 'frozen') or '0'}`,
} as const satisfies Script<string, string>;

type Args = Array<string | number>;
type CursorRedis = RedisClient & {
  readUsage(
    ...keysThenArgs: Args
  ): Promise<[string, UsageEntries, string[], number, string, Array<string | number>, number, number, string]>;
  moveUsage(...keysThenArgs: Args): Promise<number>;
  moveAlerts(...keysThenArgs: Args): Promise<number>;
  countDropped(...keysThenArgs: Args): Promise<number>;
};

/** Each loop calls it: defining a script twice is harmless. */
export function defineCursorScripts(redis: RedisClient): void {
  defineScript(redis, 'moveUsage', MOVE_USAGE);
  defineScript(redis, 'moveAlerts', MOVE_ALERTS);
  defineScript(redis, 'countDropped', DROPPED);
  defineScript(redis, 'readUsage', READ_USAGE);
}

const usageKeys = (name: string) => ({
  cursor: subjectKey.eventsCursor(name),
  stream: subjectKey.events(name),
  statuses: subjectKey.statuses(name),
  bundles: subjectKey.bundles(name),
  statements: subjectKey.statements(name),
});

const BUNDLE = 6;

export interface UsageRead {
  /** '0-0': none yet. */
  cursor: string;
  entries: UsageEntries;
  statuses: Map<string, number>;
  length: number;
  /** '0-0': none yet. */
  bundleCursor: string;
  bundles: Bundle[];
  moreBundles: boolean;
  /** Dropped by the bundles' cap, not yet reported by countDropped. */
  unreported: number;
  /** The end (ms) of the account's last frozen period, as MOVE_USAGE must find it ('0': none). */
  frozen: string;
}

/** Bundles come whole, up to `bundleEvents` events, the first always. */
export async function readUsage(
  redis: RedisClient,
  name: string,
  at: { after?: string; count: number; bundlesAfter?: string; bundleEvents: number },
): Promise<UsageRead> {
  const [cursor, entries, found, length, bundleCursor, flat, more, unreported, frozen] = await (redis as CursorRedis).readUsage(
    ...wiresArgs(READ_USAGE, usageKeys(name), {
      after: at.after ?? '',
      count: at.count,
      bafter: at.bundlesAfter ?? '',
      bcount: at.bundleEvents,
    }),
  );
  const statuses = new Map<string, number>();
  for (let i = 0; i < found.length; i += 2) statuses.set(found[i]!, Number(found[i + 1]));
  const bundles: Bundle[] = [];
  for (let i = 0; i < flat.length; i += BUNDLE) {
    const [id, events, upto, data, refunds, credits] = flat.slice(i, i + BUNDLE) as [string, number, string, string, string, string];
    bundles.push({ id, events: Number(events), upto: Number(upto), data, refunds, credits });
  }
  return {
    cursor,
    entries,
    statuses,
    length: Number(length),
    bundleCursor,
    bundles,
    moreBundles: Number(more) === 1,
    unreported: Number(unreported),
    frozen,
  };
}

/** A move trims what it sent, so an empty stream has nothing unsent. */
export function usagePending(redis: RedisClient, names: string[]): Promise<boolean[]> {
  return Promise.all(
    names.map(async (name) => {
      const [events, bundles] = await Promise.all([redis.xlen(subjectKey.events(name)), redis.xlen(subjectKey.bundles(name))]);
      return events + bundles > 0;
    }),
  );
}

/** Delivered alerts stay in the stream: compare with the cursor. */
export function alertsPending(redis: RedisClient, names: string[]): Promise<boolean[]> {
  return Promise.all(
    names.map(async (name) => {
      const [cursor, last] = await Promise.all([
        redis.get(subjectKey.alertsCursor(name)),
        redis.xrevrange(subjectKey.alerts(name), '+', '-', 'COUNT', 1),
      ]);
      return last.length > 0 && idAfter(last[0]![0], cursor ?? '0-0');
    }),
  );
}

export function idAfter(a: string, b: string): boolean {
  const [am, as] = a.split('-').map(Number) as [number, number];
  const [bm, bs] = b.split('-').map(Number) as [number, number];
  return am > bm || (am === bm && as > bs);
}

export interface UsageMove {
  token: number;
  /** The cursor id the round read ('0-0': none yet). */
  from: string;
  /** The last entry sent. */
  to?: string;
  consumed: number;
  /** Ids whose joined statuses are deleted. */
  refs: string[];
  /** The last bundle sent. */
  bundle?: Pick<Bundle, 'id' | 'upto'>;
  /** The events the account's bundles took up to the first bundle sent (its `upto` less its events). */
  bundleFrom?: number;
  /** As the round read it (UsageRead.frozen; none: '0'). */
  frozen?: string;
  /** periods.ts, tallyLine: a line a part (none: nothing tallied). */
  stats?: string[];
}

export async function moveUsageCursor(redis: RedisClient, name: string, m: UsageMove): Promise<Moved> {
  const r = redis as CursorRedis;
  const n = await r.moveUsage(
    ...wiresArgs(
      MOVE_USAGE,
      usageKeys(name),
      {
        token: m.token,
        read: m.from,
        sent: m.to ?? '',
        consumed: m.consumed,
        keepFrom: m.to ? nextId(m.to) : '',
        bsent: m.bundle?.id ?? '',
        bupto: m.bundle?.upto ?? 0,
        bkeepFrom: m.bundle ? nextId(m.bundle.id) : '',
        bfrom: m.bundleFrom ?? '',
        frozen: m.frozen ?? '0',
        stats: (m.stats ?? []).join('\n'),
      },
      m.refs,
    ),
  );
  return outcome(Number(n));
}

export async function moveAlertsCursor(redis: RedisClient, name: string, token: number, from: string, to: string): Promise<Moved> {
  return outcome(
    Number(
      await (redis as CursorRedis).moveAlerts(
        ...wiresArgs(
          MOVE_ALERTS,
          { cursor: subjectKey.alertsCursor(name), fence: subjectKey.alertsFence(name) },
          { token, read: from, delivered: to },
        ),
      ),
    ),
  );
}

export async function countDropped(redis: RedisClient, name: string): Promise<number> {
  const keys = { stream: subjectKey.events(name), cursor: subjectKey.eventsCursor(name) };
  return Number(await (redis as CursorRedis).countDropped(...wiresArgs(DROPPED, keys, {})));
}
