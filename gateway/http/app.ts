import Fastify, { type FastifyBaseLogger, type FastifyInstance, type FastifyServerOptions, LogController } from 'fastify';
import type { Logger } from 'pino';
import type { GatewayConfig } from '../config/config.js';
import { fastifyTrustProxy, type GatewaySettings } from '../config/settings.js';
import { handleError } from '../errors.js';
import type { accessLog } from '../observability/access-log.js';
import type { GatewayMetrics } from '../observability/metrics.js';
import { LazyRequestLogger } from '../observability/request-logger.js';
import type { RequestTracing } from '../observability/tracing.js';
import type { KeyRegistry } from '../auth/registry-cache.js';
import { admit } from '../quota/admit.js';
import type { QuotaStore } from '../quota/store.js';
import type { RedisClient } from '../redis/client.js';
import { accountStatement } from '../usage/statements.js';
import { usageView } from '../quota/usage-view.js';
import { type PortalParts, portalOff, portalRoutes } from '../portal/routes.js';
import { USAGE_ROUTE } from '../routes.js';
import { documentServer, OPENAPI_PATH } from './openapi.js';
import { type RequestContext, requestPipeline } from './pipeline.js';
import { registerProxy } from './proxy.js';
import { type ConnectionCounts, limitedServer } from './connections.js';
import { clientErrorHandler, installRawHandlers, type RawDeps, requestId } from './raw-answers.js';

// The public port, built from what the wiring (../app.ts) gives it: the request pipeline in
// order, the API document, the usage route and the proxy. It builds no store and starts no loop.

export type PublicSettings = Pick<
  GatewaySettings,
  | 'backendUrl'
  | 'bodyLimit'
  | 'requestTimeoutMs'
  | 'upstreamTimeoutMs'
  | 'trustProxy'
  | 'maxConnections'
  | 'maxInFlight'
  | 'pipelined'
  | 'unreadTimeoutMs'
>;

export interface PublicParts {
  log: FastifyBaseLogger;
  config: () => GatewayConfig;
  store: QuotaStore;
  metrics: GatewayMetrics;
  /** The access line and its metrics, written once per answer. */
  access: ReturnType<typeof accessLog>;
  tracing?: RequestTracing;
  /** The key registry, with KEY_STORE=redis: keys beyond the config file's. */
  keys?: KeyRegistry;
  /** Told of each key refused as unknown (KEY_STORE=file: auth/registry-unread.ts). */
  unknownKey?: () => void;
  /** Where the usage statements are read (usage/statements.ts); none without Redis. */
  redis?: RedisClient;
  /** The usage portal's parts, with Redis; without, /portal says it needs Redis. */
  portal?: PortalParts;
  /** Run when the app closes: what the wiring started for it. */
  close(): Promise<void>;
}

/**
 * The backend could not be reached or timed out: the request is given back to its windows, its
 * credits and its overage (so neither the access line nor the metric bills it).
 */
function refund(store: QuotaStore, ctx: RequestContext): void {
  if (ctx.consumer && ctx.countedAtMs !== undefined) {
    void store.refund(ctx.consumer.subject, ctx.countedAtMs, ctx.cost, ctx.eventId, {
      plan: ctx.consumer.plan,
      route: ctx.route ?? 'none',
    });
  }
  ctx.overage = undefined;
}

/** The public port's fastify: one access line and lazy request loggers, request ids, timeouts, and the answers made before any hook. */
function publicApp(
  settings: PublicSettings,
  log: FastifyBaseLogger,
  raw: RawDeps,
  frameworkErrors: FastifyServerOptions['frameworkErrors'],
  metrics: GatewayMetrics,
) {
  const counts: ConnectionCounts = { open: 0, inFlight: 0 };
  metrics.watchConnections(counts);
  const pushback = (reason: string) => metrics.pushback.inc({ reason });
  return Fastify({
    // Our own http.Server: per-connection pipelines, the caps on connections and requests in progress.
    serverFactory: limitedServer(settings, { record: raw.record, pushback }, counts),
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

/** The public app, hooks in order: pipeline, tracing, access line. Never listens. */
export async function buildPublicApp(settings: PublicSettings, parts: PublicParts): Promise<FastifyInstance> {
  const { store, tracing, metrics } = parts;
  // Answers without fastify's hooks (framework errors, raw sockets) get their span where their access line is written.
  const record = tracing ? tracing.recording(parts.access.record) : parts.access.record;
  const pipeline = requestPipeline(store, parts.config, record, parts.keys, parts.unknownKey);
  const raw: RawDeps = {
    admitAddress: async (address) => admit(store, parts.config().addressSubject(address)),
    record,
  };

  const app = publicApp(settings, parts.log, raw, pipeline.onFrameworkError, metrics);
  installRawHandlers(app.server, raw);
  app.decorateRequest('ctx', null as never);
  app.setErrorHandler(handleError);
  app.addHook('onRequest', pipeline.onRequest);
  if (tracing) app.addHook('onRequest', tracing.onRequest);
  app.addHook('onResponse', parts.access.onResponse);
  if (tracing) app.addHook('onResponse', tracing.onResponse);
  app.addHook('onClose', parts.close);
  const document = documentServer(settings.backendUrl, settings.upstreamTimeoutMs);
  app.get(OPENAPI_PATH, async (request) => document(request.ctx.config));
  // The pipeline has authenticated the key and counted the request per address.
  app.get(USAGE_ROUTE.path, async ({ ctx }, reply) => {
    reply.header('cache-control', 'no-store');
    return usageView(ctx.consumer!, await store.peek(ctx.consumer!.subject));
  });
  app.get<{ Params: { period: string } }>('/v1/me/statements/:period', async ({ ctx, params }, reply) => {
    reply.header('cache-control', 'no-store');
    return accountStatement(parts.redis, ctx.config, ctx.consumer!, params.period);
  });
  if (parts.portal) await app.register(portalRoutes, { ...parts.portal, prefix: '/portal' });
  else await app.register(portalOff, { prefix: '/portal' });
  await registerProxy(app, {
    upstream: settings.backendUrl,
    bodyLimit: settings.bodyLimit,
    timeoutMs: settings.upstreamTimeoutMs,
    upstreamSeconds: (request, seconds) => metrics.upstream(request.ctx.route ?? 'none', seconds),
    failed: ({ ctx }) => refund(store, ctx),
    inject: tracing?.inject,
  });
  return app;
}
