import { randomUUID } from 'node:crypto';
import type { Socket } from 'node:net';
import type { Redis } from 'ioredis';
import Fastify, { type FastifyInstance, type FastifyReply, type FastifyRequest, LogController } from 'fastify';
import { authenticate } from './auth.js';
import type { Consumer, GatewayConfig, GatewaySettings } from './config.js';
import { type GatewayErrorCode, GatewayError, handleError, renderError } from './errors.js';
import { rateLimitHeaders } from './headers.js';
import { GatewayMetrics, type RejectionReason } from './metrics.js';
import { loggerOptions } from '../backend/config.js';
import { registerProxy } from './proxy.js';
import { admit } from './quota.js';
import { MemoryQuotaStore, type QuotaStore, type QuotaSubject, RedisQuotaStore } from './quota-store.js';
import { matchRoute, type RouteId } from './routes.js';

declare module 'fastify' {
  interface FastifyRequest {
    /** What the gateway decided about this request; read by the proxy and the access log. */
    gw: { consumer?: Consumer; route?: RouteId; quota?: string };
  }
}

const REQUEST_ID = /^[A-Za-z0-9._:-]{1,128}$/;

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

  /** Counts a request without a key against its address; the headers describe that limit. */
  async function admitAnonymous(ip: string, reply: FastifyReply): Promise<void> {
    await admit(store, reply, anonymous(ip), config.unauthenticated.policy);
  }

  const app = Fastify({
    logger: loggerOptions(settings.logLevel, settings.logPretty),
    // One access line per request (onResponse below) instead of fastify's two.
    logController: new LogController({ disableRequestLogging: true }),
    genReqId: (req) => {
      const given = req.headers['x-request-id'];
      return typeof given === 'string' && REQUEST_ID.test(given) ? given : randomUUID();
    },
    trustProxy: settings.trustProxy,
    bodyLimit: settings.bodyLimit,
    // Keep-alive requests arriving while closing are still served, in the Error shape if refused.
    return503OnClosing: false,
    clientErrorHandler: (err, socket) => onClientError(err, socket),
    frameworkErrors: (err, request, reply) => {
      request.gw = {};
      reply.header('x-request-id', request.id);
      admitAnonymous(request.ip, reply).then(
        () => handleError(err, request, reply),
        (refused) => handleError(refused, request, reply),
      );
    },
  });
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
    // Authentication first, for every path: a caller without a valid key learns nothing of routes.
    const who = authenticate(request.headers.authorization, current);
    if (who instanceof GatewayError) {
      await admitAnonymous(request.ip, reply);
      throw who;
    }
    request.gw.consumer = who;
    const route = matchRoute(request.method, request.url);
    const deprecation = route instanceof GatewayError ? undefined : current.deprecations.get(route.id);
    if (deprecation) reply.headers(deprecation.headers);
    // Every authenticated request counts, whatever its outcome, except one refused with 429.
    const decision = await admit(store, reply, who.subject, who.policy).catch((err: unknown) => {
      request.gw.quota = err instanceof GatewayError ? err.code : 'error';
      throw err;
    });
    request.gw.quota = decision.outcome;
    if (route instanceof GatewayError) throw route;
    request.gw.route = route.id;
    if (deprecation && Date.now() >= deprecation.sunsetMs) {
      throw new GatewayError('route_sunset', `${route.method} ${route.path} was removed on ${deprecation.headers.sunset}`);
    }
  });

  app.addHook('onResponse', async (request, reply) => {
    const { consumer, route, quota } = request.gw ?? {};
    const status = reply.statusCode;
    metrics.request(route ?? 'none', status, consumer?.plan ?? 'none', consumer?.id, rejection(status, quota));
    request.log.info(
      {
        key: consumer?.id,
        plan: consumer?.plan,
        route: route ?? null,
        method: request.method,
        status,
        ms: Math.round(reply.elapsedTime * 10) / 10,
        quota,
      },
      'request',
    );
  });

  await registerProxy(app, {
    upstream: settings.backendUrl,
    bodyLimit: settings.bodyLimit,
    timeoutMs: settings.upstreamTimeoutMs,
    identity: (request) => {
      const c = request.gw.consumer!;
      return { 'x-consumer-id': c.id, 'x-consumer-plan': c.plan };
    },
    upstreamSeconds: (request, seconds) => metrics.upstreamSeconds.observe({ route: request.gw.route ?? 'none' }, seconds),
  });

  /**
   * Errors of the HTTP parser (bad framing, oversized headers) come before fastify has a
   * request; they are answered here, in the Error shape, counted against the address.
   */
  function onClientError(err: Error & { code?: string }, socket: Socket): void {
    if (err.code === 'ECONNRESET' || socket.destroyed) {
      socket.destroy();
      return;
    }
    const code: GatewayErrorCode =
      err.code === 'HPE_HEADER_OVERFLOW'
        ? 'headers_too_large'
        : err.code === 'ERR_HTTP_REQUEST_TIMEOUT'
          ? 'request_timeout'
          : 'bad_request';
    const message =
      code === 'headers_too_large'
        ? 'Request headers are too large'
        : code === 'request_timeout'
          ? 'The request was not received in time'
          : 'Malformed HTTP request';
    const subject = anonymous(socket.remoteAddress ?? 'unknown');
    store.consume(subject).then(
      (d) => write(rateLimitHeaders(d, config.unauthenticated.policy)),
      () => write({}),
    );
    function write(headers: Record<string, string>): void {
      if (!socket.writable) return void socket.destroy();
      const body = renderError(code, message);
      const status = new GatewayError(code, message).status;
      const lines = Object.entries({
        ...headers,
        'content-type': 'application/json; charset=utf-8',
        'cache-control': 'no-store',
        'content-length': String(Buffer.byteLength(body)),
        connection: 'close',
      }).map(([k, v]) => `${k}: ${v}`);
      socket.end(`HTTP/1.1 ${status} ${statusText(status)}\r\n${lines.join('\r\n')}\r\n\r\n${body}`);
    }
  }

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

function rejection(status: number, quota: string | undefined): RejectionReason | undefined {
  if (status === 401) return 'unauthenticated';
  return status === 429 && quota ? REJECTIONS[quota] : undefined;
}

function statusText(status: number): string {
  return { 400: 'Bad Request', 408: 'Request Timeout', 431: 'Request Header Fields Too Large' }[status] ?? 'Error';
}
