import cluster from 'node:cluster';
import { type GatewayConfig, loadConfigFile } from './config/config.js';
import { needsRedis } from './config/needs-redis.js';
import { type GatewaySettings, loadSettings, redisTarget } from './config/settings.js';
import { runPrimary, runWorker } from './process/cluster.js';
import { run } from './process/runner.js';

// Entry: settings and config (fail fast), then one gateway process (process/runner.ts), or
// with GATEWAY_WORKERS > 1 a cluster of them (process/cluster.ts). Nothing else.
let settings: GatewaySettings;
let initial: GatewayConfig;
try {
  settings = loadSettings();
  initial = loadConfigFile(settings.configFile, settings.redisKeyPrefix, 'GATEWAY_CONFIG');
  const unkept = redisTarget(settings) ? [] : needsRedis(initial);
  if (unkept.length > 0) throw new Error(`${settings.configFile}: ${unkept.join(`\n${settings.configFile}: `)}`);
  if (settings.workers > 1 && !redisTarget(settings)) {
    throw new Error(
      `GATEWAY_WORKERS=${settings.workers} needs Redis (REDIS_URL, REDIS_CLUSTER_NODES or REDIS_SENTINELS): without Redis each worker keeps its own quotas, so every limit would be multiplied by ${settings.workers}`,
    );
  }
} catch (err) {
  console.error(err instanceof Error ? err.message : String(err));
  process.exit(1);
}

if (settings.workers === 1) await run(settings, initial, { serve: true, admin: {}, reloads: 'file', ownProcess: { announce: true } });
else if (cluster.isPrimary) await runPrimary(settings, initial);
else await runWorker(settings, initial);
