import type { RedisClient } from '../redis/client.js';
import { subjectKey } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';
import { DATA_FIELD, nextId, type UsageEntries } from './events.js';

// The streams' cursors, moved only under the lead in force: each move carries the fencing
// token its leader got when it took the lead (leader.ts), as Kleppmann's fencing tokens do.
// The lock lives in another Cluster slot, so a move cannot read it: the cursor keeps the
// highest token that moved it and refuses a lower one, and it compares-and-sets the cursor id
// the round read, so a leader that lost the lead can never count or trim a batch twice.

/** A move's outcome: done; refused for a newer lead's token; refused for a cursor moved since the round read it. */
export type Moved = 'moved' | 'fenced' | 'raced';

/** Why a move was refused, for a log line. */
export const REFUSED: Record<Exclude<Moved, 'moved'>, string> = {
  fenced: 'moved by a newer lead',
  raced: 'moved since this round read it',
};

const outcome = (n: number): Moved => (n === 1 ? 'moved' : n === 0 ? 'fenced' : 'raced');

/**
 * The account's usage cursor hash (`id`, `consumed`, `dropped`, `fence`), its stream, its
 * statuses, in one slot (`{k:<account>}`). The ids of the entries whose statuses go come from REST on.
 */
const MOVE_USAGE = {
  keys: ['cursor', 'stream', 'statuses'],
  argv: ['token', 'read', 'sent', 'consumed', 'keepFrom'], // the cursor id read, the last entry sent, what it consumes, the first id kept
  lua: `local fence = tonumber(redis.call('HGET', KEY.cursor, 'fence') or '0')
if tonumber(ARG.token) < fence then return 0 end
if (redis.call('HGET', KEY.cursor, 'id') or '0-0') ~= ARG.read then return -1 end
redis.call('HSET', KEY.cursor, 'id', ARG.sent, 'fence', ARG.token)
redis.call('HINCRBY', KEY.cursor, 'consumed', ARG.consumed)
redis.call('XTRIM', KEY.stream, 'MINID', ARG.keepFrom)
for i = REST, #ARGV, 500 do
  redis.call('HDEL', KEY.statuses, unpack(ARGV, i, math.min(i + 499, #ARGV)))
end
return 1`,
} as const satisfies Script<string, string>;

/** The account's alerts cursor (a string, as it always was), the highest token that moved it. */
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

/**
 * What the usage stream's cap dropped, from one consistent view: all it ever took, less what
 * was consumed, less what it holds; recorded in the cursor's `dropped` when it grew, and the growth returned.
 */
const DROPPED = {
  keys: ['stream', 'cursor'],
  argv: [],
  lua: `local length = redis.call('XLEN', KEY.stream)
local info = redis.call('XINFO', 'STREAM', KEY.stream)
local added = 0
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then added = tonumber(info[i + 1]) end
end
local consumed = tonumber(redis.call('HGET', KEY.cursor, 'consumed') or '0')
local known = tonumber(redis.call('HGET', KEY.cursor, 'dropped') or '0')
local dropped = added - consumed - length
if dropped <= known then return 0 end
redis.call('HSET', KEY.cursor, 'dropped', dropped)
return dropped - known`,
} as const satisfies Script<string, string>;

/**
 * Up to `count` entries after `after` ('': the cursor), flat (events.ts, UsageEntries: a leased
 * admission's as `id, at, data`, usagebatch.lua's layout `kind request at <ms> data <json>`
 * checked here; any other as `id, '', fields`), with the cursor, the statuses found for them
 * (id, status, id, status...) and the stream's length: what a round needs of an account, in one
 * call in its slot. A leased admission's entry carries its status in its data: only the others
 * are looked up.
 */
const READ_USAGE = {
  keys: ['cursor', 'stream', 'statuses'],
  argv: ['after', 'count'],
  lua: `local cursor = redis.call('HGET', KEY.cursor, 'id') or '0-0'
local after = ARG.after
if after == '' then after = cursor end
local entries = redis.call('XRANGE', KEY.stream, '(' .. after, '+', 'COUNT', ARG.count)
local flat, ids = {}, {}
for _, e in ipairs(entries) do
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
return {cursor, flat, found, redis.call('XLEN', KEY.stream)}`,
} as const satisfies Script<string, string>;

