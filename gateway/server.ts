import { watch } from 'node:fs';
import { basename, dirname } from 'node:path';
import { Redis } from 'ioredis';
import { stopOnSignals } from '../runtime/process.js';
import { buildAdmin } from './admin.js';
import { buildGateway } from './app.js';
import { ConfigError, loadConfigFile } from './config.js';
import { loadSettings } from './settings.js';

// Entry: settings and config (fail fast), the quota store, listen, reload, close on signals.
let settings: ReturnType<typeof loadSettings>;
let initial: ReturnType<typeof loadConfigFile>;
try {
  settings = loadSettings();
  initial = loadConfigFile(settings.configFile, settings.redisKeyPrefix);
} catch (err) {
  console.error(err instanceof Error ? err.message : String(err));
  process.exit(1);
}

let redis: Redis | undefined;
if (settings.redisUrl) {
  // Fail fast instead of queueing: no offline queue, one retry, and a command timeout,
  // which is the only guard against a Redis that accepts connections but never answers.
  redis = new Redis(settings.redisUrl, {
    enableOfflineQueue: false,
    maxRetriesPerRequest: 1,
    commandTimeout: settings.redisTimeoutMs,
    connectTimeout: 2000,
    retryStrategy: (times) => Math.min(times * 100, 2000),
  });
  redis.on('error', () => {}); // reported once through the store's degraded log line instead
}

const gateway = await buildGateway(settings, { config: initial, redis });
const { app, setConfig } = gateway;
let closing = false;
const admin = await buildAdmin({
  config: gateway.config,
  store: gateway.store,
  metrics: gateway.metrics,
  redis,
  backendUrl: settings.backendUrl,
  adminToken: settings.adminToken,
  closing: () => closing,
  log: app.log,
});
if (!settings.redisUrl) {
  app.log.warn('REDIS_URL is not set: quotas are kept in this process only, so limits are per gateway process');
}
if (redis) {
  await new Promise<void>((resolve) => {
    const timer = setTimeout(resolve, 3000);
    redis.once('ready', () => {
      clearTimeout(timer);
      resolve();
    });
  });
  if (redis.status !== 'ready') app.log.warn('Redis is not ready yet; quotas are per process until it is');
}

function reload(reason: string): void {
  try {
    setConfig(loadConfigFile(settings.configFile, settings.redisKeyPrefix));
    app.log.info({ reason, file: settings.configFile }, 'config reloaded');
  } catch (err) {
    const problems = err instanceof ConfigError ? err.problems : [(err as Error).message];
    app.log.error({ reason, file: settings.configFile, problems }, 'config reload refused; the previous config stays in force');
  }
}

// The directory is watched, not the file: editors and the keys command replace the file
// by rename, which a watch on the old inode would miss.
let debounce: NodeJS.Timeout | undefined;
const watcher = watch(dirname(settings.configFile), (_event, name) => {
  if (name !== basename(settings.configFile)) return;
  clearTimeout(debounce);
  debounce = setTimeout(() => reload('file changed'), 100);
});
process.on('SIGHUP', () => reload('SIGHUP'));

// Graceful stop: /readyz turns 503 and the config watch ends, in-flight requests finish,
// then the admin port and Redis close.
stopOnSignals(app, settings.shutdownGraceMs, {
  beforeClose: () => {
    closing = true;
    watcher.close();
    clearTimeout(debounce);
  },
  afterClose: async () => {
    await admin.close();
    await redis?.quit();
  },
});

const address = await app.listen({ port: settings.port, host: settings.host });
const adminAddress = await admin.listen({ port: settings.adminPort, host: settings.adminHost });
app.log.info(
  {
    address,
    admin: adminAddress,
    environment: initial.environment,
    backend: settings.backendUrl,
    store: redis ? 'redis' : 'memory',
  },
  'gateway ready',
);

