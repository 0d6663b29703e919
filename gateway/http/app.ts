import Fastify, {
  type FastifyBaseLogger,
  type FastifyInstance,
  type FastifyRequest,
  type FastifyServerOptions,
  LogController,
} from 'fastify';
import type { RedisClient } from '../process/redis-client.js';
import type { DestinationStream, Logger } from 'pino';
import { createLogger } from '../../runtime/process.js';
import { LazyRequestLogger } from '../observability/request-logger.js';
import { accessLog } from '../observability/access-log.js';
import type { GatewayConfig } from '../config/config.js';
import { handleError } from './errors.js';
import { clientErrorHandler, installRawHandlers, type RawDeps, requestId } from './raw-answers.js';
import { GatewayMetrics } from '../observability/metrics.js';
import { documentServer, OPENAPI_PATH } from './openapi.js';
import { USAGE_ROUTE } from './routes.js';
import { usageView } from '../quota/usage-view.js';
import { KeyRegistry } from '../auth/registry.js';
import { type RequestContext, requestPipeline } from './pipeline.js';
import { registerProxy } from './proxy.js';
import { admit } from '../quota/admit.js';
import { MemoryQuotaStore } from '../quota/memory-store.js';
import { RedisQuotaStore } from '../quota/redis-store.js';
import { activityMarks } from '../usage/active.js';
import { UsageExporter } from '../usage/exporter.js';
import { WebhookDispatcher } from '../usage/webhooks.js';
import type { QuotaStore } from '../quota/store.js';
import { ackReplicas, fastifyTrustProxy, type GatewaySettings } from '../config/settings.js';
import type { RequestTracing, TracingSettings } from '../observability/tracing.js';

export interface GatewayDeps {
  config: GatewayConfig;
  /** The shared quota store; without it, quotas are kept in this process. */
  redis?: RedisClient;
  /** Where log lines go (tests read them); stdout when unset. */
  logStream?: DestinationStream;
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

type AppSettings = Pick<
  GatewaySettings,
  | 'backendUrl'
  | 'bodyLimit'
  | 'requestTimeoutMs'
  | 'upstreamTimeoutMs'
  | 'trustProxy'
  | 'logLevel'
  | 'logPretty'
  | 'metricsKeyIds'
  | 'quotaLeaseMax'
  | 'keyStore'
  | 'creditsAckReplicas'
  | 'creditsAckTimeoutMs'
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
>;

/**
 * The backend could not be reached or timed out: the request is given back to its windows, its
 * credits and its overage (so neither the access line nor the metric bills it).
 */
function refund(store: QuotaStore, ctx: RequestContext): void {
  if (ctx.consumer && ctx.countedAtMs !== undefined) {
    void store.refund(ctx.consumer.subject, ctx.countedAtMs, ctx.cost, ctx.eventId);
  }
  ctx.overage = undefined;
}

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
    timeoutMs: settings.redisTimeoutMs,
    failClosed: settings.quotaStoreFailure === 'closed',
    ackReplicas: ackReplicas(settings),
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
  const { RequestTracing } = await import('../observability/tracing.js');
  return new RequestTracing({ ...settings, tracingUrl: settings.tracingUrl } satisfies TracingSettings, log);
}

/** The public port's fastify: one access line and lazy request loggers, request ids, timeouts, and the answers made before any hook. */
function publicApp(settings: AppSettings, log: FastifyBaseLogger, raw: RawDeps, frameworkErrors: FastifyServerOptions['frameworkErrors']) {
  return Fastify({
    loggerInstance: log,
    // One access line per request (access-log.ts) instead of fastify's two.
    logController: new LogController({ disableRequestLogging: true }),
    // request.log becomes pino's child only if something logs through it (observability/request-logger.ts).
    childLoggerFactory: (logger, bindings, opts) =>
      new LazyRequestLogger(logger as Logger, bindings, opts.level) as unknown as FastifyBaseLogger,
    genReqId: (req) => requestId(req.headers['x-request-id']),
    trustProxy: fastifyTrustProxy(settings.trustProxy),
    bodyLimit: settings.bodyLimit,
    // Keep-alive requests arriving while closing are still served, in the Error shape if refused.
    return503OnClosing: false,
    // A slow client (headers or body trickled) is cut with 408 once GATEWAY_REQUEST_TIMEOUT_MS
    // has passed, checked every second rather than Node's default 30 s.
    requestTimeout: settings.requestTimeoutMs,
    // A missing Host is refused by the pipeline, in the Error shape, instead of by Node with an empty 400.
    http: {
      requireHostHeader: false,
      headersTimeout: settings.requestTimeoutMs,
      connectionsCheckingInterval: Math.min(1000, settings.requestTimeoutMs),
    },
    clientErrorHandler: clientErrorHandler(raw),
    frameworkErrors,
  });
}

