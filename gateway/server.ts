import cluster from 'node:cluster';
import { announceReady, listenOrExit, stopOnSignals } from '../runtime/process.js';
import { buildAdmin } from './admin/app.js';
import { buildGateway } from './http/app.js';
import { runPrimary, runWorker } from './process/cluster.js';
import { type GatewayConfig, loadConfigFile } from './config/config.js';
import { awaitRedis, closeRedis, connectRedis } from './process/redis-client.js';
import { reloader, watchConfig } from './process/config-watch.js';
import { type GatewaySettings, loadSettings, redisTarget } from './config/settings.js';

// Entry: settings and config (fail fast), then one gateway process with its admin port, or
// with GATEWAY_WORKERS > 1 a cluster (cluster.ts).
const PUBLIC = { port: 'GATEWAY_PORT', host: 'GATEWAY_HOST' };
const ADMIN = { port: 'ADMIN_PORT', host: 'ADMIN_HOST' };
let settings: GatewaySettings;
let initial: GatewayConfig;
try {
  settings = loadSettings();
  initial = loadConfigFile(settings.configFile, settings.redisKeyPrefix, 'GATEWAY_CONFIG');
  if (settings.workers > 1 && !redisTarget(settings)) {
    throw new Error(
      `GATEWAY_WORKERS=${settings.workers} needs Redis (REDIS_URL, REDIS_CLUSTER_NODES or REDIS_SENTINELS): without Redis each worker keeps its own quotas, so every limit would be multiplied by ${settings.workers}`,
    );
  }
} catch (err) {
  console.error(err instanceof Error ? err.message : String(err));
  process.exit(1);
}

if (settings.workers > 1) await (cluster.isPrimary ? runPrimary(settings, initial) : runWorker(settings, initial));
else await runSingle(settings, initial);

async function runSingle(settings: GatewaySettings, initial: GatewayConfig): Promise<void> {
  const redis = connectRedis(settings);
  const gateway = await buildGateway(settings, { config: initial, redis });
  const { app } = gateway;
  let closing = false;
  const admin = await buildAdmin(settings, {
    config: gateway.config,
    store: gateway.store,
    metrics: gateway.metrics,
    redis,
    closing: () => closing,
    log: app.log,
  });
  if (!redis) app.log.warn('REDIS_URL is not set: quotas are kept in this process only, so limits are per gateway process');
  await awaitRedis(redis, app.log);
  const stopWatching = watchConfig(settings.configFile, reloader(settings, gateway.setConfig, app.log));

  // Graceful stop: /readyz turns 503 and the config watch ends, in-flight requests finish,
  // then the admin port and Redis close.
  stopOnSignals(app, settings.shutdownGraceMs, {
    beforeClose: () => {
      closing = true;
      stopWatching();
    },
    afterClose: async () => {
      await admin.close();
      if (redis) await closeRedis(redis);
    },
  });

  const address = await listenOrExit(app, settings.port, settings.host, PUBLIC);
  const adminAddress = await listenOrExit(admin, settings.adminPort, settings.adminHost, ADMIN);
  const { environment } = initial;
  app.log.info({ address, admin: adminAddress, environment, backend: settings.backendUrl, store: redis ? 'redis' : 'memory' }, 'gateway ready');
  announceReady();
}
