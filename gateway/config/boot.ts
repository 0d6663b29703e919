import { type GatewayConfig, loadConfigFile } from './config.js';
import { needsRedis } from './needs-redis.js';
import { type GatewaySettings, loadSettings, redisTarget } from './settings.js';

// What the gateway checks before it starts anything: its settings, its config file, and that the
// two agree. One function, so `npm start` (stack.ts) can refuse a bad gateway before the backend
// starts, with the same lines the gateway itself would print.

/** The gateway's settings and first config from `env`, or an error whose message is every problem, one a line. */
export function loadGatewayStart(env: NodeJS.ProcessEnv = process.env): { settings: GatewaySettings; initial: GatewayConfig } {
  const settings = loadSettings(env);
  const initial = loadConfigFile(settings.configFile, settings.redisKeyPrefix, 'GATEWAY_CONFIG', {
    keysElsewhere: settings.keyStore === 'redis',
  });
  const unkept = redisTarget(settings) ? [] : needsRedis(initial);
  if (unkept.length > 0) throw new Error(`${settings.configFile}: ${unkept.join(`\n${settings.configFile}: `)}`);
  if (settings.workers > 1 && !redisTarget(settings)) {
    throw new Error(
      `GATEWAY_WORKERS=${settings.workers} needs Redis (REDIS_URL, REDIS_CLUSTER_NODES or REDIS_SENTINELS): without Redis each worker keeps its own quotas, so every limit would be multiplied by ${settings.workers}`,
    );
  }
  return { settings, initial };
}
