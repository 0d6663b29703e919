import { readFileSync } from 'node:fs';
import { Type } from '@sinclair/typebox';
import { readSettings } from '../../runtime/settings.js';
import { type ConfigFile, parseConfigText } from '../config/config.js';
import { GatewaySettingsSchema, loadSettings, redisTarget } from '../config/settings.js';
import { connectRedis, type RedisClient, redisWhere } from '../redis/client.js';
import { deploymentPrefix } from '../redis/keys.js';
import { type ConfigRest, NotBlock, readConfigRest } from './key-section.js';
import { RegistryKeys } from './registry.js';

// The keys command's way to Redis: KEY_STORE read as the gateway reads it, a Redis that is
// named at once when it is not there or not Redis, and the registry opened on it.

/** A refusal the keys command prints as it is, without usage. */
export class Refusal extends Error {}

/** KEY_STORE through the gateway's own parser: a value the gateway refuses (`Redis`) is refused here in the same words. */
export function keyStoreOf(env: NodeJS.ProcessEnv): 'file' | 'redis' {
  try {
    return readSettings(Type.Object({ keyStore: GatewaySettingsSchema.properties.keyStore }), env, 'gateway').keyStore;
  } catch (err) {
    throw new Refusal((err as Error).message);
  }
}

/** The Redis the settings name, once it answers; `why` says what needs it. */
export async function openRedis(env: NodeJS.ProcessEnv, why: string) {
  const settings = loadSettings(env);
  const redis = connectRedis(redisTarget(settings), settings.redisTimeoutMs);
  if (!redis) throw new Refusal(`${why}: set REDIS_URL, REDIS_CLUSTER_NODES or REDIS_SENTINELS`);
  // The first error ends the wait: a refused connection or a service that is not Redis is said at once.
  const ready = await new Promise<true | Error | undefined>((resolve) => {
    const timer = setTimeout(() => resolve(undefined), 5000);
    const done = (outcome: true | Error) => {
      clearTimeout(timer);
      resolve(outcome);
    };
    redis.once('ready', () => done(true));
    redis.once('error', (err: Error) => done(err));
  });
  // Connected is not yet Redis: an HTTP server accepts the connection, then answers the first command with HTML.
  const answered =
    ready === true
      ? await redis.ping().then(
          () => true as const,
          (err: Error) => err,
        )
      : ready;
  if (answered !== true) {
    redis.disconnect();
    throw new Refusal(`${why}: ${unreachable(redisWhere(redis), answered)}`);
  }
  return { redis, settings };
}

/** Why Redis could not be used, in words a new user can act on. */
function unreachable(where: string, err: Error | undefined): string {
  const at = where.replace(/^Redis at /, '');
  if (!err) return `${where} did not answer within 5 s (is it running, and is REDIS_URL right?)`;
  if ((err as NodeJS.ErrnoException).code === 'ECONNREFUSED') return `nothing listens at ${at} (is Redis running, and is REDIS_URL right?)`;
  if (/Protocol error/.test(err.message)) return `something answered at ${at} that is not Redis (is REDIS_URL's port right?)`;
  return `${where}: ${err.message}`;
}

/** The key registry the settings name (KEY_STORE=redis), once Redis answers. */
export async function openRegistry(file: string, env: NodeJS.ProcessEnv): Promise<{ keys: RegistryKeys; redis: RedisClient }> {
  const { redis, settings } = await openRedis(env, 'KEY_STORE=redis');
  // The registry needs the plans and the environment only: a file of 200,000 keys is not built for them.
  const current = await configRest(file);
  return { keys: new RegistryKeys(redis, () => current, deploymentPrefix(settings.redisKeyPrefix, current.environment)), redis };
}

/** The file without its keys: the keys section skipped line by line, or (a file of another shape) the whole parsed. */
export async function configRest(file: string): Promise<ConfigRest> {
  try {
    return await readConfigRest(file);
  } catch (err) {
    if (!(err instanceof NotBlock)) throw err;
    const whole: Partial<ConfigFile> = parseConfigText(readFileSync(file, 'utf8'), file, { keysElsewhere: true });
    delete whole.keys;
    return whole as ConfigRest;
  }
}
