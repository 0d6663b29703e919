import { createHash, timingSafeEqual } from 'node:crypto';
import Fastify, { type FastifyBaseLogger, type FastifyInstance, type FastifyRequest, LogController } from 'fastify';
import type { RedisClient } from '../process/redis-client.js';
import { ADMIN_DOCUMENT } from './document.js';
import { registerKeyApi } from './keys.js';
import type { Consumer, GatewayConfig } from '../config/config.js';
import { GatewayError, handleError } from '../http/errors.js';
import { windows } from '../quota/decision.js';
import type { QuotaStore } from '../quota/store.js';

/** What the admin port takes from the settings. */
export interface AdminSettings {
  backendUrl: string;
  adminToken?: string;
  /** The config file the key API edits (the same locked, validated edit as the keys command). */
  configFile?: string;
}

/** What the admin port reads from the running instance. */
export interface AdminParts {
  config: () => GatewayConfig;
  store: QuotaStore;
  /** The Prometheus text: this process's registry, or every worker's, aggregated. */
  metrics: { contentType: string; text(): Promise<string> };
  /** Problems that make this instance unready beyond Redis and the backend (a worker down). */
  problems?: () => string[];
  redis?: RedisClient;
  /** True once shutdown has begun: /readyz then answers 503 so load balancers stop sending. */
  closing: () => boolean;
  log: FastifyBaseLogger;
}

type AdminDeps = AdminSettings & AdminParts;

const digest = (s: string) => createHash('sha256').update(s).digest();

/** Which Redis, in the words of the settings that chose it. */
function redisName(redis: RedisClient): string {
  if ('isCluster' in redis && redis.isCluster) return 'redis (REDIS_CLUSTER_NODES)';
  const { sentinels, name } = (redis as { options: { sentinels?: unknown[] | null; name?: string } }).options;
  return sentinels?.length ? `redis (REDIS_SENTINELS, master ${name})` : 'redis';
}

/** Why Redis is not usable, in an operator's words rather than the client library's. */
async function redisProblems(redis: RedisClient, store: QuotaStore): Promise<string[]> {
  const what = redisName(redis);
  if (redis.status !== 'ready') return [`${what}: not connected (${redis.status}); the gateway keeps trying`];
  // Declared failing by the quota store: no need to wait for a PING's own timeout to say so.
  if (store.degraded) return [`${what}: connected but not answering in time`];
  return redis.ping().then(
    () => [],
    (err: Error) => [/timed out/i.test(err.message) ? `${what}: connected but not answering in time` : `${what}: ${err.message}`],
  );
}

/**
 * The admin surface, on its own port and never on the public one: health, readiness,
 * Prometheus metrics, and a key's usage (behind ADMIN_TOKEN).
 */
export async function buildAdmin(settings: AdminSettings, parts: AdminParts): Promise<FastifyInstance> {
  const deps: AdminDeps = { ...settings, ...parts };
  const app = Fastify({
    loggerInstance: deps.log,
    // One line per request, as on the public port, instead of fastify's two.
    logController: new LogController({ disableRequestLogging: true }),
    return503OnClosing: false,
    frameworkErrors: (err, request, reply) => handleError(err, request, reply),
  });
  app.setErrorHandler(handleError);
  app.addHook('onResponse', async (request, reply) => {
    const ms = Math.round(reply.elapsedTime * 10) / 10;
    request.log.info({ method: request.method, url: request.url, status: reply.statusCode, ms }, 'admin request');
  });
  app.setNotFoundHandler(() => {
    throw new GatewayError('route_not_found', 'No such admin route');
  });
  const token = deps.adminToken ? digest(deps.adminToken) : undefined;
  if (!token) app.log.warn('ADMIN_TOKEN is not set: /admin/* answers 401 to everyone');

  app.get('/healthz', async () => ({ status: 'ok' }));
  app.get('/openapi.json', async () => ADMIN_DOCUMENT);

  app.get('/readyz', async (_request, reply) => {
    const problems: string[] = [];
    if (deps.closing()) problems.push('shutting down');
    problems.push(...(deps.problems?.() ?? []));
    if (deps.redis) {
      problems.push(...(await redisProblems(deps.redis, deps.store)));
    }
    await fetch(`${deps.backendUrl}/healthz`, { signal: AbortSignal.timeout(1000) }).then(
      (res) => {
        if (!res.ok) problems.push(`backend: status ${res.status}`);
      },
      (err: Error) => problems.push(`backend: ${err.cause ? String((err.cause as Error).message) : err.message}`),
    );
    if (problems.length > 0) throw new GatewayError('not_ready', `Not ready: ${problems.join('; ')}`);
    reply.header('cache-control', 'no-store');
    return { status: 'ready', store: deps.redis ? 'redis' : 'memory' };
  });

  app.get('/metrics', async (_request, reply) => {
    reply.type(deps.metrics.contentType);
    return deps.metrics.text();
  });

  const authorize = (request: FastifyRequest) => {
    const given = /^Bearer (\S+)$/i.exec(request.headers.authorization ?? '')?.[1];
    if (!token || !given || !timingSafeEqual(digest(given), token)) {
      throw new GatewayError('unauthorized', token ? 'Admin token missing or wrong' : 'ADMIN_TOKEN is not configured', {
        'www-authenticate': 'Bearer realm="pet-store-admin"',
      });
    }
  };

  /** An account's windows, ban and recent 429s, read from the store the gateway enforces with. */
  async function usageOf(consumer: Consumer) {
    const usage = await deps.store.peek(consumer.subject);
    const iso = (ms: number) => new Date(ms).toISOString();
    const { limits } = consumer.subject;
    const state = windows(limits, usage.nowMs, usage.minuteUsed, usage.dayUsed);
    return {
      account: consumer.account,
      plan: consumer.plan,
      limits,
      windows: Object.fromEntries(
        state.map((w) => [w.name, { used: w.used, remaining: Math.max(0, w.limit - w.used), resetAt: iso(w.resetMs) }]),
      ),
      ban: { active: usage.banUntilMs > 0, until: usage.banUntilMs > 0 ? iso(usage.banUntilMs) : null },
      recentRejections: usage.recentRejections,
      store: deps.redis ? (deps.store.degraded ? 'memory (Redis failing)' : 'redis') : 'memory',
      at: iso(usage.nowMs),
    };
  }

  // A key's usage is its account's: the keys of one account share one quota.
  app.get<{ Params: { id: string } }>('/admin/keys/:id/usage', async (request) => {
    authorize(request);
    const consumer = [...deps.config().consumers.values()].find((c) => c.id === request.params.id);
    if (!consumer) throw new GatewayError('key_not_found', `No key with id "${request.params.id}"`);
    return { id: consumer.id, revoked: consumer.revoked, ...(await usageOf(consumer)) };
  });

  registerKeyApi(app, authorize, deps.configFile);

  app.get<{ Params: { account: string } }>('/admin/accounts/:account/usage', async (request) => {
    authorize(request);
    const members = [...deps.config().consumers.values()].filter((c) => c.account === request.params.account);
    if (members.length === 0) throw new GatewayError('key_not_found', `No key in account "${request.params.account}"`);
    return { keys: members.map((c) => c.id).sort(), ...(await usageOf(members[0]!)) };
  });
  return app;
}
