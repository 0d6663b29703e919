import type { FastifyBaseLogger, FastifyInstance, FastifyRequest } from 'fastify';
import type { DestinationStream } from 'pino';
import { createLogOutput } from '../runtime/process.js';
import { type AdminParts, buildAdmin } from './admin/app.js';
import { fileKeys, type KeyStore } from './auth/key-file.js';
import { keyFinder } from './auth/key-finder.js';
import { bothStores, registryAccounts } from './auth/key-stores.js';
import { RegistryKeys } from './auth/registry.js';
import { KeyRegistry } from './auth/registry-cache.js';
import { registryPlanCheck, registryPlansMissing } from './auth/registry-plans.js';
import { UnreadRegistry } from './auth/registry-unread.js';
import { installPlainRawHandlers, plainClientErrorHandler } from './http/raw-answers.js';
import type { GatewayConfig } from './config/config.js';
import { ackReplicas, type GatewaySettings } from './config/settings.js';
import { buildPublicApp, type PublicSettings } from './http/app.js';
import { accessLog } from './observability/access-log.js';
import { GatewayMetrics } from './observability/metrics.js';
import type { RequestTracing, TracingSettings } from './observability/tracing.js';
import { AccountFigures } from './portal/figures.js';
import { OutcomeHistory } from './portal/history.js';
import type { PortalParts } from './portal/routes.js';
import { PortalSessions } from './portal/sessions.js';
import { MemoryQuotaStore } from './quota/memory-store.js';
import { RedisQuotaStore } from './quota/redis/store.js';
import { settleOf } from './quota/redis/event-batches.js';
import type { QuotaStore } from './quota/store.js';
import type { RedisClient, RedisTarget } from './redis/client.js';
import { activityMarks } from './usage/active.js';
import { ExportThread } from './usage/export-thread.js';
import { WebhookDispatcher } from './usage/webhooks.js';

// The wiring: the one file that knows every capability. From settings and a Redis client it
// builds the logger, metrics, the quota store, the usage loops, tracing and the key registry,
// and hands them to the public app (http/app.ts) and the admin port (admin/app.ts); the runner only starts them.

export interface GatewayDeps {
  config: GatewayConfig;
  /** The shared quota store; without it, quotas are kept in this process. */
  redis?: RedisClient;
  /** The Redis `redis` connects to, and its REDIS_TIMEOUT_MS: the usage exporter's thread opens a connection of its own there. */
  redisConnection?: { target: RedisTarget; timeoutMs: number };
  /** Where log lines go (tests read them); stdout when unset. */
  logStream?: DestinationStream;
  /** The config file this deployment's reloads come from: where the portal issues keys (without the key registry). */
  keyFile?: string;
}

export interface Gateway {
  app: FastifyInstance;
  /** Swaps in a new config; requests already past authentication finish under the old one. */
  setConfig(config: GatewayConfig): void;
  config(): GatewayConfig;
  store: QuotaStore;
  metrics: GatewayMetrics;
  /** The key registry, with KEY_STORE=redis: keys beyond the config file's. */
  keys?: KeyRegistry;
}

type AppSettings = PublicSettings &
  Pick<
    GatewaySettings,
    | 'logLevel'
    | 'logPretty'
    | 'metricsKeyIds'
    | 'quotaLeaseMax'
    | 'concurrencySlotTtlMs'
    | 'concurrencySlotLingerMs'
    | 'burstTokenLease'
    | 'burstTokenLeaseMs'
    | 'usageBatchMs'
    | 'keyStore'
    | 'creditsAckReplicas'
    | 'creditsAckTimeoutMs'
    | 'usageExportAckReplicas'
    | 'idempotencyKeyHours'
    | 'redisUrl'
    | 'redisClusterNodes'
    | 'redisSentinels'
    | 'redisSentinelName'
    | 'redisTimeoutMs'
    | 'quotaStoreFailure'
    | 'tracingUrl'
    | 'tracingServiceName'
    | 'tracingSampleRatio'
    | 'tracingDelayMs'
    | 'portalRotateGraceMs'
  >;

/**
 * Redis when the gateway has it (its live instances registered under the config's registry key,
 * for each one's share while Redis fails; the accounts it writes to marked for the usage loops),
 * else in-process.
 */
