import type { GatewayConfig } from '../config/config.js';
import type { RedisClient } from '../redis/client.js';
import { registryKeys } from '../redis/keys.js';
import { defineScript, type Script, wiresArgs } from '../redis/wires.js';

// The plans the key registry's keys name, for a reload that would drop one: the file refuses to
// lose a plan one of its keys names (revoked ones included), and so does a reload here, or the
// registry's keys would answer 401 "Unknown API key" from then on. The registry's create script
// counts keys per plan as it issues them (a hash beside the records), so the check is one
// HGETALL, never a walk of the keys; keys are never deleted from the registry, so the counts
// only grow.

/**
 * The count per plan rebuilt from every key, once, for a registry written before its create
 * script counted: atomic, so no key issued meanwhile is counted twice or missed. It walks every
 * key inside Redis (about a second per 100,000 keys here, Redis busy meanwhile): done once per
 * registry, by the first reload that drops a plan. 0 when the counts were there already.
 */
const RECOUNT = {
  keys: ['plans', 'ids'],
  argv: ['idStem', 'recordStem'],
  lua: `if redis.call('EXISTS', KEY.plans) == 1 then return 0 end
local n = 0
-- The records' names from the stems in ARGV: every one in the {keys} slot, as the declared keys.
for _, id in ipairs(redis.call('ZRANGE', KEY.ids, 0, -1)) do
  local digest = redis.call('GET', ARG.idStem .. id)
  local plan = digest and redis.call('HGET', ARG.recordStem .. digest, 'plan')
  if plan then
    redis.call('HINCRBY', KEY.plans, plan, 1)
    n = n + 1
  end
end
return n`,
} as const satisfies Script<string, string>;

type PlansRedis = RedisClient & { registryRecount(...keysThenArgs: Array<string | number>): Promise<number> };

/** Keys of the registry per plan (revoked ones included), counted once first where the registry predates the count. */
export async function registryPlanCounts(redis: RedisClient, prefix: string): Promise<Map<string, number>> {
  const n = registryKeys(prefix);
  let counts = await redis.hgetall(n.plans);
  if (Object.keys(counts).length === 0) {
    defineScript(redis, 'registryRecount', RECOUNT);
    const args = wiresArgs(RECOUNT, { plans: n.plans, ids: n.ids }, { idStem: n.id(''), recordStem: n.record('') });
    if ((await (redis as PlansRedis).registryRecount(...args)) > 0) counts = await redis.hgetall(n.plans);
  }
  return new Map(Object.entries(counts).map(([plan, count]) => [plan, Number(count)]));
}

/**
 * A reload's check with the key registry: every plan the config in force has and `next` drops,
 * while registry keys still name it, as a problem. Redis is asked only when a plan is dropped,
 * so a reload during a Redis outage that keeps every plan goes through.
 */
export function registryPlanCheck(redis: RedisClient, current: () => GatewayConfig) {
  return async (next: GatewayConfig): Promise<string[]> => {
    const dropped = Object.keys(current().plans).filter((plan) => !Object.hasOwn(next.plans, plan));
    if (dropped.length === 0) return [];
    const counts = await registryPlanCounts(redis, current().redisPrefix);
    return dropped.flatMap((plan) => {
      const n = counts.get(plan) ?? 0;
      return n > 0 ? [`plans: plan "${plan}" is still named by ${n} key${n === 1 ? '' : 's'} of the key registry`] : [];
    });
  };
}
