import type { Redis } from 'ioredis';
import Fastify, {
  type FastifyBaseLogger,
  type FastifyInstance,
  type FastifyReply,
  type FastifyRequest,
  LogController,
} from 'fastify';
import { authenticate } from './auth.js';
import type { Consumer, GatewayConfig, GatewaySettings } from './config.js';
import { GatewayError, handleError } from './errors.js';
import { rateLimitHeaders } from './headers.js';
import { GatewayMetrics, type RejectionReason } from './metrics.js';
import { loggerOptions } from '../runtime/process.js';
import { clientErrorHandler, installRawHandlers, type RawDeps, requestId } from './http-errors.js';
import { registerProxy } from './proxy.js';
import { admit, refusal } from './quota.js';
import { MemoryQuotaStore, type QuotaStore, type QuotaSubject, RedisQuotaStore } from './quota-store.js';
import { matchRoute, type RouteId } from './routes.js';

declare module 'fastify' {
  interface FastifyRequest {
    /** What the gateway decided about this request; read by the proxy and the access log. */
    gw: { consumer?: Consumer; route?: RouteId; quota?: string };
  }
}

export interface GatewayDeps {
  config: GatewayConfig;
  /** The shared quota store; without it, quotas are kept in this process. */
  redis?: Redis;
}

export interface Gateway {
  app: FastifyInstance;
  /** Swaps in a new config; requests already past authentication finish under the old one. */
  setConfig(config: GatewayConfig): void;
  config(): GatewayConfig;
  store: QuotaStore;
  metrics: GatewayMetrics;
}

