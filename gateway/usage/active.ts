import type { GatewayConfig } from '../config/config.js';
import type { RedisClient } from '../redis/client.js';
import { loopKey } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';

// The accounts with something to send, so a round costs what has traffic, not what is configured (issue 30). The
// score counts marks; unmarking compares and removes, so a write the leader could not have seen keeps its mark.

/** Plain data but `accountOf`, so the export thread rebuilds it from what it is posted. */
export interface LoopConfig {
  environment: GatewayConfig['environment'];
  redisPrefix: string;
  accounts: ReadonlyMap<string, { name: string }>;
  accountOf(subjectName: string): string | undefined;
}

export type Loop = 'usage-export' | 'alerts';

export interface Marked {
  name: string;
  score: string;
}

const activeKey = (config: Pick<LoopConfig, 'redisPrefix'>, loop: Loop) => loopKey(config.redisPrefix, loop, 'active');

const MARK = {
  keys: ['index'],
  argv: [],
  lua: `for i = REST, #ARGV do redis.call('ZINCRBY', KEY.index, 1, ARGV[i]) end
return #ARGV - REST + 1`,
} as const satisfies Script<string, string>;

/** From REST on, pairs of a name and the score read. */
const UNMARK = {
  keys: ['index'],
  argv: [],
  lua: `local n = 0
for i = REST, #ARGV, 2 do
  if redis.call('ZSCORE', KEY.index, ARGV[i]) == ARGV[i + 1] then n = n + redis.call('ZREM', KEY.index, ARGV[i]) end
end
return n`,
} as const satisfies Script<string, string>;

type IndexRedis = RedisClient & {
  markActive(...keysThenArgs: Array<string | number>): Promise<number>;
  unmarkActive(...keysThenArgs: Array<string | number>): Promise<number>;
};

export function defineActiveScripts(redis: RedisClient): void {
  defineScript(redis, 'markActive', MARK);
  defineScript(redis, 'unmarkActive', UNMARK);
}

export async function markActive(
  redis: RedisClient,
  config: Pick<LoopConfig, 'redisPrefix'>,
  loop: Loop,
  names: Iterable<string>,
): Promise<void> {
  const list = [...names];
  if (list.length > 0) await (redis as IndexRedis).markActive(...wiresArgs(MARK, { index: activeKey(config, loop) }, {}, list));
}

/** The quota store's `marks` option, called every 100 ms. */
export function activityMarks(redis: RedisClient, config: () => GatewayConfig) {
  defineActiveScripts(redis);
  return (active: { usage: Iterable<string>; alerts: Iterable<string> }) =>
    Promise.all([markActive(redis, config(), 'usage-export', active.usage), markActive(redis, config(), 'alerts', active.alerts)]);
}

const byConfig = new WeakMap<LoopConfig, { names: string[]; accounts: Map<string, string> }>();
/** Built once per config, not per round; `account(name)` also names a key registry's accounts. */
export function accountsOf(config: LoopConfig): { names: string[]; account(name: string): string | undefined } {
  let known = byConfig.get(config);
  if (!known) {
    const accounts = new Map<string, string>();
    for (const [account, subject] of config.accounts) accounts.set(subject.name, account);
    known = { names: [...accounts.keys()], accounts };
    byConfig.set(config, known);
  }
  const { names, accounts } = known;
  return { names, account: (name) => accounts.get(name) ?? config.accountOf(name) };
}

const SCAN_COUNT = 500;

/** ZSCAN passes: every account marked for a whole pass is visited once in it, whatever the set's size. */
export class ActiveIndex {
  private cursor = '0';
  private scanned = false;
  private queue: Marked[] = [];
  private readonly seen = new Set<string>();
  private key?: string;

  constructor(
    private readonly redis: RedisClient,
    private readonly loop: Loop,
  ) {
    defineActiveScripts(redis);
  }

  async take(config: LoopConfig, max: number): Promise<{ picked: Marked[]; more: boolean }> {
    const key = activeKey(config, this.loop);
    if (key !== this.key) this.restart(key);
    while (this.queue.length < max && !this.scanned) {
      const [next, flat] = await this.redis.zscan(key, this.cursor, 'COUNT', SCAN_COUNT);
      for (let i = 0; i < flat.length; i += 2) {
        // ZSCAN may return a member twice in a pass: a round must not read one account twice.
        if (this.seen.has(flat[i]!)) continue;
        this.seen.add(flat[i]!);
        this.queue.push({ name: flat[i]!, score: flat[i + 1]! });
      }
      this.cursor = next;
      this.scanned = next === '0';
    }
    const picked = this.queue.splice(0, max);
    const more = this.queue.length > 0 || !this.scanned;
    if (!more) this.restart(key);
    return { picked, more };
  }

  /** Only those whose score is still the one read: no mark since. */
  async unmark(config: LoopConfig, done: Marked[]): Promise<void> {
    if (done.length === 0) return;
    const pairs = done.flatMap((m) => [m.name, m.score]);
    await (this.redis as IndexRedis).unmarkActive(...wiresArgs(UNMARK, { index: activeKey(config, this.loop) }, {}, pairs));
  }

  private restart(key: string): void {
    this.key = key;
    this.cursor = '0';
    this.scanned = false;
    this.queue = [];
    this.seen.clear();
  }
}
