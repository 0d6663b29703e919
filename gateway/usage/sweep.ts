import type { RedisClient } from '../redis/client.js';
import { loopKey } from '../redis/keys.js';
import { accountsOf, type Loop, type LoopConfig, markActive } from './active.js';

// The backstop for marks that were lost (an instance died between its script call and its
// 100 ms mark flush; a Redis failure lost the flush): the leader walks the config's accounts at
// a fixed pace, a few each round, and marks those it finds with something unsent. Its cost per
// second is the pace, whatever the number of accounts; a full pass takes accounts / pace.

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
   * unsent, and returns their names. Where the walk is lives in Redis (`{<loop>}:sweep`, a
   * counter of accounts checked), so a new leader carries on from where the last one stopped.
   */
  async step(config: LoopConfig, nowMs = performance.now()): Promise<string[]> {
    const { names } = accountsOf(config);
    const elapsed = this.last === undefined ? 1 : Math.min(CATCH_UP_SECONDS, (nowMs - this.last) / 1000);
    this.last = nowMs;
    const due = this.carry + elapsed * this.perSecond;
    const n = Math.min(Math.floor(due), names.length);
    this.carry = n === names.length ? 0 : due - n;
    if (n === 0) return [];
    const end = Number(await this.redis.incrby(loopKey(config.redisPrefix, this.loop, 'sweep'), n));
    const batch = Array.from({ length: n }, (_, i) => names[(((end - n + i) % names.length) + names.length) % names.length]!);
    const found = await this.pending(this.redis, batch);
    const marked = batch.filter((_, i) => found[i]);
    await markActive(this.redis, config, this.loop, marked);
    return marked;
  }
}
