import type { Decision } from '../quota/decision.js';
import type { RedisClient } from '../redis/client.js';
import { deploymentStandingKeys } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';

// The accounts' standing the operator page lists without reading every account: those within
// 10% of a limit, and the sum of the credit balances. Both come from each active account's last
// decision of the second, written in the history's flush (two script calls a second, whatever
// the number of accounts), and from top-ups as they are made.

/** A window is near its limit with this share of it left, or less. */
export const NEAR_SHARE = 0.1;
/** Accounts listed near a limit, and expired entries pruned a flush, at most. */
export const NEAR_MAX = 100;
/** The deployment's standing keys live as long as the history's ranking, renewed by every flush. */
const KEEP_S = 62 * 86_400;

export interface NearWindow {
  name: string;
  used: number;
  limit: number;
  resetMs: number;
}

/** A decision's windows with 10% of their limit or less left (what the usage view calls near, too). */
export function nearWindows(d: Decision): NearWindow[] {
  const near: NearWindow[] = [];
  for (const w of d.windows) {
    if (w.limit > 0 && w.limit - w.used <= w.limit * NEAR_SHARE)
      near.push({ name: w.name, used: w.used, limit: w.limit, resetMs: w.resetMs });
  }
  return near;
}

/**
 * REST: triples of a subject name, its windows near a limit (JSON, '' for none) and when the last
 * of them resets. An account is listed until its last near window resets; expired entries are
 * pruned here, NEAR_MAX a call, so the set holds what is near now and no more.
 */
const NEAR = {
  keys: ['near', 'windows'],
  argv: ['nowMs', 'keepS', 'prune'],
  lua: `for i = REST, #ARGV, 3 do
  if ARGV[i + 1] == '' then
    redis.call('ZREM', KEY.near, ARGV[i])
    redis.call('HDEL', KEY.windows, ARGV[i])
  else
    redis.call('ZADD', KEY.near, ARGV[i + 2], ARGV[i])
    redis.call('HSET', KEY.windows, ARGV[i], ARGV[i + 1])
  end
end
local gone = redis.call('ZRANGEBYSCORE', KEY.near, '-inf', ARG.nowMs, 'LIMIT', 0, tonumber(ARG.prune))
for _, name in ipairs(gone) do
  redis.call('ZREM', KEY.near, name)
  redis.call('HDEL', KEY.windows, name)
end
redis.call('EXPIRE', KEY.near, ARG.keepS)
redis.call('EXPIRE', KEY.windows, ARG.keepS)
return #gone`,
} as const satisfies Script<string, string>;

/**
 * REST: triples of a subject name, the time of a balance (Redis's, ms) and the balance. Each
 * account's newest balance is kept ("<ms> <balance>"), and the total moves by its change: an older
 * one arriving late (another instance's flush) changes nothing. Two of the same millisecond: the
 * lower, since within a millisecond only spending moves a balance.
 */
const BALANCES = {
  keys: ['balances', 'total'],
  argv: ['keepS'],
  lua: `for i = REST, #ARGV, 3 do
  local at, balance = tonumber(ARGV[i + 1]), tonumber(ARGV[i + 2])
  local was = redis.call('HGET', KEY.balances, ARGV[i])
  local wasAt, wasBalance = -1, 0
  if was then
    local space = string.find(was, ' ', 1, true)
    wasAt, wasBalance = tonumber(string.sub(was, 1, space - 1)), tonumber(string.sub(was, space + 1))
  end
  if at > wasAt or (at == wasAt and balance < wasBalance) then
    redis.call('HSET', KEY.balances, ARGV[i], ARGV[i + 1] .. ' ' .. ARGV[i + 2])
    redis.call('INCRBY', KEY.total, string.format('%d', balance - wasBalance))
  end
end
redis.call('EXPIRE', KEY.balances, ARG.keepS)
redis.call('EXPIRE', KEY.total, ARG.keepS)
return redis.call('GET', KEY.total)`,
} as const satisfies Script<string, string>;

type StandingRedis = RedisClient & {
  standingNear(...keysThenArgs: Array<string | number>): Promise<number>;
  standingBalances(...keysThenArgs: Array<string | number>): Promise<string | null>;
};

export function defineStandingScripts(redis: RedisClient): void {
  defineScript(redis, 'standingNear', NEAR);
  defineScript(redis, 'standingBalances', BALANCES);
}

/** What one flush writes: each active account's last decision. */
export async function writeStanding(redis: RedisClient, prefix: string, last: ReadonlyMap<string, Decision>, nowMs: number): Promise<void> {
  const k = deploymentStandingKeys(prefix);
  const near: Array<string | number> = [];
  const balances: Array<string | number> = [];
  for (const [name, d] of last) {
    const windows = nearWindows(d);
    const until = windows.reduce((n, w) => Math.max(n, w.resetMs), 0);
    near.push(name, windows.length === 0 ? '' : JSON.stringify(windows), until);
    if (d.balance !== undefined) balances.push(name, Math.floor(d.nowMs), d.balance);
  }
  const r = redis as StandingRedis;
  await Promise.all([
    r.standingNear(...wiresArgs(NEAR, k, { nowMs, keepS: KEEP_S, prune: NEAR_MAX }, near)),
    balances.length === 0 ? undefined : r.standingBalances(...wiresArgs(BALANCES, k, { keepS: KEEP_S }, balances)),
  ]);
}

/** A balance learnt outside a request (a top-up's answer): `atMs` is Redis's time of it. */
export async function recordBalance(redis: RedisClient, prefix: string, name: string, atMs: number, balance: number): Promise<void> {
  const k = deploymentStandingKeys(prefix);
  await (redis as StandingRedis).standingBalances(...wiresArgs(BALANCES, k, { keepS: KEEP_S }, [name, atMs, balance]));
}

export interface Standing {
  /** Subjects with a window near its limit now, soonest reset last; at most NEAR_MAX. */
  near: Array<{ name: string; windows: NearWindow[] }>;
  /** The sum of every account's last known balance. */
  outstanding: number;
}

/** Three reads, whatever the number of accounts. */
export async function readStanding(redis: RedisClient, prefix: string, nowMs: number): Promise<Standing> {
  const k = deploymentStandingKeys(prefix);
  const [names, total] = await Promise.all([redis.zrevrangebyscore(k.near, '+inf', `(${nowMs}`, 'LIMIT', 0, NEAR_MAX), redis.get(k.total)]);
  const details = names.length === 0 ? [] : await redis.hmget(k.windows, ...names);
  const near = names.map((name, i) => ({
    name,
    windows: (JSON.parse(details[i] ?? '[]') as NearWindow[]).filter((w) => w.resetMs > nowMs),
  }));
  return { near: near.filter((n) => n.windows.length > 0), outstanding: Number(total ?? 0) };
}
