import type { RedisClient } from '../redis/client.js';
import { subjectKey } from '../redis/keys.js';
import { nextId, type StreamEntry } from './events.js';

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
 * KEYS: the account's usage cursor hash (`id`, `consumed`, `dropped`, `fence`), its stream, its
 * statuses. ARGV: token, the cursor id read, the last entry sent, how many entries that
 * consumes, the first id to keep, then the entries whose statuses go. One slot: `{k:<account>}`.
 */
const MOVE_USAGE = `local fence = tonumber(redis.call('HGET', KEYS[1], 'fence') or '0')
if tonumber(ARGV[1]) < fence then return 0 end
if (redis.call('HGET', KEYS[1], 'id') or '0-0') ~= ARGV[2] then return -1 end
redis.call('HSET', KEYS[1], 'id', ARGV[3], 'fence', ARGV[1])
redis.call('HINCRBY', KEYS[1], 'consumed', ARGV[4])
redis.call('XTRIM', KEYS[2], 'MINID', ARGV[5])
for i = 6, #ARGV, 500 do
  redis.call('HDEL', KEYS[3], unpack(ARGV, i, math.min(i + 499, #ARGV)))
end
return 1`;

/** KEYS: the account's alerts cursor (a string, as it always was), the highest token that moved it. ARGV: token, the cursor id read, the entry delivered. */
const MOVE_ALERTS = `local fence = tonumber(redis.call('GET', KEYS[2]) or '0')
if tonumber(ARGV[1]) < fence then return 0 end
if (redis.call('GET', KEYS[1]) or '0-0') ~= ARGV[2] then return -1 end
redis.call('SET', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], ARGV[1])
return 1`;

/**
 * KEYS: the account's usage stream, its cursor hash. What the stream's cap dropped, from one
 * consistent view: all it ever took, less what was consumed, less what it holds; recorded in
 * `dropped` when it grew, and the growth returned.
 */
const DROPPED = `local length = redis.call('XLEN', KEYS[1])
local info = redis.call('XINFO', 'STREAM', KEYS[1])
local added = 0
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then added = tonumber(info[i + 1]) end
end
local consumed = tonumber(redis.call('HGET', KEYS[2], 'consumed') or '0')
local known = tonumber(redis.call('HGET', KEYS[2], 'dropped') or '0')
local dropped = added - consumed - length
if dropped <= known then return 0 end
redis.call('HSET', KEYS[2], 'dropped', dropped)
return dropped - known`;

/**
 * KEYS: the account's usage cursor hash, its stream, its statuses. ARGV: the entry to read after
 * ('': the cursor), how many. Returns the cursor, the entries, their statuses (nil: none yet) and
 * the stream's length: what a round needs of an account, in one call in its slot.
 */
const READ_USAGE = `local cursor = redis.call('HGET', KEYS[1], 'id') or '0-0'
local after = ARGV[1]
if after == '' then after = cursor end
local entries = redis.call('XRANGE', KEYS[2], '(' .. after, '+', 'COUNT', ARGV[2])
local statuses = {}
for i = 1, #entries, 500 do
  local ids = {}
  for j = i, math.min(i + 499, #entries) do ids[#ids + 1] = entries[j][1] end
  local found = redis.call('HMGET', KEYS[3], unpack(ids))
  for j = 1, #ids do statuses[#statuses + 1] = found[j] end
end
return {cursor, entries, statuses, redis.call('XLEN', KEYS[2])}`;

type CursorRedis = RedisClient & {
  readUsage(
    cursor: string,
    stream: string,
    statuses: string,
    after: string,
    count: number,
  ): Promise<[string, StreamEntry[], Array<string | null>, number]>;
  moveUsage(cursor: string, stream: string, statuses: string, ...args: Array<string | number>): Promise<number>;
  moveAlerts(cursor: string, fence: string, token: number, from: string, to: string): Promise<number>;
  countDropped(stream: string, cursor: string): Promise<number>;
};

/** Defines the scripts on a client (each loop calls it; defining one twice is harmless). */
export function defineCursorScripts(redis: RedisClient): void {
  redis.defineCommand('moveUsage', { numberOfKeys: 3, lua: MOVE_USAGE });
  redis.defineCommand('moveAlerts', { numberOfKeys: 2, lua: MOVE_ALERTS });
  redis.defineCommand('countDropped', { numberOfKeys: 2, lua: DROPPED });
  redis.defineCommand('readUsage', { numberOfKeys: 3, lua: READ_USAGE });
}

/** What a round read of an account's usage stream. */
export interface UsageRead {
  /** The cursor id ('0-0': none yet). */
  cursor: string;
  entries: StreamEntry[];
  /** The statuses joined to the entries, by their ids. */
  statuses: Map<string, number>;
  /** The stream's length. */
  length: number;
}

/** Up to `count` entries of the account's usage stream after `after` (undefined: after its cursor), with their statuses. */
export async function readUsage(redis: RedisClient, name: string, after: string | undefined, count: number): Promise<UsageRead> {
  const [cursor, entries, found, length] = await (redis as CursorRedis).readUsage(
    subjectKey.eventsCursor(name),
    subjectKey.events(name),
    subjectKey.statuses(name),
    after ?? '',
    count,
  );
  const statuses = new Map<string, number>();
  entries.forEach(([id], i) => found[i] != null && statuses.set(id, Number(found[i])));
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
    subjectKey.eventsCursor(name),
    subjectKey.events(name),
    subjectKey.statuses(name),
    m.token,
    m.from,
    m.to,
    m.consumed,
    nextId(m.to),
    ...m.refs,
  );
  return outcome(Number(n));
}

/** The account's alerts cursor moved to the entry delivered, if `token` still leads. */
export async function moveAlertsCursor(redis: RedisClient, name: string, token: number, from: string, to: string): Promise<Moved> {
  return outcome(
    Number(await (redis as CursorRedis).moveAlerts(subjectKey.alertsCursor(name), subjectKey.alertsFence(name), token, from, to)),
  );
}

/** Events of the account's usage stream its cap dropped since last counted (recorded in the cursor's `dropped`). */
export async function countDropped(redis: RedisClient, name: string): Promise<number> {
  return Number(await (redis as CursorRedis).countDropped(subjectKey.events(name), subjectKey.eventsCursor(name)));
}