function quotaStore(
  settings: AppSettings,
  redis: RedisClient | undefined,
  log: FastifyBaseLogger,
  metrics: GatewayMetrics,
  config: () => GatewayConfig,
): QuotaStore {
  if (!redis) return new MemoryQuotaStore();
  return new RedisQuotaStore(redis, log, {
    observe: (s) => metrics.redisSeconds.observe(s),
    leaseMax: settings.quotaLeaseMax,
    slotTtlMs: settings.concurrencySlotTtlMs,
    slotLingerMs: settings.concurrencySlotLingerMs,
    burstTokens: settings.burstTokenLease,
    burstTokenMs: settings.burstTokenLeaseMs,
    usageBatchMs: settings.usageBatchMs,
    upstreamTimeoutMs: settings.upstreamTimeoutMs,
    requestTimeoutMs: settings.requestTimeoutMs,
    timeoutMs: settings.redisTimeoutMs,
    failClosed: settings.quotaStoreFailure === 'closed',
    ackReplicas: ackReplicas(settings, settings.creditsAckReplicas),
    ackTimeoutMs: settings.creditsAckTimeoutMs,
    idempotencyMs: settings.idempotencyKeyHours * 3_600_000,
    registry: () => config().registryKey,
    // The accounts whose streams it writes to, for the usage loops to read.
    marks: activityMarks(redis, config),
  });
}

/**
 * Tracing, when a collector is configured. Off, the OpenTelemetry SDK is not even loaded, and
 * the gateway adds no hook: a request pays one test (the proxy's, for a span to pass on).
 */
async function startTracing(settings: AppSettings, log: FastifyBaseLogger): Promise<RequestTracing | undefined> {
  if (!settings.tracingUrl) return undefined;
  const { RequestTracing } = await import('./observability/tracing.js');
  return new RequestTracing({ ...settings, tracingUrl: settings.tracingUrl } satisfies TracingSettings, log);
}

/**
 * The portal's parts, with Redis (its sessions live there): keys found and issued through the
 * same stores as the admin port's (the registry's with KEY_STORE=redis, else the config file
 * this deployment reloads), figures from the enforcing store, and the outcome history.
 */
function portalParts(
  settings: AppSettings,
  deps: GatewayDeps & { redis: RedisClient },
  config: () => GatewayConfig,
  store: QuotaStore,
  lookup: KeyRegistry | undefined,
  log: FastifyBaseLogger,
): PortalParts & { history: OutcomeHistory } {
  const { redis } = deps;
  const registry =
    settings.keyStore === 'redis'
      ? new RegistryKeys(redis, config, config().redisPrefix, (digest) => lookup?.changedHere(digest))
      : undefined;
  // The file's edits on a thread of their own, its pages from the config in force (what `config` holds).
  const keys: KeyStore | undefined = registry ?? (deps.keyFile ? fileKeys(deps.keyFile, {}, config) : undefined);
  const timeoutMs = settings.redisTimeoutMs;
  return {
    config,
    redis,
    sessions: new PortalSessions(redis, () => config().redisPrefix, timeoutMs),
    figures: new AccountFigures({ store, find: keyFinder(config, registry), redis, timeoutMs, config }),
    lookup,
    keys,
    rotateGraceMs: settings.portalRotateGraceMs,
    history: new OutcomeHistory(redis, () => config().redisPrefix, log),
  };
}

/** Wiring only: logger, metrics, store, the usage loops, tracing, the key registry, then the public app. Never listens. */
export async function buildGateway(settings: AppSettings, deps: GatewayDeps): Promise<Gateway> {
  let config = deps.config;
  const current = () => config;
  const metrics = new GatewayMetrics(settings.metricsKeyIds);
  const output = createLogOutput(
    'gateway',
    settings.logLevel,
    settings.logPretty,
    (lines) => metrics.logLinesDropped.inc(lines),
    deps.logStream,
  );
  const log: FastifyBaseLogger = output.log;
  const store = quotaStore(settings, deps.redis, log, metrics, current);
  metrics.watch(store);
  // Usage events to the billing sink, when the config names one: one exporter per deployment
  // leads, on a thread of its own (usage/export-thread.ts), its log lines and metrics this one's.
  const exporter =
    deps.redis && deps.redisConnection
      ? new ExportThread({
          ...deps.redisConnection,
          config: current,
          log,
          metrics: metrics.usage,
          settleMs: settleOf(settings),
          ackReplicas: ackReplicas(settings, settings.usageExportAckReplicas),
        })
      : undefined;
  const webhooks = deps.redis ? new WebhookDispatcher({ redis: deps.redis, config: current, log, metrics: metrics.webhooks }) : undefined;
  exporter?.start();
  webhooks?.start();
  // The final status of a request whose usage event was written with its count, joined to it.
  const recordStatus =
    store.recordStatus &&
    ((request: FastifyRequest, status: number) => store.recordStatus!(request.ctx.consumer!.subject, request.ctx.eventId!, status));
  const tracing = await startTracing(settings, log);
  const keys =
    settings.keyStore === 'redis' && deps.redis
      ? new KeyRegistry(deps.redis, { config: current, log, failing: () => store.degraded, timeoutMs: settings.redisTimeoutMs })
      : undefined;
  if (keys) metrics.watchKeyRegistry(keys);
  const redis = deps.redis;
  // With the file as key store, a key refused as unknown says so if a registry it does not read exists.
  const unread = settings.keyStore === 'file' && redis ? new UnreadRegistry(redis, current, log) : undefined;
  const portal = redis ? portalParts(settings, { ...deps, redis }, current, store, keys, log) : undefined;
  const app: FastifyInstance = await buildPublicApp(settings, {
    log,
    config: current,
    store,
    metrics,
    access: accessLog(metrics, output, recordStatus, portal && ((e) => portal.history.count(e))),
    portal,
    redis: deps.redis,
    tracing,
    keys,
    unknownKey: unread && (() => unread.unknownKey()),
    close: async () => {
      // Their rounds ended and their leads given up before Redis closes: the next instance leads at once.
      await Promise.all([exporter?.stop(), webhooks?.stop()]);
      keys?.close();
      await portal?.history.close();
      await Promise.all([store.close?.(), tracing?.shutdown()]);
    },
  });
  const setConfig = (next: GatewayConfig) => {
    config = next;
    exporter?.configChanged(next);
    void unread?.check();
  };
  return { app, setConfig, config: current, store, metrics, keys };
}

