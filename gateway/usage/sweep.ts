import type { RedisClient } from '../redis/client.js';
import { accountName, loopKey, registryKeys } from '../redis/keys.js';
import { accountsOf, type Loop, type LoopConfig, markActive } from './active.js';

// The backstop for lost marks (an instance died before its 100 ms mark flush, or Redis lost it): walks the accounts,
// then the key registry's, at a fixed pace. Cost per second is the pace, whatever the number of accounts or keys.

/** One call per account: each in its own slot. */
export type PendingCheck = (redis: RedisClient, names: string[]) => Promise<boolean[]>;

/** The most seconds' worth one step catches up after a round that waited on a slow sink. */
const CATCH_UP_SECONDS = 2;

export class Sweep {
  private last?: number;
  private carry = 0;

  constructor(
    private readonly redis: RedisClient,
    private readonly loop: Loop,
    readonly perSecond: number,
    private readonly pending: PendingCheck,
  ) {}

  /**
   * The position lives in Redis, so a new leader carries on; it is kept below the walk's length, since a running count
   * taken modulo a changing length would jump elsewhere each time and could revisit the same few.
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
      // One leader a loop moves it: no race to lose.
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
 * A key's `account`, or its id when it names none (auth/registry.ts). Revoked keys stay in the registry, so their
 * accounts are still walked; a key issued shifts the ranks by one: the walk sees one key again and misses none.
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
