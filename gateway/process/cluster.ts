import cluster, { type Worker } from 'node:cluster';
import type { FastifyBaseLogger } from 'fastify';
import { AggregatorRegistry } from 'prom-client';
import { announceReady, createLogger, listenOrExit, stopOnSignals } from '../../runtime/process.js';
import { buildAdmin } from '../admin/app.js';
import { buildGateway } from '../http/app.js';
import type { GatewayConfig } from '../config/config.js';
import { awaitRedis, closeRedis, connectRedis } from './redis-client.js';
import { reloader, watchConfig } from './config-watch.js';
import { RedisQuotaStore } from '../quota/redis-store.js';
import type { GatewaySettings } from '../config/settings.js';

// GATEWAY_WORKERS=N: N gateway processes on one port (node:cluster; the primary hands each
// connection to a worker in turn). Limits stay exact because they live in Redis, which is
// why more than one worker needs REDIS_URL. The primary serves the admin port once (metrics
// of every worker, aggregated), watches the config and tells every worker to reload, and
// on SIGTERM/SIGINT drains every worker before it exits.

const RELOAD = 'gateway:reload';
const RESTART_AFTER_MS = 1000;

export async function runPrimary(settings: GatewaySettings, initial: GatewayConfig): Promise<void> {
  const log: FastifyBaseLogger = createLogger(settings.logLevel, settings.logPretty, () => {});
  const redis = connectRedis(settings)!;
  let config = initial;
  let closing = false;
  const listening = new Set<number>();

  const aggregator = new AggregatorRegistry();
  const admin = await buildAdmin(settings, {
    config: () => config,
    store: new RedisQuotaStore(redis, log), // for the usage lookup: it only reads
    metrics: { contentType: aggregator.contentType, text: () => aggregator.clusterMetrics() },
    problems: () => (listening.size < settings.workers ? [`workers: ${listening.size} of ${settings.workers} listening`] : []),
    redis,
    closing: () => closing,
    log,
  });
  await awaitRedis(redis, log);
  const adminAddress = await listenOrExit(admin, settings.adminPort, settings.adminHost, { port: 'ADMIN_PORT', host: 'ADMIN_HOST' });

  const reload = reloader(settings, (next) => (config = next), log);
  const stopWatching = watchConfig(settings.configFile, (reason) => {
    reload(reason);
    for (const worker of workers()) worker.send({ type: RELOAD, reason });
  });

  let announced = false;
  cluster.on('listening', (worker, a) => {
    listening.add(worker.id);
    if (announced || listening.size < settings.workers) return;
    announced = true;
    const address = `http://${a.address ?? settings.host}:${a.port}`;
    const { environment } = initial;
    log.info({ address, admin: adminAddress, workers: settings.workers, environment, backend: settings.backendUrl, store: 'redis' }, 'gateway ready');
    announceReady();
  });
  cluster.on('exit', (worker: Worker, code, signal) => {
    listening.delete(worker.id);
    if (closing) return;
    if (!announced) {
      // It never listened (it said why on stderr): starting it again would fail the same way.
      log.error({ worker: worker.process.pid, code, signal }, 'a gateway worker could not start; stopping');
      process.exit(1);
    }
    log.error({ worker: worker.process.pid, code, signal }, `gateway worker exited; starting another in ${RESTART_AFTER_MS} ms`);
    setTimeout(() => !closing && cluster.fork(), RESTART_AFTER_MS);
  });

  for (const signal of ['SIGTERM', 'SIGINT'] as const) {
    process.on(signal, () => {
      if (closing) process.exit(1);
      closing = true;
      stopWatching();
      log.info({ signal, workers: listening.size }, 'closing: draining every worker');
      void drain(workers(), settings.shutdownGraceMs + 2000).then(async (worst) => {
        await admin.close();
        await closeRedis(redis);
        log.info({ cut: worst !== 0 }, worst === 0 ? 'closed' : 'closed; a worker cut busy connections');
        process.exit(worst);
      });
    });
  }
  for (let i = 0; i < settings.workers; i++) cluster.fork();
}

const workers = () => Object.values(cluster.workers ?? {}).filter((w): w is Worker => w !== undefined);

/**
 * SIGTERM to every worker (each finishes its in-flight requests); resolves with the worst
 * exit code. A worker still alive after `deadlineMs` (its own grace period plus a margin) is
 * killed and counts as 1.
 */
function drain(list: Worker[], deadlineMs: number): Promise<number> {
  const alive = list.filter((w) => !w.isDead());
  return new Promise((resolve) => {
    let worst = 0;
    let left = alive.length;
    if (left === 0) resolve(0);
    const deadline = setTimeout(() => alive.forEach((w) => !w.isDead() && w.process.kill('SIGKILL')), deadlineMs);
    for (const w of alive) {
      w.once('exit', (code) => {
        worst = Math.max(worst, code ?? 1);
        if (--left > 0) return;
        clearTimeout(deadline);
        resolve(worst);
      });
      w.process.kill('SIGTERM');
    }
  });
}

export async function runWorker(settings: GatewaySettings, initial: GatewayConfig): Promise<void> {
  const redis = connectRedis(settings)!;
  const gateway = await buildGateway(settings, { config: initial, redis });
  const { app } = gateway;
  // The primary asks each worker for its registry and sums them (prom-client's cluster support).
  new AggregatorRegistry();
  AggregatorRegistry.setRegistries([gateway.metrics.registry]);
  const reload = reloader(settings, gateway.setConfig, app.log);
  process.on('message', (m: { type?: string; reason?: string }) => {
    if (m?.type === RELOAD) reload(m.reason ?? 'primary');
  });
  // The primary decides: it reloads every worker, and passes a stop on as SIGTERM. A Ctrl-C
  // reaches the whole process group; taken here too, it would count as a second signal.
  process.on('SIGHUP', () => {});
  process.on('SIGINT', () => {});
  // A primary that has already stopped (another worker could not start) makes talking to it
  // fail with EPIPE: this worker has nothing left to serve, and the primary said why.
  cluster.worker?.on('error', () => process.exit(1));
  stopOnSignals(app, settings.shutdownGraceMs, { afterClose: () => closeRedis(redis) }, ['SIGTERM']);
  await awaitRedis(redis, app.log);
  await listenOrExit(app, settings.port, settings.host, { port: 'GATEWAY_PORT', host: 'GATEWAY_HOST' });
}
