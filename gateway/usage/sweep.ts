import type { RedisClient } from '../redis/client.js';
import { accountName, loopKey, registryKeys } from '../redis/keys.js';
import { accountsOf, type Loop, type LoopConfig, markActive } from './active.js';

// The backstop for marks that were lost (an instance died between its script call and its
// 100 ms mark flush; a Redis failure lost the flush): the leader walks the config's accounts,
// then the key registry's keys (KEY_STORE=redis: an account only the registry names, as a key's
// `account` or its id), at a fixed pace, a few each round, and marks those it finds with
// something unsent. Its cost per second is the pace, whatever the number of accounts or keys; a
// full pass takes (accounts + registry keys) / pace.

/** Whether each account has something unsent, in one call per account (each in its own slot). */
export type PendingCheck = (redis: RedisClient, names: string[]) => Promise<boolean[]>;

/** Most of a second's worth of accounts one round sweeps after a long one (a round that waited on a slow sink). */
const CATCH_UP_SECONDS = 2;

export class Sweep {
  private last?: number;
  private carry = 0;

  /** `perSecond`: accounts checked a second; `pending`: the check. */
  constructor(
    private readonly redis: RedisClient,
    private readonly loop: Loop,
    readonly perSecond: number,
    private readonly pending: PendingCheck,
  ) {}

  /**
   * Checks the next accounts due at the pace since the last step, marks those with something
   * unsent, and returns their names. Where the walk is lives in Redis (`{<loop>}:sweep`: the
   * position the next step starts from), so a new leader carries on from where the last one
   * stopped. It is kept below the walk's length: a key issued moves the walk's end, not where
   * it is (a count of every account ever checked, taken modulo a length that changed, would
   * jump each time to an unrelated place, and could come back to the same few).
   */
  async step(config: LoopConfig, nowMs = performance.now()): Promise<string[]> {
    const { names } = accountsOf(config);
    const registry = registryKeys(config.redisPrefix);
    // The registry's keys follow the config's accounts in the walk: none without a registry.
    const total = names.length + (await this.redis.zcard(registry.ids));
    const elapsed = this.last === undefined ? 1 : Math.min(CATCH_UP_SECONDS, (nowMs - this.last) / 1000);
    this.last = nowMs;
    const due = this.carry + elapsed * this.perSecond;
    const n = Math.min(Math.floor(due), total);
    this.carry = n === total ? 0 : due - n;
    if (n === 0) return [];
    const key = loopKey(config.redisPrefix, this.loop, 'sweep');
    let end = Number(await this.redis.incrby(key, n));
    if (end >= total) {
      // Past the walk's end: on from its start (one leader a loop moves it, so no race to lose).
      end %= total;
      await this.redis.set(key, end);
    }
    const at = Array.from({ length: n }, (_, i) => (((end - n + i) % total) + total) % total);
    const configured = at.filter((p) => p < names.length).map((p) => names[p]!);
    const ranks = at.filter((p) => p >= names.length).map((p) => p - names.length);
    const keyed = (await registryAccounts(this.redis, registry, ranks)).map((a) => accountName(config.redisPrefix, a));
    // An account with several keys, or in both the config and the registry, is checked once.
    const batch = [...new Set([...configured, ...keyed])];
    const found = await this.pending(this.redis, batch);
    const marked = batch.filter((_, i) => found[i]);
    await markActive(this.redis, config, this.loop, marked);
    return marked;
  }
}

/**
 * The accounts of the registry's keys at `ranks` (in its ids' order; consecutive but for one
 * wrap): a key's `account`, or its id when it names none (auth/registry.ts), all in the
 * registry's slot: the ids (a ZRANGE a run of ranks), their records' digests (one MGET), then
 * each record's account (an HGET each, sent together). The registry keeps every key it issued,
 * revoked ones too, so a revoked key's account is still walked; an id without a record (none
 * the registry writes) is skipped. A key issued moves the ids after it by one: the walk sees
 * one key again, and misses none.
 */
async function registryAccounts(redis: RedisClient, registry: ReturnType<typeof registryKeys>, ranks: number[]): Promise<string[]> {
  if (ranks.length === 0) return [];
  const runs: Array<[number, number]> = [];
  for (const r of ranks) {
    const last = runs.at(-1);
    if (last && r === last[1] + 1) last[1] = r;
    else runs.push([r, r]);
  }
  const ids = (await Promise.all(runs.map(([from, to]) => redis.zrange(registry.ids, from, to)))).flat();
  if (ids.length === 0) return [];
  const digests = await redis.mget(ids.map((id) => registry.id(id)));
  const accounts = await Promise.all(digests.map((d) => (d === null ? null : redis.hget(registry.record(d), 'account'))));
  return ids.flatMap((id, i) => (digests[i] === null ? [] : [accounts[i] ?? id]));
}