type Args = Array<string | number>;
type CursorRedis = RedisClient & {
  readUsage(...keysThenArgs: Args): Promise<[string, UsageEntries, string[], number]>;
  moveUsage(...keysThenArgs: Args): Promise<number>;
  moveAlerts(...keysThenArgs: Args): Promise<number>;
  countDropped(...keysThenArgs: Args): Promise<number>;
};

/** Defines the scripts on a client (each loop calls it; defining one twice is harmless). */
export function defineCursorScripts(redis: RedisClient): void {
  defineScript(redis, 'moveUsage', MOVE_USAGE);
  defineScript(redis, 'moveAlerts', MOVE_ALERTS);
  defineScript(redis, 'countDropped', DROPPED);
  defineScript(redis, 'readUsage', READ_USAGE);
}

/** The usage cursor's keys of an account. */
const usageKeys = (name: string) => ({
  cursor: subjectKey.eventsCursor(name),
  stream: subjectKey.events(name),
  statuses: subjectKey.statuses(name),
});

/** What a round read of an account's usage stream. */
export interface UsageRead {
  /** The cursor id ('0-0': none yet). */
  cursor: string;
  /** Flat: events.ts, UsageEntries. */
  entries: UsageEntries;
  /** The statuses joined to the entries, by their ids. */
  statuses: Map<string, number>;
  /** The stream's length. */
  length: number;
}

/** Up to `count` entries of the account's usage stream after `after` (undefined: after its cursor), with their statuses. */
export async function readUsage(redis: RedisClient, name: string, after: string | undefined, count: number): Promise<UsageRead> {
  const [cursor, entries, found, length] = await (redis as CursorRedis).readUsage(
    ...wiresArgs(READ_USAGE, usageKeys(name), { after: after ?? '', count }),
  );
  const statuses = new Map<string, number>();
  for (let i = 0; i < found.length; i += 2) statuses.set(found[i]!, Number(found[i + 1]));
  return { cursor, entries, statuses, length: Number(length) };
}

/** Whether each account's usage stream holds anything: a move trims what it sent, so an empty stream has nothing unsent. */
export function usagePending(redis: RedisClient, names: string[]): Promise<boolean[]> {
  return Promise.all(names.map(async (name) => (await redis.xlen(subjectKey.events(name))) > 0));
}

/** Whether each account's alerts stream has an entry past its cursor (delivered alerts stay in the stream). */
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

/** Whether stream id `a` comes after `b`. */
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
  to: string;
  /** Entries from `from` (excluded) to `to`: what `consumed` grows by. */
  consumed: number;
  /** Their ids, whose joined statuses are deleted. */
  refs: string[];
}

/** The account's usage cursor moved past what was sent, counted, trimmed and its statuses deleted, in one script, if `token` still leads. */
export async function moveUsageCursor(redis: RedisClient, name: string, m: UsageMove): Promise<Moved> {
  const r = redis as CursorRedis;
  const n = await r.moveUsage(
    ...wiresArgs(
      MOVE_USAGE,
      usageKeys(name),
      { token: m.token, read: m.from, sent: m.to, consumed: m.consumed, keepFrom: nextId(m.to) },
      m.refs,
    ),
  );
  return outcome(Number(n));
}

/** The account's alerts cursor moved to the entry delivered, if `token` still leads. */
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

/** Events of the account's usage stream its cap dropped since last counted (recorded in the cursor's `dropped`). */
export async function countDropped(redis: RedisClient, name: string): Promise<number> {
  const keys = { stream: subjectKey.events(name), cursor: subjectKey.eventsCursor(name) };
  return Number(await (redis as CursorRedis).countDropped(...wiresArgs(DROPPED, keys, {})));
}