/** Wiring only: logger, metrics, store, then the request pipeline in order, the API document and the proxy. Never listens. */
export async function buildGateway(settings: AppSettings, deps: GatewayDeps): Promise<Gateway> {
  let config = deps.config;
  const current = () => config;
  const metrics = new GatewayMetrics(settings.metricsKeyIds);
  const log: FastifyBaseLogger = createLogger(
    'gateway',
    settings.logLevel,
    settings.logPretty,
    (lines) => metrics.logLinesDropped.inc(lines),
    deps.logStream,
  );
  const store = quotaStore(settings, deps.redis, log, metrics, current);
  metrics.watch(store);
  // Usage events to the billing sink, when the config names one: one exporter per deployment leads.
  const exporter = deps.redis ? new UsageExporter({ redis: deps.redis, config: current, log, metrics: metrics.usage }) : undefined;
  const webhooks = deps.redis ? new WebhookDispatcher({ redis: deps.redis, config: current, log, metrics: metrics.webhooks }) : undefined;
  exporter?.start();
  webhooks?.start();
  // The final status of a request whose usage event was written with its count, joined to it.
  const settle =
    store.settle &&
    ((request: FastifyRequest, status: number) => store.settle!(request.ctx.consumer!.subject, request.ctx.eventId!, status));
  const access = accessLog(metrics, log, settle);
  const tracing = await startTracing(settings, log);
  // Answers without fastify's hooks (framework errors, raw sockets) get their span where their access line is written.
  const record = tracing ? tracing.recording(access.record) : access.record;
  const keys = settings.keyStore === 'redis' && deps.redis ? new KeyRegistry(deps.redis, current, log) : undefined;
  const pipeline = requestPipeline(store, current, record, keys);
  const raw: RawDeps = {
    admitAddress: async (address) => admit(store, config.addressSubject(address)),
    record,
  };

  const app = publicApp(settings, log, raw, pipeline.onFrameworkError);
  installRawHandlers(app.server, raw);
  app.decorateRequest('ctx', null as never);
  app.setErrorHandler(handleError);
  app.addHook('onRequest', pipeline.onRequest);
  if (tracing) app.addHook('onRequest', tracing.onRequest);
  app.addHook('onResponse', access.onResponse);
  if (tracing) app.addHook('onResponse', tracing.onResponse);
  app.addHook('onClose', async () => {
    exporter?.stop();
    webhooks?.stop();
    keys?.close();
    await Promise.all([store.close?.(), tracing?.shutdown()]);
  });
  const document = documentServer(settings.backendUrl, settings.upstreamTimeoutMs);
  app.get(OPENAPI_PATH, async (request) => document(request.ctx.config));
  // The pipeline has authenticated the key and counted the request per address.
  app.get(USAGE_ROUTE.path, async ({ ctx }, reply) => {
    reply.header('cache-control', 'no-store');
    return usageView(ctx.consumer!, await store.peek(ctx.consumer!.subject));
  });
  await registerProxy(app, {
    upstream: settings.backendUrl,
    bodyLimit: settings.bodyLimit,
    timeoutMs: settings.upstreamTimeoutMs,
    upstreamSeconds: (request, seconds) => metrics.upstream(request.ctx.route ?? 'none', seconds),
    failed: ({ ctx }) => refund(store, ctx),
    inject: tracing?.inject,
  });

  return { app, setConfig: (next) => void (config = next), config: current, store, metrics, keys };
}