/** Builds the gateway: hooks in order (request id, auth, quota, route allow-list), then the proxy. Never listens. */
export async function buildGateway(
  settings: Pick<
    GatewaySettings,
    'backendUrl' | 'bodyLimit' | 'upstreamTimeoutMs' | 'trustProxy' | 'logLevel' | 'logPretty' | 'metricsKeyIds'
  >,
  deps: GatewayDeps,
): Promise<Gateway> {
  let config = deps.config;

  const anonymous = (ip: string): QuotaSubject => ({
    key: `${config.keyPrefix}:{a:${ip}}`,
    limits: config.unauthenticated.limits,
    bans: null,
  });

  /** Asks for a decision, puts its headers on the reply and notes it for the access line; throws a 429. */
  async function admitNoting(request: FastifyRequest, reply: FastifyReply, subject: QuotaSubject, policy: string) {
    try {
      request.gw.quota = (await admit(store, reply, subject, policy)).outcome;
    } catch (err) {
      request.gw.quota = err instanceof GatewayError ? err.code : 'error';
      throw err;
    }
  }

  /** Counts a request without a valid key against its address; the headers describe that limit. */
  const admitAnonymous = (request: FastifyRequest, reply: FastifyReply) =>
    admitNoting(request, reply, anonymous(request.ip), config.unauthenticated.policy);

  /** One access line and the metrics, for every answer, whichever path made it. */
  function record(
    log: FastifyBaseLogger,
    e: { method: string; status: number; ms: number; consumer?: Consumer; route?: RouteId; quota?: string },
  ): void {
    metrics.request(e.route ?? 'none', e.status, e.consumer?.plan ?? 'none', e.consumer?.id, rejection(e));
    log.info(
      {
        key: e.consumer?.id,
        plan: e.consumer?.plan,
        route: e.route ?? null,
        method: e.method,
        status: e.status,
        ms: Math.round(e.ms * 10) / 10,
        quota: e.quota,
      },
      'request',
    );
  }

  const raw: RawDeps = {
    admitAddress: async (address) => {
      const decision = await store.consume(anonymous(address));
      return { headers: rateLimitHeaders(decision, config.unauthenticated.policy), refused: refusal(decision) };
    },
    record: ({ reqId, method, status, quota, started }) =>
      record(app.log.child({ reqId }), { method, status, quota, ms: performance.now() - started }),
  };

  const app = Fastify({
    logger: loggerOptions(settings.logLevel, settings.logPretty),
    // One access line per request (onResponse below) instead of fastify's two.
    logController: new LogController({ disableRequestLogging: true }),
    genReqId: (req) => requestId(req.headers['x-request-id']),
    // A hop count trusts that many proxies nearest to the gateway (fastify's types take no number).
    trustProxy:
      typeof settings.trustProxy === 'number'
        ? ((hops: number) => (_addr: string, hop: number) => hop < hops)(settings.trustProxy)
        : settings.trustProxy,
    bodyLimit: settings.bodyLimit,
    // Keep-alive requests arriving while closing are still served, in the Error shape if refused.
    return503OnClosing: false,
    // A missing Host is refused in onRequest, in the Error shape, instead of by Node with an empty 400.
    http: { requireHostHeader: false },
    clientErrorHandler: clientErrorHandler(raw),
    // A URL fastify cannot decode: no route, so no hooks; answered and recorded here.
    frameworkErrors: (err, request, reply) => {
      const started = performance.now(); // fastify starts no reply timer on this path
      request.gw = {};
      reply.header('x-request-id', request.id);
      reply.raw.once('finish', () =>
        record(request.log, {
          method: request.method,
          status: reply.statusCode,
          ms: performance.now() - started,
          quota: request.gw.quota,
        }),
      );
      admitAnonymous(request, reply).then(
        () => handleError(err, request, reply),
        (refused) => handleError(refused, request, reply),
      );
    },
  });
  installRawHandlers(app.server, raw);
  const metrics = new GatewayMetrics(settings.metricsKeyIds, () => ({ degraded: store.degraded, bans: store.activeBans() }));
  const store: QuotaStore = deps.redis
    ? new RedisQuotaStore(deps.redis, app.log, (s) => metrics.redisSeconds.observe(s))
    : new MemoryQuotaStore();
  app.decorateRequest('gw', null as unknown as FastifyRequest['gw']);
  app.setErrorHandler(handleError);

  app.addHook('onRequest', async (request, reply) => {
    request.gw = {};
    reply.header('x-request-id', request.id);
    const current = config;
    if (request.headers.host === undefined && request.raw.httpVersion === '1.1') {
      await admitAnonymous(request, reply);
      throw new GatewayError('bad_request', 'HTTP/1.1 requests need a Host header');
    }
    // Authentication first, for every path: a caller without a valid key learns nothing of routes.
    const who = authenticate(request.headers.authorization, current);
    if (who instanceof GatewayError) {
      await admitAnonymous(request, reply);
      throw who;
    }
    request.gw.consumer = who;
    const route = matchRoute(request.method, request.url);
    const deprecation = route instanceof GatewayError ? undefined : current.deprecations.get(route.id);
    if (deprecation) reply.headers(deprecation.headers);
    // Every authenticated request counts, whatever its outcome, except one refused with 429.
    await admitNoting(request, reply, who.subject, who.policy);
    if (route instanceof GatewayError) throw route;
    request.gw.route = route.id;
    if (deprecation && Date.now() >= deprecation.sunsetMs) {
      throw new GatewayError('route_sunset', `${route.method} ${route.path} was removed on ${deprecation.headers.sunset}`);
    }
  });

  app.addHook('onResponse', async (request, reply) => {
    const { consumer, route, quota } = request.gw ?? {};
    record(request.log, { method: request.method, status: reply.statusCode, ms: reply.elapsedTime, consumer, route, quota });
  });

  await registerProxy(app, {
    upstream: settings.backendUrl,
    bodyLimit: settings.bodyLimit,
    timeoutMs: settings.upstreamTimeoutMs,
    identity: (request) => request.gw.consumer!.upstreamHeaders,
    upstreamSeconds: (request, seconds) => metrics.upstreamSeconds.observe({ route: request.gw.route ?? 'none' }, seconds),
  });

  return {
    app,
    setConfig: (next) => {
      config = next;
    },
    config: () => config,
    store,
    metrics,
  };
}

const REJECTIONS: Record<string, RejectionReason> = {
  rate_limited: 'minute',
  daily_quota_exceeded: 'day',
  key_banned: 'banned',
};

/** Why a request was refused, for the metric: a 401, or a 429 without a key, is "unauthenticated". */
function rejection(e: { status: number; quota?: string; consumer?: Consumer }): RejectionReason | undefined {
  if (e.status === 401 || (e.status === 429 && !e.consumer)) return 'unauthenticated';
  return e.status === 429 && e.quota ? REJECTIONS[e.quota] : undefined;
}