/** The primary's own parts of its admin port: its workers' aggregated metrics, and their problems. */
export type AdminPortParts = Partial<Pick<AdminParts, 'metrics' | 'problems' | 'warnings'>>;

/** What the admin port reads: this process's gateway (none in a cluster's primary), Redis, the config in force. */
export interface AdminSources {
  gateway?: Gateway;
  redis?: RedisClient;
  log: FastifyBaseLogger;
  config: () => GatewayConfig;
  closing: () => boolean;
  portalUrl: () => string;
  /** The primary's own parts (its workers' metrics, problems and warnings), in place of this process's. */
  own: AdminPortParts;
  /** The config file the key API edits: only where this process watches it. */
  configFile?: string;
}

/**
 * The admin port, reading this process's gateway; the primary, which has none, reads Redis and
 * its workers.
 */
export function buildAdminPort(settings: GatewaySettings, from: AdminSources): Promise<FastifyInstance> {
  const { own, configFile } = from;
  // The primary's reads usage, and tops credits up: their events and alerts marked for the usage loops.
  const store = from.gateway?.store ?? new RedisQuotaStore(from.redis!, from.log, { marks: activityMarks(from.redis!, from.config) });
  const metrics = own.metrics ?? from.gateway!.metrics;
  // With the key registry, keys are issued there (every instance hears of a change at once), and
  // changed in the file too where it holds a copy; accounts' settings stay in the file.
  // A key changed here is known to this process's lookup before the answer (a primary has none: its workers hear the channel).
  const registry =
    settings.keyStore === 'redis' && from.redis
      ? new RegistryKeys(
          from.redis,
          () => from.config(),
          from.config().redisPrefix,
          (digest) => from.gateway?.keys?.changedHere(digest),
        )
      : undefined;
  const keys = registry && configFile ? bothStores(configFile, registry) : registry;
  return buildAdmin(
    { ...settings, configFile, portalUrl: from.portalUrl },
    {
      config: from.config,
      store,
      metrics,
      problems: async () => [...((await own.problems?.()) ?? []), ...(from.gateway?.keys?.problems() ?? [])],
      warnings: async () => [...((await own.warnings?.()) ?? []), ...(from.gateway?.keys?.warnings() ?? [])],
      redis: from.redis,
      closing: from.closing,
      log: from.log,
      keys,
      find: keyFinder(from.config, registry),
      accounts: registry && registryAccounts(registry),
      // What both ports share, handed in: the answers Node gives before fastify has a request.
      rawAnswers: { install: installPlainRawHandlers, clientError: plainClientErrorHandler },
    },
  );
}

/** What a reload of the watched file is checked against beyond the file itself: the plans the key registry's keys name. */
export function reloadCheck(settings: Pick<GatewaySettings, 'keyStore'>, redis: RedisClient | undefined, config: () => GatewayConfig) {
  return redis && settings.keyStore === 'redis' ? registryPlanCheck(redis, config) : undefined;
}

/** What boot says of the config in force beyond the file itself: the plans the key registry's keys name that it lacks. */
export function bootWarnings(settings: Pick<GatewaySettings, 'keyStore'>, redis: RedisClient, config: GatewayConfig): Promise<string[]> {
  return settings.keyStore === 'redis' ? registryPlansMissing(redis, config) : Promise.resolve([]);
}
