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
 * The count per plan rebuilt for a registry written before its create script counted: a page of
 * ids a call, in id order, into a hash renamed to the counts once the walk is done (1; 0: more to
 * walk). A key issued meanwhile behind the walk is counted by the create script (which reads the
 * walk's place), one ahead of it by the walk, so none is missed or counted twice. Paged, as one
 * script over every key would hold Redis for its whole walk (10 s at 1,000,000 keys here).
 */
const RECOUNT_PAGE = {
  keys: ['plans', 'recount', 'ids'],
  argv: ['count', 'idStem', 'recordStem'],
  lua: `if redis.call('EXISTS', KEY.plans) == 1 then return 1 end
local at = redis.call('HGET', KEY.recount, '~at')
local ids = redis.call('ZRANGEBYLEX', KEY.ids, at and ('(' .. at) or '-', '+', 'LIMIT', 0, tonumber(ARG.count))
-- The records' names from the stems in ARGV: every one in the {keys} slot, as the declared keys.
for _, id in ipairs(ids) do
  local digest = redis.call('GET', ARG.idStem .. id)
  local plan = digest and redis.call('HGET', ARG.recordStem .. digest, 'plan')
  if plan then redis.call('HINCRBY', KEY.recount, plan, 1) end
end
if #ids == tonumber(ARG.count) then
  redis.call('HSET', KEY.recount, '~at', ids[#ids])
  return 0
end
redis.call('HDEL', KEY.recount, '~at')
if redis.call('EXISTS', KEY.recount) == 1 then redis.call('RENAME', KEY.recount, KEY.plans) end
return 1`,
} as const satisfies Script<string, string>;

/** Ids a rebuild's call walks: a few milliseconds of Redis each. */
const PAGE = 1000;

type PlansRedis = RedisClient & { registryRecountPage(...keysThenArgs: Array<string | number>): Promise<number> };

/** Keys of the registry per plan (revoked ones included), counted first where the registry predates the count. */
export async function registryPlanCounts(redis: RedisClient, prefix: string): Promise<Map<string, number>> {
  const n = registryKeys(prefix);
  let counts = await redis.hgetall(n.plans);
  if (Object.keys(counts).length === 0) {
    defineScript(redis, 'registryRecountPage', RECOUNT_PAGE);
    const args = wiresArgs(
      RECOUNT_PAGE,
      { plans: n.plans, recount: n.plansRecount, ids: n.ids },
      { count: PAGE, idStem: n.id(''), recordStem: n.record('') },
    );
    while ((await (redis as PlansRedis).registryRecountPage(...args)) === 0);
    counts = await redis.hgetall(n.plans);
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

/**
 * At boot, what a reload would have refused: plans the registry's keys name that the config in
 * force has not (its keys answer 401 until it has). One HGETALL, whatever the number of keys.
 */
export async function registryPlansMissing(redis: RedisClient, config: GatewayConfig): Promise<string[]> {
  const counts = await registryPlanCounts(redis, config.redisPrefix);
  return [...counts]
    .filter(([plan, n]) => n > 0 && !Object.hasOwn(config.plans, plan))
    .map(
      ([plan, n]) =>
        `key registry: plan "${plan}" is named by ${n} key${n === 1 ? '' : 's'} of the registry, and this config has no such plan: they answer 401 until it has`,
    );
}
